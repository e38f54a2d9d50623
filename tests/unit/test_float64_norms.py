"""`to_float64` makes the exact gradient checks exact: transformers' RMS norms compute in
float32 whatever the model's dtype, and in a float64 model that rounded each normalised
activation (and each gradient coming back through it) to float32. A norm that is not the
plain RMS norm is left as it is."""

from __future__ import annotations

import pytest
import torch
from tiny_jobs import float64_model

from rlft.trainer.model.build import float32_norms, float64_rms_norms


def float64_reference(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_rms_norm_of_a_float64_model_computes_in_float64(family):
    model = float64_model(family, 40)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) >= 5  # two per layer and the final one (Qwen3 adds q/k norms)
    assert float32_norms(model) == []
    x = torch.randn(3, 7, model.config.hidden_size, dtype=torch.float64)
    for norm in norms:
        if norm.weight.shape[-1] != x.shape[-1]:
            continue  # Qwen3's per-head q/k norms: test_shared_prefix's gradients cover them
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
        got = norm(x)
        assert got.dtype == torch.float64
        assert (got - float64_reference(norm, x)).abs().max() <= 1e-15 * got.abs().max()


def test_a_float32_norm_in_a_float64_model_rounds_and_the_switched_one_does_not():
    model = float64_model("llama", 40)
    original = type(model.model.norm)(model.config.hidden_size, model.config.rms_norm_eps)
    original = original.to(torch.float64)
    x = torch.randn(4, model.config.hidden_size, dtype=torch.float64)
    reference = float64_reference(original, x)
    # What the checks compared before: float32's rounding, 1e-8 and more.
    assert (original(x) - reference).abs().max() > 1e-10 * reference.abs().max()
    assert (model.model.norm(x) - reference).abs().max() <= 1e-15 * reference.abs().max()


class OffsetRMSNorm(torch.nn.Module):
    """Gemma's kind: the weight is an offset from 1; computes in float32."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(size))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1.0 + self.weight.float()) * h).to(x.dtype)


def test_switching_the_norms_leaves_the_callers_random_stream_alone():
    model = float64_model("llama", 40)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    float64_rms_norms(model)  # probes every norm again
    assert torch.equal(torch.rand(3), expected)


def test_a_norm_that_is_not_the_plain_rms_norm_keeps_its_own_forward():
    model = torch.nn.Sequential(OffsetRMSNorm(16)).to(torch.float64)
    x = torch.randn(2, 16, dtype=torch.float64)
    before = model(x)
    float64_rms_norms(model)
    assert "forward" not in vars(model[0])
    assert float32_norms(model) == ["0"]  # what `rlft verify` names in its first line
    assert torch.equal(model(x), before)
