"""The S3 backend (boto3): AWS or any S3-compatible store (SeaweedFS, MinIO, Ceph…).

Large files go up as parallel multipart uploads (boto3's transfer manager); an object
only appears once its upload completed, so a killed upload leaves no partial object.
botocore retries each request a few times; callers add longer retries on top for errors
marked transient. Every botocore error is translated into a StorageError whose text is
ours plus the server's redacted message: credentials never reach a log line.
"""

from __future__ import annotations

import io
import logging
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

import boto3
import botocore.exceptions as bex
import botocore.session
from boto3.exceptions import Boto3Error, RetriesExceededError, S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.loaders import create_loader

from rlft.trainer.config.locations import BUCKET, NO_CREDENTIALS, holds_credentials, shown
from rlft.trainer.secret_sources import remember
from rlft.trainer.storage.backends import ObjectInfo, S3Options, check_key, os_error
from rlft.trainer.storage.errors import (
    BadUriError,
    BucketMissingError,
    CredentialsError,
    ObjectMissingError,
    StorageError,
    redact,
)

_CREDENTIAL_FILES = {
    "aws_access_key_id": ("AWS_ACCESS_KEY_ID", "aws_access_key_id", "accessKeyId"),
    "aws_secret_access_key": (
        "AWS_SECRET_ACCESS_KEY",
        "aws_secret_access_key",
        "secretAccessKey",
    ),
    "aws_session_token": ("AWS_SESSION_TOKEN", "aws_session_token", "sessionToken"),
}
log = logging.getLogger("rlft.storage")

_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
    "502",
    "504",
}
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "InvalidClientTokenId",
    "403",
}
_CONNECTION_ERRORS = (
    bex.EndpointConnectionError,
    bex.ConnectionError,
    bex.ConnectTimeoutError,
    bex.ReadTimeoutError,
    bex.ConnectionClosedError,
    bex.HTTPClientError,
)
# A response cut short or garbled on its way: the next try reads it whole. Other client
# errors with no S3 code (an endpoint botocore cannot resolve, a bad parameter) are
# mistakes no retry mends.
_STREAM_ERRORS = (
    bex.IncompleteReadError,
    bex.ResponseStreamingError,
    bex.ChecksumError,
    bex.FlexibleChecksumError,
)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Bucket and key prefix (no trailing slash) of `s3://bucket/prefix`."""
    if holds_credentials(uri):  # not repeated: the message would carry the secret
        raise BadUriError(f"the S3 location {NO_CREDENTIALS}")
    parsed = urlparse(uri)
    bucket = parsed.netloc
    if parsed.scheme != "s3" or not bucket:
        raise BadUriError(f"{shown(uri)}: an S3 URI looks like s3://bucket/prefix")
    if not BUCKET.match(bucket):
        raise BadUriError(
            f"{shown(uri)}: {bucket!r} is not a valid bucket name (3–63 lower-case letters, "
            "digits, dots and hyphens)"
        )
    if parsed.query or parsed.fragment:
        raise BadUriError(f"{shown(uri)}: an S3 URI has no query or fragment")
    return bucket, parsed.path.strip("/")


def read_credentials_dir(folder: str) -> dict[str, str]:
    """Credentials from a mounted Secret: one file per key, named like the environment
    variable (AWS_ACCESS_KEY_ID) or its lower-case form."""
    path = Path(folder)
    if not path.is_dir():
        raise CredentialsError(
            f"credentials folder {folder} does not exist: mount the Secret there or unset "
            "spec.checkpoint.credentialsDir"
        )
    found: dict[str, str] = {}
    for key, names in _CREDENTIAL_FILES.items():
        for name in names:
            file = path / name
            if file.is_file():
                found[key] = file.read_text().strip()
                break
    missing = [k for k in ("aws_access_key_id", "aws_secret_access_key") if k not in found]
    if missing:
        wanted = " and ".join(_CREDENTIAL_FILES[k][0] for k in missing)
        raise CredentialsError(f"credentials folder {folder} has no file named {wanted}")
    return found


def _error_code(error: BaseException) -> tuple[str | None, str]:
    """The S3 error code (or HTTP status) and the server's message, if any."""
    if isinstance(error, bex.ClientError):
        body = error.response.get("Error", {})
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = body.get("Code") or (str(status) if status else None)
        if code and code.isdigit() and status == 404:
            code = "NotFound"
        return code, str(body.get("Message") or "")
    match = re.search(r"An error occurred \((\w+)\)", str(error))
    return (match.group(1) if match else None), ""


def _past_the_end(error: BaseException) -> bool:
    """A ranged read that starts at or after the object's end (HTTP 416)."""
    if not isinstance(error, bex.ClientError):
        return False
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status == 416 or error.response.get("Error", {}).get("Code") == "InvalidRange"


# One loader of botocore's service descriptions for the process: each session otherwise
# parses S3's JSON model again (~70 ms of CPU per storage opened; a rollout server opens
# one per weight version it loads). Sessions stay per storage: a shared one would keep
# the first credentials it resolved from the environment.
_LOADER = create_loader()


def _session(credentials: dict[str, str]) -> boto3.session.Session:
    core = botocore.session.Session()
    core.register_component("data_loader", _LOADER)
    return boto3.session.Session(botocore_session=core, **credentials)


class S3Storage:
    """Objects under `s3://bucket/prefix`."""

    def __init__(self, uri: str, options: S3Options):
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = parse_s3_uri(uri)
        if options.endpoint_url and holds_credentials(options.endpoint_url):
            raise BadUriError(f"the S3 endpoint URL {NO_CREDENTIALS}")
        self.options = options
        credentials: dict[str, str] = {}
        if options.credentials_dir:
            credentials = read_credentials_dir(options.credentials_dir)
        self._secrets = [
            credentials.get("aws_secret_access_key"),
            credentials.get("aws_session_token"),
            os.environ.get("AWS_SECRET_ACCESS_KEY"),
            os.environ.get("AWS_SESSION_TOKEN"),
        ]
        remember(self._secrets)
        region = (
            options.region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1"
        )
        config = Config(
            region_name=region,
            connect_timeout=options.connect_timeout_s,
            read_timeout=options.read_timeout_s,
            retries={"max_attempts": options.max_attempts, "mode": "standard"},
            max_pool_connections=max(10, 2 * options.upload_concurrency),
            s3={"addressing_style": options.addressing_style},
            # S3-compatible stores differ in their support of the newer default CRC
            # checksums; integrity is checked end to end by the manifest's SHA-256.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._config = config
        self._credentials = credentials
        self._rotating = threading.Lock()
        self._client = self._new_client()
        part = options.part_size_mb << 20
        self._transfer = TransferConfig(
            multipart_threshold=part,
            multipart_chunksize=part,
            max_concurrency=options.upload_concurrency,
            use_threads=True,
        )

    # ------------------------------------------------------------------ helpers

    def _new_client(self):
        return _session(self._credentials).client(
            "s3", endpoint_url=self.options.endpoint_url, config=self._config
        )

    def _rotated(self) -> bool:
        """Whether credentialsDir now holds other credentials than the client's (the
        kubelet updates a mounted Secret when it is rotated; a run of weeks outlives a
        key): the client is rebuilt with them."""
        if not self.options.credentials_dir:
            return False
        try:
            current = read_credentials_dir(self.options.credentials_dir)
        except (CredentialsError, OSError):
            return False
        with self._rotating:
            if current == self._credentials:
                return False
            self._credentials = current
            secret_keys = ("aws_secret_access_key", "aws_session_token")
            self._secrets += [current.get(key) for key in secret_keys]
            remember(self._secrets)
            self._client = self._new_client()
        return True

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _full(self, prefix: str) -> str:
        """The bucket key prefix of a prefix under this location."""
        return (f"{self.prefix}/" if self.prefix else "") + prefix

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def _translate(self, error: BaseException, what: str) -> StorageError:
        where = f"{what} at {self.uri}"
        inner = error
        if isinstance(error, S3UploadFailedError):
            inner = error.__cause__ or error.__context__ or error
        elif isinstance(error, RetriesExceededError):  # a download's reads kept failing
            inner = error.last_exception or error
        if isinstance(inner, bex.NoCredentialsError | bex.PartialCredentialsError):
            return CredentialsError(
                f"no S3 credentials for {where}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or mount them with spec.checkpoint.credentialsSecret"
            )
        # Only the inner error is classified: an upload's own message names the bucket
        # and key, and "interconnect-ckpt" read as an unreachable endpoint, retried for
        # uploadRetryMinutes where the credentials had been refused.
        # s3transfer retries a download's reads on the socket's own errors and ends with
        # the last (RetriesExceededError): a network fault too, not a damaged object.
        if isinstance(inner, (*_CONNECTION_ERRORS, OSError)):
            endpoint = self.options.endpoint_url or "the S3 endpoint"
            return StorageError(f"cannot reach {endpoint} for {where}", transient=True)
        code, message = _error_code(inner)
        if code == "NoSuchBucket":
            return BucketMissingError(
                f"bucket {self.bucket!r} does not exist ({where}): create it or fix "
                "spec.checkpoint.uri"
            )
        if code in ("NoSuchKey", "NotFound", "404"):
            return ObjectMissingError(f"{where}: no such object")
        if code in _CREDENTIAL_CODES:
            if self._rotated():  # retried (transient) with the new ones
                return CredentialsError(
                    f"the object store rejected the credentials ({code}) for {where}; "
                    "credentialsDir holds new ones now: retrying with them",
                    transient=True,
                )
            return CredentialsError(
                f"the object store rejected the credentials ({code}) for {where}: check the "
                "access key and secret (spec.checkpoint.credentialsSecret or AWS_* variables)"
            )
        if code is None:
            transient = isinstance(inner, _STREAM_ERRORS)
            code, message = type(inner).__name__, str(inner)
        else:
            transient = code in _TRANSIENT_CODES
        detail = redact(message, self._secrets)
        suffix = f": {detail}" if detail else ""
        return StorageError(f"{where} failed ({code}){suffix}", transient=transient)

    def _call(self, what: str, fn, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (bex.BotoCoreError, bex.ClientError, Boto3Error) as error:
            raise self._translate(error, what) from None

    # --------------------------------------------------------------- operations

    def put_file(self, key: str, path: Path, *, move: bool = False) -> None:
        self._call(
            f"uploading {key}",
            self._client.upload_file,
            str(path),
            self.bucket,
            self._key(key),
            Config=self._transfer,
        )

    def put_bytes(self, key: str, data: bytes) -> None:
        if len(data) < self._transfer.multipart_threshold:
            self._call(
                f"writing {key}",
                self._client.put_object,
                Bucket=self.bucket,
                Key=self._key(key),
                Body=data,
            )
            return
        # Published weights are one object the size of the model: one PUT stops at 5 GB
        # on AWS, parts do not (and go up in parallel).
        self._call(
            f"writing {key}",
            self._client.upload_fileobj,
            io.BytesIO(data),
            self.bucket,
            self._key(key),
            Config=self._transfer,
        )

    def get_bytes(self, key: str) -> bytes:
        with self.open_read(key) as stream:
            return stream.read()

    def get_file(self, key: str, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._call(
                f"downloading {key}",
                self._client.download_file,
                self.bucket,
                self._key(key),
                str(path),
                Config=self._transfer,
            )
        except OSError as error:  # the local side: s3transfer raises it as it is
            what = f"downloading {key} from {self.uri}"
            raise os_error(error, what, str(path.parent), room=None) from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        what = f"reading bytes {start}-{start + length - 1} of {key}"
        try:
            response = self._client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
            )
        except (bex.BotoCoreError, bex.ClientError, Boto3Error) as error:
            if _past_the_end(error):
                # As a file reads: nothing past the end (a truncated or emptied object is
                # damage for the manifest's sizes to find, not a failing store).
                return b""
            raise self._translate(error, what) from None
        try:
            return response["Body"].read()
        except (bex.BotoCoreError, bex.ClientError) as error:
            raise self._translate(error, what) from None
        finally:
            response["Body"].close()

    @contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        response = self._call(
            f"reading {key}", self._client.get_object, Bucket=self.bucket, Key=self._key(key)
        )
        body = response["Body"]
        try:
            yield body
        except (bex.BotoCoreError, bex.ClientError) as error:
            raise self._translate(error, f"reading {key}") from None
        finally:
            body.close()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        full = self._full(prefix)
        found: list[ObjectInfo] = []
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=full
        )
        try:
            for page in pages:
                for item in page.get("Contents", []):
                    found.append(ObjectInfo(self._relative(item["Key"]), int(item["Size"])))
        except (bex.BotoCoreError, bex.ClientError) as error:
            raise self._translate(error, f"listing {prefix or '/'}") from None
        return sorted(found, key=lambda info: info.key)

    def exists(self, key: str) -> bool:
        try:
            self._call(
                f"checking {key}", self._client.head_object, Bucket=self.bucket, Key=self._key(key)
            )
        except ObjectMissingError:
            return False
        return True

    def delete_prefix(self, prefix: str) -> int:
        doomed = [self._key(info.key) for info in self.list(prefix)]
        for start in range(0, len(doomed), 1000):
            batch = [{"Key": key} for key in doomed[start : start + 1000]]
            response = self._call(
                f"deleting {prefix}",
                self._client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": batch, "Quiet": True},
            )
            if response.get("Errors"):
                first = response["Errors"][0]
                raise StorageError(
                    f"deleting {prefix} at {self.uri} failed for {len(response['Errors'])} "
                    f"objects ({first.get('Code')})",
                    transient=True,
                )
        if not prefix or prefix.endswith("/"):  # a folder: a single key has none
            try:
                self._abort_uploads(prefix)
            except StorageError as error:
                # Best effort: a key without s3:ListBucketMultipartUploads still deletes
                # (a lifecycle rule, AbortIncompleteMultipartUpload, removes the parts).
                log.warning("the unfinished uploads under %s stay: %s", prefix, error)
        return len(doomed)

    def _abort_uploads(self, prefix: str) -> None:
        """Abort the multipart uploads left under `prefix`: a process killed mid-upload
        (preempted, OOM, the grace watchdog's exit) leaves its parts stored and billed,
        invisible to listings; only an abort removes them."""
        full = self._full(prefix)
        pages = self._client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=full
        )
        what = f"aborting the uploads under {prefix}"
        try:
            uploads = [u for page in pages for u in page.get("Uploads", [])]
        except (bex.BotoCoreError, bex.ClientError) as error:
            if _error_code(error)[0] in ("NotImplemented", "501"):
                return  # a store without multipart listings
            raise self._translate(error, what) from None
        for upload in uploads:
            try:
                self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
            except (bex.BotoCoreError, bex.ClientError) as error:
                if _error_code(error)[0] != "NoSuchUpload":  # not finished meanwhile
                    raise self._translate(error, what) from None
