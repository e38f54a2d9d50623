"""Holds a trainer process at a chosen point until its stop is requested, so that a test's
signal lands there on any machine, fast or loaded (a sleep before the signal bet on the
machine's speed: too fast and the point was passed, too slow and it was not reached).

`plant` writes a `sitecustomize.py` into the test's folder, which `test_resume.start`
puts on the trainer's PYTHONPATH (torchrun's workers inherit it): every Python process
the test starts imports it at start-up. It wraps the trainer's method once its module is
imported (not before: importing the trainer there would import torch into every process,
rollout servers and torchrun's agent included). At the point, the wrapper touches the
`held` file, which the test waits for before it signals, and then waits (at most
`LIMIT_S`) until the rank's `stopping()` is true: the signal has reached it there.

- `FINAL_EVALUATION`: `Run.eval_accuracy` of the final model (the cursor past step 0;
  the held-out evaluation before the first step runs at step 0). The evaluation itself
  runs once the stop is requested: it ends in the grace period the signal started.
- `FINAL_CHECKPOINT`: rank 0's `Checkpointing.final`, before it waits for the save in
  flight (the other ranks go on into that wait).
- `WAIT_FOR_ROLLOUTS`: rank 0's wait for a batch (`RolloutPipeline._wait_for_batch`),
  once the test armed it (`arm`: the rollout server is stopped) and the wait has found
  no batch for its first second (its `stopping` is asked only then). Then no batch
  that arrives later (a batch in flight at the server's stop) ends the wait: the stop
  is seen in it for sure.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

FINAL_EVALUATION = "final-evaluation"
FINAL_CHECKPOINT = "final-checkpoint"
WAIT_FOR_ROLLOUTS = "wait-for-rollouts"
LIMIT_S = 120
"""The longest a hold waits for the stop: a test that never signals fails, not hangs."""

_SITECUSTOMIZE = '''\
"""Planted by tests/e2e/trainer_holds.py: holds the trainer at {hold!r}."""

import importlib.abc
import importlib.util
import sys
import time
from pathlib import Path

HOLD = {hold!r}
HELD = Path({held!r})
ARMED = Path({armed!r})
LIMIT_S = {limit}
MODULE = {{
    "final-evaluation": "rlft.trainer.run.loop",
    "final-checkpoint": "rlft.trainer.run.checkpointing",
    "wait-for-rollouts": "rlft.trainer.rollout.pipeline",
}}[HOLD]


def hold(stopping):
    """Says it is held, then waits for the stop (or gives up after LIMIT_S)."""
    HELD.touch()
    deadline = time.monotonic() + LIMIT_S
    while not stopping() and time.monotonic() < deadline:
        time.sleep(0.02)


def patch(module):
    if HOLD == "final-evaluation":
        evaluate = module.Run.eval_accuracy

        def eval_accuracy(self):
            if self.cursor.step > 0:  # the final model's, not the one before step 1
                hold(self.checkpoints.stopping)
            return evaluate(self)

        module.Run.eval_accuracy = eval_accuracy
    elif HOLD == "final-checkpoint":
        final = module.Checkpointing.final

        def final_checkpoint(self, *args, **kwargs):
            if self.dist.is_main:
                hold(lambda: self.stop.requested)  # rank 0's own signal
            return final(self, *args, **kwargs)

        module.Checkpointing.final = final_checkpoint
    else:
        wait = module.RolloutPipeline._wait_for_batch

        def _wait_for_batch(self, stopping=module.never):
            def held():  # asked after each second without a batch
                if ARMED.exists():
                    hold(stopping)
                return stopping()

            return wait(self, held)

        module.RolloutPipeline._wait_for_batch = _wait_for_batch


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds MODULE as the other finders do, and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # once per process; and not to find itself below
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, PatchOnImport())
'''


class Hold:
    """A hold planted in a test's folder."""

    def __init__(self, folder: Path, hold: str):
        self.held = folder / f"{hold}.held"
        self.armed = folder / f"{hold}.armed"
        source = _SITECUSTOMIZE.format(
            hold=hold, held=str(self.held), armed=str(self.armed), limit=LIMIT_S
        )
        (folder / "sitecustomize.py").write_text(source)

    def arm(self) -> None:
        """From now on a wait that finds no batch holds (WAIT_FOR_ROLLOUTS)."""
        self.armed.touch()

    def wait(self, process: subprocess.Popen, timeout: float = 300) -> None:
        """Until the trainer is held (it then waits for its stop)."""
        deadline = time.monotonic() + timeout
        while not self.held.exists():
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the trainer never reached the hold"
            time.sleep(0.02)
