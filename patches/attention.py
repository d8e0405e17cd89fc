"""The attention and mask functions flashpage registers with transformers.

Registered as ``ATTN_NAME`` ("pagedkv": the name must not contain "flash", or transformers
would try to import flash-attn). The attention function has two paths:

- paged: the layer's new K/V were written to pages by ``HFPagedCache.update`` for this forward;
  attention runs on the pages through the step the cache planned once for the forward
  (``DeviceStep.attend``: flash-attn where eligible, else the exact PyTorch kernels);
- unpatched: no paged cache this forward (training, ``use_cache=False``, a cache the caller chose):
  the attention implementation the model had before ``patch()``, called as the model would call it
  (``unpatched.py``): losses, gradients and dropout are exactly the unpatched model's;
- dense: a model that expands cached latents, attention weights asked for, or a previous
  implementation flashpage cannot call (flex, flash-attn): the given K/V with transformers' own
  mask, computed as transformers' sdpa (or, for softcap, sinks and weights, eager) attention does;
  in a step the engine planned, varlen attention over each scheduled sequence's whole K/V
  (``HFPagedCache.step_kv``), ``cu_seqlens_q`` / ``cu_seqlens_k`` from the plan, causal bottom-right.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from flashpage.errors import NonCausalMaskError
from flashpage.kernels import dispatch
from flashpage.kernels.paged import LayerOptions
from flashpage.patches.unpatched import run_unpatched, unpatched_attention

ATTN_NAME = "pagedkv"


# per thread: the patched forward in flight whose causal attention reads the pages and ignores the mask
_PAGED_FORWARD = threading.local()


def set_paged_forward(model: str | None, cache: Any = None) -> None:
    """Say (patching's hooks) which model's paged forward is in flight on this thread (None: none), and its
    HFPagedCache. Skipped under ``torch.compile``, which traces the hooks (and the mask check is skipped there too)."""
    if not torch.compiler.is_compiling():
        _PAGED_FORWARD.model = model
        _PAGED_FORWARD.cache = cache


def paged_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Mask function: transformers' own sdpa mask, (B, 1, Lq, Lk) bool or None.

    The paged path ignores it (the step plan knows every sequence's keys, causal); the dense path
    (``use_cache=False``, a cache the caller chose, dense-view families) and attention weights use
    it exactly as transformers' sdpa / eager attention would, so those agree with the unpatched
    model. In a paged forward, a mask that lets a real token see a later one (image tokens attending
    bidirectionally: Gemma 3 / 4 ``token_type_ids``, PaliGemma's prefix) marks the forward: its layers
    still write their K/V to the pages, then attend under this mask over the keys read back from the pages
    (:func:`pagedkv_attention`), exactly as transformers does. Where the forward's plan is not the cache's own
    (the engine's packed steps) it raises :class:`~flashpage.errors.NonCausalMaskError` here, before any layer
    runs, instead of computing it causally. Trace-friendly: ``torch.compile(fullgraph=True)`` goes through it
    (the check is skipped while compiling).
    """
    mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"](*args, **kwargs)
    if torch.compiler.is_compiling() or not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2] < 2:
        return mask
    model = getattr(_PAGED_FORWARD, "model", None)
    if model is not None and sees_later_tokens(mask, kwargs):
        cache = getattr(_PAGED_FORWARD, "cache", None)
        if cache is not None and cache.owns_plan:  # generate()'s forward: attention under this mask (exact)
            cache.sees_later = True
            return mask
        raise NonCausalMaskError(
            f"{model}'s attention mask for this input lets tokens see later tokens (bidirectional attention, e.g. "
            "over image tokens marked by token_type_ids / mm_token_type_ids), which flashpage's packed engine steps "
            "cannot compute exactly. Run such inputs through the patched model's generate() (exact there), or "
            "unpatched; text-only prompts run in the engine as before.")
    return mask


def sees_later_tokens(mask: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether a (B, 1, Lq, Lk) bool mask lets a real (unpadded) query see a key at a later position.

    Query positions come from ``cache_position`` (transformers < 5.5) or ``q_offset``, key positions from
    ``kv_offset`` (both default to a query block ending the keys); padded query rows (0 in the 2D
    ``attention_mask``) are not counted."""
    q_len, k_len = mask.shape[-2], mask.shape[-1]
    device = mask.device
    positions = kwargs.get("cache_position")
    if isinstance(positions, torch.Tensor) and positions.numel() == q_len:
        q_pos = positions.to(device=device, dtype=torch.long)
    else:
        q_offset = kwargs.get("q_offset", k_len - q_len)
        q_pos = torch.arange(q_len, device=device) + int(q_offset)
    kv_offset = int(kwargs.get("kv_offset", 0) or 0)
    k_pos = torch.arange(k_len, device=device) + kv_offset
    later = mask & (k_pos[None, :] > q_pos[:, None])  # (B, 1, Lq, Lk)
    rows = later.any(dim=-1)[:, 0]  # (B, Lq)
    padding = kwargs.get("attention_mask")
    if isinstance(padding, torch.Tensor) and padding.dim() == 2:
        column = (q_pos - kv_offset).clamp(0, padding.shape[1] - 1).to(padding.device)
        rows = rows & padding.index_select(1, column).to(device=device, dtype=torch.bool)
    return bool(rows.any())


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
                      **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers attention function.

    Args:
        query: (B, H, Lq, D) after RoPE. key/value: (B, Hk, Lk, D/Dv) as ``cache.update`` returned
            them (ignored on the paged path).
        attention_mask: (B, 1, Lq, Lk) bool from :func:`paged_mask`, or None.
        output_attentions (in kwargs): also return the attention weights (B, H, Lq, Lk), computed
            as transformers' eager attention does.

    Returns:
        ``(out, weights or None)`` with out (B, Lq, H, Dv) contiguous.
    """
    state = getattr(module, "_flashpage_state", None)
    cache = getattr(state, "active_cache", None)
    if is_causal is None and attention_mask is None and _attends_all_unmasked(module, query, cache):
        is_causal = False
    own = unpatched_attention(module) if cache is None and not kwargs.get("output_attentions") else None
    if own is not None:  # no paged cache in this forward (training, use_cache=False): the unpatched attention
        if kwargs.get("indices") is not None:  # merged into the mask as the model does for eager / sdpa
            attention_mask = _merge_indices(attention_mask, kwargs.pop("indices"), query)
        given = {k: v for k, v in (("sliding_window", sliding_window), ("softcap", softcap),
                                   ("is_causal", is_causal), ("s_aux", s_aux)) if v is not None}
        return run_unpatched(*own, module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             **given, **kwargs)
    if dropout and module.training:
        raise ValueError("flashpage's attention is inference-only: dropout must be 0 (call model.eval())")
    options = _kernel_options(module, scaling, sliding_window, softcap, is_causal, s_aux)
    layer = getattr(module, "layer_idx", None)
    if layer is not None and layer < 0 and cache is not None:  # one module shared by several layers (Zamba2's
        layer = cache.last_written  # attention block, layer_idx=-1): the layer whose K/V update() just wrote
    weights = bool(kwargs.get("output_attentions", False))
    indices = kwargs.get("indices")  # a sparse-attention indexer's top-k keys per query (DeepSeek-V3.2 DSA)
    engine_dense = cache is not None and cache.dense_view and cache.plan is not None and not cache.owns_plan
    if engine_dense and indices is not None:
        raise RuntimeError("flashpage: the engine's dense-view step does not apply a sparse indexer's top-k keys "
                           "(LLM runs such models one sequence per forward: checks.generate_layout_reason)")
    if engine_dense and not weights:
        return _step_dense(cache, query, key, value, options), None  # the engine's step on the dense view
    paged = cache is not None and cache.plan is not None and not cache.dense_view and layer is not None
    chunk = state.chunks.get(layer, 0) if paged and getattr(state, "chunks", None) else 0
    # a sliding window (or chunk) counts padded positions; pages hold real tokens only: padding inside a
    # sequence (right padding, masks with holes) needs the logical layout for windowed layers; top-k indices
    # address logical key positions; a padded prefill's chunked layers take transformers' chunked mask
    local = options["window_size"] != (-1, -1) or chunk
    # a forward whose mask lets tokens see later ones (image tokens attending both ways, paged_mask): its K/V are
    # on the pages; attention under that mask over the keys read back, as transformers computes it
    logical = weights or indices is not None or (paged and (cache.sees_later or cache.has_holes and local)) or \
        (paged and chunk and not getattr(_step(cache, query), "supports_chunks", True))  # (a compiled packed step:
    # the engine's, which does)
    if paged and not logical:
        return _paged(cache, layer, query, options, chunk), None
    if paged:  # read the pages back as dense K/V at their logical positions (zeros at padding)
        key, value = cache.dense_kv(layer, query.dtype)
        if weights and sliding_window:  # transformers' sliding layers keep the last window - 1 past keys
            keep = min(key.shape[2] - query.shape[2], sliding_window - 1) + query.shape[2]
            key, value = key[:, :, -keep:], value[:, :, -keep:]
            attention_mask = attention_mask[..., -keep:] if attention_mask is not None else None
    if indices is not None:
        attention_mask = _select_keys(attention_mask, indices, query.shape[2], key.shape[2], options["causal"])
    return _dense(query, key, value, attention_mask, options, weights)


def _attends_all_unmasked(module: torch.nn.Module, query: torch.Tensor, cache: Any) -> bool:
    """Whether the unpatched model, handed no mask for this multi-token forward, attends to every key both ways:
    a module that says ``is_causal=False`` but is handed causal masks (PaliGemma's text model: patch() made it
    causal and marked it) under sdpa, which then reads ``module.is_causal`` (transformers skips the mask where
    there is no padding; an eager mask is always built, causal). Not in the engine's packed steps, which compute
    such a prompt as one span attending both ways (engine/multimodal.py ``PromptSpans``)."""
    state = getattr(module, "_flashpage_state", None)
    return (query.shape[2] > 1 and getattr(module, "_flashpage_unmasked_full", False)
            and getattr(state, "previous_attn", None) == "sdpa" and (cache is None or cache.owns_plan))


def _merge_indices(mask: torch.Tensor | None, indices: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """A DSA model's eager / sdpa mask: the keys its indexer did not select masked out, in the mask's own
    kind (bool: False; additive float: the dtype's minimum), as the model builds it for those implementations."""
    lk = mask.shape[-1] if mask is not None else int(indices.max()) + 1
    if mask is None or mask.dtype == torch.bool:
        return _select_keys(mask, indices, query.shape[2], lk, True)
    chosen = torch.zeros((indices.shape[0], query.shape[2], lk), dtype=torch.bool, device=indices.device)
    chosen.scatter_(-1, indices.long(), True)
    return mask.masked_fill(~chosen.unsqueeze(1), torch.finfo(query.dtype).min)


def _select_keys(mask: torch.Tensor | None, indices: torch.Tensor, lq: int, lk: int, causal: bool) -> torch.Tensor:
    """The mask restricted to the keys a sparse-attention indexer selected, as transformers' eager / sdpa
    paths of DSA models merge them: (B, 1, Lq, Lk) bool, True where a query attends a key.

    Args:
        mask: (B, 1, Lq, Lk) bool / additive float mask, or None (causal or full, by ``causal``).
        indices: (B, Lq, topk) integer key positions per query (logical, as the dense K/V lay them out).
    """
    if mask is None:
        mask = torch.ones((lq, lk), dtype=torch.bool, device=indices.device)
        mask = (mask.tril(lk - lq) if causal else mask)[None, None]
    elif mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else mask.to(torch.bool)
    mask = mask[..., :lk]
    chosen = torch.zeros((indices.shape[0], lq, lk), dtype=torch.bool, device=indices.device)
    chosen.scatter_(-1, indices.long(), True)
    return mask & chosen.unsqueeze(1)


def _step(cache: Any, query: torch.Tensor) -> Any:
    return cache.step if cache.step.input_slots.device == query.device else cache.plan.to(query.device)


def _paged(cache: Any, layer: int, query: torch.Tensor, options: dict[str, Any], chunk: int = 0) -> torch.Tensor:
    """Attention on the pages through the step the cache prepared for this forward (no checks,
    no backend choice, no host reads: this runs once per layer). ``chunk``: chunked attention's size."""
    kv = cache.kv
    opts = LayerOptions(options["softmax_scale"], options["causal"], options["window_size"], options["softcap"],
                        chunk=chunk)
    return _step(cache, query).attend(query, kv.k_pages(layer), kv.v_pages(layer), opts, options.get("s_aux"))


def _step_dense(cache: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                options: dict[str, Any]) -> torch.Tensor:
    """A step the engine planned, on the dense view: varlen attention of the step's queries over each
    sequence's whole K/V as the model hands them after its own per-token transforms (flash-attn's
    ``flash_attn_varlen_func`` contract: ``cu_seqlens_q`` over the step's tokens, ``cu_seqlens_k`` over
    the sequences' keys, causal bottom-right aligned).

    Args:
        query: (R, H, L, D): the packed step (R = 1) or one row per sequence (R = B).
        key / value: (R, H', W, D) / (R, H', W, Dv) in :meth:`HFPagedCache.step_kv`'s layout.

    Returns:
        (R, L, H, Dv) contiguous.
    """
    step = cache.step if cache.step.input_slots.device == query.device else cache.plan.to(query.device)
    plan = step.plan
    rows, heads, length, d = query.shape
    if step.token_index is not None or step.pad_rows is not None:
        raise RuntimeError("flashpage: the engine's dense-view step takes unpadded input (a packed step, equal rows)")
    q = query.transpose(1, 2).reshape(rows * length, heads, d)
    k, v = cache.step_keys(key), cache.step_keys(value)
    dv = v.shape[-1]
    width = max(d, dv)  # flash-attn's varlen takes one head size: zero columns change no score and no output
    q, k, v = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
    scale = options["softmax_scale"] if options["softmax_scale"] is not None else d ** -0.5
    out = dispatch.flash_attn_varlen_func(q.contiguous(), k.contiguous(), v.contiguous(), step.cu_seqlens_q,
                                          step.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
                                          softmax_scale=scale, causal=options["causal"],
                                          window_size=options["window_size"], softcap=options["softcap"],
                                          s_aux=options.get("s_aux"))
    return out[..., :dv].reshape(rows, length, heads, dv).contiguous()


def _dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           options: dict[str, Any], weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention on dense K/V (B, Hk, Lk, D) with the mask the model hands over (B, 1|H, Lq, Lk): bool, an
    additive float bias, or None
    (None: causal, bottom-right aligned). SDPA as transformers' sdpa attention calls it; softcap,
    attention sinks and attention weights as transformers' eager attention computes them."""
    lq, lk = query.shape[2], key.shape[2]
    scale = options["softmax_scale"] if options["softmax_scale"] is not None else query.shape[-1] ** -0.5
    if mask is not None and mask.shape[-1] > lk:  # a compiled forward's mask is max_cache_len wide
        mask = mask[..., :lk]
    if mask is not None and mask.dtype != torch.bool and not _is_bias(mask):
        mask = mask > torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else mask.to(torch.bool)
    if mask is None and options["causal"] and lq > 1:
        mask = torch.ones((lq, lk), dtype=torch.bool, device=query.device).tril(lk - lq)[None, None]
    plain = not options["softcap"] and options.get("s_aux") is None and not weights
    if plain:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    return _eager(query, key, value, mask, scale, options["softcap"], options.get("s_aux"))


def _is_bias(mask: torch.Tensor) -> bool:
    """A float mask that carries a bias (values other than 0 and the dtype's minimum, e.g. Doge's dynamic
    mask): it is added to the scores as transformers' sdpa / eager attention add it, not made boolean."""
    if not mask.is_floating_point():
        return False
    low = torch.finfo(mask.dtype).min / 2
    return bool(((mask != 0) & (mask > low)).any())


def _eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float, s_aux: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention: scores, softcap, additive mask (dtype min), sinks, softmax in fp32.
    ``mask``: bool (True: attend) or an additive float bias."""
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1) if group > 1 else key
    v = value.repeat_interleave(group, dim=1) if group > 1 else value
    scores = torch.matmul(query, k.transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask
    elif mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if s_aux is not None:
        sinks = s_aux.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=torch.float32).to(query.dtype)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, v)
    return out.transpose(1, 2).contiguous(), probs


def register() -> None:
    """Register the attention and mask functions under ``ATTN_NAME`` (idempotent)."""
    AttentionInterface.register(ATTN_NAME, pagedkv_attention)
    AttentionMaskInterface.register(ATTN_NAME, paged_mask)  # forwards whatever this transformers passes
