"""The step's progress line (what `rlft train` prints per step)."""

from __future__ import annotations

from types import SimpleNamespace

from rlft.trainer.run.loop import _progress_line


def test_the_progress_line_says_why_an_update_was_skipped():
    """metrics.jsonl had the reason; the line said only `loss nan` (or raised for DPO's,
    which reads the margin of a step that has none)."""
    phase = SimpleNamespace(source=SimpleNamespace(describe=lambda r: f"loss {r['loss']:.1f}"))
    reason = "no informative groups were sampled"
    assert _progress_line(phase, {"skip_reason": reason}) == f"update skipped: {reason}"
    record = {"loss": 2.0, "skip_reason": "skip"}
    assert _progress_line(phase, record) == "loss 2.0 (update skipped: skip)"
    assert _progress_line(phase, {"loss": 2.0}) == "loss 2.0"


def test_an_rl_step_without_an_accuracy_shows_none():
    """A job whose rewards hold no exact_match term has no train accuracy: the line said
    `acc nan` on every step."""
    from rlft.trainer.run.sources import RolloutSource

    record = {"reward_mean": 0.5, "loss": 0.25, "grad_norm": 1.0}
    assert RolloutSource().describe(record) == "reward 0.500 loss +0.2500 gnorm 1.000"
    line = RolloutSource().describe(record | {"train_accuracy": 0.75})
    assert line == "reward 0.500 acc 0.75 loss +0.2500 gnorm 1.000"
