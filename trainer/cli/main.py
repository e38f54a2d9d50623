"""The `rlft` command line."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

from rlft.trainer.cli.training import add_training_commands
from rlft.trainer.config import JobFileError, RLFineTune, load_job
from rlft.trainer.exit_codes import ExitCode

_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
"""What the API server gives every object as metadata.uid (a UUID, lower-case)."""


def _load_or_report(path: str) -> RLFineTune | None:
    """The job, or None after printing one `file: field: problem` line per problem."""
    try:
        return load_job(path)
    except JobFileError as error:
        for problem in error.problems:
            print(f"{error.source}: {problem}", file=sys.stderr)
        return None


def cmd_validate(args: argparse.Namespace) -> int:
    job = _load_or_report(args.job)
    if job is None:
        return ExitCode.INVALID_CONFIG
    print(f"{args.job}: valid RLFineTune {job.metadata.name!r}")
    return ExitCode.OK


def cmd_crd(args: argparse.Namespace) -> int:
    # Imported here: the operator's modules are not needed by the other commands.
    from rlft.operator.crd import render_crd

    text = render_crd()
    if args.out in (None, "-"):
        sys.stdout.write(text)
    else:
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)
        except OSError as error:  # a file where a folder goes, a folder, no permission…
            print(
                f"rlft: --out {args.out}: {error.strerror} ({error.filename}): choose a file "
                "path rlft can create and write",
                file=sys.stderr,
            )
            return ExitCode.INVALID_CONFIG
        print(f"rlft: wrote {args.out}")
    return ExitCode.OK


def cmd_plan(args: argparse.Namespace) -> int:
    from rlft.operator import plan
    from rlft.operator.__main__ import pod_settings

    job = _load_or_report(args.job)
    if job is None:
        return ExitCode.INVALID_CONFIG
    if args.uid and not _UID.match(args.uid):
        # Applied, objects owned by a uid no object has are garbage-collected.
        print(
            f"rlft: --uid {args.uid!r} is not a Kubernetes uid (a lower-case UUID); copy the "
            "job's own: kubectl get rlft NAME -o jsonpath='{.metadata.uid}'",
            file=sys.stderr,
        )
        return ExitCode.INVALID_CONFIG
    namespace = plan.namespace_of(job, args.namespace)
    problems = plan.problems(job, namespace)
    for problem in problems:
        print(f"{args.job}: {problem}", file=sys.stderr)
    if problems:
        return ExitCode.INVALID_CONFIG
    objects = plan.plan(job, namespace, args.uid, pod_settings(args))
    sys.stdout.write(plan.render(objects))
    return ExitCode.OK


PLAN_HELP = """\
Print every object the operator creates for this job on its first reconcile (ConfigMap,
Services, the job's token Secret and NetworkPolicy, the gang's PodGroup, trainer and
rollout pods), as one YAML stream, in the order it creates them: for
review and GitOps, like `helm template`. The objects come from the operator's own code,
not a copy. ownerReferences need the job's uid, which exists only once the job is applied:
without --uid they are left out (a made-up uid would get applied objects garbage-collected)
and the trainers' --rdzv-id shows the placeholder uid 00000000-0000-0000-0000-000000000000;
with --uid (kubectl get rlft NAME -o jsonpath='{.metadata.uid}') the output is exactly what
the operator creates. Credentials appear only as secretKeyRef names, never as values. A bad
job file, or one the API server would refuse or the operator would fail before any pod
(InvalidSpec), exits 2 naming each field, as `rlft validate` does.
"""


def _add_plan_command(commands: argparse._SubParsersAction) -> None:
    from rlft.operator.options import add_pod_arguments

    plan = commands.add_parser(
        "plan",
        help="print the Kubernetes objects the operator would create for a job (YAML)",
        description=PLAN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("job", help="RLFineTune manifest (YAML)")
    plan.add_argument(
        "-n",
        "--namespace",
        help="namespace of the job (default: its metadata.namespace, else 'default')",
    )
    plan.add_argument("--uid", help="the applied job's metadata.uid: adds ownerReferences")
    add_pod_arguments(plan)  # the operator's own options of the same name (the chart's values)
    plan.set_defaults(handler=cmd_plan)


def cmd_operator(args: argparse.Namespace) -> int:
    from rlft.operator.__main__ import run

    return run(args)


def cmd_rollout(args: argparse.Namespace) -> int:
    from rlft.trainer.rollout.server import run

    return run(args)


def _add_checkpoint_commands(commands: argparse._SubParsersAction) -> None:
    """`rlft checkpoints list|verify URI` and `rlft export` (torch loads only for export)."""
    from rlft.trainer.checkpoint import commands as ck

    group = commands.add_parser("checkpoints", help="inspect a checkpoint location")
    actions = group.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="committed, uncommitted and damaged checkpoints")
    listing.add_argument("uri", help="s3://bucket/prefix, file:///path or a folder")
    ck.add_storage_options(listing)
    listing.set_defaults(handler=ck.cmd_list)
    verify = actions.add_parser("verify", help="check sizes and SHA-256; exit 1 if damaged")
    verify.add_argument("uri", help="s3://bucket/prefix, file:///path or a folder")
    verify.add_argument("--step", type=int, help="only this step")
    ck.add_storage_options(verify)
    verify.set_defaults(handler=ck.cmd_verify)

    export = commands.add_parser(
        "export", help="write a run's final model or a checkpoint as a Hugging Face folder"
    )
    export.add_argument(
        "checkpoint",
        help="a checkpoint location (its finished run's final model, else its latest "
        "checkpoint) or one checkpoint folder (.../step-000120)",
    )
    export.add_argument(
        "--latest-checkpoint",
        action="store_true",
        help="export the location's latest checkpoint even when a final model is there",
    )
    export.add_argument("out_dir", help="new folder for config, safetensors and tokenizer")
    ck.add_storage_options(export)
    export.set_defaults(handler=ck.cmd_export)


class _Parser(argparse.ArgumentParser):
    """argparse, whose refusal of a command line is also the process's verdict: in a pod
    the operator wrote that command line (an operator newer than the trainer's image,
    say), and exit 2 alone told its failure policy nothing it could show."""

    def error(self, message: str) -> NoReturn:
        from rlft.trainer import termination

        rank = os.environ.get("RANK", "0")
        verdict = termination.Verdict(
            ExitCode.INVALID_CONFIG,
            f"{self.prog}: {message} (the command line; see `{self.prog} --help`)",
            int(rank) if rank.isdigit() else 0,
        )
        termination.write_unless_written(verdict)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rlft", description="RL fine-tuning of language models, locally or on Kubernetes."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    validate = commands.add_parser(
        "validate", help="check a job file; exit 2 naming each bad field"
    )
    validate.add_argument("job", help="RLFineTune manifest (YAML)")
    validate.set_defaults(handler=cmd_validate)

    add_training_commands(commands)

    crd = commands.add_parser("crd", help="print (or write) the RLFineTune CRD YAML")
    crd.add_argument("--out", help="write it to this file (e.g. crds/rlfinetune.yaml)")
    crd.set_defaults(handler=cmd_crd)

    _add_plan_command(commands)

    operator = commands.add_parser("operator", help="run the Kubernetes operator")
    from rlft.operator.options import add_arguments

    add_arguments(operator)
    operator.set_defaults(handler=cmd_operator)
    _add_checkpoint_commands(commands)

    rollout = commands.add_parser(
        "rollout",
        aliases=["rollout-server"],
        help="serve one rollout instance (POST /generate, POST /weights, GET /healthz, /metrics)",
    )
    from rlft.trainer.rollout.arguments import add_arguments as add_rollout_arguments

    add_rollout_arguments(rollout)
    rollout.set_defaults(handler=cmd_rollout)

    scrubbed = commands.add_parser(
        "scrubbed",
        help="run a command with its output scrubbed of the secrets of the environment and "
        "the mounted Secrets (what every pod runs first)",
    )
    scrubbed.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGUMENT...]")
    scrubbed.set_defaults(handler=cmd_scrubbed)
    return parser


def cmd_scrubbed(args: argparse.Namespace) -> int:
    from rlft.trainer.cli.scrubbed import main as run_scrubbed

    return run_scrubbed(args.argv)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":  # torchrun's ranks, and tests, start `python -m` this module
    from rlft.trainer.redaction import scrub_output

    scrub_output()
    sys.exit(main())
