"""Models built on several threads at once (rollout engines loading their first weights
in their handler threads, a model built beside a load) come out as they would alone.

transformers swaps `PreTrainedModel.tie_weights` and `init_weights` for no-ops on the
class while `from_pretrained` builds: unguarded, about one model in ten built beside a
load came out with its embeddings untied (an FSDP2 resume in the test suite then failed
on an optimizer tensor the checkpoint lacked), and overlapping loads could leave tying
off for the rest of the process."""

from __future__ import annotations

import threading

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from rlft.trainer.model.construct import from_config, from_pretrained

ORIGINAL = (PreTrainedModel.tie_weights, PreTrainedModel.init_weights)


def _config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        head_dim=16,
        tie_word_embeddings=True,
    )


def _tied(model: torch.nn.Module) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def test_models_built_beside_loads_on_other_threads_are_tied(tmp_path):
    from_config(AutoModelForCausalLM, _config()).save_pretrained(tmp_path)
    stop = threading.Event()
    errors: list[BaseException] = []

    def keep_loading() -> None:
        try:
            while not stop.is_set():
                assert _tied(from_pretrained(AutoModelForCausalLM, tmp_path))
        except BaseException as error:  # reported by the test, not lost on the thread
            errors.append(error)

    loaders = [threading.Thread(target=keep_loading, daemon=True) for _ in range(2)]
    for loader in loaders:
        loader.start()
    try:
        untied = sum(not _tied(from_config(AutoModelForCausalLM, _config())) for _ in range(150))
    finally:
        stop.set()
        for loader in loaders:
            loader.join(timeout=60)
    assert not errors, errors
    assert untied == 0, f"{untied} of 150 models built beside loads came out untied"
    assert (PreTrainedModel.tie_weights, PreTrainedModel.init_weights) == ORIGINAL
