"""A weight set that is not the served model's (a tensor missing, or one it lacks) is
refused before any tensor is copied: the server goes on serving the version it had,
intact, and says why. Loaded as it was, the missing tensors kept their old values under
the new version's number (vLLM's reload takes any subset of names: see
test_rollout_vllm.py for that engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rollout_fixtures import PROMPTS, ThreadServer, publish, redraw, store_at, tiny_model

from rlft.trainer.rollout.client import RequestFailed, http_json
from rlft.trainer.weights.store import config_json, save_safetensors, unique_tensors

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = {"max_new_tokens": 6, "greedy": True}


def _greedy(url: str) -> tuple[list[list[int]], int]:
    body = {"prompts": PROMPTS, "n": 1, "sampling": GREEDY}
    answer = http_json(f"{url}/generate", body, 60)
    return [c["token_ids"] for c in answer["completions"]], answer["policy_version"]


@pytest.mark.parametrize("fault", ["missing", "unknown"])
def test_a_weight_set_that_is_not_the_models_is_refused_and_the_served_one_stays(
    tmp_path: Path, fault: str
) -> None:
    model, _ = tiny_model()
    store = store_at(tmp_path)
    server = ThreadServer()
    try:
        http_json(f"{server.url}/weights", {"version": 0, "uri": publish(store, model, 0)}, 60)
        served, version = _greedy(server.url)
        assert version == 0
        redraw(model, 1)
        tensors = unique_tensors(model.state_dict())
        if fault == "missing":
            del tensors["model.layers.0.mlp.down_proj.weight"]
        else:
            tensors["model.layers.9.mlp.down_proj.weight"] = torch.zeros(2, 2)
        uri = store.write(1, save_safetensors(tensors), config_json(model))
        with pytest.raises(RequestFailed) as refused:
            http_json(f"{server.url}/weights", {"version": 1, "uri": uri}, 60)
        expected = "lack 1 tensor(s)" if fault == "missing" else "name 1 tensor(s)"
        assert expected in str(refused.value) and "WeightNamesError" in str(refused.value)
        # Not damaged: the same version, the same weights, still served.
        assert _greedy(server.url) == (served, 0)
        assert http_json(f"{server.url}/healthz", None, 10)["policy_version"] == 0
        http_json(f"{server.url}/weights", {"version": 2, "uri": publish(store, model, 2)}, 60)
        changed, version = _greedy(server.url)
        assert version == 2 and changed != served
    finally:
        server.stop()


def test_a_tied_models_output_layer_may_be_left_out():
    """A publisher writes a tied alias once (the embeddings): that is the whole set."""
    from rlft.trainer.rollout.engine import WeightNamesError, check_names

    names = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    check_names(names, names - {"lm_head.weight"}, tied=True)
    with pytest.raises(WeightNamesError, match=r"'lm_head\.weight'"):
        check_names(names, names - {"lm_head.weight"}, tied=False)
