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

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from flashpage.kernels import dispatch, paged
from flashpage.kernels.paged import LayerOptions


@dataclass(frozen=True)
class InputLayout:
    """How the forward's input tokens map to sequences.

    Attributes:
        rows / length: the input is (rows, length) tokens, flattened row-major (N = rows * length).
        computed: (N,) bool host tensor: positions whose K/V this step writes and whose queries
            attend normally; None when every input position is a computed token in sequence order.
        visible: (N,) int host tensor: for every input position, how many of its sequence's
            stored keys its query may see (only needed for masked positions that still attend:
            right padding); None when no such position exists.
    """

    rows: int
    length: int
    computed: torch.Tensor | None = None
    visible: torch.Tensor | None = None


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
    pad_rows: torch.Tensor | None = None  # (R,) input positions of right-pad queries that attend
    pad_seqs: torch.Tensor | None = None  # (R,) their sequence index
    pad_visible: torch.Tensor | None = None  # (R,) keys each of them sees
    pages: object = None  # the PagedKVCache whose pages the layers read (set by PagedKVCache.plan)
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

    def on(self, device: torch.device | str) -> DeviceStep:
        """Alias of :meth:`to`."""
        return self.to(device)


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
    _masks: dict = field(default_factory=dict, repr=False)

    def write(self, k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k (N, Hk, D) / v (N, Hk, Dv), one row per input position, into the pages."""
        paged.store(k_pages, v_pages, k, v, self.input_slots)

    def attend(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: LayerOptions,
               s_aux: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q (N, H, D), one row per input position, over the pages: (N, H, Dv)."""
        plan = self.plan
        if plan.mode == "kvcache":
            b = self.block_table.shape[0]
            q4 = q.view(b, q.shape[0] // b, *q.shape[1:])
            out = self._kvcache(q4, k_pages, v_pages, opts, s_aux)
            return out.reshape(q.shape[0], q.shape[1], -1)
        return self._varlen(q, k_pages, v_pages, opts, s_aux)

    def _kvcache(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: LayerOptions,
                 s_aux: torch.Tensor | None) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        table = self.block_table if compiling else self.block_table[:, : self.read_blocks]
        if not compiling:
            kernel = dispatch.layer_kernel(q.device, q.dtype, self.plan.block_size, s_aux is not None,
                                           opts.softcap > 0, q.shape[-1])
            if kernel is not None:
                return kernel.kvcache(q, k_pages, v_pages, table, self.seqlens_k, opts)
        return paged.attend_static(q, k_pages, v_pages, table, self.seqlens_k, opts, s_aux)

    def _varlen(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: LayerOptions,
                s_aux: torch.Tensor | None) -> torch.Tensor:
        plan = self.plan
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
            pq = q.index_select(0, self.pad_rows).unsqueeze(1)
            table = self.block_table.index_select(0, self.pad_seqs)
            decode = LayerOptions(opts.softmax_scale, False, opts.window_size, opts.softcap)
            pad_out = paged.attend_static(pq, k_pages, v_pages, table, self.pad_visible, decode, s_aux)
            full.index_copy_(0, self.pad_rows, pad_out.squeeze(1))
        return full


def _move(plan: StepPlan, device: torch.device) -> DeviceStep:
    """One host buffer, one copy to ``device`` (pinned + non-blocking on CUDA), views per field."""
    parts: list[torch.Tensor | None] = [plan.input_slots, plan.block_table.reshape(-1), plan.seqlens_k,
                                        plan.cu_seqlens_q, plan.cu_seqlens_k, plan.token_index, plan.pad_rows,
                                        plan.pad_seqs, plan.pad_visible]
    present = [p for p in parts if p is not None]
    host = torch.cat([p.to(torch.int64) for p in present])
    if device.type == "cuda":
        host = host.pin_memory()
    moved = host.to(device, non_blocking=True) if device != host.device else host
    views: list[torch.Tensor | None] = []
    offset = 0
    for p in parts:
        if p is None:
            views.append(None)
            continue
        views.append(moved[offset: offset + p.numel()])
        offset += p.numel()
    slots, table, seqlens, cu_q, cu_k, token_index, pad_rows, pad_seqs, pad_visible = views
    return DeviceStep(
        plan=plan,
        input_slots=slots,
        block_table=table.view(plan.block_table.shape).to(torch.int32),
        seqlens_k=seqlens.to(torch.int32),
        cu_seqlens_q=cu_q.to(torch.int32),
        cu_seqlens_k=cu_k.to(torch.int32),
        token_index=token_index,
        pad_rows=pad_rows,
        pad_seqs=pad_seqs,
        pad_visible=pad_visible,
        read_blocks=max(1, -(-plan.max_seqlen_k // plan.block_size)),
    )


def build_plan(seq_ids: list[Hashable], query_lens: list[int], context_lens: list[int], tables: list[list[int]],
               block_size: int, layout: InputLayout | None = None, table_width: int | None = None) -> StepPlan:
    """The plan for computing ``query_lens[i]`` tokens of ``seq_ids[i]`` after ``context_lens[i]``
    stored ones, whose blocks (``tables``) are already allocated. ``layout`` None: the input is the
    computed tokens, packed sequence by sequence. ``table_width``: block-table columns at least
    (fixed widths keep shapes static across steps)."""
    slots = [t[pos // block_size] * block_size + pos % block_size
             for t, c, n in zip(tables, context_lens, query_lens, strict=True) for pos in range(c, c + n)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    key_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    width = max(max((len(t) for t in tables), default=0), table_width or 0, 1)
    block_table = torch.zeros((len(tables), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        if t:
            block_table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.tensor(query_lens, dtype=torch.int32)
    seqlens_k = torch.tensor(key_lens, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32)
    plan = StepPlan(
        seq_ids=seq_ids, query_lens=query_lens, context_lens=context_lens, mode="varlen",
        layout=layout or InputLayout(1, len(slots)), block_size=block_size, slot_mapping=slot_mapping,
        input_slots=slot_mapping, token_index=None, block_table=block_table, seqlens_k=seqlens_k,
        cu_seqlens_q=torch.cat([zero, q.cumsum(0, dtype=torch.int32)]),
        cu_seqlens_k=torch.cat([zero, seqlens_k.cumsum(0, dtype=torch.int32)]),
        max_seqlen_q=max(query_lens, default=0), max_seqlen_k=max(key_lens, default=0),
        uniform_query=len(set(query_lens)) <= 1, key_lens=key_lens,
    )
    if layout is None or layout.computed is None:
        plan.mode = "kvcache" if plan.uniform_query and plan.max_seqlen_q > 0 else "varlen"
        return plan
    _apply_layout(plan, layout)
    return plan


def _apply_layout(plan: StepPlan, layout: InputLayout) -> None:
    """Padded input: slots per input position, and the mode the layout allows."""
    computed = layout.computed.reshape(layout.rows, layout.length).to(torch.bool)
    counts = computed.sum(dim=1).tolist()
    if layout.rows != len(plan.seq_ids) or counts != plan.query_lens:
        raise ValueError(f"StepPlan: the input layout computes {counts} tokens per row but the step plans "
                         f"{plan.query_lens} for {len(plan.seq_ids)} sequences")
    flat = computed.reshape(-1)
    index = flat.nonzero().squeeze(1)
    plan.input_slots = torch.full((flat.numel(),), -1, dtype=torch.int64)
    plan.input_slots[index] = plan.slot_mapping
    plan.uniform_query = bool(flat.all())
    suffix = layout.length < 2 or bool((computed[:, 1:] >= computed[:, :-1]).all())
    if suffix and plan.max_seqlen_q > 0:
        plan.mode = "kvcache"  # real tokens end each row: bottom-right alignment handles the padding
        return
    plan.mode = "varlen"
    plan.token_index = None if plan.uniform_query else index
    if layout.visible is not None:
        attends = ~flat & (layout.visible.reshape(-1) > 0)
        if bool(attends.any()):
            rows = attends.nonzero().squeeze(1)
            plan.pad_rows = rows
            plan.pad_seqs = rows // layout.length
            plan.pad_visible = layout.visible.reshape(-1)[rows].to(torch.int64)
