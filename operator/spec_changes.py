"""Edits of a job's spec: which fields may change when, and how a change reaches the job.

| spec fields                                      | while it runs¹    | suspended², not started³ |
|--------------------------------------------------|-------------------|--------------------------|
| `suspend`, `restartPolicy`                       | yes               | yes                      |
| `trainer.replicas` (min and max)                 | yes: gang restart | yes                      |
| `model`, `algorithm.name`, `data.source`, `checkpoint.uri` | no      | not started only         |
| all else (hyperparameters, images, resources, …) | no                | yes, applied on resume⁴  |

¹ a status.phase other than Succeeded or Failed, and spec.suspend false (Suspended with
spec.suspend false is a resume under way: its pods may be being created). ² spec.suspend
true (set by the user, or by the operator when the trainer paused after a collapse),
whatever the phase. ³ no status.phase yet: the operator has not reconciled it. A
Succeeded or Failed job accepts edits of all but the identity fields, and never runs
again. ⁴ But not a model the checkpoints lack: a KL term added to a run that started
without a reference model fails the resume with exit 2, saying so (the reference would
be the policy as it was when the run started, which no checkpoint holds).

Why:

- **What the pods read cannot change under them.** Every pod reads the job file from the
  ConfigMap when it starts, and a torchrun worker restarted in place (an elastic
  membership change) reads it again: an edit applied while pods run would give one gang
  two job files. So the ConfigMap is re-rendered only when no pod of the job is active
  (suspended, or before the pods of a resume are created), or when only live fields
  differ (the trainer does not read those), and the API server refuses other edits
  while the job runs, naming the field: suspend the job, edit it, resume it.
- **Identity stays.** The checkpoints hold the model's weights and optimizer state, the
  algorithm's own state (a critic, a reference) and the data cursor, under
  `checkpoint.uri`: a resume with another model cannot load them, and one elsewhere
  would start over. A job that started keeps these; a new job (a new name and location)
  is the way to change them.
- **`trainer.replicas` restarts the gang.** `--nnodes=min:max` is in each torchrun
  agent's command, and each agent decides with its own numbers when the rendezvous is
  complete (torch's DynamicRendezvousHandler): pods added with a new max beside agents
  with the old one would not agree on the gang. A change is therefore applied as a gang
  restart at a rendezvous of its own: the trainer pods get SIGTERM (their emergency
  checkpoint), new ones are created from the new spec and resume from the latest
  healthy checkpoint, resharded to the new world size. The rollout pods keep running;
  it is not a failure and costs no restart budget.
- **`restartPolicy` and `suspend`** are read by the operator only, at each reconcile.

`status.observedGeneration` moves to metadata.generation only once the children reflect
it; while an edit waits, the `SpecApplied` condition says why (SuspendToApply: it reached
a running job anyway, through a CRD without these rules or a race; Rescaling).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlft.operator.status import RLFineTuneStatus, condition, set_condition
from rlft.trainer.config import RLFineTune, RLFineTuneSpec, dump_job

FINISHED_PHASES = ("Succeeded", "Failed")
"""Phases that never run again (status.TERMINAL_PHASES): any edit is accepted, none applied."""
LIVE = ("suspend", "restartPolicy", "trainer.replicas")
"""Spec paths that may change while the job runs."""
IDENTITY = {
    "model": "its checkpoints hold this model's weights and optimizer state",
    "algorithm.name": "its checkpoints hold this algorithm's state (a critic, a reference)",
    "data.source": "its checkpoints hold this data source's cursor",
    "checkpoint.uri": "its checkpoints are there: a resume elsewhere would start over",
}
"""Spec paths that never change once the job has started, and why."""
SHOWN_FIELDS = 8
"""How many changed fields a message names."""

_CEL_RESERVED = {
    "true", "false", "null", "in", "as", "break", "const", "continue", "else", "for",
    "function", "if", "import", "let", "loop", "package", "namespace", "return", "var",
    "void", "while",
}  # fmt: skip


# ------------------------------------------------------------------ admission (CEL)


def _has(root: str, path: str) -> str:
    parts = path.split(".")
    for part in parts:
        if part in _CEL_RESERVED:  # the API server would need it written __part__
            raise ValueError(f"spec.{path}: {part!r} is a CEL keyword")
    return " && ".join(f"has({root}.spec.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))


def _unchanged(path: str) -> str:
    """CEL: spec.<path> is absent in both, or present in both and equal."""
    new, old = _has("self", path), _has("oldSelf", path)
    return f"(({new}) ? (({old}) && self.spec.{path} == oldSelf.spec.{path}) : !({old}))"


def frozen_while_running(model: type[BaseModel] = RLFineTuneSpec, prefix: str = "") -> list[str]:
    """Spec paths that may not change while the job runs: every field but the LIVE ones
    (a section holding a live field is split into its own fields) and the identity-only
    ones (their own rule covers every phase). From the models, so a new field is frozen
    until someone decides otherwise."""
    out = []
    for name, info in model.model_fields.items():
        path = prefix + (info.alias or name)
        if path in LIVE or path in IDENTITY:
            continue
        inner = info.annotation
        if any(live.startswith(path + ".") for live in LIVE):
            assert isinstance(inner, type) and issubclass(inner, BaseModel), path
            out += frozen_while_running(inner, path + ".")
        else:
            out.append(path)
    return out


def transition_rules() -> list[dict[str, str]]:
    """The CRD's root-level transition rules (`oldSelf`: the stored object, status
    included), one per field so that the API server's message names it."""
    finished = ", ".join(f"'{p}'" for p in FINISHED_PHASES)
    started = "has(oldSelf.status) && has(oldSelf.status.phase)"
    suspended = "has(oldSelf.spec.suspend) && oldSelf.spec.suspend"
    # Not `phase == 'Suspended'`: once spec.suspend is false again the operator may be
    # creating the pods of the resume from the spec it read, before the phase says so.
    free = f"!({started}) || oldSelf.status.phase in [{finished}] || ({suspended})"
    rules = [
        {
            "rule": f"!({started}) || {_unchanged(path)}",
            "message": f"spec.{path} cannot change once the job has started: {why}; "
            "create a new job, with its own name and spec.checkpoint.uri",
            "fieldPath": f".spec.{path}",
        }
        for path, why in IDENTITY.items()
    ]
    live = ", ".join(f"spec.{p}" for p in LIVE)
    rules += [
        {
            "rule": f"{free} || {_unchanged(path)}",
            "message": f"spec.{path} cannot change while the job runs: suspend it first "
            f"(spec.suspend: true), then edit it and resume it (while it runs only {live} "
            "may change)",
            "fieldPath": f".spec.{path}",
        }
        for path in frozen_while_running()
    ]
    return rules


# ------------------------------------------------------------------ applying an edit


def _changed(old: Any, new: Any, path: str, out: list[str]) -> None:
    if path.removeprefix("spec.") in LIVE or old == new:
        return
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            _changed(old.get(key), new.get(key), f"{path}.{key}", out)
    else:
        out.append(path)


def frozen_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Where two job files differ outside the LIVE fields (`spec.trainer.learningRate`)."""
    out: list[str] = []
    _changed(old.get("spec"), new.get("spec"), "spec", out)
    return out


@dataclass(frozen=True)
class ConfigChange:
    """What to do about the ConfigMap: re-render it now, or name what must wait."""

    update: bool = False
    waiting: tuple[str, ...] = ()
    """Fields that differ while pods that read the old job file are active."""


def config_change(observed: str | None, desired: str, pods_active: bool) -> ConfigChange:
    """`observed`: the ConfigMap's job file (None: not known); `pods_active`: a pod of the
    job (not being deleted) may read it."""
    if observed is None or observed == desired:
        return ConfigChange()
    try:
        old = yaml.safe_load(observed)
    except yaml.YAMLError:
        old = None
    new = yaml.safe_load(desired)
    if isinstance(old, dict):
        old, new = _as_written_now(old, new)
    changed = frozen_changes(old, new) if isinstance(old, dict) else ["spec"]
    if not changed or not pods_active:
        return ConfigChange(update=True)
    return ConfigChange(waiting=tuple(changed))


def _as_written_now(old: dict[str, Any], new: Any) -> tuple[dict[str, Any], Any]:
    """Both job files as this operator writes them. One an older operator wrote lacks
    the fields added since: they hold their defaults, which is no edit (read raw, every
    job running through an operator upgrade waited for a suspend, naming a field nobody
    changed). Files that do not parse as jobs are compared as they are."""
    try:
        return (
            dump_job(RLFineTune.model_validate(old)),
            dump_job(RLFineTune.model_validate(new)),
        )
    except ValidationError:
        return old, new


def gang_replicas(spec: RLFineTuneSpec) -> str:
    """The trainer gang's shape as its torchrun `--nnodes` says it."""
    return f"{spec.trainer.replicas.min}:{spec.trainer.replicas.max}"


def settle(
    st: RLFineTuneStatus,
    generation: int | None,
    waiting: tuple[str, ...],
    rescaling: bool,
    now: datetime,
) -> tuple[str, str] | None:
    """Move status.observedGeneration to `generation` if the children reflect it, else
    say why not in the SpecApplied condition. Returns (reason, message) for a Warning
    Event when an edit starts waiting for a suspend."""
    if generation is None or st.observed_generation == generation:
        return None  # nothing new since the children were last made from the spec
    before = condition(st, "SpecApplied")
    if waiting:
        shown = ", ".join(waiting[:SHOWN_FIELDS]) + (", …" if len(waiting) > SHOWN_FIELDS else "")
        message = (
            f"generation {generation} is not applied: {shown} changed while the job runs, "
            "and its pods keep the job file they started with; suspend the job "
            "(spec.suspend: true) and resume it to apply the change"
        )
        set_condition(st, "SpecApplied", "False", "SuspendToApply", message, now)
        if before is None or (before.reason, before.message) != ("SuspendToApply", message):
            return "SuspendToApply", message
        return None
    if rescaling:
        message = f"restarting the trainer gang to apply generation {generation}"
        set_condition(st, "SpecApplied", "False", "Rescaling", message, now)
        return None
    st.observed_generation = generation
    if before is not None:
        set_condition(st, "SpecApplied", "True", "Applied", f"generation {generation}", now)
    return None
