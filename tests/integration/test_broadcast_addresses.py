"""Weights by broadcast between pods: each member's gloo listens on the address its peers
are given, so it must be the pod's own (RLFT_POD_IP). A rollout server listened on
127.0.0.1, which on one machine every process reaches, so every test passed; in a
cluster the trainer's pod would have dialled its own loopback, and every publication
waited out the group's timeout before falling back to the store.

Here each side gets a loopback address of its own (the trainer 127.66.0.1, the rollout
server 127.66.0.2), and the test reads where the server's process really listens."""

from __future__ import annotations

import os
from pathlib import Path

from rollout_fixtures import publish, redraw, store_at, tiny_model

from rlft.trainer.rollout.client import RolloutClient
from rlft.trainer.rollout.local import LocalServers
from rlft.trainer.rollout.publisher import WeightPublisher
from rlft.trainer.telemetry.liveness_server import POD_IP_ENV

TRAINER_IP, SERVER_IP = "127.66.0.1", "127.66.0.2"


def listening_addresses(pid: int) -> set[str]:
    """The IPv4 addresses the process's TCP sockets listen on (/proc: its socket inodes
    against the network namespace's table)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and inode in inodes:  # LISTEN
            hex_ip = local.split(":")[0]
            found.add(".".join(str(int(hex_ip[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_a_rollout_servers_broadcast_member_listens_on_its_pods_address(tmp_path):
    model, _ = tiny_model()
    store = store_at(tmp_path)
    publish(store, model, 0)
    env = {POD_IP_ENV: SERVER_IP}
    with LocalServers(
        1, "transformers", store.storage.uri, log_dir=tmp_path, extra_env=env
    ) as servers:
        client = RolloutClient(servers.start(), timeout_s=60, token=servers.token)
        publisher = WeightPublisher(client, store, "broadcast", timeout_s=60, host=TRAINER_IP)
        try:
            client.wait_ready(120)
            for version in (1, 2):  # 1 by the store (it builds the engine), 2 broadcast
                redraw(model, version)
                publisher.publish_now(model, version)
            assert store.latest() == 2  # the group formed at 2 (its copy in the store)
            assert client.instances[0].policy_version == 2
            listening = listening_addresses(servers.processes[0].pid)
        finally:
            publisher.close()
            client.close()
    assert SERVER_IP in listening, listening
