"""How weights travel to rollout instances: the weight store (a Hugging Face folder per
policy version, in object storage or a folder) and the broadcast group (a
torch.distributed group of its own). The publisher that uses them is
`rlft.trainer.rollout.publisher`."""
