"""`python -m rlft.operator` (also `rlft operator`): run the operator.

Leader election: replicas share a kopf peering object (`--peering`, created at start-up);
each gets a priority (`--priority`, random by default), the highest one works and the
others stand by, taking over when its keep-alive lapses (`--peering-lifetime` seconds).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys

from rlft.operator.manifests import Settings
from rlft.operator.options import build_parser
from rlft.trainer.addresses import ALL as ALL_ADDRESSES
from rlft.trainer.redaction import scrub_output


def _own_namespace() -> str:
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        return os.environ.get("POD_NAMESPACE", "default")


def pod_settings(args: argparse.Namespace) -> Settings:
    """The pods' settings from the options of `options.add_pod_arguments`."""
    return Settings(
        status_port=args.trainer_status_port,
        rdzv_port=args.rendezvous_port,
        rollout_port=args.rollout_port,
        liveness_port=args.liveness_port,
        ray_port=args.ray_port,
        grace_seconds=args.grace_seconds,
        network_policy=args.job_network_policy,
    )


def run(args: argparse.Namespace) -> int:
    # Imported here: `rlft crd` and `rlft --help` must not need kopf.
    import kopf

    from rlft.operator import handlers

    host, _, port = args.metrics_bind.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::]:9090, an IPv6 address
    if not port.isdigit():
        print(
            f"rlft operator: --metrics-bind {args.metrics_bind!r}: expected HOST:PORT",
            file=sys.stderr,
        )
        return 2
    priority = args.priority
    if priority is None:
        env = os.environ.get("RLFT_OPERATOR_PRIORITY")
        priority = int(env) if env else random.randint(1, 2**31 - 1)
    namespaces = [] if args.all_namespaces else (args.namespace or [_own_namespace()])
    options = handlers.Options(
        settings=pod_settings(args),
        poll_seconds=args.poll_seconds,
        priority=priority,
        peering_lifetime=args.peering_lifetime,
        metrics_host=host or ALL_ADDRESSES,
        metrics_port=int(port),
        identity=os.environ.get("POD_NAME", f"rlft-operator-{os.getpid()}"),
    )
    handlers.configure(options, namespaces)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # kopf logs every handler call at INFO: too chatty for 1000s of jobs
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=namespaces,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=priority,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    # The image's entry point is `python -m rlft.operator`, not the `rlft` command that
    # scrubs its output: its log is read and kept as a pod's is. Before parsing: an
    # option's error quotes its value.
    scrub_output()
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
