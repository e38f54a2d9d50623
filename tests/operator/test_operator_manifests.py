"""The planner's manifests: what each pod runs, how it is hardened, and that every manifest
is a valid Kubernetes object (`kubernetes-validate --strict`, real schemas)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from jobs import job_doc, parsed

from rlft.operator import manifests as M
from rlft.operator import names as N
from rlft.operator import pod_spec

SETTINGS = M.Settings()

SHAPES = {
    "tiny": {},
    "gpu-elastic": {
        "trainer": {
            "replicas": {"min": 2, "max": 4},
            "gpusPerPod": 8,
            "resources": {"requests": {"cpu": "16", "memory": "200Gi"}},
        },
        "rollout": {
            "engine": "vllm",
            "instances": 3,
            "gpusPerInstance": 4,
            "tensorParallel": 2,
            "expertParallel": 2,
        },
        "checkpoint": {"uri": "s3://bucket/runs/x", "credentialsSecret": "s3-creds"},
        "scheduling": {
            "nodeSelector": {"gpu": "h200"},
            "priorityClassName": "training",
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "zone", "operator": "In", "values": ["a"]}
                                ]
                            }
                        ]
                    }
                }
            },
        },
    },
    "multi-node-rollout": {
        "rollout": {
            "engine": "vllm",
            "instances": 2,
            "gpusPerInstance": 16,
            "tensorParallel": 8,
            "expertParallel": 2,
            "nodesPerInstance": 2,
        },
    },
}


def _desired(shape: str, name: str = "tiny-grpo", resume: str = "auto") -> M.Desired:
    job, body = parsed(job_doc(name=name, **SHAPES[shape]))
    return M.desired(job, body, SETTINGS, resume)


def _pods(d: M.Desired, role: str) -> list[dict]:
    return [p for p in d.pods.values() if p["metadata"]["labels"][N.LABEL_ROLE] == role]


def test_every_manifest_passes_kubernetes_validate_strict(tmp_path):
    documents = []
    for shape in SHAPES:
        documents += _desired(shape, name=f"job-{shape}").all()
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    tool = str(Path(sys.executable).parent / "kubernetes-validate")
    result = subprocess.run([tool, "--strict", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(documents)
    # the check is real: one unknown field fails it
    documents[-1]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    path.write_text(yaml.safe_dump_all(documents))
    result = subprocess.run([tool, "--strict", str(path)], capture_output=True, text=True)
    assert result.returncode != 0 and "imagePullPolice" in result.stdout + result.stderr


def test_children_of_the_example():
    d = _desired("tiny")
    assert list(d.config_maps) == ["tiny-grpo-config"]
    assert sorted(d.services) == ["tiny-grpo-rollout", "tiny-grpo-trainer"]
    assert sorted(d.pods) == ["tiny-grpo-rollout-0", "tiny-grpo-trainer-0"]
    for obj in d.all():
        owner = obj["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "RLFineTune" and owner["uid"] == "0f0e-uid" and owner["controller"]
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"][N.LABEL_JOB] == "tiny-grpo"
    job_file = yaml.safe_load(d.config_maps["tiny-grpo-config"]["data"]["job.yaml"])
    assert job_file["kind"] == "RLFineTune" and job_file["spec"]["trainer"]["steps"] == 150
    trainer = d.services["tiny-grpo-trainer"]["spec"]
    assert trainer["clusterIP"] == "None" and trainer["publishNotReadyAddresses"]


def test_trainer_pods_run_elastic_torchrun():
    d = _desired("gpu-elastic", resume="latest-healthy")
    trainers = _pods(d, N.ROLE_TRAINER)
    assert len(trainers) == 4  # replicas.max
    for i, pod in enumerate(sorted(trainers, key=lambda p: p["metadata"]["name"])):
        spec = pod["spec"]
        main = spec["containers"][0]
        command = main["command"]
        assert command[:4] == ["rlft", "scrubbed", "--", "torchrun"]  # its output scrubbed
        assert "--nnodes=2:4" in command and "--nproc-per-node=8" in command
        assert "--rdzv-endpoint=trainer-0.tiny-grpo-trainer.ml.svc:29400" in command
        assert "--rdzv-id=0f0e-uid-0" in command  # the first gang's rendezvous
        (conf,) = [a for a in command if a.startswith("--rdzv-conf=")]
        assert "last_call_timeout=5" in conf
        # trainer-0 hosts the rendezvous store, said rather than guessed from DNS
        assert conf.endswith(f",is_host={'true' if i == 0 else 'false'}"), conf
        assert "--max-restarts=0" in command  # the operator restarts, counts, backs off
        # The job's grace reaches the pod and torchrun (which SIGKILLs after its timeout).
        grace = parsed(job_doc(**SHAPES["gpu-elastic"]))[0].spec.checkpoint.grace_period_seconds
        assert f"--shutdown-timeout={grace:.0f}" in command
        assert spec["terminationGracePeriodSeconds"] == grace + M.SHUTDOWN_MARGIN_SECONDS
        assert command[-1] == "--resume=latest-healthy"
        env = {e["name"]: e for e in main["env"]}
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]["value"] == "1"
        assert spec["hostname"] == f"trainer-{i}" and spec["subdomain"] == "tiny-grpo-trainer"
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert main["resources"]["requests"]["cpu"] == "16"
        assert spec["nodeSelector"] == {"gpu": "h200"}
        assert spec["priorityClassName"] == "training"
        assert spec["tolerations"][0] == {
            "key": "nvidia.com/gpu",
            "operator": "Exists",
            "effect": "NoSchedule",
        }
        assert "nodeAffinity" in spec["affinity"]
        assert spec["restartPolicy"] == "Never"
        # Rank 0 serves /status and /metrics on trainer-0 only; a PodMonitor scrapes the
        # ports a pod declares, and one declared where nothing listens is always down.
        declared = {port["name"] for port in main["ports"]}
        assert ("status" in declared) == (i == 0), declared


def test_every_pod_leaves_a_lost_node_after_node_lost_seconds():
    """NoExecute tolerations of the unreachable and not-ready taints, for
    spec.scheduling.nodeLostSeconds (not Kubernetes' 300 s), unless the job's own
    tolerations name those keys."""
    d = _desired("gpu-elastic")
    for pod in d.pods.values():
        taints = pod_spec.NODE_LOST_TAINTS
        lost = {t["key"]: t for t in pod["spec"]["tolerations"] if t["key"] in taints}
        assert set(lost) == set(taints)
        assert all(
            t["effect"] == "NoExecute" and t["tolerationSeconds"] == 60 for t in lost.values()
        )
    own = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}
    job, body = parsed(job_doc(scheduling={"nodeLostSeconds": 5, "tolerations": [own]}))
    pod = next(iter(M.desired(job, body, M.Settings(), "auto").pods.values()))
    tolerations = pod["spec"]["tolerations"]
    assert own in tolerations and len(tolerations) == 2
    assert tolerations[1]["key"] == "node.kubernetes.io/not-ready"
    assert tolerations[1]["tolerationSeconds"] == 5


def test_a_roles_own_env_follows_the_operators_which_it_cannot_change():
    """spec.trainer.env reaches trainer pods, spec.rollout.env the rollout pods, after the
    operator's variables; every variable the operator sets is one the job file refuses
    (but OMP_NUM_THREADS, which the operator sets only when the job does not)."""
    from rlft.trainer.config.containers import OPERATOR_ENV

    secret = {"secretKeyRef": {"name": "hf", "key": "token"}}
    job, body = parsed(
        job_doc(
            trainer={"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
            rollout={"env": [{"name": "HF_TOKEN", "valueFrom": secret}]},
            checkpoint={"uri": "s3://bkt/run", "credentialsSecret": "s3"},
        )
    )
    d = M.desired(job, body, SETTINGS, "auto")
    for pod in d.pods.values():
        env = pod["spec"]["containers"][0]["env"]
        role = pod["metadata"]["labels"][N.LABEL_ROLE]
        own = {"name": "NCCL_DEBUG", "value": "INFO"} if role == N.ROLE_TRAINER else None
        own = own or {"name": "HF_TOKEN", "valueFrom": secret}
        assert own in env
        operator_names = {e["name"] for e in env} - {own["name"]}
        assert operator_names <= OPERATOR_ENV, operator_names - OPERATOR_ENV
        # The names of the variables filled from Secrets, whose values the pod's
        # processes keep out of their error texts (trainer/redaction.py).
        hidden = [e.get("value") for e in env if e["name"] == "RLFT_SECRET_ENV"]
        assert hidden == ([] if role == N.ROLE_TRAINER else ["HF_TOKEN"])


def _threads(trainer: dict, rollout: dict | None = None) -> dict[str, list[str]]:
    """OMP_NUM_THREADS values of each role's pods for a job with these sections."""
    job, body = parsed(job_doc(trainer=trainer, rollout=rollout or {}))
    found: dict[str, list[str]] = {}
    for pod in M.desired(job, body, SETTINGS, "auto").pods.values():
        env = pod["spec"]["containers"][0]["env"]
        role = pod["metadata"]["labels"][N.LABEL_ROLE]
        found.setdefault(role, []).extend(e["value"] for e in env if e["name"] == "OMP_NUM_THREADS")
    return found


def test_torch_threads_follow_the_containers_cpus_unless_the_job_sets_them():
    """OMP_NUM_THREADS is the CPU limit, else the request, rounded down and at least 1;
    no CPU given, no variable (torch's own default); the job's own value wins, once."""
    cpus = {"requests": {"cpu": "16"}}
    threads = _threads({"resources": cpus}, {"resources": {"limits": {"cpu": "2500m"}}})
    assert set(threads[N.ROLE_TRAINER]) == {"16"} and threads[N.ROLE_ROLLOUT] == ["2"]
    both = {"requests": {"cpu": "2"}, "limits": {"cpu": "4"}}  # the limit, not the request
    assert set(_threads({"resources": both})[N.ROLE_TRAINER]) == {"4"}
    assert set(_threads({"resources": {"requests": {"cpu": "500m"}}})[N.ROLE_TRAINER]) == {"1"}
    assert _threads({}) == {N.ROLE_TRAINER: [], N.ROLE_ROLLOUT: []}
    # A trainer pod's ranks share its CPUs (torchrun keeps the value: each took all 64)
    eight = _threads({"resources": {"limits": {"cpu": "64"}}, "gpusPerPod": 8})
    assert set(eight[N.ROLE_TRAINER]) == {"8"}
    own = {"resources": cpus, "env": [{"name": "OMP_NUM_THREADS", "value": "3"}]}
    trainer_threads = _threads(own)[N.ROLE_TRAINER]
    assert trainer_threads and set(trainer_threads) == {"3"}
    assert len(trainer_threads) == len(_threads({"resources": cpus})[N.ROLE_TRAINER])


def test_credentials_come_from_the_secret_never_the_config_map():
    d = _desired("gpu-elastic")
    text = yaml.safe_dump(d.config_maps["tiny-grpo-config"])
    assert "s3-creds" in text  # the Secret's name, never its values
    for pod in d.pods.values():
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            ref = env[key]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "s3-creds", "key": key} and "value" not in env[key]
    assert "AWS_" not in text


@pytest.mark.parametrize("shape", list(SHAPES))
def test_pods_are_hardened(shape):
    for pod in _desired(shape).pods.values():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        # No command is PID 1 (deaf to SIGTERM without a handler): the test cluster's
        # kubelet makes it so without this, and a deletion waits out its grace.
        assert spec["shareProcessNamespace"] is True
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/tmp", "/workspace", "/etc/rlft"} <= mounts  # writable places exist


def test_multi_node_rollout_instances_are_ray_clusters():
    d = _desired("multi-node-rollout")
    heads, workers = _pods(d, N.ROLE_RAY_HEAD), _pods(d, N.ROLE_RAY_WORKER)
    assert len(heads) == 2 and len(workers) == 2 and not _pods(d, N.ROLE_ROLLOUT)
    for head in heads:
        script = head["spec"]["containers"][0]["command"][-1]
        assert "ray start --head" in script and "--ray-address" in script
        assert head["metadata"]["labels"][N.LABEL_SERVES] == "rollout"
        assert head["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    for worker in workers:
        command = worker["spec"]["containers"][0]["command"]
        k = worker["metadata"]["labels"][N.LABEL_INDEX]
        assert command[:5] == ["rlft", "scrubbed", "--", "ray", "start"]
        assert "--block" in command
        assert f"--address=rollout-{k}.tiny-grpo-rollout.ml.svc:6379" in command
    urls = d.pods["tiny-grpo-trainer-0"]["spec"]["containers"][0]["env"]
    urls = next(e["value"] for e in urls if e["name"] == "RLFT_ROLLOUT_URLS").split(",")
    assert urls == [f"http://rollout-{k}.tiny-grpo-rollout.ml.svc:8000" for k in range(2)]


@pytest.mark.parametrize("name", ["a" * 63, "1job", "x-" * 31 + "y"])
def test_long_or_odd_job_names_still_give_valid_names(name):
    d = _desired("tiny", name=name)
    for svc in d.services:
        assert len(svc) <= 63 and svc[0].isalpha(), svc
    assert len({N.trainer_service(name), N.rollout_service(name)}) == 2
    for pod in d.pods.values():
        assert len(pod["spec"]["hostname"]) <= 63
        assert len(pod["spec"]["subdomain"]) <= 63


def test_the_operator_imports_no_torch():
    code = (
        "import sys, rlft.operator.handlers, rlft.operator.__main__, rlft.operator.crd\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def _selects(selector: dict, pod: dict) -> bool:
    labels = pod["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


@pytest.mark.parametrize("shape", ["tiny", "multi-node-rollout"])
def test_the_network_policy_opens_only_the_read_or_guarded_ports_to_other_pods(shape):
    """Every pod of the job, and no other job's, is behind the policy; the job's own pods
    reach each other on any port (rendezvous, collectives, Ray), anyone else only the
    status, rollout and liveness ports: not the rendezvous store nor Ray's head."""
    mine, other = _desired(shape), _desired(shape, name="other-job")
    (policy,) = [g for g in mine.guards if g["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # egress (S3, the Hub) left alone
    assert all(_selects(spec["podSelector"], pod) for pod in mine.pods.values())
    assert not any(_selects(spec["podSelector"], pod) for pod in other.pods.values())
    peers, anyone = spec["ingress"]
    assert set(peers) == {"from"} and peers["from"] == [{"podSelector": spec["podSelector"]}]
    assert set(anyone) == {"ports"}  # from anywhere, these ports only
    open_ports = {p["port"] for p in anyone["ports"]}
    assert open_ports == {SETTINGS.status_port, SETTINGS.rollout_port, SETTINGS.liveness_port}
    assert SETTINGS.rdzv_port not in open_ports and SETTINGS.ray_port not in open_ports
    declared = {
        port["containerPort"]
        for pod in mine.pods.values()
        for port in pod["spec"]["containers"][0].get("ports", [])
        if port["name"] not in ("rdzv", "ray")
    }
    assert declared <= open_ports  # what the operator, Prometheus and kubelet call is open


def test_no_job_network_policy_leaves_it_out_of_the_plan(tmp_path, capsys):
    from rlft.trainer.cli.main import main

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_doc()))
    for flags, expected in (([], 1), (["--no-job-network-policy"], 0)):
        assert main(["plan", str(path), *flags]) == 0, capsys.readouterr().err
        kinds = [o["kind"] for o in yaml.safe_load_all(capsys.readouterr().out)]
        assert kinds.count("NetworkPolicy") == expected and kinds.count("Secret") == 1


def test_a_job_applied_again_under_its_name_gets_tokens_of_its_own():
    """Deleted and applied again, a job has a new uid: its token Secret must not be the
    old one (kept on the 409, then removed by the garbage collector with its owner)."""
    job, body = parsed(job_doc())
    again = {**body, "metadata": {**body["metadata"], "uid": "9a8b7c6d-new"}}
    names = []
    for b in (body, again):
        d = M.desired(job, b, SETTINGS, "auto")
        (secret,) = [g for g in d.guards if g["kind"] == "Secret"]
        (policy,) = [g for g in d.guards if g["kind"] == "NetworkPolicy"]
        assert secret["metadata"]["ownerReferences"][0]["uid"] == b["metadata"]["uid"]
        for pod in d.pods.values():
            env = pod["spec"]["containers"][0]["env"]
            refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in env if "secretKeyRef" in str(e)]
            assert refs == [secret["metadata"]["name"]]
        names.append((secret["metadata"]["name"], policy["metadata"]["name"]))
    assert names == [
        ("tiny-grpo-tokens-0f0e-uid", "tiny-grpo-ingress-0f0e-uid"),
        ("tiny-grpo-tokens-9a8b7c6d", "tiny-grpo-ingress-9a8b7c6d"),
    ]


def test_the_pod_view_tells_the_pods_given_the_rollout_token():
    """What reconcile reads to keep an upgrade's old trainers served (PodView.rollout_token)
    is what the manifests give: every trainer and rollout pod the operator makes has the
    token, and `without_rollout_token` takes it away."""
    from rlft.operator.observe import pod_view

    job, body = parsed(job_doc())
    pods = M.desired(job, body, SETTINGS, "auto").pods
    assert {p["metadata"]["labels"][N.LABEL_ROLE] for p in pods.values()} == {"trainer", "rollout"}
    for pod in pods.values():
        assert pod_view(pod).rollout_token
        assert not pod_view(pod_spec.without_rollout_token(pod)).rollout_token
        assert pod_view(pod).rollout_token  # the copy's change left the pod as it was
