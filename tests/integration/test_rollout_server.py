"""The rollout protocol on real HTTP servers (transformers engine): round trip, bad
requests, health and metrics, weight updates atomic with respect to requests, and an
instance killed with requests in flight (every prompt still yields exactly one group).

The same protocol on the vLLM engine is in test_rollout_vllm.py."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from rollout_fixtures import (
    PROMPTS,
    ThreadServer,
    publish,
    redraw,
    store_at,
    tiny_model,
    wait_until,
)

from rlft.trainer.rollout import SamplingParams, TransformersEngine
from rlft.trainer.rollout.client import Generated, RequestFailed, RolloutClient, http_json
from rlft.trainer.rollout.local import LocalServers
from rlft.trainer.rollout.protocol import GenerateRequest, ProtocolError, WeightsRequest
from rlft.trainer.rollout.remote import RemoteEngine

GREEDY = SamplingParams(max_new_tokens=8, greedy=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def server():
    instance = ThreadServer()
    yield instance
    instance.stop()


def greedy_reference(model, tokenizer, prompts=PROMPTS, n=1):
    engine = TransformersEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    return [c.token_ids for c in engine.generate(prompts, n, GREEDY)]


def test_protocol_round_trip_health_and_metrics(server, tmp_path: Path) -> None:
    model, tokenizer = tiny_model()
    health = http_json_status(f"{server.url}/healthz")
    assert health[0] == 503 and "no weights" in health[1]["reason"]

    store = store_at(tmp_path)
    uri = publish(store, model, 3)
    client = RolloutClient([server.url], timeout_s=60)
    assert client.load_weights(client.instances[0], WeightsRequest(version=3, uri=uri), 60)
    assert http_json(f"{server.url}/healthz", None, 5) == {
        "ok": True,
        "policy_version": 3,
        "engine": "transformers",
        "server_id": server.server.server_id,
    }
    request = GenerateRequest(PROMPTS, 2, GREEDY, seed=1, stop_ids=[tokenizer.eos_token_id])
    answer = client.generate(request)
    assert answer.policy_version == 3
    assert [c.prompt_index for c in answer.completions] == [0, 0, 1, 1, 2, 2]
    assert all(c.policy_version == 3 for c in answer.completions)
    assert [c.token_ids for c in answer.completions] == greedy_reference(model, tokenizer, n=2)
    assert all(len(c.logprobs) == len(c.token_ids) for c in answer.completions)
    assert answer.tokens == sum(len(c.token_ids) for c in answer.completions)

    metrics = urlopen_text(f"{server.url}/metrics")
    assert 'rlft_rollout_requests_total{status="ok"} 1.0' in metrics
    assert f"rlft_rollout_generated_tokens_total {float(answer.tokens)}" in metrics
    assert "rlft_rollout_policy_version 3.0" in metrics
    client.close()


def test_sampled_requests_are_reproducible_by_seed(server, tmp_path: Path) -> None:
    model = tiny_model()[0]
    uri = publish(store_at(tmp_path), model, 0)
    http_json(f"{server.url}/weights", {"version": 0, "uri": uri}, 60)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=8)
    body = GenerateRequest(PROMPTS, 3, sampling, seed=11).to_json()
    first = http_json(f"{server.url}/generate", body, 60)["completions"]
    again = http_json(f"{server.url}/generate", body, 60)["completions"]
    other = http_json(f"{server.url}/generate", body | {"seed": 12}, 60)["completions"]
    assert first == again
    assert [c["token_ids"] for c in first] != [c["token_ids"] for c in other]
    # behaviour log-probs are those of the sampling distribution (softmax of logits / T)
    c = first[0]
    ids = torch.tensor([PROMPTS[0] + c["token_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPTS[0]) - 1 : -1].float() / 0.8
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c["token_ids"])[:, None])
    assert torch.allclose(expected.squeeze(-1), torch.tensor(c["logprobs"]), atol=1e-5)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompts": [], "n": 1}, "prompts"),
        ({"prompts": [[1, 2]], "n": 0}, "n:"),
        ({"prompts": [[1, 99999]], "n": 1}, "prompts[0]"),
        ({"prompts": [[1]], "sampling": {"temperture": 1.0}}, "unknown field"),
        ({"prompts": [[1]], "sampling": {"top_p": 0}}, "sampling.top_p"),
    ],
)
def test_bad_requests_are_rejected_naming_the_field(server, tmp_path, body, field) -> None:
    model = tiny_model()[0]
    http_json(
        f"{server.url}/weights", {"version": 0, "uri": publish(store_at(tmp_path), model, 0)}, 60
    )
    with pytest.raises(ProtocolError, match=field.replace("[", r"\[").replace("]", r"\]")):
        http_json(f"{server.url}/generate", body, 10)


def test_weights_request_needs_a_published_version(server, tmp_path: Path) -> None:
    with pytest.raises(ProtocolError, match="exactly one of uri and broadcast"):
        http_json(f"{server.url}/weights", {"version": 1}, 10)
    missing = (tmp_path / "nothing").as_uri()
    status, body = http_json_status(f"{server.url}/weights", {"version": 1, "uri": missing})
    assert status == 500 and "not a published weight version" in body["error"]


def test_weights_of_an_older_trainer_gang_are_refused(server, tmp_path: Path) -> None:
    """An instance takes weights from gang attempts that never go back (a load without
    one, from a local run, passes); a bad attempt number is named."""
    from rlft.trainer.rollout.protocol import SupersededGangError

    model = tiny_model()[0]
    uri = publish(store_at(tmp_path), model, 0)
    load = f"{server.url}/weights"
    assert http_json(load, {"version": 0, "uri": uri, "gang": 2}, 60)["policy_version"] == 0
    assert http_json(load, {"version": 0, "uri": uri, "gang": 2}, 60)  # the same gang
    assert http_json(load, {"version": 0, "uri": uri}, 60)  # no gang: not refused
    with pytest.raises(SupersededGangError, match="gang attempt 1 refused: gang attempt 2"):
        http_json(load, {"version": 0, "uri": uri, "gang": 1}, 60)
    assert http_json(load, {"version": 0, "uri": uri, "gang": 3}, 60)
    assert server.server.host.gang == 3
    with pytest.raises(ProtocolError, match="gang"):
        http_json(load, {"version": 0, "uri": uri, "gang": "new"}, 10)


def test_a_load_older_than_the_weights_served_does_not_go_back(server, tmp_path) -> None:
    """A load that queued behind a long request (its first attempt timed out at the
    trainer, which retried while it waited) arrives after a newer one: it was applied,
    and the instance served older weights than it had acknowledged."""
    model, _ = tiny_model()
    store = store_at(tmp_path)
    old_uri = publish(store, model, 3)
    redraw(model, 5)
    new_uri = publish(store, model, 5)
    assert (
        http_json(f"{server.url}/weights", {"version": 5, "uri": new_uri}, 60)["policy_version"]
        == 5
    )
    answer = http_json(f"{server.url}/weights", {"version": 3, "uri": old_uri}, 60)
    assert answer["policy_version"] == 5
    assert http_json(f"{server.url}/healthz", None, 5)["policy_version"] == 5
    served = server.server.host.engine.model.state_dict()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in served.items())


def test_an_engine_that_fails_every_request_is_reported_dead(server, tmp_path) -> None:
    """Every request failing in the engine (a dead vLLM engine, a GPU in an error state)
    behind an HTTP server that answers: /livez said ok, so the pod's liveness never had
    it replaced and each request was re-issued until the trainer's deadline."""
    from rlft.trainer.rollout.server import ENGINE_FAILURES

    model, tokenizer = tiny_model()
    uri = publish(store_at(tmp_path), model, 0)
    http_json(f"{server.url}/weights", {"version": 0, "uri": uri}, 60)
    engine = server.server.host.engine
    generate = engine.generate

    def dead(*args, **kwargs):
        raise OSError("CUDA error: an illegal memory access was encountered")

    engine.generate = dead
    body = GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=[tokenizer.eos_token_id]).to_json()
    for attempt in range(ENGINE_FAILURES):
        assert http_json_status(f"{server.url}/livez", None)[0] == 200, attempt
        with pytest.raises(RequestFailed, match="illegal memory access"):
            http_json(f"{server.url}/generate", body, 30)
    status, answer = http_json_status(f"{server.url}/livez", None)
    assert status == 503 and "5 requests in a row failed" in answer["reason"]
    engine.generate = generate  # it recovered (a transient fault): alive again
    http_json(f"{server.url}/generate", body, 30)
    assert http_json_status(f"{server.url}/livez", None)[0] == 200


def test_a_server_starts_from_the_jobs_own_model_folder(server, tmp_path: Path) -> None:
    """spec.model.path (on Kubernetes, a folder on a mounted claim) is a plain Hugging Face
    folder with no READY marker: before the trainer publishes anything the server serves
    it as version 0, greedy-equal to the model itself."""
    model, tokenizer = tiny_model()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert not (folder / "READY").exists()
    server.server.host.load_model(folder)
    assert http_json(f"{server.url}/healthz", None, 5)["policy_version"] == 0
    client = RolloutClient([server.url], timeout_s=60)
    request = GenerateRequest(PROMPTS, 1, GREEDY, seed=1, stop_ids=[tokenizer.eos_token_id])
    answer = client.generate(request)
    assert answer.policy_version == 0
    assert [c.token_ids for c in answer.completions] == greedy_reference(model, tokenizer)
    client.close()


def test_weight_updates_are_atomic_with_respect_to_requests(server, tmp_path: Path) -> None:
    """Requests and updates race; every answer is exactly one version's greedy output."""
    store = store_at(tmp_path)
    models, expected = {}, {}
    for version in range(4):
        model, tokenizer = tiny_model(seed=version)
        models[version] = model
        expected[version] = greedy_reference(model, tokenizer)
    http_json(f"{server.url}/weights", {"version": 0, "uri": publish(store, models[0], 0)}, 60)
    client = RolloutClient([server.url], timeout_s=60)
    answers: list[Generated] = []
    errors: list[Exception] = []
    stop = threading.Event()

    def ask() -> None:
        try:
            while not stop.is_set():
                answers.append(client.generate(GenerateRequest(PROMPTS, 1, GREEDY)))
        except Exception as error:  # told by the waits below, not lost with the thread
            errors.append(error)

    def wait_for_an_answer_of(version: int) -> None:
        def has() -> bool:
            assert not errors, f"a request failed: {errors[0]!r}"
            return any(a.policy_version == version for a in list(answers))

        wait_until(has, 60, f"an answer of version {version}")

    askers = [threading.Thread(target=ask) for _ in range(3)]
    for thread in askers:
        thread.start()
    try:
        # Each version is published once one answer came from the one before (0 first):
        # a fixed time per version skipped versions on a loaded machine. The askers keep
        # requests in flight meanwhile, so the loads still race them.
        for version in range(1, 4):
            wait_for_an_answer_of(version - 1)
            uri = publish(store, models[version], version)
            assert client.load_weights(
                client.instances[0], WeightsRequest(version=version, uri=uri), 60
            )
        wait_for_an_answer_of(3)
    finally:
        stop.set()
        for thread in askers:
            thread.join(60)
    assert not errors, f"a request failed: {errors[0]!r}"
    seen = set()
    for answer in answers:
        versions = {c.policy_version for c in answer.completions}
        assert versions == {answer.policy_version}
        assert [c.token_ids for c in answer.completions] == expected[answer.policy_version]
        seen.add(answer.policy_version)
    assert seen == {0, 1, 2, 3}, f"the race covered too few versions: {sorted(seen)}"
    client.close()


def test_killed_instance_requests_are_reissued_and_no_group_is_lost(tmp_path: Path) -> None:
    """Three subprocess servers; one is SIGKILLed while requests are in flight. Every
    prompt still yields exactly one group of completions, generated by a live instance."""
    model, tokenizer = tiny_model()
    store = store_at(tmp_path)
    publish(store, model, 0)
    servers = LocalServers(3, "transformers", store.storage.uri, log_dir=tmp_path)
    try:
        client = RolloutClient(
            servers.start(), timeout_s=30, probe_every_s=0.2, token=servers.token
        )
        client.wait_ready(120)
        remote = RemoteEngine(client, [tokenizer.eos_token_id], request_prompts=1)
        prompts = [[10 + i, 20 + i, 30 + i] for i in range(24)]
        sampling = SamplingParams(max_new_tokens=48, greedy=True)
        result: dict = {}
        worker = threading.Thread(
            target=lambda: result.setdefault("out", remote.generate(prompts, 2, sampling))
        )
        worker.start()
        deadline = time.monotonic() + 30
        while client.instances[0].in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert client.instances[0].in_flight > 0, "no request reached instance 0"
        servers.kill(0)
        worker.join(timeout=120)
        completions = result["out"]
        assert [c.prompt_index for c in completions] == [i for i in range(24) for _ in range(2)]
        assert client.reissued >= 1
        assert not client.instances[0].healthy
        reference = TransformersEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
        expected = reference.generate(prompts, 2, sampling)
        assert [c.token_ids for c in completions] == [c.token_ids for c in expected]
        client.close()
    finally:
        servers.stop()


def http_json_status(url: str, body=None):
    import json
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def urlopen_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_new_instance_catches_up_from_the_store(tmp_path: Path) -> None:
    """An instance started after versions were published serves the newest one."""
    store = store_at(tmp_path)
    for version in range(3):
        model, tokenizer = tiny_model(seed=version)
        publish(store, model, version)
    assert store.versions() == [0, 1, 2]
    redraw(model, 2)
    with LocalServers(1, "transformers", store.storage.uri, log_dir=tmp_path) as servers:
        client = RolloutClient(servers.start(), timeout_s=60, token=servers.token)
        client.wait_ready(120)
        answer = client.generate(
            GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=[tokenizer.eos_token_id])
        )
        assert answer.policy_version == 2
        assert [c.token_ids for c in answer.completions] == greedy_reference(model, tokenizer)
        client.close()
    # The ready files' folder goes with the servers; the logs stay where they were asked.
    assert not servers._scratch.exists()
    assert (tmp_path / "rollout-0.log").exists()


def test_weights_published_to_s3_reach_new_and_running_instances(
    tmp_path: Path, monkeypatch, bucket: str, s3_env
) -> None:
    """`publication: store` on a real S3 server (SeaweedFS): an instance started later
    catches up from the newest version there, and a POST /weights naming an s3:// URI
    loads that version; a version never published is refused and the old one kept.
    The downloaded copies go once loaded: an instance fetches a version every few steps.
    The endpoint is the job's spec.checkpoint.endpointUrl, not the environment's: the
    store and the servers ignored it, and went to AWS while checkpoints went to it."""
    from rlft.trainer.storage.backends import S3Options
    from rlft.trainer.weights.store import WeightStore

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    s3 = S3Options(endpoint_url=s3_env.endpoint, addressing_style="path")
    server_tmp = tmp_path / "server-tmp"  # where the server subprocess downloads to
    server_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(server_tmp))
    store = WeightStore.at(f"s3://{bucket}/weights", s3=s3)
    for version in range(2):
        model, tokenizer = tiny_model(seed=version)
        publish(store, model, version)
    assert store.versions() == [0, 1]
    stops = [tokenizer.eos_token_id]
    with LocalServers(1, "transformers", store.storage.uri, log_dir=tmp_path, s3=s3) as servers:
        client = RolloutClient(servers.start(), timeout_s=60, token=servers.token)
        client.wait_ready(120)
        answer = client.generate(GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=stops))
        assert answer.policy_version == 1
        assert [c.token_ids for c in answer.completions] == greedy_reference(model, tokenizer)

        redraw(model, 7)
        uri = publish(store, model, 2)
        assert uri.startswith(f"s3://{bucket}/weights/")
        assert client.load_weights(client.instances[0], WeightsRequest(version=2, uri=uri), 60)
        answer = client.generate(GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=stops))
        assert answer.policy_version == 2
        assert [c.token_ids for c in answer.completions] == greedy_reference(model, tokenizer)

        missing = WeightsRequest(version=3, uri=f"s3://{bucket}/weights/v-00000003")
        assert not client.load_weights(client.instances[0], missing, 60)
        health = http_json(f"{client.instances[0].url}/healthz", None, 10)
        assert health["policy_version"] == 2
        assert not list(server_tmp.glob("rlft-weights-*"))
        client.close()


def test_fetched_versions_are_removed_after_use_unless_local(
    tmp_path: Path, monkeypatch, bucket: str, s3_env
) -> None:
    """`fetched` downloads an s3:// version for the block and removes it after, also when
    the block fails; a file:// version is the store's own folder and stays."""
    from rlft.trainer.weights.store import WeightStore, fetched, read_tensors

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint)
    model, _ = tiny_model(seed=3)
    uri = publish(WeightStore.at(f"s3://{bucket}/weights"), model, 0)
    with fetched(uri, scratch=tmp_path) as folder:
        assert folder.parent == tmp_path
        tensors = read_tensors(folder)
        assert torch.equal(
            tensors["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"]
        )
    assert not folder.exists()
    with pytest.raises(RuntimeError, match="engine failed"), fetched(uri, tmp_path) as folder:
        raise RuntimeError("engine failed")
    assert not folder.exists()

    local = publish(store_at(tmp_path), model, 0)
    with fetched(local) as folder:
        assert (folder / "READY").exists()
    assert (folder / "model.safetensors").exists()


def test_versions_cut_short_are_pruned_like_published_ones(tmp_path: Path) -> None:
    """A version whose write stopped before READY (the store failing, the publisher
    killed) is never read, and goes when it falls `keep` versions behind."""
    from rlft.trainer.weights.store import READY, version_key

    store = store_at(tmp_path)
    model, _ = tiny_model(seed=3)
    publish(store, model, 0)
    cut_short = store.storage.root / version_key(1)
    publish(store, model, 1)
    (cut_short / READY).unlink()
    assert store.versions() == [0]
    for version in range(2, 5):
        publish(store, model, version)
    assert store.versions() == [2, 3, 4]  # keep=3
    assert not cut_short.exists()
    assert sorted(p.name for p in store.storage.root.iterdir() if p.is_dir()) == [
        version_key(v) for v in (2, 3, 4)
    ]


def test_weights_published_while_the_store_is_down_arrive_when_it_is_back(
    tmp_path: Path, monkeypatch
) -> None:
    """The store goes down between the publisher's upload of a version and the
    instance's load of it: the load fails on the missing store and the instance is marked
    down. The publisher retries instead of ending the run, asks the instance marked down
    again, and does not count the version as published until it is served; the instance
    serves it once the store is back."""
    from seaweedfs import SeaweedServer

    from rlft.trainer.rollout.publisher import WeightPublisher
    from rlft.trainer.weights.store import WeightStore

    s3 = SeaweedServer(tmp_path / "weed", tmp_path / "weed.log")
    s3.start()
    try:
        for key, value in s3.credentials().items():
            monkeypatch.setenv(key, value)  # the trainer side and the server subprocess
        s3.create_bucket("outage")
        store = WeightStore.at("s3://outage/weights")
        model, _ = tiny_model(seed=0)
        publish(store, model, 0)
        write = store.write

        def write_then_stop_the_store(version: int, weights: bytes, config: str) -> str:
            uri = write(version, weights, config)
            s3.stop()  # the upload went through; the instance's load will not
            return uri

        with LocalServers(1, "transformers", store.storage.uri, log_dir=tmp_path) as servers:
            client = RolloutClient(servers.start(), timeout_s=20, token=servers.token)
            client.wait_ready(120)
            publisher = WeightPublisher(client, store, "store", timeout_s=120)
            store.write = write_then_stop_the_store
            redraw(model, 5)
            publisher.publish(model, 1)
            instance = client.instances[0]
            deadline = time.monotonic() + 60
            while instance.failures == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert instance.failures >= 1, "the load from the stopped store did not fail"
            assert instance.last_error
            time.sleep(3)  # a few more failed attempts
            assert publisher.acked < 1  # a version nobody loaded is not published
            health = http_json(f"{instance.url}/healthz", None, 10)
            assert health["policy_version"] == 0
            s3.start()
            publisher.wait(1, timeout=90)
            health = http_json(f"{instance.url}/healthz", None, 10)
            assert health["policy_version"] == 1
            assert store.versions() == [0, 1]  # written once, not again on each retry
            publisher.close()
            client.close()
    finally:
        s3.stop()


def test_a_load_that_fails_part_way_serves_nothing_until_a_good_one(server, tmp_path) -> None:
    """A load copies the tensors it can, then fails (a tensor of the wrong shape; a set
    of the wrong names is refused before it, test_weight_names.py): the engine holds a
    mix of two versions. It used to go on serving under the
    old version's number; now it serves nothing and reports no version, but still
    answers /healthz, so the next publication reaches it and brings it back."""
    from safetensors.torch import save

    from rlft.trainer.weights.store import config_json, unique_tensors

    model, tokenizer = tiny_model()
    store = store_at(tmp_path)
    client = RolloutClient([server.url], timeout_s=60)
    instance = client.instances[0]
    assert client.load_weights(
        instance, WeightsRequest(version=1, uri=publish(store, model, 1)), 60
    )
    other, _ = tiny_model(seed=1)
    tensors = {k: v.clone() for k, v in unique_tensors(other.state_dict()).items()}
    tensors["model.norm.weight"] = torch.zeros(3)
    uri = store.write(2, save(tensors), config_json(other))
    assert not client.load_weights(instance, WeightsRequest(version=2, uri=uri), 60)
    health = http_json(f"{server.url}/healthz", None, 5)
    assert health["ok"] is True and health["policy_version"] is None
    assert "the load of version 2 failed part-way" in health["reason"]
    request = GenerateRequest(PROMPTS, 1, GREEDY, seed=1, stop_ids=[tokenizer.eos_token_id])
    with pytest.raises(RequestFailed, match=r"HTTP 503.*version 2 failed part-way"):
        http_json(f"{server.url}/generate", request.to_json(), 30)
    assert client.probe(instance)  # answers: a publication goes to it
    assert client.load_weights(
        instance, WeightsRequest(version=3, uri=publish(store, other, 3)), 60
    )
    answer = client.generate(request)
    assert answer.policy_version == 3
    assert [c.token_ids for c in answer.completions] == greedy_reference(other, tokenizer)
    client.close()


def test_sampled_completions_do_not_depend_on_which_instances_are_live(tmp_path) -> None:
    """A request's seed goes with its slice of the prompts, so the slices must not follow
    how many instances answer at that moment: with one of two instances down the same
    call gives the same samples (requests were cut by the live count, and a down instance
    or a resume while one was down sampled other completions)."""
    model, tokenizer = tiny_model()
    uri = publish(store_at(tmp_path), model, 0)
    servers = [ThreadServer(), ThreadServer()]
    client = RolloutClient([s.url for s in servers], timeout_s=30, probe_every_s=60)
    stopped: list[ThreadServer] = []
    try:
        for s in servers:
            http_json(f"{s.url}/weights", {"version": 0, "uri": uri}, 60)
        client.wait_ready(60)
        remote = RemoteEngine(client, [tokenizer.eos_token_id])
        prompts = [[10 + i, 20 + i] for i in range(6)]
        sampling = SamplingParams(max_new_tokens=6, temperature=1.0)

        def sample() -> list[list[int]]:
            generator = torch.Generator().manual_seed(7)
            return [c.token_ids for c in remote.generate(prompts, 2, sampling, generator)]

        both = sample()
        # The fault: the second instance stops (its port refuses connections), and the
        # client's own probe finds it down, as its probe loop would.
        servers[1].stop()
        stopped.append(servers[1])
        assert not client.probe(client.instances[1])
        assert [i.healthy for i in client.instances] == [True, False]
        assert sample() == both
        assert [i.healthy for i in client.instances] == [True, False]
    finally:
        client.close()
        for s in servers:
            if s not in stopped:
                s.stop()


def test_a_generate_request_is_counted_before_its_answer_is_sent(monkeypatch, tmp_path) -> None:
    """A caller that reads /metrics once it has its answer sees the request counted (the
    count came after the reply, and a loaded machine showed it missing)."""
    from rlft.trainer.rollout.server import ServerMetrics

    counted = ServerMetrics.request

    def slowly(self: ServerMetrics, status: str) -> None:
        time.sleep(0.5)  # the handler thread descheduled between reply and count
        counted(self, status)

    monkeypatch.setattr(ServerMetrics, "request", slowly)
    server = ThreadServer()
    try:
        model, tokenizer = tiny_model()
        client = RolloutClient([server.url], timeout_s=60)
        uri = publish(store_at(tmp_path), model, 1)
        assert client.load_weights(client.instances[0], WeightsRequest(version=1, uri=uri), 60)
        client.generate(GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=[tokenizer.eos_token_id]))
        client.close()
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as response:
            assert 'rlft_rollout_requests_total{status="ok"} 1.0' in response.read().decode()
    finally:
        server.stop()
