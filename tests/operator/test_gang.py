"""Gang scheduling (`spec.scheduling.gang`, `operator/gang.py`): the config's rules (pydantic
and the CRD's CEL agree), the label and annotation names checked against the projects'
own source (vendored in data/gang/ with the commit), the PodGroups checked against the
projects' published CRD schemas, what each kind makes of every pod, the PodGroup sent
before the pods of each creation round, `rlft plan`'s objects valid (`kubernetes-validate
--strict` for the built-in kinds, the vendored schema for the PodGroup), and the REST
calls that create and refresh a PodGroup, each declared in the permissions."""

from __future__ import annotations

import asyncio
import copy
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_validation import validate
from hypothesis import given
from hypothesis import strategies as st
from jobs import job_doc, parsed
from test_operator_reconcile import World

from rlft.operator import crd, permissions, plan
from rlft.operator import gang as G
from rlft.operator import manifests as M
from rlft.operator import names as N
from rlft.operator.kube import Connection, Kube
from rlft.operator.observe import KUEUE_STOP
from rlft.trainer.config import JobFileError, parse_job
from rlft.trainer.config.gang import GangSpec

DATA = Path(__file__).resolve().parent / "data" / "gang"
SCHEMA = crd.crd_schema()


def _crd(name: str) -> dict[str, Any]:
    return yaml.safe_load((DATA / name).read_text())


CRDS = {
    "volcano": _crd("volcano-podgroups-crd.yaml"),
    "coscheduling": _crd("coscheduling-podgroups-crd.yaml"),
}


def _go_constants(name: str) -> dict[str, str]:
    """`Name = "value"` and `Name = GroupName + "/suffix"` lines of a vendored Go excerpt."""
    text = (DATA / name).read_text()
    found: dict[str, str] = {}
    for key, value in re.findall(r'^\s*(?:const )?(\w+)\s*=\s*"([^"]*)"', text, re.M):
        found.setdefault(key, value)
    for key, base, suffix in re.findall(r'^\s*(\w+)\s*=\s*\w+\.(\w+) \+ "([^"]*)"', text, re.M):
        found[key] = found[base] + suffix
    return found


def _job(kind: str, **gang: Any) -> dict[str, Any]:
    """A GRPO job of 2..3 trainer pods and 2 rollout instances, with requests."""
    return job_doc(
        trainer={
            "replicas": {"min": 2, "max": 3},
            "gpusPerPod": 2,
            "resources": {"requests": {"cpu": "3", "memory": "8Gi"}, "limits": {"memory": "8Gi"}},
        },
        rollout={"instances": 2, "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
        scheduling={"gang": {"kind": kind, **gang}, "priorityClassName": "research-high"},
    )


def _ray(kind: str, **gang: Any) -> dict[str, Any]:
    """One rollout instance over 3 nodes (a Ray head and 2 workers), 1 trainer pod."""
    return job_doc(
        rollout={"engine": "vllm", "instances": 1, "gpusPerInstance": 3, "nodesPerInstance": 3},
        scheduling={"gang": {"kind": kind, **gang}},
    )


def _desired(doc: dict[str, Any], attempt: int = 0) -> M.Desired:
    job, body = parsed(doc)
    return M.desired(job, body, M.Settings(), "auto", attempt)


def _by_role(d: M.Desired) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for pod in d.pods.values():
        out.setdefault(pod["metadata"]["labels"][N.LABEL_ROLE], []).append(pod)
    return out


# ---------------------------------------------------------------- the config


def _problems(gang: dict[str, Any]) -> list[str]:
    try:
        parse_job(job_doc(scheduling={"gang": gang}))
    except JobFileError as error:
        return error.problems
    return []


def test_no_gang_by_default_and_the_schedulers_per_kind():
    job = parse_job(job_doc())
    assert job.spec.scheduling.gang == GangSpec() and job.spec.scheduling.gang.kind == "none"
    assert GangSpec(kind="volcano").pod_scheduler() == "volcano"
    assert GangSpec(kind="coscheduling").pod_scheduler() == "scheduler-plugins-scheduler"
    assert GangSpec(kind="kueue", queue_name="q").pod_scheduler() is None
    own = GangSpec(kind="coscheduling", scheduler_name="default-scheduler")
    assert own.pod_scheduler() == "default-scheduler"


@pytest.mark.parametrize(
    ("gang", "problem"),
    [
        ({"kind": "kueue"}, "spec.scheduling.gang: kind kueue needs queueName"),
        ({"kind": "coscheduling", "queueName": "q"}, "kind coscheduling has no queues"),
        ({"queueName": "q"}, "queueName and schedulerName need a gang kind"),
        ({"kind": "none", "schedulerName": "volcano"}, "need a gang kind"),
        ({"kind": "volcano", "queueName": "Team_A"}, "queueName: 'Team_A' is not a queue name"),
        ({"kind": "volcano", "queueName": "q" * 64}, "queueName: string should have at most 63"),
        ({"kind": "volcano", "schedulerName": "My Scheduler"}, "is not a scheduler name"),
        ({"kind": "slurm"}, "spec.scheduling.gang.kind: must be one of"),
        ({"kind": "volcano", "queue": "q"}, "spec.scheduling.gang.queue: unknown field"),
    ],
)
def test_a_bad_gang_is_refused_naming_the_field(gang, problem):
    problems = _problems(gang)
    assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.parametrize(
    "gang",
    [
        {"kind": "kueue", "queueName": "team-a"},
        {"kind": "volcano"},
        {"kind": "volcano", "queueName": "research.gpu", "schedulerName": "volcano-2"},
        {"kind": "coscheduling", "schedulerName": "default-scheduler"},
    ],
)
def test_good_gangs_pass_pydantic_and_the_crd(gang):
    doc = job_doc(scheduling={"gang": gang})
    assert _problems(gang) == []
    _, problems, warnings = validate(doc, SCHEMA)
    assert problems == [] and warnings == [], [str(p) for p in problems]


def _gang_node() -> dict[str, Any]:
    return SCHEMA["properties"]["spec"]["properties"]["scheduling"]["properties"]["gang"]


@given(
    st.sampled_from([None, "none", "kueue", "volcano", "coscheduling"]),
    st.booleans(),
    st.booleans(),
)
def test_the_crds_cel_rules_agree_with_pydantic(kind, queue, scheduler):
    value: dict[str, Any] = {}
    if kind is not None:
        value["kind"] = kind
    if queue:
        value["queueName"] = "team-a"
    if scheduler:
        value["schedulerName"] = "volcano"
    schema = {"type": "object", "properties": {"gang": _gang_node()}}
    cel_ok = not validate({"gang": value}, schema)[1]
    try:
        GangSpec.model_validate(value, by_alias=True, by_name=False)
        pydantic_ok = True
    except ValueError:
        pydantic_ok = False
    assert cel_ok == pydantic_ok, value


# ------------------------------------------- names and schemas, from the source


def test_kueue_names_are_kueues_own():
    go = _go_constants("kueue-constants.go.txt")
    assert go["QueueLabel"] == G.KUEUE_QUEUE_LABEL
    assert go["GroupNameLabel"] == G.KUEUE_GROUP_LABEL
    assert go["GroupTotalCountAnnotation"] == G.KUEUE_TOTAL_COUNT
    assert go["RetriableInGroupAnnotationKey"] == G.KUEUE_RETRIABLE
    assert go["RetriableInGroupAnnotationValue"] == "false"  # the value apply() writes
    # The documented use: the queue and group name as labels, the count as an annotation.
    text = (DATA / "kueue-constants.go.txt").read_text()
    assert '"pod-group-name" label, and the "pod-group-total-count" annotation' in text


def test_kueues_stop_condition_is_kueues_own():
    """The condition Kueue sets on each pod of a workload it stops, then deletes it: the
    operator reads it as a disruption (not counted against restartPolicy)."""
    go = _go_constants("kueue-pod-controller.go.txt")
    assert go["ConditionTypeTerminationTarget"] == KUEUE_STOP
    text = (DATA / "kueue-pod-controller.go.txt").read_text()
    condition = "Type:   ConditionTypeTerminationTarget,\n\t\t\t\t\t\tStatus: corev1.ConditionTrue"
    assert condition in text
    assert text.index("c.Status().Patch(ctx, pCopy") < text.index("c.Delete(ctx, podInGroup")


def test_volcano_names_are_volcanos_own():
    go = _go_constants("volcano-labels.go.txt")
    assert go["KubeGroupNameAnnotationKey"] == G.VOLCANO_GROUP_ANNOTATION
    assert go["TaskSpecKey"] == G.VOLCANO_TASK_ANNOTATION
    assert f"{go['GroupName']}/{go['GroupVersion']}" == G.VOLCANO_API
    text = (DATA / "volcano-labels.go.txt").read_text()
    assert "pod.Annotations[v1beta1.KubeGroupNameAnnotationKey]" in text  # an annotation
    assert 'key is value of "volcano.sh/task-spec"' in text  # minTaskMember's keys


def test_coscheduling_names_are_scheduler_plugins_own():
    go = _go_constants("scheduler-plugins-labels.go.txt")
    assert G.COSCHEDULING_GROUP_LABEL == go["PodGroupLabel"] == "scheduling.x-k8s.io/pod-group"
    assert G.COSCHEDULING_API.split("/")[0] == go["GroupName"]


@pytest.mark.parametrize("kind", ["volcano", "coscheduling"])
def test_the_vendored_crds_are_the_api_the_pod_groups_use(kind):
    doc = CRDS[kind]
    (version,) = doc["spec"]["versions"]
    assert G.POD_GROUP_APIS[kind] == f"{doc['spec']['group']}/{version['name']}"
    assert doc["spec"]["names"]["kind"] == "PodGroup"
    assert doc["spec"]["names"]["plural"] == "podgroups" and doc["spec"]["scope"] == "Namespaced"
    assert version["served"] and version["storage"]
    header = (DATA / f"{kind}-podgroups-crd.yaml").read_text().splitlines()[3]
    assert re.search(r"github\.com/.+/blob/[0-9a-f]{40}/", header), "source and commit"


def _schema(kind: str) -> dict[str, Any]:
    return CRDS[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("kind", ["volcano", "coscheduling"])
@pytest.mark.parametrize("shape", [_job, _ray], ids=["trainers+rollouts", "ray"])
def test_every_pod_group_validates_against_the_published_schema(kind, shape):
    for gang in ({}, {"queueName": "research"} if kind == "volcano" else {}):
        (group,) = _desired(shape(kind, **gang)).pod_groups.values()
        _, problems, warnings = validate(group, _schema(kind))
        assert problems == [] and warnings == [], [str(p) for p in problems]
    broken = {**group, "spec": {**group["spec"], "minMembers": 3}}  # the check is real
    assert [p.field for p in validate(broken, _schema(kind))[1]] == ["spec.minMembers"]


# ------------------------------------------------------------ what each pod gets


def test_volcano_one_pod_group_of_min_trainers_and_every_rollout_pod():
    d = _desired(_job("volcano", queueName="research"))
    (group,) = d.pod_groups.values()
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1" and group["kind"] == "PodGroup"
    meta = group["metadata"]
    assert meta["name"] == "tiny-grpo-gang" and meta["namespace"] == "ml"
    assert meta["labels"][N.LABEL_JOB] == "tiny-grpo"
    (owner,) = meta["ownerReferences"]
    assert owner["kind"] == "RLFineTune" and owner["controller"] and owner["uid"] == "0f0e-uid"
    assert group["spec"] == {
        "minMember": 4,  # replicas.min 2 + 2 rollout instances; the 3rd trainer is spare
        "minTaskMember": {"rollout": 2, "trainer": 2},
        # 2 trainers × (3 cpu, 8Gi, 2 GPUs) + 2 rollout pods × (500m, 1Gi)
        "minResources": {"cpu": "7", "memory": "18Gi", "nvidia.com/gpu": "4"},
        "queue": "research",
        "priorityClassName": "research-high",
    }
    roles = _by_role(d)
    assert len(roles["trainer"]) == 3 and len(roles["rollout"]) == 2
    for role, pods in roles.items():
        for pod in pods:
            assert pod["spec"]["schedulerName"] == "volcano"
            assert pod["metadata"]["annotations"] == {
                "scheduling.k8s.io/group-name": "tiny-grpo-gang",
                "volcano.sh/task-spec": role,
            }
            assert not any(
                k.startswith(("kueue.", "scheduling.")) for k in pod["metadata"]["labels"]
            )


def test_volcano_counts_ray_heads_and_workers_as_tasks_of_their_own():
    d = _desired(_ray("volcano"))
    (group,) = d.pod_groups.values()
    assert group["spec"]["minTaskMember"] == {"ray-head": 1, "ray-worker": 2, "trainer": 1}
    assert group["spec"]["minMember"] == 4
    assert group["spec"]["minResources"] == {"nvidia.com/gpu": "3"}  # 1 GPU per Ray node
    assert "queue" not in group["spec"] and "priorityClassName" not in group["spec"]
    tasks = {p["metadata"]["annotations"]["volcano.sh/task-spec"] for p in d.pods.values()}
    assert tasks == {"trainer", "ray-head", "ray-worker"}


def test_coscheduling_one_pod_group_and_its_label_on_every_pod():
    d = _desired(_job("coscheduling"))
    (group,) = d.pod_groups.values()
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {
        "minMember": 4,
        "minResources": {"cpu": "7", "memory": "18Gi", "nvidia.com/gpu": "4"},
    }
    for pod in d.pods.values():
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "tiny-grpo-gang"
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
        assert "annotations" not in pod["metadata"]
    own = _desired(_job("coscheduling", schedulerName="default-scheduler"))
    assert {p["spec"]["schedulerName"] for p in own.pods.values()} == {"default-scheduler"}


def test_dpo_has_a_gang_of_trainers_only():
    doc = _job("coscheduling")
    doc["spec"]["algorithm"] = {"name": "dpo"}
    (group,) = _desired(doc).pod_groups.values()
    assert group["spec"]["minMember"] == 2 and group["spec"]["minResources"]["cpu"] == "6"


def test_kueue_the_trainer_gang_of_each_attempt_is_one_pod_group_and_rollouts_single_pods():
    d = _desired(_job("kueue", queueName="team-a"), attempt=5)
    assert d.pod_groups == {}  # Kueue makes its Workload from the pods
    roles = _by_role(d)
    for pod in roles["trainer"]:
        labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
        assert labels["kueue.x-k8s.io/pod-group-name"] == "tiny-grpo-trainers-5"
        assert annotations == {
            "kueue.x-k8s.io/pod-group-total-count": "3",  # replicas.max: every pod of it
            "kueue.x-k8s.io/retriable-in-group": "false",  # one shot: restarts make a new one
        }
        assert "schedulerName" not in pod["spec"]
    for pod in roles["rollout"]:
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert "kueue.x-k8s.io/pod-group-name" not in pod["metadata"]["labels"]
        assert "annotations" not in pod["metadata"]
    again = _desired(_job("kueue", queueName="team-a"), attempt=6)
    labels = _by_role(again)["trainer"][0]["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/pod-group-name"] == "tiny-grpo-trainers-6"


def test_the_group_names_fit_a_label_value_for_the_longest_job_name():
    name = "j" * 63
    assert len(G.group_name(name)) <= 63 and len(G.kueue_group(name, 10**6)) <= 63
    assert G.group_name(name) != G.group_name("j" * 62)


def test_no_gang_changes_nothing():
    plain = _desired(job_doc())
    assert plain.pod_groups == {}
    for pod in plain.pods.values():
        assert "schedulerName" not in pod["spec"] and "annotations" not in pod["metadata"]


def test_the_gangs_keys_win_over_a_roles_own_labels():
    doc = _job("coscheduling")
    doc["spec"]["trainer"]["pod"] = {
        "labels": {"scheduling.x-k8s.io/pod-group": "other", "team": "a"},
        "annotations": {"note": "x"},
    }
    pod = _by_role(_desired(doc))["trainer"][0]
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "tiny-grpo-gang"
    assert pod["metadata"]["labels"]["team"] == "a" and pod["metadata"]["annotations"] == {
        "note": "x"
    }


def test_the_pod_group_comes_before_the_pods():
    d = _desired(_job("volcano"))
    kinds = [o["kind"] for o in d.all()]
    guards = ["Secret", "NetworkPolicy"]
    assert kinds == ["ConfigMap", "Service", "Service", *guards, "PodGroup"] + ["Pod"] * 5


@pytest.mark.parametrize(
    ("values", "resource", "text"),
    [
        (["3", 2, "500m"], "cpu", "5500m"),
        (["1.5", "1500m"], "cpu", "3"),
        (["1e3"], "cpu", "1000"),
        (["8Gi", "8Gi", "1Gi"], "memory", "17Gi"),
        (["1G", "1G"], "memory", "2G"),
        (["1000", "24"], "memory", "1Ki"),
        (["1Ki", "1"], "memory", "1025"),
        (["1Mi"], "ephemeral-storage", "1Mi"),
        ([1, 1], "nvidia.com/gpu", "2"),
        (["1m", "1u"], "cpu", "2m"),  # rounded up: never less than asked
    ],
)
def test_quantities_add_up_exactly(values, resource, text):
    total = sum((G.quantity(v) for v in values), Fraction(0))
    assert G.format_quantity(resource, total) == text
    assert G.quantity(text) >= total


# ------------------------------------------------- the reconciler and the plan


def test_the_pod_group_is_sent_before_each_round_of_pod_creations_only():
    w = World(spec={"scheduling": {"gang": {"kind": "coscheduling"}}})
    first = [m["kind"] for m in w.step().create]
    guards = ["Secret", "NetworkPolicy"]
    assert first == ["ConfigMap", "Service", "Service", *guards, "PodGroup", "Pod", "Pod"]
    assert w.step().create == []  # nothing missing: nothing sent
    w.run_all()
    w.step()
    w.pods.pop("tiny-grpo-rollout-0")  # a rollout pod vanished: it is recreated alone
    again = w.step().create
    assert [m["kind"] for m in again] == ["Secret", "NetworkPolicy", "PodGroup", "Pod"]
    assert again[2]["metadata"]["name"] == "tiny-grpo-gang"


@pytest.mark.parametrize(
    "gang",
    [
        {"kind": "volcano", "queueName": "research"},
        {"kind": "coscheduling"},
        {"kind": "kueue", "queueName": "team-a"},
    ],
    ids=lambda g: g["kind"],
)
def test_the_plan_of_a_gang_job_is_valid(gang, tmp_path):
    """`rlft plan`'s objects: the built-in kinds with `kubernetes-validate --strict`, the
    PodGroup against its project's published schema."""
    kind, rest = gang["kind"], {k: v for k, v in gang.items() if k != "kind"}
    objects = []
    for doc in (_job(kind, **rest), _ray(kind, **rest)):
        objects += plan.plan(parse_job(doc), "ml", "6f1c2a7e-93d4-4b1e-8a52-0c9d3e7b1f20")
    groups = [o for o in objects if o["kind"] == "PodGroup"]
    assert len(groups) == (0 if kind == "kueue" else 2)
    for group in groups:
        assert validate(group, _schema(kind))[1] == []
    builtin = [o for o in objects if o["kind"] != "PodGroup"]
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump_all(builtin))
    tool = str(Path(sys.executable).parent / "kubernetes-validate")
    result = subprocess.run([tool, "--strict", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(builtin)


# ------------------------------------------------------------- the REST calls


GANG_CRDS = Path(__file__).resolve().parent / "data" / "gang"


@pytest.fixture(scope="module")
def api_with_pod_groups(tmp_path_factory):
    """The emulated API server with Volcano's and scheduler-plugins' published PodGroup
    CRDs: it answers a second create with its own 409 AlreadyExists."""
    from cluster import EmulatedApiServer

    api = EmulatedApiServer(tmp_path_factory.mktemp("api"))
    try:
        for name in ("volcano-podgroups-crd.yaml", "coscheduling-podgroups-crd.yaml"):
            api.kubectl("apply", "--validate=false", "-f", str(GANG_CRDS / name))
        api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}})
        yield api
    finally:
        api.stop()


class _Recording(Kube):
    """Kube whose requests are recorded (each also checked against the permissions by
    `_request` itself) on their way to the API server."""

    def __init__(self, server: str):
        super().__init__(Connection(server=server, headers={}))
        self.calls: list[tuple[str, str, Any, str]] = []

    async def _request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        self.calls.append((method, path, body, content_type))
        return await super()._request(method, path, body, content_type)


@pytest.mark.parametrize("kind", ["volcano", "coscheduling"])
def test_a_pod_group_is_created_or_brought_to_the_current_gang(kind, api_with_pod_groups):
    """A second create meets the API server's 409: the group that exists gets the new
    spec and owner (a job deleted and applied again under its name finds its former
    self's PodGroup, which the garbage collector, asynchronous on a real cluster, would
    delete as that job's, leaving the new pods waiting for a group that is gone)."""
    api = api_with_pod_groups
    (group,) = _desired(_job(kind)).pod_groups.values()
    collection = f"/apis/{G.POD_GROUP_APIS[kind]}/namespaces/ml/podgroups"
    again = copy.deepcopy(group)  # the job applied again: a new uid, a bigger gang
    again["metadata"]["ownerReferences"][0]["uid"] = "1a1b-uid"
    again["spec"]["minMember"] += 1
    pod = next(iter(_desired(_job(kind)).pods.values()))
    pod = copy.deepcopy(pod)
    pod["metadata"]["name"] = f"{pod['metadata']['name']}-{kind}"

    async def twice() -> tuple[_Recording, _Recording, _Recording, _Recording]:
        kubes = [_Recording(api.url) for _ in range(4)]
        try:
            assert await kubes[0].create(group) is True
            assert await kubes[1].create(again) is False
            assert await kubes[2].create(pod) is True
            assert await kubes[3].create(pod) is False
        finally:
            for kube in kubes:
                await kube.close()
        return tuple(kubes)  # type: ignore[return-value]

    fresh, existing, _, core = asyncio.run(twice())
    assert fresh.calls == [("POST", collection, group, "application/json")]
    patch = [
        {"op": "add", "path": "/spec", "value": again["spec"]},
        {
            "op": "add",
            "path": "/metadata/ownerReferences",
            "value": again["metadata"]["ownerReferences"],
        },
    ]
    assert existing.calls[1] == (
        "PATCH",
        f"{collection}/tiny-grpo-gang",
        patch,
        "application/json-patch+json",
    )
    stored = api.get(
        f"podgroups.{G.POD_GROUP_APIS[kind].split('/')[0]}", "tiny-grpo-gang", "-n", "ml"
    )
    assert stored["metadata"]["ownerReferences"][0]["uid"] == "1a1b-uid"
    assert stored["spec"]["minMember"] == again["spec"]["minMember"]
    assert [c[:2] for c in core.calls] == [("POST", "/api/v1/namespaces/ml/pods")]  # no patch


def test_the_pod_group_permissions_are_declared_apart_from_the_charts_defaults():
    gang = {(p.group, p.resource, v) for p in permissions.GANG_PERMISSIONS for v in p.verbs}
    assert gang == {
        (group, "podgroups", verb)
        for group in ("scheduling.volcano.sh", "scheduling.x-k8s.io")
        for verb in ("create", "patch")
    }
    always = {(p.group, p.resource) for p in permissions.PERMISSIONS}
    assert not {(g, r) for g, r, _ in gang} & always
    with pytest.raises(permissions.UndeclaredRequest):
        permissions.require(
            "DELETE", "/apis/scheduling.x-k8s.io/v1alpha1/namespaces/ml/podgroups/x"
        )


def test_rlft_plan_prints_the_pod_group_before_the_pods(tmp_path, capsys):
    from rlft.trainer.cli.main import main

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job("coscheduling")))
    assert main(["plan", str(path), "-n", "ml"]) == 0, capsys.readouterr().err
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [o["kind"] for o in printed][:7] == [
        "ConfigMap",
        "Service",
        "Service",
        "Secret",
        "NetworkPolicy",
        "PodGroup",
        "Pod",
    ]
    assert "ownerReferences" not in printed[5]["metadata"]  # no uid given: none, as for all
