"""Checkpoint benchmark, side by side in one run on the same state and the same server:

1. how long the training loop is blocked by an asynchronous checkpoint vs a synchronous
   one (both: DCP shards → upload → manifest) to a real SeaweedFS S3 server on loopback;
2. the S3 writer's upload throughput vs a plain boto3 `upload_file` of the same bytes.

Last line: JSON with `blocking_ratio` (async / sync, goal ≤ 0.1) and
`throughput_vs_boto3` (ours / boto3's, goal ≥ 0.8).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from seaweedfs import ACCESS_KEY, SECRET_KEY, SeaweedServer  # noqa: E402

from rlft.trainer.checkpoint import open_storage  # noqa: E402
from rlft.trainer.checkpoint.saver import Checkpointer  # noqa: E402
from rlft.trainer.storage.backends import S3Options  # noqa: E402

WIDTH, DEPTH, ROUNDS = 2048, 4, 3  # 16.8 M parameters: 67 MB + 134 MB of AdamW state


def build_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, WIDTH)).sum().backward()
    optimizer.step()
    return model, optimizer


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    work = Path(tempfile.mkdtemp(prefix="rlft-bench-ckpt-"))
    server = SeaweedServer(work / "data", work / "weed.log")
    server.start()
    try:
        server.create_bucket("bench")
        options = S3Options(endpoint_url=server.endpoint, addressing_style="path")
        storage = open_storage("s3://bench/run", options)
        model, optimizer = build_state()
        state_mb = (
            sum(
                t.numel() * t.element_size()
                for t in [*model.state_dict().values()]
                + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            )
            / 1e6
        )
        ckpt = Checkpointer(storage, keep_last=2, staging_dir=work / "staging")
        blocked_async, blocked_sync = [], []
        step = 0
        for _ in range(ROUNDS):
            step += 1
            start = time.perf_counter()
            ckpt.save(step, model, optimizer, extra={"step": step})
            blocked_async.append(time.perf_counter() - start)
            ckpt.wait()
            step += 1
            start = time.perf_counter()
            assert ckpt.save(step, model, optimizer, extra={"step": step}, wait=True)
            blocked_sync.append(time.perf_counter() - start)
        assert ckpt.stats.committed == 2 * ROUNDS and ckpt.stats.failed == 0
        ckpt.close()

        # Upload throughput: one large file, our writer vs boto3's defaults.
        blob = work / "blob.bin"
        blob.write_bytes(os.urandom(int(state_mb * 1e6)))
        size_mb = blob.stat().st_size / 2**20
        client = server.client()
        ours, plain = [], []
        for i in range(ROUNDS):
            start = time.perf_counter()
            storage.put_file(f"throughput/ours-{i}", blob)
            ours.append(size_mb / (time.perf_counter() - start))
            start = time.perf_counter()
            client.upload_file(str(blob), "bench", f"run/throughput/boto3-{i}")
            plain.append(size_mb / (time.perf_counter() - start))
    finally:
        server.stop()

    a, s = statistics.median(blocked_async), statistics.median(blocked_sync)
    o, b = statistics.median(ours), statistics.median(plain)
    print(f"state: {state_mb:.0f} MB (model + AdamW), SeaweedFS S3 on loopback, {ROUNDS} rounds")
    print(f"{'':32}{'async':>12}{'sync':>12}{'ratio':>10}")
    print(f"{'training loop blocked (s)':32}{a:>12.3f}{s:>12.3f}{a / s:>10.3f}")
    print(f"{'':32}{'rlft S3':>12}{'boto3':>12}{'ratio':>10}")
    print(f"{'upload throughput (MiB/s)':32}{o:>12.1f}{b:>12.1f}{o / b:>10.2f}")
    print(
        json.dumps(
            {
                "state_mb": round(state_mb, 1),
                "async_blocking_s": round(a, 4),
                "sync_blocking_s": round(s, 4),
                "blocking_ratio": round(a / s, 4),
                "rlft_mib_s": round(o, 1),
                "boto3_mib_s": round(b, 1),
                "throughput_vs_boto3": round(o / b, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
