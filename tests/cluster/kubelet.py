"""A process kubelet: one simulated node of the test cluster.

    python tests/cluster/kubelet.py --api URL --node node-a --index 1 --cpu 4 --memory 8Gi

It registers its Node (capacity, a Ready condition it keeps fresh), runs the pods bound
to it as real processes (`podinit.py` in their own mount and UTS namespaces, under a
memory cgroup with the container's limit, with ConfigMap, Secret, emptyDir and
PersistentVolumeClaim volumes (a claim bound to a hostPath PersistentVolume is its folder),
the pod's environment and a per-pod /etc/hosts for cluster DNS), and reports what a
kubelet reports: phase, podIP, Ready, containerStatuses (running; terminated with exit
code, reason Completed / Error / OOMKilled and the termination message), restarts per
restartPolicy. It runs httpGet startup, liveness and readiness probes (`probes.py`): they
set a container's `started` and `ready`, and a failed liveness or startup probe stops it.
A pod marked for deletion gets SIGTERM on each container's main process (PID 1 of its
own PID namespace unless the pod sets shareProcessNamespace), then SIGKILL on all its
processes after its grace period, and is removed. What it does not do is listed in README.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from cluster_dns import hosts_file  # noqa: E402
from cluster_images import environment_of  # noqa: E402
from cluster_resources import memory_limit  # noqa: E402
from kube_api import Api, ApiError  # noqa: E402
from probes import ContainerProbes, event_body, probe_specs  # noqa: E402

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
KUBELET_CONDITIONS = ("PodScheduled", "Initialized", "ContainersReady", "Ready")
"""The pod conditions a kubelet writes; it keeps the others."""
HEARTBEAT_S = 1.0
SYNC_S = 0.2
BACKOFF_S = (1, 2, 4, 8)
"""Restart back-off after each crash (a real kubelet: 10 s doubling to 5 minutes)."""
TERMINATION_LOG = "/dev/termination-log"
MAX_MESSAGE = 4096
READ_ONLY_SOURCES = ("configMap", "secret", "downwardAPI", "projected")
"""Volume sources a kubelet always mounts read-only."""


def write_atomically(folder: Path, files: dict[str, bytes]) -> None:
    """A ConfigMap's or Secret's keys as a kubelet's atomic writer lays them out: the
    files in a hidden timestamped folder, `..data` a link to it (swapped by a rename when
    the object changes), and a link `key -> ..data/key` per key. Whatever reads such a
    volume meets links and `..` entries here as on a node."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = folder / f"..{time.strftime('%Y_%m_%d_%H_%M_%S', time.gmtime())}.{time.time_ns()}"
    stamp.mkdir()
    for name, content in files.items():
        (stamp / name).write_bytes(content)
    data, swap = folder / "..data", folder / "..data_tmp"
    previous = os.readlink(data) if data.is_symlink() else None
    swap.unlink(missing_ok=True)
    swap.symlink_to(stamp.name)
    os.rename(swap, data)
    for name in files:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")
    for gone in folder.iterdir():  # the links of keys the object no longer has
        if gone.is_symlink() and not gone.name.startswith("..") and gone.name not in files:
            gone.unlink()
    if previous is not None:
        shutil.rmtree(folder / previous, ignore_errors=True)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ConfigError(Exception):
    """A Secret or ConfigMap the container needs is missing (CreateContainerConfigError)."""


@dataclass
class Container:
    spec: dict[str, Any]
    log: Path
    termination: Path
    cgroup: Path | None = None
    process: subprocess.Popen | None = None
    started_at: str | None = None
    restarts: int = 0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "Creating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    restart_at: float | None = None
    probes: ContainerProbes | None = None
    """This run's probe workers (probes.py)."""
    kill_at: float | None = None
    """When a container its probe failed gets SIGKILL (it got SIGTERM)."""
    own_pid_namespace: bool = False
    """Its command is PID 1 of a PID namespace of its own (the pod does not set
    shareProcessNamespace): the child podinit forks, not `process`."""
    term_pending: bool = False
    """SIGTERM is due but its PID 1 did not exist yet (podinit had not forked)."""

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class PodRun:
    pod: dict[str, Any]
    folder: Path
    ip: str
    hosts: Path
    containers: list[Container]
    env_error: str | None = None
    kill_at: float | None = None
    reported: dict[str, Any] = field(default_factory=dict)
    hosts_text: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.pod["metadata"]["namespace"], self.pod["metadata"]["name"]


class Kubelet:
    def __init__(
        self,
        api: Api,
        node: str,
        index: int,
        capacity: dict[str, str],
        state: Path,
        labels: dict[str, str],
        taints: list[dict[str, str]],
        cgroup_parent: str = "rlft-test-cluster",
    ):
        self.api, self.node, self.index = api, node, index
        self.capacity, self.labels, self.taints = capacity, labels, taints
        self.state = state
        self.runs: dict[str, PodRun] = {}  # by pod uid
        self.next_ip = 2
        self.stopping = False
        self.cgroups = CGROUP_ROOT / cgroup_parent / node

    # ------------------------------------------------------------------ node
    def register(self) -> None:
        body = {
            "metadata": {
                "name": self.node,
                "labels": {"kubernetes.io/hostname": self.node, **self.labels},
            },
            "spec": {"taints": self.taints} if self.taints else {},
        }
        if self.api.get("nodes", None, self.node) is None:
            self.api.create("nodes", None, body)
        else:
            self.api.patch("nodes", None, self.node, body)
        self.heartbeat()

    def heartbeat(self) -> None:
        stamp = now()
        status = {
            "capacity": self.capacity,
            "allocatable": self.capacity,
            "addresses": [{"type": "InternalIP", "address": f"127.0.{self.index}.1"}],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "the process kubelet is posting ready status",
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": stamp,
                }
            ],
            "nodeInfo": {"kubeletVersion": "process-kubelet", "operatingSystem": "linux"},
        }
        self.api.patch("nodes", None, self.node, {"status": status}, status=True)

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        self.register()
        beat = time.monotonic()
        while not self.stopping:
            try:
                self.sync()
                if time.monotonic() - beat >= HEARTBEAT_S:
                    self.heartbeat()
                    beat = time.monotonic()
            except (ApiError, OSError) as error:  # the API server restarting: try again
                print(f"kubelet {self.node}: {error}", file=sys.stderr, flush=True)
            time.sleep(SYNC_S)
        self.shutdown()

    def sync(self) -> None:
        pods = self.api.list("pods")
        services = self.api.list("services")
        mine = {p["metadata"]["uid"]: p for p in pods if p["spec"].get("nodeName") == self.node}
        for uid, pod in mine.items():
            run = self.runs.get(uid)
            if run is None:
                if pod["metadata"].get("deletionTimestamp"):
                    self.api.delete("pods", *_key(pod), grace=0)
                    continue
                run = self.runs[uid] = self.admit(pod)
            run.pod = pod
            hosts = hosts_file(pod, run.ip, pods, services)
            if hosts != run.hosts_text:
                _rewrite_in_place(run.hosts, hosts)
                run.hosts_text = hosts
            if pod["metadata"].get("deletionTimestamp"):
                if self.terminate(run):
                    # The final status first, as a kubelet's status manager sends it
                    # before the last delete: how each container ended (OOMKilled, …).
                    for container in run.containers:
                        if container.process is not None:
                            self._exited(run, container, "Never")
                    self.report(run)
                    self.remove(uid)
                continue
            self.drive(run)
            self.report(run)
        for uid in [u for u in self.runs if u not in mine]:  # deleted behind our back
            self.kill(self.runs[uid])
            self.remove(uid, delete=False)

    # ------------------------------------------------------------------ pods
    def admit(self, pod: dict[str, Any]) -> PodRun:
        ns, name = _key(pod)
        folder = self.state / "pods" / f"{ns}_{name}_{pod['metadata']['uid'][:8]}"
        folder.mkdir(parents=True, exist_ok=True)
        ip = f"127.0.{self.index}.{self.next_ip}"
        self.next_ip = self.next_ip + 1 if self.next_ip < 254 else 2
        hosts = folder / "hosts"
        hosts.write_text("")
        containers = [
            Container(c, folder / f"{c['name']}.log", folder / f"{c['name']}.termination")
            for c in pod["spec"]["containers"]
        ]
        for container in containers:
            container.termination.write_text("")
        _lost_before(pod, containers)
        return PodRun(pod, folder, ip, hosts, containers)

    def drive(self, run: PodRun) -> None:
        """Start what should run, notice what exited, restart per restartPolicy."""
        policy = run.pod["spec"].get("restartPolicy", "Always")
        for container in run.containers:
            if container.running:
                self._probed(run, container)
                continue
            if container.process is not None:
                self._exited(run, container, policy)
            if container.process is None and _may_start(container, policy):
                if container.restart_at is not None and time.monotonic() < container.restart_at:
                    continue
                self.start(run, container)

    def _probed(self, run: PodRun, container: Container) -> None:
        """Post what the probes saw; stop a container whose liveness or startup probe
        failed as a kubelet does: SIGTERM, then SIGKILL after the probe's grace."""
        probes = container.probes
        if probes is None:
            return
        for kind, reason, message in probes.drain_events():
            with contextlib.suppress(ApiError, OSError):  # an Event is best effort
                body = event_body(run.pod, container.name, self.node, kind, reason, message)
                self.api.create("events", run.key[0], body)
        if probes.kill is not None and container.kill_at is None:
            container.kill_at = time.monotonic() + probes.kill.grace
            _signal(container, signal.SIGTERM)
        elif container.term_pending:
            _signal(container, signal.SIGTERM)
        if container.kill_at is not None and time.monotonic() >= container.kill_at:
            _signal(container, signal.SIGKILL)

    def _exited(self, run: PodRun, container: Container, policy: str) -> None:
        if container.probes is not None:
            container.probes.stop()
            container.probes = None
        container.kill_at = None
        code = container.process.returncode
        code = 128 - code if code < 0 else code
        oom = _oom_killed(container.cgroup)
        reason = "OOMKilled" if oom else ("Completed" if code == 0 else "Error")
        terminated = {
            "exitCode": code,
            "reason": reason,
            "startedAt": container.started_at,
            "finishedAt": now(),
            "containerID": f"process://{container.process.pid}",
        }
        message = _termination_message(container, code)
        if message:
            terminated["message"] = message
        (self.state / "pids" / str(container.process.pid)).unlink(missing_ok=True)
        container.process = None
        kill_cgroup(container.cgroup)  # what outlived the first process
        _remove_cgroup(container.cgroup)
        container.cgroup = None
        restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        if restart:
            container.last_state = {"terminated": terminated}
            delay = BACKOFF_S[min(container.restarts, len(BACKOFF_S) - 1)]
            container.restart_at = time.monotonic() + delay
            container.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay}s restarting failed container",
                }
            }
            container.restarts += 1
        else:
            container.state = {"terminated": terminated}
            container.restart_at = None

    def start(self, run: PodRun, container: Container) -> None:
        pod, spec = run.pod, container.spec
        image = spec.get("image", "")
        environment = environment_of(image)
        if environment is None:
            container.state = {
                "waiting": {"reason": "ErrImagePull", "message": f"image {image!r} not found"}
            }
            return
        try:
            env = self._environment(pod, spec, run.ip, environment)
        except ConfigError as error:
            container.state = {
                "waiting": {"reason": "CreateContainerConfigError", "message": str(error)}
            }
            return
        argv = [_expand(a, env) for a in (spec.get("command") or []) + (spec.get("args") or [])]
        if not argv:
            container.state = {
                "waiting": {"reason": "CreateContainerError", "message": "no command"}
            }
            return
        try:
            mounts = self._mounts(run, container)
        except ConfigError as error:
            container.state = {
                "waiting": {"reason": "CreateContainerConfigError", "message": str(error)}
            }
            return
        container.cgroup = self._cgroup(run, container)
        security = spec.get("securityContext") or {}
        # Without shareProcessNamespace a runtime makes the command PID 1 of its own PID
        # namespace, and the kernel gives PID 1 only the signals it has handlers for
        # (SIGKILL aside): a command without a SIGTERM handler outlives its grace.
        container.own_pid_namespace = not pod["spec"].get("shareProcessNamespace", False)
        sandbox = {
            "ownPidNamespace": container.own_pid_namespace,
            "hostname": pod["spec"].get("hostname") or pod["metadata"]["name"],
            "mounts": mounts,
            "readOnlyRootFilesystem": bool(security.get("readOnlyRootFilesystem")),
            "cgroup": str(container.cgroup) if container.cgroup else None,
            "workingDir": spec.get("workingDir"),
            "argv": argv,
            "env": env,
            "terminationMessage": spec.get("terminationMessagePath", TERMINATION_LOG),
            "keepVisible": [str(REPO), str(environment)],
        }
        spec_file = run.folder / f"{container.name}.sandbox.json"
        spec_file.write_text(json.dumps(sandbox))
        container.termination.write_text("")
        with container.log.open("ab") as log:
            container.process = subprocess.Popen(
                [
                    "unshare",
                    "-m",
                    "-u",
                    "--propagation",
                    "private",
                    sys.executable,
                    str(HERE / "podinit.py"),
                    str(spec_file),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        (self.state / "pids").mkdir(exist_ok=True)
        (self.state / "pids" / str(container.process.pid)).write_text(container.name)
        # For the tests' fault injection: the container's process group, by pod.
        container.log.with_suffix(".pid").write_text(str(container.process.pid))
        container.started_at = now()
        container.state = {"running": {"startedAt": container.started_at}}
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        specs = probe_specs(spec, run.ip, grace)
        if specs:
            container.probes = ContainerProbes(container.name, specs)
            container.probes.start(time.monotonic())

    def _environment(
        self, pod: dict[str, Any], spec: dict[str, Any], ip: str, environment: Path
    ) -> dict[str, str]:
        ns = pod["metadata"]["namespace"]
        env = {
            "PATH": f"{environment / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"],
            "VIRTUAL_ENV": str(environment),
        }
        fields = {
            "metadata.name": pod["metadata"]["name"],
            "metadata.namespace": ns,
            "metadata.uid": pod["metadata"]["uid"],
            "spec.nodeName": self.node,
            "status.podIP": ip,
            "status.hostIP": f"127.0.{self.index}.1",
        }
        # envFrom first: `env` overrides what it sets, as in a kubelet.
        for item in spec.get("envFrom") or []:
            env.update(self._env_from(ns, item))
        for item in spec.get("env") or []:
            if "value" in item:
                env[item["name"]] = _expand(str(item["value"]), env)
                continue
            source = item.get("valueFrom") or {}
            if "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                if path not in fields:
                    raise ConfigError(f"fieldRef {path} is not emulated (kubelet.py)")
                env[item["name"]] = fields[path]
            elif "resourceFieldRef" in source:
                raise ConfigError("resourceFieldRef is not emulated (kubelet.py)")
            elif "secretKeyRef" in source or "configMapKeyRef" in source:
                value = self._key_ref(ns, source)
                if value is not None:
                    env[item["name"]] = value
        return env

    def _env_from(self, ns: str, item: dict[str, Any]) -> dict[str, str]:
        """One envFrom source: every key of a ConfigMap or Secret, with the prefix; keys
        that are not variable names are left out (a kubelet posts an event for them)."""
        secret = "secretRef" in item
        ref = item["secretRef"] if secret else item["configMapRef"]
        obj = self.api.get("secrets" if secret else "configmaps", ns, ref["name"])
        if obj is None:
            if ref.get("optional"):
                return {}
            raise ConfigError(f'{"secret" if secret else "configmap"} "{ref["name"]}" not found')
        prefix = item.get("prefix", "")
        found = {}
        for key, value in (obj.get("data") or {}).items():
            name = prefix + key
            if name.replace("_", "a").isalnum() and not name[0].isdigit():
                found[name] = base64.b64decode(value).decode() if secret else value
        return found

    def _key_ref(self, ns: str, source: dict[str, Any]) -> str | None:
        secret = "secretKeyRef" in source
        ref = source["secretKeyRef"] if secret else source["configMapKeyRef"]
        kind = "secrets" if secret else "configmaps"
        obj = self.api.get(kind, ns, ref["name"])
        label = "secret" if secret else "configmap"
        if obj is None:
            if ref.get("optional"):
                return None
            raise ConfigError(f'{label} "{ref["name"]}" not found')
        data = obj.get("data") or {}
        if ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise ConfigError(
                f"couldn't find key {ref['key']} in {label.title()} {ns}/{ref['name']}"
            )
        value = data[ref["key"]]
        return base64.b64decode(value).decode() if secret else value

    def _mounts(self, run: PodRun, container: Container) -> list[dict[str, Any]]:
        pod = run.pod
        ns = pod["metadata"]["namespace"]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        out = [{"source": str(run.hosts), "target": "/etc/hosts", "readOnly": False}]
        for mount in container.spec.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                raise ConfigError(f"volume {mount['name']!r} is not defined in the pod")
            source = self._volume(run, ns, volume)
            if mount.get("subPath"):
                # A path inside the volume; a kubelet creates it as a folder if missing.
                source = source / mount["subPath"]
                if not source.exists():
                    source.mkdir(parents=True)
            out.append(
                {
                    "source": str(source),
                    "target": mount["mountPath"],
                    # configMap and secret volumes are read-only whatever the mount
                    # says, as a kubelet mounts them (since CVE-2017-1002102's fix).
                    "readOnly": bool(mount.get("readOnly"))
                    or bool((volume.get("persistentVolumeClaim") or {}).get("readOnly"))
                    or any(k in volume for k in READ_ONLY_SOURCES),
                }
            )
        out.append(
            {
                "source": str(container.termination),
                "target": container.spec.get("terminationMessagePath", TERMINATION_LOG),
            }
        )
        return out

    def _volume(self, run: PodRun, ns: str, volume: dict[str, Any]) -> Path:
        folder = run.folder / "volumes" / volume["name"]
        if "emptyDir" in volume:
            folder.mkdir(parents=True, exist_ok=True)
            return folder
        if "hostPath" in volume:
            return Path(volume["hostPath"]["path"])
        if "persistentVolumeClaim" in volume:
            return self._claimed(ns, volume["persistentVolumeClaim"]["claimName"])
        for kind, key in (("configmaps", "configMap"), ("secrets", "secret")):
            if key not in volume:
                continue
            name = volume[key].get("name") or volume[key].get("secretName")
            obj = self.api.get(kind, ns, name)
            if obj is None:
                if volume[key].get("optional"):
                    folder.mkdir(parents=True, exist_ok=True)
                    return folder
                raise ConfigError(f'{key.lower()} "{name}" not found')
            data = obj.get("data") or {}
            decode = base64.b64decode if kind == "secrets" else str.encode
            write_atomically(folder, {item: decode(value) for item, value in data.items()})
            return folder
        kinds = sorted(k for k in volume if k != "name")
        raise ConfigError(f"volume {volume['name']!r}: {kinds} volumes are not supported here")

    def _claimed(self, ns: str, claim: str) -> Path:
        """The folder of the PersistentVolume a claim is bound to (statically: the claim's
        spec.volumeName), a hostPath or local volume as single-node clusters use."""
        pvc = self.api.get("persistentvolumeclaims", ns, claim)
        if pvc is None:
            raise ConfigError(f'persistentvolumeclaim "{claim}" not found')
        name = (pvc.get("spec") or {}).get("volumeName")
        pv = self.api.get("persistentvolumes", None, name) if name else None
        source = (pv or {}).get("spec") or {}
        path = (source.get("hostPath") or source.get("local") or {}).get("path")
        if not path:
            raise ConfigError(f'persistentvolumeclaim "{claim}" is not bound to a volume')
        return Path(path)

    def _cgroup(self, run: PodRun, container: Container) -> Path | None:
        """Every container's memory cgroup (with its limit when it has one): what its
        processes are, for killing all of them, and what the OOM killer judges."""
        if not CGROUP_ROOT.is_dir():
            return None
        ns, name = run.key
        group = self.cgroups / f"{ns}_{name}_{container.name}_{container.restarts}"
        group.mkdir(parents=True, exist_ok=True)
        limit = memory_limit(container.spec)
        if limit is not None:
            (group / "memory.limit_in_bytes").write_text(str(limit))
        return group

    # ------------------------------------------------------------------ status
    def report(self, run: PodRun) -> None:
        pod = run.pod
        statuses = []
        for container in run.containers:
            probes = container.probes
            status = {
                "name": container.name,
                "image": container.spec.get("image", ""),
                "imageID": "",
                "ready": container.running and (probes is None or probes.ready),
                "started": container.running and (probes is None or probes.started),
                "restartCount": container.restarts,
                "state": container.state,
            }
            if container.last_state:
                status["lastState"] = container.last_state
            statuses.append(status)
        phase = _phase(run.containers, pod["spec"].get("restartPolicy", "Always"))
        ready = "True" if all(s["ready"] for s in statuses) and phase == "Running" else "False"
        started = run.reported.get("startTime") or now()
        status = {
            "phase": phase,
            "hostIP": f"127.0.{self.index}.1",
            "podIP": run.ip,
            "podIPs": [{"ip": run.ip}],
            "startTime": started,
            "conditions": [
                # When it was bound: the kubelet saw it at once (the scheduler's own
                # condition, which a kubelet keeps).
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": started},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready},
                {"type": "Ready", "status": ready},
                # Conditions others own (DisruptionTarget, Kueue's TerminationTarget) are
                # kept, as a real kubelet keeps them: its status is not theirs to drop.
                *(
                    c
                    for c in (pod.get("status") or {}).get("conditions") or []
                    if c.get("type") not in KUBELET_CONDITIONS
                ),
            ],
            "containerStatuses": statuses,
        }
        if status != run.reported:
            self.api.patch("pods", *run.key, {"status": status}, status=True)
            run.reported = status

    # ------------------------------------------------------------------ stop
    def terminate(self, run: PodRun) -> bool:
        """SIGTERM, then SIGKILL after the grace period; True once every process is gone."""
        grace = run.pod["metadata"].get("deletionGracePeriodSeconds", 30)
        if run.kill_at is None:
            run.kill_at = time.monotonic() + grace
            for container in run.containers:
                if container.probes is not None:  # a pod going away is probed no more
                    container.probes.stop()
                _signal(container, signal.SIGTERM)
        for container in run.containers:
            if container.term_pending:
                _signal(container, signal.SIGTERM)
        if time.monotonic() >= run.kill_at:
            self.kill(run)
        alive = [c for c in run.containers if c.running]
        if alive:
            return False
        for container in run.containers:
            if container.process is not None:
                container.process.wait()
        return True

    def kill(self, run: PodRun) -> None:
        for container in run.containers:
            _signal(container, signal.SIGKILL)
            if container.process is not None:
                container.process.wait()

    def remove(self, uid: str, delete: bool = True) -> None:
        run = self.runs.pop(uid)
        for container in run.containers:
            _remove_cgroup(container.cgroup)
            if container.process is not None:
                (self.state / "pids" / str(container.process.pid)).unlink(missing_ok=True)
        shutil.rmtree(run.folder / "volumes", ignore_errors=True)
        if delete:
            self.api.delete("pods", *run.key, grace=0)

    def shutdown(self) -> None:
        for uid in list(self.runs):
            self.kill(self.runs[uid])
            self.remove(uid, delete=False)


# ---------------------------------------------------------------------- helpers
def _rewrite_in_place(path: Path, text: str) -> None:
    """In place (the pod's bind mount follows the inode, not the name), and never empty:
    the new text over the old, then cut to its length. write_text truncated first, and a
    resolver reading meanwhile found no `localhost` (a trainer's rendezvous failed with
    gaierror). The first lines (localhost, the pod's own names) never change."""
    data = text.encode()
    with path.open("r+b") as file:
        file.write(data)
        file.truncate(len(data))


def _key(pod: dict[str, Any]) -> tuple[str, str]:
    return pod["metadata"]["namespace"], pod["metadata"]["name"]


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values ($$ escapes)."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and ")" in text[i:]:
            end = text.index(")", i)
            name = text[i + 2 : end]
            out.append(env.get(name, text[i : end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _lost_before(pod: dict[str, Any], containers: list[Container]) -> None:
    """A pod this kubelet admits that already ran here (a node back after an outage
    shorter than the operator's nodeLostSeconds): its containers died with the machine.
    As a kubelet does, one that may not restart ends ContainerStatusUnknown (exit code
    137), and one that may is started again with its restart counted."""
    policy = pod["spec"].get("restartPolicy", "Always")
    reported = {s["name"]: s for s in (pod.get("status") or {}).get("containerStatuses") or []}
    for container in containers:
        status = reported.get(container.name)
        if status is None or not (status.get("state") or {}).get("running"):
            continue  # never started here, or already ended: nothing was lost
        lost = {
            "exitCode": 137,
            "reason": "ContainerStatusUnknown",
            "message": "The container could not be located when the pod was terminated",
            "startedAt": status["state"]["running"].get("startedAt"),
            "finishedAt": now(),
        }
        container.restarts = int(status.get("restartCount") or 0)
        if policy == "Never":
            container.state = {"terminated": lost}
        else:
            container.last_state = {"terminated": lost}
            container.restarts += 1


def _may_start(container: Container, policy: str) -> bool:
    return "terminated" not in container.state or policy == "Always"


def _phase(containers: list[Container], policy: str) -> str:
    if any(c.running for c in containers):
        return "Running"
    terminated = [c.state["terminated"] for c in containers if "terminated" in c.state]
    if len(terminated) == len(containers):
        return "Succeeded" if all(t["exitCode"] == 0 for t in terminated) else "Failed"
    if any(c.last_state for c in containers) or any(c.started_at for c in containers):
        return "Running"  # between restarts
    return "Pending"


def _signal(container: Container, sig: int) -> None:
    """SIGTERM to the container's main process only, as a runtime sends it (the command
    passes it on to its children, or not); SIGKILL to every process of the container."""
    if sig == signal.SIGTERM:
        container.term_pending = container.running
        main = _main_pid(container)
        if main is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(main, sig)
            container.term_pending = False
        return
    if container.running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(container.process.pid, sig)
    if sig == signal.SIGKILL:
        kill_cgroup(container.cgroup)


def _main_pid(container: Container) -> int | None:
    """The process the container's command runs in (its PID 1, seen from the host, when
    it has a PID namespace of its own); None when not running or not forked yet."""
    if not container.running:
        return None
    if not container.own_pid_namespace:
        return container.process.pid
    pid = container.process.pid
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found = (task / "children").read_text().split()
            if found:
                return int(found[0])
    return None


def kill_cgroup(group: Path | None) -> None:
    """SIGKILL every process in the container's cgroup, as a container runtime does when
    it kills a container or its first process has exited: also those that left its
    process group (torchrun starts its workers in sessions of their own)."""
    if group is None or not group.is_dir():
        return
    for _ in range(50):
        try:
            pids = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _oom_killed(group: Path | None) -> bool:
    if group is None:
        return False
    try:
        text = (group / "memory.oom_control").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and int(value) > 0:
            return True
    return False


def _remove_cgroup(group: Path | None) -> None:
    if group is not None and group.is_dir():
        with contextlib.suppress(OSError):
            group.rmdir()


def _termination_message(container: Container, code: int) -> str:
    # The kubelet keeps the file's last bytes (tail.ReadAtMost), not its first.
    data = container.termination.read_bytes() if container.termination.exists() else b""
    message = data[-MAX_MESSAGE:].decode(errors="replace")
    policy = container.spec.get("terminationMessagePolicy", "File")
    if not message and code != 0 and policy == "FallbackToLogsOnError":
        lines = container.log.read_text(errors="replace").splitlines()[-80:]
        message = "\n".join(lines)[-2048:]
    return message


def main() -> None:
    parser = argparse.ArgumentParser(description="a process kubelet of the test cluster")
    parser.add_argument("--api", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--index", type=int, required=True, help="pods get 127.0.INDEX.x")
    parser.add_argument("--cpu", default="4")
    parser.add_argument("--memory", default="8Gi")
    parser.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu to advertise")
    parser.add_argument("--label", action="append", default=[], help="KEY=VALUE")
    parser.add_argument("--taint", action="append", default=[], help="KEY=VALUE:EFFECT")
    parser.add_argument("--state", required=True, type=Path)
    parser.add_argument(
        "--cgroup-parent",
        default="rlft-test-cluster",
        help="memory cgroup folder of this cluster's nodes (one per test cluster)",
    )
    args = parser.parse_args()
    capacity = {"cpu": args.cpu, "memory": args.memory, "pods": "110"}
    if args.gpus:
        capacity["nvidia.com/gpu"] = str(args.gpus)
    labels = dict(item.split("=", 1) for item in args.label)
    taints = []
    for item in args.taint:
        pair, _, effect = item.rpartition(":")
        key, _, value = pair.partition("=")
        taints.append({"key": key, "value": value, "effect": effect})
    kubelet = Kubelet(
        Api(args.api),
        args.node,
        args.index,
        capacity,
        args.state,
        labels,
        taints,
        args.cgroup_parent,
    )

    def stop(*_: object) -> None:
        kubelet.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    kubelet.serve()


if __name__ == "__main__":
    main()
