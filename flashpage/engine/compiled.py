"""Engine steps through a compiled forward.

CPU (:class:`CompiledStep`): every packed [1, T] step (prefill, mixed, decode) through one
``torch.compile(fullgraph=True)`` graph with T dynamic, as vLLM's CPU backend compiles its model:
attention and the K/V store are opaque ops that read the step's sequences outside the graph
(``flashpage/kernels/packed.py``), linears call oneDNN through an opaque op (``engine/linears.py``),
and inductor fuses what is left (norms, rotary, activations, residuals) and removes the Python
between ops. Weights stay graph inputs (nothing frozen), so updated weights are used at once.

CUDA (:class:`CompiledDecode`): a step in which every scheduled sequence adds one token is padded
to a batch-size bucket (1, 2, 4, 8, ... up to ``max_num_seqs``) and its block table to a width bucket (8, 16, 32, ...
blocks), so every step of a bucket has the same shapes: ``torch.compile(fullgraph=True,
dynamic=False)`` traces each bucket once, and on CUDA its ``"reduce-overhead"`` mode captures it
as a CUDA graph (as vLLM and nano-vllm do). Padding rows write nothing (slot -1) and see no key.
Prefill and mixed steps stay eager there (the packed attention op reads host state, which a CUDA
graph cannot replay).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from flashpage.cache import PagedKVCache, StepPlan
from flashpage.engine.linears import compiled_scope
from flashpage.kernels.packed import attend_packed, current_step
from flashpage.kernels.paged import store, store_op
from flashpage.plan import pad_decode

MIN_WIDTH_BLOCKS = 8


def _bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    return 1 << max(n - 1, floor - 1, 0).bit_length()


def default_compile(device: torch.device) -> bool:
    """Compile by default where it pays: on CUDA (CUDA graphs remove the per-kernel launch cost that
    dominates decode). On CPU the compiled step's one graph takes 30-120 s to compile and gains
    0.9-1.2x (docs/engine.md, compiling), so it is opt-in there (``LLM(compile=True)``)."""
    return device.type == "cuda"


@dataclass
class CompiledDecode:
    """The compiled forward and its bucket bookkeeping for one LLM."""

    model: Any
    cache: Any  # the engine's HFPagedCache
    cache_kwarg: str
    max_num_seqs: int
    device: torch.device
    fn: Any = None
    steps: int = 0
    shapes: set[tuple[int, int]] = field(default_factory=set)  # (batch bucket, width bucket) traced so far

    def __post_init__(self) -> None:
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        self.fn = torch.compile(self.model.forward, fullgraph=True, dynamic=False, mode=mode)

    def eligible(self, num_tokens: list[int], emits: list[bool]) -> bool:
        """Decode-only: one token per sequence, every one emitting, within the largest bucket."""
        return bool(num_tokens) and all(n == 1 for n in num_tokens) and all(emits) \
            and len(num_tokens) <= _bucket(self.max_num_seqs)

    def plan(self, kv: PagedKVCache, seq_ids: list[Any]) -> StepPlan:
        """The step's plan padded to its buckets (slots were allocated by the scheduler)."""
        widest = max(len(kv.blocks.block_table(s)) for s in seq_ids)
        width = _bucket(widest, MIN_WIDTH_BLOCKS)
        plan = kv.plan(seq_ids, [1] * len(seq_ids), allocated=True, table_width=width)
        rows = _bucket(len(seq_ids))
        self.shapes.add((rows, width))
        return pad_decode(plan, rows)

    def forward(self, plan: StepPlan, ids: list[int], pos: list[int]) -> torch.Tensor:
        """Run the padded step; returns logits (n, vocab) of the n real sequences."""
        from flashpage.patches.patching import planned_forward

        rows, n = plan.block_table.shape[0], len(ids)
        pad = rows - n
        input_ids = torch.tensor([ids + [0] * pad], device=self.device)
        position_ids = torch.tensor([pos + [0] * pad], device=self.device)
        keep = torch.arange(rows, device=self.device)
        self.cache.set_plan(plan, self.device)
        with planned_forward(self.model, self.cache):
            out = self.fn(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=keep,
                          **{self.cache_kwarg: self.cache})
        self.steps += 1
        return out.logits[0, :n]


# ------------------------------------------------------------------ every step kind (CPU)
@dataclass
class PackedStep:
    """What the layers of a compiled packed step see as the cache's step (duck-types
    :class:`flashpage.plan.DeviceStep`'s ``write`` / ``attend``).

    ``input_slots`` (Tp,) are the real step's slots padded with -1 to the bucket size Tp: the store
    writes nothing for padding. Attention goes through the opaque ``flashpage::attend_packed`` op,
    which reads the real step (:func:`flashpage.kernels.packed.current_step`), so nothing of the
    step but Tp reaches the graph."""

    plan: StepPlan
    input_slots: torch.Tensor

    def write(self, k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k (Tp, Hk, D) / v (Tp, Hk, Dv) at ``input_slots``."""
        if torch.compiler.is_compiling():
            store_op(k_pages, v_pages, k, v, self.input_slots, False)
        else:
            store(k_pages, v_pages, k, v, self.input_slots, False)

    def attend(self, query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: Any,
               s_aux: torch.Tensor | None = None) -> torch.Tensor:
        """query (1, H, Tp, D) -> (1, Tp, H, Dv)."""
        rows, heads, length, _ = query.shape
        flat = query.transpose(1, 2).reshape(rows * length, heads, -1)
        return attend_packed(flat, k_pages, v_pages, opts, s_aux).view(rows, length, heads, -1)


def step_kind(query_lens: list[int], context_lens: list[int]) -> str:
    """"decode" (every sequence adds one token after cached ones), "prefill" (none does) or "mixed"."""
    decodes = sum(1 for n, c in zip(query_lens, context_lens, strict=True) if n == 1 and c > 0)
    return "decode" if decodes == len(query_lens) else "prefill" if decodes == 0 else "mixed"


def token_buckets(max_tokens: int, floor: int = 8) -> list[int]:
    """The padded step sizes: powers of two from ``floor`` up to the first >= ``max_tokens``."""
    sizes = [floor]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] * 2)
    return sizes


@dataclass
class CompiledStep:
    """Every packed [1, T] engine step (prefill, mixed, decode) through one compiled forward.

    ``dynamic=False``: T is padded to the next of :func:`token_buckets` (one graph per size used);
    ``dynamic=True`` (the default; measured: one graph compiles in 30-120 s where the buckets took
    ~500 s, steps as fast): T is a dynamic dimension (one graph; two where transformers' mask code
    branches on T against a sliding window). Either way the number of rows whose
    logits are kept is dynamic, attention and the K/V store are opaque ops, and on CPU float32 the
    linears call oneDNN as the eager engine does (``flashpage::onednn_linear``). Weights are graph
    inputs (nothing frozen): a compiled step always computes with the current parameters."""

    model: Any
    cache: Any  # the engine's HFPagedCache
    cache_kwarg: str
    max_num_batched_tokens: int
    device: torch.device
    onednn: bool = False
    prepack: Any = None  # the engine's linears.Prepacked: the oneDNN op runs on packed weights
    dynamic: bool = True
    fn: Any = None
    steps: int = 0
    sizes: list[int] = field(default_factory=list)
    shapes: set[int] = field(default_factory=set)  # padded T of the steps run so far
    kinds: Counter = field(default_factory=Counter)  # steps run per kind: "prefill", "mixed", "decode"

    def __post_init__(self) -> None:
        self.sizes = token_buckets(self.max_num_batched_tokens)
        self.fn = torch.compile(self.model.forward, fullgraph=True, dynamic=False)

    def eligible(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` packed tokens runs compiled (every step the scheduler makes)."""
        return 0 < num_tokens <= self.sizes[-1]

    def padded(self, num_tokens: int) -> int:
        """The step's size in the graph: T itself (at least 2) when dynamic, else its bucket."""
        if self.dynamic:
            return max(num_tokens, 2)  # sizes 0 and 1 would be specialised
        return next(s for s in self.sizes if s >= num_tokens)

    def forward(self, plan: StepPlan, ids: list[int], pos: list[int], keep: list[int]) -> torch.Tensor:
        """Run the step planned by ``plan`` (tokens ``ids`` at positions ``pos``, packed); returns the
        logits (len(keep), V) of the packed rows ``keep``."""
        from flashpage.patches.patching import planned_forward

        t = len(ids)
        tp = self.padded(t)
        real = plan.to(self.device)
        # always a new tensor made here (inside the engine's inference mode): the plan's own were made
        # outside it, and a different dispatch key set would be a recompile
        slots = torch.cat([real.input_slots, real.input_slots.new_full((tp - t,), -1)])
        input_ids = torch.tensor([ids + [0] * (tp - t)], device=self.device)
        position_ids = torch.tensor([pos + [0] * (tp - t)], device=self.device)
        rows = torch.tensor(keep + [0] * (2 - len(keep)) if len(keep) < 2 else keep, dtype=torch.long,
                            device=self.device)
        torch._dynamo.maybe_mark_dynamic(rows, 0)
        if self.dynamic:
            for x in (input_ids, position_ids):
                torch._dynamo.maybe_mark_dynamic(x, 1)
            torch._dynamo.maybe_mark_dynamic(slots, 0)
        self.cache.set_plan(plan, self.device)
        self.cache.step = PackedStep(plan, slots)
        self.shapes.add(tp)
        self.kinds[step_kind(plan.query_lens, plan.context_lens)] += 1
        with planned_forward(self.model, self.cache), current_step(real), compiled_scope(self.onednn, self.prepack):
            out = self.fn(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=rows,
                          **{self.cache_kwarg: self.cache})
        self.steps += 1
        return out.logits[0, :len(keep)]
