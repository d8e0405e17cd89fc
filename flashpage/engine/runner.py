"""The model-facing half of :class:`flashpage.LLM`: one packed forward per engine step.

:class:`ModelRunner` owns what touches the model: the patched model, the ``HFPagedCache`` wrapper over the
paged KV pool (``_cache``), the cache keyword, the recurrent state slots, and the step kinds (the flat eager
loop of ``engine/flat.py``, the compiled step / decode of ``engine/compiled.py``, the model's eager forward,
the stateful ``[B, L]`` rows of ``engine/states.py``, and for models only generate()'s layout is exact on the
solo steps of ``engine/solo.py``: one ``[1, L]`` forward per sequence), plus the weights watcher. ``LLM`` keeps the
request API, the groups, the scheduler and the sampler; speculative decoding or multimodal inputs would
plug in here (as nano-vllm's ``ModelRunner`` and vLLM V1's ``GPUModelRunner``).

Data flow of one step::

    Scheduler.schedule() -> Schedule (chunks: each sequence's new tokens, their slots already allocated)
      -> ModelRunner.run(schedule, extra_rows) -> logits (rows, vocab): each emitting chunk's last row,
         then the packed rows ``extra_rows`` (prompt logprobs); every chunk's ``seq.num_computed`` advanced
      -> Sampler(logits, seqs) -> one token per emitting sequence (LLM._postprocess)

On a failed forward the runner ends the cache's forward, calls ``rollback(schedule)`` (the scheduler's:
the step's slots are given back) and re-raises.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashpage.cache import PagedKVCache
from flashpage.cpu_threads import ThreadGovernor
from flashpage.engine.compiled import CompiledDecode, CompiledStep, default_compile
from flashpage.engine.fastpath import FastPath, fastpath_scope, install_fastpath
from flashpage.engine.flat import FlatDecoder, flat_decoder
from flashpage.engine.linears import Prepacked, install_onednn_linears, onednn_scope
from flashpage.engine.multimodal import deepstack_kwargs, language_model_inputs, per_layer_kwargs, two_way_spans
from flashpage.engine.positions import EnginePositions, honours_logits_to_keep, kept_rows
from flashpage.engine.scheduler import Chunk, Schedule
from flashpage.engine.solo import SoloModel, restart_solo_step, solo_forward
from flashpage.engine.states import StateSlots, continues_chunks, restart_from_scratch, stateful_forward
from flashpage.engine.weights import WeightWatcher
from flashpage.patches import HFPagedCache, is_patched, patch, unpatch
from flashpage.patches.checks import _probe_tokens
from flashpage.patches.compat import cache_kwarg
from flashpage.patches.hf_cache import module_states
from flashpage.patches.linear_cache import engine_cache_class
from flashpage.patches.patching import attention_switched

# frames from choose_compile() up to the code that called LLM(...): its warnings point there
_LLM_CALLER = 5


@dataclass(frozen=True)
class RunnerConfig:
    """What the runner needs to know beyond the model and the pool (all from LLM's arguments)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    compile: bool | None  # LLM(compile=...): None picks default_compile()
    cpu_prepack: bool | str  # LLM(cpu_prepack=...), already checked
    tensor_parallel: bool = False
    dense_view: bool = False  # K/V transformed after the cache (MLA...): no static shapes
    chunked_attention: bool = False  # Llama 4: the model's code specialises on the step's length
    solo: bool = False  # one [1, L] forward per sequence, as generate() runs it (engine/solo.py)


def new_probe_cache(model: Any) -> HFPagedCache:
    """A fresh generate()-style cache for probes (recurrent state in the model's modules included)."""
    cache = engine_cache_class(model)(model.config)
    cache.module_states = module_states(model)
    return cache


def step_inputs(schedule: Schedule, extra_rows: Sequence[int] = ()) -> tuple[list[int], list[int], list[int]]:
    """The packed step's token ids (T), positions (T) and the kept rows (each emitting chunk's last row, or
    its last ``1 + len(draft)`` rows for a verification chunk, then ``extra_rows``)."""
    ids: list[int] = []
    pos: list[int] = []
    for c in schedule.chunks:
        ids.extend(c.token_ids)
        pos.extend(range(c.start, c.start + c.num_tokens))
    ends = list(itertools.accumulate(c.num_tokens for c in schedule.chunks))
    keep = [r for c, e in zip(schedule.chunks, ends, strict=True) for r in range(e - c.num_emitting_rows, e)]
    keep.extend(extra_rows)
    return ids, pos, keep


class ModelRunner:
    """Runs the engine's packed forward on a patched model over a paged KV pool.

    Args:
        model: the patched (``flashpage.patch``) causal LM, in eval mode.
        kv: the paged KV pool the scheduler allocates from.
        config: the model's text config (``config.get_text_config(decoder=True)``).
        states: recurrent state slots (hybrid / state-space models), else None.
        options: see :class:`RunnerConfig`.
        rollback: undoes a schedule whose forward failed (``Scheduler.rollback``).
    """

    def __init__(self, model: Any, kv: PagedKVCache, config: Any, states: StateSlots | None,
                 options: RunnerConfig, rollback: Callable[[Schedule], None]) -> None:
        self.model = model
        self.kv = kv
        self.device: torch.device = next(model.parameters()).device
        self.states = states
        self._rollback = rollback
        self.flat_steps = 0  # eager steps that ran as the flat loop
        self._cache = engine_cache_class(model).wrap(kv, config)
        self._cache.module_states = module_states(model)  # RecurrentGemma: swapped per forward
        self._cache_kwarg = cache_kwarg(model)
        # recurrent layers that restart from zero on a multi-token input (Mamba-1 mixers): continuing chunks
        # of a prompt run one token at a time
        self._token_by_token = states is not None and not continues_chunks(self.states_after,
                                                                           _probe_tokens(config, 8))
        self._solo_steps = options.solo
        use_compile = self._choose_compile(options)
        self._install_eager(options.cpu_prepack, options.tensor_parallel)
        self._build_compiled(use_compile, options)
        self._solo = SoloModel(model, kv, config, type(self._cache), self._cache_kwarg, self.device, states,
                               self._keeps_logits, tuple(self._cache.module_states)) if options.solo else None
        self._weights = WeightWatcher(model)  # KV of older weights is dropped, never reused (weights.py)
        self.threads = ThreadGovernor.for_device(self.device)  # one thread while the cores are shared

    # ------------------------------------------------------------- set-up
    def _choose_compile(self, options: RunnerConfig) -> bool:
        """Whether steps go through the compiled forward; installs the model's own positions / logits rows
        handling (which rules it out) on the way. A compile=True that cannot be honoured warns."""
        asked = options.compile
        name = type(self.model).__name__
        use = default_compile(self.device) and not options.tensor_parallel if asked is None else bool(asked)
        if self.states is not None:  # the compiled step is the packed [1, T] layout
            if asked:
                warnings.warn(f"flashpage.LLM(compile=True): {name} has recurrent (linear-attention / SSM) layers, "
                              "whose steps run eagerly in [B, L] rows", stacklevel=_LLM_CALLER)
            use = False
        if options.dense_view:  # attention on what the model hands it, whose width is the step's keys
            if asked:
                warnings.warn(f"flashpage.LLM(compile=True): {name} transforms its K/V after the cache (dense view); "
                              "its steps run eagerly", stacklevel=_LLM_CALLER)
            use = False
        if options.solo:
            if asked:
                warnings.warn(f"flashpage.LLM(compile=True): {name} runs one sequence per forward, as generate() "
                              "does (a sparse-attention indexer or a mask the model edits); its steps run eagerly",
                              stacklevel=_LLM_CALLER)
            use = False
        if options.chunked_attention:
            if asked:
                warnings.warn(f"flashpage.LLM(compile=True): {name} has chunked-attention layers; its steps run "
                              "eagerly", stacklevel=_LLM_CALLER)
            use = False
        self._positions = EnginePositions.install(self.model)  # BART family: positions from the cache length
        self._keeps_logits = honours_logits_to_keep(self.model)  # whisper: logits of every row
        if self._positions is not None or not self._keeps_logits:
            if asked:
                warnings.warn(f"flashpage.LLM(compile=True): {name} takes positions or logits rows in its own way; "
                              "its steps run eagerly", stacklevel=_LLM_CALLER)
            use = False
        return use

    def _install_eager(self, cpu_prepack: bool | str, tensor_parallel: bool) -> None:
        """The eager forward's helpers: oneDNN linears (CPU float32), fused ops, the flat loop. None for solo steps,
        which run the model's own forward as generate() does (and whose models' rotary helpers may take other
        arguments: Qwen4-Exp's indexer rotates its queries alone)."""
        solo = self._solo_steps
        # CPU float32: linears through oneDNN inside the engine's eager forwards (engine/linears.py)
        self._onednn = not solo and self.device.type == "cpu" and install_onednn_linears(self.model) > 0
        # ... with their weights packed (and siblings fused) once, as vLLM's CPU backend does (engine/linears.py)
        self._prepack = Prepacked(self.model, cpu_prepack) if self._onednn else None
        # fused norms / rotary / gated-MLP activations inside the engine's eager forwards (engine/fastpath.py)
        self.fastpath = FastPath() if solo else install_fastpath(self.model)
        # a plain Llama-family decoder's eager step as one flat loop, once a step proves it equal (engine/flat.py)
        self._tensor_parallel = tensor_parallel
        self._flat: FlatDecoder | None = None
        self.flat_step = self._build_flat()

    def _build_compiled(self, use_compile: bool, options: RunnerConfig) -> None:
        """CPU: every step kind through one compiled packed forward; CUDA: decode steps as CUDA graphs."""
        self._compiled_step = CompiledStep(self.model, self._cache, self._cache_kwarg, options.max_num_batched_tokens,
                                           self.device, onednn=self._onednn, prepack=self._prepack) \
            if use_compile and self.device.type == "cpu" else None
        self._compiled = CompiledDecode(self.model, self._cache, self._cache_kwarg, options.max_num_seqs,
                                        self.device) if use_compile and self._compiled_step is None else None

    # ------------------------------------------------------------- public
    @property
    def compiled_steps(self) -> int:
        """Steps that ran through a compiled forward."""
        return sum(x.steps for x in (self._compiled, self._compiled_step) if x is not None)

    @property
    def weights_version(self) -> int:
        """How many weight changes the runner has seen."""
        return self._weights.version

    def weights_changed(self, full: bool = True) -> bool:
        """Whether the model's weights changed since the last check (the caller then drops the KV computed
        with the old ones and calls :meth:`refresh_weights`)."""
        return self._weights.changed(full=full)

    def refresh_weights(self, everything: bool | None = None) -> None:
        """After a weight change: repack the packed copies (all of them, or by default what the watcher saw
        change) and rebuild the flat step (its modules may have been replaced: verified again)."""
        if self._prepack is not None:
            self._prepack.refresh(everything=not self._weights.per_tensor if everything is None else everything)
        self.flat_step = self._build_flat()

    def run(self, schedule: Schedule, extra_rows: Sequence[int] = ()) -> torch.Tensor:
        """:meth:`_run` with the step's intra-op threads chosen by the :class:`ThreadGovernor` (one thread
        while other processes keep the cores busy; the caller's count otherwise and after the step)."""
        self.threads.begin()
        try:
            return self._run(schedule, extra_rows)
        finally:
            self.threads.end()

    def _run(self, schedule: Schedule, extra_rows: Sequence[int] = ()) -> torch.Tensor:
        """One step's forward. Logits (emitting rows + len(extra_rows), vocab): each emitting chunk's last
        row (a verification chunk's last 1 + len(draft) rows), then the packed rows ``extra_rows`` (prompt
        logprobs). Every chunk's ``seq.num_computed`` is advanced (past its own tokens, not its proposed
        ones); on failure the schedule is rolled back and the error re-raised."""
        chunks = schedule.chunks
        ids, pos, keep = step_inputs(schedule, extra_rows)
        if self._solo is not None:
            return self._solo_forward(schedule, keep)
        if self.states is not None:
            return self._stateful_forward(schedule, keep)
        compiled = self._compiled if not extra_rows else None
        images = any(_carries_images(c) for c in chunks)
        try:
            self.ensure_patched()
            seq_ids = [c.seq.seq_id for c in chunks]
            if images:  # image rows: the model's eager forward on inputs_embeds (engine/multimodal.py)
                plan = self.kv.plan(seq_ids, [c.num_tokens for c in chunks], allocated=True)
                plan.two_way = two_way_spans([(c.seq.group.mm, c.start, c.start + c.num_tokens) for c in chunks])
                self._cache.set_plan(plan, self.device)
                position_ids = _image_step_positions(chunks, pos).to(self.device)
                keep_rows = torch.tensor(keep, dtype=torch.long, device=self.device)
                with torch.inference_mode(), self._positions_for(position_ids), \
                        onednn_scope(self._onednn, self._prepack), fastpath_scope(self.fastpath.any):
                    logits = self._embeds_logits(schedule, torch.tensor([ids], device=self.device), position_ids,
                                                 keep_rows)
            elif self._compiled_step is not None and self._compiled_step.eligible(len(ids)):
                plan = self.kv.plan(seq_ids, [c.num_tokens for c in chunks], allocated=True)
                with torch.inference_mode():
                    logits = self._compiled_step.forward(plan, ids, pos, keep)
            elif compiled is not None and compiled.eligible([c.num_tokens for c in chunks],
                                                            [c.emits for c in chunks]):
                with torch.inference_mode():
                    logits = compiled.forward(compiled.plan(self.kv, seq_ids), ids, pos)
            else:
                plan = self.kv.plan(seq_ids, [c.num_tokens for c in chunks], allocated=True)
                self._cache.set_plan(plan, self.device)
                position_ids = torch.tensor([pos], device=self.device)
                keep_rows = torch.tensor(keep, dtype=torch.long, device=self.device)
                with torch.inference_mode(), self._positions_for(position_ids), \
                        onednn_scope(self._onednn, self._prepack), fastpath_scope(self.fastpath.any):
                    logits = self._eager_logits(torch.tensor([ids], device=self.device), position_ids, keep_rows)
        except BaseException:
            self._cache.end_forward(ok=False)
            self._rollback(schedule)  # give back this step's slots: the cache is as before
            raise
        for c in chunks:  # a verification chunk's proposed tokens count once accepted (LLM._postprocess_spec)
            c.seq.num_computed = c.start + c.num_tokens - len(c.draft)
        return logits

    def states_after(self, parts: list[list[int]]) -> dict:
        """The recurrent states after feeding ``parts`` (token id lists) one forward after another to a fresh
        cache."""
        cache = self._new_cache()
        with torch.inference_mode():
            for part in parts:
                self.model(input_ids=torch.tensor([part], device=self.device), use_cache=True,
                           **{self._cache_kwarg: cache})
        return cache.read_states()[0]

    def ensure_patched(self) -> None:
        """Re-patch if someone unpatched the model (or switched its attention) since the last step."""
        if not is_patched(self.model) or attention_switched(self.model):
            unpatch(self.model)
            patch(self.model)

    # ------------------------------------------------------------- inner
    def _eager_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      keep_rows: torch.Tensor) -> torch.Tensor:
        """An eager step's kept logits rows (K, V) from input_ids / position_ids (1, T): through the flat loop
        once verified, else the model's forward (which verifies the loop on the first step that can)."""

        def module_forward() -> torch.Tensor:
            logits = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                                logits_to_keep=keep_rows, **{self._cache_kwarg: self._cache}).logits[0]
            return kept_rows(logits, keep_rows, self._keeps_logits)

        flat = self._flat
        if flat is None or flat.failed is not None:
            return module_forward()
        if flat.usable():
            logits = flat.forward(self._cache, input_ids, position_ids, keep_rows)
            self._cache.end_forward(ok=True)
            self.flat_steps += 1
            return logits
        if flat.verified or (self._prepack is not None and self._prepack.state == "probe"):
            return module_forward()  # a hook was added since; or the step that finds the linears to pack
        logits = flat.verify(self._cache, module_forward, input_ids, position_ids, keep_rows)
        if flat.failed is not None:
            self.flat_step = f"off: {flat.failed}"
            # frames: here, run(), LLM._step(), then LLM.step() / generate()'s loop
            warnings.warn(f"flashpage.LLM: the flat eager step of {type(self.model).__name__} is off "
                          f"({flat.failed}); steps run the model's forward", stacklevel=4)
        else:
            self.flat_step = "on: verified equal to the model's forward"
        return logits

    def _embeds_logits(self, schedule: Schedule, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       keep_rows: torch.Tensor) -> torch.Tensor:
        """A step carrying image rows: the token embedding of the step's ids (1, T) with each request's image
        rows put back at their positions, through the model's forward as ``inputs_embeds``."""
        embeds = self.model.get_input_embeddings()(input_ids)
        offset = 0
        spans = [(c.seq.group.mm, c.start, c.start + c.num_tokens) for c in schedule.chunks]
        for mm, start, end in spans:
            if mm is not None:
                mm.put(embeds[0], offset, start, end)
            offset += end - start
        deep = deepstack_kwargs(spans, offset, embeds.device)  # Qwen3-VL: its visual rows of this step
        extra = per_layer_kwargs(self.model, input_ids, embeds)  # Gemma 4: per-layer inputs from the ids
        with language_model_inputs(self.model, deep):
            logits = self.model(inputs_embeds=embeds, position_ids=position_ids, use_cache=True,
                                logits_to_keep=keep_rows, **extra, **{self._cache_kwarg: self._cache}).logits[0]
        return kept_rows(logits, keep_rows, self._keeps_logits)

    def _build_flat(self) -> str:
        """(Re)build the flat eager step (after a weight change: modules may have been replaced; the same
        modules keep their verified loop); says why there is none."""
        old, self._flat = self._flat, None
        if self.states is not None or self._positions is not None or not self._keeps_logits \
                or self._tensor_parallel or self._solo_steps:
            return "off: recurrent layers, own positions / logits rows, tensor parallel, or solo steps"
        flat = flat_decoder(self.model)
        if isinstance(flat, str):
            return f"off: {flat}"
        if old is not None and old.modules == flat.modules and (old.verified or old.failed is not None):
            self._flat = old
            return self.flat_step
        self._flat = flat
        return "on once a step verifies it"

    def _positions_for(self, position_ids: torch.Tensor):
        """Give decoders that derive positions from the cache's length (BART family) the step's own."""
        return self._positions.step(position_ids) if self._positions is not None else contextlib.nullcontext()

    def _new_cache(self) -> HFPagedCache:
        """A fresh generate()-style cache for probes (recurrent state in the model's modules included)."""
        return new_probe_cache(self.model)

    def _solo_forward(self, schedule: Schedule, keep: list[int]) -> torch.Tensor:
        """A model only generate()'s layout is exact on: one [1, L] forward per chunk (engine/solo.py)."""
        assert self._solo is not None
        try:
            self.ensure_patched()
            with torch.inference_mode():  # the model's own forward, as generate() runs it (no fused ops)
                logits = solo_forward(self._solo, schedule.chunks, keep)
        except BaseException:
            self._rollback(schedule)
            restart_solo_step(self._solo, schedule.chunks)
            raise
        for c in schedule.chunks:
            c.seq.num_computed = c.start + c.num_tokens
        return logits

    def _stateful_forward(self, schedule: Schedule, keep: list[int]) -> torch.Tensor:
        """A model with recurrent layers: decodes as [B, 1] rows, other chunks alone (engine/states.py)."""
        assert self.states is not None
        try:
            self.ensure_patched()
            with torch.inference_mode():
                logits = stateful_forward(self.model, self.kv, self._cache, self._cache_kwarg, self.device,
                                          self.states, schedule.chunks, keep, self._token_by_token)
        except BaseException:
            self._cache.end_forward(ok=False)
            self._rollback(schedule)
            # some forwards of the step may have advanced states: those sequences start over
            restart_from_scratch([c.seq for c in schedule.chunks], self.kv, self.states)
            raise
        for c in schedule.chunks:
            c.seq.num_computed = c.start + c.num_tokens
        return logits


def _carries_images(chunk: Chunk) -> bool:
    """Whether a chunk needs the image step: it covers image rows, or its request has M-RoPE positions."""
    mm = chunk.seq.group.mm
    return mm is not None and (mm.mrope is not None or mm.overlaps(chunk.start, chunk.start + chunk.num_tokens))


def _image_step_positions(chunks: Sequence[Chunk], pos: list[int]) -> torch.Tensor:
    """An image step's position ids: (1, T), or (3, 1, T) where a request has M-RoPE positions (its own rows from
    the model's computation, the others' 1-D positions repeated)."""
    if not any(c.seq.group.mm is not None and c.seq.group.mm.mrope is not None for c in chunks):
        return torch.tensor([pos])
    parts = []
    for c in chunks:
        mm = c.seq.group.mm
        if mm is not None and mm.mrope is not None:
            parts.append(mm.rope_positions(c.start, c.start + c.num_tokens))
        else:
            parts.append(torch.arange(c.start, c.start + c.num_tokens).expand(3, -1))
    return torch.cat(parts, 1)[:, None, :]
