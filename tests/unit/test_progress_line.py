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
