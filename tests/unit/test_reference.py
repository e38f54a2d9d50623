"""The configuration reference is generated from the models; the committed one must match."""

from __future__ import annotations

from pathlib import Path

from rlft.trainer.config import RLFineTuneSpec, Section
from rlft.trainer.config.docs import render


def test_committed_reference_is_current(repo_root: Path) -> None:
    committed = (repo_root / "docs" / "configuration.md").read_text()
    assert committed == render(), (
        "docs/configuration.md is stale: run "
        "`.venv/bin/python -m rlft.trainer.config.docs > docs/configuration.md`"
    )


def _sections(model: type[Section], seen: set) -> None:
    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
            for target in (candidate, *getattr(candidate, "__args__", ())):
                if isinstance(target, type) and issubclass(target, Section):
                    _sections(target, seen)


def test_every_field_of_every_section_is_documented_and_listed() -> None:
    seen: set = set()
    _sections(RLFineTuneSpec, seen)
    text = render()
    assert len(seen) > 10
    for model in seen:
        assert model.__doc__, f"{model.__name__} has no docstring"
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
            assert f".{field.alias}` |" in text, f"{model.__name__}.{name} missing from reference"
