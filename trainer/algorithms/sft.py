"""SFT: the negative log-likelihood of reference answers (the job's algorithm with
`name: sft`, and the warm start before RL)."""

from __future__ import annotations

from rlft.trainer.algorithms.aggregation import aggregate
from rlft.trainer.algorithms.batch import SequenceBatch
from rlft.trainer.algorithms.losses import token_logprobs
from rlft.trainer.algorithms.objectives import Models, Prepared, expert_sums, forward, router_term
from rlft.trainer.algorithms.registry import Algorithm, register
from rlft.trainer.config.algorithm import AlgorithmSpec


class Supervised:
    """SFT: token-mean negative log-likelihood of the masked (answer) tokens."""

    unit = 1

    def __init__(self, spec: AlgorithmSpec):
        self.spec = spec

    def prepare(self, models: Models, micro: SequenceBatch) -> Prepared:
        return {}

    def loss(self, models, micro, prepared, norms):
        fwd = forward(models.policy, micro)
        nll = -token_logprobs(fwd.logits, micro.targets)
        loss = aggregate(nll, micro.mask, "token-mean", norms)
        loss = loss + router_term(fwd, micro, norms, self.spec.moe.router_aux_coef)
        return loss, {"loss": loss.item()} | expert_sums(fwd)


ENTRY = register(Algorithm("sft", lambda spec, *_: Supervised(spec)))
