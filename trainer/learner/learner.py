"""The trainer side of a step, on every rank: take this rank's shard of the batch,
accumulate the whole batch's gradient, clip, apply; then publish the new weights to the
rollout engine (rank 0's unsharded copy when the policy is sharded).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlft.trainer.algorithms.batch import SequenceBatch, rank_shard
from rlft.trainer.algorithms.objectives import Models
from rlft.trainer.config import TrainerSpec
from rlft.trainer.distributed import Dist
from rlft.trainer.distributed.fsdp import shard_model
from rlft.trainer.learner import faults
from rlft.trainer.learner.gradients import (
    backward,
    clip_and_norm,
    clip_to_norm,
    group_grad_norms,
    plan_step,
)
from rlft.trainer.stability.actions import GuardDecision


@dataclass
class StepResult:
    stats: dict[str, float] = field(default_factory=dict)
    grad_norm: float = 0.0
    applied: bool = True
    reason: str = ""
    group_norms: dict[str, float] = field(default_factory=dict)
    """Gradient norm per parameter group before clipping (first epoch)."""
    decision: GuardDecision = field(default_factory=lambda: GuardDecision(0, "apply", "ok", 0))
    """What the stability guard decided for this update (apply, skip, rollback, …)."""
    dropped_epochs: int = 0
    """Epochs after the first not applied for a non-finite gradient (those before stand)."""
    critic_grad_norm: float | None = None
    """PPO: the critic's gradient norm before clipping (the last epoch's)."""
    critic_skipped_epochs: int = 0
    """PPO: epochs whose critic update was dropped for a non-finite gradient."""

    @property
    def action(self) -> str:
        return self.decision.action


class Learner:
    """Owns the models of the run (the trained policy and critic with their optimizers,
    the frozen reference) and rank 0's unsharded copy of the policy for sampling."""

    def __init__(
        self,
        policy: torch.nn.Module,
        trainer: TrainerSpec,
        dist: Dist,
    ):
        self.dist = dist
        self.trainer = trainer
        # Rank 0 samples with an unsharded copy when the policy is sharded; in a single
        # process the engine shares the policy itself, so its weights are always current.
        self.engine_model = copy.deepcopy(policy) if dist.active and dist.is_main else policy
        self.engine_current = True
        """Whether rank 0's engine model holds the policy's latest weights (the same on
        every rank: every rank steps, and syncs, at the same points)."""
        self.models = Models(shard_model(policy, trainer.parallelism, dist))
        self.optimizer = self._adamw(self.models.policy, trainer.learning_rate)
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.critic_lr = 0.0
        """The critic's peak learning rate (its schedule follows the policy's)."""
        self.reference: torch.nn.Module | None = None
        """A frozen copy of the policy (KL terms, DPO), on every rank so that
        checkpoints are alike; rank 0 scores batches with it."""
        self.planted = faults.planted_from_env()

    def _adamw(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=lr, weight_decay=self.trainer.weight_decay)

    def attach_critic(self, critic: torch.nn.Module, lr: float) -> None:
        """PPO's critic, built once the policy it starts from is final (after SFT)."""
        self.models.critic = shard_model(critic, self.trainer.parallelism, self.dist)
        self.critic_optimizer = self._adamw(self.models.critic, lr)
        self.critic_lr = lr

    def reset_optimizer(self, lr: float) -> None:
        """A fresh optimizer (new phase, e.g. RL after the warm start). The last phase's
        gradients go with the old one: left on the parameters, a checkpoint saved before
        the new phase's first backward (its first batches dropped, a SIGTERM at step 1)
        held an optimizer without its moments (torch skips initialising its state where
        a gradient exists), which no resume could load."""
        self.models.policy.zero_grad(set_to_none=True)
        self.optimizer = self._adamw(self.models.policy, lr)

    def set_lr(self, lr: float, scale: float = 1.0) -> None:
        """The policy's learning rate for the next update; the critic's is its peak times
        `scale`, the same warm-up and guard multiplier (a critic at full rate from step 1
        fits values to the untrained policy's returns while the policy barely moves)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.critic_optimizer is not None:
            for group in self.critic_optimizer.param_groups:
                group["lr"] = self.critic_lr * scale

    def step(
        self,
        objective,
        batch: SequenceBatch,
        epochs: int = 1,
        judge: Callable[[StepResult], GuardDecision] | None = None,
        step: int | None = None,
    ) -> StepResult:
        """`epochs` optimizer steps over `batch` (which every rank holds whole).

        `judge` sees the first epoch's gradient statistics after clipping and before the
        optimizer step, and returns the guard's verdict: `apply`, or another action
        (skip, rollback, pause, fail), in which case no update is applied at all; every
        rank must get the same verdict. The result carries it for the loop to act on.
        """
        self.models.policy.train()
        shard = rank_shard(batch, self.dist.rank, self.dist.world, objective.unit)
        plan = plan_step(
            objective, self.models, shard, batch, self.trainer.micro_batch_size, self.dist
        )
        if plan.norms.tokens <= 0:
            return StepResult(applied=False, reason="no trainable tokens in the batch")
        result = StepResult()
        for epoch in range(epochs):
            self._zero_grad()
            stats = backward(objective, self.models, plan, self.dist)
            stats |= {"norm_tokens": plan.norms.tokens, "norm_pairs": plan.norms.pairs}
            if self.planted and step is not None:
                faults.apply(self.planted, step, self.models.policy.parameters())
            groups = group_grad_norms(self.models.policy, self.dist)
            grad_norm = math.sqrt(sum(norm * norm for norm in groups.values()))
            clip_to_norm(list(self.models.policy.parameters()), self.trainer.grad_clip, grad_norm)
            if epoch > 0 and not math.isfinite(grad_norm):
                # The epochs before it changed the weights, and that update stands (a
                # new policy version); this epoch and those after it are dropped.
                self._zero_grad()
                result.dropped_epochs = epochs - epoch
                break
            result.stats, result.grad_norm = stats, grad_norm  # the last applied epoch's
            if epoch == 0:
                result.group_norms = groups
                if judge is not None:
                    result.decision = judge(result)
                elif not math.isfinite(grad_norm):  # unguarded (a warm start): skipped
                    reasons = ["non-finite gradient"]
                    result.decision = GuardDecision(step or 0, "skip", "warning", 1, reasons)
                if result.action != "apply":
                    self._zero_grad()
                    result.applied, result.reason = False, result.action
                    break
            self.optimizer.step()
            self.engine_current = not self.dist.active  # one process samples the policy itself
            if self.critic_optimizer is not None:
                self._critic_step(result)
        return result

    def _critic_step(self, result: StepResult) -> None:
        """The critic's update beside the policy's. The guard judges the policy's gradient
        only, so a non-finite value gradient (a return far out of the critic's range) is
        dropped here: applied, it made every critic weight NaN, and every advantage after
        it. The norm is global, so every rank drops the same update."""
        assert self.critic_optimizer is not None and self.models.critic is not None
        norm = clip_and_norm(list(self.models.critic.parameters()), self.trainer.grad_clip)
        result.critic_grad_norm = norm
        if math.isfinite(norm):
            self.critic_optimizer.step()
        else:
            self.critic_optimizer.zero_grad(set_to_none=True)
            result.critic_skipped_epochs += 1

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)

    def freeze_reference(self) -> None:
        """The frozen reference: a copy of the current policy (collective when sharded).
        Ranks other than 0 hold only their shards, so every rank builds the copy from
        the model's config and the full state."""
        state = self.full_policy_state()
        self.reference = _same_model(self.engine_model, state).eval()
        for parameter in self.reference.parameters():
            parameter.requires_grad_(False)

    def sync_engine_model(self) -> None:
        """Copy the new weights into rank 0's unsharded engine model (collective when
        sharded; a single process samples from the policy itself)."""
        if not self.dist.active:
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.models.policy, options=options)
        if self.dist.is_main:
            self.engine_model.load_state_dict(state)
        self.engine_current = True

    def refresh_engine_model(self) -> None:
        """`sync_engine_model` when an update since the last sync left the engine model
        behind: only what samples, evaluates or saves from it pays for the gather (each
        step while generating; once per probe and at the end of a warm start). Every rank
        calls it at the same point."""
        if not self.engine_current:
            self.sync_engine_model()

    def full_policy_state(self) -> dict[str, torch.Tensor]:
        """The whole policy state on every rank (collective when sharded)."""
        if not self.dist.active:
            return self.models.policy.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(
            self.models.policy, options=StateDictOptions(full_state_dict=True)
        )


def _same_model(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A new, unsharded model of `model`'s architecture holding `state`."""
    if not isinstance(next(iter(state.values()), None), torch.Tensor):
        raise ValueError("the policy state is empty")
    from transformers import AutoModelForCausalLM

    from rlft.trainer.model.construct import from_config

    dtype = next(iter(state.values())).dtype
    copy_ = from_config(AutoModelForCausalLM, model.config, dtype=dtype)
    copy_.load_state_dict(state)
    return copy_
