"""A publisher that can start no thread, for real: its process is put in a cgroup of the
pids controller (cgroup v1, as root) whose limit is the threads it has, so the kernel
refuses the next one (root is not held by RLIMIT_NPROC, a cgroup holds everyone)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from rollout_fixtures import ThreadServer

PIDS_ROOT = Path("/sys/fs/cgroup/pids")

# Rank 0's publisher over two instances, the second of which refuses its loads (it
# expects another token): version 1 is published to the first, and the catch-up keeps
# trying the second, each try a thread of its own, also once the test limited them.
PUBLISHER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch
    torch.set_num_threads(1)  # no intra-op pool threads to start later
    from rollout_fixtures import store_at, tiny_model
    from rlft.trainer.rollout.client import RolloutClient
    from rlft.trainer.rollout.publisher import WeightPublisher

    urls, folder = sys.argv[1].split(","), sys.argv[2]
    model = tiny_model()[0]
    client = RolloutClient(urls, timeout_s=10, probe_every_s=0.05)
    publisher = WeightPublisher(
        client, store_at(Path(folder)), "store", 30, "127.0.0.1", 0.05, catch_up_backoff_max_s=0.5
    )
    publisher.publish_now(model, 1)
    print("published", flush=True)
    sys.stdin.readline()  # the test limited this process's threads
    publisher._thread.join(timeout=60)
    print("thread alive" if publisher._thread.is_alive() else "thread ended", flush=True)
    try:
        publisher.publish(model, 2)
    except RuntimeError as error:
        print(f"publish raised: {error}", flush=True)
    """
)


def test_a_publisher_thread_ended_by_a_catch_up_error_tells_the_trainer(tmp_path: Path) -> None:
    """Its catch-ups ran outside the error handling: an error there (no thread left to
    start) ended the thread silently, and the trainer waited for an ack forever."""
    steady, refusing = ThreadServer(), ThreadServer(token="not-the-trainers")
    group = PIDS_ROOT / f"rlft-test-{uuid.uuid4().hex[:8]}"
    here = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, f"{steady.url},{refusing.url}", str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline().strip() == "published", "the first publication failed"
        group.mkdir()
        (group / "cgroup.procs").write_text(str(child.pid))
        (group / "pids.max").write_text((group / "pids.current").read_text())
        child.stdin.write("go\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=120)
        assert int((group / "pids.events").read_text().split()[1]) >= 1, "no thread refused"
        assert "thread ended" in out, out
        assert "publish raised: weight publication failed: can't start new thread" in out, out
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if group.exists():
            group.rmdir()  # empty once the child is gone
        steady.stop()
        refusing.stop()
