"""The first process of a container on the test cluster, run by its kubelet as
`unshare -m -u --propagation private python podinit.py SPEC.json`.

Inside its own mount and UTS namespaces it joins the container's memory cgroup, takes
the pod's hostname, bind-mounts the pod's volumes at their mountPath, its /etc/hosts
(cluster DNS) and its termination-message file, remounts the root filesystem read-only
when the container asks, then execs the container's command. Nothing outside the
namespaces changes, except that a missing mount point is created (an empty folder or
file) on the host. Standard library only: it runs before any environment is chosen.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def _mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"podinit: mount {' '.join(args)}: {result.stderr.strip()}")


def _mount_point(target: Path, is_file: bool) -> None:
    if target.exists():
        return
    if is_file:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    else:
        target.mkdir(parents=True, exist_ok=True)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("cgroup"):
        Path(spec["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
    socket.sethostname(spec["hostname"])
    for mount in spec["mounts"]:
        source, target = Path(mount["source"]), Path(mount["target"])
        _mount_point(target, source.is_file())
        _mount("--bind", str(source), str(target))
        if mount.get("readOnly"):
            _mount("-o", "remount,bind,ro", str(target))
    if spec.get("readOnlyRootFilesystem"):
        _mount("-o", "remount,bind,ro", "/")
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
