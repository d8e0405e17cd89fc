"""What ``patch()`` (and so ``LLM``) checks before the first forward: exact, or refused with a reason.

flashpage relies on a few things a model does: each attention layer stores its K/V through
``cache.update`` once per forward under its own ``layer_idx``; it then calls transformers'
``AttentionInterface`` on exactly the K/V ``update`` returned, with arguments flashpage honours; the
window its mask or dense cache applies is the one the call says; and it calls no cache method
flashpage's cache lacks. Reading source files cannot tell (a module may mention the interface and
not use it), so :func:`probe` runs one small forward (a left-padded prefill of two rows, then one
decode step) through flashpage's cache with recording attention and mask functions, and each
``check_*`` function turns one broken assumption into a reason. Reasons are sentences that finish
"flashpage cannot be exact on <type> because ...". One check per reason, so work that makes a case
exact relaxes exactly that check.

A model whose attention receives K/V other than the ones ``update`` returned (multi-head latent
attention expanding cached latents, DiffLlama splitting V, JetMoE repeating K/V per expert) is not
refused: it is switched to the dense-view path (the cache returns the whole padded K/V, the model
transforms it, attention runs on what the model hands it), which is exact, in ``LLM`` too (each
scheduled sequence's whole K/V, varlen attention: ``attention._step_dense``). The probe runs once
per model object; its result is kept on the model.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from flashpage.patches import attention
from flashpage.patches.compat import cache_kwarg
from flashpage.patches.geometry import shared_kv_layers
from flashpage.patches.hf_cache import HFPagedCache, module_states

# attention-call keyword arguments flashpage honours, or that do not change the result
HONOURED_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "softcap", "is_causal", "s_aux",
                             "indices"})  # indices: a sparse-attention indexer's top-k keys (dense path)
HARMLESS_KWARGS = frozenset({
    "position_ids", "output_attentions", "use_cache", "cache_position", "past_key_values", "cache",
    "token_type_ids", "layer_idx", "return_dict", "output_hidden_states", "head_mask", "training",
    # varlen metadata only flash-attention implementations read (None outside packed training)
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens_q", "cu_seqlens_k",
    "max_seqlen_q", "max_seqlen_k", "target_dtype", "query_length",
    "logits_to_keep",  # which rows the LM head keeps (GOT-OCR2 hands its forward kwargs down to the layers)
})
# cache methods a model may call that flashpage's cache does not have, and what they mean
CACHE_METHOD_MEANING = {
    "update_indexer": "a sparse-attention indexer (DeepSeek-V3.2 DSA kind) whose keys flashpage's cache does not keep",
    "indexer_position_ids": "a sparse-attention indexer whose positions flashpage's cache does not keep",
    "store_compression_weights": "compressed sparse attention whose compressed keys flashpage's cache does not keep",
}


@dataclass
class AttentionCall:
    """One call of the attention function during the probe.

    Attributes:
        forward: 0 (prefill) or 1 (decode).
        layer: the module's ``layer_idx`` (None when it has none).
        module: the module's class name.
        own_kv: key/value are the tensors ``cache.update`` returned for ``layer`` in this forward
            (None: no update for ``layer`` in this forward).
        kwargs: keyword arguments of the call that are set (not None / False), by name.
        mask_window: (creator, size) when the mask came from transformers' sliding-window or chunked
            mask creator (``local_size``), else None.
        causal_used: whether flashpage's paged attention would attend causally for this call.
        mask_causal: whether the mask the model built is causal (True) or bidirectional (False) over
            the unpadded row of the prefill; None when there is no such mask.
        mask_edited: the mask the module hands the attention function is none of the masks transformers'
            mask functions built in this forward (the model edited it: e.g. Qwen4-Exp's sparse indexer
            removes the keys it did not select), so only attention under that very mask is exact.
    """

    forward: int
    layer: int | None
    module: str
    own_kv: bool | None
    kwargs: dict[str, Any]
    mask_window: tuple[str, int] | None = None
    causal_used: bool = True
    mask_causal: bool | None = None
    mask_edited: bool = False


@dataclass
class ProbeReport:
    """What the probe forward did.

    Attributes:
        updates: per forward, how often each layer index called ``cache.update``.
        calls: every attention call, in order.
        error: the exception the probe forward raised, if any.
        kv_shapes: per layer index, (KV heads, key head dim, value head dim) of what it stored.
        layer_out_of_range: a layer index the model stored K/V under that its config does not have.
        state_layers / state_layers_used: the cache's recurrent-state layers, and those the model
            wrote a state into (a model that keeps its recurrent state itself uses none).
        causal_by_mask: attention modules that say ``is_causal=False`` but are handed a causal mask
            (``patch`` makes them causal while patched).
        transformers_layers: per layer, what transformers' own cache for this config holds
            (``"full"``, ``"sliding:W"``, ``"chunked:W"``, ``"linear"``, ``"dummy"`` or a class name).
        indexer_layers: layers whose sparse-attention indexer stored keys through ``cache.update_indexer``.
    """

    updates: list[Counter] = field(default_factory=list)
    calls: list[AttentionCall] = field(default_factory=list)
    kv_shapes: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    cross_attention_modules: list[str] = field(default_factory=list)
    layer_out_of_range: int | None = None
    state_layers: list[int] = field(default_factory=list)
    state_layers_used: list[int] = field(default_factory=list)
    causal_by_mask: list[torch.nn.Module] = field(default_factory=list)
    error: BaseException | None = None
    transformers_layers: list[str] = field(default_factory=list)
    indexer_layers: list[int] = field(default_factory=list)


# ------------------------------------------------------------------------------- recording
class _Recorder:
    """Collects one probe's updates, masks and attention calls (only for the probed model's modules)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.report = ProbeReport()
        self.returned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.masks: dict[int, tuple[str, int]] = {}
        self.made: list[torch.Tensor] = []  # every mask the mask function built in this forward
        self.kept: list[Any] = []

    def start_forward(self) -> None:
        self.report.updates.append(Counter())
        self.returned = {}
        self.made = []

    def edited(self, mask: Any) -> bool:
        """Whether ``mask`` is none of the masks the mask function built in this forward (nor a view of one):
        a new tensor is the model's edit, whether or not the probe's short prompt makes it change a value
        (a sparse indexer that keeps every key of a short context still selects on a long one)."""
        if not isinstance(mask, torch.Tensor):
            return False
        return not any(mask is m or _shares_storage(mask, m) for m in self.made)

    def updated(self, layer: int, stored: tuple[torch.Tensor, torch.Tensor], key: torch.Tensor,
                value: torch.Tensor) -> None:
        self.report.updates[-1][layer] += 1
        self.report.kv_shapes[layer] = (stored[0].shape[1], stored[0].shape[-1], stored[1].shape[-1])
        self.returned[layer] = (key, value)

    def attended(self, module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, mask: Any,
                 kwargs: dict[str, Any]) -> bool | None:
        layer = getattr(module, "layer_idx", None)
        cache = self.state.active_cache
        if (layer is None or layer < 0) and cache is not None:  # a module shared by several layers
            layer = cache.last_written  # (Zamba2's attention block): the layer whose K/V update() just wrote
        given = self.returned.get(layer) if isinstance(layer, int) else None
        own = None if given is None else _same(given[0], key) and _same(given[1], value)
        set_kwargs = {k: v for k, v in kwargs.items() if v is not None and v is not False}
        causal = attention._kernel_options(module, None, None, None, kwargs.get("is_causal"), None)["causal"]
        self.report.calls.append(AttentionCall(len(self.report.updates) - 1, layer, type(module).__name__, own,
                                               set_kwargs, self.masks.get(id(mask)), causal, _mask_causal(mask),
                                               self.edited(mask)))
        if self.report.calls[-1].mask_causal and not causal and module not in self.report.causal_by_mask:
            self.report.causal_by_mask.append(module)
        return own


def _mask_causal(mask: Any) -> bool | None:
    """Whether a (B, 1, Lq, Lk) bool mask is causal (True) or full (False) on its last row (the probe's
    unpadded one) when queries and keys are the same tokens; None otherwise."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.dtype != torch.bool:
        return None
    square = mask[-1, 0]
    if square.shape[0] < 2 or square.shape[0] != square.shape[1]:
        return None
    lower = torch.ones_like(square).tril()
    if torch.equal(square, lower):
        return True
    return False if bool(square.all()) else None


def _state_written(layer: Any) -> bool:
    """Whether a cache state layer received a conv or recurrent state."""
    flags = [getattr(layer, name, {}) for name in ("is_conv_states_initialized", "is_recurrent_states_initialized")]
    return any(any(f.values()) if isinstance(f, dict) else bool(f) for f in flags)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b`` or a view of it (a slice of the mask's key columns, a broadcast over heads)."""
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b)))


_ACTIVE: _Recorder | None = None


def _recording_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
    rec = _ACTIVE
    if rec is not None and getattr(module, "_flashpage_state", None) is rec.state:
        own = rec.attended(module, key, value, attention_mask, kwargs)
        cache = rec.state.active_cache
        if own is False and cache is not None and not cache.dense_view:
            # the pages hold something else than what the model attends: finish the probe on what it hands
            # over (the dense view will be used), so the checks after this one still run
            options = attention._kernel_options(module, kwargs.get("scaling"), kwargs.get("sliding_window"),
                                                kwargs.get("softcap"), kwargs.get("is_causal"), kwargs.get("s_aux"))
            return attention._dense(query, key, value, attention_mask, options)
    return attention.pagedkv_attention(module, query, key, value, attention_mask, *args, **kwargs)


def _recording_mask(*args: Any, **kwargs: Any) -> Any:
    mask = attention.paged_mask(*args, **kwargs)
    rec = _ACTIVE
    if rec is not None and isinstance(mask, torch.Tensor):
        rec.made.append(mask)
    local = kwargs.get("local_size")
    if rec is not None and mask is not None and local:
        creator = sys._getframe(1).f_code.co_name
        rec.masks[id(mask)] = ("chunked" if "chunk" in creator else "sliding", int(local))
        rec.kept.append(mask)  # alive until the probe ends: a freed mask's id could be reused by another tensor
    return mask


class _ProbeCache(HFPagedCache):
    """An HFPagedCache that tells the recorder what each ``update`` returned."""

    recorder: _Recorder | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if self.recorder is not None and not 0 <= layer_idx < self.num_layers:
            self.recorder.report.layer_out_of_range = layer_idx
        key, value = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.recorder is not None:
            self.recorder.updated(layer_idx, (key_states, value_states), key, value)
        return key, value

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        if self.recorder is not None and layer_idx not in self.recorder.report.indexer_layers:
            self.recorder.report.indexer_layers.append(layer_idx)
        return super().update_indexer(indexer_key_states, layer_idx)


@contextmanager
def _recording(rec: _Recorder):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    global _ACTIVE
    _ACTIVE = rec
    AttentionInterface.register(attention.ATTN_NAME, _recording_attention)
    AttentionMaskInterface.register(attention.ATTN_NAME, _recording_mask)
    try:
        yield
    finally:
        _ACTIVE = None
        attention.register()


@contextmanager
def _eval_no_grad(model: torch.nn.Module):
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes.items():
            m.training = training


# per-batch state models keep on their modules between forwards of one generate() (Qwen-VL / GLM-4V M-RoPE
# position deltas, GLM-Image's decode positions): left from the user's last batch, it would shape the probe's
_BATCH_STATE = ("rope_deltas", "_cached_decode_position_ids")  # positions (and fail on its batch size)


@contextmanager
def _batch_state_cleared(model: torch.nn.Module):
    """Run the probe as a fresh model would: each module's per-batch state (:data:`_BATCH_STATE`) set to None
    for the probe, then given back as it was (the next generate() resets it anyway; a caller continuing its
    own batch by hand keeps it)."""
    saved = [(m, name, vars(m)[name]) for m in model.modules() for name in _BATCH_STATE
             if vars(m).get(name) is not None]
    for m, name, _ in saved:
        setattr(m, name, None)
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


# ----------------------------------------------------------------------------------- probe
def _probe_tokens(config: Any, count: int) -> list[int]:
    """Ordinary token ids (no special or multimodal placeholder ids) of this vocabulary."""
    special = set()
    for name in dir(config):
        if name.endswith(("token_id", "token_index", "token_ids")):
            value = getattr(config, name, None)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int):
                    special.add(v)
    vocab = int(getattr(config, "vocab_size", 0) or 0) or 100
    ids = [t for t in range(3, vocab) if t not in special][:count]
    return (ids * count)[:count] if ids else [0] * count


def transformers_layers(config: Any) -> list[str]:
    """Per layer, the kind of cache transformers itself would give this config (see ProbeReport)."""
    try:
        from transformers.cache_utils import DynamicCache

        layers = DynamicCache(config=config).layers
    except Exception:  # configs transformers builds no per-layer cache for: nothing to compare
        return []
    kinds = []
    for layer in layers:
        name = type(layer).__name__
        window = getattr(layer, "sliding_window", None)
        if "Chunked" in name and window:
            kinds.append(f"chunked:{window}")
        elif window:
            kinds.append(f"sliding:{window}")
        elif getattr(layer, "is_linear", False) or "Linear" in name or "Conv" in name:
            kinds.append("linear")
        elif name == "DynamicLayer":
            kinds.append("full")
        elif "Dummy" in name:
            kinds.append("dummy")
        else:
            kinds.append(name)
    return kinds


def probe(model: torch.nn.Module, state: Any) -> ProbeReport:
    """One left-padded prefill of two rows and one decode step through a fresh HFPagedCache, recording
    what every layer did (nothing for a model with its own cache class, which generate() never gives
    a paged cache). The model must be patched (``state`` is its PatchState)."""
    rec = _Recorder(state)
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():  # its own cache class: generate() never hands it a paged one,
        return rec.report  # and LLM refuses it (engine/positions.py): nothing of flashpage's to check
    config = model.config.get_text_config(decoder=True)
    rec.report.transformers_layers = transformers_layers(model.config)
    rec.report.cross_attention_modules = sorted({type(m).__name__ for m in model.modules()
                                                 if "CrossAttention" in type(m).__name__})
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    tokens = _probe_tokens(config, 9)
    pad = getattr(config, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < int(getattr(config, "vocab_size", 1) or 1) else tokens[0]
    ids = torch.tensor([[pad] + tokens[:3], tokens[3:7]], device=device)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], device=device)
    cache = _ProbeCache(model.config, block_size=4, num_blocks=8)
    cache.recorder = rec
    kwargs = {cache_kwarg(model): cache, "use_cache": True}
    try:
        with _eval_no_grad(model), _recording(rec), _batch_state_cleared(model):
            rec.start_forward()
            model(input_ids=ids, attention_mask=mask, **kwargs)
            rec.start_forward()
            model(input_ids=torch.tensor([[tokens[7]], [tokens[8]]], device=device),
                  attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1), **kwargs)
    except Exception as exc:  # what would have happened inside the user's first generate()
        rec.report.error = exc
    finally:
        rec.report.state_layers = list(getattr(cache, "state_layers", []))
        rec.report.state_layers_used = [i for i in rec.report.state_layers if _state_written(cache.layers[i])]
        cache.reset()
    return rec.report


# ---------------------------------------------------------------------------------- checks
Check = Callable[[ProbeReport, Any, Any], str | None]


def check_layer_indices(report: ProbeReport, config: Any, family: Any) -> str | None:
    """Every layer stores its K/V under an index the config has (looped layers, e.g. Dory's, run the same
    layers again under new indices)."""
    if report.layer_out_of_range is not None:
        return (f"it stores K/V under layer index {report.layer_out_of_range}, beyond the "
                f"{getattr(config, 'num_hidden_layers', '?')} layers of its config (looped / recurrent-depth layers)")
    return None


def check_probe_forward(report: ProbeReport, config: Any, family: Any) -> str | None:
    """The forward must run under flashpage's cache (a missing cache method, unsupported layer state...)."""
    exc = report.error
    if exc is None:
        return None
    text = f"{type(exc).__name__}: {exc}"
    for method, meaning in CACHE_METHOD_MEANING.items():
        if method in text:
            return f"it has {meaning} (the model calls cache.{method}(), which HFPagedCache does not have)"
    if "linear" in report.transformers_layers:
        return ("it has linear-attention / SSM / convolution layers whose state flashpage's cache does not hold "
                f"(a test forward failed: {_short(text)})")
    return f"a test forward through flashpage's cache failed ({_short(text)})"


def check_layers_run_once(report: ProbeReport, config: Any, family: Any) -> str | None:
    """Every layer stores its K/V once per forward (looped / recurrent-depth layers do not)."""
    for updates in report.updates:
        again = sorted(layer for layer, n in updates.items() if n > 1)
        if again:
            return (f"layers {again} run more than once per forward (looped layers), and flashpage keeps one "
                    "K/V per layer index")
    return None


def check_attention_has_own_kv(report: ProbeReport, config: Any, family: Any) -> str | None:
    """Every attention call attends the K/V its own layer stored in this forward (not cross-attention, not
    another layer's K/V, not a layer without an index)."""
    for call in report.calls:
        if call.layer is None:
            return (f"its attention module {call.module} has no layer_idx, so flashpage cannot tell which pages "
                    "it reads")
        if call.own_kv is None and call.layer not in shared_kv_layers(config):  # readers attend the owner's pages
            return (f"layer {call.layer}'s attention ({call.module}) reads K/V that it did not store through the "
                    "cache in this forward (cross-attention, or K/V shared from another layer)")
    return None


def check_attention_through_interface(report: ProbeReport, config: Any, family: Any) -> str | None:
    """Every layer that stores K/V calls transformers' AttentionInterface (else it computes attention
    itself on K/V flashpage's paged attention never sees)."""
    if not family.set_attention:  # adapters for models that keep their own attention (Falcon, Bloom)
        return None
    for forward, updates in enumerate(report.updates):
        attended = {c.layer for c in report.calls if c.forward == forward}
        missing = sorted(layer for layer in updates if layer not in attended)
        if missing:
            return (f"layers {missing} store K/V but compute attention themselves instead of through "
                    "transformers' AttentionInterface")
    return None


def check_attention_arguments(report: ProbeReport, config: Any, family: Any) -> str | None:
    """Every argument the attention call carries is one flashpage honours or one that changes nothing."""
    for call in report.calls:
        unknown = sorted(k for k in call.kwargs if k not in HONOURED_KWARGS and k not in HARMLESS_KWARGS)
        if unknown:
            return (f"layer {call.layer}'s attention ({call.module}) passes {unknown} to the attention function, "
                    "which flashpage does not honour")
    return None


def check_windows(report: ProbeReport, config: Any, family: Any) -> str | None:
    """The window each layer's mask or transformers' own cache applies is the ``sliding_window`` its
    attention call passes (flashpage applies only that one); chunked attention is applied as the probe saw it
    (:func:`chunked_layers`)."""
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    for call in report.calls:
        expected = _expected_window(report, call)
        if expected is None:
            continue
        kind, size = expected
        if limit and size >= limit:
            continue  # never reached
        if kind == "chunked":
            continue  # applied by flashpage's attention from what the probe saw (chunked_layers)
        if call.kwargs.get("sliding_window") != size:
            return (f"layer {call.layer} has a sliding window of {size} tokens that its attention call does not "
                    f"pass (sliding_window={call.kwargs.get('sliding_window')}), so flashpage would attend "
                    "beyond it")
    return None


def chunked_layers(report: ProbeReport) -> dict[int, int]:
    """``{layer: chunk size}`` of the layers with chunked attention (Llama 4's local layers), from the mask
    transformers built for them or its own cache's layer type."""
    chunks = {}
    for call in report.calls:
        expected = _expected_window(report, call)
        if expected is not None and expected[0] == "chunked" and call.layer is not None:
            chunks[call.layer] = expected[1]
    return chunks


def _expected_window(report: ProbeReport, call: AttentionCall) -> tuple[str, int] | None:
    if call.mask_window is not None:
        return call.mask_window
    kinds = report.transformers_layers
    if call.layer is not None and 0 <= call.layer < len(kinds) and ":" in kinds[call.layer]:
        kind, size = kinds[call.layer].split(":")
        return kind, int(size)
    return None


def check_cross_attention(report: ProbeReport, config: Any, family: Any) -> str | None:
    """No layer attends K/V computed from another input (images, an encoder): those are not paged."""
    layers = getattr(config, "cross_attention_layers", None)
    if layers or getattr(config, "add_cross_attention", False):
        which = layers or "add_cross_attention=True"
        return f"it has cross-attention layers ({which}), whose K/V flashpage does not page"
    if report.cross_attention_modules:
        return (f"it has cross-attention modules ({', '.join(report.cross_attention_modules)}), whose K/V "
                "flashpage does not page")
    return None


def check_causality(report: ProbeReport, config: Any, family: Any) -> str | None:
    """The paged attention is causal exactly where the model's mask is (a module that says ``is_causal=False``
    but is handed a causal mask is made causal by ``patch``; a bidirectional mask is refused)."""
    for call in report.calls:
        if call.mask_causal is False and call.causal_used:
            return (f"layer {call.layer}'s attention ({call.module}) is bidirectional (its mask lets tokens see later "
                    "ones), and flashpage's paged attention is causal")
    return None


CHECKS: list[Check] = [check_cross_attention, check_layer_indices, check_probe_forward, check_causality,
                       check_layers_run_once, check_attention_has_own_kv, check_attention_through_interface,
                       check_attention_arguments, check_windows]


def refusal_reason(report: ProbeReport, config: Any, family: Any) -> str | None:
    """The first reason flashpage cannot be exact on this model, or None."""
    for check in CHECKS:
        reason = check(report, config, family)
        if reason:
            return reason
    return None


def kv_transformed(report: ProbeReport) -> list[int]:
    """Layers whose attention receives K/V other than what ``cache.update`` returned (they need the
    dense view: MLA latents expanded after the cache, DiffLlama, JetMoE)."""
    return sorted({c.layer for c in report.calls if c.own_kv is False and c.layer is not None})


def mask_edited(report: ProbeReport) -> list[int]:
    """Layers whose attention receives a mask the model edited after transformers built it (they need the
    model's own mask: the dense view, in generate()'s layout; LLM runs them one sequence per forward)."""
    return sorted({c.layer for c in report.calls if c.mask_edited and c.layer is not None})


def _short(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# ----------------------------------------------------------------------------- engine checks
# What flashpage.LLM needs beyond patch(): K/V to page, and recurrent state kept where the engine can
# keep it per sequence (the cache's state layers). One function per reason (work that makes a case
# exact in the engine removes or relaxes exactly that function; positions, logits_to_keep and
# generation_config processors are the engine's own, see engine/positions.py, generation_config.py).
EngineCheck = Callable[[torch.nn.Module, ProbeReport], str | None]


def check_recurrent_state_in_cache(model: torch.nn.Module, report: ProbeReport) -> str | None:
    """Recurrent state the engine can keep per sequence is state the model keeps in the cache's state
    layers; a model that keeps it in its own modules would mix the sequences of a batch."""
    unused = [i for i in report.state_layers if i not in report.state_layers_used]
    if unused and not module_states(model):  # state in known module attributes is swapped per forward
        return (f"its recurrent layers {unused} keep their state in the model's own modules, not in the cache, so "
                "the engine cannot keep it per sequence")
    return None


def generate_layout_reason(report: ProbeReport | None) -> str | None:
    """Why only generate()'s ``[1, L]`` layout of one sequence is exact on this model, or None. Not a refusal:
    ``LLM`` runs such a model one sequence per forward, a prompt whole (``engine/solo.py``).

    - A sparse-attention indexer (DeepSeek-V3.2 DSA) picks its keys with ``topk`` over one row of scores per
      query; which of several tied scores (ReLU zeros are common) it keeps depends on the row's length and
      layout. In a packed engine step a request's keys sit among other requests' (masked) ones: the same
      scores, another tie-break (measured: deepseek_v32 and glm_moe_dsa exact one request per step, a
      different token at step 4 when two share a step).
    - A model that edits the attention mask itself (a sparse indexer's selection expressed only in the mask,
      Qwen4-Exp's; Doge's dynamic bias) needs transformers' mask, which the packed steps never build."""
    if report is None:
        return None
    if report.indexer_layers:
        return (f"its sparse-attention indexer (layers {sorted(report.indexer_layers)}) picks keys by top-k, whose "
                "choice among tied scores depends on the row's layout")
    edited = mask_edited(report)
    if edited:
        return f"layers {edited} edit the attention mask themselves (e.g. a sparse indexer's token selection)"
    return None


def unmasked_bidirectional_prefill(report: ProbeReport | None) -> bool:
    """Whether attention modules say ``is_causal=False`` but are handed causal masks (PaliGemma's text model,
    ``use_bidirectional_attention``) under sdpa: transformers skips the mask for an unpadded prompt and sdpa then
    attends to the whole prompt both ways (patched generate() does the same). ``flashpage.LLM`` then computes
    every prompt whose mask is skipped as one span attending both ways, in one step (engine/multimodal.py
    ``PromptSpans``): a causal chunked prefill drifted by ~1e-4 in logprobs, silently."""
    return report is not None and any(
        getattr(getattr(module, "_flashpage_state", None), "previous_attn", None) == "sdpa"
        for module in report.causal_by_mask)


ENGINE_CHECKS: list[EngineCheck] = [check_recurrent_state_in_cache]


def engine_refusal_reason(model: torch.nn.Module, report: ProbeReport | None) -> str | None:
    """The first reason ``flashpage.LLM`` cannot run this (patched, accepted) model exactly, or None."""
    if report is None:
        return None
    for check in ENGINE_CHECKS:
        reason = check(model, report)
        if reason:
            return reason
    return None
