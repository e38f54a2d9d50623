"""The model and its tokenizer: building or loading the policy and PPO's critic
(transformers), the offline tokenizers, and the prompt/answer encoding of a task."""
