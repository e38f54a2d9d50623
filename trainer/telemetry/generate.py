"""Write the generated observability files: alert rules and the Grafana dashboard.

    python -m rlft.trainer.telemetry.generate          # rewrite them
    python -m rlft.trainer.telemetry.generate --check  # exit 1 if any is stale

A test runs the check, so the committed files never drift from the metric definitions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from rlft.trainer.telemetry.alerts import rules_document
from rlft.trainer.telemetry.dashboard import dashboard

REPO_ROOT = Path(__file__).resolve().parents[2]
RULES = Path("observability/rules/rlft-alerts.yaml")
DASHBOARD = Path("observability/grafana/rlft.json")
_HEADER = (
    "# Generated from rlft.trainer.telemetry.alerts by "
    "`python -m rlft.trainer.telemetry.generate`; do not edit.\n"
)


def rendered() -> dict[Path, str]:
    """Relative path → exact file content."""
    rules = _HEADER + yaml.safe_dump(rules_document(), sort_keys=False, width=100)
    return {RULES: rules, DASHBOARD: json.dumps(dashboard(), indent=2) + "\n"}


def stale(root: Path = REPO_ROOT) -> list[Path]:
    """Generated files whose content differs from what the code generates."""
    return [
        path
        for path, text in rendered().items()
        if not (root / path).exists() or (root / path).read_text() != text
    ]


def write(root: Path = REPO_ROOT) -> list[Path]:
    for path, text in rendered().items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return list(rendered())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(args.root)
        for path in bad:
            print(
                f"{path} is stale: run python -m rlft.trainer.telemetry.generate", file=sys.stderr
            )
        return 1 if bad else 0
    for path in write(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
