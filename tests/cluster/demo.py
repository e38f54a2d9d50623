"""`make cluster-demo`: the test cluster on this machine with the example job applied.

It starts the emulated API server, a scheduler and two process kubelets, a real SeaweedFS
as the cluster's object store and the real operator; then it applies
examples/tiny-grpo.yaml with an s3:// checkpoint location and two trainer pods, and
prints how to watch it with kubectl. It runs until the job finishes (or Ctrl-C), then
stops everything it started. Not a real cluster: see tests/cluster/README.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "tests"))

import yaml  # noqa: E402
from seaweedfs import SeaweedServer  # noqa: E402
from testcluster import ProcessCluster  # noqa: E402

NAMESPACE = "demo"
BUCKET = "rlft-demo"


def demo_job(steps: int | None = None) -> dict:
    job = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    job["metadata"]["namespace"] = NAMESPACE
    spec = job["spec"]
    if steps is not None:
        spec["trainer"]["steps"] = steps
    spec["trainer"]["replicas"] = {"min": 2, "max": 2}
    spec["rollout"]["engine"] = "transformers"
    spec["checkpoint"] = {
        "uri": f"s3://{BUCKET}/tiny-grpo",
        "credentialsSecret": "s3-creds",
        "addressingStyle": "path",
        "intervalSteps": 50,
    }
    return job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="RL steps (default: the example's)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="rlft-cluster-demo-"))
    store = SeaweedServer(workdir / "seaweedfs", workdir / "seaweedfs.log")
    store.start()
    try:
        with ProcessCluster(workdir / "cluster", nodes=2) as cluster:
            cluster.install_operator(NAMESPACE, store.credentials())
            store.create_bucket(BUCKET)
            cluster.apply(demo_job(args.steps))
            kubeconfig = cluster.api_server.kubeconfig
            kubectl = cluster.api_server.kubectl_path
            print(
                f"""
rlft test cluster: 2 process kubelets, emulated API server, SeaweedFS, the operator.
The example job tiny-grpo runs in namespace {NAMESPACE} with 2 trainer pods. Watch it:

  export KUBECONFIG={kubeconfig}
  {kubectl} get rlft -n {NAMESPACE} -w
  {kubectl} get pods -n {NAMESPACE} -o wide
  tail -f {workdir}/cluster/nodes/*/pods/{NAMESPACE}_tiny-grpo-trainer-0_*/main.log

Ctrl-C stops the cluster.""",
                flush=True,
            )
            phase = None
            while phase not in ("Succeeded", "Failed"):
                time.sleep(5)
                job = cluster.api.request(
                    "GET", f"/apis/rlft.dev/v1alpha1/namespaces/{NAMESPACE}/rlfinetunes/tiny-grpo"
                )
                status = job.get("status") or {}
                phase = status.get("phase")
                print(
                    f"  phase {phase}, step {status.get('step')}, reward {status.get('reward')}",
                    flush=True,
                )
            print(f"tiny-grpo {phase}; outputs in s3://{BUCKET}/tiny-grpo/outputs")
            return 0 if phase == "Succeeded" else 1
    except KeyboardInterrupt:
        return 130
    finally:
        store.stop()


if __name__ == "__main__":
    sys.exit(main())
