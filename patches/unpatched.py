"""The attention of a patched model's forwards without a paged cache: the unpatched model's own.

Training (``use_cache=False``, gradients, gradient checkpointing, dropout in train mode) and any
forward with a cache the caller chose run through the attention implementation the model had
before ``patch()``: transformers' ``sdpa_attention_forward``, or the family's own
``eager_attention_forward`` (softcap, sinks, attention dropout exactly as the family applies
them). Same function, same arguments, same mask values, same dropout draws: a patched model
trains exactly as the unpatched one (tests/patches/test_training_untouched.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def unpatched_attention(module: torch.nn.Module) -> tuple[AttentionFn, bool] | None:
    """The attention function the unpatched model would call for ``module``, and whether it takes an
    additive float mask (eager) rather than sdpa's bool mask; None when flashpage cannot reproduce it
    (flex attention, flash-attn kernels, a custom registered function): the caller keeps its own path."""
    state = getattr(module, "_flashpage_state", None)
    previous = getattr(state, "previous_attn", None)
    if previous == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"], False
    if previous in (None, "eager"):
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        return (eager, True) if eager is not None else None
    return None


def eager_mask_from(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, dtype: torch.dtype,
                    causal: bool) -> torch.Tensor | None:
    """transformers' eager mask (B|1, 1, Lq, Lk) additive float (0 / dtype min) from sdpa's bool mask,
    or from None (sdpa skipped a plain causal mask, which eager always materialises)."""
    if mask is None:
        if not causal:
            return None
        lq, lk = query.shape[2], key.shape[2]
        mask = torch.ones((lq, lk), dtype=torch.bool, device=query.device).tril(lk - lq)[None, None]
    elif mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)


def run_unpatched(fn: AttentionFn, wants_float_mask: bool, module: torch.nn.Module, query: torch.Tensor,
                  key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Call the unpatched attention with the arguments the model gave flashpage's.

    Args:
        query: (B, H, Lq, D); key/value: (B, Hk, Lk, D/Dv); attention_mask: sdpa's (B, 1, Lq, Lk) bool or None.
        kwargs: everything else the model passed (dropout, scaling, sliding_window, softcap, s_aux, ...).

    Returns:
        ``(out (B, Lq, H, Dv), weights or None)`` as that implementation returns them.
    """
    if wants_float_mask:
        causal = kwargs.get("is_causal")
        causal = bool(causal if causal is not None else getattr(module, "is_causal", True))
        attention_mask = eager_mask_from(attention_mask, query, key, _mask_dtype(module, query), causal)
    return fn(module, query, key, value, attention_mask, **kwargs)


def _mask_dtype(module: torch.nn.Module, query: torch.Tensor) -> torch.dtype:
    """The dtype transformers builds the eager mask in: the model's (embeddings') dtype, which is the
    query's outside autocast."""
    weight = next(module.parameters(), None)
    return weight.dtype if weight is not None and weight.is_floating_point() else query.dtype
