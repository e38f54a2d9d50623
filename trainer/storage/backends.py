"""Where checkpoints live: a small key/value interface with a file and an S3 backend.

Keys are relative POSIX paths under the location the URI names (`step-000120/x.distcp`).
The checkpoint code only uses these operations, so a new backend is one class. Writes
are all-or-nothing: on `file://` a temp file is fsynced and renamed into place; on S3 an
object appears only once its (multipart) upload completed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Protocol
from urllib.parse import unquote, urlparse

from rlft.trainer.config.locations import shown
from rlft.trainer.storage.errors import (
    BadUriError,
    ObjectMissingError,
    StorageError,
    StorageFullError,
)

CHUNK = 8 << 20
TEMP_MARK = ".rlft-tmp-"


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key under the location's root and its size in bytes."""

    key: str
    size: int


class Storage(Protocol):
    """What the checkpoint code needs from a storage location."""

    uri: str
    """The location, as the user wrote it (never holds credentials)."""

    def put_file(self, key: str, path: Path, *, move: bool = False) -> None:
        """Store a local file under `key`; `move` allows consuming the local file."""

    def put_bytes(self, key: str, data: bytes) -> None:
        """Store `data` under `key`."""

    def get_bytes(self, key: str) -> bytes:
        """The object's content; ObjectMissingError when absent."""

    def get_file(self, key: str, path: Path) -> None:
        """Copy the object to a local file (written atomically)."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes of the object from offset `start` (fewer at its end)."""

    @contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        """A readable stream of the object (for hashing without a local copy)."""

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, sorted by key."""

    def exists(self, key: str) -> bool:
        """Whether the object exists."""

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix`; the number deleted."""


def check_key(key: str) -> str:
    """A key must be a relative path without `..` (it must stay inside the location)."""
    parts = PurePosixPath(key).parts
    if not key or key.startswith("/") or ".." in parts or TEMP_MARK in key:
        raise ValueError(f"invalid storage key {key!r}")
    return key


def sha256_stream(stream: BinaryIO) -> tuple[int, str]:
    """Size and SHA-256 hex digest of a stream, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    while chunk := stream.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def sha256_file(path: Path) -> tuple[int, str]:
    with open(path, "rb") as stream:
        return sha256_stream(stream)


def sha256_blocks(path: Path, block_bytes: int) -> tuple[int, str, tuple[str, ...]]:
    """Size and SHA-256 of a file, and the SHA-256 of each `block_bytes` piece of it, in
    one read."""
    whole = hashlib.sha256()
    blocks: list[str] = []
    size = 0
    with open(path, "rb") as stream:
        while True:
            piece = hashlib.sha256()
            filled = 0
            while filled < block_bytes and (chunk := stream.read(min(CHUNK, block_bytes - filled))):
                whole.update(chunk)
                piece.update(chunk)
                filled += len(chunk)
            if filled == 0 and blocks:
                break
            blocks.append(piece.hexdigest())
            size += filled
            if filled < block_bytes:
                break
    return size, whole.hexdigest(), tuple(blocks)


# ------------------------------------------------------------------------ file://


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def os_error(
    error: OSError, what: str, location: str, room: str | None = "spec.checkpoint.uri"
) -> StorageError:
    """The StorageError of a file system's error; a full disk says to point `room` (what
    chose the folder, if the user did) at a larger volume."""
    if error.errno in _FULL:
        larger = f" or point {room} at a larger volume" if room else ""
        return StorageFullError(
            f"no space left on the device {what} under {location}: free space{larger} "
            "(the partial file was removed)"
        )
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        other = f" or choose another {room}" if room else ""
        return StorageError(
            f"permission denied {what} under {location}: make the folder writable by the "
            f"trainer{other}"
        )
    # A network file system's passing faults (a server restarting, a stale handle).
    transient = error.errno in (errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN)
    return StorageError(f"{what} under {location} failed: {error.strerror}", transient=transient)


def _may_hold(folder: str, prefix: str) -> bool:
    """Whether keys under `folder` (ending in /) can start with `prefix`."""
    return folder.startswith(prefix) or prefix.startswith(folder)


class FileStorage:
    """A folder on a local or mounted file system."""

    def __init__(
        self, root: Path, uri: str | None = None, room: str | None = "spec.checkpoint.uri"
    ):
        self.root = root
        self.uri = uri or root.as_uri()
        self.room = room  # what chose the folder, for a full disk's advice

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _write_atomically(self, key: str, fill) -> None:
        target = self._path(key)
        temp = target.parent / f"{TEMP_MARK}{uuid.uuid4().hex}-{target.name}"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(temp, "wb") as out:
                fill(out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, target)
            _fsync_dir(target.parent)
        except OSError as error:
            temp.unlink(missing_ok=True)
            raise os_error(error, f"writing {key}", self.uri, self.room) from None

    def put_file(self, key: str, path: Path, *, move: bool = False) -> None:
        if move and self._moved(key, path):
            return

        def copy(out: BinaryIO) -> None:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, out, CHUNK)

        self._write_atomically(key, copy)

    def _moved(self, key: str, path: Path) -> bool:
        """Rename `path` into place; False (copy it instead) when it is on another file
        system, or on another mount of the same one: the device numbers match across a
        bind mount, and the rename is refused there (EXDEV)."""
        target = self._path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if os.stat(path).st_dev != os.stat(target.parent).st_dev:
                return False
            with open(path, "rb+") as src:
                os.fsync(src.fileno())
            os.replace(path, target)
            _fsync_dir(target.parent)
        except OSError as error:
            if error.errno == errno.EXDEV:
                return False
            raise os_error(error, f"writing {key}", self.uri, self.room) from None
        return True

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write_atomically(key, lambda out: out.write(data))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectMissingError(f"{self.uri}/{key} does not exist") from None
        except OSError as error:
            raise os_error(error, f"reading {key}", self.uri) from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with self._path(key).open("rb") as stream:
                stream.seek(start)
                return stream.read(length)
        except FileNotFoundError:
            raise ObjectMissingError(f"{self.uri}/{key} does not exist") from None
        except OSError as error:
            raise os_error(error, f"reading {key}", self.uri) from None

    def get_file(self, key: str, path: Path) -> None:
        source = self._path(key)
        if not source.is_file():
            raise ObjectMissingError(f"{self.uri}/{key} does not exist")
        FileStorage(path.parent, room=None).put_file(path.name, source)

    @contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        path = self._path(key)
        if not path.is_file():
            raise ObjectMissingError(f"{self.uri}/{key} does not exist")
        with open(path, "rb") as stream:
            yield stream

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        found: list[ObjectInfo] = []
        if not self.root.is_dir():
            return found

        def unreadable(error: OSError) -> None:
            # os.walk skips a folder it cannot read unless told: a passing NFS fault on a
            # step folder made a resume go back to an older step, on the root a fresh
            # start whose retention deleted every checkpoint.
            if not isinstance(error, FileNotFoundError):  # deleted while listing
                raise os_error(error, f"listing {error.filename}", self.uri) from None

        for folder, subfolders, names in os.walk(self.root, onerror=unreadable):
            # Folders whose keys cannot start with `prefix` are not walked: a checkpoint
            # catalog lists its step folders beside thousands of history segments.
            above = Path(folder).relative_to(self.root).as_posix()
            above = "" if above == "." else f"{above}/"
            subfolders[:] = [
                d for d in subfolders
                if not d.startswith(TEMP_MARK) and _may_hold(f"{above}{d}/", prefix)
            ]  # fmt: skip
            for name in names:
                if name.startswith(TEMP_MARK):
                    continue
                path = Path(folder) / name
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    try:
                        found.append(ObjectInfo(key, path.stat().st_size))
                    except FileNotFoundError:
                        continue  # deleted while listing
        return sorted(found, key=lambda info: info.key)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete_prefix(self, prefix: str) -> int:
        doomed = self.list(prefix)
        for info in doomed:
            self._path(info.key).unlink(missing_ok=True)
        # A folder's delete also removes what is left below it: empty folders and stale
        # temp files. Not a key's: other writers (ranks uploading their shards beside a
        # manifest being withdrawn) may have a temp file or a fresh folder there.
        if not prefix.endswith("/"):
            return len(doomed)
        base = self.root / prefix
        if base.is_dir() and base != self.root:
            for folder, _, names in sorted(os.walk(base), key=lambda w: -len(w[0])):
                for name in names:
                    if name.startswith(TEMP_MARK):
                        (Path(folder) / name).unlink(missing_ok=True)
                with suppress(OSError):
                    Path(folder).rmdir()
        return len(doomed)


# -------------------------------------------------------------------------- URIs


def parse_file_uri(uri: str) -> Path:
    """The folder of a `file:///abs/path` URI or a plain path."""
    if "://" not in uri:
        return Path(uri).expanduser().resolve()
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        raise BadUriError(f"{shown(uri)}: not a file URI")
    if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
        raise BadUriError(
            f"{shown(uri)}: a file URI needs an absolute path with three slashes, "
            "e.g. file:///data/checkpoints"
        )
    # Percent-decoded: the URIs rlft prints (`Path.as_uri`: a space is %20) come back.
    return Path(unquote(parsed.path))


def open_storage(uri: str, s3: S3Options | None = None) -> Storage:
    """The backend for `uri`: `s3://bucket/prefix`, `file:///path` or a plain path."""
    if not isinstance(uri, str) or not uri.strip():
        raise BadUriError("the checkpoint URI is empty: use s3://bucket/prefix or file:///path")
    scheme = urlparse(uri).scheme if "://" in uri else ""
    if scheme == "s3":
        from rlft.trainer.storage.s3 import S3Storage

        return S3Storage(uri, s3 or S3Options())
    if scheme in ("", "file"):
        return FileStorage(parse_file_uri(uri), uri if scheme else None)
    raise BadUriError(
        f"{shown(uri)}: unsupported scheme {scheme!r}; use s3://bucket/prefix or file:///path"
    )


@dataclass(frozen=True)
class S3Options:
    """How to reach an S3-compatible store (from spec.checkpoint)."""

    endpoint_url: str | None = None
    """None: AWS (or AWS_ENDPOINT_URL from the environment)."""
    region: str | None = None
    addressing_style: str = "auto"
    """`auto`, `path` (most S3-compatible stores) or `virtual`."""
    upload_concurrency: int = 8
    """Parallel part uploads per file, and files uploaded at once."""
    part_size_mb: int = 32
    """Multipart chunk size."""
    credentials_dir: str | None = None
    """Folder with the credentials as files (a mounted Secret); None: the environment."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    max_attempts: int = 3
    """Retries inside botocore for each request, after its first attempt (botocore's
    `retries.max_attempts` counts retries: 3 is 4 attempts); callers retry on top."""
