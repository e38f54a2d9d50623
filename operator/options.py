"""The operator's command-line options, one place for their names and defaults: the
operator (`python -m rlft.operator`, `rlft operator`) parses them, and the Helm chart's
values take their defaults from the constants here, so the two cannot drift apart.
Importing this module has no side effects."""

from __future__ import annotations

import argparse

PEERING = "rlft"
PEERING_LIFETIME_SECONDS = 60
METRICS_BIND = "[::]:9090"
POLL_SECONDS = 15.0
TRAINER_STATUS_PORT = 8080
RENDEZVOUS_PORT = 29400
ROLLOUT_PORT = 8000
LIVENESS_PORT = 8081
RAY_PORT = 6379
GRACE_SECONDS = 300
POD_PORTS = {
    "trainer-status": (TRAINER_STATUS_PORT, "port of the trainers' /status and /metrics"),
    "rendezvous": (RENDEZVOUS_PORT, "port of torchrun's rendezvous store on trainer pod 0"),
    "rollout": (ROLLOUT_PORT, "port of the rollout pods' protocol (/generate, /weights, …)"),
    "liveness": (LIVENESS_PORT, "port of each trainer pod's /livez (stallTimeoutSeconds)"),
    "ray": (RAY_PORT, "port of the Ray head of a rollout instance spanning several nodes"),
}
"""The ports the job's pods listen on: option `--NAME-port`, its default, its meaning."""


def metrics_port(bind: str = METRICS_BIND) -> int:
    return int(bind.rpartition(":")[2])


def build_parser(prog: str = "python -m rlft.operator") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Run the RLFineTune operator.")
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="serve this namespace (repeatable; default: the pod's own namespace)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve all namespaces")
    parser.add_argument("--peering", default=PEERING, help="peering object for leader election")
    parser.add_argument("--standalone", action="store_true", help="no leader election")
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="leader-election priority (highest wins; default: random, env RLFT_OPERATOR_PRIORITY)",
    )
    parser.add_argument(
        "--peering-lifetime",
        type=int,
        default=PEERING_LIFETIME_SECONDS,
        help="seconds a silent peer counts as alive",
    )
    parser.add_argument(
        "--metrics-bind",
        default=METRICS_BIND,
        help="HOST:PORT of /metrics (port 0 picks a free one)",
    )
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=POLL_SECONDS,
        help="reconcile every job at least this often (and poll /status)",
    )
    add_pod_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def add_pod_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that shape the pods the operator builds (`manifests.Settings`): shared
    with `rlft plan`, whose plan must match an operator started with the same values."""
    # Pods that share a network (hostNetwork, or the test cluster) need ports of their own
    # per operator; in a pod network the defaults serve every job.
    for name, (default, meaning) in POD_PORTS.items():
        parser.add_argument(f"--{name}-port", type=int, default=default, help=meaning)
    parser.add_argument(
        "--grace-seconds",
        type=int,
        default=GRACE_SECONDS,
        help="terminationGracePeriodSeconds of rollout pods (trainer pods get their job's "
        "spec.checkpoint.gracePeriodSeconds plus a margin)",
    )
    parser.add_argument(
        "--job-network-policy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a NetworkPolicy per job: its pods take connections from each other, and from "
        "elsewhere only on the status, rollout and liveness ports (--no-job-network-policy "
        "where something else must reach them, e.g. a sidecar's port)",
    )
