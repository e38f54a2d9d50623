"""`rlft plan JOB.yaml`: every object the operator creates for a new job, as YAML.

No copy of the builders: the plan is the `create` list of the operator's own first
reconcile (`reconcile.reconcile` with a fresh status and nothing observed), over the body
the API server would hand it after `kubectl apply` (the manifest, its namespace, a uid).
What only exists after the apply is handled so that the output stays reviewable and safe
to apply:

- **the uid**: without `uid`, `ownerReferences` are left out, and the trainers'
  `--rdzv-id` (which is `<uid>-<gang attempt>`) reads PLACEHOLDER_UID. A made-up uid in an
  owner reference would be worse than none: the garbage collector deletes children whose
  owner uid matches no object. With the uid of an applied job (`kubectl get rlft NAME -o
  jsonpath='{.metadata.uid}'`) the plan is exactly what the operator creates for it.
- **Secrets**: the operator never reads one; credentials reach the pods as
  `secretKeyRef`s naming spec.checkpoint.credentialsSecret, so no value can appear here.
  The one Secret it creates, the job's tokens (`manifests.token_secret`), is planned
  without them: the operator draws them as it sends the create. Applied as printed, it
  leaves the pods waiting for its keys (`token`, `ray`): nothing runs without a token.

Pure, like the planner it calls: no API server, no clock.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import yaml

from rlft.operator import crd
from rlft.operator import manifests as M
from rlft.operator.decision import Observed
from rlft.operator.pod_spec import spec_problems
from rlft.operator.reconcile import reconcile
from rlft.operator.status import RLFineTuneStatus
from rlft.trainer.config import RLFineTune, dump_job, parse_job

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
"""Stands for the job's uid before it exists (in the trainers' rendezvous id)."""
DEFAULT_NAMESPACE = "default"
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)  # what is created does not depend on the time
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def namespace_of(job: RLFineTune, given: str | None) -> str:
    """--namespace, else the manifest's metadata.namespace, else `default` (as kubectl)."""
    return given or job.metadata.namespace or DEFAULT_NAMESPACE


def problems(job: RLFineTune, namespace: str) -> list[str]:
    """Why the API server would refuse the job in `namespace`, or the operator would fail
    it before any pod (InvalidSpec, `pod_spec.spec_problems`); pydantic has passed it."""
    out = [*crd.cluster_problems(job), *spec_problems(job)]
    if not _DNS_LABEL.match(namespace):
        out.append(f"--namespace {namespace!r}: must be a DNS-1123 label")
    own = job.metadata.namespace
    if own and own != namespace:  # `kubectl apply -n` refuses the same mismatch
        out.append(f"metadata.namespace: {own!r} is not --namespace {namespace!r}")
    return out


def server_body(job: RLFineTune, namespace: str, uid: str) -> dict[str, Any]:
    """The custom resource as a fresh reconcile reads it: the manifest with the metadata
    the API server stamps (the operator reads only name, namespace, uid, generation)."""
    return {
        "apiVersion": job.api_version,
        "kind": job.kind,
        "metadata": {
            "name": job.metadata.name,
            "namespace": namespace,
            "uid": uid,
            "generation": 1,
        },
        "spec": dump_job(job)["spec"],
    }


def plan(
    job: RLFineTune,
    namespace: str,
    uid: str | None = None,
    settings: M.Settings | None = None,
) -> list[dict[str, Any]]:
    """The objects the operator creates on the job's first reconcile, in its order
    (ConfigMap, Services, pods); without `uid`, no ownerReferences (see the module)."""
    body = server_body(job, namespace, uid or PLACEHOLDER_UID)
    # The operator parses the body it reads, which holds only name and namespace of the
    # manifest's metadata; parse the same document.
    seen = parse_job({**body, "metadata": {"name": job.metadata.name, "namespace": namespace}})
    decision = reconcile(seen, body, RLFineTuneStatus(), Observed(), _EPOCH, settings)
    objects = decision.create
    if not uid:  # `--uid ''` too: never an owner reference with a made-up uid
        for obj in objects:
            obj["metadata"].pop("ownerReferences", None)
    return objects


class _Dumper(yaml.SafeDumper):
    """Quotes every string another YAML reader could take for a number: PyYAML follows
    YAML 1.1, but kubectl (Go's YAML) reads `1e-3` and `0o17` as numbers, and the trainer's
    `read_yaml` reads `1e-3` as one."""

    def ignore_aliases(self, data: Any) -> bool:
        return True  # objects shared between pods (their resources) are written out in full


_Dumper.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"),
    list("-+0123456789."),
)
_Dumper.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^0o[0-7]+$"), list("0"))


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # The ConfigMap's job.yaml reads as a block, not as one escaped line.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def render(objects: list[dict[str, Any]]) -> str:
    """A `---`-separated YAML stream, keys in the builders' order."""
    return yaml.dump_all(
        objects,
        Dumper=_Dumper,
        sort_keys=False,
        explicit_start=True,
        allow_unicode=True,
        width=100,
    )
