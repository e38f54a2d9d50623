"""DPO and IPO on (chosen, rejected) preference pairs, against a frozen reference."""

from __future__ import annotations

from rlft.trainer.algorithms.batch import SequenceBatch
from rlft.trainer.algorithms.losses import preference_losses, token_logprobs
from rlft.trainer.algorithms.objectives import (
    Models,
    Prepared,
    count,
    expert_sums,
    forward,
    masked,
    router_term,
)
from rlft.trainer.algorithms.registry import Algorithm, register
from rlft.trainer.config.algorithm import AlgorithmSpec

TEMPERATURE = 1.0
"""Temperature of every DPO log-prob: the policy's in the loss and the reference's in the
batch. DPO's implicit reward β·log(π/π_ref) compares the models' own distributions, not
the rollout sampler's; the two sides must also agree, or an untrained policy (π = π_ref)
starts with a non-zero margin."""


class Preference:
    """DPO / IPO on rows ordered (chosen, rejected) per pair."""

    unit = 2

    def __init__(self, spec: AlgorithmSpec):
        self.spec = spec

    def prepare(self, models: Models, micro: SequenceBatch) -> Prepared:
        return {}

    def loss(self, models, micro, prepared, norms):
        dpo = self.spec.dpo
        fwd = forward(models.policy, micro)
        logp = masked(token_logprobs(fwd.logits, micro.targets, TEMPERATURE), micro.mask)
        ref = masked(micro.ref_logp, micro.mask)
        summed, ref_summed = logp.sum(-1), ref.sum(-1)
        if dpo.loss == "ipo":  # IPO compares length-normalised log-probs
            lengths = micro.mask.sum(-1).clamp(min=1)
            summed, ref_summed = summed / lengths, ref_summed / lengths
        pair_loss, margin = preference_losses(
            summed[0::2],
            summed[1::2],
            ref_summed[0::2],
            ref_summed[1::2],
            dpo.beta,
            dpo.loss,
            dpo.label_smoothing,
        )
        real = (micro.mask.sum(-1)[0::2] > 0).to(pair_loss.dtype)
        loss = (pair_loss * real).sum() / count(norms.pairs, "preference pairs")
        loss = loss + router_term(fwd, micro, norms, self.spec.moe.router_aux_coef)
        sums = {
            "loss": loss.item(),
            "margin": (margin * real).sum().item(),
            "preference_accuracy": ((margin > 0).to(real.dtype) * real).sum().item(),
        }
        return loss, sums | expert_sums(fwd)


ENTRY = register(Algorithm("dpo", lambda spec, *_: Preference(spec), reference=True))
