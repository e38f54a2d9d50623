"""`rlft export`: a Hugging Face folder (config, safetensors, tokenizer) that transformers
and vLLM load, from a finished run's final model (`outputs/model/` under the checkpoint
location) or from a checkpoint. A checkpoint needs nothing else: the saver stores the
model's config and tokenizer files under `hf/` in every checkpoint."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlft.trainer.checkpoint.catalog import Catalog
from rlft.trainer.checkpoint.errors import CheckpointError
from rlft.trainer.checkpoint.loader import LocalCopy
from rlft.trainer.checkpoint.manifest import (
    HF_DIR,
    OUTPUTS,
    Manifest,
    Which,
    split_location,
    step_dir,
)
from rlft.trainer.checkpoint.state import apply_tensor_state, tensor_state
from rlft.trainer.storage.backends import S3Options, Storage, open_storage


def hf_files_of(model: torch.nn.Module, tokenizer=None) -> dict[str, bytes]:
    """The small files a Hugging Face folder needs besides the weights (config,
    generation config, tokenizer), to store in every checkpoint."""
    with tempfile.TemporaryDirectory() as folder:
        model.config.save_pretrained(folder)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        return {
            path.relative_to(folder).as_posix(): path.read_bytes()
            for path in sorted(Path(folder).rglob("*"))
            if path.is_file()
        }


def export_hf(
    location: str,
    out_dir: Path,
    *,
    which: Which | None = None,
    s3: S3Options | None = None,
    storage: Storage | None = None,
) -> Manifest:
    """Write the checkpoint at `location` (a folder `…/step-N`, or a checkpoint location
    for its latest) to `out_dir` as a Hugging Face model folder. Nothing is left behind
    on failure; an existing non-empty `out_dir` is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlft.trainer.model.construct import from_config

    base, chosen = split_location(location)
    which = chosen if which is None else which
    storage = storage or open_storage(base, s3)
    catalog = Catalog(storage)
    local = LocalCopy(storage, None, 0, 1)
    chosen_manifest: list[Manifest] = []
    loaded: list[Any] = []

    def check(manifest: Manifest) -> list[str]:
        """Its files, then its model's weights read (only those: not the optimizer's)."""
        if problems := _hf_problems(manifest) or local.fetch(manifest):
            return problems
        assert local.path is not None
        config = AutoConfig.from_pretrained(local.path / HF_DIR, local_files_only=True)
        model = from_config(AutoModelForCausalLM, config, dtype=getattr(config, "dtype", None))
        state = tensor_state(model, None)
        if damage := local.read(state):
            return damage
        apply_tensor_state(model, None, state)
        loaded[:] = [model]
        return []

    def fill(work: Path) -> None:
        manifest = catalog.choose(
            which,
            check=check,
            purpose=f"export of {step_dir(which)}" if isinstance(which, int) else "export",
            advice="export another step (`rlft checkpoints verify` checks them)",
        )
        chosen_manifest.append(manifest)
        assert local.path is not None
        hf = local.path / HF_DIR
        loaded[0].save_pretrained(work)
        # The checkpoint's own files after the weights: save_pretrained writes a
        # generation_config.json derived from config.json alone, and an instruct model's
        # (its end-of-turn stop tokens, its sampling defaults) was lost.
        for path in hf.rglob("*"):
            if path.is_file():
                target = work / path.relative_to(hf)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)

    try:
        _into_new_folder(Path(out_dir), fill)
    finally:
        local.cleanup()
    return chosen_manifest[0]


FINAL_MODEL = f"{OUTPUTS}/model/"
FINISHED = f"{OUTPUTS}/summary.json"


def export_final(location: str, out_dir: Path, *, s3: S3Options | None = None) -> bool:
    """Copy a finished run's final model (`<location>/outputs/model/`, published by rank 0
    after the last step) to `out_dir`; False when the location holds no finished run.
    The summary is published last, so its presence says the model is complete."""
    storage = open_storage(location, s3)
    if not storage.exists(FINISHED):
        return False
    files = [info.key for info in storage.list(FINAL_MODEL)]
    if f"{FINAL_MODEL}config.json" not in files:
        return False

    def fill(work: Path) -> None:
        for key in files:
            target = work / key.removeprefix(FINAL_MODEL)
            target.parent.mkdir(parents=True, exist_ok=True)
            storage.get_file(key, target)

    _into_new_folder(Path(out_dir), fill)
    return True


def _into_new_folder(out_dir: Path, fill: Callable[[Path], None]) -> None:
    """Run `fill` on a scratch folder beside `out_dir`, then rename it into place: a
    failure leaves nothing behind, and an existing non-empty `out_dir` is refused."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir} exists and is not empty: choose a new folder")
    # Made before the download, so a parent that cannot be is found then, not by the
    # rename after it; the folders made here go again if the export fails.
    made = [p for p in reversed(out_dir.parents) if not p.exists()]
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"cannot make {out_dir.parent} ({error.strerror})") from None
    work = Path(tempfile.mkdtemp(prefix=".rlft-export-", dir=out_dir.parent))
    exported = False
    try:
        fill(work)
        _as_new_files(work)
        if out_dir.exists():
            out_dir.rmdir()
        work.rename(out_dir)
        exported = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for folder in [] if exported else reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _as_new_files(folder: Path) -> None:
    """The permissions new files and folders get here (the umask's), on `folder` and all
    in it: mkdtemp's folder is the owner's alone (0700), and so is the model.safetensors
    transformers writes (0600), and a model server of another user could not read the
    export."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _hf_problems(manifest: Manifest) -> list[str]:
    if not any(entry.path == f"{HF_DIR}/config.json" for entry in manifest.files):
        return [f"no {HF_DIR}/config.json (saved without hf_files): cannot export"]
    return []
