"""`store` publication: policy version V as a Hugging Face folder under a location.

Layout under the location (file:// or s3://, the checkpoint code's storage backends):

    v-00000012/config.json
    v-00000012/model.safetensors
    v-00000012/READY          written last: a version without it does not exist
    LATEST                    the newest ready version, as text ("12")

Rollout instances load `v-…/` on `POST /weights {uri}`; a newly started instance reads
`LATEST` and catches up before it serves (`latest_uri`). Old versions are deleted once
`keep` newer ones are ready, so an instance still loading an older one finds it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rlft.trainer.storage.backends import FileStorage, S3Options, Storage, open_storage
from rlft.trainer.storage.errors import ObjectMissingError

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
READY = "READY"
LATEST = "LATEST"


def version_key(version: int) -> str:
    return f"v-{version:08d}"


def unique_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state without aliases (tied embeddings): the first name of each storage wins,
    which is the Hugging Face name (`embed_tokens` before `lm_head`)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous().cpu()
    return out


def serialize(model: torch.nn.Module) -> bytes:
    """The model's weights as safetensors bytes (a snapshot: later updates do not leak in)."""
    return save_safetensors(unique_tensors(model.state_dict()))


def config_json(model: torch.nn.Module) -> str:
    """The model's config.json; `architectures` is set as `save_pretrained` would (vLLM
    picks the model class, and generation vs pooling, from it)."""
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    # The trainer's local folder of the model (as save_pretrained drops it): nothing a
    # server needs, and a path of the trainer's machine in a shared store.
    config.pop("_name_or_path", None)
    return json.dumps(config, indent=2, sort_keys=True)


class WeightStore:
    """Writes and finds published versions under one location."""

    def __init__(self, storage: Storage, keep: int = 3):
        self.storage = storage
        self.keep = max(2, keep)

    @classmethod
    def at(cls, uri: str, keep: int = 3, s3: S3Options | None = None) -> WeightStore:
        """The store at `uri`; `s3`: how to reach it (the job's spec.checkpoint: the
        operator puts the weights under its checkpoint location)."""
        return cls(open_storage(uri, s3), keep)

    def uri_of(self, version: int) -> str:
        return f"{self.storage.uri.rstrip('/')}/{version_key(version)}"

    def write(self, version: int, weights: bytes, config: str) -> str:
        """Publish `version`; returns its URI. Readers never see a half-written version."""
        folder = version_key(version)
        self.storage.put_bytes(f"{folder}/{CONFIG_FILE}", config.encode())
        self.storage.put_bytes(f"{folder}/{WEIGHTS_FILE}", weights)
        self.storage.put_bytes(f"{folder}/{READY}", json.dumps({"version": version}).encode())
        self.storage.put_bytes(LATEST, str(version).encode())
        self._prune(version)
        return self.uri_of(version)

    def _folders(self) -> dict[int, set[str]]:
        """Each version folder's file names, published or not."""
        found: dict[int, set[str]] = {}
        for info in self.storage.list("v-"):
            folder, _, name = info.key.partition("/")
            number = folder.removeprefix("v-")
            if number.isdigit():
                found.setdefault(int(number), set()).add(name)
        return found

    def versions(self) -> list[int]:
        return sorted(v for v, names in self._folders().items() if READY in names)

    def numbers(self) -> list[int]:
        """Every version with a folder, ready or cut short: numbers that are taken."""
        return sorted(self._folders())

    def latest(self) -> int | None:
        try:
            return int(self.storage.get_bytes(LATEST).decode().strip())
        except ObjectMissingError:
            versions = self.versions()
            return versions[-1] if versions else None

    def latest_uri(self) -> tuple[int, str] | None:
        version = self.latest()
        return None if version is None else (version, self.uri_of(version))

    def _prune(self, newest: int) -> None:
        """Versions older than the `keep` newest ready ones up to `newest`, published or
        not: a write cut short (the store failing mid-version, the publisher killed)
        leaves a folder without READY that no reader takes and nothing else would remove.
        Counted in ready versions, not numbers: a broadcast writes a store copy only when
        its group is re-formed, and the previous copy (what a restarted instance loads,
        from LATEST) may be any number of versions behind the new one."""
        folders = self._folders()
        ready = sorted(v for v, names in folders.items() if READY in names and v <= newest)
        if len(ready) < self.keep:
            return
        oldest_kept = ready[-self.keep]
        for version in sorted(folders):
            if version < oldest_kept:
                self.storage.delete_prefix(f"{version_key(version)}/")


@contextmanager
def fetched(uri: str, scratch: Path | None = None, s3: S3Options | None = None) -> Iterator[Path]:
    """Version `uri` as a local folder for the length of the block: file:// as it is,
    s3:// downloaded and the download removed after it. A rollout instance loads a new
    version every few steps for weeks; a copy kept per version would fill its disk."""
    storage = open_storage(uri, s3)
    if not storage.exists(READY):
        raise ObjectMissingError(
            f"{uri} is not a published weight version (no {READY} marker): publish it first"
        )
    if isinstance(storage, FileStorage):
        yield storage.root
        return
    local = Path(tempfile.mkdtemp(prefix="rlft-weights-", dir=scratch))
    try:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            storage.get_file(name, local / name)
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_safetensors((folder / WEIGHTS_FILE).read_bytes())
