"""SIGTERM after the final checkpoint committed, while the trainer evaluates the final
model and writes the outputs (the held-out evaluation, the model, summary.json, the
upload to spec.checkpoint.uri: minutes on a real job): still a stop in its grace period
with a verdict, not a process the signal kills. The trainer used to stop handling
SIGTERM once the last step's checkpoint was in, so the signal's default action killed
it there without a word (exit -15, no termination message)."""

from __future__ import annotations

import signal

import yaml
from processes import kill_tree
from test_resume import start, write_job
from trainer_holds import FINAL_EVALUATION, Hold

from rlft.trainer import termination
from rlft.trainer.checkpoint.manifest import LATEST, step_dir

STEPS = 3


def test_sigterm_while_the_final_model_is_evaluated_ends_in_grace_with_a_verdict(tmp_path):
    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["trainer"]["steps"] = STEPS
    spec["spec"]["checkpoint"] = {"intervalSteps": 1000, "gracePeriodSeconds": 60}
    job.write_text(yaml.safe_dump(spec))
    # The final evaluation waits for the signal: it lands there however fast the machine.
    hold = Hold(tmp_path, FINAL_EVALUATION)
    process = start(tmp_path, "out")
    try:
        hold.wait(process)
        # The final checkpoint (the only one: no periodic saves) came before.
        latest = tmp_path / "out" / "checkpoints" / LATEST
        assert latest.read_text().strip() == step_dir(STEPS)
        assert not (tmp_path / "out" / "summary.json").exists(), "finished before the signal"
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=90)[0]
    finally:
        kill_tree(process)
    assert process.returncode == 0, output
    verdict = termination.read((tmp_path / "out.termination").read_text())
    assert verdict is not None and verdict.exit_code == 0, (verdict, output)
    assert verdict.completed or verdict.stopped, verdict
    assert verdict.last_checkpoint == STEPS, verdict
