"""`spec.stability`: the collapse detector's thresholds and the actions it may take.

Defaults were chosen on healthy traces of real local runs (bench/traces/) so that they
raise no alarm on them while catching NaN, ≥10× gradient spikes within one step and a
slow entropy collapse within a few steps (`python bench/detector.py` measures this).
No torch import: the operator reads this section too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlft.trainer.config.base import Section


class _Levels(Section):
    def _check_order(self, warning: float, critical: float, higher_is_worse: bool, what: str):
        ok = warning <= critical if higher_is_worse else warning >= critical
        if not ok:
            word = "≤" if higher_is_worse else "≥"
            raise ValueError(f"{what}: the warning level must be {word} the critical level")


class NonFiniteCheck(Section):
    """NaN or ±Inf in any value of a step's record: the update is never applied."""

    ignore: list[str] = Field(
        default_factory=lambda: ["train_accuracy", "eval_accuracy"], max_length=256
    )
    """Record keys allowed to be NaN (e.g. an accuracy that a task cannot measure)."""


class GradNormCheck(_Levels):
    """Gradient-norm spike: robust z-score of log(grad norm) against the rolling median
    and MAD of the last `window` accepted steps."""

    window: int = Field(100, ge=5, le=100_000)
    """Accepted steps the median and MAD are taken over."""
    warmup_steps: int = Field(20, ge=3, le=100_000)
    """Steps observed before spikes are judged (NaN/Inf is judged from the first step)."""
    warning_z: float = Field(4.0, gt=0, le=1000)
    """z-score at which a step is a warning (logged, counted, update applied)."""
    critical_z: float = Field(6.0, gt=0, le=1000)
    """z-score at which a step is critical whatever its size: its update is skipped (see
    `onSpike`)."""
    critical_factor: float = Field(8.0, gt=1, le=1e6)
    """A grad norm at least this many times its rolling median is critical as soon as
    its z-score reaches `warningZ`: large and unusual. Catches 10× spikes in noisy runs
    (healthy tiny runs have a log-scale of up to ~0.45, where 10× scores only ~5)."""
    min_critical_factor: float = Field(5.0, ge=1, le=1e6)
    """A grad norm under this many times its rolling median is never critical, only a
    warning: 2–3× steps occur in healthy RL runs (a steady tiny run had a 2.9× one after
    250 steps) whatever the z-score of a steady history says; clipping bounds them, and
    skipping them would waste batches."""
    min_scale: float = Field(0.1, gt=0, le=10)
    """Floor of the robust scale (1.4826·MAD of log grad norm), so a very steady run
    does not turn a 1.5× wobble into a spike."""

    @model_validator(mode="after")
    def _ordered(self) -> GradNormCheck:
        self._check_order(self.warning_z, self.critical_z, True, "gradNorm")
        return self


class SustainedCheck(Section):
    """Sustained spikes: many flagged steps in a short window mean the run itself is
    diverging, not one bad batch; critical declares collapse."""

    window: int = Field(20, ge=1, le=10_000)
    """Steps looked back over."""
    warning_count: int = Field(3, ge=1, le=10_000)
    """Steps at warning level or worse (any per-step check) that make a warning."""
    critical_count: int = Field(3, ge=1, le=10_000)
    """Steps at critical level (skipped updates) that declare collapse."""

    @model_validator(mode="after")
    def _counts_fit_the_window(self) -> SustainedCheck:
        for name, count in (
            ("warningCount", self.warning_count),
            ("criticalCount", self.critical_count),
        ):
            if count > self.window:
                raise ValueError(
                    f"{name} {count} > window {self.window}: no window of {self.window} steps "
                    "holds that many, so the check could never fire"
                )
        return self


class TrendCheck(_Levels):
    """A slow signal judged by the median of the last `recent` steps against the median
    of the `window` accepted steps before them."""

    recent: int = Field(5, ge=1, le=10_000)
    """Latest steps whose median is compared (smooths single noisy steps)."""
    window: int = Field(100, ge=5, le=100_000)
    """Earlier accepted steps forming the reference median."""
    min_history: int = Field(20, ge=1, le=100_000)
    """Reference steps needed before the check judges anything."""

    @model_validator(mode="after")
    def _history_fits_the_window(self) -> TrendCheck:
        if self.min_history > self.window:
            raise ValueError(
                f"minHistory {self.min_history} > window {self.window}: the reference "
                "never holds that many steps, so the check could never judge"
            )
        return self


class EntropyCheck(TrendCheck):
    """Entropy collapse: the policy turning deterministic much faster than learning
    does. Levels are ratios recent / reference (healthy runs stay above ~0.6)."""

    warning_ratio: float = Field(0.45, gt=0, lt=1)
    """recent/reference entropy at or below which a step is a warning."""
    critical_ratio: float = Field(0.3, gt=0, lt=1)
    """recent/reference entropy at or below which collapse is declared."""
    floor: float = Field(0.0, ge=0, le=100)
    """Absolute mean entropy (nats/token) below which collapse is declared (0: off)."""

    @model_validator(mode="after")
    def _ordered(self) -> EntropyCheck:
        self._check_order(self.warning_ratio, self.critical_ratio, False, "entropy")
        return self


class KLCheck(TrendCheck):
    """KL blow-up: KL to the reference policy jumping far above its recent level."""

    warning_factor: float = Field(5.0, gt=1, le=1e6)
    """recent/reference KL at or above which a step is a warning."""
    critical_factor: float = Field(20.0, gt=1, le=1e6)
    """recent/reference KL at or above which collapse is declared."""
    min_kl: float = Field(0.01, ge=0, le=1000)
    """KL (nats/token) below which no blow-up is declared, whatever the factor."""
    critical_kl: float = Field(10.0, gt=0, le=1e6)
    """Absolute KL (nats/token) that is critical whatever the reference."""

    @model_validator(mode="after")
    def _ordered(self) -> KLCheck:
        self._check_order(self.warning_factor, self.critical_factor, True, "kl")
        return self


class RewardCheck(TrendCheck):
    """Reward collapse: the recent median reward falling far below the reference.
    The drop is measured as (reference − recent) / max(|reference|, minScale)."""

    recent: int = Field(3, ge=1, le=10_000)
    """Latest steps whose median is compared."""
    warning_drop: float = Field(0.5, gt=0, le=100)
    """Relative drop at or above which a step is a warning."""
    critical_drop: float = Field(0.6, gt=0, le=100)
    """Relative drop at or above which collapse is declared."""
    min_scale: float = Field(0.1, gt=0, le=1e6)
    """Smallest reward scale the drop is divided by (rewards near 0)."""

    @model_validator(mode="after")
    def _ordered(self) -> RewardCheck:
        self._check_order(self.warning_drop, self.critical_drop, True, "reward")
        return self


class ImportanceRatioCheck(_Levels):
    """Train/inference mismatch blowing up: extreme per-token importance ratios or a mean
    far from 1. Judged per step; critical skips the update."""

    warning_max: float = Field(10.0, gt=1, le=1e12)
    """Largest token ratio (ratio_max) at which a step is a warning."""
    critical_max: float = Field(1000.0, gt=1, le=1e12)
    """Largest token ratio at which the update is skipped."""
    warning_mean_deviation: float = Field(0.2, gt=0, le=1e6)
    """|ratio_mean − 1| at which a step is a warning."""
    critical_mean_deviation: float = Field(1.0, gt=0, le=1e6)
    """|ratio_mean − 1| at which the update is skipped."""
    warning_masked: float = Field(0.1, gt=0, le=1)
    """Fraction of tokens masked for extreme ratios at which a step is a warning."""
    critical_masked: float = Field(0.5, gt=0, le=1)
    """Fraction of masked tokens at which the update is skipped."""

    @model_validator(mode="after")
    def _ordered(self) -> ImportanceRatioCheck:
        self._check_order(self.warning_max, self.critical_max, True, "importanceRatio max")
        self._check_order(
            self.warning_mean_deviation, self.critical_mean_deviation, True, "importanceRatio mean"
        )
        self._check_order(self.warning_masked, self.critical_masked, True, "importanceRatio masked")
        return self


class ExpertLoadCheck(TrendCheck):
    """MoE expert-load collapse: routing concentrating on few experts. Judged on the
    median of the last `recent` steps (absolute levels, no reference needed)."""

    min_history: int = Field(1, ge=1, le=100_000)
    """Steps needed before the check judges anything."""
    warning_imbalance: float = Field(4.0, gt=1, le=1e6)
    """Max expert load / mean load at which a step is a warning."""
    critical_imbalance: float = Field(8.0, gt=1, le=1e6)
    """Max expert load / mean load at which collapse is declared."""
    warning_dead: float = Field(0.25, gt=0, le=1)
    """Fraction of (almost) unused experts at which a step is a warning."""
    critical_dead: float = Field(0.5, gt=0, le=1)
    """Fraction of (almost) unused experts at which collapse is declared."""

    @model_validator(mode="after")
    def _ordered(self) -> ExpertLoadCheck:
        self._check_order(self.warning_imbalance, self.critical_imbalance, True, "expertLoad")
        self._check_order(self.warning_dead, self.critical_dead, True, "expertLoad dead")
        return self


class DetectorSpec(Section):
    """Thresholds of every check of the collapse detector."""

    non_finite: NonFiniteCheck = NonFiniteCheck()
    """NaN/Inf anywhere in the step's record: critical at once."""
    grad_norm: GradNormCheck = GradNormCheck()
    """Gradient-norm spikes (per step)."""
    sustained: SustainedCheck = SustainedCheck()
    """Repeated per-step alarms."""
    entropy: EntropyCheck = EntropyCheck()
    """Entropy collapse."""
    kl: KLCheck = KLCheck()
    """KL blow-up."""
    reward: RewardCheck = RewardCheck()
    """Reward collapse."""
    importance_ratio: ImportanceRatioCheck = ImportanceRatioCheck()
    """Importance-ratio blow-up (per step)."""
    expert_load: ExpertLoadCheck = ExpertLoadCheck()
    """MoE expert-load collapse."""


class StabilitySpec(Section):
    """Collapse detection from per-step telemetry, and what to do about it."""

    on_collapse: Literal["rollback", "suspend", "fail", "alert"] = "rollback"
    """Action when the detector declares collapse: `rollback` in-process to the last
    healthy checkpoint, `suspend` (pause the job), `fail`, or only `alert`."""
    on_spike: Literal["skip", "alert"] = "skip"
    """Action on a critical per-step alarm (gradient spike, importance-ratio blow-up):
    `skip` zeroes that update before optimizer.step(); `alert` applies it. A NaN/Inf
    update is skipped either way (applied, it would make every weight NaN)."""
    max_rollbacks: int = Field(3, ge=0, le=1000)
    """Rollbacks allowed; the next collapse takes `afterMaxRollbacks`."""
    after_max_rollbacks: Literal["suspend", "fail"] = "fail"
    """What a collapse does once `maxRollbacks` rollbacks have been made."""
    rollback_lr_scale: float = Field(0.5, gt=0, le=1)
    """Factor applied to the learning rate at each rollback (1 keeps it)."""
    skip_data_window: bool = True
    """On rollback, skip the data between the restored checkpoint and the collapse
    (the data and sampling streams go on from where they are); false trains on that
    window again (the streams as the checkpoint had them)."""
    detector: DetectorSpec = DetectorSpec()
    """Thresholds of the collapse detector's checks."""
