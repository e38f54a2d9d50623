"""The collapse detector: a pure function of the stream of per-step records.

`Detector.observe(record)` takes one step's record (the dict the loop writes to
metrics.jsonl: floats, plus optional dicts of floats such as per-group grad norms) and
returns a `Verdict`. Its whole state is plain JSON-able data (`state_dict()`), saved in
every checkpoint so a resumed or rolled-back run judges exactly as before.

Checks (thresholds in `spec.stability.detector`, see `rlft.trainer.config.stability`):

| check | signal | kind | critical means |
|---|---|---|---|
| non_finite | any value in the record (minus `ignore`) | step | NaN/Inf: skip at once |
| grad_norm_spike | robust z of log grad_norm vs rolling median/MAD | step | skip |
| importance_ratio_blowup | ratio_max, abs(ratio_mean-1), ratio_masked_fraction | step | skip |
| sustained_spikes | count of flagged steps in a window | trend | collapse |
| entropy_collapse | median of recent entropy / reference median | trend | collapse |
| kl_blowup | median of recent kl / reference median, or kl itself | trend | collapse |
| reward_collapse | relative drop of recent median reward | trend | collapse |
| expert_load_collapse | expert_imbalance_max, expert_dead_fraction | trend | collapse |

"step" checks judge one update: a critical one means that update must not be applied,
and its values never enter the rolling statistics (a spike cannot raise the bar for the
next one). "trend" checks judge the run: critical means collapse. A trend signal at
critical level is also kept out of its reference, so a collapsed run stays flagged
instead of the reference drifting down to meet it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rlft.trainer.config.stability import DetectorSpec, TrendCheck

OK, WARNING, CRITICAL = 0, 1, 2
STEP_CHECKS = ("non_finite", "grad_norm_spike", "importance_ratio_blowup")
TREND_CHECKS = (
    "sustained_spikes",
    "entropy_collapse",
    "kl_blowup",
    "reward_collapse",
    "expert_load_collapse",
)
CHECKS = STEP_CHECKS + TREND_CHECKS
_MAD_TO_SIGMA = 1.4826
_ZERO_GRAD = 1e-10


@dataclass
class Verdict:
    """What the detector concluded about one step."""

    step: int
    levels: dict[str, int]
    """Level (0 ok, 1 warning, 2 critical) of every check."""
    reasons: list[str] = field(default_factory=list)
    """One human line per check at warning level or worse."""
    zscore: float | None = None
    """Robust z-score of log grad norm (None during warm-up or without a grad norm)."""

    @property
    def level(self) -> int:
        return max(self.levels.values(), default=OK)

    @property
    def skip_update(self) -> bool:
        """A per-step check is critical: this update must not be applied."""
        return any(self.levels[c] >= CRITICAL for c in STEP_CHECKS)

    @property
    def collapsed(self) -> bool:
        """A trend check is critical: the run has collapsed."""
        return any(self.levels[c] >= CRITICAL for c in TREND_CHECKS)

    @property
    def health(self) -> str:
        if self.collapsed:
            return "collapsed"
        return "warning" if self.level >= WARNING else "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "levels": dict(self.levels),
            "reasons": list(self.reasons),
            "zscore": self.zscore,
            "health": self.health,
        }


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def non_finite_keys(record: dict[str, Any], ignore: list[str]) -> list[str]:
    """Keys (dotted for nested dicts) whose numeric value is NaN or ±Inf."""
    bad = []
    for key, value in record.items():
        if key in ignore:
            continue
        if isinstance(value, dict):
            bad += [f"{key}.{k}" for k, v in value.items() if _is_number(v) and not _finite(v)]
        elif _is_number(value) and not _finite(value):
            bad.append(key)
    return bad


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def robust_z(history: list[float], value: float, min_scale: float) -> float:
    """(value − median) / max(1.4826·MAD, min_scale)."""
    median = statistics.median(history)
    mad = statistics.median(abs(x - median) for x in history)
    return (value - median) / max(_MAD_TO_SIGMA * mad, min_scale)


def _level(value: float, warning: float, critical: float, higher_is_worse: bool = True) -> int:
    if higher_is_worse:
        return CRITICAL if value >= critical else WARNING if value >= warning else OK
    return CRITICAL if value <= critical else WARNING if value <= warning else OK


class Detector:
    """Stateful over steps, pure over data: same records in, same verdicts out."""

    def __init__(self, spec: DetectorSpec | None = None):
        self.spec = spec or DetectorSpec()
        s = self.spec
        self.steps_seen = 0
        self.log_grad = deque(maxlen=s.grad_norm.window)
        self.entropy = deque(maxlen=s.entropy.window + s.entropy.recent)
        self.kl = deque(maxlen=s.kl.window + s.kl.recent)
        self.reward = deque(maxlen=s.reward.window + s.reward.recent)
        self.expert_imbalance = deque(maxlen=s.expert_load.recent)
        self.expert_dead = deque(maxlen=s.expert_load.recent)
        self.flags = deque(maxlen=s.sustained.window)
        """Per-step worst level of the step checks, for the sustained check."""

    # ------------------------------------------------------------------ checks

    def _grad_norm(self, record: dict, levels: dict, reasons: list) -> tuple[float | None, float]:
        value = record.get("grad_norm")
        if not _finite(value) or value <= _ZERO_GRAD:
            # A zero gradient (every group's rewards equal: zero advantages) says nothing
            # about the scale of the next one; it stays out of the statistics.
            return None, math.nan
        x = math.log(float(value))
        spec = self.spec.grad_norm
        if self.steps_seen < spec.warmup_steps or len(self.log_grad) < 3:
            return None, x
        z = robust_z(list(self.log_grad), x, spec.min_scale)
        factor = math.exp(x - statistics.median(self.log_grad))
        level = _level(z, spec.warning_z, spec.critical_z)
        if level == WARNING and factor >= spec.critical_factor:
            level = CRITICAL  # large and unusual, even if the run is noisy
        elif (
            level == CRITICAL
            and factor < spec.critical_factor
            and z / (1 + 3 / len(self.log_grad)) < spec.critical_z
        ):
            # Critical on the z-score alone: a MAD from few steps (just after the warm-up)
            # often underestimates the spread, so the z must clear the bar with a
            # (1 + 3/n) wider scale; a 3× wobble of a noisy run is then a warning.
            level = WARNING
        if level == CRITICAL and factor < spec.min_critical_factor:
            level = WARNING
        levels["grad_norm_spike"] = level
        if level:
            median = value / factor
            reasons.append(
                f"grad norm {value:.4g} is {factor:.1f}× its rolling median {median:.4g} "
                f"(robust z {z:.1f})"
            )
        return z, x

    def _importance_ratio(self, record: dict, levels: dict, reasons: list) -> None:
        spec = self.spec.importance_ratio
        found = OK
        if _finite(record.get("ratio_max")):
            level = _level(record["ratio_max"], spec.warning_max, spec.critical_max)
            if level:
                reasons.append(f"largest importance ratio {record['ratio_max']:.4g}")
            found = max(found, level)
        if _finite(record.get("ratio_mean")):
            deviation = abs(record["ratio_mean"] - 1.0)
            level = _level(deviation, spec.warning_mean_deviation, spec.critical_mean_deviation)
            if level:
                reasons.append(f"mean importance ratio {record['ratio_mean']:.4g} (far from 1)")
            found = max(found, level)
        if _finite(record.get("ratio_masked_fraction")):
            level = _level(
                record["ratio_masked_fraction"], spec.warning_masked, spec.critical_masked
            )
            if level:
                reasons.append(
                    f"{record['ratio_masked_fraction']:.1%} of tokens masked for extreme ratios"
                )
            found = max(found, level)
        levels["importance_ratio_blowup"] = found

    @staticmethod
    def _split(history: deque, value: float, spec: TrendCheck) -> tuple[list, list] | None:
        """(reference, recent) once enough reference history exists."""
        values = [*history, value]
        recent, reference = values[-spec.recent :], values[: -spec.recent]
        if len(reference) < spec.min_history:
            return None
        return reference, recent

    def _entropy(self, record: dict, levels: dict, reasons: list) -> None:
        value = record.get("entropy")
        if not _finite(value):
            return
        spec = self.spec.entropy
        level = OK
        if spec.floor and value < spec.floor:
            level = CRITICAL
            reasons.append(f"entropy {value:.4g} below the floor {spec.floor}")
        split = self._split(self.entropy, value, spec)
        if split:
            reference, recent = (statistics.median(part) for part in split)
            ratio = recent / reference if reference > 0 else 1.0
            by_ratio = _level(ratio, spec.warning_ratio, spec.critical_ratio, higher_is_worse=False)
            if by_ratio:
                reasons.append(
                    f"entropy fell to {ratio:.2f}× its reference ({recent:.4g} vs {reference:.4g})"
                )
            level = max(level, by_ratio)
        levels["entropy_collapse"] = level

    def _kl(self, record: dict, levels: dict, reasons: list) -> None:
        value = record.get("kl")
        if not _finite(value):
            return
        spec = self.spec.kl
        level = CRITICAL if value >= spec.critical_kl else OK
        split = self._split(self.kl, value, spec)
        if split:
            reference, recent = (statistics.median(part) for part in split)
            if recent >= spec.min_kl:
                factor = recent / max(reference, spec.min_kl)
                level = max(level, _level(factor, spec.warning_factor, spec.critical_factor))
        if level:
            reasons.append(f"KL {value:.4g} nats/token blew up")
        levels["kl_blowup"] = level

    def _reward(self, record: dict, levels: dict, reasons: list) -> None:
        value = record.get("reward_mean")
        if not _finite(value):
            return
        spec = self.spec.reward
        split = self._split(self.reward, value, spec)
        if not split:
            return
        reference, recent = (statistics.median(part) for part in split)
        drop = (reference - recent) / max(abs(reference), spec.min_scale)
        levels["reward_collapse"] = _level(drop, spec.warning_drop, spec.critical_drop)
        if levels["reward_collapse"]:
            reasons.append(f"reward fell from {reference:.4g} to {recent:.4g} ({drop:.0%} drop)")

    def _expert_load(self, record: dict, levels: dict, reasons: list) -> None:
        spec = self.spec.expert_load
        level = OK
        for key, history, warning, critical, what in (
            (
                "expert_imbalance_max",
                self.expert_imbalance,
                spec.warning_imbalance,
                spec.critical_imbalance,
                "expert load imbalance",
            ),
            (
                "expert_dead_fraction",
                self.expert_dead,
                spec.warning_dead,
                spec.critical_dead,
                "fraction of unused experts",
            ),
        ):
            if not _finite(record.get(key)):
                continue
            recent = [*history, record[key]][-spec.recent :]
            if len(recent) < min(spec.min_history, spec.recent):
                continue
            median = statistics.median(recent)
            found = _level(median, warning, critical)
            if found:
                reasons.append(f"{what} {median:.3g}")
            level = max(level, found)
        levels["expert_load_collapse"] = level

    # ----------------------------------------------------------------- observe

    def observe(self, record: dict[str, Any]) -> Verdict:
        """Judge one step and fold it into the rolling state."""
        step = int(record.get("step", self.steps_seen + 1))
        levels = dict.fromkeys(CHECKS, OK)
        reasons: list[str] = []
        bad = non_finite_keys(record, self.spec.non_finite.ignore)
        if bad:
            levels["non_finite"] = CRITICAL
            reasons.append(f"non-finite values in {', '.join(bad)}")
        zscore, log_grad = self._grad_norm(record, levels, reasons)
        self._importance_ratio(record, levels, reasons)
        self._entropy(record, levels, reasons)
        self._kl(record, levels, reasons)
        self._reward(record, levels, reasons)
        self._expert_load(record, levels, reasons)

        step_level = max(levels[c] for c in STEP_CHECKS)
        self.flags.append(step_level)
        sustained = self.spec.sustained
        criticals = sum(f >= CRITICAL for f in self.flags)
        flagged = sum(f >= WARNING for f in self.flags)
        if criticals >= sustained.critical_count:
            levels["sustained_spikes"] = CRITICAL
        elif flagged >= sustained.warning_count:
            levels["sustained_spikes"] = WARNING
        if levels["sustained_spikes"]:
            reasons.append(
                f"{flagged} flagged steps ({criticals} critical) in the last {len(self.flags)}"
            )

        self.steps_seen += 1
        if step_level < CRITICAL:
            self._accept(record, levels, log_grad)
        return Verdict(step=step, levels=levels, reasons=reasons, zscore=zscore)

    def _accept(self, record: dict, levels: dict, log_grad: float) -> None:
        """Fold an applied step's values into the rolling statistics."""
        if math.isfinite(log_grad):
            self.log_grad.append(log_grad)
        for key, history, check in (
            ("entropy", self.entropy, "entropy_collapse"),
            ("kl", self.kl, "kl_blowup"),
            ("reward_mean", self.reward, "reward_collapse"),
        ):
            if _finite(record.get(key)) and levels[check] < CRITICAL:
                history.append(float(record[key]))
        if _finite(record.get("expert_imbalance_max")):
            self.expert_imbalance.append(float(record["expert_imbalance_max"]))
        if _finite(record.get("expert_dead_fraction")):
            self.expert_dead.append(float(record["expert_dead_fraction"]))

    # ------------------------------------------------------------------ state

    _HISTORIES = ("log_grad", "entropy", "kl", "reward", "expert_imbalance", "expert_dead", "flags")

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state (saved in checkpoints)."""
        return {
            "version": 1,
            "steps_seen": self.steps_seen,
            **{name: list(getattr(self, name)) for name in self._HISTORIES},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (windows may differ: the newest values are kept)."""
        if state.get("version") != 1:
            raise ValueError(
                f"detector state version {state.get('version')!r} is not supported (expected 1)"
            )
        self.steps_seen = int(state["steps_seen"])
        for name in self._HISTORIES:
            history: deque = getattr(self, name)
            history.clear()
            history.extend(state.get(name, []))
