"""A rollout instance that spans several nodes: its Ray cluster (the head pod runs this
server, the worker pods only `ray start`), awaited before the engine starts.

vLLM places one worker per device of the instance through its Ray executor. Its CPU
build has none (`current_platform.ray_device_key` is empty), so an instance spanning
nodes on a CPU image is refused here with the field to change, once the cluster has
formed, instead of failing deep inside vLLM after minutes of start-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rlft.trainer.exit_codes import ExitCode


class RayClusterError(RuntimeError):
    """The instance's Ray cluster did not form, or cannot run the engine."""

    def __init__(self, message: str, exit_code: int = ExitCode.FAILURE):
        super().__init__(message)
        self.exit_code = exit_code


def wait_for_nodes(
    address: str,
    nodes: int,
    instance: int,
    timeout_s: float = 600.0,
    log: Callable[[str], None] = print,
    poll_s: float = 1.0,
) -> int:
    """Join the Ray cluster at `address` and wait until `nodes` nodes are alive; returns
    how many are. A worker pod that never joins (unschedulable, crash-looping) ends in
    a retryable error naming the instance, not in a server that waits forever."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + timeout_s
    alive = 0
    while True:
        alive = sum(1 for node in ray.nodes() if node.get("Alive"))
        if alive >= nodes:
            log(f"rlft rollout: instance {instance}: Ray cluster at {address} has {alive} nodes")
            return alive
        if time.monotonic() > deadline:
            raise RayClusterError(
                f"rollout instance {instance}: only {alive} of {nodes} Ray nodes joined "
                f"{address} in {timeout_s:.0f} s; check the instance's ray-worker pods"
            )
        log(f"rlft rollout: instance {instance}: waiting for Ray nodes ({alive} of {nodes})")
        time.sleep(poll_s)


def check_engine_runs_on_ray(engine: str, nodes: int) -> None:
    """Refuse, as a configuration error, an engine that cannot span `nodes` nodes."""
    if engine != "vllm":
        raise RayClusterError(
            f"spec.rollout.nodesPerInstance is {nodes}, but the {engine} engine runs on one "
            "node: set spec.rollout.engine to vllm or nodesPerInstance to 1",
            ExitCode.INVALID_CONFIG,
        )
    from vllm.platforms import current_platform

    if not current_platform.ray_device_key:
        raise RayClusterError(
            f"spec.rollout.nodesPerInstance is {nodes}, but this vLLM build (platform "
            f"{current_platform.device_name}) has no Ray executor, so one instance cannot "
            "span nodes: use a GPU rollout image or set nodesPerInstance to 1",
            ExitCode.INVALID_CONFIG,
        )
