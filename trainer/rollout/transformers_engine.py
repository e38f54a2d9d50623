"""A small in-process engine on transformers models: for the CPU, tests and fallback.

It runs its own sampling loop over the model's KV cache (rather than `generate()`) so
that it returns exactly the per-token log-probs of the distribution it sampled from.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from rlft.trainer.algorithms.prefix import cache_argument
from rlft.trainer.rollout.engine import Completion, SamplingParams


class TransformersEngine:
    def __init__(self, model: PreTrainedModel, pad_id: int, stop_ids: list[int]):
        self.model = model
        self.pad_id = pad_id
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long)
        self.policy_version = 0
        self._cache_arg = cache_argument(model)

    def set_policy_version(self, version: int) -> None:
        """The model is shared with the trainer: its weights are always the latest ones."""
        self.policy_version = version

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[Completion]:
        """`n` completions per prompt, grouped: all of prompt 0's first, then prompt 1's."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rows = [p for p in prompts for _ in range(n)]
        input_ids, attention = _left_pad(prompts, self.pad_id)
        was_training = self.model.training
        self.model.eval()
        try:
            tokens, logprobs, finished_at = self._sample(
                input_ids, attention, n, sampling, generator
            )
        finally:
            self.model.train(was_training)
        completions = []
        for row in range(len(rows)):
            end = int(finished_at[row])
            stopped = end >= 0
            length = end + 1 if stopped else tokens.shape[1]
            completions.append(
                Completion(
                    prompt_index=row // n,
                    token_ids=tokens[row, :length].tolist(),
                    logprobs=logprobs[row, :length].tolist(),
                    finish_reason="stop" if stopped else "length",
                    policy_version=self.policy_version,
                )
            )
        return completions

    def _sample(
        self,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        n: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each prompt is read once; its KV cache is then copied for its `n` rows."""
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = getattr(out, self._cache_arg)
        logits = out.logits[:, -1, :]
        next_position = positions[:, -1:] + 1
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            attention = attention.repeat_interleave(n, dim=0)
            next_position = next_position.repeat_interleave(n, dim=0)
        batch = logits.shape[0]
        finished_at = torch.full((batch,), -1, dtype=torch.long)
        all_tokens, all_logprobs = [], []
        for step in range(sampling.max_new_tokens):
            logp = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)
            token = _choose(logp, sampling, generator)
            done = finished_at >= 0
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            all_tokens.append(token)
            all_logprobs.append(torch.where(done, 0.0, logp.gather(-1, token[:, None]).squeeze(-1)))
            newly = ~done & torch.isin(token, self.stop_ids)
            finished_at[newly] = step
            if bool((finished_at >= 0).all()) or step == sampling.max_new_tokens - 1:
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=next_position,
                use_cache=True,
                **{self._cache_arg: cache},
            )
            cache = getattr(out, self._cache_arg)
            logits = out.logits[:, -1, :]
            next_position = next_position + 1
        return torch.stack(all_tokens, 1), torch.stack(all_logprobs, 1), finished_at


def _choose(
    logp: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    if sampling.greedy:
        return logp.argmax(-1)
    probs = logp.exp()
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > sampling.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask
