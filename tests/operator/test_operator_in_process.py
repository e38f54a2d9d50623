"""The real handlers in kopf, in this process, against the emulated API server, for
what a test can only do from inside the server: lose a watch event, mark a namespace
Terminating.

- A pod deleted while the operator's watch missed it (a watch gap, which a real API
  server ends with 410 Gone) is made again. Before, the operator took a job's pods from
  kopf's watch caches: kopf's relist after a 410 adds and updates what it caches but
  keeps what was deleted meanwhile, so the lost pod filled its slot for good.
- A job deleted in a namespace being deleted finishes its finalizer. Its "Deleted" Event
  is refused there (403), which raised, so kopf kept the finalizer, retrying for ever, and
  the namespace stayed Terminating for good.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import kmock
import kopf
import kube_emulator as KE
import yaml
from jobs import job_doc

from rlft.operator import handlers

ROOT = Path(__file__).resolve().parents[2]
JOBS = "/apis/rlft.dev/v1alpha1/namespaces/ml/rlfinetunes"
JOB = ("rlft.dev", "rlfinetunes", "ml", "tiny-grpo")
TRAINER = ("", "pods", "ml", "tiny-grpo-trainer-0")


async def _call(url: str, method: str, path: str, body: dict | None = None) -> None:
    """A request as kubectl sends it (a PATCH is a merge patch)."""
    kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method, url + path, data=json.dumps(body), headers={"Content-Type": kind}
        ) as response,
    ):
        assert response.status < 300, await response.text()


@asynccontextmanager
async def _operator(tmp_path: Path) -> AsyncIterator[tuple[KE.Emulator, str]]:
    """The emulated API server with the CRD and namespace `ml`, and the operator on it."""
    emulator = KE.Emulator()
    async with emulator, kmock.Server(emulator, port=0) as server:
        url = f"http://127.0.0.1:{server.port}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "e",
            "clusters": [{"name": "e", "cluster": {"server": url}}],
            "users": [{"name": "u", "user": {"token": "x"}}],
            "contexts": [{"name": "e", "context": {"cluster": "e", "user": "u"}}],
        }
        (tmp_path / "kubeconfig").write_text(json.dumps(config))
        crd = yaml.safe_load((ROOT / "crds" / "rlfinetune.yaml").read_text())
        await _call(url, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        await _call(url, "POST", "/api/v1/namespaces", {"metadata": {"name": "ml"}})
        stop = asyncio.Event()
        operator = asyncio.create_task(
            kopf.operator(standalone=True, namespaces=["ml"], stop_flag=stop)
        )
        try:
            yield emulator, url
        finally:
            stop.set()
            await asyncio.wait_for(operator, 30)


async def _until(check: Callable[[], object], what: str, seconds: float) -> object:
    for _ in range(int(seconds / 0.2)):
        if found := check():
            return found
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what}: not after {seconds} s")


def _run(tmp_path: Path, monkeypatch, scenario) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    monkeypatch.setattr(handlers, "RUNTIME", handlers.Runtime())
    # Reconciled every second: a slot is looked at soon, event or none.
    options = handlers.Options(metrics_host="127.0.0.1", metrics_port=0, poll_seconds=1.0)
    handlers.configure(options, ["ml"])
    asyncio.run(scenario())


def test_a_pod_deleted_while_the_watch_missed_it_is_made_again(tmp_path, monkeypatch):
    async def scenario() -> None:
        async with _operator(tmp_path) as (emulator, url):
            await _call(url, "POST", JOBS, job_doc())

            def uid() -> str | None:
                pod = emulator.store.get(TRAINER)
                return pod["metadata"]["uid"] if pod else None

            first = await _until(uid, "the trainer pod", 30)
            emulator.lose(*TRAINER)
            await _until(lambda: uid() not in (None, first), "the lost trainer pod made again", 20)

    _run(tmp_path, monkeypatch, scenario)


def test_a_job_deleted_in_a_terminating_namespace_lets_it_go(tmp_path, monkeypatch):
    async def scenario() -> None:
        async with _operator(tmp_path) as (emulator, url):
            await _call(url, "POST", JOBS, job_doc())
            await _until(lambda: emulator.store.get(TRAINER), "the trainer pod", 30)
            emulator.terminate_namespace("ml")
            await _call(url, "DELETE", f"{JOBS}/tiny-grpo")
            await _until(lambda: JOB not in emulator.store, "the job's finalizer removed", 15)
            assert TRAINER not in emulator.store  # its pods went first

    _run(tmp_path, monkeypatch, scenario)


def test_a_startup_kopf_retries_serves_metrics_once(tmp_path, monkeypatch):
    """kopf retries a startup handler that raised (a 503 creating the peering object):
    the retry bound the metrics port the first try held, failed with EADDRINUSE on every
    try, and kopf never started watching, while the probes on /metrics, served by the
    first try, said the operator was fine."""
    import logging
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(handlers, "RUNTIME", handlers.Runtime())
    handlers.configure(handlers.Options(metrics_host="127.0.0.1", metrics_port=port), ["ml"])
    monkeypatch.setattr(handlers, "_login", lambda **_: None)  # no API server needed
    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    try:
        for _ in range(2):  # the first try, then kopf's retry
            asyncio.run(handlers._startup(settings=settings, logger=logging.getLogger("t")))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert b"rlft_operator" in response.read()
    finally:
        handlers.RUNTIME.metrics.close()


def test_a_decisions_events_are_posted_though_a_later_write_fails(tmp_path, monkeypatch):
    """A trainer exits 2 (a bad job): the operator writes the status Failed, then deletes
    the rollout pod, which the API server answers 503. The Events were posted after the
    deletes, so the failure lost them, and the next reconcile, starting from the Failed
    status, had none to say: `kubectl describe` never showed why the job failed."""
    failed = {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "main",
                "state": {"terminated": {"exitCode": 2, "reason": "Error", "message": "bad"}},
                "ready": False,
                "restartCount": 0,
                "image": "x",
                "imageID": "",
            }
        ],
    }

    def reasons(emulator: KE.Emulator) -> list[str]:
        return [o.get("reason") for k, o in emulator.store.items() if k[1] == "events"]

    async def scenario() -> None:
        async with _operator(tmp_path) as (emulator, url):
            await _call(url, "POST", JOBS, job_doc())
            await _until(lambda: emulator.store.get(TRAINER), "the trainer pod", 30)
            emulator.faults.append(("DELETE", "pods", 503))
            await _call(
                url,
                "PATCH",
                "/api/v1/namespaces/ml/pods/tiny-grpo-trainer-0/status",
                {"status": failed},
            )
            await _until(lambda: "Failed" in reasons(emulator), "the Failed Event", 15)
            assert emulator.faults == []  # the delete was refused (and done later)

    _run(tmp_path, monkeypatch, scenario)


def test_the_timer_leaves_alone_a_job_reconciled_within_poll_seconds(monkeypatch):
    """kopf's timer fires every 15 s whatever --poll-seconds says: a --poll-seconds of 60
    still reconciled every job and polled its /status every 15 s."""
    kicked: list[tuple[str, str]] = []

    async def kick(key: tuple[str, str]) -> None:
        kicked.append(key)

    monkeypatch.setattr(handlers, "RUNTIME", handlers.Runtime())
    monkeypatch.setattr(handlers, "kick", kick)
    handlers.configure(handlers.Options(poll_seconds=60.0), ["ml"])
    state = handlers.RUNTIME.jobs.setdefault(("ml", "job"), handlers._JobState())

    def fire(ago: float) -> bool:
        state.reconciled_at = time.monotonic() - ago
        kicked.clear()
        asyncio.run(handlers._poll(namespace="ml", name="job", meta={}))
        return kicked == [("ml", "job")]

    assert not fire(15.0)
    assert fire(61.0)


def _get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_livez_fails_while_the_event_loop_is_blocked_and_metrics_does_not(tmp_path, monkeypatch):
    """The liveness probe was on /metrics, which a thread of its own serves: an operator
    whose event loop a handler blocked (or a deadlock stopped) stopped reconciling and
    still looked alive. /livez answers from the loop's heartbeat."""
    import threading

    async def scenario() -> None:
        async with _operator(tmp_path):
            metrics = await _until(lambda: handlers.RUNTIME.metrics.server, "metrics served", 20)
            handlers.RUNTIME.metrics.stall_seconds = 1.0
            base = f"http://127.0.0.1:{metrics.server_address[1]}"
            await _until(lambda: _get(f"{base}/livez") == (200, "ok\n"), "/livez ok", 10)
            livez: list[tuple[int, str]] = []
            other: list[tuple[int, str]] = []
            probes = [
                threading.Timer(2.5, lambda: livez.append(_get(f"{base}/livez"))),
                threading.Timer(2.5, lambda: other.append(_get(f"{base}/metrics"))),
            ]
            for probe in probes:
                probe.start()
            time.sleep(4.0)  # a handler that blocks the event loop
            for probe in probes:
                probe.join()
            assert livez[0][0] == 503 and "event loop has not run for" in livez[0][1], livez
            assert other[0][0] == 200 and "rlft_operator_reconciles_total" in other[0][1]
            await _until(lambda: _get(f"{base}/livez")[0] == 200, "/livez ok again", 5)

    _run(tmp_path, monkeypatch, scenario)
