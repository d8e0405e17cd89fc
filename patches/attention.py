"""The attention and mask functions flashpage registers with transformers.

Registered as ``ATTN_NAME`` ("pagedkv": the name must not contain "flash", or transformers
would try to import flash-attn). The attention function has two paths:

- paged: the layer's new K/V were written to pages by ``HFPagedCache.update`` for this forward;
  attention runs on the pages with ``flash_attn_with_kvcache`` (every sequence has the same
  number of new tokens and no padding) or ``flash_attn_varlen_func(block_table=...)``
  (padding, or packed engine steps);
- dense: no paged cache this forward (``use_cache=False``, or a model that expands cached
  latents): the given K/V are used directly, padding removed via the 2D mask and
  ``flash_attn_varlen_func``.
Both go through flashpage's kernels, so they run on flash-attn where it applies and on the
exact PyTorch reference everywhere else.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from flashpage.kernels import flash_attn_varlen_func, flash_attn_with_kvcache
from flashpage.patches.compat import adapt_mask_function

ATTN_NAME = "pagedkv"


def paged_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function: Any = None, attention_mask: torch.Tensor | None = None,
               device: torch.device | str = "cpu", **kwargs) -> torch.Tensor | None:
    """Mask function: the 2D padding mask (B, kv_length), or None when nothing is padded.

    Keys past the written ones (a static cache is ``kv_length`` wide but holds only
    ``q_offset + q_length`` tokens) are marked padding so the dense path never reads them.
    """
    if attention_mask is not None and attention_mask.dim() != 2:
        return attention_mask
    filled = int(q_offset) + q_length
    narrow = attention_mask is None or attention_mask.shape[1] < kv_length
    if narrow and kv_length > filled and kv_offset == 0:
        written = (attention_mask[:, -filled:].to(torch.bool) if attention_mask is not None
                   else torch.ones((batch_size, filled), dtype=torch.bool, device=device))
        empty = torch.zeros((batch_size, kv_length - filled), dtype=torch.bool, device=written.device)
        return torch.cat([written, empty], dim=1)
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _kernel_options(module: torch.nn.Module, scaling: float | None, sliding_window: int | None,
                    softcap: float | None, is_causal: bool | None, s_aux: torch.Tensor | None) -> dict[str, Any]:
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (-1, -1)
    if sliding_window is not None and sliding_window > 0:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    options: dict[str, Any] = {"softmax_scale": scaling, "causal": causal, "window_size": window,
                               "softcap": float(softcap) if softcap else 0.0}
    if s_aux is not None:
        options["s_aux"] = s_aux
    return options


def pagedkv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, s_aux: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function.

    Args:
        query: (B, H, Lq, D) after RoPE. key/value: (B, Hk, Lk, D/Dv) as ``cache.update`` returned
            them (ignored on the paged path).
        attention_mask: (B, Lk) bool padding mask from :func:`paged_mask`, or None.

    Returns:
        ``(out, None)`` with out (B, Lq, H, Dv) contiguous.
    """
    if dropout and module.training:
        raise ValueError("flashpage's attention is inference-only: dropout must be 0 (call model.eval())")
    options = _kernel_options(module, scaling, sliding_window, softcap, is_causal, s_aux)
    cache = getattr(getattr(module, "_flashpage_state", None), "active_cache", None)
    layer = getattr(module, "layer_idx", None)
    if cache is not None and cache.plan is not None and not cache.dense_view and layer is not None:
        return _paged(cache, layer, query, options), None
    return _dense(query, key, value, attention_mask, options), None


def _paged(cache: Any, layer: int, query: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
    b, h, lq, d = query.shape
    kv = cache.kv
    plan = cache.plan.on(query.device)
    k_pages, v_pages = kv.k_pages(layer), kv.v_pages(layer)
    q = query.transpose(1, 2)  # (B, Lq, H, D), last dim contiguous
    n_seq = len(plan.seq_ids)
    if plan.uniform_query and plan.token_index is None and n_seq * plan.max_seqlen_q == b * lq:
        q = q.reshape(n_seq, plan.max_seqlen_q, h, d)
        out = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=plan.seqlens_k,
                                      block_table=plan.block_table, **options)
        return out.reshape(b, lq, h, -1)
    flat = q.reshape(b * lq, h, d)
    if plan.token_index is not None:
        flat = flat.index_select(0, plan.token_index)
    out = flash_attn_varlen_func(flat, k_pages, v_pages, cu_seqlens_q=plan.cu_seqlens_q,
                                 cu_seqlens_k=plan.cu_seqlens_k, max_seqlen_q=plan.max_seqlen_q,
                                 max_seqlen_k=plan.max_seqlen_k, block_table=plan.block_table, **options)
    if plan.token_index is None:
        return out.reshape(b, lq, h, -1)
    full = out.new_zeros((b * lq, h, out.shape[-1]))
    full.index_copy_(0, plan.token_index, out)
    return full.reshape(b, lq, h, -1)


def _dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
           options: dict[str, Any]) -> torch.Tensor:
    b, h, lq, d = query.shape
    lk, dv = key.shape[2], value.shape[-1]
    if dv != d:  # kernels need one head dim (MLA: value dim < key dim): pad, then slice back
        value = torch.nn.functional.pad(value, (0, d - dv))
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if attention_mask is None or attention_mask.dim() != 2:
        seqlens = torch.full((b,), lk, dtype=torch.int32, device=query.device)
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, **options)
        return out[..., :dv].contiguous()
    key_mask = attention_mask[:, -lk:].to(torch.bool)
    written = int(key_mask.any(0).nonzero().max()) + 1 if bool(key_mask.any()) else lq
    if written < lk:  # a static cache: drop its never-written tail so the queries are the last keys again
        key_mask, k, v, lk = key_mask[:, :written], k[:, :written], v[:, :written], written
    q_mask = key_mask[:, -lq:]
    q_index = q_mask.reshape(-1).nonzero().squeeze(1)
    k_index = key_mask.reshape(-1).nonzero().squeeze(1)
    zero = torch.zeros(1, dtype=torch.int32, device=query.device)
    cu_q = torch.cat([zero, q_mask.sum(1).cumsum(0).to(torch.int32)])
    cu_k = torch.cat([zero, key_mask.sum(1).cumsum(0).to(torch.int32)])
    out = flash_attn_varlen_func(
        q.reshape(b * lq, h, d).index_select(0, q_index),
        k.reshape(b * lk, k.shape[2], d).index_select(0, k_index),
        v.reshape(b * lk, v.shape[2], d).index_select(0, k_index),
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=lq, max_seqlen_k=lk, **options,
    )
    full = out.new_zeros((b * lq, h, d))
    full.index_copy_(0, q_index, out)
    return full.reshape(b, lq, h, d)[..., :dv].contiguous()


def register() -> None:
    """Register the attention and mask functions under ``ATTN_NAME`` (idempotent)."""
    AttentionInterface.register(ATTN_NAME, pagedkv_attention)
    AttentionMaskInterface.register(ATTN_NAME, adapt_mask_function(paged_mask))
