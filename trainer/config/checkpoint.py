"""The checkpoint section: where sharded checkpoints go, how often, and how uploads and
resumes behave."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from rlft.trainer.config.base import Section, checked
from rlft.trainer.config.locations import ENDPOINT, endpoint_problem, location_problem
from rlft.trainer.config.pods import DnsSubdomain


class CheckpointSpec(Section):
    """Sharded checkpoints in object storage."""

    uri: str | None = None
    """`s3://bucket/prefix` or `file:///path`; locally defaults to the output folder's
    `checkpoints/`."""
    interval_steps: int = Field(50, ge=1, le=1_000_000)
    """Checkpoint every N optimizer steps."""
    interval_minutes: float = Field(30.0, gt=0, le=10080)
    """...and at least every this many minutes."""
    keep_last: int = Field(3, ge=1, le=1000)
    """How many of the newest committed checkpoints are kept, and as many of the newest
    the collapse detector tagged healthy (what `latest-healthy` and a rollback restore)
    besides them: at most twice this many; older ones are deleted after each commit."""
    credentials_secret: DnsSubdomain | None = None
    """Name of a Secret with the object store's credentials (Kubernetes only)."""
    credentials_dir: str | None = Field(None, min_length=1, max_length=4096)
    """Folder holding the object store's credentials as files named AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY (and optionally AWS_SESSION_TOKEN), e.g. a mounted Secret.
    Rollout pods read published weights from the store with it too: on Kubernetes mount
    it in `spec.rollout.pod` as in `spec.trainer.pod`. Unset: the standard AWS environment
    variables and config files."""
    endpoint_url: str | None = Field(None, pattern=ENDPOINT, max_length=2048)
    """Endpoint of an S3-compatible store (SeaweedFS, MinIO, Ceph…), e.g.
    `http://seaweedfs.storage:8333`. Unset: AWS S3 (or AWS_ENDPOINT_URL)."""
    region: str | None = Field(None, min_length=1, max_length=64)
    """Region of the bucket. Unset: AWS_REGION, else us-east-1."""
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """How buckets are addressed: `path` (most S3-compatible stores), `virtual`
    (bucket.host) or `auto`."""
    upload_concurrency: int = Field(8, ge=1, le=64)
    """Parallel uploads per trainer process: files, and the parts of a large file."""
    part_size_mb: int = Field(32, ge=5, le=5120)
    """Part size of multipart uploads, in MiB (S3 needs ≥ 5)."""
    upload_retry_minutes: float = Field(15.0, gt=0, le=1440)
    """How long a failed upload or commit is retried in the background, with exponential
    backoff, before that checkpoint is given up (training continues meanwhile); also how
    long a resume or rollback retries reads the store refuses for a while."""
    staging_dir: str | None = Field(None, min_length=1, max_length=4096)
    """Local folder where each trainer process writes its shards before uploading them
    (room for its share of one checkpoint). Unset: beside a file:// location, else the
    system's temporary folder."""
    resume: Literal["auto", "latest-healthy", "never"] = "auto"
    """What a (re)started trainer does when the location holds committed checkpoints:
    `auto` resumes from the latest, `latest-healthy` from the newest one the collapse
    detector tagged healthy, `never` starts afresh (on the operator: a restart still
    resumes the job's own, and a location holding another job's checkpoints is refused
    rather than overwritten)."""
    grace_period_seconds: float = Field(60.0, ge=5, le=3600)
    """Time from SIGTERM (preemption, drain, suspend) to exit: the trainer writes an
    emergency checkpoint within it; on Kubernetes, the pods'
    terminationGracePeriodSeconds."""

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str | None) -> str | None:
        return checked(uri, location_problem)

    @field_validator("endpoint_url", mode="before")  # before the pattern: say why
    @classmethod
    def _http_endpoint(cls, url: Any) -> Any:
        return checked(url, endpoint_problem) if isinstance(url, str) else url
