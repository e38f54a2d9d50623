"""`rlft checkpoints list|verify URI` and `rlft export CHECKPOINT OUT_DIR`: the command
line's view of a checkpoint location. Prints plain lines; returns exit codes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlft.trainer.checkpoint.catalog import Catalog
from rlft.trainer.checkpoint.errors import BadUriError, CheckpointError, StorageError
from rlft.trainer.checkpoint.history import segment_problems
from rlft.trainer.checkpoint.manifest import split_location, step_dir
from rlft.trainer.config.locations import shown
from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.storage.backends import FileStorage, S3Options, open_storage

FAILURES = (CheckpointError, StorageError, BadUriError, OSError)
"""Reported as one line and exit 1 (a local folder that cannot be written or read, too)."""


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """Flags for S3-compatible stores (credentials come from the AWS environment or
    --credentials-dir, never from the command line)."""
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint, e.g. http://host:8333")
    parser.add_argument("--region", help="bucket region (default AWS_REGION or us-east-1)")
    parser.add_argument("--addressing-style", choices=["auto", "path", "virtual"], default="auto")
    parser.add_argument(
        "--credentials-dir", help="folder with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY files"
    )


def s3_arguments(options: S3Options) -> list[str]:
    """The flags of `add_storage_options` that give `options` (credentials never: a
    child process reads them from the environment or the folder named)."""
    flags = [
        ("--endpoint-url", options.endpoint_url),
        ("--region", options.region),
        ("--addressing-style", options.addressing_style),
        ("--credentials-dir", options.credentials_dir),
    ]
    return [part for flag, value in flags if value for part in (flag, value)]


def storage_options(args: argparse.Namespace) -> S3Options:
    """The S3 options `add_storage_options` added."""
    return S3Options(
        endpoint_url=args.endpoint_url,
        region=args.region,
        addressing_style=args.addressing_style,
        credentials_dir=args.credentials_dir,
    )


def _readable(uri: str, args: argparse.Namespace):
    """The location's storage; a local folder that does not exist is the caller's typo,
    not an empty location (a CI gate on a wrong path used to pass)."""
    storage = open_storage(uri, storage_options(args))
    if isinstance(storage, FileStorage) and not storage.root.is_dir():
        raise BadUriError(f"no folder at {storage.root}: check the path")
    return storage


def cmd_list(args: argparse.Namespace) -> int:
    try:
        catalog = Catalog(_readable(args.uri, args))
        scan = catalog.scan()
    except FAILURES as error:
        print(f"rlft: {error}", file=sys.stderr)
        return ExitCode.FAILURE
    if not (scan.manifests or scan.uncommitted or scan.unreadable):
        print(f"{args.uri}: no checkpoints")
        return ExitCode.OK
    abandoned = scan.abandoned
    print(f"{'step':>8}  {'healthy':7}  {'ranks':>5}  {'MB':>9}  {'created':20}  note")
    for step in sorted(set(scan.manifests) | scan.uncommitted | set(scan.unreadable)):
        manifest = scan.manifests.get(step)
        if manifest is None:
            note = (
                "written by a newer rlft"
                if step in scan.newer
                else "DAMAGED manifest"
                if step in scan.unreadable
                else "uncommitted"
            )
            print(f"{step:>8}  {'-':7}  {'-':>5}  {'-':>9}  {'-':20}  {note}")
            continue
        notes = [
            n
            for n, on in (
                ("latest", step == scan.latest),
                ("emergency", manifest.emergency),
                ("abandoned", step in abandoned),
            )
            if on
        ]
        print(
            f"{step:>8}  {'yes' if manifest.healthy else 'no':7}  {manifest.world_size:>5}  "
            f"{manifest.total_bytes / 1e6:>9.1f}  {manifest.created_at:20}  {' '.join(notes)}"
        )
    return ExitCode.OK


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every committed checkpoint's files against its manifest (sizes and
    SHA-256), and the metrics history segments it lists, or only `--step`'s; exit 1 if
    any checked is damaged or missing."""
    base, named = split_location(args.uri)  # `…/step-000120` is that step, as for export
    if isinstance(named, int) and args.step not in (None, named):
        said = f"rlft: {shown(args.uri)} names step {named}, --step {args.step}: give one"
        print(said, file=sys.stderr)
        return ExitCode.INVALID_CONFIG
    step = named if isinstance(named, int) else args.step
    try:
        storage = _readable(base, args)
        catalog = Catalog(storage)
        scan = catalog.scan()
        damaged = 0
        wanted = set(scan.manifests) | set(scan.unreadable)
        steps = sorted(wanted) if step is None else [step]
        for step in steps:
            if step in scan.unreadable:
                # A newer rlft's checkpoint cannot be checked here; it is not damage.
                newer = step in scan.newer
                print(
                    f"{step_dir(step)}: {'NOT CHECKED' if newer else 'DAMAGED'}: "
                    f"{scan.unreadable[step]}"
                )
                damaged += not newer
                continue
            if step not in scan.manifests:
                print(f"{step_dir(step)}: not committed")
                damaged += 1
                continue
            problems = catalog.verify(scan.manifests[step])
            if not problems:
                problems = segment_problems(storage, catalog.read_extra(step))
            if problems and catalog.gone(scan.manifests[step]):
                # A run writing here committed a newer one, and its retention deleted this.
                print(f"{step_dir(step)}: deleted meanwhile (retention), not checked")
                continue
            damaged += bool(problems)
            print(
                f"{step_dir(step)}: "
                + ("ok" if not problems else "DAMAGED: " + "; ".join(problems))
            )
    except FAILURES as error:
        print(f"rlft: {error}", file=sys.stderr)
        return ExitCode.FAILURE
    if not steps:
        print(f"{args.uri}: no committed checkpoints")
        if isinstance(storage, FileStorage) and (storage.root / "checkpoints").is_dir():
            # a run's output folder: a CI gate on it passed without checking anything
            print(
                f"rlft: {args.uri} is a run folder: verify {args.uri}/checkpoints", file=sys.stderr
            )
            return ExitCode.FAILURE
    return ExitCode.FAILURE if damaged else ExitCode.OK


def cmd_export(args: argparse.Namespace) -> int:
    from rlft.trainer.checkpoint.export import FINAL_MODEL, export_final, export_hf, split_location

    out, s3 = Path(args.out_dir), storage_options(args)
    final = split_location(args.checkpoint)[1] == "auto" and not args.latest_checkpoint
    try:
        if final and export_final(args.checkpoint, out, s3=s3):
            print(f"exported the final model ({FINAL_MODEL}) to {args.out_dir}")
            return ExitCode.OK
        manifest = export_hf(args.checkpoint, out, s3=s3)
    except FAILURES as error:
        print(f"rlft: {error}", file=sys.stderr)
        return ExitCode.FAILURE
    print(f"exported {step_dir(manifest.step)} to {args.out_dir}")
    return ExitCode.OK
