"""Fast path of the reference for plain attention: pages gathered once, then torch SDPA.

Used by ``reference.flash_attn_varlen_func`` for one query-length bucket at a time when nothing
needs the exact online-softmax emulation: no softcap, no ALiBi, no attention sinks, no LSE
requested, and the gathered keys fit a memory budget. Masking (bottom-right causal, sliding
window, key padding) follows flash-attn's contract exactly; query rows that see no key give 0,
as the kernel does. SDPA then runs its fused CPU kernel (or the device's) on dense tensors,
which is 2-3x faster than the chunked online softmax on prefill-sized buckets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from flashpage.kernels.reference import MaskSpec

_GATHER_BYTES = 256 << 20  # padded K+V of one bucket
_SCORE_ELEMS = 64 << 20  # n * H * Sq * Sk, in case SDPA falls back to its math kernel


def fits(n: int, rows_q: int, rows_k: int, heads: int, kv_heads: int, dim: int, elem: int) -> bool:
    """Whether a bucket of n sequences (queries padded to rows_q, keys to rows_k) fits the budgets."""
    return 2 * n * rows_k * kv_heads * dim * elem <= _GATHER_BYTES and n * heads * rows_q * rows_k <= _SCORE_ELEMS


def _keys(
    k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None, page: int, cu_k: torch.Tensor | None,
    idx: torch.Tensor, rows_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the bucket's sequences as (n, Hk, rows_k, D) (strided views; rows past a
    sequence's end hold junk that the mask hides)."""
    n = idx.shape[0]
    if block_table is not None:
        nb = -(-rows_k // page)
        ids = block_table[idx, :nb]
        kb = k[ids].view(n, nb * page, *k.shape[2:])
        vb = v[ids].view(n, nb * page, *v.shape[2:])
    else:
        assert cu_k is not None
        rows = (cu_k[idx][:, None] + torch.arange(rows_k, device=k.device)[None, :]).clamp(max=k.shape[0] - 1)
        kb, vb = k[rows], v[rows]
    return kb.transpose(1, 2), vb.transpose(1, 2)


def _mask(
    seq_q: torch.Tensor, seq_k: torch.Tensor, rows_q: int, cols: int, mask: MaskSpec
) -> torch.Tensor:
    """(n, 1, rows_q, cols) bool: key j visible to query i of each sequence."""
    dev = seq_q.device
    pos = torch.arange(cols, device=dev).view(1, 1, cols)
    qi = torch.arange(rows_q, device=dev).view(1, rows_q, 1)
    diag = qi + (seq_k - seq_q).view(-1, 1, 1)  # key on query i's diagonal (bottom-right aligned)
    visible = pos < seq_k.view(-1, 1, 1)
    if mask.causal:
        visible = visible & (pos <= diag)
    elif mask.local:
        visible = visible & (pos >= diag - mask.left) & (pos <= diag + mask.right)
    return visible.unsqueeze(1)


def attend_bucket(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor | None,
    page: int,
    cu_k: torch.Tensor | None,
    idx: torch.Tensor,
    qrows: torch.Tensor,
    sq: list[int],
    sk: list[int],
    mask: MaskSpec,
) -> torch.Tensor:
    """Attention of one bucket. q: (total_q, H, D); k, v: pages (NB, P, Hk, D) with block_table
    (B, M) int64, or packed (total_k, Hk, D) with cu_k (B + 1,) int64; idx: (n,) the bucket's
    sequences; qrows: (n, rows_q) their query rows in q (clamped); sq, sk: their true lengths.
    Returns (n, rows_q, H, D) in q's dtype; rows past a sequence's queries are junk."""
    n, rows_q = qrows.shape
    rows_k = max(sk)
    heads, kv_heads = q.shape[1], k.shape[-2]
    qb = q[qrows].transpose(1, 2)  # (n, H, rows_q, D)
    kb, vb = _keys(k, v, block_table, page, cu_k, idx, rows_k)
    cols = kb.shape[2]
    plain_causal = mask.causal and all(a == b == rows_q for a, b in zip(sq, sk, strict=True)) and cols == rows_q
    gqa = heads != kv_heads
    if plain_causal:
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=mask.scale, enable_gqa=gqa)
        return out.transpose(1, 2)
    seq_q = torch.tensor(sq, device=q.device)
    seq_k = torch.tensor(sk, device=q.device)
    visible = _mask(seq_q, seq_k, rows_q, cols, mask)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible, scale=mask.scale, enable_gqa=gqa)
    if mask.local or min(sk) == 0 or any(b < a for a, b in zip(sq, sk, strict=True)):
        out = torch.where(visible.any(-1, keepdim=True), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.transpose(1, 2)
