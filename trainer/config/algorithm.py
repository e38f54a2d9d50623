"""`spec.algorithm`: which RL (or preference, or supervised) objective runs, and its knobs.

One section per concern, so a recipe reads as a combination of published choices:
GRPO = `name: grpo`; Dr. GRPO = `scaleRewards: none` + `policyLoss.aggregation: constant`;
DAPO = `policyLoss.clipHigh > clipLow` + `dynamicSampling.enabled` + `overlong`;
GSPO = `policyLoss.ratioLevel: sequence` + `aggregation: seq-mean-token-mean`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlft.trainer.config.base import Section

AlgorithmName = Literal["grpo", "rloo", "reinforce++", "ppo", "dpo", "sft"]
BatchSource = Literal["rollouts", "pairs", "examples"]

SOURCES: dict[str, BatchSource] = {
    "grpo": "rollouts",
    "rloo": "rollouts",
    "reinforce++": "rollouts",
    "ppo": "rollouts",
    "dpo": "pairs",
    "sft": "examples",
}
"""What feeds each algorithm's steps: scored rollouts, preference pairs or supervised
examples. Torch-free, so the operator knows which jobs need rollout pods; the algorithm
registry reads it (`rlft.trainer.algorithms.registry`)."""
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "constant"]


class PolicyLossParams(Section):
    """The clipped importance-ratio surrogate shared by grpo, rloo, reinforce++ and ppo."""

    clip_low: float = Field(0.2, gt=0, lt=1)
    """Lower clip of the importance ratio: ratios below 1 - clipLow are clipped."""
    clip_high: float = Field(0.2, gt=0, le=10)
    """Upper clip: ratios above 1 + clipHigh are clipped (DAPO's clip-higher: > clipLow)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """`token`: one ratio per token (PPO/GRPO). `sequence`: GSPO's length-normalised
    sequence ratio exp(mean log-ratio), the stable choice for MoE models."""
    aggregation: Aggregation = "token-mean"
    """Reduction of per-token losses, always with normalisers counted over the whole
    optimizer batch (all micro-batches and ranks): `token-mean` (÷ all completion tokens),
    `seq-mean-token-sum` (per-sequence sums ÷ sequences), `seq-mean-token-mean`
    (per-sequence means ÷ sequences), `constant` (Dr. GRPO: sums ÷ sequences ×
    constantNormalizer). Sequences are all sampled ones, those overlong filtering masks
    out too (as TRL counts them)."""
    constant_normalizer: int | None = Field(None, ge=1, le=10_000_000)
    """Tokens per sequence assumed by `constant` aggregation (default: the rollout's
    maxNewTokens)."""
    epochs: int = Field(1, ge=1, le=64)
    """Optimizer passes over each batch of rollouts (PPO epochs)."""


class KLParams(Section):
    """Regularisation towards a frozen copy of the starting policy."""

    coef: float = Field(0.0, ge=0, le=100)
    """Weight of the KL term (0 disables it and the reference model). RL algorithms only:
    dpo's KL weight is `dpo.beta`, sft has none."""
    estimator: Literal["k1", "k2", "k3", "k3-ratio"] = "k3"
    """Schulman's estimators of KL(policy ‖ reference) per token: `k1` log-ratio,
    `k2` half squared log-ratio, `k3` exp(-x) + x - 1 (unbiased, non-negative; what TRL's
    GRPOTrainer uses by default when beta > 0). `k3-ratio`: k3 × the clipped surrogate's
    importance ratio π/π_old (per token, or per sequence with `ratioLevel: sequence`;
    before clipping, with gradient), as TRL computes it with `use_bias_correction_kl=True`
    (off by default there). Its value is k3's where the ratio is 1, but its gradient gains
    k3·∇log π, making it per token, in expectation, the gradient of KL(policy ‖ reference)
    (on-policy, k3's alone is that of KL(reference ‖ policy)). With `placement: reward` it
    equals k3."""
    placement: Literal["loss", "reward"] = "loss"
    """`loss`: added to the per-token loss. `reward`: subtracted from the reward before
    advantages are computed (no gradient through it)."""


class MismatchParams(Section):
    """Correction for the difference between the rollout engine's probabilities (the
    behaviour policy) and the trainer's, using the log-probs the engine returned."""

    mode: Literal["none", "truncate", "mask"] = "none"
    """`none`: the clip ratio is taken directly against the behaviour log-probs.
    `truncate` (TIS): weight each term by min(π_old/π_behaviour, cap). `mask` (MIS): drop
    terms whose weight exceeds cap or falls below 1/cap; they keep their place in the
    loss's normaliser (a weight of 0), as in TRL and prime-rl, where verl takes them out
    of the response mask (its gradient is then 1/(1 - the dropped fraction) times as
    large)."""
    level: Literal["token", "sequence"] = "token"
    """Weight per token, or one weight per sequence (product of its token weights)."""
    cap: float = Field(2.0, gt=1, le=1e6)
    """Truncation / masking threshold C of the importance weight."""


class DynamicSamplingParams(Section):
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no signal."""

    enabled: bool = False
    """Drop groups with zero reward variance and sample more prompts to refill."""
    max_rounds: int = Field(3, ge=1, le=100)
    """Sampling rounds per step at most; the step trains on what it has after that."""


class OverlongParams(Section):
    """DAPO's treatment of completions cut off at maxNewTokens."""

    filter: bool = False
    """Exclude truncated completions from the loss (their reward is unreliable)."""
    soft_penalty_tokens: int = Field(0, ge=0, le=1_000_000)
    """Length of the soft-penalty buffer L: completions longer than maxNewTokens - L
    lose reward linearly, up to `penalty` at maxNewTokens (0 disables)."""
    penalty: float = Field(1.0, ge=0, le=1000)
    """Reward lost at the maximum length."""


class PPOParams(Section):
    """PPO's critic and generalised advantage estimation."""

    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per token."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE λ: 1 is Monte-Carlo returns, 0 one-step TD."""
    value_clip: float = Field(0.2, gt=0, le=1e6)
    """New values are clipped to within this of the rollout-time values."""
    value_learning_rate: float = Field(1e-3, gt=0, le=1)
    """Peak learning rate of the critic (AdamW, its own optimizer); it warms up with the
    policy's (trainer.warmupSteps) and follows the guard's rate reductions."""


class DPOParams(Section):
    """Direct preference optimisation on (prompt, chosen, rejected) pairs."""

    beta: float = Field(0.1, gt=0, le=100)
    """Inverse temperature of the implicit reward β·log(π/π_ref)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """`sigmoid` (DPO) or `ipo` (squared distance of the margin to 1/(2β))."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Conservative DPO: assumed probability that a pair's label is flipped."""
    pairs_per_step: int = Field(64, ge=1, le=1_000_000)
    """Preference pairs per optimizer step."""


class MoEParams(Section):
    """Mixture-of-experts training terms."""

    router_aux_coef: float = Field(0.0, ge=0, le=100)
    """Weight of the router load-balancing loss. It is computed per forward pass (per
    micro-batch, as in Megatron and transformers) and weighted by the micro-batch's share
    of the batch's tokens, so its total weight is this value however the batch is split;
    its value is not (a nonlinear function of each pass's routing), so with this above 0
    the update depends on microBatchSize and the number of ranks."""


class SFTParams(Section):
    """Supervised warm start on the task's reference answers, before RL."""

    steps: int = Field(150, ge=0, le=1_000_000)
    """Optimizer steps of supervised fine-tuning (0 skips the warm start)."""
    batch_size: int = Field(64, ge=1, le=65536)
    """Examples per SFT step."""
    learning_rate: float = Field(3e-3, gt=0, le=1)
    """Learning rate of the warm start (AdamW, linear warm-up then constant)."""
    warmup_steps: int = Field(50, ge=0, le=1_000_000)
    """Steps of linear learning-rate warm-up."""
    stop_at_accuracy: float | None = Field(None, gt=0, le=1)
    """End the warm start early once greedy exact-match accuracy on a probe of fresh
    training problems (never the held-out ones) reaches this; `steps` stays the cap.
    Leaves RL room to improve whatever the seed."""
    probe_every_steps: int = Field(25, ge=1, le=1_000_000)
    """How often the probe runs when stopAtAccuracy is set."""
    probe_problems: int = Field(256, ge=1, le=100_000)
    """Training problems in each probe."""


class AlgorithmSpec(Section):
    """The training objective and its parameters."""

    name: AlgorithmName = "grpo"
    """`grpo` (group-relative advantages), `rloo` (leave-one-out baseline), `reinforce++`
    (group-mean baseline, batch-normalised), `ppo` (critic + GAE), `dpo` (preference pairs;
    `dpo.loss: ipo` for IPO) or `sft` (supervised only)."""
    group_size: int = Field(8, ge=1, le=1024)
    """Completions sampled per prompt (grpo and rloo need ≥ 2)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """grpo: divide advantages by the group's reward std, the batch's, or not at all."""
    reward_std: Literal["population", "sample"] = "population"
    """grpo with scaleRewards: the std of n rewards divides by n (`population`) or by
    n − 1 (`sample`, Bessel's correction, as TRL's GRPOTrainer does with rewardStdEps
    1e-4). Adam hides most of the difference, but not its weight against the KL term."""
    reward_std_eps: float = Field(1e-6, gt=0, le=1)
    """grpo with scaleRewards: added to the std before dividing, bounding the advantages
    of a group whose rewards barely differ (TRL's GRPOTrainer: 1e-4)."""
    policy_loss: PolicyLossParams = PolicyLossParams()
    """The clipped surrogate (grpo, rloo, reinforce++, ppo)."""
    kl: KLParams = KLParams()
    """KL regularisation to the starting policy."""
    mismatch: MismatchParams = MismatchParams()
    """Train/inference mismatch correction (truncated or masked importance sampling)."""
    dynamic_sampling: DynamicSamplingParams = DynamicSamplingParams()
    """Refill batches with groups that carry signal (DAPO)."""
    overlong: OverlongParams = OverlongParams()
    """Filtering or soft penalty for truncated completions (DAPO)."""
    ppo: PPOParams = PPOParams()
    """Critic and GAE settings (ppo)."""
    dpo: DPOParams = DPOParams()
    """Preference-optimisation settings (dpo)."""
    moe: MoEParams = MoEParams()
    """Mixture-of-experts terms."""
    sft: SFTParams = SFTParams()
    """The supervised warm start that precedes RL. Not used with `name: sft`: that job is
    the supervised training itself, its steps, batch and learning rate spec.trainer's
    (`steps`, `promptsPerStep`, `learningRate`, `warmupSteps`)."""

    @model_validator(mode="after")
    def _check_groups(self) -> AlgorithmSpec:
        if self.name in ("grpo", "rloo") and self.group_size < 2:
            raise ValueError(f"`{self.name}` compares completions of one prompt: groupSize ≥ 2")
        if self.dynamic_sampling.enabled and self.group_size < 2:
            raise ValueError(
                "dynamicSampling keeps groups whose rewards differ, and a group of one "
                "never does (every step would be skipped): groupSize ≥ 2, or disable it"
            )
        # Accepted and ignored, each read as a regulariser that was not there (sft built
        # a whole frozen reference for its kl.coef and never used it).
        if self.name in ("sft", "dpo") and self.kl.coef > 0:
            weight = "dpo.beta is its KL weight" if self.name == "dpo" else "it has no reference"
            raise ValueError(f"kl.coef is for the RL algorithms ({weight}): set it to 0")
        if self.name in ("sft", "dpo") and self.mismatch.mode != "none":
            raise ValueError(
                f"mismatch corrects sampled rollouts, which `{self.name}` does not train on: "
                "set mismatch.mode to none"
            )
        if self.dpo.loss == "ipo" and self.dpo.label_smoothing > 0:
            raise ValueError(
                "dpo.labelSmoothing applies to the sigmoid loss, not ipo: set it to 0 or "
                "use dpo.loss: sigmoid"
            )
        return self
