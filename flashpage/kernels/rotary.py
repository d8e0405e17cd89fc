"""Rotary position embedding as flash-attn's kvcache kernel applies it (interleaved and NeoX).

Only the first rotary_dim = 2 * cos.shape[1] channels rotate; the rest pass through. The rotation
is computed in fp32 (fp64 for fp64 inputs) and rounded once to the input dtype, like the kernel.
"""

from __future__ import annotations

import torch


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate x (B, S, H, D) with the table rows at positions (B, S) int64.

    cos, sin: (seqlen_ro, rotary_dim / 2). interleaved: pairs (0, 1), (2, 3), ...; otherwise
    NeoX/GPT-J "rotate half" pairs (i, i + rotary_dim / 2). Returns a new tensor in x's dtype.
    """
    half = cos.shape[1]
    rd = 2 * half
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    positions = positions.clamp(0, cos.shape[0] - 1)
    c = cos.to(acc)[positions].unsqueeze(2)  # (B, S, 1, rd/2)
    s = sin.to(acc)[positions].unsqueeze(2)
    xr = x[..., :rd].to(acc)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    out = x.clone()
    out[..., :rd] = rotated.to(x.dtype)
    return out


def query_positions(cache_seqlens: torch.Tensor, seqlen_q: int, per_row: bool) -> torch.Tensor:
    """Positions of q rows: L + i when causal or local (per_row), else L for every row. (B, Sq) int64."""
    base = cache_seqlens.to(torch.int64)[:, None]
    if not per_row:
        return base.expand(-1, seqlen_q)
    return base + torch.arange(seqlen_q, device=cache_seqlens.device)[None, :]


def key_positions(cache_seqlens: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Positions of appended key rows: L + t. (B, Sn) int64."""
    base = cache_seqlens.to(torch.int64)[:, None]
    return base + torch.arange(new_tokens, device=cache_seqlens.device)[None, :]
