"""``patch(model)``, ``unpatch(model)`` and ``patched(model)``.

Patching a HuggingFace causal LM:
1. registers flashpage's attention and mask functions and selects them on the model (families
   that bypass the attention interface keep their own attention, see ``families.py``);
2. hooks the decoder's forward so an :class:`HFPagedCache` passed to it is planned once per
   forward (slots, block tables, lengths) from the input and its 2D padding mask;
3. makes ``generate()`` create an HFPagedCache sized for the call whenever the caller gives no
   cache (and ``use_cache`` is not False).
``unpatch`` restores the previous attention implementation and generate behaviour exactly.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F

from flashpage.errors import check_positive_ints
from flashpage.patches import checks
from flashpage.patches.attention import ATTN_NAME, register, set_paged_forward
from flashpage.patches.compat import NEWEST_TESTED, cache_kwarg, installed_version, require_supported_transformers
from flashpage.patches.deepseek import NOTE as MLA_NOTE
from flashpage.patches.deepseek import is_mla
from flashpage.patches.families import FamilySpec, family_for
from flashpage.patches.hf_cache import HFPagedCache, cache_api_mismatches
from flashpage.patches.legacy import ABSENT, Refused

_STATE_ATTR = "_flashpage_patch"
_CACHE_KWARGS = ("cache", "past_key_values")
# cache_implementation values that ask for no particular cache: before 5.24, assisted decoding sets
# "dynamic_full" on the assistant only to get a croppable cache with every token (what HFPagedCache is).
_NO_CACHE_CHOICE = (None, "dynamic_full")


@dataclass
class PatchState:
    """What ``patch`` changed on one model, so ``unpatch`` can undo exactly that."""

    family: FamilySpec
    cache_options: dict[str, Any]
    previous_attn: str | None
    root: torch.nn.Module | None = None  # the patched model (its config says which attention is selected)
    hooks: list[Any] = field(default_factory=list)
    active_cache: HFPagedCache | None = None
    planner: torch.nn.Module | None = None  # the hooked module whose forward is in flight
    user_prepare_override: Any = None  # an instance-level _prepare_cache_for_generation we replaced
    user_set_attn: Any = None  # an instance-level set_attn_implementation we replaced
    report: checks.ProbeReport | None = None  # what the probe forward saw (checks.py)
    restore: list[tuple[Any, str, Any]] = field(default_factory=list)  # (object, attribute, value) for unpatch
    chunks: dict[int, int] = field(default_factory=dict)  # {layer: chunk size} of chunked-attention layers
    saved_attn: list[tuple[Any, Any]] = field(default_factory=list)  # (config, its implementation before patch)
    causal: bool = True  # some attention module is causal (a mask letting tokens see later ones is wrong)


def _has_causal_attention(model: torch.nn.Module) -> bool:
    """Whether some attention module of ``model`` is causal (``is_causal`` not False; True where none says): the
    paged attention of a non-causal one (a BERT-like model without ``is_decoder``) attends to every key anyway."""
    flags = [vars(m)["is_causal"] for m in model.modules() if "is_causal" in vars(m)]
    return not flags or any(flag is not False for flag in flags)


class UnsupportedModelError(TypeError):
    """The model cannot be routed through flashpage."""


def patch(model: torch.nn.Module, **cache_options: Any) -> torch.nn.Module:
    """Route ``model``'s attention through flashpage and make ``generate()`` use paged KV.

    Args:
        model: a transformers causal LM (``AutoModelForCausalLM`` and friends).
        **cache_options: defaults for the HFPagedCache each ``generate()`` creates
            (``block_size``, ``num_blocks``, ``enable_prefix_caching``, ``growable``).

    Returns:
        The same model, patched in place. Patching again only updates ``cache_options``.
    """
    require_supported_transformers()
    _check_cache_options(cache_options)
    state: PatchState | None = getattr(model, _STATE_ATTR, None)
    if state is not None:
        state.cache_options.update(cache_options)
        return model
    mismatches = cache_api_mismatches()
    if mismatches:
        raise UnsupportedModelError(_refusal(model, (
            f"this transformers ({installed_version('transformers')}) calls cache methods with arguments flashpage's "
            f"cache does not take: {'; '.join(mismatches)} (flashpage was tested up to transformers "
            f"{NEWEST_TESTED}.x)")))
    family = _family_of(model)
    register()
    state = PatchState(family=family, cache_options=dict(cache_options),
                       previous_attn=getattr(model.config.get_text_config(decoder=True), "_attn_implementation", None),
                       root=model, causal=_has_causal_attention(model))
    _install(model, state)
    try:
        if family.install is not None:  # adapters (legacy.py) change the model's attention modules
            state.restore.extend(_adapter_changes(model, family))
        state.family = _checked_family(model, state)
        state.causal = _has_causal_attention(model)  # the probe may have made is_causal=False modules causal
    except BaseException:
        unpatch(model)
        raise
    return model


def _install(model: torch.nn.Module, state: PatchState) -> None:
    """Select flashpage's attention, hook the forwards and generate()'s cache choice."""
    family = state.family
    if family.set_attention:
        state.saved_attn = _attention_choices(model)
        model.set_attn_implementation(ATTN_NAME)
    for module in model.modules():
        module._flashpage_state = state
    for module in _hooked_modules(model):
        state.hooks.append(module.register_forward_pre_hook(_pre_hook(state), with_kwargs=True))
        state.hooks.append(module.register_forward_hook(_post_hook(state), with_kwargs=True, always_call=True))
    state.user_prepare_override = vars(model).get("_prepare_cache_for_generation")
    model._prepare_cache_for_generation = MethodType(_prepare_paged_cache, model)
    if family.set_attention:
        state.user_set_attn = vars(model).get("set_attn_implementation")
        model.set_attn_implementation = MethodType(_switch_attention, model)
    setattr(model, _STATE_ATTR, state)


def _adapter_changes(model: torch.nn.Module, family: FamilySpec) -> list[tuple[Any, str, Any]]:
    try:
        return family.install(model)
    except Refused as exc:
        raise UnsupportedModelError(_refusal(model, str(exc))) from None


_CHECKED_ATTR = "_flashpage_checked"  # the family the probe settled on, kept across unpatch (checks run once)


def _checked_family(model: torch.nn.Module, state: PatchState) -> FamilySpec:
    """Run the checks of ``checks.py`` once per model: the family to use, or UnsupportedModelError.

    A model whose attention receives K/V other than the ones the cache returned goes to the dense view."""
    cached = vars(model).get(_CHECKED_ATTR)
    if cached is not None:
        state.report = cached[1]
        state.chunks = checks.chunked_layers(cached[1])
        _make_causal(state, cached[1].causal_by_mask)
        return cached[0]
    family = state.family
    report = checks.probe(model, state)
    if report.causal_by_mask:  # is_causal=False modules handed a causal mask: the mask is what transformers applies
        fixed = report.causal_by_mask
        _make_causal(state, fixed)
        report = checks.probe(model, state)
        report.causal_by_mask = fixed
    interface = family.path == "interface" and report.error is None
    transformed = checks.kv_transformed(report) if interface else []
    edited = checks.mask_edited(report) if interface else []
    if transformed or edited:
        mla = any(is_mla(m) for m in model.modules() if getattr(m, "layer_idx", None) in transformed)
        note = MLA_NOTE if mla else (f"K/V transformed after cache.update (layers {transformed}): attention on "
                                     "what the model hands it, read back densely from the pages")
        if not transformed:
            note = (f"attention mask edited by the model (layers {edited}): attention under that mask, on K/V "
                    "read back densely from the pages")
        family = FamilySpec(family.model_type, "dense-view", family.set_attention, note)
        state.family = family
        report = checks.probe(model, state)
    reason = checks.refusal_reason(report, model.config.get_text_config(decoder=True), family)
    if reason is not None:
        raise UnsupportedModelError(_refusal(model, reason))
    state.report = report
    state.chunks = checks.chunked_layers(report)
    model.__dict__[_CHECKED_ATTR] = (family, report)
    return family


UNMASKED_FULL = "_flashpage_unmasked_full"  # on modules _make_causal changed: see there


def _make_causal(state: PatchState, modules: list[torch.nn.Module]) -> None:
    """Modules that say ``is_causal=False`` but are handed a causal mask (PaliGemma's text model with
    ``use_bidirectional_attention``): the mask is what transformers applies, so they are made causal. Where
    transformers skips the mask (no padding: ``attention_mask`` None) such a module attends to every key,
    bidirectionally: they are marked (:data:`UNMASKED_FULL`) so the attention does the same then."""
    for module in modules:
        if not any(obj is module and name == "is_causal" for obj, name, _ in state.restore):
            state.restore.append((module, "is_causal", module.is_causal))
            state.restore.append((module, UNMASKED_FULL, vars(module).get(UNMASKED_FULL, ABSENT)))
        module.is_causal = True
        setattr(module, UNMASKED_FULL, True)


def _refusal(model: torch.nn.Module, reason: str) -> str:
    config = model.config
    text_type = config.get_text_config(decoder=True).model_type
    inner = f" (text model {text_type!r})" if text_type != config.model_type else ""
    return (f"flashpage cannot patch {type(model).__name__} (model_type={config.model_type!r}{inner}) exactly: "
            f"{reason}. Use it unpatched.")


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: previous attention implementation, hooks and generate behaviour."""
    state: PatchState | None = getattr(model, _STATE_ATTR, None)
    if state is None:
        return model
    for handle in state.hooks:
        handle.remove()
    for obj, name, value in reversed(state.restore):
        if value is ABSENT:
            vars(obj).pop(name, None)
        else:
            setattr(obj, name, value)
    if "set_attn_implementation" in vars(model):
        del model.set_attn_implementation
    if state.user_set_attn is not None:
        model.set_attn_implementation = state.user_set_attn
    if state.family.set_attention and _attention_switched(model, state) is None:
        _restore_attention(state.saved_attn)
    for module in model.modules():
        if "_flashpage_state" in vars(module):
            del module._flashpage_state
    if state.user_prepare_override is not None:
        model._prepare_cache_for_generation = state.user_prepare_override
    else:
        del model._prepare_cache_for_generation
    delattr(model, _STATE_ATTR)
    return model


def _attention_choices(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """Every config of ``model`` whose attention implementation ``set_attn_implementation`` may change (the
    model's, its sub-configs' at any depth, its sub-models'), each with its current choice."""
    configs = [model.config] + [getattr(m, "config", None) for m in model.modules() if m is not model]
    seen: dict[int, tuple[Any, Any]] = {}
    while configs:
        config = configs.pop()
        if config is None or id(config) in seen or not hasattr(config, "_attn_implementation_internal"):
            continue
        seen[id(config)] = (config, config._attn_implementation_internal)
        configs.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {})
    return list(seen.values())


def _restore_attention(saved: list[tuple[Any, Any]]) -> None:
    """Give each config back the implementation it had before ``patch`` (where flashpage's is still selected).
    Set directly, as transformers' ``set_attn_implementation`` sets it after its checks: those passed when the
    model chose it, and one choice for the whole model would put the text model's (e.g. "sdpa") on sub-models
    that do not support it (VibeVoice-ASR's audio tokenizers): unpatch must not fail half-way."""
    for config, value in saved:
        if config._attn_implementation_internal == ATTN_NAME:
            config._attn_implementation_internal = value


@contextmanager
def patched(model: torch.nn.Module, **cache_options: Any) -> Iterator[torch.nn.Module]:
    """``with patched(model): model.generate(...)`` patches for the block, then restores."""
    state = patch_state(model)
    saved_options = dict(state.cache_options) if state is not None else None
    patch(model, **cache_options)
    try:
        yield model
    finally:
        if saved_options is None:
            unpatch(model)
        else:
            state.cache_options.clear()
            state.cache_options.update(saved_options)


def is_patched(model: torch.nn.Module) -> bool:
    return getattr(model, _STATE_ATTR, None) is not None


def patch_state(model: torch.nn.Module) -> PatchState | None:
    return getattr(model, _STATE_ATTR, None)


# --------------------------------------------------------------------- checks
_OPTION_NAMES = {"block_size", "num_blocks", "enable_prefix_caching", "growable", "max_cache_len"}


def _check_cache_options(options: dict[str, Any]) -> None:
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise TypeError(f"flashpage.patch got unknown cache option(s) {sorted(unknown)}; "
                        f"allowed: {sorted(_OPTION_NAMES)}")
    sizes = {name: options.get(name) for name in ("block_size", "num_blocks", "max_cache_len")}
    check_positive_ints("flashpage.patch: cache option ", {k: v for k, v in sizes.items() if v is not None},
                        "a positive int or None")


def _family_of(model: torch.nn.Module) -> FamilySpec:
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or not hasattr(model, "generate"):
        raise UnsupportedModelError(
            f"flashpage.patch needs a transformers causal LM with generate(); got {name}. "
            "Load it with AutoModelForCausalLM.from_pretrained(...)")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"flashpage.patch supports decoder-only causal LMs; {name} (model_type="
            f"{config.model_type!r}) is encoder-decoder. Use it unpatched.")
    text_config = config.get_text_config(decoder=True)
    family = family_for(text_config.model_type)
    if family.set_attention and not model._can_set_attn_implementation() and not _text_model_can_set(model):
        inner = f" (text model {text_config.model_type!r})" if text_config.model_type != config.model_type else ""
        raise UnsupportedModelError(
            f"flashpage cannot patch {name} (model_type={config.model_type!r}{inner}): its attention does not go "
            "through transformers' AttentionInterface and flashpage has no adapter for it. Use it unpatched, "
            "or add an adapter module in flashpage/patches (see patches/legacy.py).")
    return family


def _text_model_can_set(model: torch.nn.Module) -> bool:
    """Whether the text (decoder) model inside a composite one can select an attention implementation while
    another part cannot (GOT-OCR2's vision encoder): flashpage's attention is then selected for the text model
    only, and the probe checks that every layer holding K/V goes through it."""
    text = model.config.get_text_config(decoder=True)
    return text is not model.config and any(
        getattr(m, "config", None) is text and callable(getattr(m, "_can_set_attn_implementation", None))
        and m._can_set_attn_implementation() for m in model.modules())


def _hooked_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model itself, and its base model in case that is called directly (outer one plans)."""
    base = getattr(model, "base_model", model)
    return [model] if base is model or not isinstance(base, torch.nn.Module) else [model, base]


# ---------------------------------------------------------------------- hooks
def _bound_arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    if not args:
        return kwargs
    try:
        return dict(inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments)
    except TypeError:
        return kwargs


_SWITCHED = ("flashpage: the attention implementation of this patched model was switched to {name!r}; "
             "flashpage unpatched it (its paged cache, hooks and generate() default are removed), so it runs "
             "as plain transformers now. Call flashpage.patch(model) to route it through flashpage again.")


def _attention_switched(model: torch.nn.Module, state: PatchState) -> str | None:
    """The implementation someone selected instead of flashpage's, or None while flashpage's is selected."""
    if not state.family.set_attention:
        return None
    name = getattr(model.config.get_text_config(decoder=True), "_attn_implementation", None)
    return None if name == ATTN_NAME else str(name)


def attention_switched(model: torch.nn.Module) -> bool:
    """Whether a patched model's attention selection moved away from flashpage's since ``patch``."""
    state = patch_state(model)
    return state is not None and _attention_switched(model, state) is not None


def _switch_attention(self, attn_implementation: Any = None, *args: Any, **kwargs: Any) -> Any:
    """Stand-in for ``set_attn_implementation`` on a patched model: selecting another attention
    unpatches the model cleanly first (with a warning), then selects it."""
    if attn_implementation != ATTN_NAME:
        warnings.warn(_SWITCHED.format(name=attn_implementation), UserWarning, stacklevel=2)
        unpatch(self)
    return self.set_attn_implementation(attn_implementation, *args, **kwargs)


def _pre_hook(state: PatchState):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = _bound_arguments(module, args, kwargs)
        cache = next((inputs[k] for k in _CACHE_KWARGS if inputs.get(k) is not None), None)
        switched = _attention_switched(module, state) if module is state.root else None
        if switched is not None:
            if isinstance(cache, HFPagedCache):
                raise RuntimeError(
                    f"this model was patched by flashpage, then its attention was switched to {switched!r} "
                    "(config._attn_implementation), but it was given a flashpage HFPagedCache, which only "
                    "flashpage's attention can read. Call flashpage.unpatch(model) before switching attention "
                    "(or flashpage.patch(model) again to use the paged cache).")
            state.planner, state.active_cache = None, None
            return
        if state.planner is not None and state.active_cache is not None and module is not state.planner \
                and cache is state.active_cache:
            # the outer model already planned this forward and handed its cache down. (A state left by an
            # interrupted forward, whose post-hook torch skips on KeyboardInterrupt, never has this cache.)
            return
        set_paged_forward(None)
        state.planner = module
        if not isinstance(cache, HFPagedCache):
            state.active_cache = None
            return
        cache.dense_view = cache.dense_view or state.family.path == "dense-view"
        if cache.plan is None or cache.owns_plan:  # the engine plans its own steps; generate()'s are planned here
            if cache.enable_prefix_caching and (carries_media(inputs) or _unmasked_full(state)):
                # placeholder tokens do not say which image, and K/V of a prefill attending both ways depend on
                # the tokens after them: pages keyed by the tokens before them would be wrong to share
                cache.enable_prefix_caching = False
            input_ids = inputs.get("input_ids")
            shaped = input_ids if input_ids is not None else inputs.get("inputs_embeds")
            batch, length = shaped.shape[0], shaped.shape[1]
            cache.begin_forward(input_ids, batch, length, inputs.get("attention_mask"), shaped.device)
        state.active_cache = cache
        if state.family.path == "adapter":  # their models build ALiBi / masks from the 2D mask as given
            return None
        if state.family.path == "interface" and not cache.dense_view:  # attention on the pages: the mask unread
            if state.causal:
                set_paged_forward(type(module).__name__, cache)
        return _fixed_width_mask(cache, args, kwargs)

    return hook


def _unmasked_full(state: PatchState) -> bool:
    """Whether some attention module of the patched model attends bidirectionally when its mask is skipped (an
    sdpa model's module that says is_causal=False but is handed causal masks: see ``attention.py``)."""
    return state.previous_attn == "sdpa" and any(name == UNMASKED_FULL for _, name, _ in state.restore)


_TEXT_INPUTS = frozenset({"input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache_position",
                          "token_type_ids", "mm_token_type_ids", "labels", "logits_to_keep"})


def carries_media(inputs: dict[str, Any]) -> bool:
    """Whether a forward's arguments carry images, video or audio (a floating-point tensor, or a list of them,
    besides the text inputs: ``pixel_values``, ``input_features``, precomputed image embeddings ...). Their
    tokens are placeholders shared by every image: pages keyed by token ids would hand one request's image K/V
    to another with the same text, so such a cache hashes no prefixes. Encoder outputs generate() computed
    before the forward (transformers >= 5.25: ``mm_encoder_outputs``, a dict of model outputs) count too."""
    return any(_has_float_tensor(value) for name, value in inputs.items()
               if name not in _TEXT_INPUTS and name not in _CACHE_KWARGS)


def _has_float_tensor(value: Any, depth: int = 3) -> bool:
    """A floating-point tensor in ``value`` or, ``depth`` levels down, in its lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    if depth <= 0:
        return False
    if isinstance(value, dict):
        return any(_has_float_tensor(v, depth - 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_float_tensor(v, depth - 1) for v in value)
    return False


def _fixed_width_mask(cache: HFPagedCache, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """generate()'s 2D mask grows by a column per step; the paged attention does not read it (the plan
    has what it says), but a compiled forward would see a new shape every step. Widen it to the
    cache's fixed ``max_cache_len`` with padding columns: every decode step then has one shape. Not for
    hybrid models: their linear-attention layers read the mask's last columns as this forward's padding."""
    mask = kwargs.get("attention_mask")
    width = cache.max_cache_len
    if cache.dense_view or cache.has_states or not width or not isinstance(mask, torch.Tensor) or mask.dim() != 2 \
            or mask.shape[1] >= width:
        return None
    return args, {**kwargs, "attention_mask": F.pad(mask, (0, width - mask.shape[1]))}


def _post_hook(state: PatchState):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if module is not state.planner:
            return
        set_paged_forward(None)
        cache, state.active_cache, state.planner = state.active_cache, None, None
        if cache is not None:
            cache.end_forward(ok=output is not None)

    return hook


@contextmanager
def planned_forward(model: torch.nn.Module, cache: HFPagedCache) -> Iterator[None]:
    """What the outer hooks do around a forward, for a caller that runs ``model.forward`` itself
    (a compiled forward): the layers see ``cache`` (whose plan the caller set) as the active cache."""
    state: PatchState = getattr(model, _STATE_ATTR)
    state.planner, state.active_cache = model, cache
    ok = False
    try:
        yield
        ok = True
    finally:
        state.planner = state.active_cache = None
        cache.end_forward(ok=ok)


# ------------------------------------------------------------------- generate
def _prepare_paged_cache(self, generation_config, model_kwargs: dict, generation_mode, batch_size: int,
                         max_cache_length: int):
    """Stand-in for ``GenerationMixin._prepare_cache_for_generation``: an HFPagedCache by default."""
    state: PatchState = getattr(self, _STATE_ATTR)
    original = state.user_prepare_override or MethodType(type(self)._prepare_cache_for_generation, self)
    switched = _attention_switched(self, state)
    if switched is not None:  # config._attn_implementation was set by hand: unpatch, then behave as transformers
        warnings.warn(_SWITCHED.format(name=switched), UserWarning, stacklevel=3)
        unpatch(self)
        return original(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
    wants_other = (any(model_kwargs.get(k) is not None for k in _CACHE_KWARGS) or generation_config.use_cache is False
                   or generation_config.cache_implementation not in _NO_CACHE_CHOICE
                   or not self._supports_default_dynamic_cache())
    if wants_other:
        return original(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
    options = dict(state.cache_options)
    expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    options.setdefault("max_cache_len", max_cache_length)
    if "num_blocks" not in options:
        options["num_blocks"] = _blocks_for(batch_size, expand, max_cache_length, options.get("block_size"),
                                            self.device, model_kwargs.get("attention_mask"))
    model_kwargs[cache_kwarg(self)] = HFPagedCache(self.config, **options)  # the key generate() reads back
    return None


def _blocks_for(rows: int, expand: int, max_len: int, block_size: int | None, device: torch.device,
                attention_mask: torch.Tensor | None) -> int:
    """Blocks for a generate() call: each row's real tokens (prompt without its padding, plus the
    new tokens) rounded up to whole blocks, times the beams/samples per row, plus one block per
    expanded row for copy-on-write of shared partial blocks. The cache grows if a call needs more."""
    from flashpage.cache import default_block_size

    bs = block_size or default_block_size(device)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.shape[0] == rows:
        padding = attention_mask.shape[1] - attention_mask.sum(dim=1)
        lengths = (max_len - padding).clamp(min=1)
        blocks = int(((lengths + bs - 1) // bs).sum())
    else:
        blocks = rows * -(-max_len // bs)
    cow = rows * expand if expand > 1 else 0
    return max(1, blocks * expand + cow)
