"""The offline tokenizers: `bpe` (trained in-process) and `byte`."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rlft.trainer.config import ArithmeticTask, TokenizerSpec
from rlft.trainer.data.arithmetic import ArithmeticProblems
from rlft.trainer.model.tokenizer import (
    BYTE_ALPHABET_SIZE,
    EOS,
    IM_END,
    IM_START,
    PAD,
    SPECIAL_TOKENS,
    build_tokenizer,
    stop_token_ids,
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a tokenizer learns merges from the text it is given",
    "12345+67890=80235",
    "héllo wörld, naïve café",
] * 40


@pytest.fixture(scope="module", params=["bpe", "byte"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    return build_tokenizer(TokenizerSpec(kind=request.param, vocab_size=320), CORPUS)


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerBase:
    return build_tokenizer(TokenizerSpec(kind="bpe", vocab_size=320), CORPUS)


@pytest.fixture(scope="module")
def byte() -> PreTrainedTokenizerBase:
    return build_tokenizer(TokenizerSpec(kind="byte"), CORPUS)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_vocabulary_sizes(bpe: PreTrainedTokenizerBase, byte: PreTrainedTokenizerBase) -> None:
    assert len(byte) == BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    assert len(byte) < len(bpe) <= 320
    # bpe learned merges from its corpus; byte has one token per byte.
    assert len(encode(bpe, "the quick brown fox")) < len(encode(byte, "the quick brown fox"))
    assert len(encode(byte, "the quick brown fox")) == len(b"the quick brown fox")


def test_bpe_vocab_size_is_respected() -> None:
    small = build_tokenizer(TokenizerSpec(kind="bpe", vocab_size=270), CORPUS)
    assert len(small) == 270


def test_arithmetic_corpus_builds(bpe: PreTrainedTokenizerBase) -> None:
    task = ArithmeticProblems(ArithmeticTask(digits=3), seed=0)
    tokenizer = build_tokenizer(TokenizerSpec(kind="bpe", vocab_size=300), task.corpus())
    assert tokenizer.decode(encode(tokenizer, "123+456=579")) == "123+456=579"


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_round_trip_arbitrary_text(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = encode(tokenizer, text)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "text",
    ["", " ", "  a\n\tb  ", "日本語のテキスト", "emoji 🎉🧪", "x\x00y", "Ünïcödé ß", " 12 , 3 "],
)
def test_round_trip_examples(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    assert tokenizer.decode(encode(tokenizer, text)) == text


@settings(max_examples=50, deadline=None)
@given(number=st.integers(min_value=0, max_value=10**30))
def test_digits_are_single_tokens(tokenizer: PreTrainedTokenizerBase, number: int) -> None:
    text = str(number)
    ids = encode(tokenizer, text)
    assert len(ids) == len(text)
    assert [tokenizer.decode([i]) for i in ids] == list(text)


def test_digits_are_single_tokens_in_context(bpe: PreTrainedTokenizerBase) -> None:
    # The corpus repeats "12345+67890=80235": merges of digits would be learned without
    # the Digits pre-tokenizer.
    ids = encode(bpe, "12345+67890=80235")
    pieces = [bpe.decode([i]) for i in ids]
    assert pieces == list("12345+67890=80235")
    assert len({encode(bpe, d)[0] for d in "0123456789"}) == 10


def test_special_tokens_have_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (PAD, EOS, IM_START, IM_END)]
    assert all(isinstance(i, int) for i in ids)
    assert len(set(ids)) == 4
    assert tokenizer.pad_token == PAD and tokenizer.pad_token_id == ids[0]
    assert tokenizer.eos_token == EOS and tokenizer.eos_token_id == ids[1]
    assert tokenizer.padding_side == "left"
    # A special token in text is one token, not its characters.
    assert encode(tokenizer, f"a{IM_END}") == [*encode(tokenizer, "a"), ids[3]]
    assert stop_token_ids(tokenizer) == sorted([ids[1], ids[3]])


def test_special_tokens_are_skipped_on_request(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [*encode(tokenizer, "42"), tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "42"
    assert tokenizer.decode(ids) == f"42{EOS}"


def test_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt.endswith(f"{IM_START}assistant\n")
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not closed.endswith(f"{IM_START}assistant\n")
    assert prompt == closed + f"{IM_START}assistant\n"

    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(ids) == encode(tokenizer, prompt)
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == 3
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_END)) == 2


SAMPLES = [
    "123+456=579",
    "the quick brown fox",
    "héllo wörld 日本 🎉",
    f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n",
    f"done{EOS}",
    "  spaced   out  ",
]


def test_save_pretrained_round_trip(tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in SAMPLES:
        assert encode(loaded, text) == encode(tokenizer, text), text
        assert loaded.decode(encode(loaded, text)) == text
    assert len(loaded) == len(tokenizer)
    assert loaded.pad_token_id == tokenizer.pad_token_id
    assert loaded.eos_token_id == tokenizer.eos_token_id
    assert loaded.padding_side == "left"
    assert loaded.chat_template == tokenizer.chat_template
    assert stop_token_ids(loaded) == stop_token_ids(tokenizer)
    batch = loaded(["1", "123"], add_special_tokens=False, padding=True)
    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2  # padded on the left
