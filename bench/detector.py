"""How fast and how quietly does rlft's collapse detector catch faults, next to two
common baselines? Replays labelled traces through each detector, side by side.

    .venv/bin/python bench/detector.py

Traces (bench/traces/*.csv, see bench/traces/README.md) are per-step records of REAL
local runs of examples/tiny-grpo.yaml: healthy runs (several seeds), one real collapse
(RL learning rate 2e-3), one run with the learning rate ×100 for a single step, and one
whose reference answers were wrong for 30 steps (data poisoning). Faults are also
planted into every healthy trace at several onsets by these transforms:

- nan:               loss and grad_norm are NaN at the onset step.
- grad spike N×:     one bad batch: grad_norm at the onset step becomes N× the median of
                     the 100 steps before it ("the grad norm jumped 10×"), and the loss
                     is scaled by the same factor. "own value" rows instead multiply the
                     step's own grad_norm by N (which may be below the median).
- lr ×100:           the update of the onset step is 100× too large. What the real run
                     with that fault (traces/lr100-seed5.csv) showed from the next step on,
                     for the 110 steps it lasted: the policy is wrecked, reward and grad
                     norm drop to ~0 (all-zero rewards give zero advantages) and entropy
                     rises ~3×. The transform multiplies reward_mean and grad_norm by
                     LR100_FACTOR and entropy by 3 from the step after the onset on.
- data poisoning:    for 30 steps from the onset the reference answers are wrong. The
                     real poisoned run (traces/poison-seed6.csv) scored every completion
                     0 on them, so every advantage and the gradient were 0: the transform
                     multiplies reward_mean and grad_norm by POISON_FACTOR for 30 steps.
- entropy collapse:  from the onset t0 entropy is multiplied by exp(-(t-t0)/20); the
                     labelled collapse point is t0+28, where entropy is down to 25%.
                     Detection before that point (but after t0) gives a negative delay.

A detector "alarms" when it would intervene: rlft when a verdict is critical (the update
is skipped or collapse declared; warnings are counted apart), the fixed threshold when
grad_norm > T or is not finite, the running-max baseline when |loss| > 10× the largest
|loss| so far or loss is not finite. T is the largest grad norm of all healthy traces,
i.e. tuned in hindsight to raise no false alarm on them: the kindest choice for it.
Delay = first alarm step at or after the fault's onset − labelled step; a fault not
caught within HORIZON steps is "missed". Last line: JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from rlft.trainer.stability.detector import Detector

TRACES = Path(__file__).resolve().parent / "traces"
COLUMNS = (
    "step", "loss", "grad_norm", "entropy", "kl", "reward_mean", "reward_std",
    "train_accuracy", "clip_fraction", "ratio_mean", "response_len_mean", "truncated_fraction",
)  # fmt: skip
HORIZON = 60
ONSETS = (40, 120, 220, 320, 420)
ENTROPY_TAU, ENTROPY_LABEL_OFFSET = 20, 28  # exp(-28/20) ≈ 0.25
POISON_STEPS = 30
# Measured on the real runs in traces/ (see README there); used by the transforms.
LR100_FACTOR = 0.02
POISON_FACTOR = 0.0


# ----------------------------------------------------------------------- traces


def read_trace(path: Path) -> tuple[dict, list[dict]]:
    """(metadata from the first `# {...}` line, records)."""
    lines = path.read_text().splitlines()
    meta = json.loads(lines[0].removeprefix("# "))
    records = []
    for row in csv.DictReader(lines[1:]):
        records.append({k: (int(v) if k == "step" else float(v)) for k, v in row.items() if v})
    return meta, records


def add_trace(jsonl: Path, name: str, meta: dict) -> Path:
    """Store a run's metrics.jsonl compactly under traces/NAME.csv."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    path = TRACES / f"{name}.csv"
    with path.open("w", newline="") as out:
        out.write("# " + json.dumps({"name": name, **meta}) + "\n")
        writer = csv.writer(out)
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow([row["step"], *(f"{row.get(c, math.nan):.6g}" for c in COLUMNS[1:])])
    return path


# ------------------------------------------------------------------- transforms


def _copy(records: list[dict], end: int) -> list[dict]:
    return [dict(r) for r in records[:end]]


def plant_nan(records, t):
    out = _copy(records, t + HORIZON)
    out[t]["loss"] = out[t]["grad_norm"] = math.nan
    return out, t, t


def plant_spike(factor, relative_to_median=True):
    def plant(records, t):
        out = _copy(records, t + HORIZON)
        before = [r["grad_norm"] for r in records[max(0, t - 100) : t]]
        base = statistics.median(before) if relative_to_median else out[t]["grad_norm"]
        scale = factor * base / out[t]["grad_norm"]
        out[t]["grad_norm"] *= scale
        out[t]["loss"] *= scale
        return out, t, t

    return plant


def plant_lr100(records, t):
    out = _copy(records, t + HORIZON)
    for r in out[t + 1 :]:
        r["grad_norm"] *= LR100_FACTOR
        r["reward_mean"] *= LR100_FACTOR
        r["entropy"] *= 3
    return out, t + 1, t + 1  # the step's own record is clean: its gradient came first


def plant_poison(records, t):
    out = _copy(records, t + HORIZON)
    for r in out[t : t + POISON_STEPS]:
        r["reward_mean"] *= POISON_FACTOR
        r["grad_norm"] *= POISON_FACTOR
    return out, t, t


def plant_entropy_collapse(records, t):
    out = _copy(records, t + HORIZON)
    for i, r in enumerate(out[t:]):
        r["entropy"] *= math.exp(-i / ENTROPY_TAU)
    return out, t, t + ENTROPY_LABEL_OFFSET


FAULTS: dict[str, Callable] = {
    "nan": plant_nan,
    "grad spike 10x": plant_spike(10.0),
    "grad spike 100x": plant_spike(100.0),
    "grad spike 10x own value": plant_spike(10.0, relative_to_median=False),
    "lr x100": plant_lr100,
    "data poisoning": plant_poison,
    "entropy collapse (slow)": plant_entropy_collapse,
}


# -------------------------------------------------------------------- detectors


class Rlft:
    name = "rlft"

    def __init__(self):
        self.detector = Detector()
        self.warnings = 0

    def alarm(self, record: dict) -> bool:
        verdict = self.detector.observe(record)
        self.warnings += verdict.level == 1
        return verdict.skip_update or verdict.collapsed


class FixedGradThreshold:
    def __init__(self, threshold: float):
        self.threshold = threshold
        self.name = f"grad_norm > {threshold:.3g}"

    def alarm(self, record: dict) -> bool:
        g = record["grad_norm"]
        return not math.isfinite(g) or g > self.threshold


class LossRunningMax:
    name = "|loss| > 10x running max"

    def __init__(self):
        self.running = 0.0

    def alarm(self, record: dict) -> bool:
        loss = abs(record["loss"])
        if not math.isfinite(loss):
            return True
        fired = self.running > 0 and loss > 10 * self.running
        self.running = max(self.running, loss)
        return fired


def alarm_steps(factory: Callable, records: list[dict]) -> list[int]:
    detector = factory()
    return [r["step"] for r in records if detector.alarm(r)]


def delay(alarms: list[int], onset: int, label: int) -> int | None:
    after = [s for s in alarms if onset <= s < onset + HORIZON]
    return after[0] - label if after else None


# ------------------------------------------------------------------------- main


def summarise(delays: list[int | None]) -> dict:
    found = [d for d in delays if d is not None]
    return {
        "n": len(delays),
        "missed": len(delays) - len(found),
        "median": statistics.median(found) if found else None,
        "max": max(found) if found else None,
    }


def cell(s: dict) -> str:
    if s["median"] is None:
        return f"missed {s['missed']}/{s['n']}"
    text = f"{s['median']:g} / {s['max']:g}"
    return text + (f"  (missed {s['missed']}/{s['n']})" if s["missed"] else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--add", type=Path, help="store a run's metrics.jsonl as a trace")
    parser.add_argument("--name", help="trace name (with --add)")
    parser.add_argument("--meta", default="{}", help="JSON metadata (with --add)")
    args = parser.parse_args()
    if args.add:
        print(f"wrote {add_trace(args.add, args.name, json.loads(args.meta))}")
        return 0

    traces = [read_trace(p) for p in sorted(TRACES.glob("*.csv"))]
    healthy = [recs for meta, recs in traces if meta["kind"] == "healthy"]
    real = [(meta, recs) for meta, recs in traces if meta["kind"] != "healthy"]
    if not healthy:
        sys.exit(f"no healthy traces in {TRACES}")
    threshold = max(r["grad_norm"] for recs in healthy for r in recs)
    factories = {
        "rlft": Rlft,
        "fixed": lambda: FixedGradThreshold(threshold),
        "loss": LossRunningMax,
    }
    names = {"rlft": "rlft", "fixed": f"grad_norm > {threshold:.3g}", "loss": LossRunningMax.name}

    healthy_steps = sum(len(recs) for recs in healthy)
    false_alarms = {
        k: sum(len(alarm_steps(f, recs)) for recs in healthy) for k, f in factories.items()
    }
    rlft_warnings = 0
    for recs in healthy:
        detector = Rlft()
        for r in recs:
            detector.alarm(r)
        rlft_warnings += detector.warnings

    results: dict[str, dict] = {}
    for kind, plant in FAULTS.items():
        delays: dict[str, list] = {k: [] for k in factories}
        for recs in healthy:
            for t in ONSETS:
                if t + HORIZON > len(recs):
                    continue
                faulty, onset, label = plant(recs, t)
                onset_step, label_step = faulty[onset]["step"], faulty[label]["step"]
                for k, f in factories.items():
                    delays[k].append(delay(alarm_steps(f, faulty), onset_step, label_step))
        results[kind] = {k: summarise(v) for k, v in delays.items()}
    for meta, recs in real:
        onset, label = meta["onset"], meta.get("label", meta["onset"])
        row = {}
        for k, f in factories.items():
            row[k] = summarise([delay(alarm_steps(f, recs), onset, label)])
        results[f"real: {meta['description']}"] = row

    width = max(len(k) for k in results) + 2
    print(
        f"healthy traces: {len(healthy)} real runs, {healthy_steps} steps; delay in steps "
        "(median / max over planted onsets)"
    )
    print(f"{'fault':<{width}}" + "".join(f"{names[k]:>28}" for k in factories))
    for kind, row in results.items():
        print(f"{kind:<{width}}" + "".join(f"{cell(row[k]):>28}" for k in factories))
    per_1000 = {k: 1000 * v / healthy_steps for k, v in false_alarms.items()}
    print(
        f"{'false alarms / 1000 healthy steps':<{width}}"
        + "".join(f"{per_1000[k]:>28.2f}" for k in factories)
    )
    print(f"(rlft warnings, not alarms: {1000 * rlft_warnings / healthy_steps:.2f} / 1000 steps)")

    for meta, recs in real:
        detector, first = Detector(), {}
        for r in recs:
            verdict = detector.observe(r)
            if verdict.skip_update:
                first.setdefault("skip", (r["step"], verdict.reasons))
            if verdict.collapsed:
                first.setdefault("collapse", (r["step"], verdict.reasons))
        for what, (step, reasons) in sorted(first.items(), key=lambda kv: kv[1][0]):
            reward = recs[[r["step"] for r in recs].index(step)]["reward_mean"]
            print(
                f"rlft on real {meta['name']}: first {what} at step {step} "
                f"(reward {reward:.3f}): {'; '.join(reasons)}"
            )

    def worst(kind: str) -> float:
        s = results[kind]["rlft"]
        return math.inf if s["missed"] or s["max"] is None else s["max"]

    goals = {
        "nan_delay_le_1": worst("nan") <= 1,
        "spike_10x_delay_le_1": worst("grad spike 10x") <= 1,
        "spike_100x_delay_le_1": worst("grad spike 100x") <= 1,
        "lr_x100_delay_le_1": worst("lr x100") <= 1,
        "entropy_collapse_delay_le_5": worst("entropy collapse (slow)") <= 5,
        "zero_false_alarms": false_alarms["rlft"] == 0 and healthy_steps >= 2000,
    }
    print(
        json.dumps(
            {
                "healthy_steps": healthy_steps,
                "grad_threshold": threshold,
                "false_alarms_per_1000": per_1000,
                "rlft_warnings_per_1000": 1000 * rlft_warnings / healthy_steps,
                "delays": results,
                "goals": goals,
                "goals_met": all(goals.values()),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
