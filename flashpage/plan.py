"""The step plan: everything one forward's attention needs, built once on the host, moved once.

A :class:`StepPlan` is made by :meth:`PagedKVCache.plan` after the block manager allocated the
step's slots. It knows how the forward's input is laid out (:class:`InputLayout`) and picks one
of two kernel modes:

- ``"kvcache"``: every sequence owns one input row of ``Sq`` tokens whose real tokens sit at the
  row's end (no padding, or left padding). Attention is flash-attn's ``flash_attn_with_kvcache``
  on ``q`` reshaped to (B, Sq, H, D): bottom-right causal alignment makes pad rows see no key.
  This covers generate()'s prefill and decode and the engine's decode-only steps, and its shapes
  are static for a fixed batch and block-table width (what ``torch.compile`` and CUDA graphs need).
- ``"varlen"``: anything else (the engine's packed prefill chunks, right padding, arbitrary
  masks): ``flash_attn_varlen_func(block_table=...)`` on the computed tokens; a masked query row
  that follows real tokens (right padding) attends to every real key before it, as transformers'
  own attention does.

:meth:`StepPlan.to` gives the :class:`DeviceStep` for a device: one host buffer, one copy
(pinned and non-blocking on CUDA), views per field. The layer loop then only calls
:meth:`DeviceStep.write` and :meth:`DeviceStep.attend`: no validation, no backend choice, no host
reads of device data. No transformers import here.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from flashpage.blocks import slot_list
from flashpage.kernels import cpu_attention, dispatch, paged
from flashpage.kernels.paged import LayerOptions


@dataclass(frozen=True)
class InputLayout:
    """How the forward's input tokens map to sequences: ``rows`` x ``length`` positions, flattened
    row-major, row ``b`` holding sequence ``b``.

    Attributes:
        real: (rows, length) bool host tensor, True where a row holds a real token of its sequence
            (False: padding), or None when every position is real. A row's real tokens are the last
            ones of its sequence: the step computes the last ``query_lens[b]`` of them, and the
            leading ones it does not compute are already cached (prefix hits).
    """

    rows: int
    length: int
    real: torch.Tensor | None = None


@dataclass
class StepPlan:
    """One forward's sequences, slots and block tables (host side; see :meth:`to`).

    Attributes:
        seq_ids: the ``B`` sequences, in batch order.
        query_lens: tokens computed per sequence this step.
        context_lens: tokens each sequence held before this step's computed tokens.
        mode: ``"kvcache"`` or ``"varlen"`` (module docstring).
        layout: the input layout.
        slot_mapping: (T,) int64 slots of the computed tokens, in packed order.
        input_slots: (N,) int64 slot of every input position, -1 where nothing is written.
        token_index: (T,) int64 input positions of the computed tokens, or None (input = packed tokens).
        block_table: (B, W) int32, zero padded; W >= the blocks any sequence uses (the width
            requested for static shapes, else exactly that).
        seqlens_k: (B,) int32 keys visible after the step (``context + query``).
        cu_seqlens_q / cu_seqlens_k: (B + 1,) int32 prefix sums.
        max_seqlen_q / max_seqlen_k: the maxima (ints).
        uniform_query: every sequence computes the same number of tokens with no padding.
        key_lens: ``seqlens_k`` as a host list.
    """

    seq_ids: list[Hashable]
    query_lens: list[int]
    context_lens: list[int]
    mode: str
    layout: InputLayout
    block_size: int
    slot_mapping: torch.Tensor
    input_slots: torch.Tensor
    token_index: torch.Tensor | None
    block_table: torch.Tensor
    seqlens_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    uniform_query: bool
    key_lens: list[int]
    all_written: bool = True  # every input position gets a slot (no -1)
    empty_rows: bool = False  # kvcache mode: some query row sees no key (left padding)
    pad_rows: torch.Tensor | None = None  # (R,) input positions of right-pad queries that attend
    pad_seqs: torch.Tensor | None = None  # (R,) their sequence index
    pad_visible: torch.Tensor | None = None  # (R,) keys each of them sees
    host_ints: torch.Tensor | None = None  # the int32 buffer block_table .. cu_seqlens_k are views of
    # packed input, varlen mode: runs of sequences with one query length, (first token, first
    # sequence, sequences, query length) each: the PyTorch kernels attend run by run
    segments: list[tuple[int, int, int, int]] | None = None
    # spans of positions [a, b) of sequence i whose queries also see each other's keys up to ``reach`` positions
    # away (image tokens attending both ways: Gemma 3 / 4), per layer kind ("full", "sliding"): (i, a, b, reach)
    two_way: dict[str, list[tuple[int, int, int, int]]] | None = None
    _on_device: dict[torch.device, DeviceStep] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        """Computed tokens in this step (T)."""
        return int(self.slot_mapping.numel())

    @property
    def is_decode(self) -> bool:
        """True when every sequence adds exactly one token."""
        return self.uniform_query and self.max_seqlen_q == 1

    def to(self, device: torch.device | str) -> DeviceStep:
        """This plan's tensors on ``device`` (one transfer per device, then cached)."""
        dev = torch.device(device)
        step = self._on_device.get(dev)
        if step is None:
            step = self._on_device[dev] = _move(self, dev)
        return step


@dataclass
class DeviceStep:
    """A plan's tensors on one device, and the two calls every layer makes.

    Field shapes as in :class:`StepPlan`; ``read_blocks`` is how many block-table columns eager
    attention reads (``ceil(max_seqlen_k / block_size)``); under ``torch.compile`` every column
    is read, so shapes never depend on lengths.
    """

    plan: StepPlan
    input_slots: torch.Tensor
    block_table: torch.Tensor
    seqlens_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    token_index: torch.Tensor | None
    pad_rows: torch.Tensor | None
    pad_seqs: torch.Tensor | None
    pad_visible: torch.Tensor | None
    read_blocks: int
    all_written: bool  # no input position is skipped (no -1 slot)
    empty_rows: bool  # some query row may see no key (left padding, empty sequences)
    equal_keys: bool  # every sequence sees max_seqlen_k keys
    _masks: dict = field(default_factory=dict, repr=False)

    def write(self, k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k (N, Hk, D) / v (N, Hk, Dv), one row per input position, into the pages."""
        if torch.compiler.is_compiling():
            paged.store_op(k_pages, v_pages, k, v, self.input_slots, self.all_written)
        elif not (k_pages.is_cpu and cpu_attention.store_kv(k_pages, v_pages, k, v, self.input_slots,
                                                            self._store_loaded())):
            paged.store(k_pages, v_pages, k, v, self.input_slots, self.all_written)

    def _store_loaded(self) -> bool:
        """Whether the C++ CPU kernels are loaded (:func:`cpu_attention.load`): looked up on the first layer's
        write and shared by the others (one environment check per step, as :meth:`_cpu_metadata`)."""
        loaded = self._masks.get("store")
        if loaded is None:
            loaded = self._masks["store"] = cpu_attention.load() is not None
        return loaded

    @property
    def supports_chunks(self) -> bool:
        """Whether :meth:`attend` can run chunked attention (``opts.chunk``) on this step: a kvcache-mode
        step or packed runs of equal query length (not a padded varlen layout)."""
        return self.plan.mode == "kvcache" or self.plan.segments is not None

    def attend(self, query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: LayerOptions,
               s_aux: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of a layer's queries over the pages.

        query: (R, H, L, D) in transformers' layout with R * L input positions (R rows of L, as
        the plan's layout says). Returns (R, L, H, Dv) contiguous. The queries of a plan's two-way spans
        are computed again under their mask (:func:`_two_way_rows`).
        """
        out = self._attend(query, k_pages, v_pages, opts, s_aux)
        if self.plan.two_way:
            _two_way_rows(self, out, query, k_pages, v_pages, opts, s_aux)
        return out

    def _attend(self, query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: LayerOptions,
                s_aux: torch.Tensor | None = None) -> torch.Tensor:
        rows, heads, length, _ = query.shape
        fast = self._cpu_attend(query, k_pages, v_pages, opts, s_aux)
        if fast is not None:
            return fast
        if self.plan.mode != "kvcache":
            flat = query.transpose(1, 2).reshape(rows * length, heads, -1)
            return self._varlen(flat, k_pages, v_pages, opts, s_aux).view(rows, length, heads, -1)
        n = self.block_table.shape[0]
        if rows == n:
            qh = query
        else:  # packed engine step (1, T): n sequences of T / n tokens each
            qh = query.reshape(heads, n, rows * length // n, -1).transpose(0, 1)
        out = self._kvcache(qh, k_pages, v_pages, opts, s_aux)  # (n, H, Sq, Dv)
        return out.transpose(1, 2).reshape(rows, length, heads, -1)

    def _cpu_attend(self, query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: LayerOptions,
                    s_aux: torch.Tensor | None) -> torch.Tensor | None:
        """The whole step in one call of the fused C++ CPU kernel (every sequence, whatever its query
        length), or None where it does not apply (not CPU / its dtypes, ALiBi, chunks, padded layouts,
        a trace, or the kernel unavailable). query (R, H, L, D) -> (R, L, H, Dv)."""
        if (opts.alibi_slopes is not None or opts.chunk or query.device.type != "cpu"
                or torch.compiler.is_compiling()):  # a trace takes the traceable kernels (and writes no memo)
            return None
        rows, heads, length, d = query.shape
        meta = self._cpu_metadata(rows, length, query, k_pages, v_pages)
        if meta is None or (torch.is_grad_enabled() and (query.requires_grad or k_pages.requires_grad
                                                         or v_pages.requires_grad)):
            return None
        kernel, table, seqlens, cu_q = meta
        scale = d**-0.5 if opts.softmax_scale is None else float(opts.softmax_scale)
        out, _ = cpu_attention.run_kernel(kernel, query.transpose(1, 2).reshape(rows * length, heads, d), k_pages,
                                          v_pages, table, seqlens, cu_q, scale, float(opts.softcap),
                                          cpu_attention.window_sides(opts.causal, opts.window_size), s_aux)
        return out.view(rows, length, heads, -1)

    def _cpu_metadata(self, rows: int, length: int, query: torch.Tensor, k_pages: torch.Tensor,
                      v_pages: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The C++ kernel and the (block table, key lengths, query-row prefix sums) it reads (int64)
        for queries of this shape and these dtypes, or None where it does not apply; looked up on
        the first layer's call and shared by the others (one environment check per step)."""
        key = ("cpu", rows, length, query.dtype, k_pages.dtype, v_pages.dtype)  # pages: contiguous per layer
        if key in self._masks:
            return self._masks[key]
        meta = None
        kernel = None
        if (self.token_index is None and self.pad_rows is None
                and cpu_attention.eligible(query.detach(), k_pages.detach(), v_pages.detach())
                and self._flash(query, False, False) is None):  # a flash-attn build for CPU (tests) goes first
            kernel = cpu_attention.load()
        if kernel is not None:
            tokens = rows * length
            table = self.block_table[:, : self.read_blocks].to(torch.int64).contiguous()
            seqlens = self.seqlens_k.to(torch.int64)
            if self.plan.mode == "kvcache":  # n sequences of tokens / n queries each, back to back
                n = self.block_table.shape[0]
                cu_q = torch.arange(0, tokens + 1, tokens // max(n, 1), dtype=torch.int64)[: n + 1]
            else:
                cu_q = self.cu_seqlens_q.to(torch.int64)
                seqlens = self.cu_seqlens_k.diff().to(torch.int64)
            meta = (kernel, table, seqlens, cu_q)
        self._masks[key] = meta
        return meta

    def _flash(self, query: torch.Tensor, sinks: bool, softcap: bool) -> dispatch.LayerKernel | None:
        """The flash-attn kernel this step's layers of this kind run on (None: flashpage's own kernels), chosen
        on the first such layer's call and kept for the step: one backend choice per step, not per layer."""
        key = ("flash", query.device, query.dtype, sinks, softcap, query.shape[-1])
        if key not in self._masks:
            self._masks[key] = dispatch.layer_kernel(query.device, query.dtype, self.plan.block_size, sinks, softcap,
                                                     query.shape[-1])
        return self._masks[key]

    def _kvcache(self, qh: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: LayerOptions,
                 s_aux: torch.Tensor | None) -> torch.Tensor:
        # ALiBi and chunked attention: the PyTorch kernels (static shapes, traceable; flash-attn has no chunks)
        own = opts.alibi_slopes is not None or opts.chunk > 0
        if torch.compiler.is_compiling() and not own:  # an opaque op over the whole table: static shapes
            return paged.attend_compiled(qh, k_pages, v_pages, self.block_table, self.seqlens_k, opts, s_aux,
                                         self.empty_rows)
        table = self.block_table if torch.compiler.is_compiling() else self.block_table[:, : self.read_blocks]
        kernel = None if own else self._flash(qh, s_aux is not None, opts.softcap > 0)
        if kernel is not None:
            return kernel.kvcache(qh.transpose(1, 2), k_pages, v_pages, table, self.seqlens_k, opts).transpose(1, 2)
        sq = qh.shape[2]
        if sq == 1 and opts.window_size[0] < 0 and self.equal_keys and not own:
            return paged.attend_static(qh, k_pages, v_pages, table, self.seqlens_k, opts, s_aux,
                                       all_keys=self.plan.max_seqlen_k)  # equal lengths: no mask needed
        mask = self._mask(None, self.seqlens_k, sq, table.shape[1] * k_pages.shape[1], opts)
        return paged.attend_static(qh, k_pages, v_pages, table, self.seqlens_k, opts, s_aux, mask, self.empty_rows)

    def _mask(self, run: int | None, seqlens_k: torch.Tensor, seqlen_q: int, width: int,
              opts: LayerOptions) -> torch.Tensor:
        """The visible-key mask of the whole step (``run`` None) or of one run of sequences, for
        these options: built once per step, shared by the layers."""
        causal = opts.causal and seqlen_q > 1
        key = (run, causal, opts.window_size, opts.chunk)
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = paged.visible_keys(seqlens_k, seqlen_q, width, causal, opts.window_size,
                                                         opts.chunk)
        return mask

    def _segments(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: LayerOptions,
                  s_aux: torch.Tensor | None) -> torch.Tensor:
        """A packed step on the PyTorch kernels: each run of sequences with one query length
        (the engine's decodes, each prefill chunk) is one static-shape kvcache call."""
        outs = []
        for i, (token0, seq0, n, sq) in enumerate(self.plan.segments):
            qh = q[token0: token0 + n * sq].view(n, sq, *q.shape[1:]).transpose(1, 2)
            rows = slice(seq0, seq0 + n)
            seqlens = self.seqlens_k[rows]
            table = self.block_table[rows, : -(-max(self.plan.key_lens[rows]) // self.plan.block_size)]
            mask = self._mask(i, seqlens, sq, table.shape[1] * k_pages.shape[1], opts)
            out = paged.attend_static(qh, k_pages, v_pages, table, seqlens, opts, s_aux, mask, self.empty_rows)
            outs.append(out.transpose(1, 2).reshape(n * sq, *out.shape[1:2], out.shape[-1]))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _varlen(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: LayerOptions,
                s_aux: torch.Tensor | None) -> torch.Tensor:
        plan = self.plan
        if opts.chunk and plan.segments is None:
            raise NotImplementedError("chunked attention runs on the PyTorch mask path, which needs the step's "
                                      "sequences as runs of equal query length (DeviceStep.supports_chunks)")
        if plan.segments is not None and (opts.alibi_slopes is not None or opts.chunk
                                          or self._flash(q, s_aux is not None, opts.softcap > 0) is None):
            return self._segments(q, k_pages, v_pages, opts, s_aux)
        flat = q if self.token_index is None else q.index_select(0, self.token_index)
        out = dispatch.layer_varlen(flat, k_pages, v_pages, self.cu_seqlens_q, self.cu_seqlens_k,
                                    plan.max_seqlen_q, plan.max_seqlen_k, self.block_table, opts, s_aux,
                                    plan.query_lens, plan.key_lens, plan.block_size)
        if self.token_index is None and self.pad_rows is None:
            return out
        full = out.new_zeros((q.shape[0], q.shape[1], out.shape[-1]))
        if self.token_index is not None:
            full.index_copy_(0, self.token_index, out)
        else:
            full.copy_(out)
        if self.pad_rows is not None:  # right padding: a masked query sees every real key before it
            pq = q.index_select(0, self.pad_rows).unsqueeze(2)  # (R, H, 1, D)
            table = self.block_table.index_select(0, self.pad_seqs)
            single = LayerOptions(opts.softmax_scale, False, opts.window_size, opts.softcap, opts.alibi_slopes,
                                  opts.chunk)
            pad_out = paged.attend_static(pq, k_pages, v_pages, table, self.pad_visible, single, s_aux)
            full.index_copy_(0, self.pad_rows, pad_out.squeeze(2))
        return full


def _two_way_rows(step: DeviceStep, out: torch.Tensor, query: torch.Tensor, k_pages: torch.Tensor,
                  v_pages: torch.Tensor, opts: LayerOptions, s_aux: torch.Tensor | None) -> None:
    """Rewrite in ``out`` (1, T, H, Dv) the rows of the step's queries inside a two-way span ``[a, b)`` of this
    layer's kind: each attends as the layer does (causal, within its sliding window) and also to the later keys of
    its span and its earlier ones at most ``reach`` back (all on the pages: a chunk never ends inside a span), in
    float32 over the sequence's keys read back from the pages, as transformers' sdpa computes the model's mask."""
    plan = step.plan
    spans = (plan.two_way or {}).get("full" if tuple(opts.window_size) == (-1, -1) else "sliding")
    if not spans:
        return
    if plan.token_index is not None or query.shape[0] != 1 or s_aux is not None or opts.alibi_slopes is not None \
            or opts.chunk:
        raise NotImplementedError("flashpage: two-way attention spans run in packed steps without sinks, ALiBi or "
                                  "chunked attention only")
    heads, d = query.shape[1], query.shape[3]
    scale = d**-0.5 if opts.softmax_scale is None else float(opts.softmax_scale)
    size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    flat_k, flat_v = k_pages.reshape(-1, kv_heads, d), v_pages.reshape(-1, kv_heads, v_pages.shape[-1])
    for i, a, b, reach in spans:
        context, n = plan.context_lens[i], plan.query_lens[i]
        lo, hi = max(a, context), min(b, context + n)
        if lo >= hi:
            continue
        if b > context + n:
            raise RuntimeError(f"flashpage: a chunk ends at {context + n}, inside the two-way span [{a}, {b})")
        keys = torch.arange(context + n, device=query.device)
        slots = step.block_table[i].long()[keys // size] * size + keys % size
        k = flat_k.index_select(0, slots).float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = flat_v.index_select(0, slots).float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        row = int(plan.cu_seqlens_q[i]) + lo - context
        q = query[0, :, row:row + hi - lo].float()  # (H, m, D)
        scores = q @ k.transpose(1, 2) * scale
        if opts.softcap:
            scores = torch.tanh(scores / opts.softcap) * opts.softcap
        qp = torch.arange(lo, hi, device=query.device)[:, None]
        visible = keys[None, :] <= qp
        if opts.window_size[0] >= 0:
            visible &= keys[None, :] >= qp - opts.window_size[0]
        visible |= (keys[None, :] >= a) & (keys[None, :] < b) & (qp - keys[None, :] <= reach)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[0, row:row + hi - lo] = (probs @ v).transpose(0, 1).to(out.dtype)


def _move(plan: StepPlan, device: torch.device) -> DeviceStep:
    """The plan's tensors on ``device``: on the host they are views of one int32 buffer (block table,
    key lengths, prefix sums) and one int64 buffer (slots, indices), so a device gets two copies
    (pinned and non-blocking on CUDA) and views of them."""
    long_parts = [plan.input_slots, plan.token_index, plan.pad_rows, plan.pad_seqs, plan.pad_visible]
    if device == plan.block_table.device:  # the host tensors are already where they are needed
        table, seqlens, cu_q, cu_k = plan.block_table, plan.seqlens_k, plan.cu_seqlens_q, plan.cu_seqlens_k
        slots, token_index, pad_rows, pad_seqs, pad_visible = long_parts
    else:
        int_parts = [plan.block_table.reshape(-1), plan.seqlens_k, plan.cu_seqlens_q, plan.cu_seqlens_k]
        ints = plan.host_ints if plan.host_ints is not None else _joined(int_parts, torch.int32)
        table, seqlens, cu_q, cu_k = _split(_to(ints, device), int_parts)
        table = table.view(plan.block_table.shape)
        slots, token_index, pad_rows, pad_seqs, pad_visible = _split(_to(_joined(long_parts, torch.int64), device),
                                                                     long_parts)
    return DeviceStep(
        plan=plan,
        input_slots=slots,
        block_table=table,
        seqlens_k=seqlens,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        token_index=token_index,
        pad_rows=pad_rows,
        pad_seqs=pad_seqs,
        pad_visible=pad_visible,
        read_blocks=max(1, -(-plan.max_seqlen_k // plan.block_size)),
        all_written=plan.all_written,
        empty_rows=plan.empty_rows,
        equal_keys=bool(plan.key_lens) and min(plan.key_lens) == plan.max_seqlen_k,
    )


def _joined(parts: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
    """The parts back to back, flattened, in ``dtype``."""
    present = [p for p in parts if p is not None]
    if len(present) == 1:
        return present[0].reshape(-1).to(dtype)
    return torch.cat([p.reshape(-1).to(dtype) for p in present]) if present else torch.empty(0, dtype=dtype)


def _to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if host.device == device:
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _split(buffer: torch.Tensor, parts: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    views: list[torch.Tensor | None] = []
    offset = 0
    for p in parts:
        if p is None:
            views.append(None)
            continue
        views.append(buffer[offset: offset + p.numel()])
        offset += p.numel()
    return views


def build_plan(seq_ids: list[Hashable], query_lens: list[int], context_lens: list[int], tables: list[list[int]],
               block_size: int, layout: InputLayout | None = None, table_width: int | None = None) -> StepPlan:
    """The plan for computing ``query_lens[i]`` tokens of ``seq_ids[i]`` after ``context_lens[i]``
    stored ones, whose blocks (``tables``) are already allocated. ``layout`` None: the input is the
    computed tokens, packed sequence by sequence. ``table_width``: block-table columns at least
    (fixed widths keep shapes static across steps)."""
    slots: list[int] = []
    for t, c, n in zip(tables, context_lens, query_lens, strict=True):
        slots += slot_list(t, block_size, c, c + n)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    key_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    b = len(tables)
    width = max(max((len(t) for t in tables), default=0), table_width or 0, 1)
    # one int32 host tensor holds the block table, key lengths and both prefix sums (views below)
    flat = [i for t in tables for i in (*t, *([0] * (width - len(t))))]
    flat += key_lens + [0, *itertools.accumulate(query_lens)] + [0, *itertools.accumulate(key_lens)]
    ints = torch.tensor(flat, dtype=torch.int32)
    block_table = ints[: b * width].view(b, width)
    seqlens_k = ints[b * width: b * width + b]
    cu_q = ints[b * width + b: b * width + 2 * b + 1]
    cu_k = ints[b * width + 2 * b + 1:]
    plan = StepPlan(
        seq_ids=seq_ids, query_lens=query_lens, context_lens=context_lens, mode="varlen",
        layout=layout or InputLayout(1, len(slots)), block_size=block_size, slot_mapping=slot_mapping,
        input_slots=slot_mapping, token_index=None, block_table=block_table, seqlens_k=seqlens_k,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, host_ints=ints,
        max_seqlen_q=max(query_lens, default=0), max_seqlen_k=max(key_lens, default=0),
        uniform_query=len(set(query_lens)) <= 1, key_lens=key_lens,
    )
    if layout is None or (layout.real is None and len(slots) == layout.rows * layout.length):
        plan.mode = "kvcache" if plan.uniform_query and plan.max_seqlen_q > 0 else "varlen"
        plan.empty_rows = min(key_lens, default=0) < plan.max_seqlen_q
        if plan.mode == "varlen" and min(query_lens, default=0) > 0:
            plan.segments = _runs(query_lens)
        return plan
    plan.empty_rows = min(key_lens, default=0) < layout.length
    if layout.real is None:  # every position real, some of them cached
        layout = InputLayout(layout.rows, layout.length, torch.ones((layout.rows, layout.length), dtype=torch.bool))
    _apply_layout(plan, layout)
    return plan


def _apply_layout(plan: StepPlan, layout: InputLayout) -> None:
    """Padded input: slots per input position, and the mode the layout allows."""
    real = layout.real.reshape(layout.rows, layout.length).to(torch.bool)
    rank = real.to(torch.int32).cumsum(dim=1)  # real tokens up to and including each position
    count = rank[:, -1:]
    query = torch.tensor(plan.query_lens, dtype=torch.int32).view(-1, 1)
    if layout.rows != len(plan.seq_ids) or bool((count < query).any()):
        raise ValueError(f"StepPlan: the input holds {count.view(-1).tolist()} real tokens per row but the step "
                         f"computes {plan.query_lens} for {len(plan.seq_ids)} sequences")
    computed = real & (rank > count - query)
    flat = computed.reshape(-1)
    index = flat.nonzero().squeeze(1)
    plan.input_slots = torch.full((flat.numel(),), -1, dtype=torch.int64)
    plan.input_slots[index] = plan.slot_mapping
    plan.all_written = index.numel() == flat.numel()
    plan.uniform_query = bool(flat.all())
    suffix = layout.length < 2 or bool((computed[:, 1:] >= computed[:, :-1]).all())
    if suffix and plan.max_seqlen_q > 0:
        plan.mode = "kvcache"  # computed tokens end each row: bottom-right alignment handles the rest
        return
    plan.mode = "varlen"
    plan.token_index = None if plan.uniform_query else index
    outside = torch.tensor(plan.context_lens, dtype=torch.int32).view(-1, 1) - (count - query)
    visible = (outside + rank).reshape(-1)  # stored keys each position's query may see
    attends = ~flat & (visible > 0)  # masked or cached positions still attend to the keys before them
    if bool(attends.any()):
        rows = attends.nonzero().squeeze(1)
        plan.pad_rows = rows
        plan.pad_seqs = rows // layout.length
        plan.pad_visible = visible[rows].to(torch.int64)


def pad_decode(plan: StepPlan, rows: int) -> StepPlan:
    """A one-token-per-sequence kvcache plan padded to ``rows`` sequences with fixed flags.

    Padding rows have slot -1 (nothing written), block-table row 0 and no visible key (output 0).
    ``all_written`` / ``empty_rows`` are fixed (False / True) whatever the padding, so every step
    of a bucket traces to the same graph."""
    n = len(plan.seq_ids)
    if plan.mode != "kvcache" or plan.max_seqlen_q != 1 or rows < n:
        raise ValueError(f"pad_decode: needs a decode plan of at most {rows} sequences (got mode {plan.mode}, "
                         f"{n} sequences, {plan.max_seqlen_q} tokens each)")
    extra = rows - n
    table = torch.cat([plan.block_table, plan.block_table.new_zeros((extra, plan.block_table.shape[1]))])
    seqlens = torch.cat([plan.seqlens_k, plan.seqlens_k.new_zeros(extra)])
    slots = torch.cat([plan.input_slots, plan.input_slots.new_full((extra,), -1)])
    zero = torch.zeros(1, dtype=torch.int32)
    ones = torch.ones(rows, dtype=torch.int32)
    return StepPlan(
        seq_ids=plan.seq_ids, query_lens=plan.query_lens, context_lens=plan.context_lens, mode="kvcache",
        layout=InputLayout(1, rows), block_size=plan.block_size, slot_mapping=plan.slot_mapping,
        input_slots=slots, token_index=None, block_table=table, seqlens_k=seqlens,
        cu_seqlens_q=torch.cat([zero, ones.cumsum(0, dtype=torch.int32)]),
        cu_seqlens_k=torch.cat([zero, seqlens.cumsum(0, dtype=torch.int32)]),
        max_seqlen_q=1, max_seqlen_k=plan.max_seqlen_k, uniform_query=True, key_lens=plan.key_lens + [0] * extra,
        all_written=False, empty_rows=True,
    )


def _runs(query_lens: list[int]) -> list[tuple[int, int, int, int]]:
    """(first token, first sequence, sequences, query length) of each run of equal query lengths."""
    runs: list[tuple[int, int, int, int]] = []
    token = seq = 0
    for sq, group in itertools.groupby(query_lens):
        n = len(list(group))
        runs.append((token, seq, n, sq))
        token, seq = token + n * sq, seq + n
    return runs
