"""Pure loss and advantage functions over tensors: no models, no I/O."""
