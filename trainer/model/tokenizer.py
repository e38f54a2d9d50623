"""Offline tokenizers for models built from config: nothing is downloaded.

`bpe` trains a byte-level BPE on the task's own text in a fraction of a second, with
digits split into single tokens (merging digits makes arithmetic needlessly hard);
`byte` is the same machinery with no merges at all, one token per byte.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlft.trainer.config import TokenizerSpec

PAD = "<|pad|>"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD, EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BYTE_ALPHABET_SIZE = 256


def build_tokenizer(spec: TokenizerSpec, corpus: Iterable[str]) -> PreTrainedTokenizerFast:
    """Train (or, for `byte`, just assemble) a tokenizer and wrap it for transformers."""
    core = Tokenizer(models.BPE(unk_token=None, fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    core.decoder = decoders.ByteLevel()
    vocab_size = spec.vocab_size if spec.kind == "bpe" else BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus if spec.kind == "bpe" else [], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Token ids that end a completion: end-of-text and, for chat, end-of-turn."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)
