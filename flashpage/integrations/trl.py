"""flashpage as TRL's generation backend: GRPO rollouts on the trainer's own weights.

One line switches it on::

    from flashpage.integrations.trl import flashpage_rollout
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          rollout_func=flashpage_rollout())

Each rollout runs :class:`flashpage.LLM` on ``trainer.model`` itself, unwrapped as TRL unwraps it
for generation (DDP/DeepSpeed/FSDP; a PEFT model runs with its LoRA layers, unmerged): nothing to
sync after an optimizer step, no second copy of the weights. A prompt that TRL's sampler repeated
``num_generations`` times becomes one request with ``n=num_generations``, whose samples share the
prompt's KV pages (copy-on-write). Vision-language models: TRL passes each prompt as a conversation whose
image parts carry the images (``{"type": "image", "image": PIL}``); each distinct prompt goes through the
trainer's processor once (its chat template, as TRL's own ``_tokenize_prompts``) and reaches the engine as
``{"prompt_token_ids": ids, "multi_modal_data": {"image": processor outputs}}``, the engine's pre-processed image
form (TRL's vLLM backend sends vLLM the same ids with the images). The trainer's generation settings are
applied (temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length, its EOS ids and the
``generation_kwargs`` flashpage understands). The returned logprobs are, per sampled token,
``log_softmax(logits / temperature)``: what GRPOTrainer recomputes for the importance-sampling
ratio. The model's train/eval mode (module by module) and its patch state are restored after the
rollout. The KV pool is released after every rollout by default (``release_kv=True``) so training
gets the memory back; the next rollout makes a pool sized for its own prompts.

Needs TRL >= 1.0 (``pip install 'flashpage[rl]'``): from 1.0 on ``GRPOTrainer`` calls
``rollout_func(prompts, trainer)`` whatever the generation backend; 0.2x releases call it only
from inside their vLLM backend (``use_vllm=True``). Checked with TRL 1.16.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from flashpage.cache import default_block_size
from flashpage.engine.llm import LLM
from flashpage.engine.outputs import RequestOutput
from flashpage.engine.params import SamplingParams
from flashpage.errors import install_hint
from flashpage.patches import is_patched, unpatch

MIN_TRL = "1.0.0"
_INSTALL = install_hint("'trl>=1.0' peft", "rl")
# generation_kwargs (GRPOConfig.generation_kwargs) that map onto SamplingParams; others are refused
_KWARGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
           "min_new_tokens": "min_tokens", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "stop_strings": "stop", "seed": "seed"}
_IGNORED = {"do_sample", "pad_token_id", "bos_token_id", "cache_implementation", "eos_token_id"}


def check_trl() -> str:
    """The installed TRL's version, or ImportError saying which versions have the hook and how to get one."""
    try:
        import trl
    except ImportError as e:
        raise ImportError(f"flashpage.integrations.trl needs TRL: {_INSTALL}") from e
    from packaging.version import Version

    version = str(trl.__version__)
    if Version(version) < Version(MIN_TRL):
        raise ImportError(
            f"flashpage.integrations.trl needs TRL >= {MIN_TRL}; found trl {version}. TRL < 1.0 calls "
            "GRPOTrainer(rollout_func=...) only from inside its vLLM backend (use_vllm=True), and releases before "
            f"0.24 have no rollout_func at all. Upgrade: {_INSTALL}")
    from trl import GRPOTrainer

    if "rollout_func" not in inspect.signature(GRPOTrainer.__init__).parameters:
        raise ImportError(
            f"trl {version}: GRPOTrainer has no rollout_func parameter (it was experimental in TRL 1.0 - 1.16, "
            "which flashpage supports); install one of those: pip install 'trl>=1.0,<=1.16'")
    return version


@dataclass
class RolloutStats:
    """What the rollouts did (cumulative).

    Attributes:
        rollouts: calls so far. samples: completions returned. engines_built: LLMs (KV pools) made.
        kv_bytes_peak: the largest KV pool made. seconds: time inside generate().
    """

    rollouts: int = 0
    samples: int = 0
    engines_built: int = 0
    kv_bytes_peak: int = 0
    seconds: float = 0.0


@dataclass
class FlashpageRollout:
    """A TRL ``rollout_func``: ``GRPOTrainer(..., rollout_func=FlashpageRollout())``.

    Args:
        release_kv: drop the KV pool after each rollout (default; the memory goes back to training),
            else keep the engine and its pool for the next rollout (rebuilt when a rollout needs more).
        block_size: tokens per KV page (default: flashpage's for the model's device).
        max_num_batched_tokens: tokens per engine step at most (long prompt batches are chunked).
        compile: ``LLM(compile=...)``; default off: with ``release_kv`` every rollout makes a new engine,
            whose compiled graphs (CUDA graphs included) would be built again each time and would keep
            the released pool alive. ``compile=None`` takes LLM's default (on for CUDA); best with
            ``release_kv=False``.
        logprobs: "trainer" (default): ``log_softmax(logits / temperature)`` of each sampled token, what
            GRPOTrainer recomputes; "raw": ``log_softmax(logits)``.
    """

    release_kv: bool = True
    block_size: int | None = None
    max_num_batched_tokens: int = 4096
    compile: bool | None = False
    logprobs: str = "trainer"
    stats: RolloutStats = field(default_factory=RolloutStats)
    _llm: LLM | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.logprobs not in ("trainer", "raw"):
            raise ValueError(f"FlashpageRollout(logprobs={self.logprobs!r}): use 'trainer' or 'raw'")

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        """TRL's hook: ``prompts`` as the trainer holds them (each repeated per generation), one completion
        per entry back: ``{"prompt_ids", "completion_ids", "logprobs"}`` (lists of int / float lists); prompts
        with images come back with their image tokens expanded, as TRL's own tokenization gives them."""
        check_trl()
        runs = group_repeats(prompts)
        params = [sampling_params(trainer, n) for _, n in runs]
        import time

        with generation_model(trainer) as model, restored(model):
            prompt_ids, requests = rollout_requests(trainer, runs, model)
            llm = self._engine(model, prompt_ids, params)
            start = time.perf_counter()
            try:
                outputs = llm.generate(requests, params, use_tqdm=False)
            finally:
                if self.release_kv:
                    self._llm = None
            self.stats.seconds += time.perf_counter() - start
        result = to_trl(prompt_ids, outputs)
        self.stats.rollouts += 1
        self.stats.samples += len(result["completion_ids"])
        return result

    def _engine(self, model: torch.nn.Module, prompt_ids: list[list[int]], params: list[SamplingParams]) -> LLM:
        device = next(model.parameters()).device
        block_size = self.block_size or default_block_size(device)
        need = kv_blocks_needed(prompt_ids, params, block_size)
        samples = sum(p.n for p in params)
        longest = max(len(ids) + p.max_tokens for ids, p in zip(prompt_ids, params, strict=True))
        positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        max_len = min(longest, positions) if positions else longest
        llm = self._llm
        if llm is not None and llm.model is model and llm.kv.num_blocks >= need \
                and llm.scheduler.max_num_seqs >= samples and llm.max_model_len >= max_len:
            return llm
        self._llm = None  # free the old pool before making the new one
        llm = LLM(model, block_size=block_size, num_blocks=need, max_num_seqs=max(samples, 1), max_model_len=max_len,
                  max_num_batched_tokens=max(self.max_num_batched_tokens, samples), compile=self.compile)
        if self.logprobs == "trainer":
            record_temperature_logprobs(llm)
        self.stats.engines_built += 1
        self.stats.kv_bytes_peak = max(self.stats.kv_bytes_peak, llm.sizing.total_bytes)
        self._llm = llm
        return llm


def flashpage_rollout(**options: Any) -> FlashpageRollout:
    """``GRPOTrainer(..., rollout_func=flashpage_rollout())``; options as :class:`FlashpageRollout`'s."""
    check_trl()
    return FlashpageRollout(**options)


# ---------------------------------------------------------------------------- pieces (tested one by one)
def group_repeats(prompts: Sequence[Any]) -> list[tuple[Any, int]]:
    """Consecutive equal prompts as ``(prompt, count)`` runs: TRL's sampler repeats each prompt
    ``num_generations`` times in a row; each run becomes one request with ``n=count``."""
    runs: list[tuple[Any, int]] = []
    for p in prompts:
        if runs and runs[-1][0] == p:
            runs[-1] = (p, runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def tokenize_prompts(trainer: Any, prompts: list[Any]) -> list[list[int]]:
    """Token ids of each text prompt exactly as GRPOTrainer tokenizes them for its own generate()
    (chat template, tools, template kwargs); prompts with images go through :func:`image_requests`."""
    tokenize = getattr(trainer, "_tokenize_prompts", None)
    if tokenize is None:
        ids = trainer.processing_class(text=prompts)["input_ids"]
    else:
        ids, images, _ = tokenize(prompts)
        if images is not None:
            raise ValueError("these prompts hold images: build their requests with image_requests()")
    return [list(map(int, x)) for x in ids]


def prompt_images(prompt: Any) -> list[Any]:
    """The images of a conversational prompt's ``{"type": "image", "image": ...}`` parts, in order (what TRL's
    ``_tokenize_prompts`` collects); [] for a text prompt."""
    if not isinstance(prompt, list):
        return []
    parts = [part for message in prompt if isinstance(message, dict) and isinstance(message.get("content"), list)
             for part in message["content"]]
    return [p["image"] for p in parts
            if isinstance(p, dict) and p.get("type") == "image" and p.get("image") is not None]


def rollout_requests(trainer: Any, runs: list[tuple[Any, int]], model: torch.nn.Module) -> tuple[list[list[int]], list]:
    """Each run's prompt ids (image tokens expanded) and its LLM request: the token ids for a text-only batch,
    :func:`image_requests` when any prompt holds images. Models the engine cannot take images for are refused
    here, before any forward."""
    prompts = [p for p, _ in runs]
    if not any(prompt_images(p) for p in prompts):
        ids = tokenize_prompts(trainer, prompts)
        return ids, list(ids)
    from flashpage.engine.multimodal import image_refusal

    reason = image_refusal(model)
    if reason is not None:
        raise ValueError(f"flashpage rollouts cannot take images for {type(model).__name__} (model_type="
                         f"{model.config.model_type!r}): {reason}. Drop rollout_func to use TRL's own generation")
    firsts = [sum(n for _, n in runs[:i]) for i in range(len(runs))]
    return image_requests(trainer, prompts, firsts)


def image_requests(trainer: Any, prompts: list[Any], firsts: list[int]) -> tuple[list[list[int]], list]:
    """Each conversational prompt through the trainer's processor on its own, rendered and tokenized as
    GRPOTrainer's ``_tokenize_prompts`` does (``prepare_multimodal_messages``, the trainer's chat template, tools
    (per environment: the batch's ``firsts`` index its environments) and template kwargs): its ids, and the LLM
    request ``{"prompt_token_ids": ids, "multi_modal_data": {"image": processor outputs}}`` (plain ids for a
    prompt without images)."""
    from trl.data_utils import prepare_multimodal_messages

    processor = trainer.processing_class
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(f"prompts with images need the model's processor as the trainer's processing_class, got "
                         f"{type(processor).__name__}: GRPOTrainer(..., processing_class=AutoProcessor...)")
    envs = getattr(trainer, "environment_factories", None)
    all_ids, requests = [], []
    for prompt, first in zip(prompts, firsts, strict=True):
        tools = trainer._env_tools[trainer._batch_environments[first]] if envs is not None \
            else getattr(trainer, "tools", None)
        out = processor.apply_chat_template(
            conversation=[prepare_multimodal_messages(prompt)], tools=tools or None,
            chat_template=getattr(trainer, "chat_template", None), add_generation_prompt=True, tokenize=True,
            return_dict=True, return_tensors="pt", **(getattr(trainer, "chat_template_kwargs", None) or {}))
        ids = [int(t) for t in out.pop("input_ids")[0]]
        out.pop("attention_mask", None)
        all_ids.append(ids)
        fields = {k: v for k, v in out.items() if v is not None}
        requests.append({"prompt_token_ids": ids, "multi_modal_data": {"image": fields}}
                        if prompt_images(prompt) else ids)
    return all_ids, requests


def sampling_params(trainer: Any, n: int) -> SamplingParams:
    """The trainer's generation settings as flashpage SamplingParams for ``n`` samples of one prompt."""
    kw: dict[str, Any] = {
        "n": n, "max_tokens": int(trainer.max_completion_length), "temperature": float(trainer.temperature),
        "top_p": float(trainer.top_p if trainer.top_p is not None else 1.0),
        "top_k": int(trainer.top_k) if trainer.top_k else -1,
        "min_p": float(trainer.min_p or 0.0),
        "repetition_penalty": float(trainer.repetition_penalty or 1.0),
        "stop_token_ids": [int(t) for t in trainer.eos_token_ids if t is not None], "logprobs": 0,
    }
    extra = dict(getattr(trainer.args, "generation_kwargs", None) or {})
    unknown = sorted(set(extra) - set(_KWARGS) - _IGNORED)
    if unknown:
        raise ValueError(f"flashpage rollouts cannot apply generation_kwargs {unknown}; they take "
                         f"{sorted(_KWARGS)}. Remove those keys, or drop rollout_func to use TRL's generate()")
    for key, name in _KWARGS.items():
        if extra.get(key) is not None:
            kw[name] = extra[key]
    if "eos_token_id" in extra and extra["eos_token_id"] is not None:
        eos = extra["eos_token_id"]
        kw["stop_token_ids"] = [int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos])]
    if extra.get("do_sample") is False:
        kw["temperature"] = 0.0
    if kw["top_k"] == 0:
        kw["top_k"] = -1
    return SamplingParams(**kw)


def kv_blocks_needed(prompt_ids: list[list[int]], params: list[SamplingParams], block_size: int) -> int:
    """KV blocks for every sample of every prompt at full length: the prompt's full blocks once (shared
    by its samples), the rest per sample (the partial prompt block is copied on write), plus one."""
    total = 1
    for ids, p in zip(prompt_ids, params, strict=True):
        full = len(ids) // block_size
        per_sample = -(-(len(ids) + p.max_tokens) // block_size) - full
        total += full + p.n * per_sample
    return total


def record_temperature_logprobs(llm: LLM) -> None:
    """Make ``llm`` record ``log_softmax(logits / temperature)`` of each sampled token (GRPOTrainer's
    definition) instead of the raw logits' (greedy rows: temperature 1)."""
    original = llm.sampler._record_logprobs

    def record(raw: torch.Tensor, seqs: Sequence[Any], chosen: list[int]) -> None:
        inv_t = [1.0 if s.group.params.greedy else 1.0 / s.group.params.temperature for s in seqs]
        original(raw * raw.new_tensor(inv_t)[:, None], seqs, chosen)

    llm.sampler._record_logprobs = record


def to_trl(prompt_ids: list[list[int]], outputs: list[RequestOutput]) -> dict[str, list]:
    """One row per sample, in request order then sample order (TRL's order of the repeated prompts)."""
    rows: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for ids, out in zip(prompt_ids, outputs, strict=True):
        for c in sorted(out.outputs, key=lambda c: c.index):
            rows["prompt_ids"].append(list(ids))
            rows["completion_ids"].append(list(c.token_ids))
            rows["logprobs"].append([lp.logprob for lp in (c.logprobs or [])])
    return rows


@contextmanager
def generation_model(trainer: Any) -> Iterator[torch.nn.Module]:
    """The model TRL generates with (unwrapped from DDP/DeepSpeed, FSDP parameters summoned, gradient
    checkpointing off), and for a PEFT model its base model with the adapter layers in place."""
    from trl.models.utils import unwrap_model_for_generation

    args = trainer.args
    dist = getattr(trainer, "_dist", None)
    summon = dist.summon_full_params(trainer.model_wrapped, recurse=False) if dist is not None else nullcontext()
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                     gather_deepspeed3_params=getattr(args, "ds3_gather_for_generation", True),
                                     gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs) as unwrapped, \
            summon:
        get_base = getattr(unwrapped, "get_base_model", None)
        yield get_base() if callable(get_base) and getattr(unwrapped, "peft_config", None) else unwrapped


@contextmanager
def restored(model: torch.nn.Module) -> Iterator[None]:
    """Restore every module's train/eval flag and the model's patch state when the block ends."""
    modes = [(m, m.training) for m in model.modules()]
    was_patched = is_patched(model)
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        if not was_patched and is_patched(model):
            unpatch(model)
