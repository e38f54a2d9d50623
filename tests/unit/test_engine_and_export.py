"""The in-process rollout engine on tiny random models, and export to a Hugging Face folder.

Each family (dense qwen3, qwen3-moe, llama) is built through the package's own config
models. The models' weights are re-drawn with a larger spread than transformers' init:
with tied embeddings and the default 0.02 init, a random model just repeats its input
token, which would make greedy comparisons vacuous.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rlft.trainer.config import ModelInit, ModelSpec, TokenizerSpec
from rlft.trainer.model.build import ModelLoadError, build_policy, count_parameters
from rlft.trainer.model.construct import from_pretrained
from rlft.trainer.model.tokenizer import stop_token_ids
from rlft.trainer.rollout import Completion, SamplingParams, TransformersEngine

FAMILIES = ["qwen3", "qwen3-moe", "llama"]
MAX_NEW = 10
# Left-padded prompts of different lengths (ids of the 260-token byte tokenizer).
PROMPTS = [[40, 41, 42, 43, 44], [17], [100, 7, 250, 9, 31, 77, 5, 200], [60, 61, 62]]


def tiny_spec(family: str) -> ModelSpec:
    return ModelSpec(
        init=ModelInit(
            family=family,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=64,
            num_experts=4,
            experts_per_token=2,
            moe_intermediate_size=16,
            max_position_embeddings=64,
        ),
        tokenizer=TokenizerSpec(kind="byte"),
    )


@pytest.fixture(scope="module", params=FAMILIES)
def policy(request: pytest.FixtureRequest):
    model, tokenizer = build_policy(tiny_spec(request.param), corpus=[], seed=0)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return request.param, model, tokenizer


def engine_of(model: PreTrainedModel, tokenizer, stop_ids: list[int] | None = None):
    stops = stop_token_ids(tokenizer) if stop_ids is None else stop_ids
    return TransformersEngine(model, tokenizer.pad_token_id, stops)


def greedy(max_new: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, greedy=True)


def full_forward_logprobs(
    model: PreTrainedModel, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token, from one unpadded forward pass."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
    finally:
        model.train(was_training)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return logp[positions, torch.tensor(completion)]


def truncate_at_stop(tokens: list[int], stops: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


def test_tiny_model_is_built_as_configured(policy) -> None:
    family, model, tokenizer = policy
    expected = {"qwen3": "Qwen3", "qwen3-moe": "Qwen3Moe", "llama": "Llama"}[family]
    assert type(model).__name__ == f"{expected}ForCausalLM"
    assert model.config.hidden_size == 32
    assert model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert 0 < count_parameters(model) < 200_000
    if family == "qwen3-moe":
        assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2


def test_build_policy_is_seeded() -> None:
    first, _ = build_policy(tiny_spec("qwen3"), corpus=[], seed=7)
    second, _ = build_policy(tiny_spec("qwen3"), corpus=[], seed=7)
    other, _ = build_policy(tiny_spec("qwen3"), corpus=[], seed=8)
    a, b, c = (dict(m.named_parameters()) for m in (first, second, other))
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not all(torch.equal(a[name], c[name]) for name in a)


def test_greedy_matches_transformers_generate(policy) -> None:
    _, model, tokenizer = policy
    eos = tokenizer.eos_token_id
    # First without a reachable stop token, to choose one the model really emits.
    free = engine_of(model, tokenizer, [eos]).generate(PROMPTS, 1, greedy())
    assert len({tuple(c.token_ids) for c in free}) > 1, "the random model is degenerate"
    stop = free[0].token_ids[3]
    stops = [eos, stop]

    completions = engine_of(model, tokenizer, stops).generate(PROMPTS, 1, greedy())
    assert model.training, "generate() must restore training mode"

    width = max(len(p) for p in PROMPTS)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in PROMPTS])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    model.eval()
    try:
        reference = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=stops,
            pad_token_id=pad,
        )[:, width:]
    finally:
        model.train()

    finished = 0
    for row, completion in enumerate(completions):
        hf = reference[row].tolist()
        assert completion.token_ids == truncate_at_stop(free[row].token_ids, set(stops))
        assert hf[: len(completion.token_ids)] == completion.token_ids, row
        if completion.finish_reason == "stop":
            finished += 1
            assert completion.token_ids[-1] in stops
            assert all(t == pad for t in hf[len(completion.token_ids) :])
        else:
            assert completion.finish_reason == "length"
            assert len(completion.token_ids) == MAX_NEW
            assert not set(completion.token_ids) & set(stops)
    assert completions[0].finish_reason == "stop"
    assert len(completions[0].token_ids) <= 4
    assert finished >= 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_a_full_forward_pass(policy, temperature: float) -> None:
    _, model, tokenizer = policy
    engine = engine_of(model, tokenizer)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW)
    generator = torch.Generator().manual_seed(5)
    completions = engine.generate(PROMPTS, 2, sampling, generator)
    assert len(completions) == 2 * len(PROMPTS)
    for completion in completions:
        prompt = PROMPTS[completion.prompt_index]
        assert len(completion.logprobs) == len(completion.token_ids) > 0
        expected = full_forward_logprobs(model, prompt, completion.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)
        assert all(lp <= 0 for lp in completion.logprobs)


def test_greedy_logprobs_match_a_full_forward_pass(policy) -> None:
    _, model, tokenizer = policy
    for completion in engine_of(model, tokenizer).generate(PROMPTS, 1, greedy()):
        prompt = PROMPTS[completion.prompt_index]
        expected = full_forward_logprobs(model, prompt, completion.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)


def test_finish_reasons(policy) -> None:
    _, model, tokenizer = policy
    eos = tokenizer.eos_token_id
    (free,) = engine_of(model, tokenizer, [eos]).generate([PROMPTS[2]], 1, greedy())
    assert free.finish_reason == "length"
    assert len(free.token_ids) == MAX_NEW and eos not in free.token_ids
    # The very first token is a stop token: a one-token completion that includes it.
    first = free.token_ids[0]
    (stopped,) = engine_of(model, tokenizer, [first]).generate([PROMPTS[2]], 1, greedy())
    assert stopped.token_ids == [first]
    assert stopped.finish_reason == "stop"
    assert len(stopped.logprobs) == 1
    # A stop token at the last allowed step still counts as "stop".
    last = free.token_ids[-1]
    assert last not in free.token_ids[:-1]  # true for these seeds; keeps the case meaningful
    (at_end,) = engine_of(model, tokenizer, [last]).generate([PROMPTS[2]], 1, greedy())
    assert at_end.finish_reason == "stop"
    assert at_end.token_ids == free.token_ids
    # No stop token: cut at max_new_tokens.
    (cut,) = engine_of(model, tokenizer, [eos]).generate([PROMPTS[2]], 1, greedy(max_new=3))
    assert cut.finish_reason == "length"
    assert cut.token_ids == free.token_ids[:3]
    assert len(cut.logprobs) == 3


def test_n_completions_are_grouped_in_prompt_order(policy) -> None:
    _, model, tokenizer = policy
    engine = engine_of(model, tokenizer)
    single = engine.generate(PROMPTS, 1, greedy())
    grouped = engine.generate(PROMPTS, 3, greedy())
    assert [c.prompt_index for c in grouped] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for i, completion in enumerate(grouped):
        # Greedy: every member of a group is that prompt's single greedy completion.
        assert completion.token_ids == single[i // 3].token_ids
        torch.testing.assert_close(
            torch.tensor(completion.logprobs),
            torch.tensor(single[i // 3].logprobs),
            rtol=0,
            atol=1e-5,
        )

    sampled = engine.generate(PROMPTS, 4, SamplingParams(), torch.Generator().manual_seed(0))
    assert [c.prompt_index for c in sampled] == [i for i in range(len(PROMPTS)) for _ in range(4)]


def test_same_generator_seed_gives_same_samples(policy) -> None:
    _, model, tokenizer = policy
    engine = engine_of(model, tokenizer)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)

    def sample(seed: int) -> list[Completion]:
        return engine.generate(PROMPTS, 2, sampling, torch.Generator().manual_seed(seed))

    first, again, other = sample(11), sample(11), sample(12)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    # Sampling at temperature 1 is not greedy decoding.
    greedy_ids = [c.token_ids for c in engine.generate(PROMPTS, 2, greedy())]
    assert [c.token_ids for c in first] != greedy_ids


def test_tiny_top_p_is_greedy(policy) -> None:
    _, model, tokenizer = policy
    engine = engine_of(model, tokenizer)
    nucleus = SamplingParams(top_p=1e-6, max_new_tokens=MAX_NEW)
    sampled = engine.generate(PROMPTS, 2, nucleus, torch.Generator().manual_seed(3))
    decoded = engine.generate(PROMPTS, 2, greedy())
    assert [c.token_ids for c in sampled] == [c.token_ids for c in decoded]


def test_sampled_tokens_follow_the_probabilities_and_skip_impossible_ones() -> None:
    """The sampler draws each token as often as its probability says, and never one of
    probability 0 (masked by -inf or cut by top-p)."""
    from rlft.trainer.rollout.transformers_engine import _choose

    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    rows = 100_000
    logp = probs.log().repeat(rows, 1)
    generator = torch.Generator().manual_seed(0)
    tokens = _choose(logp, SamplingParams(), generator)
    frequency = torch.bincount(tokens, minlength=len(probs)) / rows
    # 5 standard deviations of a frequency of 100k draws is below 0.008
    torch.testing.assert_close(frequency, probs, atol=0.008, rtol=0)
    assert frequency[1] == 0 and frequency[5] == 0
    nucleus = _choose(logp, SamplingParams(top_p=0.7), generator)
    assert set(nucleus.tolist()) == {0, 2}  # 0.5 + 0.3 reach 0.7; the rest are cut


def test_policy_version_is_reported(policy) -> None:
    _, model, tokenizer = policy
    engine = engine_of(model, tokenizer)
    assert {c.policy_version for c in engine.generate(PROMPTS[:1], 2, greedy(2))} == {0}
    engine.set_policy_version(7)
    assert {c.policy_version for c in engine.generate(PROMPTS[:1], 2, greedy(2))} == {7}


@pytest.mark.parametrize("prompts", [[], [[5], []]], ids=["no-prompts", "empty-prompt"])
def test_prompts_need_tokens(policy, prompts: list[list[int]]) -> None:
    _, model, tokenizer = policy
    with pytest.raises(ValueError, match="at least one token"):
        engine_of(model, tokenizer).generate(prompts, 1, greedy())


# ------------------------------------------------------------------------- export


def test_export_and_reload_gives_the_same_greedy_tokens(policy, tmp_path: Path) -> None:
    _, model, tokenizer = policy
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").is_file()
    assert list(tmp_path.glob("*.safetensors"))

    reloaded = from_pretrained(AutoModelForCausalLM, tmp_path, local_files_only=True)
    loaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert type(reloaded) is type(model)
    assert count_parameters(reloaded) == count_parameters(model)

    original = engine_of(model, tokenizer).generate(PROMPTS, 1, greedy())
    again = engine_of(reloaded, loaded_tokenizer).generate(PROMPTS, 1, greedy())
    assert [c.token_ids for c in again] == [c.token_ids for c in original]
    assert [c.finish_reason for c in again] == [c.finish_reason for c in original]

    text = "123+456="
    ids = loaded_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    model.eval()
    reloaded.eval()
    try:
        with torch.no_grad():
            torch.testing.assert_close(
                reloaded(input_ids=torch.tensor([ids])).logits,
                model(input_ids=torch.tensor([ids])).logits,
                rtol=0,
                atol=1e-5,
            )
    finally:
        model.train()


def test_exported_folder_loads_as_spec_model_path(policy, tmp_path: Path) -> None:
    _, model, tokenizer = policy
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = build_policy(ModelSpec(path=str(tmp_path)), corpus=[], seed=0)
    assert loaded_tokenizer.padding_side == "left"
    assert loaded_tokenizer.pad_token_id == tokenizer.pad_token_id
    original = engine_of(model, tokenizer).generate(PROMPTS, 1, greedy())
    again = engine_of(loaded, loaded_tokenizer).generate(PROMPTS, 1, greedy())
    assert [c.token_ids for c in again] == [c.token_ids for c in original]


def test_model_path_without_config_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"spec\.model\.path: .*\(no config\.json\)"):
        build_policy(ModelSpec(path=str(tmp_path)), corpus=[], seed=0)


def test_published_configs_hold_no_local_path(tmp_path: Path) -> None:
    """The config of each published weight version carried `_name_or_path`: the trainer's
    local folder of the model, in a store every rollout pod reads."""
    import json

    from rlft.trainer.weights.store import config_json

    model, _ = build_policy(tiny_spec("qwen3"), corpus=[], seed=0)
    folder = tmp_path / "private-models" / "mine"
    model.save_pretrained(folder)
    loaded = from_pretrained(AutoModelForCausalLM, folder)
    text = config_json(loaded)
    assert "private-models" not in text and "_name_or_path" not in json.loads(text)
    assert json.loads(text)["architectures"] == [type(loaded).__name__]
