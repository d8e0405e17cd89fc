"""The layer-path kernels: store and attend on inputs a step plan already validated.

The public ``flash_attn_*`` / ``store_kv`` entry points validate every argument for outside
callers. A model's layer loop calls these instead, with tensors that one plan built and checked
once per forward: no validation, no backend choice, no host reads of device data (no
``.tolist()`` / ``.item()`` / ``bool(tensor)``), no Python loop over sequences. Everything here
traces under ``torch.compile(fullgraph=True)`` with static shapes, which is also what CUDA graphs
need.

- :func:`store`: one ``index_copy_`` per tensor into the flattened pages; slot -1 is redirected
  to a write that changes nothing, so no device data is read.
- :func:`attend_static`: flash-attn's ``flash_attn_with_kvcache`` semantics (paged, bottom-right
  causal, sliding window, softcap, attention sinks, ALiBi) as dense masked attention over a fixed
  number of pages per sequence; SDPA where the math allows, explicit softmax otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flashpage.kernels import cpu_attention


@dataclass(frozen=True)
class LayerOptions:
    """What differs between layers of one forward (flash-attn's keyword arguments).

    Attributes:
        softmax_scale: None for ``head_dim ** -0.5``.
        causal: bottom-right causal mask.
        window_size: (left, right) sliding window, -1 = unbounded.
        softcap: 0 = off, else ``softcap * tanh(score / softcap)``.
        alibi_slopes: (H,) float32 ALiBi slopes or None: flash-attn's bias
            ``-slope * |i + Sk - Sq - j|`` is added to the scaled score of query row i and key j
            (runs on the PyTorch kernels; not part of equality or hashing).
        chunk: chunked attention (Llama 4's local layers), 0 = off: key j is visible to the query at
            position p (= i + Sk - Sq) iff ``j // chunk == p // chunk`` (and causal). flash-attn has no
            such mode: these layers always run on the PyTorch mask path (:func:`attend_static`).
    """

    softmax_scale: float | None = None
    causal: bool = True
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = field(default=None, compare=False)
    chunk: int = 0


def store(k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          slots: torch.Tensor, all_written: bool = False) -> None:
    """Write k (N, Hk, D) / v (N, Hk, Dv) into pages (NB, P, Hk, D|Dv) at ``slots`` (N,) int64.

    A slot of -1 (padding, or a token whose K/V the prefix cache already holds) writes nothing:
    it is sent to slot 0 together with slot 0's current content, unless a real token of this
    call targets slot 0, in which case it carries that token's value (equal bytes either way, so
    duplicate indices agree). ``all_written``: the caller knows no slot is -1 (one plain copy).
    Pages must be contiguous (one allocation per layer)."""
    nb, page = k_pages.shape[0], k_pages.shape[1]
    flat_k = k_pages.view(nb * page, *k_pages.shape[2:])
    flat_v = v_pages.view(nb * page, *v_pages.shape[2:])
    if all_written:
        flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, v.to(flat_v.dtype))
        return
    keep = slots >= 0
    target = torch.where(keep, slots, torch.zeros_like(slots))
    hits_zero = (target == 0) & keep
    first = torch.argmax(hits_zero.to(torch.int8)).view(1)  # a real token writing slot 0, if any
    zero_hit = hits_zero.index_select(0, first).view(1, 1, 1)
    for flat, new in ((flat_k, k), (flat_v, v)):
        new = new.to(flat.dtype)
        filler = torch.where(zero_hit, new.index_select(0, first), flat[:1])
        values = torch.where(keep[:, None, None], new, filler)
        flat.index_copy_(0, target, values)


def visible_keys(seqlens_k: torch.Tensor, seqlen_q: int, width: int, causal: bool,
                 window_size: tuple[int, int], chunk: int = 0) -> torch.Tensor:
    """(B, 1, Sq, width) bool: key j visible to query row i of sequence b (flash-attn section 3; with
    ``chunk`` > 0 also only keys of the query's chunk: ``j >= p - p % chunk`` for p = i + Sk - Sq)."""
    dev = seqlens_k.device
    sk = seqlens_k.to(torch.int64).view(-1, 1, 1)
    pos = torch.arange(width, device=dev).view(1, 1, width)
    diag = torch.arange(seqlen_q, device=dev).view(1, seqlen_q, 1) + sk - seqlen_q  # i + Sk - Sq
    visible = pos < sk
    left, right = window_size
    if causal:
        right = 0
    if right >= 0:
        visible = visible & (pos <= diag + right)
    if left >= 0:
        visible = visible & (pos >= diag - left)
    if chunk > 0:
        visible = visible & (pos >= diag - diag.remainder(chunk))
    return visible.unsqueeze(1)


def attend_static(qh: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                  seqlens_k: torch.Tensor, opts: LayerOptions, s_aux: torch.Tensor | None = None,
                  visible: torch.Tensor | None = None, empty_rows: bool = True,
                  all_keys: int | None = None) -> torch.Tensor:
    """Paged attention of qh (B, H, Sq, D) over ``block_table.shape[1]`` pages per sequence.

    flash-attn's ``flash_attn_with_kvcache`` semantics on pages that already hold the step's keys.
    k_pages / v_pages: (NB, P, Hk, D|Dv); block_table: (B, M) int32/int64 (entries past a
    sequence's length may be any valid block id); seqlens_k: (B,) keys visible per sequence.
    Sq == 1 ignores ``causal`` as flash-attn does. s_aux: (H,) attention-sink logits or None. A
    query row with no visible key returns 0. ``visible``: the mask :func:`visible_keys` gives for
    these arguments, when the caller already has it; ``empty_rows=False``: the caller knows every
    query row sees a key (skips the fix-up). ``all_keys``: the caller knows every sequence sees
    exactly its first ``all_keys`` keys (equal lengths, one query each, no window): no mask at all.
    Returns (B, H, Sq, Dv) in qh's dtype; shapes depend
    only on the inputs' shapes, never on their values.
    """
    b, heads, sq, d = qh.shape
    if (qh.device.type == "cpu" and opts.alibi_slopes is None and not opts.chunk and not torch.compiler.is_compiling()
            and cpu_attention.eligible(qh, k_pages, v_pages)):  # chunked attention: the mask below
        out = _attend_cpu(qh, k_pages, v_pages, block_table, seqlens_k, opts, s_aux)
        if out is not None:
            return out
    kv_heads = k_pages.shape[2]
    width = block_table.shape[1] * k_pages.shape[1]
    ids = block_table.reshape(-1)
    k = k_pages.index_select(0, ids).view(b, width, kv_heads, d).transpose(1, 2)  # (B, Hk, W, D)
    v = v_pages.index_select(0, ids).view(b, width, kv_heads, v_pages.shape[-1]).transpose(1, 2)
    if all_keys is not None and opts.softcap == 0 and s_aux is None and opts.alibi_slopes is None and not opts.chunk:
        scale = d**-0.5 if opts.softmax_scale is None else float(opts.softmax_scale)
        return F.scaled_dot_product_attention(qh, k[:, :, :all_keys], v[:, :, :all_keys], scale=scale,
                                              enable_gqa=heads != kv_heads).to(qh.dtype)
    if visible is None:
        visible = visible_keys(seqlens_k, sq, width, opts.causal and sq > 1, opts.window_size, opts.chunk)
    scale = d**-0.5 if opts.softmax_scale is None else float(opts.softmax_scale)
    bias = None if opts.alibi_slopes is None else alibi_bias(opts.alibi_slopes, seqlens_k, sq, width)
    if opts.softcap == 0 and s_aux is None:
        mask = visible if bias is None else bias.to(qh.dtype).masked_fill(~visible, float("-inf"))
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=heads != kv_heads)
    else:
        out = _explicit_softmax(qh, k, v, visible, scale, opts.softcap, s_aux, bias)
    if empty_rows:
        out = torch.where(visible.any(-1, keepdim=True), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.to(qh.dtype)


def _attend_cpu(qh: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                seqlens_k: torch.Tensor, opts: LayerOptions, s_aux: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`attend_static` on the fused C++ CPU kernel (B, H, Sq, Dv), or None when it is unavailable."""
    b, heads, sq, d = qh.shape
    q = qh.transpose(1, 2).reshape(b * sq, heads, d)  # a view for transformers' (B, Sq, H, D)-major queries
    cu = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int64)
    scale = d**-0.5 if opts.softmax_scale is None else float(opts.softmax_scale)
    out = cpu_attention.paged_attention(q, k_pages, v_pages, block_table, seqlens_k, cu, scale, float(opts.softcap),
                                        cpu_attention.window_sides(opts.causal, opts.window_size), s_aux)
    return None if out is None else out[0].view(b, sq, heads, -1).transpose(1, 2)


def alibi_bias(slopes: torch.Tensor, seqlens_k: torch.Tensor, seqlen_q: int, width: int) -> torch.Tensor:
    """(B, H, Sq, width) float32 ALiBi bias ``-slope[h] * |i + Sk[b] - Sq - j|`` (flash-attn's; for causal
    rows it equals BLOOM's ``slope * j`` up to a per-row constant, which softmax cancels).
    slopes (H,) or (B, H); seqlens_k (B,)."""
    dev = seqlens_k.device
    diag = torch.arange(seqlen_q, device=dev).view(1, seqlen_q, 1) + seqlens_k.to(torch.int64).view(-1, 1, 1) \
        - seqlen_q
    dist = (diag - torch.arange(width, device=dev).view(1, 1, width)).abs().to(torch.float32)  # (B, Sq, W)
    s = slopes.to(device=dev, dtype=torch.float32)
    s = s.view(1, -1, 1, 1) if s.dim() == 1 else s.view(s.shape[0], -1, 1, 1)
    return -s * dist.unsqueeze(1)


def _explicit_softmax(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                      softcap: float, s_aux: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with what SDPA cannot do: softcap and sink logits (plus an additive ALiBi ``bias``
    (B, H, Sq, W) after the softcap, as flash-attn adds it). qh (B, H, Sq, D); k, v (B, Hk, W, D)."""
    b, heads, sq, d = qh.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    acc = torch.float64 if qh.dtype == torch.float64 else torch.float32
    qg = qh.to(acc).reshape(b, kv_heads, group * sq, d)
    scores = torch.matmul(qg, k.to(acc).transpose(-1, -2)).view(b, heads, sq, -1) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(acc)
    scores = scores.masked_fill(~visible, float("-inf"))
    if s_aux is not None:
        sink = s_aux.to(acc).view(1, heads, 1, 1).expand(b, heads, sq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.nan_to_num(0.0).to(qh.dtype).to(acc)  # P rounded to the input dtype, as the kernel does
    out = torch.matmul(probs.reshape(b, kv_heads, group * sq, -1), v.to(acc))
    return out.view(b, heads, sq, -1)


# ------------------------------------------------------------------ compiled graphs
# Under torch.compile the layer path calls these two ops instead: the graph sees them as opaque
# calls with fixed output shapes, so inductor neither re-implements the page gather nor copies the
# (large) page tensors to functionalise the in-place store, and the attention may read only the
# blocks in use (on CPU, where that host read is free) or run flash-attn (see ``attend_op``).
@torch.library.custom_op("flashpage::store", mutates_args=("k_pages", "v_pages"))
def store_op(k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, all_written: bool) -> None:
    """:func:`store` as a custom op (writes the pages in place)."""
    store(k_pages, v_pages, k, v, slots, all_written)


@store_op.register_fake
def _store_fake(k_pages, v_pages, k, v, slots, all_written) -> None:
    return None


@torch.library.custom_op("flashpage::attend", mutates_args=())
def attend_op(qh: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
              seqlens_k: torch.Tensor, softmax_scale: float, causal: bool, window_left: int, window_right: int,
              softcap: float, s_aux: torch.Tensor | None, empty_rows: bool) -> torch.Tensor:
    """:func:`attend_static` as a custom op; ``softmax_scale`` < 0 means ``head_dim ** -0.5``.

    On CPU only the block-table columns in use are read (the host read of the lengths costs nothing
    there). On an accelerator nothing is read back (CUDA-graph safe): flash-attn's kvcache kernel
    runs where it is eligible (it reads only the blocks in use), else every column is read."""
    opts = LayerOptions(None if softmax_scale < 0 else softmax_scale, causal, (window_left, window_right), softcap)
    if qh.device.type != "cpu":
        from flashpage.kernels import dispatch  # dispatch imports this module

        kernel = dispatch.layer_kernel(qh.device, qh.dtype, k_pages.shape[1], s_aux is not None, softcap > 0,
                                       qh.shape[-1])
        if kernel is not None:
            out = kernel.kvcache(qh.transpose(1, 2), k_pages, v_pages, block_table, seqlens_k, opts)
            return out.transpose(1, 2).contiguous()
    else:
        used = -(-int(seqlens_k.max()) // k_pages.shape[1]) if seqlens_k.numel() else 1
        block_table = block_table[:, : max(used, 1)]
    return attend_static(qh, k_pages, v_pages, block_table, seqlens_k, opts, s_aux, None, empty_rows).contiguous()


@attend_op.register_fake
def _attend_fake(qh, k_pages, v_pages, block_table, seqlens_k, softmax_scale, causal, window_left, window_right,
                 softcap, s_aux, empty_rows) -> torch.Tensor:
    return qh.new_empty((*qh.shape[:-1], v_pages.shape[-1]))


def attend_compiled(qh: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                    seqlens_k: torch.Tensor, opts: LayerOptions, s_aux: torch.Tensor | None,
                    empty_rows: bool) -> torch.Tensor:
    """:func:`attend_static` through :func:`attend_op` (what a compiled layer calls)."""
    scale = -1.0 if opts.softmax_scale is None else float(opts.softmax_scale)
    return attend_op(qh, k_pages, v_pages, block_table, seqlens_k, scale, opts.causal, opts.window_size[0],
                     opts.window_size[1], float(opts.softcap), s_aux, empty_rows)
