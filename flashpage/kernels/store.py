"""store_kv: scatter new keys/values into the paged cache (vLLM's reshape_and_cache, in torch).

slot = block_id * block_size + offset; slot -1 means "do not store" (padding tokens).
One indexed copy per tensor, no Python loop and no host-device sync on CUDA.
"""

from __future__ import annotations

import torch

from flashpage.errors import KernelInputError


def _check(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    fn = "store_kv"
    if k_cache.dim() != 4 or v_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
        raise KernelInputError(
            f"{fn}: k_cache and v_cache must be (NB, P, Hk, D) and (NB, P, Hk, Dv) with the same NB, P "
            f"and Hk, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    rows = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        expected = (rows, *cache.shape[2:])
        if tuple(t.shape) != expected:
            raise KernelInputError(
                f"{fn}: {name} must have shape (T, Hk, D) = {expected} (T = "
                f"slot_mapping.shape[0]), got {tuple(t.shape)}"
            )
        if t.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
            raise KernelInputError(
                f"{fn}: {name} has dtype {t.dtype} but the caches have {k_cache.dtype} / "
                f"{v_cache.dtype}; cast the new keys/values to the cache dtype"
            )
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(
            f"{fn}: slot_mapping must be a (T,) int32 or int64 tensor, got "
            f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        total = k_cache.shape[0] * k_cache.shape[1]
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= total:
            raise KernelInputError(
                f"{fn}: slot_mapping values must be -1 (skip) or in [0, NB * P = {total}), "
                f"got range [{lo}, {hi}]; slot = block_id * block_size + offset"
            )


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k[t] (T, Hk, D) and v[t] (T, Hk, Dv) to k_cache (NB, P, Hk, D) and v_cache
    (NB, P, Hk, Dv) at slot_mapping[t], in place (Dv may differ from D, as in DeepSeek MLA).

    Slots equal to -1 are skipped. The caches may be views (only the last dim contiguous).
    On accelerators it is sync-free: a skipped token is redirected to the first stored token's slot with that
    token's value (same bytes, so duplicate writes agree); if no token is stored, slot 0 is
    rewritten with its own value.
    """
    _check(k_cache, v_cache, k, v, slot_mapping)
    if slot_mapping.numel() == 0 or k_cache.shape[0] * k_cache.shape[1] == 0:
        return
    page = k_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if slots.device.type == "cpu":  # host tensors: syncing is free, so drop skipped tokens up front
        if not bool(keep.all()):
            slots, k, v = slots[keep], k[keep], v[keep]
        block, offset = slots // page, slots % page
        k_cache[block, offset] = k
        v_cache[block, offset] = v
        return
    first = torch.argmax(keep.to(torch.int8))  # first stored token (0 if none)
    any_kept = keep[first]
    fallback = torch.where(any_kept, slots[first], torch.zeros_like(slots[first]))
    target = torch.where(keep, slots, fallback)
    block, offset = target // page, target % page
    for cache, new in ((k_cache, k), (v_cache, v)):
        fb_value = torch.where(any_kept, new[first], cache[0, 0])
        values = torch.where(keep[:, None, None], new, fb_value)
        cache[block, offset] = values
