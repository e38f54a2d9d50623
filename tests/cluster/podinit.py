"""The first process of a container on the test cluster, run by its kubelet as
`unshare -m -u --propagation private python podinit.py SPEC.json`.

Inside its own mount and UTS namespaces it joins the container's memory cgroup, takes
the pod's hostname, makes the rest of the container PID 1 of a new PID namespace unless
the pod shares one (it forks it and ends as it ends), bind-mounts the pod's volumes at
their mountPath, its /etc/hosts (cluster DNS) and its termination-message file, remounts
the root filesystem read-only when the container asks, then execs the container's
command. Nothing outside the
namespaces changes, except that a missing mount point is created (an empty folder or
file) on the host. Standard library only: it runs before any environment is chosen.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import stat
import sys
from pathlib import Path

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
CLONE_NEWPID = 0x20000000
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, flags: int) -> None:
    result = _libc.mount(source.encode() if source else None, target.encode(), None, flags, None)
    if result != 0:
        error = ctypes.get_errno()
        raise SystemExit(f"podinit: mount {source} on {target}: {os.strerror(error)}")


def _identity(path: str | int) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def _mount_point(target: Path, is_file: bool) -> None:
    if target.exists():
        return
    if is_file:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    else:
        target.mkdir(parents=True, exist_ok=True)


def _become_pid_1() -> None:
    """Go on as PID 1 of a new PID namespace, in a child; this process waits for it and
    ends as it did (killed by the same signal), so the kubelet sees the command's own
    exit. (util-linux 2.38's `unshare --fork` exits 1 when its child is SIGKILLed.)"""
    if _libc.unshare(CLONE_NEWPID) != 0:
        raise SystemExit(f"podinit: unshare(CLONE_NEWPID): {os.strerror(ctypes.get_errno())}")
    child = os.fork()
    if child == 0:
        # The container's /proc lists its own processes, as in a real one.
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        if _libc.mount(b"proc", b"/proc", b"proc", flags, None) != 0:
            raise SystemExit(f"podinit: mount /proc: {os.strerror(ctypes.get_errno())}")
        return
    # The kubelet signals PID 1 itself; a SIGTERM to the process group is not ours.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # its disposition cannot be changed (nor needs to be)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("cgroup"):
        Path(spec["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
    socket.sethostname(spec["hostname"])
    if spec.get("ownPidNamespace"):
        _become_pid_1()
    # Every source is opened before anything is mounted: a volume mounted over /tmp would
    # otherwise hide the sources of later volumes that live under /tmp.
    sources = [os.open(m["source"], os.O_PATH) for m in spec["mounts"]]
    keep = [(path, os.open(path, os.O_PATH)) for path in spec.get("keepVisible", [])]
    for mount, fd in zip(spec["mounts"], sources, strict=True):
        target = Path(mount["target"])
        # The opened source, not its path: a volume mounted earlier (an emptyDir on /tmp)
        # may cover the path, and a file's mount point made a folder stays one on the host.
        _mount_point(target, stat.S_ISREG(os.fstat(fd).st_mode))
        _mount(f"/proc/self/fd/{fd}", str(target), MS_BIND)
        if mount.get("readOnly"):
            _mount(None, str(target), MS_REMOUNT | MS_BIND | MS_RDONLY)
        os.close(fd)
    for path, fd in keep:
        # The image's environment (and the source tree an editable install points to)
        # must stay reachable when a volume covers a folder above it (/tmp, say).
        if _identity(path) != _identity(fd):
            Path(path).mkdir(parents=True, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, MS_BIND)
        os.close(fd)
    if spec.get("readOnlyRootFilesystem"):
        _mount(None, "/", MS_REMOUNT | MS_BIND | MS_RDONLY)
    os.chdir(spec.get("workingDir") or "/")
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as error:
        message = f"exec {argv[0]!r}: {error.strerror}"
        termination = spec.get("terminationMessage")
        if termination:
            Path(termination).write_text(message)
        print(f"podinit: {message}", file=sys.stderr)
        raise SystemExit(127) from None


if __name__ == "__main__":
    main(sys.argv[1])
