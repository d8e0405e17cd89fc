"""flashpage.LLM: continuous batching over a patched HuggingFace model and a paged KV pool.

Each :meth:`LLM.step` is one packed forward ``model(input_ids[1, T], position_ids[1, T],
cache=..., logits_to_keep=...)`` of every scheduled sequence's new tokens (decodes and prefill
chunks together), planned once; logits are computed only for sequences that emit a token.
``LLM`` keeps the requests, the scheduler and the sampler; the forward is its ``runner``'s
(:class:`flashpage.engine.runner.ModelRunner`: the patched model, the cache over the pool, the step kinds).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from flashpage.cache import PagedKVCache, default_block_size
from flashpage.cpu_memory import trim_heap, tune_malloc
from flashpage.engine import chat, lifetime, prompt_logprobs, spec_grammar
from flashpage.engine.compiled import CompiledDecode, CompiledStep
from flashpage.engine.config import EngineConfig
from flashpage.engine.distributed import NewRequest, TPSync, check_tp_size, step_digest, tp_info
from flashpage.engine.flat import FlatDecoder
from flashpage.engine.generation_config import ModelProcessors, config_diff, sampling_defaults, unapplied_fields
from flashpage.engine.limits import context_overflow
from flashpage.engine.linears import Prepacked
from flashpage.engine.loading import as_device, as_dtype, load_model
from flashpage.engine.multimodal import (
    ImageEncoder,
    PromptEmbeds,
    PromptInputs,
    both_ways_refusal,
    image_refusal,
    load_processor,
    split_multimodal,
    split_processor,
)
from flashpage.engine.outputs import RequestMetrics, RequestOutput, StreamOutput
from flashpage.engine.params import SamplingParams
from flashpage.engine.positions import EnginePositions
from flashpage.engine.runner import ModelRunner, RunnerConfig, new_probe_cache
from flashpage.engine.sampler import Sampler
from flashpage.engine.scheduler import Chunk, Schedule, Scheduler
from flashpage.engine.sequence import Group, Seq
from flashpage.engine.sizing import KVSizing, plan_kv_pool, pool_warning
from flashpage.engine.spec import SpeculativeConfig, Speculator, check_spec_support
from flashpage.engine.spec_verify import agree as agree_verdicts
from flashpage.engine.spec_verify import record_logprobs, verify
from flashpage.engine.states import StateSlots, recurrent_states_of, restart_from_scratch
from flashpage.engine.stats import EngineStats
from flashpage.engine.structured import GrammarEngine, StructuredOutputsParams
from flashpage.engine.weights import WeightWatcher, forget_kv
from flashpage.patches import HFPagedCache, is_patched, patch, unpatch
from flashpage.patches.checks import (
    ProbeReport,
    engine_refusal_reason,
    generate_layout_reason,
    unmasked_bidirectional_prefill,
)
from flashpage.patches.compat import require_supported_transformers
from flashpage.patches.patching import UnsupportedModelError, patch_state

# a text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}
Prompt = str | Sequence[int] | Mapping[str, Any]


class LLM:
    """Serve many requests at once on one HuggingFace causal LM.

    Args:
        model: a transformers causal LM, or a path / hub id loaded with ``from_pretrained``.
        tokenizer: needed for text prompts and output text (loaded with the model from a path).
            A vision-language model's processor may be given here too (its tokenizer is used for text).
        block_size: tokens per KV page (default 16; 256 where flash-attn 2 is the kernel).
        num_blocks: KV pages; default: from ``kv_cache_memory``, else on CUDA from free memory, else on CPU
            what ``max_num_seqs`` sequences of ``max_model_len`` tokens need (at most 1 GiB). A pool
            smaller than one ``max_model_len`` sequence warns here.
        max_num_seqs: sequences decoded together at most.
        max_num_batched_tokens: tokens per step at most (long prompts are chunked).
        enable_prefix_caching: share full blocks of equal prefixes between requests.
        kv_cache_memory: bytes (not GiB) for the KV pool; at least one block.
        gpu_memory_utilization: fraction of free CUDA memory for the pool (CUDA only).
        max_model_len: tokens per sequence at most (default: the model's positions).
        dtype / device: for loading from a path.
        check_invariants: verify the block accounting after every step (slow; for tests/debugging).
        max_prefill_with_decodes: prompt tokens a step may carry while it also decodes (default
            ``max_num_batched_tokens``, as vLLM's scheduler); lower bounds what prefill adds to running
            requests' time per output token, at the cost of more, smaller steps.
        compile: run decode-only steps through ``torch.compile(fullgraph=True)`` padded to batch
            and block-table buckets (CUDA graphs on CUDA). Default: on for CUDA, off on CPU
            (see :func:`flashpage.engine.compiled.default_compile`); off under tensor parallelism.
        tensor_parallel_size: under ``torchrun``, load a path sharded over this many ranks
            (``tp_plan="auto"``; every rank builds its LLM); with a model object, checked against the
            model's own sharding. See docs/tensor-parallel.md.
        generation_config: ``"auto"`` (default, as vLLM): requests given no SamplingParams take the model's
            generation_config sampling defaults (:meth:`get_default_sampling_params`), and its processors
            (``forced_eos_token_id``, ``suppress_tokens``, ``begin_suppress_tokens``, ``forced_bos_token_id``,
            ``no_repeat_ngram_size``) apply to every request as in ``generate()``; other fields that would
            change ``generate()``'s tokens are named in a warning. ``"vllm"``: ignore it (neutral defaults).
        cpu_prepack: CPU float32: keep oneDNN-packed copies of the linear weights, sibling linears that read
            the same input (q/k/v, gate/up) stacked into one GEMM (``engine/linears.py``). ``"auto"``
            (default): when the copies take <= 25% of available memory (``FLASHPAGE_CPU_PREPACK=0`` turns
            it off, ``=1`` on); True / False: always / never. Repacked when the weights change.
        speculative_config: speculative decoding (engine/spec.py), vLLM's keys: ``{"method": "ngram",
            "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m,
            "disable_by_batch_size": b}``, or a draft model ``{"model": PATH_OR_MODEL, "num_speculative_tokens": k}``
            (engine/spec_draft.py); outputs keep the target model's distribution (greedy: its tokens).
        processor: a vision-language model's processor (``AutoProcessor``), for prompts with images
            (``{"prompt": text, "multi_modal_data": {"image": image_or_list}}``) and :meth:`chat` with image
            parts; loaded with the model from a path that has one. See engine/multimodal.py for the model
            types that take images.
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, block_size: int | None = None,
                 num_blocks: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                 check_invariants: bool = False, compile: bool | None = None,
                 max_prefill_with_decodes: int | None = None, tensor_parallel_size: int | None = None,
                 generation_config: str = "auto", cpu_prepack: bool | str = "auto",
                 speculative_config: Mapping[str, Any] | SpeculativeConfig | None = None,
                 processor: Any = None) -> None:
        require_supported_transformers()  # before loading anything: say at once why not
        self.config = EngineConfig(  # every option checked here, once, before the model loads
            block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, dtype=dtype, device=device, check_invariants=check_invariants,
            compile=compile, max_prefill_with_decodes=max_prefill_with_decodes,
            tensor_parallel_size=tensor_parallel_size, generation_config=generation_config, cpu_prepack=cpu_prepack,
            speculative_config=speculative_config)
        spec_config = self.config.speculative_config
        generation_config, cpu_prepack = self.config.generation_config, self.config.cpu_prepack
        tokenizer, processor = split_processor(tokenizer, processor)  # images: engine/multimodal.py
        path = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
        if isinstance(model, (str, os.PathLike)):
            model, tokenizer = load_model(model, dtype=dtype, device=device, tokenizer=tokenizer,
                                          tensor_parallel_size=tensor_parallel_size, label=f"LLM({os.fspath(model)!r})")
        else:
            _check_model_placement(model, dtype, device)
            if tensor_parallel_size is not None:
                check_tp_size(model, tensor_parallel_size)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.processor = processor if processor is not None or path is None else load_processor(path, model)
        self._image_encoder: ImageEncoder | None = None  # made by the first request with images
        was_patched = is_patched(self.model)
        patch(self.model)
        try:
            state, config, states = self._check_engine_model()
            # exact only in generate()'s layout (a sparse indexer, a mask the model edits): one sequence per
            # forward, a prompt whole, no prefix caching (engine/solo.py); None: the packed steps
            self.solo_reason = generate_layout_reason(state.report)
            self._both_ways = self._check_both_ways(state.report)  # PaliGemma: prompts attend both ways
            self._build_pool(config, block_size=block_size, num_blocks=num_blocks,
                             kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
                             max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             enable_prefix_caching=enable_prefix_caching and states is None
                             and self.solo_reason is None)
            check_spec_support(spec_config, self.model, states is not None, self._tp is not None)
            if spec_config is not None and self.solo_reason is not None:
                raise ValueError(f"speculative_config: {type(self.model).__name__} runs one sequence per forward, as "
                                 f"generate() does ({self.solo_reason}), where a verification chunk's layout is not "
                                 "exact; leave speculative_config out for this model")
        except BaseException:  # leave the model as it was given
            if not was_patched:
                unpatch(self.model)
            raise
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, max_prefill_with_decodes,
                                   generate_layout=self.solo_reason is not None)
        try:
            self._spec = self._build_speculator(spec_config, max_num_seqs) if spec_config is not None else None
        except BaseException:  # a draft model that cannot run: leave the model as it was given
            if not was_patched:
                unpatch(self.model)
            raise
        self.sampler = Sampler(_eos_ids(self.model, tokenizer),
                               sync=self._tp.same_tokens if self._tp is not None else None)
        self._default_params = self._generation_defaults(generation_config)
        self.max_num_batched_tokens = max_num_batched_tokens
        self._init_bookkeeping(check_invariants)
        self.runner = self._build_runner(config, states, RunnerConfig(
            max_num_seqs, max_num_batched_tokens, compile, cpu_prepack, tensor_parallel=self._tp is not None,
            dense_view=state.family.path == "dense-view", chunked_attention=bool(state.chunks),
            solo=self.solo_reason is not None))
        lifetime.hold(self.model, loaded=path is not None)  # the last LLM on a model it loaded unpatches it
        self._held = self.model  # for __del__

    def __del__(self, _exiting: Any = sys.is_finalizing) -> None:
        """Free the KV pool, the runner (packed weights) and, for the last ``LLM`` on a model it loaded, the
        model (engine/lifetime.py), then give the C heap's free pages back to the OS: the tuned ``malloc`` keeps
        up to 1 GiB of freed memory for the next step (flashpage/cpu_memory.py), and a dropped engine takes none.
        Nothing at interpreter exit (``_exiting`` is bound at definition: module globals may be gone by then)."""
        model = vars(self).pop("_held", None)
        if model is None or _exiting():  # __init__ did not finish, or the process is ending anyway
            return
        vars(self).clear()
        lifetime.release(model)
        del model
        trim_heap()

    def _check_engine_model(self) -> tuple[Any, Any, StateSlots | None]:
        """Refuse a patched model the engine cannot run exactly; set the device and vocabulary. Returns the
        patch state, the text config and the recurrent state slots (None: no recurrent layers)."""
        state = patch_state(self.model)
        family = state.family
        reason = engine_refusal_reason(self.model, state.report)
        if reason is not None:
            raise UnsupportedModelError(f"flashpage.LLM cannot run {type(self.model).__name__} (model_type="
                                        f"{self.model.config.model_type!r}) exactly: {reason}. Use "
                                        "flashpage.patch(model) with model.generate() instead.")
        if not family.on_pages and not family.set_attention:  # its attention never reaches flashpage's
            raise UnsupportedModelError(
                f"flashpage.LLM cannot run {type(self.model).__name__} (model_type="
                f"{self.model.config.model_type!r}) exactly: its attention does not run on the pages ({family.note}). "
                "Use flashpage.patch(model) with model.generate() instead.")
        self.device = next(self.model.parameters()).device
        if self.device.type == "cpu":  # a step's temporaries stay in the heap between steps (cpu_memory.py)
            tune_malloc()
        config = self.model.config.get_text_config(decoder=True)
        self.vocab_size = int(config.vocab_size)
        return state, config, recurrent_states_of(self.model, new_probe_cache(self.model))

    def _build_speculator(self, config: SpeculativeConfig, max_num_seqs: int) -> Speculator:
        """Speculative decoding's proposer (engine/spec.py); a draft model gets its own LLM (engine/spec_draft.py)."""
        draft = None
        if config.model is not None:
            from flashpage.engine.spec_draft import DraftProposer, build_draft

            draft = DraftProposer(build_draft(config.model, self, max_num_seqs), self.vocab_size)
        agree = self._tp.same_proposals if self._tp is not None and draft is not None else None
        return Speculator(config, self.device.type, draft, agree)

    def _build_pool(self, config: Any, *, block_size: int | None,
                    num_blocks: int | None, kv_cache_memory: int | None, gpu_memory_utilization: float,
                    max_model_len: int | None, max_num_seqs: int, enable_prefix_caching: bool) -> None:
        """Size the KV pool (the same on every tensor-parallel rank) and make it: ``self.kv``, ``self.sizing``,
        ``self.max_model_len`` and ``self._tp``. A pool smaller than one max_model_len sequence warns."""
        positions = getattr(config, "max_position_embeddings", None)
        _check_max_model_len(max_model_len, positions)
        known_len = max_model_len or positions
        self.max_model_len = known_len or 1 << 30
        sizing = plan_kv_pool(self.model, self.device, block_size or default_block_size(self.device),
                              num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
                              gpu_memory_utilization=gpu_memory_utilization, max_model_len=known_len,
                              max_num_seqs=max_num_seqs)
        tp = tp_info(self.model)
        self._tp = TPSync(tp) if tp is not None else None
        if self._tp is not None:  # every rank the same pool: the same admissions and preemptions
            sizing = dataclasses.replace(sizing, num_blocks=self._tp.agree_min(sizing.num_blocks))
        too_small = pool_warning(sizing.num_blocks, sizing.block_size, known_len)
        if too_small:
            warnings.warn(too_small, stacklevel=3)
        self.sizing: KVSizing = sizing
        stores = sizing.num_groups > 0  # a pure state-space model stores no K/V: blocks without pages
        self.kv = PagedKVCache(sizing.num_layers, sizing.num_kv_heads or None, sizing.head_dim or None,
                               v_head_dim=sizing.v_head_dim or None, num_blocks=sizing.num_blocks,
                               block_size=sizing.block_size, dtype=sizing.dtype,
                               device=sizing.layer_devices if stores else None,
                               enable_prefix_caching=enable_prefix_caching,
                               layer_geometry=sizing.layer_geometry, shared_layers=sizing.shared_layers)

    def _init_bookkeeping(self, check_invariants: bool) -> None:
        """The request-side state: groups, ids, locks, counters."""
        self._grammar: GrammarEngine | None = None  # made by the first structured-outputs request
        self._grammar_lock = threading.Lock()
        self._groups: dict[str, Group] = {}
        self._unreported: dict[str, Group] = {}  # add_request()s that finished inside generate()/stream()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # held by each step and by abort()/add_request(): either may come from another thread than step()'s
        self._step_lock = threading.RLock()
        self._counters = {"steps": 0, "computed": 0, "generated": 0, "busy": 0.0}
        self.step_request_ids: tuple[str, ...] = ()  # requests of the latest step (set even when it raises)
        self.check_invariants = check_invariants

    def _build_runner(self, config: Any, states: StateSlots | None, options: RunnerConfig) -> ModelRunner:
        """The model runner (engine/runner.py): the step's forward, over this LLM's pool. Its compile=True
        warnings point at the code that called LLM(...). The runner holds the scheduler's rollback, never this
        LLM: no reference cycle, so a dropped LLM frees its pool and packed weights at once (tests/engine/
        test_llm_lifetime.py)."""
        return ModelRunner(self.model, self.kv, config, states, options, self.scheduler.rollback)

    # ------------------------------------------- the runner's parts (read by tests, bench and integrations)
    @property
    def _cache(self) -> HFPagedCache:
        return self.runner._cache

    @property
    def _cache_kwarg(self) -> str:
        return self.runner._cache_kwarg

    @property
    def _states(self) -> StateSlots | None:
        return self.runner.states

    @property
    def _token_by_token(self) -> bool:
        return self.runner._token_by_token

    @property
    def _flat(self) -> FlatDecoder | None:
        return self.runner._flat

    @_flat.setter
    def _flat(self, flat: FlatDecoder | None) -> None:
        self.runner._flat = flat

    @property
    def flat_step(self) -> str:
        """Whether eager steps run as the flat loop (engine/flat.py), or why not."""
        return self.runner.flat_step

    @property
    def fastpath(self) -> Any:
        """The fused ops installed in the model (engine/fastpath.py)."""
        return self.runner.fastpath

    @property
    def _compiled(self) -> CompiledDecode | None:
        return self.runner._compiled

    @property
    def _compiled_step(self) -> CompiledStep | None:
        return self.runner._compiled_step

    @property
    def _prepack(self) -> Prepacked | None:
        return self.runner._prepack

    @property
    def _onednn(self) -> bool:
        return self.runner._onednn

    @property
    def _weights(self) -> WeightWatcher:
        return self.runner._weights

    @property
    def _positions(self) -> EnginePositions | None:
        return self.runner._positions

    @property
    def _keeps_logits(self) -> bool:
        return self.runner._keeps_logits

    def _states_after(self, parts: list[list[int]]) -> dict:
        return self.runner.states_after(parts)

    def _ensure_patched(self) -> None:
        self.runner.ensure_patched()

    def _generation_defaults(self, mode: str) -> dict[str, Any]:
        """Read the model's generation_config (``mode`` "auto"): sampling defaults returned, processors
        handed to the sampler, anything else that changes generate()'s tokens named in a warning."""
        diff = config_diff(self.model) if mode == "auto" else {}
        defaults = sampling_defaults(diff)
        try:
            SamplingParams(**defaults)
        except ValueError as e:
            raise ValueError(f"the model's generation_config has sampling defaults flashpage cannot use ({e}); fix "
                             "model.generation_config or pass LLM(..., generation_config='vllm')") from None
        self.sampler.processors = ModelProcessors.from_diff(diff, self.vocab_size)
        ignored = unapplied_fields(diff)
        if ignored:
            warnings.warn(f"flashpage.LLM: the model's generation_config sets {', '.join(ignored)}, which the engine "
                          "does not apply (generate() does): outputs may differ from model.generate(). Pass "
                          "generation_config='vllm' to silence this and ignore the generation config.", stacklevel=3)
        return defaults

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a request given none: the model's generation_config sampling defaults
        (temperature, top_k, top_p, min_p, penalties, max_new_tokens as max_tokens) under
        ``generation_config="auto"``, as vLLM; SamplingParams() otherwise."""
        return SamplingParams(**self._default_params)

    # ------------------------------------------------------------- requests
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (text or token ids); returns its id. Invalid input raises ValueError
        here, before anything is queued."""
        with self._step_lock:
            group = self._make_group(prompt, sampling_params, request_id)
            self._enqueue(group)
            return group.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now: its blocks are freed, and the next step() reports its final output
        once, with finish_reason 'abort'. An unknown id, or a request that already finished (reported
        or not), is a no-op: aborting races with finishing, so both orders must be safe.
        Under tensor parallelism the abort (made on any rank) takes effect on every rank when the
        next step starts, and that step reports it. Safe from any thread: made while another thread
        runs step(), it waits for that step to end (a request that step finishes is not aborted)."""
        with self._step_lock:
            if request_id in self._unreported:
                return
            group = self._groups.get(request_id)
            if group is None:
                return
            if self._tp is not None:
                self._tp.note_abort(request_id)
                return
            self._finish_group(group, "abort")
            self._unreported[request_id] = group

    def has_unfinished_requests(self) -> bool:
        """Whether step() has more to do or to report."""
        return self.scheduler.has_work() or bool(self._unreported)

    def step(self) -> list[RequestOutput]:
        """Run one packed forward; returns the outputs of requests that progressed this step, preceded
        by the final outputs of add_request() requests that finished while a generate()/stream() ran."""
        with self._step_lock:
            self._check_weights(full=False)
            touched = self._step()
            pending = list(self._unreported.values())
            self._unreported.clear()
            return [g.to_output() for g in pending] + [g.to_output() for g in touched]

    def stats(self) -> EngineStats:
        s = self.kv.stats()
        c = self._counters
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), s.num_blocks, s.in_use,
                           s.free, s.cached, s.block_size, s.hit_rate, self.scheduler.num_preemptions,
                           c["steps"], c["computed"], c["generated"], c["busy"],
                           self.runner.compiled_steps,
                           self._tp.info.rank if self._tp is not None else 0,
                           self._tp.info.size if self._tp is not None else 1,
                           self.sizing.num_kv_heads, self.sizing.total_bytes, tuple(self.kv.groups()),
                           prefix_caching=self.kv.blocks.enable_prefix_caching,
                           kv_bytes_per_token=self.sizing.bytes_per_token,
                           state_bytes_per_seq=self._states.bytes_per_sequence() if self._states is not None else 0,
                           state_bytes=self._states.allocated_bytes() if self._states is not None else 0,
                           flat_steps=self.runner.flat_steps, **self._spec_stats())

    def _spec_stats(self) -> dict[str, Any]:
        """EngineStats' speculative-decoding fields (zeros without speculation)."""
        if self._spec is None:
            return {}
        c = self._spec.counters
        return {"spec_proposed_tokens": c.proposed, "spec_accepted_tokens": c.accepted,
                "spec_verifications": c.verifications, "spec_mean_acceptance_length": c.mean_acceptance_length}

    # -------------------------------------------------------- batch helpers
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        with self._exclusive("generate"):
            self._check_weights()
            groups = self._make_groups(prompts, sampling_params)
            for g in groups:
                self._enqueue(g)
            self._run_until_done(groups, use_tqdm)
            return [g.to_output() for g in groups]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[StreamOutput]:
        """Yield each sample's new tokens (ids and text delta) as they are produced."""
        with self._exclusive("stream"):
            self._check_weights()
            groups = self._make_groups(prompts, sampling_params, streamed=True)
            for g in groups:
                self._enqueue(g)
            try:
                while not all(g.finished for g in groups):
                    self._step_for(groups)
                    for g in groups:
                        yield from _stream_deltas(g)
            finally:
                for g in groups:
                    if not g.finished:
                        self._abort_here(g)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Any = None,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: a conversation (a list of ``{"role", "content"}`` messages) or a list of them,
        rendered by the chat template (the tokenizer's, or ``chat_template``) and generated; outputs in input
        order. Content is a string or a list of parts: text, and with a processor images (``{"type": "image",
        "image": PIL}`` or ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``); see
        engine/chat.py."""
        prompts = [chat.render(conv, self.tokenizer, self.processor, chat_template=chat_template,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               chat_template_kwargs=chat_template_kwargs)
                   for conv in chat.conversations(messages)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Forget all KV computed so far (as vLLM's): the prefix cache is emptied and running requests
        are recomputed from their tokens at their next step. The engine does this by itself when it
        sees the weights change (see :mod:`flashpage.engine.weights`); call it after changes it cannot
        see (writes through ``param.data`` in place). Returns True."""
        forget_kv(self.scheduler, self.kv)
        self.runner.refresh_weights(everything=True)
        self._encode_images_again()
        return True

    @property
    def weights_version(self) -> int:
        """How many weight changes the engine has seen (each one dropped the KV computed before it)."""
        return self.runner.weights_version

    def _check_weights(self, full: bool = True) -> None:
        """Once per generate()/stream()/step() call: KV computed with older weights is never reused."""
        if self.runner.weights_changed(full=full):
            forget_kv(self.scheduler, self.kv)
            self.runner.refresh_weights()  # repack what changed; the flat step is verified again
            self._encode_images_again()

    # ---------------------------------------------------------------- inner
    def _exclusive(self, what: str):
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"LLM.{what}() is already running (another thread or an unfinished stream); "
                               "an LLM serves one generate()/stream() at a time: wait for it, or use another LLM")
        return _Release(self._lock)

    def _run_until_done(self, groups: list[Group], use_tqdm: bool) -> None:
        bar = _progress(len(groups), use_tqdm and (self._tp is None or self._tp.info.is_driver))
        done = 0
        try:
            while not all(g.finished for g in groups):
                self._step_for(groups)
                now = sum(g.finished for g in groups)
                if bar is not None and now > done:
                    bar.update(now - done)
                done = now
        except BaseException:
            for g in groups:
                if not g.finished:
                    self._abort_here(g)
            raise
        finally:
            if bar is not None:
                bar.close()

    def _step_for(self, groups: list[Group]) -> None:
        """A step inside generate()/stream(): other requests that finish are kept for step() to report."""
        own = {g.request_id for g in groups}
        with self._step_lock:
            for g in self._step():
                if g.finished and g.request_id not in own:
                    self._unreported[g.request_id] = g

    def _make_groups(self, prompts: Prompt | Sequence[Prompt], params: Any, streamed: bool = False) -> list[Group]:
        items = _as_prompt_list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            plist = [params] * len(items)
        elif isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Iterable):
            raise TypeError(f"sampling_params must be a flashpage.SamplingParams or a list of them (one per prompt), "
                            f"got {type(params).__name__}")
        else:
            plist = list(params)
            if len(plist) != len(items):
                raise ValueError(f"got {len(plist)} SamplingParams for {len(items)} prompts; "
                                 "pass one, or one per prompt")
        groups = [self._make_group(p, sp) for p, sp in zip(items, plist, strict=True)]
        for g in groups:
            g.streamed = streamed
        return groups

    def _make_group(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None = None) -> Group:
        params = params if params is not None else self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a flashpage.SamplingParams, got {type(params).__name__}")
        params.__post_init__()  # re-validate: fields may have been changed after construction
        image_inputs = None
        if isinstance(prompt, Mapping) and ("multi_modal_data" in prompt or "mm_processor_kwargs" in prompt):
            text, ids, image_inputs = self._image_prompt(prompt)
        else:
            text, ids = self._tokenize(prompt)
        self._validate_prompt(ids, params)
        self._check_context(len(ids), params)
        mm = self._prompt_inputs(ids, image_inputs)
        rid = request_id if request_id is not None else self._next_id()
        if rid in self._groups:
            raise ValueError(f"request id {rid!r} is already in use")
        # a sequence can hold no more tokens than the model's positions, nor than the whole KV pool
        cap = min(self.max_model_len, self.kv.num_blocks * self.kv.block_size)
        group = Group(rid, text, ids, params, RequestMetrics(time.perf_counter()), self.tokenizer,
                      max_total_tokens=cap, mm=mm)
        seq = group.new_seq(0, ids)  # everything that can fail happens here, before anything is queued
        if params.structured_outputs is not None:
            seq.grammar = self._grammar_engine().new_matcher(params.structured_outputs)
        return group

    def prepare_structured_outputs(self, spec: StructuredOutputsParams) -> None:
        """Compile a constraint now (thread-safe; ValueError naming the field if it is invalid), so the
        add_request() that uses it only copies a cached matcher. A server calls it off the engine thread."""
        self._grammar_engine().compile(spec)

    def _grammar_engine(self) -> GrammarEngine:
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarEngine(self.tokenizer, self.vocab_size, sorted(self.sampler.eos_token_ids))
        return self._grammar

    def _next_id(self) -> str:
        """A fresh automatic request id (skipping any a caller chose with request_id=)."""
        rid = str(next(self._ids))
        while rid in self._groups or rid in self._unreported:
            rid = str(next(self._ids))
        return rid

    def _enqueue(self, group: Group) -> None:
        """Register a group built (and fully validated) by _make_group; cannot fail half-way."""
        self._groups[group.request_id] = group
        self.scheduler.add(group.seqs[0])
        if self._tp is not None:  # driver mode: the followers add it at the next step
            self._tp.note_add(NewRequest(group.request_id, group.prompt, group.prompt_token_ids, group.params))

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            prompt = _from_input_dict(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: LLM(model, tokenizer) or pass token ids")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.reshape(-1).tolist()
        if isinstance(prompt, (bytes, Mapping)) or not isinstance(prompt, Iterable):
            raise TypeError(f"a prompt must be a text (str) or a list of token ids (ints), got "
                            f"{type(prompt).__name__}: {prompt!r:.60}")
        ids = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError("a token-id prompt must be a list of ints")
        return None, ids

    def _image_prompt(self, prompt: Mapping[str, Any]) -> tuple[str | None, list[int], dict[str, Any]]:
        """vLLM's ``{"prompt": text, "multi_modal_data": {"image": PIL | [PIL, ...]}}`` (the processor applied;
        optional ``"mm_processor_kwargs"`` passed to it) or ``{"prompt_token_ids": ids, "multi_modal_data":
        {"image": processor_outputs}}``: (text, ids, image tensors). Models that cannot take images refused by
        name."""
        reason = self._image_refusal()
        if reason is not None:
            raise ValueError(f"flashpage.LLM cannot take images for {type(self.model).__name__} (model_type="
                             f"{self.model.config.model_type!r}): {reason}")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt) or "multi_modal_data" not in prompt:
            raise ValueError(f"a prompt dict with images takes 'multi_modal_data' and exactly one of 'prompt' or "
                             f"'prompt_token_ids' (and optionally 'mm_processor_kwargs'), got keys "
                             f"{sorted(map(str, prompt))}")
        images, tensors = split_multimodal(prompt["multi_modal_data"])
        if "prompt" in prompt:
            if images is None:
                raise ValueError("pre-processed image inputs ({'image': {'pixel_values': ...}}) go with "
                                 "'prompt_token_ids' (the processor's input_ids); a text prompt takes images")
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"'prompt' must be a text, got {type(prompt['prompt']).__name__}")
            ids, inputs = self._encoder().process(prompt["prompt"], images, prompt.get("mm_processor_kwargs") or {})
            return prompt["prompt"], ids, inputs
        if tensors is None:
            raise ValueError("with 'prompt_token_ids', multi_modal_data['image'] must be the processor's outputs "
                             "for them ({'pixel_values': ..., ...}); images themselves go with a text 'prompt'")
        _, ids = self._tokenize(prompt["prompt_token_ids"])
        return None, ids, tensors

    def _check_both_ways(self, report: ProbeReport | None) -> bool:
        """Whether a prompt transformers hands no mask attends both ways in this model (PaliGemma under sdpa: each
        request's prompt is then one span, engine/multimodal.py PromptSpans); a model whose spans cannot be read is
        refused."""
        if not unmasked_bidirectional_prefill(report):
            return False
        reason = both_ways_refusal(self.model)
        if reason is not None:
            raise UnsupportedModelError(f"flashpage.LLM cannot run {type(self.model).__name__} (model_type="
                                        f"{self.model.config.model_type!r}) exactly: {reason}. Use "
                                        "flashpage.patch(model) with model.generate() instead.")
        return True

    def _encoder(self) -> ImageEncoder:
        """The image encoder, made by the first request that needs it (a span of tokens attending both ways must
        fit one step's budget)."""
        if self._image_encoder is None:
            self._image_encoder = ImageEncoder(self.model, self.processor, self.scheduler.max_num_batched_tokens,
                                               both_ways=self._both_ways)
        return self._image_encoder

    def _prompt_inputs(self, ids: list[int], image_inputs: dict[str, Any] | None) -> PromptInputs | None:
        """What a request keeps beyond its ids (engine/multimodal.py): its image embeddings; for a text prompt
        of a model that attends to it both ways (PaliGemma), its two-way span; None: neither. A span longer than
        max_num_batched_tokens is refused here, before the request is queued."""
        if image_inputs is not None:
            return self._encoder().encode(ids, image_inputs)
        if not self._both_ways:
            return None
        if self._tp is not None:
            raise ValueError(f"flashpage.LLM cannot run {type(self.model).__name__}'s prompts, which attend both "
                             "ways, under tensor parallelism yet")
        return self._encoder().text_spans(ids)

    def _encode_images_again(self) -> None:
        """After a weight change: the image embeddings of unfinished requests come from the new weights too."""
        for group in self._groups.values():
            if isinstance(group.mm, PromptEmbeds):
                group.mm = self._encoder().encode(group.prompt_token_ids, group.mm.inputs)

    def _image_refusal(self) -> str | None:
        """Why this LLM cannot take images (None: it can; recurrent models' steps take them: engine/states.py)."""
        if self._tp is not None:
            return "images are not taken under tensor parallelism yet"
        return image_refusal(self.model)

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt has token id(s) outside the vocabulary [0, {self.vocab_size}): "
                             f"{bad[:5]}{'...' if len(bad) > 5 else ''}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the model takes at most {self.max_model_len} "
                             f"positions (max_model_len), leaving no room to generate: "
                             f"{len(ids) - self.max_model_len + 1} token(s) too many")
        need = -(-(len(ids) + 1) // self.kv.block_size)
        if need > self.kv.num_blocks:
            raise ValueError(f"prompt needs {need} KV blocks but the whole pool has {self.kv.num_blocks} "
                             f"({need - self.kv.num_blocks} too many); give the LLM more KV memory "
                             "(num_blocks= or kv_cache_memory=) or shorten the prompt")
        if self.solo_reason is not None and len(ids) > self.scheduler.max_num_batched_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens but {type(self.model).__name__} computes a prompt whole in "
                             f"one step, as generate() does ({self.solo_reason}), and a step takes at most "
                             f"max_num_batched_tokens={self.scheduler.max_num_batched_tokens}: raise "
                             "max_num_batched_tokens or shorten the prompt")

    def _check_context(self, num_prompt: int, params: SamplingParams) -> None:
        """Prompt + max_tokens beyond max_model_len: ValueError, or (opted in) a warning and a shorter output."""
        problem = context_overflow(num_prompt, params.max_tokens, self.max_model_len)
        if problem is None:
            return
        if not params.truncate_max_tokens:
            raise ValueError(f"{problem}, or pass SamplingParams(truncate_max_tokens=True) to generate only what fits")
        warnings.warn(f"{problem}; truncate_max_tokens=True: generating at most "
                      f"{self.max_model_len - num_prompt} tokens", stacklevel=4)

    def _step(self) -> list[Group]:
        self.step_request_ids = ()
        if self._tp is not None:
            self._tp_inputs()
            if self._tp.stopped:  # a follower released by rank 0: no step
                return []
        proposals = self._spec.propose(self.scheduler.running, self._grammar_check()) \
            if self._spec is not None else None
        schedule = self.scheduler.schedule(proposals)
        # which requests this step computes: if it raises, a server fails those (and only those)
        self.step_request_ids = tuple(dict.fromkeys(c.seq.group.request_id for c in schedule.chunks))
        if self._tp is not None:
            self._tp_check(schedule)
        if not schedule.chunks:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("scheduler could not place any waiting request in the KV pool")
            return []
        start = time.perf_counter()
        emitting = [c for c in schedule.chunks if c.emits]
        prompt_rows = prompt_logprobs.plan_rows(schedule.chunks)
        logits = self.runner.run(schedule, prompt_rows.flat)
        try:
            num_rows = sum(c.num_emitting_rows for c in emitting)
            if prompt_rows:  # kept after the emitting chunks' rows
                prompt_logprobs.record(prompt_rows, logits[num_rows:])
                logits = logits[:num_rows]
            touched = self._postprocess_spec(emitting, logits) if any(c.draft for c in emitting) \
                else self._postprocess(emitting, logits)
        except BaseException:
            self._unsample()
            raise
        self._counters["steps"] += 1
        self._counters["computed"] += schedule.num_tokens
        self._counters["busy"] += time.perf_counter() - start
        if self.check_invariants:
            self.kv.blocks.check_invariants()
        return touched

    def _tp_inputs(self) -> None:
        """Tensor parallel: add what rank 0 added (followers), apply the aborts any rank made since the
        last step (see distributed.py); step() reports the aborted requests, as after abort()."""
        assert self._tp is not None
        inputs = self._tp.exchange()
        for r in inputs.adds:
            group = self._make_group(r.token_ids, r.params, r.request_id)
            group.prompt = r.prompt
            self._enqueue(group)
        for rid in inputs.aborts:
            group = self._groups.get(rid)
            if group is not None:
                self._finish_group(group, "abort")
                self._unreported[rid] = group

    def _tp_check(self, schedule: Schedule) -> None:
        """Tensor parallel: every rank must run this very step; otherwise undo it and raise on all ranks."""
        assert self._tp is not None
        parts = [(c.seq.group.request_id, c.seq.index, c.start, c.token_ids) for c in schedule.chunks]
        digest = step_digest(parts, [(s.group.request_id, s.index) for s in schedule.preempted],
                             [len(c.draft) for c in schedule.chunks])
        try:
            self._tp.check_step(digest, f"{len(parts)} chunks, {schedule.num_tokens} tokens")
        except BaseException:
            self.scheduler.rollback(schedule)
            raise

    def _postprocess(self, emitting: list[Chunk], logits: torch.Tensor) -> list[Group]:
        seqs: list[Seq] = []
        rows: list[int] = []
        for i, c in enumerate(emitting):
            seqs.append(c.seq)
            rows.append(i)
            for child in self._fork_samples(c.seq):  # (a constrained child forks its parent's matcher)
                seqs.append(child)
                rows.append(i)
        if not seqs:
            return []
        row_logits = logits if rows == list(range(len(emitting))) else logits[rows]
        if self._grammar is not None:  # structured outputs: disallowed tokens to -inf in constrained rows
            row_logits = self._grammar.apply(row_logits, seqs)
        tokens = self.sampler(row_logits, seqs)
        now = time.perf_counter()
        touched: dict[str, Group] = {}
        for seq, tok in zip(seqs, tokens, strict=True):
            self._append_token(seq, tok, now)
            touched[seq.group.request_id] = seq.group
        self._counters["generated"] += len(tokens)
        return list(touched.values())

    def _postprocess_spec(self, emitting: list[Chunk], logits: torch.Tensor) -> list[Group]:
        """A step with verification chunks: the plain emitting chunks sample as usual (``_postprocess``), each
        verification chunk keeps its accepted proposed tokens and one more (engine/spec_verify.py)."""
        starts = list(itertools.accumulate((c.num_emitting_rows for c in emitting), initial=0))
        plain = [i for i, c in enumerate(emitting) if not c.draft]
        spec = [i for i, c in enumerate(emitting) if c.draft]
        spec_rows = [r for i in spec for r in range(starts[i], starts[i + 1])]
        seqs, drafts = [emitting[i].seq for i in spec], [emitting[i].draft for i in spec]
        spec_logits = logits[spec_rows]
        if self._grammar is not None:  # structured outputs: each verified row masked by its grammar state
            spec_logits = spec_grammar.mask_rows(self._grammar, spec_logits, seqs, drafts)
        verdicts = verify(self.sampler, spec_logits, seqs, drafts)
        if self._tp is not None:  # every rank keeps (and rolls back) rank 0's verified tokens
            verdicts = agree_verdicts(verdicts, drafts, self._tp.same_tokens)
        touched = {g.request_id: g for g in self._postprocess([emitting[i] for i in plain],
                                                              logits[[starts[i] for i in plain]])}
        now = time.perf_counter()
        for i, verdict in zip(spec, verdicts, strict=True):
            group = self._accept_verdict(emitting[i], verdict, spec_logits, now)
            touched[group.request_id] = group
        return list(touched.values())

    def _grammar_check(self) -> Any:
        """What cuts a grammar-constrained proposal to its grammar's valid prefix (None: no grammar engine yet)."""
        if self._grammar is None:
            return None
        return functools.partial(spec_grammar.valid_prefix, self._grammar)

    def _accept_verdict(self, chunk: Chunk, verdict: Any, logits: torch.Tensor, now: float) -> Group:
        """Keep a verification chunk's accepted tokens: the cache is cut after them (rejected tokens' blocks
        leave the prefix cache), then its tokens are appended one by one until the sequence finishes."""
        seq = chunk.seq
        assert self._spec is not None
        seq.num_computed += verdict.accepted  # the runner counted the sequence's own token only
        if self.kv.num_tokens(seq.seq_id) > seq.num_computed:
            self.kv.truncate(seq.seq_id, seq.num_computed, invalidate=True)
        appended = 0
        for token in verdict.tokens:
            self._append_token(seq, token, now)
            appended += 1
            if seq.finished:
                break
        record_logprobs(logits, seq, verdict.tokens[:appended], verdict.rows[:appended])
        self._counters["generated"] += appended
        self._spec.observe(seq, len(chunk.draft), verdict.accepted, appended)
        return seq.group

    def _unsample(self) -> None:
        """After a failure between the forward and the sampled tokens: a running sequence whose
        logits were computed but turned into no token gives back its last computed token, so the
        next step computes it again and samples (otherwise it would never be scheduled again)."""
        for seq in self.scheduler.running:
            if seq.in_cache and seq.num_computed and seq.remaining == 0:
                if self._states is not None:  # its state already includes that token: recompute from scratch
                    restart_from_scratch([seq], self.kv, self._states)
                    continue
                seq.num_computed -= 1
                drafts = self.kv.num_tokens(seq.seq_id) > seq.num_computed + 1  # a verification chunk's proposals
                self.kv.truncate(seq.seq_id, seq.num_computed, invalidate=drafts)

    def _fork_samples(self, seq: Seq) -> list[Seq]:
        group = seq.group
        if seq.index != 0 or seq.num_output != 0 or len(group.seqs) >= group.params.n:
            return []
        children = []
        for i in range(len(group.seqs), group.params.n):
            child = group.new_seq(i, seq.token_ids)
            try:
                if seq.grammar is not None:
                    child.grammar = seq.grammar.fork()
                self.kv.fork(seq.seq_id, child.seq_id)
                if self._states is not None:
                    self._states.fork(seq.seq_id, child.seq_id)
                child.in_cache = True
                child.num_computed = seq.num_computed
                self.scheduler.add_running_after(seq, child)
            except BaseException:  # drop the half-made sample: the parent's next emitting step forks it again
                group.seqs.remove(child)
                if child in self.scheduler.running:
                    self.scheduler.running.remove(child)
                if self.kv.has_sequence(child.seq_id):
                    self.kv.free(child.seq_id)
                raise
            children.append(child)
        return children

    def _append_token(self, seq: Seq, token: int, now: float) -> None:
        group, p = seq.group, seq.group.params
        seq.token_ids.append(token)
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        may_stop = seq.num_output >= p.min_tokens
        if seq.detok is not None:
            seq.detok.update(seq.output_ids, check_stop=may_stop)
        reason = self._grammar.accept(seq, token) if seq.grammar is not None else None  # "stop": grammar done
        if reason is not None:
            pass
        elif may_stop and ((token in self.sampler.eos_token_ids and not p.ignore_eos) or token in p.stop_ids):
            reason = "stop"
        elif seq.detok is not None and seq.detok.stopped:
            reason = "stop"
        elif seq.num_output >= p.max_tokens or len(seq.token_ids) >= group.max_total_tokens:
            reason = "length"
        if reason is not None:
            self._finish_seq(seq, reason)

    def _finish_seq(self, seq: Seq, reason: str) -> None:
        self.scheduler.remove(seq)
        if self._spec is not None:  # a draft model's shadow of it is freed
            self._spec.forget(seq)
        if self._states is not None:
            self._states.release(seq.seq_id)
        seq.mark_finished(reason)
        if seq.detok is not None:
            seq.detok.flush(seq.output_ids, check_stop=seq.num_output >= seq.group.params.min_tokens)
        group = seq.group
        if group.finished:
            group.metrics.finish_time = time.perf_counter()
            self._groups.pop(group.request_id, None)

    def _abort_here(self, group: Group) -> None:
        """End a request of a generate()/stream() left early, now; under tensor parallelism the other
        ranks (if they still run it) end it when the next step starts."""
        with self._step_lock:
            self._finish_group(group, "abort")
            if self._tp is not None:
                self._tp.note_abort(group.request_id)

    def _finish_group(self, group: Group, reason: str) -> None:
        while len(group.seqs) < group.params.n:  # samples never forked end too
            group.new_seq(len(group.seqs), group.prompt_token_ids)
        for seq in group.seqs:
            if not seq.finished:
                self._finish_seq(seq, reason)


class _Release:
    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _stream_deltas(group: Group) -> Iterator[StreamOutput]:
    for seq in group.seqs:
        new_ids = seq.output_ids[seq.streamed_tokens:]
        text = seq.detok.take_delta(final=seq.finished) if seq.detok is not None else ""
        announce = seq.finished and not seq.final_streamed
        if new_ids or text or announce:
            seq.streamed_tokens += len(new_ids)
            seq.final_streamed = seq.finished
            yield StreamOutput(group.request_id, seq.index, new_ids, text, seq.finished, seq.finish_reason)


def _from_input_dict(prompt: Mapping[str, Any]) -> str | list[int]:
    """vLLM's input form: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` (with images: LLM._image_prompt)."""
    unknown = set(prompt) - {"prompt", "prompt_token_ids"}
    if unknown or len(prompt) != 1:
        raise ValueError(f"a prompt dict takes exactly one of 'prompt' (text) or 'prompt_token_ids' (a list of ints), "
                         f"got keys {sorted(map(str, prompt))}")
    return prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        return [prompts.tolist()] if prompts.dim() == 1 else [p.tolist() for p in prompts]
    if not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a text, a list of token ids, or a list of those; "
                        f"got {type(prompts).__name__}")
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]
    return items


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="flashpage", unit="req")


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: Iterable[int | None] = ()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return [int(t) for t in ids if t is not None]


ALLOW_LONG_MAX_MODEL_LEN = "FLASHPAGE_ALLOW_LONG_MAX_MODEL_LEN"


def _check_max_model_len(max_model_len: int | None, positions: int | None) -> None:
    """Refuse a max_model_len beyond the model's positions (generation past them is garbage or fails),
    unless the environment says the model really takes longer inputs (vLLM's override, same spirit)."""
    if max_model_len is None or positions is None or max_model_len <= positions:
        return
    problem = (f"max_model_len={max_model_len} is more than the model's {positions} positions "
               "(config.max_position_embeddings)")
    if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN, "") not in ("", "0"):
        warnings.warn(f"{problem}; allowed by {ALLOW_LONG_MAX_MODEL_LEN}: tokens past {positions} may be "
                      "garbage", stacklevel=3)
        return
    raise ValueError(f"{problem}: tokens past position {positions} would be garbage (or fail). Give "
                     f"max_model_len <= {positions}, or set {ALLOW_LONG_MAX_MODEL_LEN}=1 if this model really "
                     "handles longer sequences (e.g. rope scaling its config does not show)")


def _check_model_placement(model: Any, dtype: torch.dtype | str | None, device: str | torch.device | None) -> None:
    """LLM(model_object, dtype=..., device=...): the model is used as given, so a dtype or device it is
    not in is refused (converting the caller's model in place would surprise); equal ones are fine."""
    param = next(model.parameters(), None) if hasattr(model, "parameters") else None
    if param is None:
        return
    want_dtype = as_dtype(dtype)
    if want_dtype is not None and want_dtype != param.dtype:
        raise ValueError(f"LLM(model, dtype={dtype!r}): the model object is {param.dtype}, and LLM uses a model "
                         f"object as it is. Convert it first (model.to({want_dtype})) or pass a path, which LLM "
                         "loads in that dtype")
    if device is not None:
        want = as_device(device)
        here = param.device
        if want.type != here.type or (want.index is not None and here.index is not None and want.index != here.index):
            raise ValueError(f"LLM(model, device={str(device)!r}): the model object is on {here}, and LLM uses a "
                             f"model object where it is. Move it first (model.to({str(want)!r})) or pass a path, "
                             "which LLM loads onto that device")
