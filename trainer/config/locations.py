"""What a storage location in a job may look like, checked where the job is read (and by
the S3 backend, for locations given on the command line): a bad one used to pass
validation and fail only once the run reached it (after a warm start), and one holding
credentials was echoed into errors, logs and the job's status."""

from __future__ import annotations

import re
from urllib.parse import urlparse

BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,61}[a-z0-9]$")
"""An S3 bucket name (underscores: older buckets and some S3-compatible stores)."""

ENDPOINT = r"^https?://[^\s/@?#]+(/[^\s?#]*)?$"
"""An S3 endpoint: http(s), a host, a path; no credentials, query or fragment."""

NO_CREDENTIALS = (
    "must not hold credentials (user:secret@): give them by spec.checkpoint."
    "credentialsSecret, credentialsDir or the AWS environment"
)


def holds_credentials(url: str) -> bool:
    """True when the URL's authority has a user-info part (`user:secret@host`)."""
    return "@" in (urlparse(url).netloc if "://" in url else "")


def shown(uri: str) -> str:
    """`uri` as a message may repeat it: without a user-info part, query or fragment,
    where a secret may be (`https://key:secret@host/…`, `s3://b/x?token=…`)."""
    if "://" not in uri:
        return repr(uri)
    parsed = urlparse(uri)
    host = parsed.netloc.rpartition("@")[2]
    hidden = "…@" if "@" in parsed.netloc else ""
    rest = "?…" if parsed.query or parsed.fragment else ""
    return repr(f"{parsed.scheme}://{hidden}{host}{parsed.path}{rest}")


def location_problem(uri: str) -> str | None:
    """Why `uri` is not `s3://bucket[/prefix]` or `file:///absolute/path`, or None. The
    answer never repeats the URI (it may hold a secret)."""
    if holds_credentials(uri):
        return NO_CREDENTIALS
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        if not BUCKET.match(parsed.netloc):
            return (
                "must look like s3://bucket/prefix, the bucket 3–63 lower-case letters, "
                "digits, dots and hyphens"
            )
        if parsed.query or parsed.fragment:
            return "an S3 location has no query or fragment (? or #)"
        return None
    if parsed.scheme == "file":
        if parsed.netloc or not parsed.path.startswith("/"):
            return "a file location is absolute: file:///path (three slashes)"
        return None
    return "must look like s3://bucket/prefix or file:///path"


def endpoint_problem(url: str) -> str | None:
    """Why `url` is not an http(s) endpoint without credentials, or None."""
    if holds_credentials(url):
        return NO_CREDENTIALS
    if re.search(r"[?#]", url):  # botocore refused it at the first request, not before
        return "must have no query or fragment (?… or #…): http://host:port or https://host"
    if not re.match(ENDPOINT, url):
        return "must look like http://host:port or https://host"
    return None
