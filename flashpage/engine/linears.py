"""oneDNN for the engine's float32 linears on CPU (what vLLM's CPU backend does); half-precision linears.

torch's ``F.linear`` on CPU float32 calls MKL's sgemm, which on some CPUs (AMD EPYC here) runs
2-2.3x slower than oneDNN's matmul on the same shapes (measured: x (256, 512) @ W (1376, 512)^T,
1 thread: 24.8 ms vs 10.8 ms; (32, 512) @ (8192, 512)^T: 31.3 vs 14.2 ms). Linears are 55-60% of an
engine step on CPU (``flashpage bench breakdown``), so ``LLM`` runs them through
``torch.ops.mkldnn._linear_pointwise`` during its own eager forwards.

How: each eligible ``nn.Linear`` (CPU, float32, 2-D weight, no forward override of its own) gets an
instance ``forward`` that takes oneDNN only inside :func:`onednn_scope` on the calling thread, and
``F.linear`` everywhere else (``model.generate()``, training, another thread, torch.compile traces
other than the engine's: inductor cannot lower the op on non-constant weights), so the model outside
the engine computes exactly what it did. A compiled engine step traces them to the opaque
``flashpage::onednn_linear`` op (:func:`compiled_scope`). Results differ from MKL's by float32
rounding (~1e-6 relative), like any two GEMM libraries. ``FLASHPAGE_CPU_LINEAR=torch`` turns it off.
A step of at most :data:`SMALL_ROWS` rows (decodes of one to four sequences) skips oneDNN, whose call costs
about 25 us more than the work at hidden 256: it runs :mod:`flashpage.kernels.cpu_fused`'s ``small_linear``
(each weight row read once for all rows, AVX2 + FMA) when those ops are loaded, else ``F.linear`` for one row
(MKL's GEMV). Measured, 1 thread, AMD EPYC (AVX2), us per call, oneDNN packed / F.linear / small_linear:
hidden 256, one row: q/k/v 40 / 16 / 11, gate/up 57 / 39 / 25, LM head (4096) 113 / 108 / 65; four rows:
q/k/v 49 / 37 / 20, gate/up 86 / 99 / 51; hidden 512, four rows: gate/up 256 / 372 / 189, down 137 / 162 / 140.
A GEMM whose original weights were paged out after packing (below) runs its few-row steps on the packed weight
instead, so they stay out; fewer than :data:`PACKED_MIN_ROWS` rows then run zero-padded to four, oneDNN's
four-row call on a packed weight being faster than its one- or two-row one. Measured at Qwen3-0.6B's widths
(hidden 1024; q/k/v fused 1024 -> 4096, o 2048 -> 1024, gate/up fused 1024 -> 6144, down 3072 -> 1024; 8 layers
streamed from memory), 1 thread, AMD EPYC, a shared machine (thread CPU time, best of 9 alternating rounds),
a layer's four GEMMs, packed (padded) / small_linear on the originals: one row 1.29x (unpadded 1.37x), two 0.96x
(1.25x), three 0.91x, four 0.76x.

bfloat16 / float16 linears (the dtype checkpoints ship in) take the same scoped forward: a step of at most
:data:`HALF_SMALL_ROWS` rows runs ``small_linear`` in half precision (float32 sums of exact products, one rounding;
AVX-512 BF16 ``vdpbf16ps`` where the CPU has it), everything else ``F.linear`` (torch's bfloat16 GEMM, oneDNN).
Measured, 1 thread, AMD EPYC (Zen 4) with avx512_bf16 (thread CPU time, best of 5 alternating rounds, a quiet host),
the Qwen3-0.6B shape's q/k/v, o, gate/up and down weights x 8 layers, bf16, streamed from memory, F.linear /
small_linear time: one row 2.08x, eight 1.81x, 32 1.37x, 96 1.10x, 128 1.05x, 192 1.02x, 256 1.00x, 512 0.99x:
hence :data:`HALF_SMALL_ROWS` 192. The kernel ran 159-179 GF/s at 32-128 rows before its accumulators' lanes were
added by transposing trees and its rows taken in passes that fit L2 (``half_linear.h``), 174-208 GF/s at 32-512
rows since; oneDNN with packed weights (what vLLM's CPU backend runs) is 2-5% faster than it at 96-512 rows and
slower at 32 rows and fewer. A packed copy of a weight that stays resident is the weight's size again (the memory
goal is weights + KV pool + 1 GiB), so half-precision weights are never packed (``_packable``: float32 only) and
never copied to float32. Tried for the steps above :data:`HALF_SMALL_ROWS` and not adopted (same setup, 4 layers,
best of 3; F.linear 205-216 GF/s, packed oneDNN 220-224 at 192-2048 rows): an outer-product kernel that packs x
into pairs of bfloat16 per call and broadcasts the plain weights' pairs (no weight copy) ran 208-212 GF/s, level
with F.linear, and at most 219 with its transposing copy-out left out (a result no longer correct); reordering
the weight on every call, then oneDNN's packed call, ran 134 GF/s at 192 rows and 212 at 2048, never ahead of
F.linear.

On a CPU without AVX-512 (AVX2: AMD Zen 2 / 3, many Intel parts) torch's bfloat16 / float16 GEMM is scalar code: at
Qwen3-0.6B's widths, 1 thread, AMD EPYC (Zen 3), ``F.linear`` in bfloat16 ran 8-10 GF/s at 1-1536 rows, against
76-86 GF/s for its float32 GEMM at 192 rows and more. There ``small_linear`` (built without AVX-512) widens instead:
steps of at most 24 rows read the half weights in place (8 halves widened per load, float32 FMAs), larger ones widen
the weights a 1 MiB block at a time and run torch's float32 GEMM on each block (``half_linear.h``); it is the faster
linear at every row count there (``Ops.half_any_rows``: x86-64 builds without AVX-512), so every half-precision step
takes it. Measured the same way (4 layers' q/k/v, o, gate/up and down weights, thread CPU time, best of 3), GF/s,
the float32 dot products on widened rows it replaced / it: one row 8.0 / 13.5, eight 14.9 / 42.3, 32 21.6 / 53.2,
192 21.0 / 77.0, 512 22.4 / 80-83, 1536 21.1 / 73-78. The weights stay as loaded: no float32 copy is kept (a 1 MiB
block at a time, in scratch). Other architectures keep torch's GEMM above :data:`HALF_SMALL_ROWS` rows (their torch
may have a native bfloat16 one).

Packed and fused weights (:class:`Prepacked`, ``LLM(cpu_prepack=...)``): as vLLM's CPU backend, the
engine keeps each weight in oneDNN's blocked layout (packed once, not reordered on every call), and
stacks sibling linears that read the same input tensor (q/k/v, gate/up; found by a probe of the first
step, never by name) into one GEMM whose output is split into views. The copies live in the engine,
not in the model; they are repacked when the :class:`~flashpage.engine.weights.WeightWatcher` sees
the weights change (only the changed GEMMs when the change shows on the tensors themselves).

Released originals (``Prepacked.release``, on by default): once a GEMM is packed, engine steps read only its packed
weight (the watcher reads version counters and storage pointers, never data; the compiled step's table is keyed by
pointers), so the members' original weights are paged out right after each pack
(:func:`flashpage.cpu_memory.page_out`, ``madvise(MADV_PAGEOUT)``). That releases memory where the weights lie in a
file mapping: a float32 checkpoint loaded in its own dtype (transformers maps safetensors files privately). The
pages stay the file's: ``llm.model``, a patched ``generate()``, a trainer reads them back transparently. Pages
written since loading (a weight update: copy on write) and weights in anonymous memory (a model built or converted
in memory) stay resident; ``Prepacked.released()`` says how many bytes the resident set shrank by. A weight that
shares its memory with a tensor the steps still read whole is never paged out; an LM head tied to the embedding is
(a lookup reads only its tokens' rows, which come back a page each): to the page cache only, so a token seen for the
first time maps its page back without reading the file (:class:`ReleaseSpans`). A linear alone with more than
:data:`SPLIT_OUT` outputs (an LM head) is packed in parts, each part's rows paged out right after it is packed, so
the process never holds the whole original beside its copy. After a weight change the repacked GEMMs are paged out
again. A fused pack's stacked temporary is handed back to the OS (``malloc_trim``), which the heap would otherwise
keep.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from flashpage import cpu_memory
from flashpage.engine.weights import tensor_version
from flashpage.kernels import cpu_fused

_STATE = threading.local()
ENV = "FLASHPAGE_CPU_LINEAR"
SMALL_ROWS = 4  # steps of at most this many rows skip oneDNN (see the module docstring); 0: never (an A/B switch)
# bfloat16 / float16 steps of at most this many rows take the C++ small-M kernel (see the module docstring); 0: never
HALF_SMALL_ROWS = 192
PACKED_MIN_ROWS = 4  # a packed GEMM's call of fewer rows runs zero-padded to this many (see _packed_call)
_HALF = (torch.bfloat16, torch.float16)


def _active() -> bool:
    return getattr(_STATE, "depth", 0) > 0


def _resolve_linear_pointwise() -> Any:
    """oneDNN's linear op as the hot path calls it: its ``default`` overload, bound once (a call through the
    overload packet picks the overload again on every call; both run the same kernel); the packet where this torch
    has no ``default`` overload; a late lookup where it has no such op (never called then: see
    :func:`onednn_available`)."""
    packet = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if packet is None:
        return lambda *args: torch.ops.mkldnn._linear_pointwise(*args)
    return getattr(packet, "default", packet)


_LINEAR_POINTWISE = _resolve_linear_pointwise()
_FLOAT32 = torch.float32
_is_compiling = torch.compiler.is_compiling


def _linear_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) through oneDNN's linear with ``weight`` (plain (out, in) or packed): (..., out)."""
    return _LINEAR_POINTWISE(x.contiguous(), weight, bias, "none", [], "")


def _packed_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`_linear_call` on a packed weight; fewer than :data:`PACKED_MIN_ROWS` rows run zero-padded to that
    many (the padding rows' outputs dropped): oneDNN's one- and two-row calls on a packed weight are slower than
    its four-row one (see the module docstring)."""
    width = x.shape[-1]
    numel = x.numel()
    if numel >= PACKED_MIN_ROWS * width or not numel:  # rows = numel // width not in 1 .. PACKED_MIN_ROWS - 1
        return _linear_call(x, weight, bias)
    rows = numel // width
    flat = x.reshape(rows, width)
    padded = torch.cat([flat, flat.new_zeros(PACKED_MIN_ROWS - rows, width)])
    return _linear_call(padded, weight, bias)[:rows].reshape(*x.shape[:-1], -1)


def _split_call(x: torch.Tensor, parts: tuple[torch.Tensor, ...], bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`_packed_call` on each part of a wide linear's packed weight (:attr:`PackedGemm.parts`), the outputs
    side by side: (..., out). The bias is added after (the same float32 sum oneDNN's epilogue would round once)."""
    out = torch.cat([_packed_call(x, part, None) for part in parts], -1)
    return out.add_(bias) if bias is not None else out


def _few_rows(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """(..., in) with at most SMALL_ROWS rows -> (..., out) through the C++ small-M kernel (once the fused ops are
    loaded), or F.linear (MKL's GEMV) for one row; None: the caller's oneDNN call."""
    ops = cpu_fused.loaded()
    weight = module.weight
    if ops is not None and weight.is_contiguous():
        return ops.small_linear(x, weight, module.bias)
    if x.numel() == x.shape[-1]:
        return F.linear(x, weight, module.bias)
    return None


def _half_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """(..., in) -> (..., out) for bfloat16 / float16 x and weight inside an engine step: the C++ small-M kernel for
    at most :data:`HALF_SMALL_ROWS` rows (float32 sums, one rounding; AVX-512 BF16 where the CPU has it), else
    ``F.linear`` (torch's bfloat16 GEMM: oneDNN); the C++ kernel at every row count where it widens to float32 GEMMs
    (builds without AVX-512: ``ops.half_any_rows``). No packed or float32 copy of the weight is kept."""
    ops = cpu_fused.loaded()
    if (ops is not None and (ops.half_any_rows or x.numel() <= HALF_SMALL_ROWS * x.shape[-1])
            and module.weight.is_contiguous() and x.dtype == module.weight.dtype):
        packs = _STATE.packs
        if packs is not None:
            packs.observe(module, x)
        return ops.small_linear(x, module.weight, module.bias)
    return F.linear(x, module.weight, module.bias)


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """(..., in) -> (..., out): oneDNN inside an engine step on this thread (traced: inside a compiled
    engine step, as an opaque op), else F.linear."""
    if _is_compiling():
        if _COMPILED_ONEDNN and x.dtype == torch.float32:
            return onednn_linear_op(x, self.weight, self.bias)
    elif _active():
        dtype = x.dtype
        if dtype is _FLOAT32:
            packs = _STATE.packs
            # decodes of one to a few sequences: no oneDNN call overhead, unless the original weight was paged out
            if x.numel() <= SMALL_ROWS * x.shape[-1] and (packs is None or not packs.paged_out(self)):
                out = _few_rows(self, x)
                if out is not None:
                    if packs is not None:
                        packs.observe(self, x)  # a probe step still learns the siblings (and packs after it)
                    return out
            if packs is not None:
                out = packs.linear(self, x)
                if out is not None:
                    return out
            return _linear_call(x, self.weight, self.bias)
        if dtype in _HALF:
            return _half_forward(self, x)
    return F.linear(x, self.weight, self.bias)


def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear and it computes F.linear's result (checked once)."""
    if os.environ.get(ENV, "").lower() == "torch":
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
        got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5))


def install_onednn_linears(model: Any) -> int:
    """Give the model's eligible linears the scoped oneDNN forward (idempotent); returns how many have it."""
    if not onednn_available():
        return 0
    count = 0
    half = False
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        own = vars(module).get("forward")
        if own is not None and getattr(own, "__func__", None) is _onednn_forward:
            count += 1
            continue
        w = module.weight
        if own is not None or w.device.type != "cpu" or w.dtype not in (torch.float32, *_HALF) or w.dim() != 2:
            continue
        module.forward = types.MethodType(_onednn_forward, module)
        half = half or w.dtype in _HALF
        count += 1
    if half:
        cpu_fused.load()  # the half-precision small-M kernel (built once per machine; None: F.linear runs)
    return count


def uninstall_onednn_linears(model: Any) -> int:
    """Take the oneDNN forwards :func:`install_onednn_linears` gave ``model``'s linears back off (each is a bound
    method of its linear: a reference cycle); returns how many."""
    removed = 0
    for module in model.modules():
        if getattr(vars(module).get("forward"), "__func__", None) is _onednn_forward:
            del module.forward
            removed += 1
    return removed


@contextlib.contextmanager
def onednn_scope(enabled: bool = True, packs: Prepacked | None = None) -> Iterator[None]:
    """Linears with the oneDNN forward use it inside this block, on this thread; with ``packs``, through
    its packed (and fused) weights (the first such block probes which linears are siblings, then packs)."""
    if not enabled:
        yield
        return
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    previous = getattr(_STATE, "packs", None)
    _STATE.packs = packs
    if packs is not None:
        packs.begin_step()
    ok = False
    try:
        yield
        ok = True
    finally:
        _STATE.depth -= 1
        _STATE.packs = previous
        if packs is not None:
            packs.end_step(ok)


# ------------------------------------------------------------------ compiled graphs
# Inductor lowers F.linear on CPU to MKL's sgemm (the slow library here), and cannot lower
# mkldnn._linear_pointwise on weights that are graph inputs (only frozen ones, which would go stale
# when the weights change). A compiled engine step therefore calls oneDNN through this opaque op,
# which reads the current weights on every call.
_COMPILED_ONEDNN = False  # a plain global: dynamo guards on its value (thread-locals break the graph)
# weight data_ptr -> (that weight, its packed copy): read by the op when it runs, never traced (no guard),
# so a repack changes what the next step uses without a recompile
_COMPILED_PACKS: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


@torch.library.custom_op("flashpage::onednn_linear", mutates_args=())
def onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ weight (out, in)^T + bias (out,) through oneDNN: (..., out); with the weight's packed
    copy when the engine's :class:`Prepacked` has one (see :func:`compiled_scope`)."""
    packed = _compiled_pack(weight)
    return _linear_call(x, weight if packed is None else packed, bias)


def _compiled_pack(weight: torch.Tensor) -> torch.Tensor | None:
    table = _COMPILED_PACKS
    hit = table.get(weight.data_ptr()) if table else None
    if hit is None or hit[0].shape != weight.shape or hit[0].stride() != weight.stride() \
            or hit[0].dtype != weight.dtype:
        return None
    return hit[1]


@onednn_linear_op.register_fake
def _onednn_linear_fake(x, weight, bias) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def compiled_onednn() -> bool:
    """Whether a forward being traced now should call :func:`onednn_linear_op` (see :func:`compiled_scope`)."""
    return _COMPILED_ONEDNN


@contextlib.contextmanager
def compiled_scope(enabled: bool = True, packs: Prepacked | None = None) -> Iterator[None]:
    """Linears with the oneDNN forward trace to :func:`onednn_linear_op` inside this block (on this thread);
    with ``packs``, the op runs on their packed weights (one per linear: no fused siblings in a graph)."""
    global _COMPILED_ONEDNN, _COMPILED_PACKS
    previous = _COMPILED_ONEDNN, _COMPILED_PACKS
    _COMPILED_ONEDNN = enabled
    _COMPILED_PACKS = packs.compiled_table() if enabled and packs is not None else None
    try:
        yield
    finally:
        _COMPILED_ONEDNN, _COMPILED_PACKS = previous


# ------------------------------------------------------------------ packed and fused weights
# oneDNN reorders a plain (out, in) weight into its blocked layout on every call; vLLM's CPU backend
# packs each weight once; ``_reorder_linear_weight(w, batch_hint)`` does that here. Measured (1 thread,
# AMD EPYC, AVX-512; docs/benchmarks.md): hint 32 is within noise of the best hint at M = 1..2048 and
# never slower than the plain weight, so one pack serves decode and prefill steps alike.
PREPACK_ENV = "FLASHPAGE_CPU_PREPACK"
RELEASE_ENV = "FLASHPAGE_CPU_PREPACK_RELEASE"  # "0": keep the packed GEMMs' original weights resident
PACK_BATCH_HINT = 32
# a linear alone with more outputs than this (an LM head) is packed in parts of this many outputs (see PackedGemm)
SPLIT_OUT = 32768
AUTO_MEMORY_SHARE = 0.25  # "auto" packs when the copies take at most this share of available memory


def _release_default() -> bool:
    return os.environ.get(RELEASE_ENV, "1") != "0"


def _prepack_env() -> tuple[str | None, str]:
    """``FLASHPAGE_CPU_PREPACK`` as (what it asks: "off", "on", "unfused" or None for unset / unknown, its value)."""
    env = os.environ.get(PREPACK_ENV, "").strip().lower()
    if env in ("0", "false", "off", "no"):
        return "off", env
    if env in ("1", "true", "on", "yes"):
        return "on", env
    return ("unfused" if env == "unfused" else None), env


def _tensor_key(t: torch.Tensor | None) -> tuple:
    """What a weight is now: its object, storage, in-place version, shape and dtype (no data read)."""
    if t is None:
        return ()
    return id(t), t.data_ptr(), tensor_version(t), tuple(t.shape), t.dtype, t.device.type


def _packable(module: torch.nn.Linear) -> bool:
    w = module.weight
    b = module.bias
    plain = type(w) in (torch.Tensor, torch.nn.Parameter)  # not a DTensor (tensor parallel) or other subclass
    return (plain and w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
            and (b is None or (b.dtype == torch.float32 and b.device.type == "cpu" and b.dim() == 1)))


@dataclass
class PackedGemm:
    """One packed GEMM: one linear, or sibling linears fused (weights stacked along ``out``).

    Attributes:
        members: the linears, in the order a step calls them (the first computes everyone's output).
        sizes: each member's ``out_features``; the GEMM's output (..., sum(sizes)) splits into them.
        weight: oneDNN's packed (sum(sizes), in) weight; None while not packable (runs unpacked).
        bias: (sum(sizes),) stacked biases (zeros for a member without one), the member's own bias
            (a single linear), or None.
        key: the members' weights and biases as they were when packed (:func:`_tensor_key`).
        released: bytes the process's resident set shrank by when the members' original weights were paged
            out after the latest pack (:meth:`release`); 0: the originals stay resident (anonymous memory,
            not released, or read by something else) and few-row steps read them.
        parts: a linear alone with more than :data:`SPLIT_OUT` outputs (an LM head), packed in parts of that many
            outputs (``weight`` None): its GEMM is one call per part, outputs side by side. Each part's rows of
            the original are paged out right after that part is packed, so a packed copy never sits beside the
            whole original (the peak a 151936 x 1024 float32 LM head would add: 593 MiB; a part: 128 MiB). Also
            faster: measured, 1 thread, AMD EPYC, the Qwen3-0.6B LM head (151936 x 1024, float32), parts of
            4096-32768 outputs / one packed weight: 20 rows 0.90-0.92x the time, 4 rows 0.72-0.79x, 64 rows 0.96x,
            256 rows 0.99-1.03x.
        split: pack a wide linear in parts (False for the compiled step's table, which maps one weight to one
            packed copy).
    """

    members: tuple[torch.nn.Linear, ...]
    sizes: tuple[int, ...]
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    key: tuple = ()
    released: int = 0
    parts: tuple[torch.Tensor, ...] = ()
    split: bool = True

    def current_key(self) -> tuple:
        return tuple((_tensor_key(m.weight), _tensor_key(m.bias)) for m in self.members)

    def pack(self, pager: Pager | None = None) -> None:
        """(Re)build the packed weight from the members' current weights (all of them). ``pager`` pages out
        original rows and returns the bytes released: a GEMM packed in :attr:`parts` calls it after each part."""
        self.key = self.current_key()
        self.released = 0
        self.parts = ()
        if not all(_packable(m) for m in self.members):
            self.weight = self.bias = None
            return
        with torch.no_grad():
            if len(self.members) == 1:
                m = self.members[0]
                self.bias = m.bias.detach() if m.bias is not None else None
                weight = m.weight.detach()
                if not self.split or weight.shape[0] <= SPLIT_OUT:
                    self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
                    return
                self.weight, parts = None, []
                for rows in weight.split(SPLIT_OUT):
                    parts.append(torch.ops.mkldnn._reorder_linear_weight(rows, PACK_BATCH_HINT))
                    if pager is not None:
                        self.released += pager(rows)
                self.parts = tuple(parts)
                return
            stacked = torch.cat([m.weight.detach() for m in self.members])
            self.weight = torch.ops.mkldnn._reorder_linear_weight(stacked, PACK_BATCH_HINT)
            if all(m.bias is None for m in self.members):
                self.bias = None
            else:
                self.bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(n)
                                       for m, n in zip(self.members, self.sizes, strict=True)])

    def nbytes(self) -> int:
        return sum(m.weight.numel() * m.weight.element_size() for m in self.members)

    def packed(self) -> bool:
        """Whether the GEMM runs on packed weights (one, or :attr:`parts`)."""
        return self.weight is not None or bool(self.parts)

    def release(self, spans: ReleaseSpans) -> int:
        """Page out the members' original weights once they are packed, as ``spans`` says (:meth:`ReleaseSpans.page`).
        Sets and returns :attr:`released` (a GEMM in :attr:`parts` paged its rows out while it was packed)."""
        if self.weight is None:
            return self.released
        self.released = spans.page(*[m.weight.detach() for m in self.members])
        return self.released


Pager = Callable[..., int]  # (*tensors) -> bytes released: pages out the original weights given (ReleaseSpans.page)


@dataclass(frozen=True)
class ReleaseSpans:
    """Where packed GEMMs' original weights may go, read once per (re)pack. Sorted byte ranges: ``kept``, tensors
    that engine steps still read whole (never paged out); ``looked_up``, embedding tables, read a row at a time (an
    LM head tied to one shares its memory): paged out of this process's mapping only, the page cache keeps them
    (``cpu_memory.page_out(keep_cached=True)``), so a lookup of a token not seen yet costs a minor fault, not a read
    of the file (measured here: 45 such reads a round, 7 ms each, 2.5% of a float32 Qwen3-0.6B round).
    ``files``: this process's file mappings (only their pages are paged out)."""

    kept: list[tuple[int, int]]
    looked_up: list[tuple[int, int]]
    files: list[tuple[int, int]]

    def page(self, *tensors: torch.Tensor) -> int:
        """A :data:`Pager`: pages out ``tensors`` but those overlapping :attr:`kept`, and returns the bytes the
        resident set shrank by (0 when nothing was advised or the resident set is unknown)."""
        out = [t for t in tensors if not _overlaps(_span(t), self.kept)]
        cached = [t for t in out if _overlaps(_span(t), self.looked_up)]
        dropped = [t for t in out if not _overlaps(_span(t), self.looked_up)]
        before = cpu_memory.resident_bytes()
        advised = 0
        if dropped:
            advised += cpu_memory.page_out(dropped, self.files)
        if cached:
            advised += cpu_memory.page_out(cached, self.files, keep_cached=True)
        after = cpu_memory.resident_bytes()
        return max(0, before - after) if advised and before is not None and after is not None else 0


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``t``'s elements lie in (its storage offset on, as far as its largest stride reaches)."""
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1 if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _overlaps(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether ``span`` overlaps one of ``spans`` (sorted by start; they may overlap each other)."""
    lo, hi = span
    return any(a < hi and lo < b for a, b in spans[:bisect.bisect_left(spans, (hi, hi))])


@dataclass
class _Probe:
    """The first packed step's record: runs of consecutive linear calls on one input tensor object.

    Attributes:
        runs: closed runs (linears that received the same tensor, with the same values, one after another).
        calls: how many times each linear (by id) was called in the step.
        seen: every linear called, in call order.
    """

    runs: list[list[torch.nn.Linear]] = field(default_factory=list)
    calls: dict[int, int] = field(default_factory=dict)
    seen: list[torch.nn.Linear] = field(default_factory=list)
    _x: torch.Tensor | None = None
    _snapshot: torch.Tensor | None = None
    _run: list[torch.nn.Linear] = field(default_factory=list)

    def record(self, module: torch.nn.Linear, x: torch.Tensor) -> None:
        first = id(module) not in self.calls
        self.calls[id(module)] = self.calls.get(id(module), 0) + 1
        if first:
            self.seen.append(module)
        same = (self._x is x and self._snapshot is not None and self._snapshot.shape == x.shape
                and torch.equal(self._snapshot, x))  # not written in place since the run began
        if same:
            self._run.append(module)
            return
        self.close()
        self._x, self._snapshot, self._run = x, x.detach().clone(), [module]

    def close(self) -> None:
        if len(self._run) > 1:
            self.runs.append(self._run)
        self._x = self._snapshot = None
        self._run = []


def sibling_groups(probe: _Probe, parents: dict[int, torch.nn.Module | None]) -> list[list[torch.nn.Linear]]:
    """Runs of the probe whose linears share one parent module, are each called once per step and are
    packable together (same input width); a run split where these break."""
    groups = []
    for run in probe.runs:
        current: list[torch.nn.Linear] = []
        for m in run:
            fits = (probe.calls[id(m)] == 1 and _packable(m) and m not in current
                    and (not current or (parents.get(id(m)) is parents.get(id(current[0]))
                                         and parents.get(id(m)) is not None
                                         and m.weight.shape[1] == current[0].weight.shape[1])))
            if fits:
                current.append(m)
                continue
            if len(current) > 1:
                groups.append(current)
            current = [m] if probe.calls[id(m)] == 1 and _packable(m) else []
        if len(current) > 1:
            groups.append(current)
    return groups


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_prepack_mode(mode: Any) -> bool | str:
    """``LLM(cpu_prepack=...)``: "auto", True or False, else a ValueError saying so."""
    if mode is True or mode is False or mode == "auto":
        return mode
    raise ValueError(f"LLM(cpu_prepack={mode!r}): expected 'auto', True or False (auto: pack the float32 CPU "
                     f"linears' weights for oneDNN when the copies take <= {AUTO_MEMORY_SHARE:.0%} of available "
                     f"memory; {PREPACK_ENV}=0 turns 'auto' off)")


def prepack_wanted(mode: bool | str, nbytes: int) -> tuple[bool, str]:
    """Whether to pack ``nbytes`` of weight copies under ``mode``, and why (for logs and tests)."""
    if mode is not True and mode is not False:
        asked, env = _prepack_env()
        if asked is not None:
            return asked != "off", f"{PREPACK_ENV}={env}"
        avail = available_memory()
        if avail is None:
            return False, "auto: available memory unknown"
        ok = nbytes <= AUTO_MEMORY_SHARE * avail
        return ok, f"auto: {nbytes / 2**20:.0f} MiB of copies {'<=' if ok else '>'} " \
                   f"{AUTO_MEMORY_SHARE:.0%} of {avail / 2**30:.1f} GiB available"
    return bool(mode), f"cpu_prepack={mode}"


def prepack_default() -> str:
    """What ``LLM(cpu_prepack="auto")`` does here, in words (``flashpage info``)."""
    asked, env = _prepack_env()
    said = {"off": "weights not packed", "unfused": "weights packed, siblings not fused",
            "on": "weights packed, siblings fused"}
    released = "; a packed GEMM's original weights paged out where they lie in a file mapping (checkpoint)"
    if asked is not None:
        return f"{said[asked]} ({PREPACK_ENV}={env}){released if asked != 'off' else ''}"
    return f"weights packed and siblings fused when the copies fit in {AUTO_MEMORY_SHARE:.0%} of available memory " \
           f"(LLM(cpu_prepack='auto'); {PREPACK_ENV}=0 turns it off){released}"


@dataclass
class Prepacked:
    """An engine's packed (and fused) copies of its model's float32 CPU linear weights.

    The first engine step inside :func:`onednn_scope` runs unpacked and records which linears receive
    the identical input tensor object one after another under one parent module (q/k/v, gate/up: no
    names involved); after it, each such run becomes one packed GEMM whose output is split (views) back
    to its members, and every other linear with the oneDNN forward gets its own packed weight. At run time a
    member other than a group's first gets its view only when it is called on that very tensor object
    (else: its unpacked oneDNN call). :meth:`refresh` repacks after a weight change; the model itself is
    never modified, and nothing is used outside the engine's scope.

    Once a GEMM is packed, engine steps no longer read its members' original weights: with ``release``, those
    are paged out (:meth:`PackedGemm.release`; only pages of a file mapping go, which the kernel reads back from
    the checkpoint if anything reads them later), and a few-row step of such a GEMM runs on the packed weight
    instead of ``small_linear`` on the original, so as not to fault it back in.

    Attributes:
        model: the model whose linears are packed.
        mode: ``"auto"``, True or False (see :func:`prepack_wanted`).
        fuse: stack sibling linears into one GEMM (False: every linear packed alone).
        release: page out the members' original weights after each pack (False: they stay resident; default
            on, ``FLASHPAGE_CPU_PREPACK_RELEASE=0`` turns it off).
        state: "probe" (the next step records), "packed", or "off".
        reason: why packing is on or off.
        gemms: the packed GEMMs.
    """

    model: torch.nn.Module
    mode: bool | str = "auto"
    fuse: bool = True
    release: bool = field(default_factory=_release_default)
    state: str = "probe"
    reason: str = ""
    gemms: list[PackedGemm] = field(default_factory=list)
    _by_module: dict[int, tuple[PackedGemm, int]] = field(default_factory=dict, repr=False)
    _probe: _Probe | None = field(default=None, repr=False)
    _pending: tuple[torch.Tensor, PackedGemm, list[torch.Tensor | None]] | None = field(default=None, repr=False)
    _steps_seen: int = -1
    _table: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode is False:
            self.state, self.reason = "off", "cpu_prepack=False"

    # ---------------------------------------------------------------- the hot path
    def linear(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
        """(..., in) -> (..., out) through the packed weights, or None: the caller runs it unpacked."""
        hit = self._by_module.get(id(module))
        if hit is None:
            probe = self._probe
            if probe is not None:
                probe.record(module, x)
            return None
        gemm, index = hit
        weight = gemm.weight
        if weight is None:
            parts = gemm.parts  # a wide linear alone, packed in parts (index 0)
            return _split_call(x, parts, gemm.bias) if parts else None
        if index == 0:  # a single linear, or a fused group's first member: its GEMM runs
            sizes = gemm.sizes
            if len(sizes) == 1:
                return _packed_call(x, weight, gemm.bias)
            # Tensor.split's own op for a tuple of sizes, without its Python wrapper
            parts: list[torch.Tensor | None] = list(_packed_call(x, weight, gemm.bias).split_with_sizes(sizes, -1))
            self._pending = (x, gemm, parts)
            return parts[0]
        pending = self._pending
        if pending is None or pending[0] is not x or pending[1] is not gemm:
            return None  # not the input the group's first member computed for: the member's own call
        parts = pending[2]
        out = parts[index]
        if out is None:
            return None  # already handed out on this input: the member's own call
        parts[index] = None
        return out

    def paged_out(self, module: torch.nn.Linear) -> bool:
        """Whether ``module``'s original weight was paged out after its pack (its steps then read the packed one)."""
        hit = self._by_module.get(id(module))
        if hit is None:
            return False
        gemm = hit[0]
        return gemm.released > 0 and gemm.packed()

    def observe(self, module: torch.nn.Linear, x: torch.Tensor) -> None:
        """A linear that ran without the packed weights (a step of few rows): the probe step records it all
        the same, so what is packed, and when, does not depend on the first step's size."""
        probe = self._probe
        if probe is not None:
            probe.record(module, x)

    def begin_step(self) -> None:
        """Called before a scoped step: the first one records the probe."""
        if self.state == "probe" and self._probe is None:
            self._probe = _Probe()

    def end_step(self, ok: bool = True) -> None:
        """Called when a scoped step ends: drop its pending outputs; pack after a probe step that completed
        (one that raised is probed again by the next step)."""
        self._pending = None
        probe, self._probe = self._probe, None
        if probe is not None and ok:
            probe.close()
            self._build(probe)

    # ---------------------------------------------------------------- building and refreshing
    def _build(self, probe: _Probe) -> None:
        if not probe.seen:
            return  # nothing called (a stateful step): probe the next one
        fuse = self.fuse and _prepack_env()[0] != "unfused"  # A/B of the fusion
        groups = sibling_groups(probe, _parents(self.model)) if fuse else []
        grouped = {id(m) for g in groups for m in g}
        # every other linear alone, those the probe step did not call too (MoE experts it did not route to)
        others = probe.seen + [m for m in self.model.modules() if _has_onednn_forward(m) and id(m) not in probe.calls]
        singles = [[m] for m in others if id(m) not in grouped and _packable(m)]
        self._use([PackedGemm(tuple(g), tuple(m.weight.shape[0] for m in g)) for g in groups + singles])

    def compiled_table(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
        """For a compiled step: each linear's weight (by data_ptr) and its packed copy. A compiled engine
        runs no probe step: every linear with the oneDNN forward is packed alone at its first call."""
        if self.state == "probe":
            self._use([PackedGemm((m,), (m.weight.shape[0],), split=False) for m in self.model.modules()
                       if _has_onednn_forward(m) and _packable(m)])
        if self.state != "packed":
            return None
        if self._table is None:
            self._table = {g.members[0].weight.data_ptr(): (g.members[0].weight, g.weight) for g in self.gemms
                           if len(g.members) == 1 and g.weight is not None}
        return self._table

    def _use(self, gemms: list[PackedGemm]) -> None:
        wanted, self.reason = prepack_wanted(self.mode, sum(g.nbytes() for g in gemms))
        if not wanted:
            self.state = "off"
            return
        spans = self._release_spans(gemms)
        for g in gemms:
            g.pack(self._pager(spans))
            self._release(g, spans)
        self.gemms = gemms
        self._by_module = {id(m): (g, i) for g in gemms for i, m in enumerate(g.members)}
        self._steps_seen = _optimizer_steps()
        self.state = "packed"

    def refresh(self, everything: bool = False) -> int:
        """After a weight change: repack what changed (every GEMM when ``everything``, or when an optimizer
        stepped since: fused optimizers write without bumping version counters). Returns GEMMs repacked."""
        if self.state != "packed":
            return 0
        steps = _optimizer_steps()
        everything = everything or steps != self._steps_seen
        self._steps_seen = steps
        self._table = None
        repacked = 0
        spans = self._release_spans(self.gemms)
        for g in self.gemms:
            if everything or g.current_key() != g.key:
                g.pack(self._pager(spans))
                self._release(g, spans)
                repacked += 1
        return repacked

    def _release(self, gemm: PackedGemm, spans: ReleaseSpans) -> None:
        """After ``gemm`` was packed: page out its originals (with :attr:`release`), and give the heap back the
        stacked temporary a fused pack freed (else every fused GEMM leaves a hole the steps never fill)."""
        if self.release:
            gemm.release(spans)
        if len(gemm.members) > 1 and gemm.weight is not None:
            cpu_memory.trim_heap()

    def _pager(self, spans: ReleaseSpans) -> Pager | None:
        """What a GEMM packed in parts pages its original rows out with (:attr:`release`), else None."""
        return spans.page if self.release else None

    def _release_spans(self, gemms: list[PackedGemm]) -> ReleaseSpans:
        """Kept: byte ranges of every parameter and buffer other than the weights of ``gemms``' members and of
        embeddings, each module's own (a weight tied to another module that is not packed is kept). An embedding's
        weight is not kept: a lookup reads only its tokens' rows (a page or two each), so an LM head tied to it is
        paged out with the rest, to the page cache (looked up), and the rows a step looks up come back one by one."""
        members = {id(m) for g in gemms for m in g.members}
        kept, looked_up = [], []
        for module in self.model.modules():
            embedding = isinstance(module, torch.nn.Embedding)
            for name, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is None or t.device.type != "cpu":
                    continue
                if name == "weight" and embedding:
                    looked_up.append(_span(t))
                elif not (name == "weight" and id(module) in members):
                    kept.append(_span(t))
        return ReleaseSpans(sorted(kept), sorted(looked_up), cpu_memory.file_mappings())

    def fused(self) -> list[tuple[torch.nn.Linear, ...]]:
        """The groups of linears that run as one GEMM."""
        return [g.members for g in self.gemms if len(g.members) > 1]

    def nbytes(self) -> int:
        """Bytes of the packed copies."""
        return sum(g.nbytes() for g in self.gemms if g.packed())

    def released(self) -> int:
        """Bytes the resident set shrank by when the packed GEMMs' original weights were paged out (their
        latest packs): 0 for weights in anonymous memory (a model built in memory or converted on load)."""
        return sum(g.released for g in self.gemms if g.packed())


def _has_onednn_forward(module: torch.nn.Module) -> bool:
    own = vars(module).get("forward")
    return type(module) is torch.nn.Linear and getattr(own, "__func__", None) is _onednn_forward


def _parents(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each submodule's parent module in the module tree, by id."""
    return {id(child): module for module in model.modules() for child in module.children()}


def _optimizer_steps() -> int:
    from flashpage.engine.weights import OPTIMIZER_STEPS

    return OPTIMIZER_STEPS.steps
