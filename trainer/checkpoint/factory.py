"""Build the checkpoint objects from the job file's `spec.checkpoint`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlft.trainer.config import CheckpointSpec
from rlft.trainer.storage.backends import S3Options, Storage, open_storage


def s3_options(spec: CheckpointSpec) -> S3Options:
    return S3Options(
        endpoint_url=spec.endpoint_url,
        region=spec.region,
        addressing_style=spec.addressing_style,
        upload_concurrency=spec.upload_concurrency,
        part_size_mb=spec.part_size_mb,
        credentials_dir=spec.credentials_dir,
    )


def storage_from_spec(spec: CheckpointSpec, default_uri: str | Path) -> Storage:
    """The storage `spec.uri` names, or `default_uri` (locally: the output folder's
    `checkpoints/`)."""
    return open_storage(spec.uri or str(default_uri), s3_options(spec))


def checkpointer_from_spec(
    spec: CheckpointSpec, default_uri: str | Path, **kwargs: Any
):  # -> Checkpointer (imported lazily: it needs torch)
    """A Checkpointer configured by `spec`; `kwargs` go to its constructor (job_config,
    hf_files, on_event, …)."""
    from rlft.trainer.checkpoint.saver import Checkpointer

    return Checkpointer(
        storage_from_spec(spec, default_uri),
        interval_steps=spec.interval_steps,
        interval_minutes=spec.interval_minutes,
        keep_last=spec.keep_last,
        retry_seconds=spec.upload_retry_minutes * 60,
        upload_concurrency=spec.upload_concurrency,
        staging_dir=Path(spec.staging_dir) if spec.staging_dir else None,
        **kwargs,
    )
