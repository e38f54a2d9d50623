"""One job's run on every rank: the job runner (`job.run_job`), the one step loop
(`loop`), the batch sources that feed it, the run's state (`state.Cursor`), checkpoints
and resume around the loop, the stability guard, step metrics and progress output."""
