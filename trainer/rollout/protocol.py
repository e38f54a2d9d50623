"""The rollout protocol's JSON messages, with validation that names the bad field.

One protocol for every engine, so the orchestrator never knows which one it talks to:

- `POST /generate` {prompts: [[int]], n, sampling: {temperature, top_p, max_new_tokens,
  greedy}, seed?, request_id?} → {request_id, policy_version, completions: [{prompt_index,
  token_ids, logprobs, finish_reason, policy_version}], tokens, seconds}
- `POST /weights` {version, uri?, gang?} or {version, broadcast: {address, rank,
  world_size, timeout_s?, group?}, gang?} → {policy_version, seconds}; `group` names the
  group (a new name is a new group, also at the last one's address); `gang` is the
  sender's trainer gang attempt: weights from a gang older than one the instance took
  weights from are refused with 409 (a replaced gang still running, cut off from the
  API server but not from the rollout pods)
- `GET /healthz` → {ok, policy_version, engine, model}; 503 until weights are loaded
- `GET /livez` → {ok, engine}: 200 once the server serves, weights or not
- `GET /metrics` → Prometheus text

The two POSTs change what an instance serves or spend its capacity, so an instance started
with a token (`rlft.trainer.api_token`) answers them only with `Authorization: Bearer
<token>` (401 otherwise); the GETs stay open to the kubelet's probes and to Prometheus.

Pure data, no torch: the orchestrator side imports it too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rlft.trainer.config.rollout import MIN_TEMPERATURE
from rlft.trainer.rollout.engine import Completion, SamplingParams


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text names the field."""


def _int(body: dict, key: str, low: int, high: int, default: int | None = None) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"{key}: must be an integer in [{low}, {high}], got {value!r}")
    return value


def _number(body: dict, key: str, low: float, high: float, default: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high:
        raise ProtocolError(f"sampling.{key}: must be a number in ({low}, {high}], got {value!r}")
    return float(value)


def sampling_to_dict(sampling: SamplingParams) -> dict[str, Any]:
    return asdict(sampling)


def sampling_from_dict(body: Any) -> SamplingParams:
    if not isinstance(body, dict):
        raise ProtocolError("sampling: must be an object")
    unknown = set(body) - {"temperature", "top_p", "max_new_tokens", "greedy"}
    if unknown:
        raise ProtocolError(f"sampling: unknown field(s) {sorted(unknown)}")
    greedy = body.get("greedy", False)
    if not isinstance(greedy, bool):
        raise ProtocolError("sampling.greedy: must be true or false")
    temperature = _number(body, "temperature", 0.0, 10.0, 1.0)
    if temperature < MIN_TEMPERATURE:  # the engine would divide the logits into NaN
        raise ProtocolError(
            f"sampling.temperature: must be at least {MIN_TEMPERATURE} (logits divided by "
            f"less overflow; greedy: true samples greedily), got {temperature!r}"
        )
    return SamplingParams(
        temperature=temperature,
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0),
        max_new_tokens=_int(body, "max_new_tokens", 1, 1_000_000, 16),
        greedy=greedy,
    )


@dataclass
class GenerateRequest:
    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    seed: int | None = None
    """Seeds the engine's sampler for this request (reproducible rollouts)."""
    request_id: str = ""
    stop_ids: list[int] = field(default_factory=list)
    """Tokens that end a completion (the tokenizer's); empty: the model's eos."""

    def to_json(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "n": self.n,
            "sampling": sampling_to_dict(self.sampling),
            "seed": self.seed,
            "request_id": self.request_id,
            "stop_ids": self.stop_ids,
        }

    @classmethod
    def from_json(
        cls, body: Any, vocab_size: int | None = None, max_positions: int | None = None
    ) -> GenerateRequest:
        """The request `body` names; `vocab_size` and `max_positions` (the served model's
        context) bound its tokens where known."""
        if not isinstance(body, dict):
            raise ProtocolError("the request body must be a JSON object")
        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not prompts:
            raise ProtocolError("prompts: must be a non-empty list of token-id lists")
        limit = (vocab_size - 1) if vocab_size else 2**31 - 1
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, list) or not prompt:
                raise ProtocolError(f"prompts[{i}]: must be a non-empty list of token ids")
            if any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= limit for t in prompt
            ):
                raise ProtocolError(f"prompts[{i}]: token ids must be integers in [0, {limit}]")
        seed = body.get("seed")
        if seed is not None:
            _int(body, "seed", 0, 2**63 - 1)
        request_id = body.get("request_id", "")
        if not isinstance(request_id, str) or len(request_id) > 200:
            raise ProtocolError("request_id: must be a string of at most 200 characters")
        stop_ids = body.get("stop_ids") or []
        if not isinstance(stop_ids, list) or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= limit for t in stop_ids
        ):
            raise ProtocolError(f"stop_ids: must be a list of token ids in [0, {limit}]")
        sampling = sampling_from_dict(body.get("sampling", {}))
        if max_positions:
            _check_context(prompts, sampling.max_new_tokens, max_positions)
        return cls(
            prompts=prompts,
            stop_ids=stop_ids,
            n=_int(body, "n", 1, 4096, 1),
            sampling=sampling,
            seed=seed,
            request_id=request_id,
        )


def _check_context(prompts: list[list[int]], max_new_tokens: int, max_positions: int) -> None:
    """Refuse a request the model has no positions for: the engine would fail it (vLLM) or
    sample from positions it was never trained at, on every instance alike."""
    for i, prompt in enumerate(prompts):
        if len(prompt) + max_new_tokens > max_positions:
            raise ProtocolError(
                f"prompts[{i}]: {len(prompt)} tokens + sampling.max_new_tokens "
                f"{max_new_tokens} exceed the model's {max_positions} positions"
            )


def completion_to_json(c: Completion) -> dict[str, Any]:
    return asdict(c)


def completion_from_json(body: dict[str, Any]) -> Completion:
    try:
        return Completion(
            prompt_index=int(body["prompt_index"]),
            token_ids=[int(t) for t in body["token_ids"]],
            logprobs=[float(x) for x in body["logprobs"]],
            finish_reason=body["finish_reason"],
            policy_version=int(body["policy_version"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ProtocolError(f"completion: malformed ({error})") from None


@dataclass
class WeightsRequest:
    version: int
    uri: str | None = None
    """Folder (file:// or s3://) of the Hugging Face safetensors of `version`."""
    broadcast: dict[str, Any] | None = None
    """Join the trainer's torch.distributed group: address, rank, world_size."""
    gang: int | None = None
    """The sender's trainer gang attempt (`$RLFT_GANG_ATTEMPT`; None: a local run)."""

    def to_json(self) -> dict[str, Any]:
        body = {"version": self.version, "uri": self.uri, "broadcast": self.broadcast}
        return body if self.gang is None else {**body, "gang": self.gang}

    @classmethod
    def from_json(cls, body: Any) -> WeightsRequest:
        if not isinstance(body, dict):
            raise ProtocolError("the request body must be a JSON object")
        version = _int(body, "version", 0, 2**62)
        uri, broadcast = body.get("uri"), body.get("broadcast")
        if (uri is None) == (broadcast is None):
            raise ProtocolError("weights: give exactly one of uri and broadcast")
        if uri is not None and (not isinstance(uri, str) or not uri):
            raise ProtocolError("uri: must be a non-empty string (file:///… or s3://…)")
        if broadcast is not None:
            if not isinstance(broadcast, dict):
                raise ProtocolError("broadcast: must be an object")
            address = broadcast.get("address")
            if not isinstance(address, str) or ":" not in address:
                raise ProtocolError("broadcast.address: must be host:port")
            world = _int(broadcast, "world_size", 2, 4096)
            rank = _int(broadcast, "rank", 1, 4095)
            if rank >= world:
                raise ProtocolError(f"broadcast.rank: {rank} must be < world_size {world}")
            if not isinstance(broadcast.get("group", ""), str):
                raise ProtocolError("broadcast.group: must be a string")
        gang = None if body.get("gang") is None else _int(body, "gang", 0, 2**62)
        return cls(version=version, uri=uri, broadcast=broadcast, gang=gang)


class SupersededGangError(RuntimeError):
    """Weights from a trainer gang older than one the instance already took weights from:
    a newer gang of the job replaced the sender (HTTP 409)."""
