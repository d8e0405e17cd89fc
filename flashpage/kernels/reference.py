"""Exact PyTorch implementation of flash-attn's KV-cache attention: the CPU product path.

Same contract as flash-attn 2 (see docs/flash-attn-contract.md): paged and dense
caches, in-place append, bottom-right causal, sliding window, softcap, ALiBi, rotary, GQA/MQA,
LSE, plus flashpage's attention sinks (s_aux). Inputs are validated by the caller (dispatch.py).

How it stays fast without a Python loop over sequences: sequences are sorted by how many keys
they read, keys are visited in chunks of a few blocks with an online softmax, and a sequence
drops out of later chunks once its keys are done, so work is proportional to real tokens.
GQA reshapes q to (Hk, B, G * Sq, D) instead of repeating K/V; the per-chunk matmuls loop over
the Hk KV heads (a small constant) on strided views, so gathered pages are copied only once.
Chunks are as large as a scratch budget allows: few, large torch ops.
Varlen batches are split into a few query-length buckets (1, 2, 3-4, 5-8, ...) so decodes are
not padded to the longest prefill chunk.
"""

from __future__ import annotations

import bisect
import functools
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from flashpage.kernels import cpu_attention, rotary, sdpa_path
from flashpage.kernels.validate import KvcacheSpec, VarlenSpec

_KV_CHUNK_BYTES = 384 << 20  # gathered K+V (and fp32 copies) per chunk: few, large ops
_SCORE_CHUNK_BYTES = 64 << 20  # score matrix per chunk
_MIN_CHUNK, _MAX_CHUNK = 16, 4096
_ROW_TILE = 512  # score rows (query positions x group) per tile for causal / windowed attention


@dataclass(frozen=True)
class MaskSpec:
    """The masking flash-attn's kernel applies after normalising causal/window (section 3)."""

    causal: bool  # the kernel's is_causal: keys j <= i + Sk - Sq
    local: bool  # sliding window: i + Sk - Sq - left <= j <= i + Sk - Sq + right
    left: int
    right: int
    scale: float
    softcap: float


@dataclass(frozen=True)
class KeyLayout:
    """Where each sequence's keys live. Paged: logical row r of seq b is
    k[block_table[b, r // P], r % P]. Dense: k[rows[b], start[b] + r]."""

    k: torch.Tensor
    v: torch.Tensor
    block_table: torch.Tensor | None  # (N, M) int64
    page: int
    rows: torch.Tensor | None  # (N,) int64
    start: torch.Tensor | None  # (N,) int64

    def select(self, idx: torch.Tensor) -> KeyLayout:
        """The layout of sequences idx (in that order)."""
        if self.block_table is not None:
            return KeyLayout(self.k, self.v, self.block_table[idx], self.page, None, None)
        return KeyLayout(self.k, self.v, None, 0, self.rows[idx], self.start[idx])


def normalize_mask(
    causal: bool,
    window_size: tuple[int, int],
    seqlen_q: int,
    seqlen_k: int,
    has_alibi: bool,
    scale: float,
    softcap: float,
) -> MaskSpec:
    """flash-attn's causal/window normalisation (flash_api.cpp + set_params_fprop).

    seqlen_q is q's length (varlen: max_seqlen_q); seqlen_k the cache capacity (varlen: max_seqlen_k).
    """
    left, right = window_size
    if seqlen_q == 1 and not has_alibi:
        causal = False  # equivalent, and what the kernel does
    if causal:
        right = 0
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    is_causal = left < 0 and right == 0
    if left < 0 and right >= 0:
        left = seqlen_k
    if left >= 0 and right < 0:
        right = seqlen_k
    local = (left >= 0 or right >= 0) and not is_causal
    return MaskSpec(is_causal, local, max(left, 0), max(right, 0), scale, softcap)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_values(values: torch.Tensor, kv_heads: int, rows_per_head: int) -> torch.Tensor:
    """Per-(sequence, head) values (N, H) -> per score row (Hk, N, R) with row r = i * G + g."""
    n, heads = values.shape
    group = heads // kv_heads
    return values.reshape(n, kv_heads, group).permute(1, 0, 2).repeat(1, 1, rows_per_head // group)


_F = TypeVar("_F", bound=Callable)
_warned_grad = False


def forward_only(fn: _F) -> _F:
    """Run ``fn`` without autograd, as flash-attn's inference entry points do: the reference
    writes into reused scratch buffers. Warns once when a caller had gradients enabled on
    inputs that require them (a patched model called outside ``torch.no_grad()``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _warned_grad
        if torch.is_grad_enabled():
            if not _warned_grad and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                _warned_grad = True
                warnings.warn(
                    "flashpage's attention is forward-only: no gradient flows through it. Run "
                    "inference under torch.no_grad() / torch.inference_mode(), and unpatch the "
                    "model (flashpage.unpatch) to train it.",
                    stacklevel=3,
                )
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


_POOL = threading.local()  # per-thread CPU scratch buffers, reused across calls (and layers)


def clear_workspace() -> None:
    """Free this thread's cached CPU scratch buffers (a few hundred MB at most)."""
    _POOL.buffers = {}


def _buffer(slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-d scratch tensor of `numel` elements. On CPU it is cached per thread: big fresh
    allocations page-fault on every call, which costs as much as the attention itself."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    pool = getattr(_POOL, "buffers", None)
    if pool is None:
        pool = _POOL.buffers = {}
    key = (slot, dtype, torch.is_inference_mode_enabled())  # inference tensors stay in inference mode
    buf = pool.get(key)
    if buf is None or buf.numel() < numel:
        buf = pool[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


class _Workspace:
    """Scratch buffers for the chunks of one call: `pairs` (sequence, key) pairs at most."""

    def __init__(self, keys: KeyLayout, pairs: int, n: int, rows: int, acc: torch.dtype) -> None:
        hk, d = keys.k.shape[-2], keys.k.shape[-1]
        dev, dt = keys.k.device, keys.k.dtype
        self.raw = [_buffer(name, pairs * hk * d, dt, dev) for name in ("k", "v")]
        self.convert = dt != acc
        self.acc = [_buffer(name, pairs * hk * d, acc, dev) for name in ("k_acc", "v_acc")] if self.convert else []
        self.scores = _buffer("scores", pairs * hk * rows, acc, dev)
        self.partial = _buffer("partial", n * hk * rows * d, acc, dev)


def _gather(keys: KeyLayout, ws: _Workspace, which: int, n: int, pos0: torch.Tensor, width: int,
            key_len: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Keys (which=0) or values (1) at logical rows pos0[b] + [0, width) of the first n sequences,
    as (n, width, Hk, D) in the accumulation dtype (whole pages copied into a scratch buffer).
    Rows past a sequence's end hold junk."""
    src = keys.k if which == 0 else keys.v
    hk, d = src.shape[-2], src.shape[-1]
    raw = ws.raw[which][: n * width * hk * d]
    if keys.block_table is not None:
        page = keys.page
        nb = width // page
        cols = (pos0[:n] // page)[:, None] + torch.arange(nb, device=pos0.device)[None, :]
        ids = keys.block_table[:n].gather(1, cols.clamp(max=keys.block_table.shape[1] - 1))
        ids = torch.where(cols * page < key_len[:n, None], ids, torch.zeros_like(ids))
        torch.index_select(src, 0, ids.flatten(), out=raw.view(n * nb, page, hk, d))
    else:
        rows = keys.start[:n, None] + pos0[:n, None] + torch.arange(width, device=pos0.device)[None, :]
        raw.view(n, width, hk, d).copy_(src[keys.rows[:n, None], rows.clamp(0, src.shape[1] - 1)])
    if not ws.convert:
        return raw.view(n, width, hk, d)
    converted = ws.acc[which][: n * width * hk * d].view(n, width, hk, d)
    converted.copy_(raw.view(n, width, hk, d))
    return converted


def _chunk_budget(keys: KeyLayout, rows: int, acc: torch.dtype) -> int:
    """How many (sequence, key) pairs one chunk may hold, from the scratch-memory budgets."""
    hk, d = keys.k.shape[-2], keys.k.shape[-1]
    acc_bytes = torch.finfo(acc).bits // 8
    per_key = 2 * hk * d * (keys.k.element_size() + (acc_bytes if keys.k.dtype != acc else 0))
    per_score = hk * rows * acc_bytes * 2
    return max(1, min(_KV_CHUNK_BYTES // per_key, _SCORE_CHUNK_BYTES // per_score))


def attend(
    qh: torch.Tensor,
    keys: KeyLayout,
    seq_q: torch.Tensor,
    seq_k: torch.Tensor,
    mask: MaskSpec,
    group: int,
    slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    in_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention for N sequences over their cached keys.

    qh: (Hk, N, R, D) in the accumulation dtype, already multiplied by the softmax scale; R =
    group * Sq_max, row r is query r // group of head hk * group + r % group. seq_q, seq_k: (N,)
    int64 true query / key lengths. slopes: (N, H) ALiBi or None. sinks: (H,) s_aux or None.
    Returns out (Hk, N, R, D) and lse (Hk, N, R) in the
    accumulation dtype. Long queries are cut into row tiles so that causal / windowed rows only
    visit the keys they can see.
    """
    rows = qh.shape[2]
    tile = rows if not (mask.causal or mask.local) else max(group, _ROW_TILE // group * group)
    if tile >= rows:
        return _attend_rows(qh, 0, keys, seq_q, seq_k, mask, group, slopes, sinks, in_dtype)
    out = torch.empty_like(qh)
    lse = torch.empty(qh.shape[:-1], dtype=qh.dtype, device=qh.device)
    for r0 in range(0, rows, tile):
        part = qh[:, :, r0 : r0 + tile]
        o, lse_part = _attend_rows(part, r0 // group, keys, seq_q, seq_k, mask, group, slopes, sinks, in_dtype)
        out[:, :, r0 : r0 + tile] = o
        lse[:, :, r0 : r0 + tile] = lse_part
    return out, lse


def _key_span(
    first_q: int, rows: int, group: int, seq_q: torch.Tensor, seq_k: torch.Tensor, mask: MaskSpec, page: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """First key to read (aligned down to a page when paged) and how many keys, per sequence,
    for query rows first_q .. first_q + rows / group - 1 (rows past a sequence's queries ignored)."""
    last_q = torch.clamp(seq_q - 1, max=first_q + (rows - 1) // group)
    shift = seq_k - seq_q  # key j is on the diagonal of query i when j == i + shift
    hi = seq_k
    if mask.causal or mask.local:
        hi = torch.minimum(seq_k, last_q + shift + 1 + (0 if mask.causal else mask.right))
    hi = torch.where(last_q >= first_q, hi.clamp(min=0), torch.zeros_like(hi))
    lo = torch.zeros_like(seq_k)
    if mask.local:
        lo = torch.minimum((first_q + shift - mask.left).clamp(min=0), hi)
    base = (lo // page) * page if page else lo
    return base, (hi - base).clamp(min=0)


def _attend_rows(qh, first_q, keys, seq_q, seq_k, mask, group, slopes, sinks, in_dtype):
    """attend() for one tile of rows; first_q is the query index of the tile's row 0."""
    hk, n_seq, rows, d = qh.shape
    acc, dev = qh.dtype, qh.device
    paged = keys.block_table is not None
    base, span = _key_span(first_q, rows, group, seq_q, seq_k, mask, keys.page if paged else 0)
    span, order = torch.sort(span, descending=True, stable=True)
    qh, seq_q, seq_k, base = qh[:, order], seq_q[order], seq_k[order], base[order]
    keys = keys.select(order)
    row_vals = None
    if slopes is not None:  # (Hk, N, rows, 1); rows of a tile start at a multiple of group
        row_vals = _row_values(slopes[order].to(acc), hk, rows)[..., None]
    m = torch.full((hk, n_seq, rows), float("-inf"), dtype=acc, device=dev)
    l_sum = torch.zeros((hk, n_seq, rows), dtype=acc, device=dev)
    if sinks is not None:
        m.copy_(_row_values(sinks.to(acc)[None, :].expand(n_seq, -1), hk, rows))
        l_sum.fill_(1.0)
    out = torch.zeros((hk, n_seq, rows, d), dtype=acc, device=dev)
    spans = span.tolist()
    if n_seq and spans[0] > 0:
        page = keys.page if paged else 1
        n_first = sum(1 for s in spans if s > 0)
        budget = _chunk_budget(keys, rows, acc)  # (sequence, key) pairs per chunk
        ws = _Workspace(keys, max(budget, n_first * max(_MIN_CHUNK, page)), n_first, rows, acc)
        neg = [-s for s in spans]
        row_q = (first_q + torch.arange(rows, device=dev) // group).view(1, 1, rows, 1)  # query index i
        offs = torch.arange(max(_MAX_CHUNK, page), device=dev)
        state = (m, l_sum, out)
        done, n = 0, n_first
        while n:  # chunks widen as short sequences drop out: the buffers stay the same size
            width = max(page, min(_MAX_CHUNK, max(_MIN_CHUNK, budget // n)) // page * page)
            width = min(width, -(-(spans[0] - done) // page) * page)  # never past the longest span
            _chunk(qh, keys, ws, n, base + done, width, seq_q, seq_k, mask, row_q, offs[:width], row_vals,
                   state, in_dtype)  # fmt: skip
            done += width
            n = bisect.bisect_left(neg, -done)  # sequences with keys left
    lse = torch.where(l_sum > 0, m + torch.log(l_sum), torch.full_like(m, float("inf")))
    res = torch.where(l_sum[..., None] > 0, out / l_sum[..., None], torch.zeros_like(out))
    unsorted_out, unsorted_lse = torch.empty_like(res), torch.empty_like(lse)
    unsorted_out[:, order] = res
    unsorted_lse[:, order] = lse
    return unsorted_out, unsorted_lse


def _chunk(qh, keys, ws, n, pos0, width, seq_q, seq_k, mask, row_q, offs, row_vals, state, in_dtype) -> None:
    """One key chunk of the online softmax for the first n (sorted) sequences; updates state =
    (running max, running sum, unnormalised output), all (Hk, N, R[, D]), in place.

    The matmuls loop over the Hk KV heads on strided views of the gathered pages (one copy of
    the keys, no re-layout); everything else is one torch op over the whole chunk."""
    hk, _, rows, d = qh.shape
    m, l_sum, out = state
    kc = _gather(keys, ws, 0, n, pos0, width, seq_k)  # (n, W, Hk, D)
    s = ws.scores[: hk * n * rows * width].view(hk, n, rows, width)
    for h in range(hk):
        torch.bmm(qh[h, :n], kc[:, :, h].transpose(1, 2), out=s[h])
    if mask.softcap > 0:  # q carries scale / softcap here
        s.tanh_().mul_(mask.softcap)
    pos = (pos0[:n, None] + offs[None, :]).view(1, n, 1, width)  # logical key index j
    sk = seq_k[:n].view(1, n, 1, 1)
    diag = row_q + sk - seq_q[:n].view(1, n, 1, 1)  # (1, n, R, 1): i + Sk - Sq
    if row_vals is not None:
        slope = row_vals[:, :n]
        if mask.causal:
            s.add_(slope * pos)
        else:
            s.sub_(slope * (diag - pos).abs())
    hidden = pos >= sk
    if mask.causal:
        hidden = hidden | (pos > diag)
    elif mask.local:
        hidden = hidden | (pos > diag + mask.right) | (pos < diag - mask.left)
    s.masked_fill_(hidden, float("-inf"))
    m_old = m[:, :n]
    m_new = torch.maximum(m_old, s.amax(-1))
    m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
    alpha = torch.exp(m_old - m_safe)
    s.sub_(m_safe[..., None]).exp_()
    l_sum[:, :n] = l_sum[:, :n] * alpha + s.sum(-1)
    if in_dtype != s.dtype:
        s.copy_(s.to(in_dtype))  # P is rounded to the input dtype before P.V, as in the kernel
    vc = _gather(keys, ws, 1, n, pos0, width, seq_k)
    o = ws.partial[: hk * n * rows * d].view(hk, n, rows, d)
    for h in range(hk):
        torch.bmm(s[h], vc[:, :, h], out=o[h])
    out[:, :n].mul_(alpha[..., None]).add_(o)
    m[:, :n] = m_new


def _append(k_cache, v_cache, k, v, lengths, block_table, page, cache_batch_idx) -> None:
    """Write the new rows at logical rows lengths[b] + t, in place."""
    batch, new = k.shape[:2]
    rows = lengths[:, None] + torch.arange(new, device=lengths.device)[None, :]
    if block_table is not None:
        blk = block_table.to(torch.int64).gather(1, rows // page)
        idx = (blk, rows % page)
    else:
        cb = (
            cache_batch_idx.to(torch.int64)
            if cache_batch_idx is not None
            else torch.arange(batch, device=lengths.device)
        )
        idx = (cb[:, None].expand(-1, new), rows)
    k_cache[idx] = k
    v_cache[idx] = v


@forward_only
def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    *,
    k,
    v,
    rotary_cos,
    rotary_sin,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    softmax_scale,
    causal,
    window_size,
    softcap,
    rotary_interleaved,
    alibi_slopes,
    return_softmax_lse,
    s_aux,
    spec: KvcacheSpec,
):
    """Reference flash_attn_with_kvcache on validated inputs (cache_seqlens is a tensor or None)."""
    dev = q.device
    acc = _acc_dtype(q.dtype)
    batch, seqlen_q, heads, d = q.shape
    hk, group = spec.kv_heads, heads // spec.kv_heads
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    mask = normalize_mask(causal, window_size, seqlen_q, spec.capacity, alibi_slopes is not None, scale, float(softcap))
    lengths = (
        cache_seqlens.to(device=dev, dtype=torch.int64)
        if cache_seqlens is not None
        else torch.full((batch,), spec.capacity, dtype=torch.int64, device=dev)
    )
    if k is not None:
        if rotary_cos is not None:
            k = rotary.rotate(k, rotary_cos, rotary_sin, rotary.key_positions(lengths, k.shape[1]), rotary_interleaved)
        _append(k_cache, v_cache, k, v, lengths, block_table, spec.page_size, cache_batch_idx)
        if rotary_cos is not None:
            per_row = mask.causal or mask.local
            q = rotary.rotate(
                q,
                rotary_cos,
                rotary_sin,
                rotary.query_positions(lengths, seqlen_q, per_row),
                rotary_interleaved,
            )
    seq_k = lengths + spec.new_tokens
    if block_table is not None:
        keys = KeyLayout(k_cache, v_cache, block_table.to(torch.int64), spec.page_size, None, None)
    else:
        start = cache_leftpad.to(torch.int64) if cache_leftpad is not None else torch.zeros_like(lengths)
        seq_k = seq_k - start
        rows = cache_batch_idx.to(torch.int64) if cache_batch_idx is not None else torch.arange(batch, device=dev)
        keys = KeyLayout(k_cache, v_cache, None, 0, rows, start)
    if block_table is not None and alibi_slopes is None:
        fast = cpu_kernel(q.reshape(batch * seqlen_q, heads, d), k_cache, v_cache, block_table, seq_k,
                           torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, device=dev), mask, s_aux)
        if fast is not None:
            out = fast[0].view(batch, seqlen_q, heads, -1)
            if not return_softmax_lse:
                return out
            return out, fast[1].view(batch, seqlen_q, heads).permute(0, 2, 1).contiguous()
    qh = q.reshape(batch, seqlen_q, hk, group, d).permute(2, 0, 1, 3, 4).reshape(hk, batch, seqlen_q * group, d)
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.expand(batch, heads) if alibi_slopes.dim() == 1 else alibi_slopes
    seq_q = torch.full((batch,), seqlen_q, dtype=torch.int64, device=dev)
    if _plain_decode_ok(q, keys, seqlen_q, mask, alibi_slopes, s_aux, batch):
        out, lse = _plain_decode(_scaled(qh, mask, acc), keys, seq_k, return_softmax_lse)
    else:
        out, lse = attend(_scaled(qh, mask, acc), keys, seq_q, seq_k, mask, group, slopes, s_aux, q.dtype)
    out = out.view(hk, batch, seqlen_q, group, d).permute(1, 2, 0, 3, 4).reshape(batch, seqlen_q, heads, d)
    out = out.to(q.dtype)
    if not return_softmax_lse:
        return out
    lse = lse.view(hk, batch, seqlen_q, group).permute(1, 0, 3, 2).reshape(batch, heads, seqlen_q)
    return out, lse


def cpu_kernel(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                seq_k: torch.Tensor, cu_q: torch.Tensor, mask: MaskSpec,
                s_aux: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Packed q (T, H, D) on the fused C++ CPU kernel (cpu_attention): out (T, H, Dv) and LSE (T, H),
    or None where it does not apply (not CPU / float32 / float64, autograd, or the kernel
    unavailable): the caller goes on."""
    if not cpu_attention.eligible(q, k_pages, v_pages) or torch.compiler.is_compiling():
        return None
    if mask.causal:
        window = (-1, 0)
    elif mask.local:
        window = (mask.left, mask.right)
    else:
        window = (-1, -1)
    return cpu_attention.paged_attention(q, k_pages, v_pages, block_table, seq_k, cu_q, mask.scale, mask.softcap,
                                         window, s_aux)


def _plain_decode_ok(q, keys: KeyLayout, seqlen_q: int, mask: MaskSpec, alibi_slopes, s_aux, batch: int) -> bool:
    """One query per sequence over fp32/fp64 pages with nothing but key padding to apply."""
    if seqlen_q != 1 or keys.block_table is None or alibi_slopes is not None or s_aux is not None:
        return False
    if mask.local or mask.softcap > 0 or q.dtype not in (torch.float32, torch.float64) or keys.k.dtype != q.dtype:
        return False
    width = keys.block_table.shape[1] * keys.page
    return 2 * batch * width * keys.k.shape[-2] * keys.k.shape[-1] * keys.k.element_size() <= _KV_CHUNK_BYTES


def _plain_decode(
    qh: torch.Tensor, keys: KeyLayout, seq_k: torch.Tensor, want_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention in one pass: pages gathered once into scratch, masked softmax, P.V.

    qh: (Hk, B, G, D) scaled queries; seq_k: (B,) int64 key lengths. Returns out (Hk, B, G, D)
    and, if ``want_lse``, lse (Hk, B, G) (+inf where a sequence has no key). The same arithmetic
    as one chunk of the online softmax, without its bookkeeping."""
    hk, n, rows, d = qh.shape
    page, dev = keys.page, qh.device
    width = -(-int(seq_k.max()) // page) * page if n else 0
    out = torch.zeros_like(qh)
    if width == 0:
        return out, torch.full(qh.shape[:-1], float("inf"), dtype=qh.dtype, device=dev) if want_lse else None
    ws = _Workspace(keys, n * width, n, rows, qh.dtype)
    start = torch.zeros_like(seq_k)
    kc = _gather(keys, ws, 0, n, start, width, seq_k)  # (n, width, Hk, D)
    scores = ws.scores[: hk * n * rows * width].view(hk, n, rows, width)
    for h in range(hk):
        torch.bmm(qh[h], kc[:, :, h].transpose(1, 2), out=scores[h])
    hidden = torch.arange(width, device=dev)[None, :] >= seq_k[:, None]
    scores.masked_fill_(hidden.view(1, n, 1, width), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if want_lse else None
    probs = torch.softmax(scores, dim=-1)
    vc = _gather(keys, ws, 1, n, start, width, seq_k)
    for h in range(hk):
        torch.bmm(probs[h], vc[:, :, h], out=out[h])
    if int(seq_k.min()) == 0:  # no visible key: output 0 and LSE +inf, as the kernel gives
        out.masked_fill_((seq_k == 0).view(1, n, 1, 1), 0.0)
        if lse is not None:
            lse.masked_fill_((seq_k == 0).view(1, n, 1), float("inf"))
    return out, lse


def _scaled(qh: torch.Tensor, mask: MaskSpec, acc: torch.dtype) -> torch.Tensor:
    """q in the accumulation dtype times the softmax scale (divided by softcap when capping), so
    the scores come out of the matmul ready for tanh / softmax."""
    factor = mask.scale / mask.softcap if mask.softcap > 0 else mask.scale
    return qh.to(acc) * factor


def _query_buckets(seq_q: list[int]) -> list[list[int]]:
    """Group sequences by query length: 1, 2, 3-4, 5-8, ... (padding wastes < 2x); skip empty ones."""
    buckets: dict[int, list[int]] = {}
    for b, n in enumerate(seq_q):
        if n > 0:
            buckets.setdefault((n - 1).bit_length(), []).append(b)
    return [buckets[key] for key in sorted(buckets)]


@forward_only
def flash_attn_varlen_func(
    q,
    k,
    v,
    *,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    return_attn_probs,
    block_table,
    s_aux,
    spec: VarlenSpec,
    seq_q: list[int],
    seq_k: list[int],
):
    """Reference flash_attn_varlen_func on validated inputs (paged with block_table, else packed k/v)."""
    dev = q.device
    acc = _acc_dtype(q.dtype)
    total_q, heads, d = q.shape
    hk, group = spec.kv_heads, heads // spec.kv_heads
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    mask = normalize_mask(
        causal, window_size, max_seqlen_q, max_seqlen_k, alibi_slopes is not None, scale, float(softcap)
    )
    cu_q = cu_seqlens_q.to(torch.int64)
    if block_table is not None:
        keys = KeyLayout(k, v, block_table.to(torch.int64), spec.page_size, None, None)
    else:
        keys = KeyLayout(
            k.unsqueeze(0),
            v.unsqueeze(0),
            None,
            0,
            torch.zeros(spec.batch, dtype=torch.int64, device=dev),
            cu_seqlens_k[:-1].to(torch.int64),
        )
    if block_table is not None and alibi_slopes is None:
        fast = cpu_kernel(q, k, v, block_table, torch.tensor(seq_k, dtype=torch.int64), cu_q, mask, s_aux)
        if fast is not None:
            return (fast[0], fast[1].t().contiguous(), None) if return_attn_probs else fast[0]
    out = torch.zeros_like(q)
    lse_all = torch.full((heads, total_q), float("inf"), dtype=acc, device=dev)
    slopes_all = None
    if alibi_slopes is not None:
        slopes_all = alibi_slopes.expand(spec.batch, heads) if alibi_slopes.dim() == 1 else alibi_slopes
    sq_all = torch.tensor(seq_q, dtype=torch.int64, device=dev)
    sk_all = torch.tensor(seq_k, dtype=torch.int64, device=dev)
    plain = softcap == 0 and alibi_slopes is None and s_aux is None and not return_attn_probs
    table = keys.block_table
    cu_k = None if block_table is not None else cu_seqlens_k.to(torch.int64)
    for members in _query_buckets(seq_q):
        idx = torch.tensor(members, dtype=torch.int64, device=dev)
        n, rq = len(members), max(seq_q[b] for b in members)
        qrows = cu_q[idx][:, None] + torch.arange(rq, device=dev)[None, :]
        valid = torch.arange(rq, device=dev)[None, :] < sq_all[idx][:, None]
        qrows = qrows.clamp(max=total_q - 1)
        sk = [seq_k[b] for b in members]
        decode = rq == 1 and _plain_decode_ok(q, keys, 1, mask, alibi_slopes, s_aux, n)
        if plain and not decode and sdpa_path.fits(n, rq, max(sk), heads, hk, d, k.element_size()):
            o = sdpa_path.attend_bucket(q, k, v, table, spec.page_size, cu_k, idx, qrows,
                                        [seq_q[b] for b in members], sk, mask)
            if n == spec.batch and rq * n == total_q:  # one full bucket: rows already in order
                out = o.reshape(total_q, heads, d).to(q.dtype)
            else:
                out[qrows[valid]] = o[valid]
            continue
        qg = q[qrows].view(n, rq, hk, group, d).permute(2, 0, 1, 3, 4).reshape(hk, n, rq * group, d)
        slopes = slopes_all[idx] if slopes_all is not None else None
        if decode:  # the same one-pass arithmetic as flash_attn_with_kvcache's decode
            o, lse = _plain_decode(_scaled(qg, mask, acc), keys.select(idx), sk_all[idx], return_attn_probs)
        else:
            o, lse = attend(
                _scaled(qg, mask, acc), keys.select(idx), sq_all[idx], sk_all[idx], mask, group, slopes, s_aux,
                q.dtype,
            )
        o = o.view(hk, n, rq, group, d).permute(1, 2, 0, 3, 4).reshape(n, rq, heads, d)
        dst = qrows[valid]
        out[dst] = o[valid].to(q.dtype)
        if lse is not None:
            lse = lse.view(hk, n, rq, group).permute(1, 2, 0, 3).reshape(n, rq, heads)
            lse_all[:, dst] = lse[valid].transpose(0, 1)
    if return_attn_probs:
        return out, lse_all, None
    return out
