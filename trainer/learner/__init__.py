"""The trainer side of a step on every rank: the models and optimizers (`Learner`), the
gradient of a whole batch accumulated over micro-batches with global normalisers
(`gradients`), and faults planted by tests (`faults`)."""
