"""Independent float64 oracle for flash-attn's kvcache and varlen attention (test helper).

Written from docs/flash-attn-contract.md and flash-attn's flash_api.cpp / mask.h, not
from flashpage's implementation: one sequence at a time, keys collected row by row, dense masks.
`round_dtype` rounds P (and the output) to that dtype, giving the "ref_in_dtype" of the contract's
tolerance rule; without it everything stays float64.
"""

from __future__ import annotations

import math

import torch


def effective_mask(
    causal: bool, window: tuple[int, int], seqlen_q: int, seqlen_k: int, has_alibi: bool
) -> tuple[bool, bool, int, int]:
    """flash-attn's normalisation: (is_causal, is_local, left, right) with finite windows."""
    left, right = int(window[0]), int(window[1])
    if seqlen_q == 1 and not has_alibi:
        causal = False
    if causal:
        right = 0
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    is_causal = left < 0 and right == 0
    if left < 0 <= right:
        left = seqlen_k
    if right < 0 <= left:
        right = seqlen_k
    is_local = (left >= 0 or right >= 0) and not is_causal
    return is_causal, is_local, left, right


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: list[int],
    interleaved: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rotate rows x (S, Hx, D) (float64) at positions pos; the result is rounded to dtype."""
    out = x.clone()
    half = cos.shape[1]
    first = [2 * i for i in range(half)] if interleaved else list(range(half))
    second = [2 * i + 1 for i in range(half)] if interleaved else [i + half for i in range(half)]
    for s, p in enumerate(pos):
        p = min(p, cos.shape[0] - 1)
        c, sn = cos[p], sin[p]
        xa, xb = x[s][:, first], x[s][:, second]
        out[s][:, first] = xa * c - xb * sn
        out[s][:, second] = xa * sn + xb * c
    return out.to(dtype).double()


def attend_one(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    softcap: float,
    mask_rule: tuple[bool, bool, int, int],
    slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    round_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q (Sq, H, D), keys/values (Sk, Hk, D), float64. Returns out (Sq, H, D), lse (H, Sq)."""
    sq, heads, _ = q.shape
    sk, kv_heads, dv = values.shape
    group = heads // kv_heads
    is_causal, is_local, left, right = mask_rule
    i_idx = torch.arange(sq)[:, None]
    j_idx = torch.arange(sk)[None, :]
    diag = i_idx + sk - sq  # the key each query row is aligned with (bottom-right)
    if is_causal:
        allowed = j_idx <= diag
    elif is_local:
        allowed = (j_idx >= diag - left) & (j_idx <= diag + right)
    else:
        allowed = torch.ones(sq, sk, dtype=torch.bool)
    out = torch.zeros(sq, heads, dv, dtype=torch.float64)
    lse = torch.full((heads, sq), math.inf, dtype=torch.float64)
    for h in range(heads):
        kh, vh = keys[:, h // group, :], values[:, h // group, :]
        s = (q[:, h, :] @ kh.T) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            slope = float(slopes[h])
            if is_causal:
                s = s + slope * j_idx.double()
            else:
                s = s - slope * (diag - j_idx).abs().double()
        s = s.masked_fill(~allowed, -math.inf)
        m = s.max(dim=1).values if sk else torch.full((sq,), -math.inf, dtype=torch.float64)
        if sinks is not None:
            m = torch.clamp(m, min=float(sinks[h]))
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m_safe[:, None]).masked_fill(~allowed, 0.0)
        denom = p.sum(dim=1)
        if sinks is not None:
            denom = denom + torch.exp(float(sinks[h]) - m_safe)
        p_num = p.to(round_dtype).double() if round_dtype is not None else p
        o = (p_num @ vh) / denom.clamp(min=1e-300)[:, None]
        o = torch.where(denom[:, None] > 0, o, torch.zeros_like(o))
        out[:, h] = o.to(round_dtype).double() if round_dtype is not None else o
        lse[h] = torch.where(denom > 0, m_safe + torch.log(denom), torch.full_like(denom, math.inf))
    return out, lse


def oracle_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    s_aux=None,
    round_dtype=None,
):
    """flash_attn_with_kvcache on copies. Returns (out (B,Sq,H,D), lse (B,H,Sq), k_cache', v_cache'),
    out/lse in float64, the caches in their own dtype (the appended rows written as flash-attn would)."""
    dtype = q.dtype
    batch, sq, heads, d = q.shape
    kc, vc = k_cache.clone(), v_cache.clone()
    paged = block_table is not None
    page = kc.shape[1]
    capacity = block_table.shape[1] * page if paged else kc.shape[1]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    rule = effective_mask(causal, window_size, sq, capacity, alibi_slopes is not None)
    new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for b in range(batch):
        length = capacity if cache_seqlens is None else int(cache_seqlens[b])
        pad = 0 if cache_leftpad is None else int(cache_leftpad[b])
        cb = b if cache_batch_idx is None else int(cache_batch_idx[b])

        def where(row: int, b=b, cb=cb) -> tuple[int, int]:
            if paged:
                return int(block_table[b, row // page]), row % page
            return cb, row

        qb = q[b].double()
        if k is not None:
            kb = k[b].double()
            if rotary_cos is not None:
                kb = rope(
                    kb,
                    rotary_cos.double(),
                    rotary_sin.double(),
                    [length + t for t in range(new)],
                    rotary_interleaved,
                    dtype,
                )
                per_row = rule[0] or rule[1]
                qpos = [length + i if per_row else length for i in range(sq)]
                qb = rope(qb, rotary_cos.double(), rotary_sin.double(), qpos, rotary_interleaved, dtype)
            for t in range(new):
                x, y = where(length + t)
                kc[x, y] = kb[t].to(dtype)
                vc[x, y] = v[b, t]
        key_rows = [where(r) for r in range(pad, length + new)]
        keys = (
            torch.stack([kc[x, y] for x, y in key_rows]).double()
            if key_rows
            else torch.zeros(0, kc.shape[2], d, dtype=torch.float64)
        )
        vals = (
            torch.stack([vc[x, y] for x, y in key_rows]).double()
            if key_rows
            else torch.zeros(0, vc.shape[2], vc.shape[3], dtype=torch.float64)
        )
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        o, lse = attend_one(qb, keys, vals, scale, softcap, rule, slopes, s_aux, round_dtype)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses), kc, vc


def oracle_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    block_table=None,
    s_aux=None,
    round_dtype=None,
):
    """flash_attn_varlen_func. Returns out (total_q, H, D) and lse (H, total_q), float64."""
    total_q, heads, d = q.shape
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    rule = effective_mask(causal, window_size, max_seqlen_q, max_seqlen_k, alibi_slopes is not None)
    out = torch.zeros(total_q, heads, v.shape[-1], dtype=torch.float64)
    lse = torch.full((heads, total_q), math.inf, dtype=torch.float64)
    batch = cu_seqlens_q.numel() - 1
    for b in range(batch):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if block_table is not None:
            page = k.shape[1]
            rows = [(int(block_table[b, r // page]), r % page) for r in range(k1 - k0)]
            keys = [k[x, y] for x, y in rows]
            vals = [v[x, y] for x, y in rows]
        else:
            keys = [k[r] for r in range(k0, k1)]
            vals = [v[r] for r in range(k0, k1)]
        kb = torch.stack(keys).double() if keys else torch.zeros(0, k.shape[-2], d, dtype=torch.float64)
        vb = (
            torch.stack(vals).double()
            if vals
            else torch.zeros(0, v.shape[-2], v.shape[-1], dtype=torch.float64)
        )
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        o, lb = attend_one(q[q0:q1].double(), kb, vb, scale, softcap, rule, slopes, s_aux, round_dtype)
        out[q0:q1] = o
        lse[:, q0:q1] = lb
    return out, lse
