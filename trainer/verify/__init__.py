"""`rlft verify`: the job's gradient compared across micro-batching and world size
(`check`), on a batch of real rollouts made the way training makes them (`batch`)."""
