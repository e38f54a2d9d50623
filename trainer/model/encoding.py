"""Text ↔ token ids for prompts and answers, the same for every phase of a job."""

from __future__ import annotations

from dataclasses import dataclass

from rlft.trainer.config import DataSpec


@dataclass
class Encoder:
    tokenizer: object
    data: DataSpec
    stop_id: int

    @property
    def chat(self) -> bool:
        return self.data.source == "jsonl" and self.data.jsonl is not None and self.data.jsonl.chat

    def prompt(self, text: str) -> list[int]:
        if self.chat:
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_lengths(self, texts: list[str]) -> list[int]:
        """The token count of each prompt, in one batch call where no chat template
        applies (a dataset's check at the start: seconds, not minutes)."""
        if self.chat or not texts:
            return [len(self.prompt(text)) for text in texts]
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def answer(self, text: str) -> list[int]:
        """The answer's tokens followed by the stop token (what SFT and DPO train on)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop_id]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id
