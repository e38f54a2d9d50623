"""The probes of a job's pods: what each kubelet asks, how often, and when it gives up.
Pure functions of the job (the pod builders in manifests.py add them).

Trainer pods, when `spec.trainer.stallTimeoutSeconds` is not 0, ask the endpoints that
local rank 0 of each pod serves (`trainer/telemetry/liveness_server.py`):

- a startup probe on `/started` (503 until the rank's training loop has begun), for
  what comes first: torchrun's rendezvous (up to `schedulingTimeoutSeconds`), the
  worker's start, loading the model and a checkpoint. The liveness probe begins only
  once it succeeded. It allows schedulingTimeoutSeconds + stallTimeoutSeconds, so a
  rendezvous that times out is judged as one (RendezvousTimeout, or a gang waiting for
  capacity), never as a failed probe;
- a liveness probe on `/livez` (503 once the rank made no progress for the stall
  timeout) every `liveness_period` seconds (a tenth of the stall timeout, 1 to 10 s)
  that fails after 3 answers in a row that are not 200: a stalled rank's container
  is killed within 3 periods of its first 503, about stallTimeoutSeconds + 3 periods after
  its last progress. 3 periods without any answer are tolerated too (a worker restarted
  in place by an elastic membership change is serving again within seconds). Its own
  grace is short: a stalled rank cannot finish the step its emergency checkpoint waits
  for, so the job's long grace would only delay the restart.

Rollout pods and Ray heads (which serve the rollout protocol; Ray workers serve nothing):

- a startup probe on `/livez` (200 as soon as the server serves) allowing
  `spec.rollout.startupTimeoutSeconds`: loading a large model happens before it serves;
- a readiness probe on `/healthz` (503 until weights are loaded): Ready while it has
  weights. Not `/healthz` for startup: a job whose model the trainer builds has no
  weights before the trainer's first publication, after its warm start;
- a liveness probe on `/livez` (503 once requests fail in the engine again and again: a
  dead vLLM engine, a GPU in an error state, behind an HTTP server that still answers;
  or once one generate call has been in the engine for twice
  `spec.rollout.requestTimeoutSeconds`: a hung one): the container is killed, the pod
  fails, and the operator replaces it.

With `restartPolicy: Never` the kubelet does not restart a killed container: the pod
ends Failed and the operator's failure policy decides (a trainer's verdict says
`stalled`, failures.py).
"""

from __future__ import annotations

import math
from typing import Any

from rlft.trainer.config import RLFineTune
from rlft.trainer.telemetry.liveness import PATH as LIVENESS_PATH
from rlft.trainer.telemetry.liveness import STARTED_PATH

LIVENESS_FAILURES = 3
"""Answers in a row that are not 200 before the kubelet kills a trainer container."""
PROBE_TIMEOUT_SECONDS = 5
"""An answer slower than this is a failure (the endpoints answer from their own thread)."""
STALLED_GRACE_SECONDS = 15
"""terminationGracePeriodSeconds of a liveness kill: the agent's SIGTERM to its workers,
then the kubelet's SIGKILL."""
ROLLOUT_STARTUP_PERIOD = 10
ROLLOUT_READINESS_PERIOD = 5
ROLLOUT_LIVENESS_PERIOD = 10
ROLLOUT_LIVEZ = "/livez"
ROLLOUT_HEALTHZ = "/healthz"


def liveness_period(stall_timeout_seconds: int) -> int:
    """periodSeconds of a trainer's probes: a tenth of the stall timeout, 1 to 10 s."""
    return min(10, max(1, stall_timeout_seconds // 10))


def _http(path: str, port: int) -> dict[str, Any]:
    return {"path": path, "port": port, "scheme": "HTTP"}


def trainer_probes(job: RLFineTune, port: int) -> dict[str, dict[str, Any]]:
    """The container fields `startupProbe` and `livenessProbe` of a trainer pod whose
    local rank 0 serves the liveness endpoint on `port`; none when the stall timeout is 0."""
    stall = job.spec.trainer.stall_timeout_seconds
    if stall <= 0:
        return {}
    period = liveness_period(stall)
    startup_budget = job.spec.scheduling.scheduling_timeout_seconds + stall
    return {
        "startupProbe": {
            "httpGet": _http(STARTED_PATH, port),
            "periodSeconds": period,
            "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
            "successThreshold": 1,
            "failureThreshold": math.ceil(startup_budget / period),
        },
        "livenessProbe": {
            "httpGet": _http(LIVENESS_PATH, port),
            "periodSeconds": period,
            "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
            "successThreshold": 1,
            "failureThreshold": LIVENESS_FAILURES,
            "terminationGracePeriodSeconds": STALLED_GRACE_SECONDS,
        },
    }


def rollout_probes(job: RLFineTune, port: int) -> dict[str, dict[str, Any]]:
    """`startupProbe`, `readinessProbe` and `livenessProbe` of a pod serving the rollout
    protocol on `port`."""
    startup = job.spec.rollout.startup_timeout_seconds
    return {
        "startupProbe": {
            "httpGet": _http(ROLLOUT_LIVEZ, port),
            "periodSeconds": ROLLOUT_STARTUP_PERIOD,
            "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
            "successThreshold": 1,
            "failureThreshold": math.ceil(startup / ROLLOUT_STARTUP_PERIOD),
        },
        "readinessProbe": {
            "httpGet": _http(ROLLOUT_HEALTHZ, port),
            "periodSeconds": ROLLOUT_READINESS_PERIOD,
            "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
            "successThreshold": 1,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": _http(ROLLOUT_LIVEZ, port),
            "periodSeconds": ROLLOUT_LIVENESS_PERIOD,
            "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
            "successThreshold": 1,
            "failureThreshold": LIVENESS_FAILURES,
        },
    }
