"""`rlft rollout` (alias `rlft rollout-server`): one rollout instance behind HTTP.

The protocol is in `protocol.py`. Weight updates are atomic with respect to requests: a
generate request holds the engine for its whole duration, a weight load waits for it and
then keeps new requests out until it is done (writer preference), so every completion
is produced by exactly one policy version, which it reports.

Start-up: the engine is built from the newest version under the publication location
(catch-up after a restart), or from `spec.model.path`, or from the first `POST /weights`;
until then `/healthz` answers 503 (a rollout pod's readiness). `/livez` answers 200 as
soon as the server serves, weights or not (its startup probe: a job whose model is built
by the trainer has no weights until the trainer's first publication, after its warm
start), and 503 once ENGINE_FAILURES requests in a row failed in the engine, or one
generate call has been in it for `--stall-seconds` (its liveness probe: a dead or hung
engine behind a live HTTP server was never replaced). A request refused for
its own content (a prompt longer than the model's context, a temperature that overflows
the logits, a ValueError the engine raises) is answered 400 and is no engine failure: the
trainer re-sends it nowhere, and one bad request does not get every instance restarted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import FrameType
from typing import Any

from rlft.trainer import termination
from rlft.trainer.addresses import http_url, is_loopback
from rlft.trainer.api_token import TOKEN_ENV, authorized, given_token
from rlft.trainer.checkpoint.commands import storage_options
from rlft.trainer.checkpoint.factory import s3_options
from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.http_server import HTTPServer
from rlft.trainer.redaction import scrubbed
from rlft.trainer.rollout.arguments import add_arguments
from rlft.trainer.rollout.engine import WeightNamesError
from rlft.trainer.rollout.protocol import (
    GenerateRequest,
    ProtocolError,
    SupersededGangError,
    WeightsRequest,
    completion_to_json,
)
from rlft.trainer.rollout.ray_cluster import RayClusterError
from rlft.trainer.storage.backends import S3Options

MAX_BODY = 64 << 20
DISCARD_CHUNK = 64 << 10
"""An unauthorized request's body is read and dropped this much at a time."""

HANDLER_TIMEOUT_S = 30.0
"""Seconds a connection may send nothing (headers or body) before its thread drops it: a
client that announces a body and never sends it held a thread and a socket forever."""


ENGINE_FAILURES = 5
"""Generate requests in a row failing in the engine before /livez reports it broken."""


class EngineHost:
    """The served engine plus the lock that makes weight updates atomic."""

    def __init__(
        self, build: Callable[[Path, int, bool], Any], metrics=None, s3: S3Options | None = None
    ):
        """`build(folder, version, published)`: an engine on a Hugging Face folder, one
        rlft published (`published`) or the job's own model (`spec.model.path`); `s3`:
        how to reach published versions on S3."""
        self._build = build
        self.s3 = s3
        self.engine = None
        self._cond = threading.Condition()
        self._busy = False
        self._writers_waiting = 0
        self._group = None
        self._joined: tuple | None = None
        """(address, rank, name) of the broadcast group joined: a new name is a new group,
        also at the last one's address."""
        self._metrics = metrics
        self.damaged: str | None = None
        """Why the engine's weights are no version (a load failed after it had begun
        copying: a mix of two), until a load succeeds. It serves nothing meanwhile."""
        self.failed_in_a_row = 0
        """Generate requests the engine itself failed since its last success."""
        self.broken: str | None = None
        """Why the engine is past recovery in this process (ENGINE_FAILURES requests in a
        row failed in it: a dead vLLM engine, a GPU in an error state): /livez says so,
        and the pod's liveness probe has it replaced."""
        self._generating_since: float | None = None
        """When the generate call in the engine began (None: none is)."""
        self.gang: int | None = None
        """The newest trainer gang attempt that sent weights: an older one's are refused."""
        self.served_gang: int | None = None
        """The gang attempt whose weights the engine holds (None: no gang's, or unknown)."""
        self._gang_lock = threading.Lock()

    @contextlib.contextmanager
    def _use(self, writer: bool) -> Iterator[None]:
        with self._cond:
            if writer:
                self._writers_waiting += 1
            try:
                while self._busy or (not writer and self._writers_waiting):
                    self._cond.wait()
            finally:
                if writer:
                    self._writers_waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    @property
    def policy_version(self) -> int | None:
        if self.engine is None or self.damaged:
            return None
        return self.engine.policy_version

    def stuck(self, limit_s: float) -> str | None:
        """Why the engine counts as wedged: one generate call in it for over `limit_s`
        (0: never). A hung engine failed nothing, so `broken` never said so, and each
        request and load sent to it waited out the trainer's timeout."""
        since = self._generating_since
        if not limit_s or since is None or time.monotonic() - since <= limit_s:
            return None
        return f"one generate call has been in the engine for over {limit_s:.0f} s"

    def generate(self, request: GenerateRequest) -> dict[str, Any]:
        started = time.perf_counter()
        with self._use(writer=False):
            if self.engine is None:
                raise RuntimeError("no weights loaded yet")
            if self.damaged:
                raise RuntimeError(self.damaged)
            self._generating_since = time.monotonic()
            try:
                completions = self.engine.generate(
                    request.prompts, request.n, request.sampling, request.seed, request.stop_ids
                )
            except ValueError as error:  # the request's own fault (vLLM: a prompt too long)
                raise ProtocolError(f"the engine refused the request: {error}") from error
            except Exception as error:
                self.failed_in_a_row += 1
                if self.failed_in_a_row >= ENGINE_FAILURES:
                    self.broken = (
                        f"{self.failed_in_a_row} requests in a row failed in the engine, the "
                        f"last with {type(error).__name__}: {error}"
                    )[:1000]
                raise
            finally:
                self._generating_since = None
            self.failed_in_a_row, self.broken = 0, None
            version = self.engine.policy_version
        seconds = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for c in completions)
        if self._metrics is not None:
            self._metrics.generated(tokens, seconds)
        return {
            "request_id": request.request_id,
            "policy_version": version,
            "completions": [completion_to_json(c) for c in completions],
            "tokens": tokens,
            "seconds": seconds,
        }

    def load(self, request: WeightsRequest) -> dict[str, Any]:
        started = time.perf_counter()
        self._admit(request.gang)  # at once: a refused gang waits for nothing
        if request.broadcast is not None:
            version, tensors = self._receive(request)
            with self._use(writer=True):
                self._admit(request.gang)  # a newer gang's load may have landed meanwhile
                if self.engine is None:
                    raise RuntimeError(
                        "a broadcast cannot start an engine (no config): load a uri first"
                    )
                self._update(version, request.gang, lambda: tensors)
        else:
            self._load_uri(request)
        seconds = time.perf_counter() - started
        version = self.engine.policy_version
        if self._metrics is not None:
            self._metrics.version(version)
        return {"policy_version": version, "seconds": seconds}

    def _admit(self, gang: int | None) -> None:
        """Refuse weights from a gang older than the newest that sent any: the operator
        replaced it (its node stopped reporting), but it may still run and reach this
        instance, and its versions would interleave with the new gang's."""
        if gang is None:
            return
        with self._gang_lock:
            if self.gang is not None and gang < self.gang:
                raise SupersededGangError(
                    f"weights from trainer gang attempt {gang} refused: gang attempt "
                    f"{self.gang} of this job has replaced it"
                )
            self.gang = gang

    def _load_uri(self, request: WeightsRequest) -> None:
        """Load a published folder. Its tensors are read before the update in place
        begins (outside the lock when an engine serves): a file that cannot be read (cut
        short, missing) fails the load with the served weights intact, not damaged."""
        from rlft.trainer.weights.store import fetched, read_tensors

        with fetched(request.uri, s3=self.s3) as folder:
            tensors = read_tensors(folder) if self.engine is not None else None
            with self._use(writer=True):
                self._admit(request.gang)  # a newer gang's load may have landed meanwhile
                if self.engine is None:
                    self.engine = self._build(folder, request.version, True)
                    self.served_gang = request.gang
                else:  # None: a first load built the engine meanwhile, read them now
                    self._update(
                        request.version,
                        request.gang,
                        lambda: read_tensors(folder) if tensors is None else tensors,
                    )

    def _update(self, version: int, gang: int | None, tensors: Callable[[], dict]) -> None:
        """Load `tensors()` into the served engine as `gang`'s `version`, unless it is
        older than what it serves (call under the writer lock)."""
        if not self._older(version, gang):
            with self._damaging(version):
                self.engine.load_tensors(tensors(), version)
            self.served_gang = gang

    def _older(self, version: int, gang: int | None) -> bool:
        """Whether `version` is older than the weights served (call under the writer lock):
        versions only grow, also across rollbacks and trainer restarts, so an older one is
        a load that waited (a retried load, its first attempt timed out at the trainer
        while it queued) and arrived after a newer one; loading it would go back. Not so
        for a gang's first weights here: a replaced gang's, taken before the new gang was
        heard from (or by a restarted instance from the store), may be numbered past the
        new gang's, which would then be skipped while the old weights stayed served."""
        if self.damaged is not None:
            return False
        if gang is not None and (self.served_gang is None or gang > self.served_gang):
            return False
        return version < self.engine.policy_version

    @contextlib.contextmanager
    def _damaging(self, version: int) -> Iterator[None]:
        """An update in place: if it fails, the weights may be part old, part new, and
        are served as no version until a load succeeds (the engine's own version number
        would vouch for weights it no longer holds)."""
        try:
            yield
        except WeightNamesError:
            raise  # refused before any tensor was copied: the served weights are intact
        except BaseException as error:
            self.damaged = (
                f"the load of version {version} failed part-way ({type(error).__name__}: "
                f"{error}); no weights are served until the next load"
            )
            raise
        self.damaged = None

    def load_model(self, folder: Path) -> None:
        """The job's own model folder (spec.model.path) as version 0, before the trainer
        publishes anything."""
        with self._use(writer=True):
            self.engine = self._build(folder, 0, False)
        if self._metrics is not None:
            self._metrics.version(0)

    def _receive(self, request: WeightsRequest):
        """Join (or re-join) the trainer's broadcast group and receive one version. Runs
        outside the engine lock: generation goes on while the bytes arrive."""
        from rlft.trainer.telemetry.liveness_server import pod_address
        from rlft.trainer.weights.broadcast import BroadcastGroup, GroupAddress

        spec = request.broadcast
        address = GroupAddress.parse(spec["address"], spec["world_size"])
        joined = (address, spec["rank"], spec.get("group"))
        if self._group is None or self._joined != joined:
            # Bound to the pod's own address: gloo gives the group the address its device
            # listens on, and the trainer in another pod cannot reach this pod's loopback.
            self._group = BroadcastGroup(
                address, spec["rank"], spec.get("timeout_s", 60.0), pod_address()
            )
            self._joined = joined
        version, tensors = self._group.receive()
        if version != request.version:
            raise ProtocolError(f"version: asked for {request.version}, received {version}")
        return version, tensors

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class ServerMetrics:
    """The rollout server's Prometheus series (names from rlft.trainer.telemetry.metrics)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry

        from rlft.trainer.telemetry import metrics as M
        from rlft.trainer.telemetry.exporter import build_collectors

        self.registry = CollectorRegistry()
        c = build_collectors(self.registry, "rollout")
        self._requests = c[M.ROLLOUT_REQUESTS.name]
        self._tokens = c[M.ROLLOUT_TOKENS.name]
        self._version = c[M.ROLLOUT_VERSION.name]
        self._latency = c[M.ROLLOUT_LATENCY.name]

    def generated(self, tokens: int, seconds: float) -> None:
        self._tokens.inc(tokens)
        self._latency.observe(seconds)

    def request(self, status: str) -> None:
        self._requests.labels(status=status).inc()

    def version(self, version: int) -> None:
        self._version.set(version)

    def text(self) -> bytes:
        from prometheus_client.exposition import generate_latest

        return generate_latest(self.registry)


class _Handler(BaseHTTPRequestHandler):
    server: RolloutHTTPServer

    def setup(self) -> None:
        self.timeout = self.server.handler_timeout_s  # the socket's, set by setup()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise
        pass

    def _reply(
        self,
        code: int,
        body: Any,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _length(self) -> int:
        """The announced body length; ProtocolError for one that is no count (a negative
        one was read to the end of a connection that may never end)."""
        text = self.headers.get("Content-Length") or "0"
        try:
            length = int(text)
        except ValueError:
            raise ProtocolError(f"Content-Length: not a number ({text[:40]!r})") from None
        if length < 0:
            raise ProtocolError(f"Content-Length: negative ({length})")
        return length

    def _body(self) -> Any:
        length = self._length()
        if length > MAX_BODY:
            raise ProtocolError(f"request body over {MAX_BODY} bytes")
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except json.JSONDecodeError as error:
            raise ProtocolError(f"the request body is not JSON ({error.msg})") from None

    def do_GET(self) -> None:
        host = self.server.host
        if self.path == "/healthz":
            version = host.policy_version
            body = {
                "ok": version is not None,
                "policy_version": version,
                "engine": self.server.kind,
                "server_id": self.server.server_id,
            }
            stuck = host.stuck(self.server.stall_s)
            if stuck:  # not ready: requests and loads would wait behind the stuck call
                self._reply(503, body | {"ok": False, "reason": stuck})
                return
            if host.damaged:
                # Still ready: the trainer's next publication must reach it (it sends
                # to instances that answer), and version None keeps requests away.
                body |= {"ok": True, "reason": host.damaged}
                self._reply(200, body)
                return
            if version is None:
                body["reason"] = "no weights loaded yet"
            self._reply(200 if version is not None else 503, body)
        elif self.path == "/livez":
            reason = host.broken or host.stuck(self.server.stall_s)
            if reason:
                self._reply(503, {"ok": False, "engine": self.server.kind, "reason": reason})
            else:
                self._reply(200, {"ok": True, "engine": self.server.kind})
        elif self.path == "/metrics":
            self._reply(200, self.server.metrics.text(), "text/plain; version=0.0.4")
        else:
            self._reply(404, {"error": f"no route GET {self.path}"})

    def _refuse_unauthorized(self) -> bool:
        """Answer 401 unless the request carries the instance's token. The body is read
        first: a reply before it would reset a connection still sending, and the caller
        would see a broken pipe instead of the reason."""
        if authorized(self.headers.get("Authorization"), self.server.token):
            return False
        try:
            length = self._length()
        except ProtocolError:
            length = 0
        if 0 < length <= MAX_BODY:
            # In pieces: a caller without the token must not make the server hold
            # MAX_BODY per connection.
            while length > 0:
                chunk = self.rfile.read(min(length, DISCARD_CHUNK))
                if not chunk:
                    break
                length -= len(chunk)
        self.server.metrics.request("unauthorized")
        error = {"error": f"no or a wrong rollout token (see {TOKEN_ENV})"}
        self._reply(401, error, headers={"WWW-Authenticate": "Bearer"})
        return True

    def do_POST(self) -> None:
        host, metrics = self.server.host, self.server.metrics
        if self._refuse_unauthorized():
            return
        try:
            if self.path == "/generate":
                vocab = getattr(host.engine, "vocab_size", None)
                positions = getattr(host.engine, "max_positions", None)
                request = GenerateRequest.from_json(self._body(), vocab, positions)
                answer = host.generate(request)
                # Counted before the reply: a caller that reads /metrics once it has its
                # answer (a test, a scrape right after) saw the request not counted yet.
                metrics.request("ok")
                self._reply(200, answer)
            elif self.path == "/weights":
                self._reply(200, host.load(WeightsRequest.from_json(self._body())))
            else:
                self._reply(404, {"error": f"no route POST {self.path}"})
        except (BrokenPipeError, ConnectionResetError):
            # The caller went away (it timed out and re-issued the request elsewhere):
            # nobody to answer, nor an error of this server's to count.
            self.close_connection = True
        except ProtocolError as error:
            metrics.request("bad_request")
            self._reply(400, {"error": str(error)})
        except SupersededGangError as error:
            metrics.request("superseded")
            self._reply(409, {"error": str(error)})
        except RuntimeError as error:
            metrics.request("unavailable")
            self._reply(503, {"error": str(error)})
        except Exception as error:  # the server stays up; the client re-issues elsewhere
            metrics.request("error")
            self._reply(500, {"error": f"{type(error).__name__}: {error}"})


class RolloutHTTPServer(HTTPServer):
    def __init__(
        self,
        address: tuple[str, int],
        host: EngineHost,
        metrics,
        kind: str,
        token: str | None = None,
    ):
        super().__init__(address, _Handler)
        self.host, self.metrics, self.kind = host, metrics, kind
        self.token = token
        """The bearer token POST /generate and POST /weights require (None: none)."""
        self.server_id = uuid.uuid4().hex
        """Drawn per process: a server restarted at the same address (a container
        restarted in its pod) has a new one, and is not in the trainer's broadcast group."""
        self.handler_timeout_s = HANDLER_TIMEOUT_S
        """Read by each connection's handler as it starts (a test shortens it)."""
        self.stall_s = 0.0
        """A generate call in the engine longer than this is a wedged engine: /livez and
        /healthz answer 503 (0: never; see `stall_seconds`)."""


def start_server(
    kind: str,
    host: str = "127.0.0.1",
    port: int = 0,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    token: str | None = None,
    s3: S3Options | None = None,
) -> RolloutHTTPServer:
    """A server on (host, port), not yet serving (call serve_forever); with `token`, its
    POSTs require it; `s3`: how to reach published versions on S3."""
    from rlft.trainer.rollout.served import build_engine, resolve_engine

    kind = resolve_engine(kind)
    metrics = ServerMetrics()
    engine_host = EngineHost(
        lambda folder, version, published: build_engine(
            kind, folder, version, tensor_parallel, expert_parallel, published
        ),
        metrics,
        s3,
    )
    return RolloutHTTPServer((host, port), engine_host, metrics, kind, token)


def open_api_warning(host: str, token: str | None) -> str | None:
    """What to say when the server takes any caller from beyond this machine."""
    if token is not None or is_loopback(host):
        return None
    return (
        f"rlft rollout: warning: {TOKEN_ENV} is not set, so POST /generate and POST "
        f"/weights answer anyone who can reach {host}"
    )


def stall_seconds(args: argparse.Namespace, job) -> float:
    """--stall-seconds, else twice the job's spec.rollout.requestTimeoutSeconds: by then
    the trainer gave up on the call and re-issued it elsewhere, twice. 0 without a job
    (local servers: no kubelet acts on /livez)."""
    if args.stall_seconds is not None:
        return args.stall_seconds
    return 2 * job.spec.rollout.request_timeout_seconds if job is not None else 0.0


def _initial_weights(args: argparse.Namespace, job, s3: S3Options) -> WeightsRequest | Path | None:
    """What to load before serving: the newest published version, else the folder of
    spec.model.path (the user's own model: complete, with no READY marker to look for)."""
    from rlft.trainer.weights.store import WeightStore

    uri = args.weights_uri or (job.spec.rollout.weights_uri if job is not None else None)
    if uri:
        latest = WeightStore.at(uri, s3=s3).latest_uri()
        if latest is not None:
            return WeightsRequest(version=latest[0], uri=latest[1])
    if job is not None and job.spec.model.path:
        return Path(job.spec.model.path).resolve()
    return None


def _exit_on_sigterm() -> None:
    """SIGTERM ends the server as Ctrl-C does. Installed by `run`, whichever way it is
    started (`rlft rollout` in a pod, `python -m` locally): in a container the server is
    PID 1, and the kernel drops a signal PID 1 has no handler for, so without one every
    pod deletion waited out its grace period for the SIGKILL."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may install handlers (a server run in a test)

    def stop(signum: int, frame: FrameType | None) -> None:
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)


def run(args: argparse.Namespace) -> int:
    _exit_on_sigterm()
    job = None
    if args.job:
        from rlft.trainer.config import load_job

        job = load_job(args.job)
    kind = args.engine or (job.spec.rollout.engine if job is not None else "transformers")
    if args.ray_address:
        try:
            _join_ray_cluster(args, kind)
        except RayClusterError as error:
            print(f"rlft rollout: {scrubbed(str(error))}", file=sys.stderr, flush=True)
            termination.write(termination.Verdict(error.exit_code, str(error)))
            return error.exit_code
    try:
        token = given_token()
    except ValueError as error:
        print(f"rlft rollout: {error}", file=sys.stderr, flush=True)
        termination.write(termination.Verdict(ExitCode.INVALID_CONFIG, str(error)))
        return ExitCode.INVALID_CONFIG
    warning = open_api_warning(args.host, token)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    # The job's spec.checkpoint (the operator puts the weights under its location);
    # without a job file (local servers), the flags.
    s3 = s3_options(job.spec.checkpoint) if job is not None else storage_options(args)
    server = start_server(
        kind, args.host, args.port, args.tensor_parallel, args.expert_parallel, token, s3
    )
    server.stall_s = stall_seconds(args, job)
    initial = _initial_weights(args, job, s3)
    if isinstance(initial, Path):
        server.host.load_model(initial)
    elif initial is not None:
        server.host.load(initial)
    port = server.server_address[1]
    if args.ready_file:
        temp = Path(args.ready_file + ".tmp")
        temp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
        temp.replace(args.ready_file)
    print(
        f"rlft rollout: instance {args.instance} ({kind}) on {http_url(args.host, port)}",
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.host.close()
    return 0


def _join_ray_cluster(args: argparse.Namespace, kind: str) -> None:
    """An instance spanning nodes: its Ray cluster formed, and an engine that runs on it
    (vLLM's Ray executor finds the cluster through RAY_ADDRESS)."""
    from rlft.trainer.rollout.ray_cluster import check_engine_runs_on_ray, wait_for_nodes

    wait_for_nodes(args.ray_address, args.nodes, args.instance, args.ray_timeout)
    check_engine_runs_on_ray(kind, args.nodes)
    os.environ["RAY_ADDRESS"] = args.ray_address


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlft rollout", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # a local run's rollout servers (rollout/local.py)
    from rlft.trainer.redaction import scrub_output

    scrub_output()
    sys.exit(main())
