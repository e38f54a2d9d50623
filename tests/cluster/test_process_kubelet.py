"""The test cluster's pods are real processes: environment, volumes, cluster DNS,
read-only root, memory limits (a real OOM kill), exit codes and termination messages,
restart policies, graceful deletion, and a scheduler that fits requests and selectors.
Everything goes through the emulated API server; kubectl reads what the kubelets wrote."""

from __future__ import annotations

import base64
import json
import shutil
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testcluster import ProcessCluster, wait_for

NS = "default"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[ProcessCluster]:
    nodes = [
        {"labels": {"pool": "cpu"}},
        {"labels": {"pool": "gpu"}, "gpus": 2, "taints": ["gpu=true:NoSchedule"]},
    ]
    with ProcessCluster(tmp_path_factory.mktemp("cluster"), nodes) as running:
        yield running


def pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": spec.pop("image", "python:3.11-slim"),
        "command": ["python", "-c", textwrap.dedent(script)],
        **spec.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": spec.pop("labels", {})},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def data_object(kind: str, name: str, data: dict[str, str]) -> dict[str, Any]:
    """A ConfigMap or Secret (its values base64 already) in the test namespace."""
    return {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": NS},
        "data": data,
    }


def terminated(p: dict[str, Any]) -> dict[str, Any]:
    return p["status"]["containerStatuses"][0]["state"]["terminated"]


def test_environment_volumes_dns_read_only_root_and_termination_message(cluster):
    cluster.apply(data_object("ConfigMap", "job", {"job.yaml": "steps: 3\n"}))
    cluster.apply(data_object("Secret", "creds", {"KEY": base64.b64encode(b"s3cret").decode()}))
    script = """
        import json, os, socket
        facts = {
            "job": open("/etc/rlft/job.yaml").read(),
            "key": os.environ["KEY"],
            "ip": os.environ["POD_IP"],
            "name": os.environ["POD_NAME"],
            "hostname": socket.gethostname(),
            "resolved": socket.gethostbyname("w-0.workers.default.svc"),
            "resolved_long": socket.gethostbyname("w-0.workers.default.svc.cluster.local"),
            "args": os.environ["ECHO"],
        }
        open("/scratch/ok", "w").write("written")
        facts["tmp"] = os.listdir("/tmp")
        try:
            open("/etc/forbidden", "w")
        except OSError as error:
            facts["root"] = error.strerror
        print(json.dumps(facts))
        # Over the kubelet's 4096 bytes: it keeps the last ones.
        open("/dev/termination-log", "w").write("x" * 5000 + "the trainer's own verdict")
        raise SystemExit(3)
    """
    manifest = pod(
        "facts",
        script,
        hostname="w-0",
        subdomain="workers",
        container={
            "env": [
                {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "KEY"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "ECHO", "value": "name=$(POD_NAME) $$literal"},
            ],
            "volumeMounts": [
                # First: an emptyDir over /tmp hides the host's /tmp, where the kubelet
                # keeps the sources of the volumes that follow.
                {"name": "tmp", "mountPath": "/tmp"},
                {"name": "job", "mountPath": "/etc/rlft", "readOnly": True},
                {"name": "scratch", "mountPath": "/scratch"},
            ],
            "securityContext": {"readOnlyRootFilesystem": True},
        },
        volumes=[
            {"name": "job", "configMap": {"name": "job"}},
            {"name": "scratch", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
        ],
    )
    cluster.apply(manifest)
    done = cluster.wait_pod(NS, "facts", "Failed")
    state = terminated(done)
    assert (state["exitCode"], state["reason"]) == (3, "Error")
    message = state["message"]
    assert len(message) == 4096 and message.endswith("x" + "the trainer's own verdict")
    facts = json.loads(cluster.logs(NS, "facts").strip().splitlines()[-1])
    ip = done["status"]["podIP"]
    assert (
        ip.startswith("127.0.") and facts["ip"] == ip == facts["resolved"] == facts["resolved_long"]
    )
    assert facts["job"] == "steps: 3\n" and facts["key"] == "s3cret"
    assert facts["hostname"] == "w-0" and facts["name"] == "facts"
    assert facts["args"] == "name=facts $literal"
    assert facts["root"] == "Read-only file system"
    # The pod's own /tmp: none of the host's, bar the mount point that keeps the source
    # tree reachable when the repository itself lies under /tmp (a CI clone).
    repo = Path(__file__).resolve().parents[2]
    kept = {repo.relative_to("/tmp").parts[0]} if repo.is_relative_to("/tmp") else set()
    assert set(facts["tmp"]) <= kept and "pytest-of-root" not in facts["tmp"]
    # kubectl reads what the kubelet reported
    out = cluster.kubectl("get", "pod", "facts", "-o", "jsonpath={.status.phase}").stdout
    assert out == "Failed"


@pytest.fixture
def host_mount_point() -> Iterator[Path]:
    """A termination-message path that does not exist on this machine yet (the kubelet
    creates a missing mount point on the host, as its mount needs one); removed after."""
    folder = Path("/run") / f"rlft-test-{uuid.uuid4().hex[:8]}"
    yield folder / "termination-log"
    shutil.rmtree(folder, ignore_errors=True)


def test_a_missing_termination_message_path_behind_an_emptydir_on_tmp_is_a_file(
    cluster, host_mount_point
):
    """The kubelet keeps the message's source under /tmp, which an emptyDir on /tmp hides:
    the mount point must still be made a file (a folder there, left on the host, failed
    every later pod that mounts its message at that path: 'Not a directory')."""
    path = str(host_mount_point)
    manifest = pod(
        "message-behind-tmp",
        f"open({path!r}, 'w').write('said through a fresh path'); raise SystemExit(4)",
        container={
            "terminationMessagePath": path,
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        },
        volumes=[{"name": "tmp", "emptyDir": {}}],
    )
    cluster.apply(manifest)
    state = terminated(cluster.wait_pod(NS, "message-behind-tmp", "Failed"))
    assert (state["exitCode"], state["message"]) == (4, "said through a fresh path")
    assert host_mount_point.is_file()


def test_pods_on_two_nodes_reach_each_other_through_a_service(cluster):
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": NS},
            "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8000}]},
        }
    )
    server = pod(
        "web",
        """
        import http.server, os
        class Hello(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
                self.wfile.write(os.environ["HOSTNAME"].encode())
        http.server.HTTPServer((os.environ["POD_IP"], 8000), Hello).serve_forever()
        """,
        labels={"app": "web"},
        nodeSelector={"pool": "cpu"},
        container={
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        },
    )
    client = pod(
        "client",
        """
        import time, urllib.request
        for _ in range(100):
            try:
                answer = urllib.request.urlopen("http://web.default.svc:8000", timeout=2)
                print(answer.read().decode())
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise SystemExit("web.default.svc never answered")
        """,
        nodeSelector={"pool": "gpu"},
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )
    cluster.apply(server)
    cluster.wait_pod(NS, "web", "Running")
    cluster.apply(client)
    cluster.wait_pod(NS, "client", "Succeeded")
    assert cluster.logs(NS, "client").strip() == "web"
    nodes = {cluster.pod(NS, n)["spec"]["nodeName"] for n in ("web", "client")}
    assert nodes == {"node-a", "node-b"}
    cluster.kubectl("delete", "pod", "web", "--wait=false")
    cluster.wait_pod(NS, "web", gone=True, timeout=40)


def test_a_volume_over_the_folder_holding_the_image_environment_hides_nothing(cluster):
    """An emptyDir over the repository's parent (CI clones under /tmp, under a pod's
    /tmp emptyDir) still leaves the image's environment and the source tree reachable."""
    parent = str(Path(__file__).resolve().parents[3])
    covered = pod(
        "covered",
        f"import os, rlft.trainer; print(os.listdir({parent!r}) != [], rlft.trainer.__name__)",
        container={"volumeMounts": [{"name": "cover", "mountPath": parent}]},
        volumes=[{"name": "cover", "emptyDir": {}}],
    )
    cluster.apply(covered)
    cluster.wait_pod(NS, "covered", "Succeeded")
    assert cluster.logs(NS, "covered").split() == ["True", "rlft.trainer"]


def test_a_container_over_its_memory_limit_is_oom_killed(cluster):
    hog = pod(
        "hog",
        """
        blocks = []
        for _ in range(64):
            blocks.append(bytearray(16 * 2**20))
        """,
        container={"resources": {"limits": {"memory": "64Mi"}}},
    )
    cluster.apply(hog)
    state = terminated(cluster.wait_pod(NS, "hog", "Failed"))
    assert (state["exitCode"], state["reason"]) == (137, "OOMKilled")


def test_deletion_sends_sigterm_and_waits_then_kills(cluster, tmp_path):
    marker = tmp_path / "drained"
    polite = pod(
        "polite",
        """
        import signal, time
        def drain(*_):
            open("/host/drained", "w").write("checkpoint committed")
            raise SystemExit(0)
        signal.signal(signal.SIGTERM, drain)
        print("serving", flush=True)
        time.sleep(3600)
        """,
        terminationGracePeriodSeconds=30,
        container={"volumeMounts": [{"name": "host", "mountPath": "/host"}]},
        volumes=[{"name": "host", "hostPath": {"path": str(tmp_path)}}],
    )
    stubborn = pod(
        "stubborn",
        """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("serving", flush=True)
        time.sleep(3600)
        """,
        terminationGracePeriodSeconds=2,
    )
    cluster.apply(polite)
    cluster.apply(stubborn)
    for name in ("polite", "stubborn"):
        cluster.wait_pod(NS, name, "Running")
        wait_for(lambda n=name: "serving" in cluster.logs(NS, n), f"{name} to start")
    cluster.kubectl("delete", "pod", "polite", "stubborn", "--wait=false")
    terminating = cluster.pod(NS, "stubborn")
    assert terminating is not None and terminating["metadata"]["deletionTimestamp"]
    cluster.wait_pod(NS, "polite", gone=True)
    assert marker.read_text() == "checkpoint committed"
    cluster.wait_pod(NS, "stubborn", gone=True, timeout=30)


def test_env_from_and_sub_paths_as_a_kubelet_sets_them(cluster):
    """envFrom (a ConfigMap with a prefix, a Secret; `env` wins over both) and subPath
    mounts (a folder inside an emptyDir, created when missing; one key of a ConfigMap
    as a file), which the operator renders from a role's pod settings; a missing
    non-optional envFrom source is CreateContainerConfigError. (The kubelet ignored
    both fields: a test using them passed with neither in effect.)"""
    tuning = {"NCCL_DEBUG": "WARN", "MODE": "fast", "bad-name": "x"}
    cluster.apply(data_object("ConfigMap", "tuning", tuning))
    cluster.apply(data_object("Secret", "hub", {"HF_TOKEN": base64.b64encode(b"t0ken").decode()}))
    script = """
        import json, os
        open("/data/written", "w").write("in the sub-folder")
        print(json.dumps({
            "env": {k: os.environ.get(k) for k in ("CM_NCCL_DEBUG", "CM_MODE", "HF_TOKEN")},
            "bad": [k for k in os.environ if "bad" in k],
            "mode_file": open("/etc/mode").read(),
        }))
        """
    manifest = pod(
        "env-from",
        script,
        container={
            "envFrom": [
                {"configMapRef": {"name": "tuning"}, "prefix": "CM_"},
                {"secretRef": {"name": "hub"}},
                {"configMapRef": {"name": "absent", "optional": True}},
            ],
            "env": [{"name": "CM_MODE", "value": "exact"}],
            "volumeMounts": [
                {"name": "scratch", "mountPath": "/data", "subPath": "runs/a"},
                {"name": "tuning", "mountPath": "/etc/mode", "subPath": "MODE"},
            ],
        },
        volumes=[
            {"name": "scratch", "emptyDir": {}},
            {"name": "tuning", "configMap": {"name": "tuning"}},
        ],
    )
    cluster.apply(manifest)
    done = cluster.wait_pod(NS, "env-from", "Succeeded")
    facts = json.loads(cluster.logs(NS, "env-from").strip().splitlines()[-1])
    assert facts["env"] == {"CM_NCCL_DEBUG": "WARN", "CM_MODE": "exact", "HF_TOKEN": "t0ken"}
    assert facts["bad"] == [] and facts["mode_file"] == "fast"
    folder = cluster.pod_folder(NS, "env-from")
    written = list(folder.glob("volumes/scratch/runs/a/written")) if folder else []
    assert written and written[0].read_text() == "in the sub-folder", done["status"]
    missing = pod(
        "env-missing", "print(1)", container={"envFrom": [{"secretRef": {"name": "nope"}}]}
    )
    cluster.apply(missing)

    def waiting() -> dict | None:
        statuses = ((cluster.pod(NS, "env-missing") or {}).get("status") or {}).get(
            "containerStatuses"
        ) or [{}]
        return statuses[0].get("state", {}).get("waiting")

    state = wait_for(lambda: (w := waiting()) and w["reason"] != "Creating" and w, "its state")
    assert state["reason"] == "CreateContainerConfigError"
    assert 'secret "nope" not found' in state["message"]
    cluster.kubectl("delete", "pod", "env-missing", "--wait=false")


GRACE_S = 20
"""pid-one's grace period: what it waits out, and what the shared pod ends well within."""


def test_a_command_without_a_sigterm_handler_is_pid_1_and_waits_for_its_grace(cluster):
    """What a runtime does: the command is PID 1 of the container's own PID namespace,
    and PID 1 gets no SIGTERM it has no handler for: it runs until SIGKILL at the end
    of the grace period. With shareProcessNamespace (the operator's pods) the pod's
    sandbox is PID 1, the command is not, and SIGTERM ends it at once."""
    script = """
        import os, time
        print("pid", os.getpid(), flush=True)
        time.sleep(3600)
        """
    # A grace far past the other pod's end, however slow the machine (a 4 s one was
    # about as long as a loaded machine took to see the shared pod gone).
    cluster.apply(pod("pid-one", script, terminationGracePeriodSeconds=GRACE_S))
    cluster.apply(
        pod("shared", script, terminationGracePeriodSeconds=60, shareProcessNamespace=True)
    )
    for name in ("pid-one", "shared"):
        cluster.wait_pod(NS, name, "Running")
        wait_for(lambda n=name: "pid" in cluster.logs(NS, n), f"{name} to start")
    assert "pid 1\n" in cluster.logs(NS, "pid-one")
    assert "pid 1\n" not in cluster.logs(NS, "shared")
    deleted = time.monotonic()
    cluster.kubectl("delete", "pod", "pid-one", "shared", "--wait=false")
    cluster.wait_pod(NS, "shared", gone=True, timeout=20)
    shared_gone = time.monotonic() - deleted
    assert cluster.pod(NS, "pid-one") is not None  # still in its grace
    cluster.wait_pod(NS, "pid-one", gone=True, timeout=GRACE_S + 30)
    pid_one_gone = time.monotonic() - deleted
    assert shared_gone < GRACE_S <= pid_one_gone, (shared_gone, pid_one_gone)


def test_restart_policy_on_failure_restarts_and_counts(cluster, tmp_path):
    flaky = pod(
        "flaky",
        """
        import os
        if not os.path.exists("/host/ran"):
            open("/host/ran", "w").write("1")
            raise SystemExit(1)
        print("second run")
        """,
        restartPolicy="OnFailure",
        container={"volumeMounts": [{"name": "host", "mountPath": "/host"}]},
        volumes=[{"name": "host", "hostPath": {"path": str(tmp_path)}}],
    )
    cluster.apply(flaky)
    done = cluster.wait_pod(NS, "flaky", "Succeeded", timeout=30)
    status = done["status"]["containerStatuses"][0]
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 1
    assert "second run" in cluster.logs(NS, "flaky")


def test_scheduler_fits_requests_and_reports_what_does_not_fit(cluster):
    cluster.apply(
        pod("too-big", "print(1)", container={"resources": {"requests": {"memory": "64Gi"}}})
    )
    gpu_job = pod(
        "gpu-job",
        "import os; print(os.environ['HOSTNAME'])",
        tolerations=[{"key": "gpu", "operator": "Exists"}],
        container={"resources": {"limits": {"nvidia.com/gpu": 2}}},
    )
    cluster.apply(gpu_job)
    assert cluster.wait_pod(NS, "gpu-job", "Succeeded")["spec"]["nodeName"] == "node-b"

    def unschedulable() -> str | None:
        conditions = (cluster.pod(NS, "too-big").get("status") or {}).get("conditions") or []
        found = [c for c in conditions if c.get("reason") == "Unschedulable"]
        return found[0]["message"] if found else None

    message = wait_for(unschedulable, "too-big to be reported unschedulable")
    assert message.startswith("0/2 nodes are available") and "Insufficient memory" in message
    assert not cluster.pod(NS, "too-big")["spec"].get("nodeName")
    cluster.kubectl("delete", "pod", "too-big", "--wait=false")
    cluster.wait_pod(NS, "too-big", gone=True)


def test_a_missing_secret_or_image_leaves_the_pod_waiting_with_the_reason(cluster):
    needs = pod(
        "needs-secret",
        "import os; print(os.environ['TOKEN'])",
        container={
            "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "late", "key": "t"}}}]
        },
    )
    cluster.apply(needs)
    cluster.apply(pod("no-image", "print(1)", image="registry.example/nothing:1"))

    def waiting(name: str) -> dict[str, Any] | None:
        statuses = (cluster.pod(NS, name).get("status") or {}).get("containerStatuses") or []
        return statuses[0]["state"].get("waiting") if statuses else None

    state = wait_for(lambda: waiting("needs-secret"), "needs-secret to wait")
    assert state == {"reason": "CreateContainerConfigError", "message": 'secret "late" not found'}
    assert wait_for(lambda: waiting("no-image"), "no-image to wait")["reason"] == "ErrImagePull"
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "late", "namespace": NS},
            "data": {"t": base64.b64encode(b"now").decode()},
        }
    )
    cluster.wait_pod(NS, "needs-secret", "Succeeded")
    assert cluster.logs(NS, "needs-secret").strip() == "now"
    cluster.kubectl("delete", "pod", "no-image", "--wait=false")
    cluster.wait_pod(NS, "no-image", gone=True)


def test_config_map_and_secret_volumes_are_read_only_whatever_the_mount_says(cluster):
    """A kubelet mounts configMap and secret volumes read-only (since the fix of
    CVE-2017-1002102), also where the mount leaves readOnly unset: a process writing into
    its job file's folder fails on a real node. (The kubelet mounted them read-write.)"""
    cluster.apply(data_object("ConfigMap", "ro-cm", {"a": "1"}))
    cluster.apply(data_object("Secret", "ro-secret", {"b": base64.b64encode(b"2").decode()}))
    script = """
        import json
        seen = {}
        for path in ("/cm/a", "/cm/new", "/secret/b", "/scratch/new"):
            try:
                open(path, "w").write("x")
                seen[path] = "written"
            except OSError as error:
                seen[path] = error.errno
        seen["read"] = open("/cm/a").read() + open("/secret/b").read()
        print(json.dumps(seen))
        """
    manifest = pod(
        "ro-volumes",
        script,
        container={
            "volumeMounts": [
                {"name": "cm", "mountPath": "/cm"},
                {"name": "secret", "mountPath": "/secret", "readOnly": False},
                {"name": "scratch", "mountPath": "/scratch"},
            ]
        },
        volumes=[
            {"name": "cm", "configMap": {"name": "ro-cm"}},
            {"name": "secret", "secret": {"secretName": "ro-secret"}},
            {"name": "scratch", "emptyDir": {}},
        ],
    )
    cluster.apply(manifest)
    cluster.wait_pod(NS, "ro-volumes", "Succeeded")
    seen = json.loads(cluster.logs(NS, "ro-volumes").strip().splitlines()[-1])
    erofs = 30
    assert seen == {
        "/cm/a": erofs,
        "/cm/new": erofs,
        "/secret/b": erofs,
        "/scratch/new": "written",
        "read": "12",
    }


def test_the_readme_lists_what_is_emulated():
    text = (Path(__file__).parent / "README.md").read_text()
    for topic in ("API server", "scheduler", "DNS", "CNI", "probes", "not a real cluster"):
        assert topic in text, topic


def test_a_node_back_after_a_short_outage_does_not_rerun_what_must_not_restart(cluster):
    """The machine dies and comes back before the pods are evicted: their processes died
    with it. A kubelet ends a `Never` container ContainerStatusUnknown (137) and starts an
    `Always` one again, its restart counted. (The emulator started both afresh, hiding a
    trainer's failure behind a seamless rerun.)"""
    script = """
        import time
        print("up", flush=True)
        time.sleep(3600)
        """
    on_b = {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}
    cluster.apply(pod("once", script, **on_b))
    cluster.apply(pod("again", script, restartPolicy="Always", **on_b))
    for name in ("once", "again"):
        cluster.wait_pod(NS, name, "Running")
        wait_for(lambda n=name: "up" in cluster.logs(NS, n), f"{name} to start")
    node = cluster.node(cluster.pod(NS, "once")["spec"]["nodeName"])
    node.lose()
    node.rejoin()
    state = terminated(cluster.wait_pod(NS, "once", "Failed", timeout=60))
    assert (state["exitCode"], state["reason"]) == (137, "ContainerStatusUnknown")

    def restarted() -> dict | None:
        status = (cluster.pod(NS, "again") or {}).get("status") or {}
        statuses = status.get("containerStatuses") or [{}]
        running = statuses[0].get("state", {}).get("running")
        return statuses[0] if running and statuses[0].get("restartCount") == 1 else None

    status = wait_for(restarted, "the Always pod restarted once", timeout=60)
    assert status["lastState"]["terminated"]["reason"] == "ContainerStatusUnknown"
    cluster.kubectl("delete", "pod", "once", "again", "--wait=false")
