"""The pods' probes as the planner builds them: a trainer's liveness on its progress (and
the startup probe that covers its rendezvous), a rollout pod's startup and readiness;
and a liveness kill seen by the failure policy, from the pod status a kubelet reports
(`kubernetes-validate --strict` of every shape, probes included, is in
test_operator_manifests.py)."""

from __future__ import annotations

import math

import pytest
import yaml
from jobs import job_doc, parsed
from pods import raw_pod, view

from rlft.operator import failures as P
from rlft.operator import manifests as M
from rlft.operator import names as N
from rlft.operator import probes
from rlft.operator.observe import pod_view
from rlft.trainer import termination
from rlft.trainer.config import JobFileError, load_job
from rlft.trainer.telemetry.liveness import PATH, PORT_ENV, STARTED_PATH

SETTINGS = M.Settings()


def _pods(role: str, gang: int = 0, **spec) -> list[dict]:
    job, body = parsed(job_doc(**spec))
    pods = M.desired(job, body, SETTINGS, "auto", gang).pods.values()
    return [p for p in pods if p["metadata"]["labels"][N.LABEL_ROLE] == role]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_trainer_pods_are_live_while_their_rank_makes_progress():
    (trainer,) = _pods(N.ROLE_TRAINER, gang=3)
    main = trainer["spec"]["containers"][0]
    live, startup = main["livenessProbe"], main["startupProbe"]
    port = SETTINGS.liveness_port
    assert live["httpGet"] == {"path": PATH, "port": port, "scheme": "HTTP"}
    assert startup["httpGet"] == {"path": STARTED_PATH, "port": port, "scheme": "HTTP"}
    # Default stallTimeoutSeconds 1800: every 10 s, killed after 3 answers that are not
    # 200 (within 30 s of the first 503), with a short grace (no emergency checkpoint is
    # possible from a stalled step).
    assert (live["periodSeconds"], live["failureThreshold"]) == (10, 3)
    assert live["successThreshold"] == 1 and live["timeoutSeconds"] == 5
    assert live["terminationGracePeriodSeconds"] == probes.STALLED_GRACE_SECONDS
    # The startup probe outlasts the rendezvous (schedulingTimeoutSeconds 600) and the
    # worker's start up to its first step, so a rendezvous that times out is judged as one.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600 + 1800
    assert "terminationGracePeriodSeconds" not in startup
    assert {"name": "liveness", "containerPort": 8081, "protocol": "TCP"} in main["ports"]
    env = _env(main)
    assert env[PORT_ENV] == "8081" and env["RLFT_GANG_ATTEMPT"] == "3"
    assert "--rdzv-id=0f0e-uid-3" in main["command"]  # the same attempt


@pytest.mark.parametrize(("stall", "period"), [(20, 2), (60, 6), (5, 1), (100_000, 10)])
def test_a_stalled_rank_is_killed_about_a_stall_timeout_after_its_last_progress(stall, period):
    (trainer,) = _pods(N.ROLE_TRAINER, trainer={"stallTimeoutSeconds": stall})
    live = trainer["spec"]["containers"][0]["livenessProbe"]
    assert live["periodSeconds"] == period == probes.liveness_period(stall)
    # The endpoint answers 503 from `stall` seconds without progress on; the kubelet
    # kills within failureThreshold periods of that.
    assert live["failureThreshold"] * live["periodSeconds"] == 3 * period <= 30


def test_no_stall_timeout_no_trainer_probes():
    (trainer,) = _pods(N.ROLE_TRAINER, trainer={"stallTimeoutSeconds": 0})
    main = trainer["spec"]["containers"][0]
    assert "livenessProbe" not in main and "startupProbe" not in main
    assert PORT_ENV not in _env(main)
    assert [p["name"] for p in main["ports"]] == ["rdzv", "status"]


def test_rollout_pods_start_within_their_startup_timeout_and_are_ready_with_weights():
    (rollout,) = _pods(N.ROLE_ROLLOUT, rollout={"startupTimeoutSeconds": 3600})
    main = rollout["spec"]["containers"][0]
    startup, ready = main["startupProbe"], main["readinessProbe"]
    port = SETTINGS.rollout_port
    assert startup["httpGet"] == {"path": "/livez", "port": port, "scheme": "HTTP"}
    assert ready["httpGet"] == {"path": "/healthz", "port": port, "scheme": "HTTP"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    assert startup["periodSeconds"] * (startup["failureThreshold"] - 1) < 3600
    assert ready["periodSeconds"] == 5 and ready["failureThreshold"] == 3
    # Liveness: /livez, which a broken engine fails, and a hung one: a generate call in
    # it for twice requestTimeoutSeconds, which the trainer gave up on twice (a busy one
    # still answers; test_rollout_publication_faults.py has both).
    alive = main["livenessProbe"]
    assert alive["httpGet"] == {"path": "/livez", "port": port, "scheme": "HTTP"}
    assert alive["failureThreshold"] == 3 and alive["periodSeconds"] == 10


def test_the_default_startup_timeout_is_sized_for_a_large_model():
    (rollout,) = _pods(N.ROLE_ROLLOUT)
    startup = rollout["spec"]["containers"][0]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1800


def test_ray_heads_serve_and_are_probed_their_workers_are_not():
    spec = {
        "rollout": {
            "engine": "vllm",
            "gpusPerInstance": 16,
            "tensorParallel": 8,
            "expertParallel": 2,
            "nodesPerInstance": 2,
        }
    }
    (head,) = _pods(N.ROLE_RAY_HEAD, **spec)
    (worker,) = _pods(N.ROLE_RAY_WORKER, **spec)
    assert head["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(
        worker["spec"]["containers"][0]
    )


def test_the_probe_fields_are_bounded(tmp_path):
    path = tmp_path / "job.yaml"
    doc = job_doc(trainer={"stallTimeoutSeconds": -1}, rollout={"startupTimeoutSeconds": 5})
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(JobFileError) as error:
        load_job(path)
    fields = " ".join(error.value.problems)
    assert "spec.trainer.stallTimeoutSeconds" in fields
    assert "spec.rollout.startupTimeoutSeconds" in fields


# ------------------------------------------------------------- the failure policy


def _killed_by_its_liveness(name: str, verdict: termination.Verdict | None, code: int) -> dict:
    """A trainer pod as a kubelet reports it after a liveness kill with restartPolicy
    Never: Failed, exit code 137 (SIGKILL) or 143 (SIGTERM), reason Error; the message is
    the termination-message file (FallbackToLogsOnError: the log tail when it is empty)."""
    pod = raw_pod(name, phase="Failed", exit_code=code, verdict=verdict, ready=False)
    if verdict is None:
        terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        terminated["message"] = "[rank1]: Traceback ...\nRuntimeError: Connection closed by peer"
    return pod


@pytest.mark.parametrize("code", [137, 143])
def test_a_rank_that_stalled_is_a_stalled_gang_restart(code):
    stalled = termination.Verdict(
        1, "stalled: rank 1 made no progress for 21 s (stallTimeoutSeconds 20)", 1, stalled=True
    )
    failure = P.classify(pod_view(_killed_by_its_liveness("job-trainer-1", stalled, code)))
    assert failure is not None and failure.kind == P.STALLED == "Stalled"
    assert failure.group and not failure.permanent
    assert failure.exit_code == 1 and "stalled" in failure.message


def test_a_peer_whose_collective_broke_after_stalling_is_stalled_too():
    """Rank 0 was blocked in a collective with the hung rank (so it stalled too) when the
    hung rank was killed: its collective raised, and its verdict keeps `stalled`."""
    broke = termination.Verdict(1, "RuntimeError: Connection closed by peer", 0, stalled=True)
    failure = P.classify(pod_view(_killed_by_its_liveness("job-trainer-0", broke, 1)))
    assert failure is not None and failure.kind == P.STALLED


def test_a_kill_without_a_stalled_verdict_is_no_stall():
    failure = P.classify(pod_view(_killed_by_its_liveness("job-trainer-0", None, 137)))
    assert failure is not None and failure.kind == P.ERROR
    rollout = view("job-rollout-0", N.ROLE_ROLLOUT, phase="Failed", exit_code=137)
    assert P.classify(rollout).kind == P.ERROR


def test_in_a_pod_of_several_ranks_the_stalled_line_is_the_verdict():
    lines = termination.encode(termination.Verdict(1, "RuntimeError: broken pipe", 9))
    lines += termination.encode(termination.Verdict(1, "stalled: rank 10 …", 10, stalled=True))
    verdict = termination.read(lines)
    assert verdict is not None and verdict.stalled and verdict.rank == 10


def test_the_startup_budget_follows_the_scheduling_timeout():
    (trainer,) = _pods(
        N.ROLE_TRAINER,
        trainer={"stallTimeoutSeconds": 120},
        scheduling={"schedulingTimeoutSeconds": 900},
    )
    startup = trainer["spec"]["containers"][0]["startupProbe"]
    assert startup["periodSeconds"] == 10
    assert startup["failureThreshold"] == math.ceil((900 + 120) / 10)
