"""rlft trainer: config, algorithms, rollout, local runs."""
