"""The test cluster on one machine: the emulated API server, a scheduler and one process
kubelet per simulated node, each its own process, with the real kubectl. Pods run as
real processes (see README.md for what is emulated). Not a real cluster.

    with ProcessCluster(tmp_path, nodes=2) as cluster:
        cluster.apply(pod_manifest)
        cluster.wait_pod("default", "hello", phase="Succeeded")
        print(cluster.logs("default", "hello"))
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "operator"))

from cluster import EmulatedApiServer, OperatorProcess, wait_for  # noqa: E402
from kube_api import Api  # noqa: E402
from kubelet import CGROUP_ROOT, kill_cgroup  # noqa: E402
from processes import stop_process  # noqa: E402

from rlft.operator.options import POD_PORTS  # noqa: E402

SLOTS = 12
"""Test clusters that can run at once on this machine (pytest-xdist workers)."""


class Slot:
    """What keeps test clusters on one machine apart: pods share the machine's network
    (no network namespaces), so each cluster gets its own node addresses (127.0.I.x with
    I from `first_node`), its own ports for the operator's pods (below the ephemeral
    range, so no client socket holds one), and its own memory cgroups. Claimed by an
    exclusive lock on a file, held until `release`, so it is free again when the process
    that held it dies."""

    def __init__(self) -> None:
        for number in range(SLOTS):
            lock = Path(tempfile.gettempdir()) / f"rlft-test-cluster-slot-{number}.lock"
            handle = lock.open("w")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            self.number, self.handle = number, handle
            return
        raise RuntimeError(f"all {SLOTS} test cluster slots are taken on this machine")

    @property
    def first_node(self) -> int:
        return 10 + 20 * self.number

    @property
    def cgroup_parent(self) -> str:
        return f"rlft-test-cluster/slot-{self.number}"

    def ports(self) -> dict[str, int]:
        base = 20000 + 100 * self.number
        return {name: base + i for i, name in enumerate(POD_PORTS)}

    def release(self) -> None:
        self.handle.close()


class Node:
    """One process kubelet."""

    def __init__(self, cluster: ProcessCluster, name: str, index: int, **options: Any):
        self.name, self.index = name, index
        self.cgroups = CGROUP_ROOT / cluster.slot.cgroup_parent / name
        self.state = cluster.workdir / "nodes" / name
        self.state.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            str(HERE / "kubelet.py"),
            "--api",
            cluster.api_server.url,
            "--node",
            name,
            "--index",
            str(index),
            "--state",
            str(self.state),
            "--cpu",
            str(options.get("cpu", "4")),
            "--memory",
            str(options.get("memory", "8Gi")),
            "--gpus",
            str(options.get("gpus", 0)),
            "--cgroup-parent",
            cluster.slot.cgroup_parent,
        ]
        command += [f"--label={k}={v}" for k, v in (options.get("labels") or {}).items()]
        command += [f"--taint={t}" for t in options.get("taints") or []]
        self.command = command
        self.log = (self.state / "kubelet.log").open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def rejoin(self) -> None:
        """After `lose()`: the machine is back, a new kubelet with the same name, state
        folder and pod addresses registers it again."""
        assert self.process.poll() is not None, f"node {self.name} is not lost"
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        """Stop the kubelet; its pods' processes end with it."""
        stop_process(self.process, timeout=30)
        self.kill_leftovers()
        self.log.close()

    def lose(self) -> None:
        """Fault injection: the node is lost (power, kernel panic, network): its kubelet
        and every container process die at once, and its heartbeats stop."""
        self.process.kill()
        self.process.wait()
        self.kill_leftovers()

    def kill_leftovers(self) -> None:
        """Containers the kubelet started and did not reap (it was killed itself): their
        process groups, by the ids it recorded, and whatever else is in their cgroups."""
        for pid_file in (self.state / "pids").glob("*") if (self.state / "pids").is_dir() else []:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid_file.name), signal.SIGKILL)
            pid_file.unlink(missing_ok=True)
        groups = self.cgroups
        for group in groups.iterdir() if groups.is_dir() else []:
            kill_cgroup(group)


class ProcessCluster:
    def __init__(self, workdir: Path, nodes: int | list[dict[str, Any]] = 2):
        self.workdir = workdir
        self.slot = Slot()
        self.ports = self.slot.ports()
        """The operator's pod ports in this cluster (`POD_PORTS`)."""
        try:
            self.api_server = EmulatedApiServer(workdir / "api", graceful_pods=True)
        except BaseException:
            self.slot.release()
            raise
        self.api = Api(self.api_server.url)
        self.nodes: list[Node] = []
        self.operator: OperatorProcess | None = None
        self.operator_args: list[str] = []
        self.operator_starts = 0
        self.scheduler_log = (workdir / "scheduler.log").open("w")
        self.scheduler = subprocess.Popen(
            [sys.executable, str(HERE / "scheduler.py"), "--api", self.api_server.url],
            stdout=self.scheduler_log,
            stderr=subprocess.STDOUT,
        )
        specs = [{} for _ in range(nodes)] if isinstance(nodes, int) else nodes
        try:
            for i, options in enumerate(specs):
                self.add_node(options.pop("name", f"node-{chr(ord('a') + i)}"), **options)
        except BaseException:
            self.stop()
            raise

    def add_node(self, name: str, **options: Any) -> Node:
        node = Node(self, name, self.slot.first_node + len(self.nodes), **options)
        self.nodes.append(node)
        wait_for(lambda: self.node_ready(name), f"node {name} to be Ready", timeout=30)
        return node

    def node(self, name: str) -> Node:
        return next(node for node in self.nodes if node.name == name)

    def node_ready(self, name: str) -> bool:
        node = self.api.get("nodes", None, name)
        conditions = ((node or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    # ------------------------------------------------------------ for the tests
    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.api_server.kubectl(*args, **kw)

    def apply(self, document: dict[str, Any] | str, *args: str, check: bool = True) -> Any:
        return self.api_server.apply(document, *args, check=check)

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.api.get("pods", namespace, name)

    def wait_pod(
        self, namespace: str, name: str, phase: str | None = None, timeout: float = 60, **more: Any
    ) -> dict[str, Any]:
        """Until the pod reaches `phase` (or, with `gone=True`, no longer exists)."""
        if more.get("gone"):
            wait_for(lambda: self.pod(namespace, name) is None, f"pod {name} to go", timeout)
            return {}

        def reached() -> dict[str, Any] | None:
            pod = self.pod(namespace, name)
            return pod if pod and (pod.get("status") or {}).get("phase") == phase else None

        try:
            return wait_for(reached, f"pod {namespace}/{name} to be {phase}", timeout)
        except AssertionError as error:
            raise AssertionError(f"{error}\nlogs:\n{self.logs(namespace, name)}") from None

    def pod_folder(self, namespace: str, name: str) -> Path | None:
        """The kubelet's folder of the pod of that name: the current one while it exists,
        else the newest (a replaced pod has the same name and a new uid)."""
        pod = self.pod(namespace, name)
        folders = [
            folder
            for node in self.nodes
            for folder in (node.state / "pods").glob(f"{namespace}_{name}_*")
        ]
        if pod is not None:
            current = [f for f in folders if f.name.endswith(pod["metadata"]["uid"][:8])]
            folders = current or folders
        return max(folders, key=lambda f: f.stat().st_mtime, default=None)

    def logs(self, namespace: str, name: str, container: str = "main") -> str:
        """The container's log (every run of it), from the node that runs the pod."""
        folder = self.pod_folder(namespace, name)
        path = folder / f"{container}.log" if folder else None
        return path.read_text(errors="replace") if path and path.exists() else ""

    def container_pid(self, namespace: str, name: str, container: str = "main") -> int:
        """The process id of the container's first process (its process group's id)."""
        folder = self.pod_folder(namespace, name)
        if folder is None or not (folder / f"{container}.pid").exists():
            raise AssertionError(f"pod {namespace}/{name} has no running {container} container")
        return int((folder / f"{container}.pid").read_text())

    def kill_container(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> None:
        """Fault injection: `sig` to every process of the container (as a crashed runtime
        would): its process group and, for SIGKILL, every process in its cgroup."""
        os.killpg(self.container_pid(namespace, name), sig)
        if sig == signal.SIGKILL:
            folder = self.pod_folder(namespace, name)
            sandbox = json.loads((folder / "main.sandbox.json").read_text()) if folder else {}
            kill_cgroup(Path(sandbox["cgroup"]) if sandbox.get("cgroup") else None)

    def install_operator(
        self, namespace: str, credentials: dict[str, str], secret: str = "s3-creds"
    ) -> OperatorProcess:
        """The CRDs, `namespace` with a Secret holding `credentials` (the S3 environment),
        and the real operator watching every namespace, stopped with the cluster."""
        for crd in ("rlfinetune.yaml", "kopf-peering.yaml"):
            self.kubectl("apply", "--validate=false", "-f", str(ROOT / "crds" / crd))
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        self.create_secret(namespace, secret, credentials)
        self.operator_args = [
            "--all-namespaces",
            "--peering", "rlft-test-cluster",
            "--priority", "100",
            "--poll-seconds", "1",
            *(f"--{name}-port={port}" for name, port in self.ports.items()),
            "--grace-seconds", "20",
        ]  # fmt: skip
        self.operator = OperatorProcess(self.api_server, *self.operator_args)
        self.operator_starts = 1
        return self.operator

    def create_secret(self, namespace: str, name: str, values: dict[str, str]) -> None:
        data = {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}
        self.apply(
            {"apiVersion": "v1", "kind": "Secret",
             "metadata": {"name": name, "namespace": namespace}, "data": data}
        )  # fmt: skip

    def restart_operator(self, sig: int = signal.SIGKILL) -> OperatorProcess:
        """Fault injection: stop the operator with `sig` (SIGKILL: mid-reconcile, no
        cleanup) and start a new one, as a Deployment would. The new one has a higher
        leader-election priority than the killed one's, as a new replica does one time
        in two (the operator draws its priority at random): with an equal or lower one,
        kopf pauses it until the killed replica's peering record expires (60 s), which
        `tests/operator/test_operator_integration.py` covers."""
        assert self.operator is not None, "install_operator first"
        self.operator.stop(sig=sig)
        self.operator_starts += 1
        name = f"operator-{self.operator_starts}"
        args = list(self.operator_args)
        args[args.index("--priority") + 1] = str(100 + self.operator_starts)
        self.operator = OperatorProcess(self.api_server, *args, name=name)
        return self.operator

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        for node in self.nodes:
            node.stop()
        if self.scheduler.poll() is None:
            self.scheduler.terminate()
            self.scheduler.wait(timeout=10)
        self.scheduler_log.close()
        self.api_server.stop()
        self.slot.release()

    def __enter__(self) -> ProcessCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
