"""Weight publication from trainer rank 0 to the rollout instances: `store` (a Hugging
Face folder per policy version, then POST /weights) and `broadcast` (a torch.distributed
group of its own)."""
