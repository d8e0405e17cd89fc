"""Adapters for models whose attention bypasses transformers' AttentionInterface.

GPT-Neo, GPT-NeoX-Japanese, BLOOM, MPT, Falcon and XGLM compute attention inline in their attention
module's ``forward`` (ALiBi biases, their own masks). Each still projects q/k/v, stores K/V through
``cache.update(key, value, layer)`` and projects the attention output back: only the core
``softmax(q k^T * scale + bias) v`` differs. One mechanism covers them all:

- :class:`LegacyAttention` says, per model type, which module class to adapt, and how its forward
  splits into ``qkv`` (the module's own projections and positional scheme: rotary, or none),
  the core (scale, sliding window, ALiBi slopes) and ``out`` (its output projection and return tuple);
- :func:`paged_forward` runs ``qkv``, stores K/V with ``cache.update`` (the pages), attends ON the pages
  through the step the cache planned (:meth:`flashpage.plan.DeviceStep.attend`: causal, window,
  ALiBi, GQA/MQA), then ``out``. This is what ``flashpage.LLM``'s packed steps need, so these models
  are exact in both ``generate()`` and ``LLM``;
- where the pages cannot say what the module computes, the module's own forward runs unchanged:
  no paged cache in this forward (training, ``use_cache=False``), attention weights asked for, or
  padding inside a row (right padding) under a window or ALiBi (both count padded positions): then
  ``update`` returns the K/V gathered back in the padded layout (``dense_view``), which is exact.

ALiBi: the model adds ``slope * key_position`` (BLOOM, Falcon: positions of real tokens; MPT: of the
padded row, which with left padding differs by a per-row constant). Softmax cancels a per-row
constant, so flash-attn's ``-slope * (query_position - key_position)`` on the pages is the same
distribution. Falcon adds the bias before its ``1/sqrt(d)`` scaling: its slopes are scaled by it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from flashpage.kernels.paged import LayerOptions

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
ABSENT = object()  # restore marker: the attribute did not exist on the instance before patch()


@dataclass(frozen=True)
class LegacyAttention:
    """How one model type's attention module splits around its core attention.

    Attributes:
        module_class: class name of the attention modules to adapt.
        qkv: ``(module, kwargs) -> (q (B, H, L, D), k (B, Hk, L, D), v (B, Hk, L, Dv))`` from the
            forward's bound arguments, positional encoding applied, before ``cache.update``.
        out: ``(module, attn (B, L, H, Dv), kwargs) -> the forward's return value``.
        scale: ``module -> softmax scale`` applied to ``q k^T``.
        window: ``module -> sliding window in tokens`` (None: full causal).
        slopes: ``module -> (H,) float32 ALiBi slopes on the CPU`` (None: no ALiBi).
        layer: ``module -> layer index`` its K/V are stored under.
        refuse: ``text config -> reason or None``: configurations the adapter cannot run exactly.
    """

    module_class: str
    qkv: Callable[[Any, dict[str, Any]], QKV]
    out: Callable[[Any, torch.Tensor, dict[str, Any]], Any]
    scale: Callable[[Any], float]
    window: Callable[[Any], int | None] = lambda m: None
    slopes: Callable[[Any], torch.Tensor] | None = None
    layer: Callable[[Any], int] = lambda m: m.layer_idx
    refuse: Callable[[Any], str | None] = lambda config: None


class Refused(Exception):
    """The adapter cannot run this configuration exactly (``patch`` turns it into UnsupportedModelError)."""


def install(model: torch.nn.Module, spec: LegacyAttention) -> list[tuple[Any, str, Any]]:
    """Give every ``spec.module_class`` module of ``model`` the paged forward; returns the
    ``(object, attribute, previous value or ABSENT)`` entries ``unpatch`` restores.
    Raises :class:`Refused` for a configuration the adapter cannot run exactly."""
    reason = spec.refuse(model.config.get_text_config(decoder=True))
    if reason:
        raise Refused(reason)
    restore = []
    for module in model.modules():
        if type(module).__name__ != spec.module_class:
            continue
        restore.append((module, "forward", vars(module).get("forward", ABSENT)))
        module.forward = _adapted(module, module.forward, spec)
    return restore


def _adapted(module: torch.nn.Module, original: Callable[..., Any], spec: LegacyAttention) -> Callable[..., Any]:
    import inspect

    signature = inspect.signature(original)

    def forward(*args: Any, **kwargs: Any) -> Any:
        cache = _paged_cache(module)
        if cache is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = {**bound.arguments.pop("kwargs", {}), **bound.arguments}
        if any(arguments.get(k) is not None for k in _CROSS_INPUTS):  # cross-attention: nothing of ours
            return original(*args, **kwargs)
        logical = cache.has_holes and (spec.slopes is not None or spec.window(module) is not None)
        if arguments.get("output_attentions") or logical:
            if not cache.owns_plan:  # the engine's dense view is its packed step layout, not the module's own
                raise RuntimeError(f"flashpage.LLM cannot run {type(module).__name__}'s own attention (attention "
                                   "weights, or padding inside a row under ALiBi / a window) on its packed steps")
            with _dense_view(cache):
                return original(*args, **kwargs)
        return paged_forward(module, cache, spec, arguments)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward


_CROSS_INPUTS = ("encoder_hidden_states", "key_value_states")


def _paged_cache(module: torch.nn.Module) -> Any:
    """The paged cache of the forward in flight when attention can run on its pages, else None."""
    state = getattr(module, "_flashpage_state", None)
    cache = getattr(state, "active_cache", None)
    if cache is None or cache.plan is None or cache.dense_view:
        return None
    return cache


@contextmanager
def _dense_view(cache: Any) -> Iterator[None]:
    """``update`` returns the K/V gathered back in the padded layout while the module's own forward runs."""
    cache.dense_view = True
    try:
        yield
    finally:
        cache.dense_view = False


def paged_forward(module: torch.nn.Module, cache: Any, spec: LegacyAttention, arguments: dict[str, Any]) -> Any:
    """The module's forward with K/V stored in, and attention run on, the pages."""
    query, key, value = spec.qkv(module, arguments)
    layer = spec.layer(module)
    cache.update(key, value, layer)
    window = spec.window(module)
    opts = LayerOptions(spec.scale(module), True, (window - 1, 0) if window else (-1, -1), 0.0,
                        _slopes(module, spec, query.device))
    step = cache.step if cache.step.input_slots.device == query.device else cache.plan.to(query.device)
    attn = step.attend(query, cache.kv.k_pages(layer), cache.kv.v_pages(layer), opts)  # (B, L, H, Dv)
    return spec.out(module, attn.to(query.dtype), arguments)


def _slopes(module: torch.nn.Module, spec: LegacyAttention, device: torch.device) -> torch.Tensor | None:
    if spec.slopes is None:
        return None
    memo = vars(module).setdefault("_flashpage_alibi", {})
    if device not in memo:
        memo[device] = spec.slopes(module).to(device=device, dtype=torch.float32)
    return memo[device]


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, heads * D) -> (B, heads, L, D)."""
    return x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


def _merged(attn: torch.Tensor) -> torch.Tensor:
    """(B, L, H, D) -> (B, L, H * D)."""
    return attn.reshape(attn.shape[0], attn.shape[1], -1)


# ------------------------------------------------------------------------------------ GPT-Neo
def _gpt_neo_qkv(m: Any, a: dict[str, Any]) -> QKV:
    h = a["hidden_states"]
    return (_heads(m.q_proj(h), m.num_heads), _heads(m.k_proj(h), m.num_heads), _heads(m.v_proj(h), m.num_heads))


GPT_NEO = LegacyAttention(
    "GPTNeoSelfAttention", _gpt_neo_qkv,
    out=lambda m, attn, a: (m.resid_dropout(m.out_proj(_merged(attn))), None),
    scale=lambda m: 1.0,  # GPT-Neo does not scale its scores
    window=lambda m: m.config.window_size if m.attention_type == "local" else None,
    layer=lambda m: m.layer_id,
)


# ------------------------------------------------------------------------- GPT-NeoX-Japanese
def _neox_japanese_qkv(m: Any, a: dict[str, Any]) -> QKV:
    from transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese import apply_rotary_pos_emb

    qkv = m.query_key_value(a["hidden_states"])
    qkv = qkv.view(*qkv.shape[:-1], m.num_attention_heads, 3 * m.head_size)
    q = qkv[..., : m.head_size].permute(0, 2, 1, 3)
    k = qkv[..., m.head_size: 2 * m.head_size].permute(0, 2, 1, 3)
    v = qkv[..., 2 * m.head_size:].permute(0, 2, 1, 3)
    cos, sin = a["position_embeddings"]
    q_rot, k_rot = apply_rotary_pos_emb(q[..., : m.rotary_ndims], k[..., : m.rotary_ndims], cos, sin)
    q = torch.cat((q_rot, q[..., m.rotary_ndims:]), dim=-1)
    k = torch.cat((k_rot, k[..., m.rotary_ndims:]), dim=-1)
    return q, k, v


GPT_NEOX_JAPANESE = LegacyAttention(
    "GPTNeoXJapaneseAttention", _neox_japanese_qkv,
    out=lambda m, attn, a: (m.dense(_merged(attn)), None, m.dense_bias),
    scale=lambda m: 1.0 / m.norm_factor,
)


# -------------------------------------------------------------------------------------- BLOOM
def _bloom_qkv(m: Any, a: dict[str, Any]) -> QKV:
    return m._reshape(m.query_key_value(a["hidden_states"]))


def _bloom_out(m: Any, attn: torch.Tensor, a: dict[str, Any]) -> Any:
    from transformers.models.bloom.modeling_bloom import dropout_add

    context = _merged(attn)
    if m.pretraining_tp > 1 and m.slow_but_exact:
        slices = m.hidden_size / m.pretraining_tp
        out = torch.zeros_like(context)
        for i in range(m.pretraining_tp):
            cols = slice(int(i * slices), int((i + 1) * slices))
            out = out + F.linear(context[:, :, cols], m.dense.weight[:, cols])
    else:
        out = m.dense(context)
    return dropout_add(out, a["residual"], m.hidden_dropout, m.training), None


def _bloom_slopes(m: Any) -> torch.Tensor:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), m.num_heads, torch.float32)  # (H, 1, 2)
    return alibi[:, 0, 1]  # slope * position 1


BLOOM = LegacyAttention("BloomAttention", _bloom_qkv, _bloom_out, scale=lambda m: m.inv_norm_factor,
                        slopes=_bloom_slopes)


# ---------------------------------------------------------------------------------------- MPT
def _mpt_qkv(m: Any, a: dict[str, Any]) -> QKV:
    mixed = m.Wqkv(a["hidden_states"])
    if m.clip_qkv:
        mixed = mixed.clamp(min=-m.clip_qkv, max=m.clip_qkv)
    q, k, v = mixed.chunk(3, dim=2)
    return _heads(q, m.n_heads), _heads(k, m.n_heads), _heads(v, m.n_heads)


def _mpt(config: Any) -> LegacyAttention:
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bias_max = config.attn_config.alibi_bias_max

    def slopes(m: Any) -> torch.Tensor:
        return -build_mpt_alibi_tensor(m.n_heads, 2, bias_max)[:, 0, 0].to(torch.float32)  # slope * (1 - 2)

    return LegacyAttention("MptAttention", _mpt_qkv, out=lambda m, attn, a: (m.out_proj(_merged(attn)), None),
                           scale=lambda m: m.softmax_scale, slopes=slopes if config.attn_config.alibi else None,
                           refuse=_mpt_refusal)


def _mpt_refusal(config: Any) -> str | None:
    attn = config.attn_config
    if attn.prefix_lm or attn.attn_uses_sequence_id or attn.qk_ln:
        return "its attention config uses prefix-LM / sequence-id masking or q/k LayerNorm, which the MPT adapter lacks"
    return None


# ------------------------------------------------------------------------------------- Falcon
def _falcon_qkv(m: Any, a: dict[str, Any]) -> QKV:
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    q, k, v = (x.transpose(1, 2) for x in _falcon_split(m, m.query_key_value(a["hidden_states"])))
    alibi = a["alibi"] is not None if "alibi" in a else m.config.alibi  # 5.25 passes ALiBi in the mask
    if not alibi:
        cos, sin = a["position_embeddings"]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def _falcon_split(m: Any, fused: torch.Tensor) -> QKV:
    """q (B, L, H, D), k and v (B, L, Hk, D) from the fused projection: the module's own ``_split_heads`` where
    it has one (before transformers 5.25; it broadcasts K/V to every head in the new decoder architecture),
    else 5.25's layout, one K/V per KV head (what its own forward stores, so a dense-view fallback reads the same
    pages)."""
    split = getattr(m, "_split_heads", None)
    if split is not None:
        return split(fused)
    fused = fused.view(*fused.shape[:-1], -1, m.head_dim)
    if m.new_decoder_architecture:  # per KV group: its queries, then its key and its value
        grouped = fused.view(*fused.shape[:2], m.num_kv_heads, -1, m.head_dim)
        return grouped[..., :-2, :].flatten(-3, -2), grouped[..., -2, :], grouped[..., -1, :]
    if m.multi_query:
        q, k, v = fused.split([m.num_heads, 1, 1], dim=-2)
        return q, k, v
    q, k, v = fused.unflatten(-2, (m.num_heads, 3)).unbind(-2)
    return q, k, v


def _falcon_slopes(m: Any) -> torch.Tensor:
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), m.num_heads, torch.float32)
    return alibi[:, 0, 1] * m.inv_norm_factor  # Falcon scales (score + bias) by 1/sqrt(d)


FALCON = LegacyAttention("FalconAttention", _falcon_qkv,
                         out=lambda m, attn, a: (m.dense(_merged(attn)), None),
                         scale=lambda m: 1.0 / math.sqrt(m.head_dim))
FALCON_ALIBI = LegacyAttention("FalconAttention", _falcon_qkv,
                               out=lambda m, attn, a: (m.dense(_merged(attn)), None),
                               scale=lambda m: m.inv_norm_factor, slopes=_falcon_slopes)


# ------------------------------------------------------------- BART-like decoders (XGLM, TrOCR, MVP)
def _bart_qkv(m: Any, a: dict[str, Any]) -> QKV:
    h = a["hidden_states"]
    q = _heads(m.q_proj(h) * m.scaling, m.num_heads)  # these models scale the query themselves
    return q, _heads(m.k_proj(h), m.num_heads), _heads(m.v_proj(h), m.num_heads)


def _bart(module_class: str, refuse: Callable[[Any], str | None] = lambda config: None) -> LegacyAttention:
    return LegacyAttention(module_class, _bart_qkv, out=lambda m, attn, a: (m.out_proj(_merged(attn)), None),
                           scale=lambda m: 1.0, refuse=refuse)


# ------------------------------------------------ BERT-like decoders (Megatron-BERT, RemBERT, RoFormer, BigBird)
def _bert_qkv(m: Any, a: dict[str, Any]) -> QKV:
    h = a["hidden_states"]
    q, k, v = (x(h).view(*h.shape[:-1], -1, m.attention_head_size).transpose(1, 2) for x in (m.query, m.key, m.value))
    rotary = a.get("sinusoidal_pos")
    if rotary is not None:  # RoFormer's rotary embedding (of the values too where it says so)
        if m.rotary_value:
            q, k, v = m.apply_rotary_position_embeddings(rotary, q, k, v)
        else:
            q, k = m.apply_rotary_position_embeddings(rotary, q, k)
    return q, k, v


def _decoder_only(config: Any) -> str | None:
    if not getattr(config, "is_decoder", False):
        return ("its config has is_decoder=False, so the prompt attends bidirectionally (later prompt tokens "
                "change earlier ones' K/V); set config.is_decoder=True for causal generation")
    return None


def _bert(module_class: str) -> LegacyAttention:
    return LegacyAttention(module_class, _bert_qkv, out=lambda m, attn, a: (_merged(attn), None),
                           scale=lambda m: 1.0 / math.sqrt(m.attention_head_size), refuse=_decoder_only)


def _bigbird_refusal(config: Any) -> str | None:
    if config.attention_type != "original_full":
        return (f"its attention_type is {config.attention_type!r} (block-sparse attention, computed by the model "
                "itself); set attention_type='original_full'")
    return _decoder_only(config)


def _mvp_refusal(config: Any) -> str | None:
    if config.use_prompt:
        return "it uses prompt key/value prefixes (use_prompt=True), which are not in the pages"
    return None


# ---------------------------------------------------------------------------------- registration
ADAPTERS: dict[str, Callable[[Any], LegacyAttention]] = {
    "gpt_neo": lambda config: GPT_NEO,
    "gpt_neox_japanese": lambda config: GPT_NEOX_JAPANESE,
    "bloom": lambda config: BLOOM,
    "mpt": _mpt,
    "falcon": lambda config: FALCON_ALIBI if config.alibi else FALCON,
    "xglm": lambda config: _bart("XGLMAttention"),
    "trocr": lambda config: _bart("TrOCRAttention"),
    "mvp": lambda config: _bart("MvpAttention", _mvp_refusal),
    "megatron-bert": lambda config: _bert("MegatronBertSelfAttention"),
    "rembert": lambda config: _bert("RemBertSelfAttention"),
    "roformer": lambda config: _bert("RoFormerSelfAttention"),
    "big_bird": lambda config: dataclasses.replace(_bert("BigBirdSelfAttention"), refuse=_bigbird_refusal),
}
# Types whose attention bypasses the interface in ways no adapter here can make exact: the reason patch() gives.
REFUSED = {
    "cpmant": "its attention adds a learned relative-position bias per (query, key) bucket, which flashpage's kernels "
              "do not implement",
    "prophetnet": "its n-gram self-attention predicts several future-token streams that attend to the main stream "
                  "and to each other with relative-position buckets, which the pages cannot hold",
    "xlm": "its forward takes the whole sequence at every step and cuts it by cache.get_seq_length() (one length for "
           "a batch), and its default causal=False attends bidirectionally over the prompt",
    "openai-gpt": "it keeps no K/V cache at all (its forward takes no cache; generate() recomputes the whole sequence "
                  "at every step), so there is nothing to page",
    "reformer": "its LSH and local attention hash keys into buckets and chunks and cache those, not per-token K/V",
    "rwkv": "it has no attention: its recurrent (time-mixing) state is a tuple of its own, not a transformers cache",
    "xlnet": "its two-stream attention adds relative-position and segment terms and keeps memories (mems), not a "
             "per-token K/V cache",
}
NOTE = ("bypasses the attention interface; its own q/k/v and output projections around attention on the pages "
        "(patches/legacy.py)")


def _installer(model_type: str) -> Callable[[torch.nn.Module], list[tuple[Any, str, Any]]]:
    def install_for(model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
        return install(model, ADAPTERS[model_type](model.config.get_text_config(decoder=True)))

    return install_for


def _refuser(reason: str) -> Callable[[torch.nn.Module], list[tuple[Any, str, Any]]]:
    def refuse(model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
        raise Refused(reason)

    return refuse


def _register() -> None:
    from flashpage.patches.families import FamilySpec, register_family

    for model_type in ADAPTERS:
        register_family(FamilySpec(model_type, "adapter", False, NOTE, install=_installer(model_type)))
    for model_type, reason in REFUSED.items():
        register_family(FamilySpec(model_type, "refused", False, reason, install=_refuser(reason)))


_register()
