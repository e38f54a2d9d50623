"""Arguments of `rlft rollout` (no torch import: the CLI builds its parser cheaply)."""

from __future__ import annotations

import argparse

from rlft.trainer.checkpoint.commands import add_storage_options


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text}: give seconds, 0 or more")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", nargs="?", help="RLFineTune manifest (YAML); optional locally")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=0, help="port (0: a free one)")
    parser.add_argument("--instance", type=int, default=0, help="index of this instance")
    parser.add_argument(
        "--engine", choices=["auto", "transformers", "vllm"], help="overrides the job's"
    )
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--expert-parallel", type=int, default=1)
    parser.add_argument("--ray-address", help="Ray head of a multi-node instance (vLLM)")
    parser.add_argument(
        "--nodes", type=int, default=1, help="nodes of a multi-node instance, awaited in Ray"
    )
    parser.add_argument(
        "--ray-timeout", type=float, default=600.0, help="seconds to wait for the Ray nodes"
    )
    parser.add_argument("--weights-uri", help="publication location to catch up from")
    parser.add_argument(
        "--stall-seconds",
        type=_seconds,
        help="a generate call in the engine this long makes /livez 503 (0: never; default "
        "twice the job's spec.rollout.requestTimeoutSeconds, 0 without a job)",
    )
    add_storage_options(parser)  # how to reach an s3:// one without a job file
    parser.add_argument("--ready-file", help="write {port, pid} here once listening")
