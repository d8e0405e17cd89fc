"""Multi-head latent attention (MLA: DeepSeek-V2/V3 and every model built the same way, e.g. GLM-4-MoE-Lite,
MiniCPM3, LongCat-Flash, Sarvam-MLA, Youtu, A.X-K1).

These models cache the compressed latent (``kv_nope``, kv_lora_rank wide, one "head") and the
shared rotary key (``k_rot``) and expand them to per-head K/V after the cache. The pages hold
the latents (the memory saving MLA exists for: one latent row per token instead of H heads of K
and V); ``update`` returns them gathered back (``dense_view``) and the attention runs on the
expanded K/V through flashpage's dense path (transformers' mask, exact).

An MLA model is recognised by what its attention does, not by its ``model_type``: the probe
(``checks.py``) sees the attention function receive K/V other than the ones ``cache.update``
returned, which sends any such model to the dense view. :func:`is_mla` only names the reason.
"""

from __future__ import annotations

import torch

NOTE = "MLA: compressed latents in pages, expanded after the cache; attention on the expanded K/V (dense view)"


def is_mla(module: torch.nn.Module) -> bool:
    """Whether an attention module projects K/V through a low-rank latent (MLA's ``kv_a_proj_with_mqa``
    / ``kv_b_proj`` pair, under any model's naming)."""
    names = {name for name, _ in module.named_children()}
    return any(n.startswith("kv_a_proj") for n in names) and any(n.startswith("kv_b_proj") for n in names)
