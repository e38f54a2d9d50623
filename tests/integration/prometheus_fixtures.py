"""A real Prometheus server on loopback for tests: free port, temporary TSDB, fast
scrape and rule evaluation, stopped by the fixture's finalizer."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from processes import stop_process

HOW_TO_INSTALL = (
    "the prometheus server binary is not installed: run `make setup` (it installs "
    "Debian's `prometheus` package where apt-get is available) or "
    "`sudo apt-get install prometheus`"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen
    log: Path

    def api(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=5) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            if predicate():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def start_prometheus(
    tmp: Path,
    targets: list[str],
    rule_files: list[Path],
    scrape_configs: list[dict] | None = None,
) -> Prometheus:
    """A server scraping `targets` (or what `scrape_configs` describe) every second; the
    caller stops it (`stop_prometheus`)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(HOW_TO_INSTALL)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": scrape_configs
        or [{"job_name": "rlft-trainer", "static_configs": [{"targets": targets}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp / "prometheus.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Prometheus(f"http://127.0.0.1:{port}", process, log)

    def ready() -> bool:
        try:
            with urllib.request.urlopen(server.url + "/-/ready", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    server.wait_for("prometheus to be ready", ready, timeout=20)
    return server


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[list[str], list[Path]], Prometheus]]:
    """Factory: `prometheus(targets, rule_files)` starts a server; all are stopped after."""
    started: list[Prometheus] = []

    def start(targets: list[str], rule_files: list[Path]) -> Prometheus:
        folder = tmp_path / f"prometheus-{len(started)}"
        folder.mkdir()
        server = start_prometheus(folder, targets, rule_files)
        started.append(server)
        return server

    yield start
    for server in started:
        stop_prometheus(server)


def stop_prometheus(server: Prometheus) -> None:
    stop_process(server.process)
