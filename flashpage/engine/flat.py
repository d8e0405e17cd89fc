"""The engine's eager step of a plain pre-norm decoder (Llama, Mistral, Qwen2, Qwen3) as one flat loop.

An eager transformers forward reaches each op through module calls (``nn.Module.__call__`` and its hook
checks), decorators (``deprecate_kwarg``, ``capture_outputs``, ``merge_with_config_defaults``), keyword
dictionaries, config attribute lookups and the attention-interface registry: on CPU, at batch 1, that
Python costs about as much as the model's GEMMs (docs/benchmarks.md). :class:`FlatDecoder` runs the
same step as a loop over the layers that calls the very ops the patched model calls, in the same order:
the embedding, the model's own rotary-embedding module, the fast path's fused norms / rotary / gated MLPs
(``engine/fastpath.py``), the oneDNN (packed, fused-sibling) linears (``engine/linears.py``), the cache's
``update`` (the K/V store) and the step's paged attention. It therefore computes bit for bit what the
patched model computes, and the engine proves it on a step (:meth:`FlatDecoder.verify`: both forwards,
logits compared with ``torch.equal``) before it relies on it; a model that differs keeps the module forward.

Which models: the causal LMs of :data:`FAMILIES` whose modules are exactly the family's classes (a
subclass or a wrapped linear, say PEFT's, is not), with no forward hooks on the modules the loop calls
(tensor-parallel and offloading hooks run there) and no attention-implementation switch.
``FLASHPAGE_FLAT=0`` turns it off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules import module as nn_module

from flashpage.kernels.paged import LayerOptions

if TYPE_CHECKING:
    from flashpage.patches.hf_cache import HFPagedCache

ENV = "FLASHPAGE_FLAT"
# model_type -> the class-name prefix of its modeling classes (LlamaForCausalLM, LlamaModel, LlamaDecoderLayer,
# LlamaAttention, LlamaMLP, LlamaRMSNorm): the families whose decoder layer is exactly the loop below
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
_QK_NORM = {"qwen3"}  # RMS norms on each head's queries and keys before the rotary (Qwen3)


def enabled_by_env() -> bool:
    """False when ``FLASHPAGE_FLAT`` is 0/false/off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@dataclass(frozen=True)
class FlatLayer:
    """One decoder layer's bound forwards (each module's own ``forward``: the fused / oneDNN one where
    the engine installed it) and its head size."""

    index: int
    attn_norm: Callable[[torch.Tensor], torch.Tensor]
    q: Callable[[torch.Tensor], torch.Tensor]
    k: Callable[[torch.Tensor], torch.Tensor]
    v: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None
    mlp_norm: Callable[[torch.Tensor], torch.Tensor]
    mlp: Callable[[torch.Tensor], torch.Tensor]
    head_dim: int


@dataclass
class FlatDecoder:
    """A flat engine step for one model (see the module docstring); build it with :func:`flat_decoder`.

    Attributes:
        layers: the decoder layers, in order.
        hooks: the forward-hook tables of every module the loop calls (a hook added later makes the
            step fall back to the module forward: :meth:`usable`).
        options: each layer's attention options, as the model's own forward passed them to the paged
            attention on the verifying step (the window a family takes from its config or its module).
        verified: the verifying step proved the loop equal to the module forward.
        failed: why it did not (the engine then keeps the module forward), or None.
    """

    embed: Callable[[torch.Tensor], torch.Tensor]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    layers: list[FlatLayer]
    norm: Callable[[torch.Tensor], torch.Tensor]
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    modeling: Any  # the modeling module: its apply_rotary_pos_emb, read at each step (the fast path's, if installed)
    hooks: list[dict]
    modules: tuple[int, ...]  # id() of every module the loop calls: the same model structure
    options: list[LayerOptions] = field(default_factory=list)
    verified: bool = False
    failed: str | None = None

    def usable(self) -> bool:
        """Verified, no module the loop calls has gained a forward hook, and no global hook is set."""
        return self.verified and not (any(self.hooks) or nn_module._global_forward_hooks
                                      or nn_module._global_forward_pre_hooks)

    def forward(self, cache: HFPagedCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                keep_rows: torch.Tensor) -> torch.Tensor:
        """The step's logits rows: input_ids / position_ids (1, T), keep_rows (K,) int64 -> (K, V).

        The cache holds the engine's plan for this step (``set_plan``); each layer stores its K/V through
        ``cache.update`` and attends on the pages through the plan's device step."""
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)
        length = input_ids.shape[1]
        kv, step = cache.kv, cache.step
        apply_rotary = self.modeling.apply_rotary_pos_emb
        for layer, options in zip(self.layers, self.options, strict=True):
            x = layer.attn_norm(hidden)
            shape = (1, length, -1, layer.head_dim)
            q, k, v = layer.q(x).view(shape), layer.k(x).view(shape), layer.v(x).view(shape)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            cache.update(k, v.transpose(1, 2), layer.index)
            out = step.attend(q, kv.k_pages(layer.index), kv.v_pages(layer.index), options)
            # the residual adds in place: ``hidden`` is the step's own tensor (the embedding's output, then these
            # sums), which no op of the loop keeps; the same add as ``hidden + ...``, without a new T x hidden tensor
            hidden.add_(layer.o(out.reshape(1, length, -1).contiguous()))
            hidden.add_(layer.mlp(layer.mlp_norm(hidden)))
        return self.lm_head(self.norm(hidden)[:, keep_rows])[0]  # normed, then sliced: as the model does

    def verify(self, cache: HFPagedCache, module_forward: Callable[[], torch.Tensor], input_ids: torch.Tensor,
               position_ids: torch.Tensor, keep_rows: torch.Tensor) -> torch.Tensor:
        """Run the step through the model's forward (``module_forward``: its kept logits rows), recording each
        layer's attention options, then through the loop, and compare the logits bit for bit. Returns the
        module forward's logits; sets ``verified`` or ``failed``. A loop that differs or raises has its K/V
        rewritten by a second module forward, so the cache holds exactly what the model computes."""
        plan, step = cache.plan, cache.step
        expected, seen = _recording(step, module_forward)
        cache.plan, cache.step = plan, step  # the module forward ended the plan; the loop runs it again
        try:
            self.failed = self._take_options(cache, seen)
            if self.failed is None:
                self.failed = _compare(expected, self.forward(cache, input_ids, position_ids, keep_rows))
        except Exception as exc:  # noqa: BLE001 - any failure of the loop means: keep the module forward
            self.failed = f"flat step raised {type(exc).__name__}: {exc}"
        finally:
            cache.plan, cache.step = plan, step
        if self.failed is not None:
            module_forward()  # the loop may have stored other K/V: store the module forward's again
            self.options = []
            return expected
        cache.end_forward(ok=True)
        self.verified = True
        return expected

    def _take_options(self, cache: HFPagedCache, seen: dict[int, LayerOptions | str]) -> str | None:
        """Fill ``options`` from what the module forward passed (``seen``: by K pages); or why the loop
        cannot take them."""
        options = [seen.get(cache.kv.k_pages(layer.index).data_ptr()) for layer in self.layers]
        bad = [i for i, o in enumerate(options) if not isinstance(o, LayerOptions) or o.alibi_slopes is not None
               or o.chunk]
        if bad:
            return f"layer {bad[0]}'s attention is not plain paged attention ({options[bad[0]]!r})"
        self.options = options  # type: ignore[assignment]
        return None


def _recording(step: Any, module_forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """``module_forward()``, and the options each layer's paged attention got, by the address of its K pages
    (the step's ``attend`` wrapped for the call)."""
    seen: dict[int, LayerOptions | str] = {}
    attend = step.attend

    def recording(query, k_pages, v_pages, opts, s_aux=None):
        seen[k_pages.data_ptr()] = opts if s_aux is None else "attention sinks"
        return attend(query, k_pages, v_pages, opts, s_aux)

    step.attend = recording
    try:
        return module_forward(), seen
    finally:
        del step.attend


def _compare(expected: torch.Tensor, got: torch.Tensor) -> str | None:
    """None when the flat step's logits equal the module forward's bit for bit, else how they differ."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"flat step logits {tuple(got.shape)} {got.dtype} vs {tuple(expected.shape)} {expected.dtype}"
    if not torch.equal(got, expected):
        diff = (got.double() - expected.double()).abs().max().item()
        return f"flat step differs from the model's forward (max |logit difference| {diff:.3g})"
    return None


def flat_decoder(model: Any) -> FlatDecoder | str:
    """The flat step of ``model``, or why it has none (a sentence for ``LLM.stats()`` / ``flashpage info``)."""
    if not enabled_by_env():
        return f"{ENV}=0"
    config = getattr(model, "config", None)
    family = FAMILIES.get(getattr(config, "model_type", ""))
    if family is None:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {sorted(FAMILIES)}"
    modeling = sys.modules.get(type(model).__module__)
    qk_norm = config.model_type in _QK_NORM
    wrong = _wrong_classes(model, modeling, family, qk_norm)
    if wrong:
        return f"not the plain {family} modules: {wrong}"
    if getattr(config, "_attn_implementation", None) != "pagedkv":
        return "attention is not flashpage's (patch() the model)"
    inner = model.model
    layers = list(inner.layers)
    if len(layers) != config.num_hidden_layers:
        return f"{len(layers)} decoder layers for num_hidden_layers={config.num_hidden_layers}"
    if not callable(getattr(modeling, "apply_rotary_pos_emb", None)):
        return f"{type(model).__module__} has no apply_rotary_pos_emb"
    called = [inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head]
    flat_layers = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        called += [layer.input_layernorm, layer.post_attention_layernorm, mlp, attn.q_proj, attn.k_proj,
                   attn.v_proj, attn.o_proj, *((attn.q_norm, attn.k_norm) if qk_norm else ())]
        flat_layers.append(FlatLayer(
            index=i, attn_norm=layer.input_layernorm.forward, q=attn.q_proj.forward, k=attn.k_proj.forward,
            v=attn.v_proj.forward, o=attn.o_proj.forward,
            q_norm=attn.q_norm.forward if qk_norm else None, k_norm=attn.k_norm.forward if qk_norm else None,
            mlp_norm=layer.post_attention_layernorm.forward, mlp=mlp.forward, head_dim=attn.head_dim))
    called += [*layers, *(layer.self_attn for layer in layers)]
    hooks = [d for m in called for d in (m._forward_hooks, m._forward_pre_hooks)]
    return FlatDecoder(embed=inner.embed_tokens.forward, rotary=inner.rotary_emb.forward, layers=flat_layers,
                       norm=inner.norm.forward, lm_head=model.lm_head.forward, modeling=modeling,
                       hooks=hooks, modules=tuple(id(m) for m in called))


def _wrong_classes(model: Any, modeling: Any, family: str, qk_norm: bool) -> str:
    """The modules of ``model`` that are not exactly the family's own classes (empty when all are)."""

    def cls(name: str) -> Any:
        return getattr(modeling, f"{family}{name}", None)

    inner = getattr(model, "model", None)
    expected: list[tuple[str, Any, Any]] = [("model", model, cls("ForCausalLM")), ("model.model", inner, cls("Model"))]
    if inner is not None:
        expected += [("model.embed_tokens", getattr(inner, "embed_tokens", None), torch.nn.Embedding),
                     ("lm_head", getattr(model, "lm_head", None), torch.nn.Linear),
                     ("model.norm", getattr(inner, "norm", None), cls("RMSNorm")),
                     ("model.rotary_emb", getattr(inner, "rotary_emb", None), cls("RotaryEmbedding"))]
        for i, layer in enumerate(getattr(inner, "layers", [])):
            where = f"model.layers.{i}"
            attn = getattr(layer, "self_attn", None)
            expected += [(where, layer, cls("DecoderLayer")), (f"{where}.self_attn", attn, cls("Attention")),
                         (f"{where}.mlp", getattr(layer, "mlp", None), cls("MLP"))]
            expected += [(f"{where}.{n}", getattr(layer, n, None), cls("RMSNorm"))
                         for n in ("input_layernorm", "post_attention_layernorm")]
            expected += [(f"{where}.self_attn.{n}", getattr(attn, n, None), torch.nn.Linear)
                         for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            expected += [(f"{where}.self_attn.{n}", getattr(attn, n, None), cls("RMSNorm"))
                         for n in (("q_norm", "k_norm") if qk_norm else ())]
    wrong = [f"{where} is {type(m).__name__}" for where, m, want in expected if want is None or type(m) is not want]
    return ", ".join(wrong[:3]) + (f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else "")
