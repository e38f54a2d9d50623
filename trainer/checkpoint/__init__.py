"""Sharded, asynchronous, atomically committed checkpoints in object storage.

How the training loop uses it (every rank runs the same calls):

    from rlft.trainer.checkpoint import GracefulStop, checkpointer_from_spec, load
    from rlft.trainer.checkpoint.export import hf_files_of
    from rlft.trainer.checkpoint.errors import NoCheckpointError

    stop = GracefulStop(spec.checkpoint.grace_period_seconds).install()   # main thread
    ckpt = checkpointer_from_spec(
        spec.checkpoint, out / "checkpoints",            # default location when uri unset
        job_config=dump_job(job),                         # hashed into every manifest
        hf_files=hf_files_of(model, tokenizer),           # rank 0: what `rlft export` needs
        on_event=lambda name, info: ...,                  # "committed" | "retry" | "failed"
    )
    start = 0
    if spec.checkpoint.resume != "never" (or --resume given):
        try:
            resumed = load(ckpt.storage, which, model, optimizer)   # which: auto |
            start = resumed.step                          # latest-healthy | a step number
            restore from resumed.extra / resumed.rank_state (RNG states are restored)
        except NoCheckpointError: (fresh start; an explicit --resume must fail instead;
                                   DamagedCheckpointsError is not one: never start afresh)
    for step in range(start + 1, total + 1):
        ... one optimizer step ...
        decision = ckpt.poll(step, stop.requested)       # tiny all-reduce; same on all ranks
        if decision.save:
            ckpt.save(step, model, optimizer,
                      extra={...}, rank_state={...}, policy_version=v, healthy=verdict,
                      wait=decision.stop, emergency=decision.stop,
                      retry_seconds=stop.remaining() if decision.stop else None)
        if decision.stop:
            ckpt.close(); exit 0                           # ExitCode.OK
    ckpt.save(final step, ..., wait=True); ckpt.close()

What goes where:
- `model`, `optimizer`: saved sharded through DCP (get_state_dict), so FSDP2 and plain
  modules work and a different world size can load them.
- `extra` (rank 0's copy, JSON): step, policy version, LR scheduler `state_dict()`,
  data cursor / sampler position, pending-rollout bookkeeping, detector state, anything
  else the run needs; never tensors (a torch.Generator: `rng.generator_state(g)`).
- `rank_state` (per rank, JSON): state that differs between ranks. The global torch /
  Python / NumPy (/ CUDA) RNG states of every rank are captured automatically and
  restored on a resume at the same world size; at another world size they start fresh.
- `healthy`: the collapse detector's verdict for this step (`latest-healthy` and
  retention use it).

Cadence: `poll` says save on multiples of intervalSteps and when intervalMinutes have
passed; while a save is in flight a due one waits (counted in `stats.deferred`). The
loop blocks only while tensors are copied to CPU (`stats.last_blocking_s`). Uploads are
retried in the background for upload_retry_minutes (`stats.upload_retries`, a warning
log line and a "retry" event per retry); `stats` also holds the last committed step.
"""

from rlft.trainer.checkpoint.emergency import GracefulStop
from rlft.trainer.checkpoint.errors import (
    BadUriError,
    CheckpointError,
    DamagedCheckpointsError,
    NoCheckpointError,
    StorageError,
)
from rlft.trainer.checkpoint.factory import checkpointer_from_spec, storage_from_spec
from rlft.trainer.storage.backends import open_storage

__all__ = [
    "BadUriError",
    "CheckpointError",
    "DamagedCheckpointsError",
    "GracefulStop",
    "NoCheckpointError",
    "StorageError",
    "checkpointer_from_spec",
    "load",
    "open_storage",
    "storage_from_spec",
]


def __getattr__(name: str):
    # `load` needs torch; the rest of the package does not, so the operator and the CLI's
    # light commands can import it.
    if name == "load":
        from rlft.trainer.checkpoint.loader import load

        return load
    raise AttributeError(name)
