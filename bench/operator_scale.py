"""Scale check of the operator: N RLFineTunes created at once (one `kubectl apply`) until
every one reaches its planned state (ConfigMap, two Services, its pods, status Pending),
against the emulated API server (not a cluster). Runs N=20 and N=200, each on a fresh API
server and operator, and prints them side by side with the operator's peak memory
(VmHWM). The last line is JSON.

    .venv/bin/python bench/operator_scale.py [--jobs 200] [--small 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster import ROOT, EmulatedApiServer, OperatorProcess, wait_for
from jobs import job_doc

CRDS = [ROOT / "crds" / "rlfinetune.yaml", ROOT / "crds" / "kopf-peering.yaml"]


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _planned(api: EmulatedApiServer, jobs: int) -> bool:
    listing = api.get("rlft", "-n", "scale")["items"]
    pending = sum(1 for j in listing if j.get("status", {}).get("phase") == "Pending")
    pods = api.kubectl("get", "pods", "-n", "scale", "-o", "name").stdout.split()
    services = api.kubectl("get", "services", "-n", "scale", "-o", "name").stdout.split()
    maps = api.kubectl("get", "configmaps", "-n", "scale", "-o", "name").stdout.split()
    return (
        pending == jobs
        and len(pods) == 2 * jobs
        and len(services) == 2 * jobs
        and len(maps) == jobs
    )


def run(jobs: int, workdir: Path) -> dict[str, float]:
    api = EmulatedApiServer(workdir)
    operator = None
    try:
        for path in CRDS:
            api.kubectl("apply", "--validate=false", "-f", str(path))
        api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "scale"}})
        operator = OperatorProcess(api, "--all-namespaces", "--standalone", "--poll-seconds", "60")
        idle_rss = _peak_rss_mib(operator.process.pid)
        documents = {
            "apiVersion": "v1",
            "kind": "List",
            "items": [job_doc(name=f"job-{i:04d}", namespace="scale") for i in range(jobs)],
        }
        started = time.monotonic()
        api.apply(documents)
        applied = time.monotonic() - started
        wait_for(lambda: _planned(api, jobs), f"{jobs} jobs planned", timeout=600, every=1.0)
        elapsed = time.monotonic() - started
        return {
            "jobs": jobs,
            "seconds": round(elapsed, 2),
            "apply_seconds": round(applied, 2),
            "ms_per_job": round(1000 * elapsed / jobs, 1),
            "operator_peak_rss_mib": round(_peak_rss_mib(operator.process.pid), 1),
            "operator_idle_rss_mib": round(idle_rss, 1),
        }
    finally:
        if operator is not None:
            operator.stop()
        api.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--small", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlft-scale-") as tmp:
        small = run(args.small, Path(tmp) / "small")
        large = run(args.jobs, Path(tmp) / "large")
    print(f"{'':28}{'N=' + str(small['jobs']):>12}{'N=' + str(large['jobs']):>12}{'ratio':>10}")
    for key, label in [
        ("seconds", "time to planned state (s)"),
        ("ms_per_job", "per job (ms)"),
        ("operator_peak_rss_mib", "operator peak RSS (MiB)"),
    ]:
        ratio = large[key] / small[key] if small[key] else float("nan")
        print(f"{label:28}{small[key]:>12}{large[key]:>12}{ratio:>10.2f}")
    summary = {
        "bench": "operator_scale",
        "jobs": large["jobs"],
        "seconds": large["seconds"],
        "ms_per_job": large["ms_per_job"],
        "operator_peak_rss_mib": large["operator_peak_rss_mib"],
        "small_jobs": small["jobs"],
        "small_seconds": small["seconds"],
        "small_operator_peak_rss_mib": small["operator_peak_rss_mib"],
        "per_job_time_ratio": round(large["ms_per_job"] / small["ms_per_job"], 2),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
