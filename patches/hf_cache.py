"""HFPagedCache: a ``transformers.Cache`` whose K/V live in a PagedKVCache.

Each batch row of ``generate()`` is one sequence of the paged cache. Only real tokens are
stored: a forward hook (installed by ``flashpage.patch``) hands the cache each forward's 2D
padding mask before any layer runs, and the cache plans the step once (slots, block tables,
lengths). ``update()`` writes a layer's new K/V into its pages; the registered attention
function then reads the pages through the paged kernels. To transformers the cache reports the
logical, padded length it expects, so ``generate()`` slices inputs exactly as with DynamicCache.

Beam search reorders by forking sequences (shared blocks, copy-on-write of the partial last
block); assisted decoding crops by truncating sequences; a returned cache can be passed to a
second ``generate()`` call to continue without recomputing the conversation.

Hybrid models (Qwen3-Next / Qwen3.5, Jamba, Bamba, Falcon-H1, Granite-4, Nemotron-H, LFM2, Zamba,
Mamba, ...) keep transformers' own linear-attention / SSM layer objects (conv and recurrent
states, one row per batch row) for the layers whose ``config.layer_types`` entry says so; only the
attention layers are paged. A layer with both (``"hybrid"``: Falcon-H1, Zamba) pages its K/V and
keeps its states. Pure state-space models (Mamba, Mamba-2, Falcon-Mamba) hold no pages at all.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, CacheLayerMixin

from flashpage.cache import DeviceStep, InputLayout, KVGroup, PagedKVCache, StepPlan, default_block_size
from flashpage.errors import check_positive_ints
from flashpage.patches.compat import legacy_crop, require_supported_transformers
from flashpage.patches.geometry import shared_kv_layers

INDEXER_GROUP = "indexer"  # the extra page group holding sparse-attention indexer keys


@dataclass(frozen=True)
class MemoryStats:
    """KV memory of an HFPagedCache against a dense cache holding the same batch.

    Attributes:
        num_blocks / block_size / blocks_in_use: pool geometry and occupancy.
        tokens_stored: real tokens held, summed over sequences (shared blocks count once per
            sequence that reads them).
        token_slots_in_use: ``blocks_in_use * block_size``: what the pages actually hold.
        bytes_in_use: bytes of the blocks in use (all layers, K and V).
        bytes_allocated: bytes of the whole page pool.
        dense_bytes: bytes a DynamicCache would hold for the same batch (batch x padded length).
        groups: the page pools, one per K/V geometry (layers of different head counts or sizes,
            e.g. Gemma 4's sliding and global layers), all sharing the block tables.
    """

    num_blocks: int
    block_size: int
    blocks_in_use: int
    tokens_stored: int
    token_slots_in_use: int
    bytes_in_use: int
    bytes_allocated: int
    dense_bytes: int
    state_bytes: int = 0  # linear-attention / SSM states of hybrid models (included in the byte counts)
    groups: tuple[KVGroup, ...] = ()

    @property
    def saving(self) -> float:
        """dense_bytes / bytes_in_use (how many times less memory the pages use)."""
        return self.dense_bytes / self.bytes_in_use if self.bytes_in_use else float("inf")


class _PagedLayer(CacheLayerMixin):
    """Per-layer view transformers iterates over; all state lives in the parent cache (except
    ``indexer_position_ids``, (P, B, L) positions a sparse indexer records on its layer, which the parent
    keeps in step with its rows: reordered, cropped and reset with them).

    The layer holds its parent weakly: the cache holds its layers, and a strong reference back would make
    a cycle, keeping a dropped cache (and with an engine's cache, its KV pool) alive until Python's cyclic
    collector next ran."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, parent: HFPagedCache, layer_idx: int) -> None:
        super().__init__()
        self._parent_ref = weakref.ref(parent)
        self._layer_idx = layer_idx
        self.is_initialized = True
        self.indexer_position_ids: torch.Tensor | None = None

    @property
    def _parent(self) -> HFPagedCache:
        parent = self._parent_ref()
        if parent is None:
            raise ReferenceError("flashpage: this cache layer's HFPagedCache was dropped; use the cache's own layers")
        return parent

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        return self._parent.update_indexer(indexer_key_states, self._layer_idx)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._parent.update(key_states, value_states, self._layer_idx)

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        return self._parent.get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self._parent.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the name of get_max_length before transformers 5.14 (abstract there)
        return -1

    def reset(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        return None

    def crop(self, tokens_to_remove: int) -> None:
        return None

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None


# transformers' linear-attention layer (conv / recurrent states), from 5.5 on; None before.
_LinearLayer = getattr(cache_utils, "LinearAttentionLayer", None)
_LinearMixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
# transformers' layer class of each cache layer type, from 5.14; empty before (cache_layer_types then says
# "full_attention" for every layer: every layer is a paged one)
_LAYER_CLASSES: Mapping[str, type] = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", {})


if _LinearLayer is not None:
    class _PagedHybridLayer(_LinearLayer, _PagedLayer):  # type: ignore[misc, valid-type]
        """A layer with both K/V (paged) and linear-attention states (kept as transformers keeps them)."""

        is_compileable = False

        def __init__(self, parent: HFPagedCache, layer_idx: int, number_of_states: int = 1, **kwargs) -> None:
            _PagedLayer.__init__(self, parent, layer_idx)
            _LinearLayer.__init__(self, number_of_states=number_of_states)

        def lazy_initialization(self, *args, **kwargs) -> None:
            if args:  # the K/V side: pages are allocated by the pool
                return None
            _LinearLayer.lazy_initialization(self, **kwargs)


def cache_layer_types(config, num_layers: int) -> tuple[list[str], list[dict]]:
    """transformers' cache layer type of each decoder layer and its constructor kwargs.

    ``("full_attention", ...)`` for every layer where transformers has no per-layer cache types
    (before 5.20) or the config does not say; ``"linear_attention"`` / ``"conv"`` / ``"hybrid"`` where
    the model keeps linear-attention / SSM states (``DynamicCache(config)`` builds the same list)."""
    plain = (["full_attention"] * num_layers, [{} for _ in range(num_layers)])
    get_types = getattr(cache_utils, "get_layer_types_and_kwargs", None)
    if config is None or get_types is None or _LinearMixin is None:
        return plain
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        types, kwargs = get_types(text_config)
    except (AttributeError, TypeError, ValueError):
        return plain
    types = list(types)
    # one kwargs dict per layer (5.20+), or one dict shared by every layer (5.17-5.19)
    kwargs = [dict(kwargs) for _ in types] if isinstance(kwargs, Mapping) else list(kwargs)
    if len(types) != num_layers or len(kwargs) != num_layers:
        return plain
    return types, kwargs


def _make_layer(parent: HFPagedCache, layer_idx: int, layer_type: str, kwargs: dict) -> CacheLayerMixin:
    """transformers' own layer object for state-only layers, a paged (or paged+state) layer otherwise."""
    if _LinearMixin is None:
        return _PagedLayer(parent, layer_idx)
    layer_class = _LAYER_CLASSES.get(layer_type)
    if layer_class is None or not issubclass(layer_class, _LinearMixin):
        return _PagedLayer(parent, layer_idx)
    states = {"number_of_states": kwargs.get("number_of_states", 1)}
    if issubclass(layer_class, CacheLayerMixin):  # states and K/V in one layer
        return _PagedHybridLayer(parent, layer_idx, **states)
    return layer_class(**states)


@lru_cache(maxsize=1)
def cache_api_mismatches() -> tuple[str, ...]:
    """Methods of the installed transformers' ``Cache`` / ``CacheLayerMixin`` that flashpage's cache overrides
    but cannot be called as transformers may call them: an optional or keyword-only parameter it does not take,
    arbitrary keywords (``**kwargs``) it does not accept, or fewer positional parameters. Empty on every release
    flashpage was tested with; ``patch()`` refuses with these names otherwise (a newer transformers' generate()
    would pass the cache arguments it does not know, e.g. 5.25's ``activate_past_recording(
    recurrent_states_to_keep=...)``)."""
    out = []
    for ours, theirs in ((HFPagedCache, Cache), (_PagedLayer, CacheLayerMixin)):
        for name, base in vars(theirs).items():
            mine = getattr(ours, name, None)
            if name.startswith("_") or not inspect.isfunction(base) or mine is None or mine is base:
                continue
            missing = _untaken_parameters(base, mine)
            if missing:
                out.append(f"{theirs.__name__}.{name}({', '.join(missing)})")
    return tuple(out)


def _untaken_parameters(base: Callable, mine: Callable) -> list[str]:
    """Parameters of ``base`` a call could pass that ``mine`` does not take (see :func:`cache_api_mismatches`)."""
    try:
        theirs, ours = inspect.signature(base).parameters, inspect.signature(mine).parameters
    except (TypeError, ValueError):
        return []
    kinds = {p.kind for p in ours.values()}
    any_keyword = inspect.Parameter.VAR_KEYWORD in kinds
    any_positional = inspect.Parameter.VAR_POSITIONAL in kinds
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    missing = []
    for name, p in theirs.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and not any_keyword:
            missing.append(f"**{name}")
        elif p.kind is inspect.Parameter.KEYWORD_ONLY or (p.kind in positional and p.default is not p.empty):
            if name not in ours and not any_keyword:
                missing.append(name)
    wanted = sum(p.kind in positional and p.default is p.empty for p in theirs.values())  # self included
    if not any_positional and sum(p.kind in positional for p in ours.values()) < wanted:
        missing.append(f"{wanted - 1} positional arguments")
    return missing


# instance attributes in which a module keeps recurrent state between forwards (RecurrentGemma)
MODULE_STATE_ATTRS = ("conv1d_state", "recurrent_states")


def module_states(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(module, attribute) pairs in which the model keeps recurrent state outside any cache
    (RecurrentGemma's conv and RG-LRU states: one batch row per sequence, reset by each prompt)."""
    return [(module, attr) for module in model.modules() for attr in MODULE_STATE_ATTRS if attr in vars(module)]


class HFPagedCache(Cache):
    """A transformers Cache over a :class:`~flashpage.PagedKVCache` (flash-attn page layout).

    Args:
        config: the model's config (``model.config``), for the number of layers.
        num_blocks: pages in the pool; default: sized at the first forward from the batch and
            ``max_cache_len`` (the pool grows when a generation outlives the estimate, unless
            ``growable=False``).
        block_size: tokens per page; default 256 where flash-attn 2 is the kernel, else 16.
        max_cache_len: expected tokens per sequence, used for the default sizing.
        enable_prefix_caching: rows whose prompts start with equal full blocks share those pages
            (e.g. ``num_return_sequences``, beams, a common system prompt); default on.
        growable: enlarge the pool instead of failing when it runs out.
        dense_view: return the whole padded K/V from ``update()`` (for models that compute
            attention themselves, e.g. Falcon, Bloom, MLA latents). Set by the family patches.

    Use it through ``flashpage.patch(model)`` (then every ``generate()`` gets one), or pass it
    yourself: ``model.generate(..., past_key_values=HFPagedCache(model.config))``.
    """

    def __init__(
        self,
        config=None,
        *,
        num_layers: int | None = None,
        num_blocks: int | None = None,
        block_size: int | None = None,
        max_cache_len: int | None = None,
        enable_prefix_caching: bool = True,
        growable: bool = True,
        dense_view: bool = False,
    ) -> None:
        require_supported_transformers()  # transformers 4.x would accept this object and fail later, obscurely
        sizes = {"num_blocks": num_blocks, "block_size": block_size, "max_cache_len": max_cache_len}
        check_positive_ints("HFPagedCache: ", {k: v for k, v in sizes.items() if v is not None},
                            "a positive int or None (the default)")
        if num_layers is None:
            if config is None:
                raise ValueError("HFPagedCache needs the model config (HFPagedCache(model.config)) or num_layers=")
            text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            num_layers = int(text_config.num_hidden_layers)
        types, type_kwargs = cache_layer_types(config, num_layers)
        layers = [_make_layer(self, i, t, kw) for i, (t, kw) in enumerate(zip(types, type_kwargs, strict=True))]
        super().__init__(layers=layers)
        self.layer_types = types
        self.state_layers = [i for i, layer in enumerate(self.layers)
                             if _LinearMixin is not None and isinstance(layer, _LinearMixin)]
        self._states_lost = False  # a failed forward left some layers' states advanced (not undoable)
        self.last_written = 0  # the layer update() wrote last (for modules shared by several layers)
        self.num_layers = num_layers
        self._requested_blocks = num_blocks
        self._block_size = block_size
        self._max_cache_len = max_cache_len
        self.enable_prefix_caching = enable_prefix_caching
        self.growable = growable
        self.dense_view = dense_view
        self.shared_layers = shared_kv_layers(config) if config is not None else {}  # {reader: owner} layers
        self.kv: PagedKVCache | None = None
        self.rows: list[int] = []
        self._next_seq = 0
        self._logical_len = 0
        self._real_parts = [torch.zeros((0, 0), dtype=torch.bool)]  # see _real
        self.plan: StepPlan | None = None
        self.step: DeviceStep | None = None  # the plan on the input's device (what the layers use)
        self.has_holes = False  # some row has padding after a real token (set per forward)
        self.sees_later = False  # this forward's mask lets tokens see later ones (set by the mask function)
        self._offset: torch.Tensor | None = None  # the logical length as a 0-d tensor on the input device
        self._owns_plan = False
        self._pending = 0  # new tokens of the forward in flight (committed by end_forward)
        self._preallocated = False  # one engine sequence whose slots the scheduler allocated (over_sequence)
        # (module, attribute) pairs holding recurrent state outside the cache (module_states); read_states /
        # load_states carry them too, so the engine keeps them per sequence like the cache's own states
        self.module_states: list[tuple[torch.nn.Module, str]] = []
        self._step_keys_cache: tuple | None = None  # (plan, rows, {device: (slots, valid)}, slots, valid): step_kv's

    @property
    def _real(self) -> torch.Tensor:
        """(B, logical_len) bool: which logical positions hold a stored (real) token."""
        if len(self._real_parts) > 1:
            self._real_parts = [torch.cat(self._real_parts, dim=1)]
        return self._real_parts[0]

    @_real.setter
    def _real(self, value: torch.Tensor) -> None:
        self._real_parts = [value]

    @classmethod
    def wrap(cls, kv: PagedKVCache, config=None) -> HFPagedCache:
        """A cache over an existing pool whose steps the caller plans (sets ``.plan``), e.g. the engine."""
        cache = cls(config, num_layers=kv.num_layers, block_size=kv.block_size)
        cache.kv = kv
        cache.shared_layers = kv.shared_layers
        return cache

    @classmethod
    def over_sequence(cls, kv: PagedKVCache, config, seq_id: int, past: int) -> HFPagedCache:
        """The cache patched generate() would hand the model for one unpadded sequence, over an engine pool
        whose scheduler allocated this forward's slots: row ``seq_id`` with ``past`` tokens computed. The
        forward plans itself (``owns_plan``), so the model sees generate()'s ``[1, L]`` layout: transformers'
        masks over its ``past + L`` keys, the dense view, a sparse indexer's keys (``update_indexer``).
        No prefix hashing, no growth; a failed forward leaves the pages to the engine's rollback."""
        cache = cls.wrap(kv, config)
        cache.enable_prefix_caching = False
        cache.growable = False
        cache.rows = [seq_id]
        cache._logical_len = past
        cache._real = torch.ones((1, past), dtype=torch.bool)
        cache._preallocated = True
        return cache

    # ------------------------------------------------------------ transformers API
    @property
    def is_compileable(self) -> bool:  # a paged cache must never be compiled with static shapes
        return False

    @property
    def is_croppable(self) -> bool:
        """Always for the pages; linear-attention layers only while they record their past (transformers' rule)."""
        return all(self.layers[i].is_croppable for i in self.state_layers)

    @property
    def has_states(self) -> bool:
        """Some layers keep linear-attention / SSM states (a hybrid or state-space model)."""
        return bool(self.state_layers) or bool(self.module_states)

    @property
    def is_initialized(self) -> bool:
        """Whether the cache holds tokens of a finished forward, as transformers' dynamic cache says once every
        layer was written: models read ``not cache.is_initialized`` as "this is the prefill" (PaliGemma builds
        its bidirectional prefix mask only then). The pool, created when the prefill is planned, does not count.
        A cache whose steps the engine plans keeps saying True once it has a pool."""
        return self.kv is not None and (self._logical_len > 0 or not self._owns_plan)

    @property
    def batch_size(self) -> int:
        return len(self.rows) if self.rows else -1

    @property
    def max_cache_len(self) -> int | None:
        """Expected tokens per sequence (sizing hint; None: sized from the first forward).

        Its own attribute: transformers' ``Cache`` has a read-only property of this name before 5.20."""
        return self._max_cache_len

    @max_cache_len.setter
    def max_cache_len(self, value: int | None) -> None:
        self._max_cache_len = value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Logical (padded) length, as transformers counts it."""
        return self._logical_len

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        """(kv_length, kv_offset) of transformers' masks. ``query_length`` is the new tokens'
        ``cache_position`` tensor before transformers 5.5 (its length is the query length), an int
        after. Under ``torch.compile`` the width is the cache's fixed ``max_cache_len``, as a static
        cache's is, so shapes do not change per step (the paged path never reads this mask; the dense
        path uses its first logical columns)."""
        if isinstance(query_length, torch.Tensor):
            query_length = int(query_length.shape[0])
        if self.max_cache_len and torch.compiler.is_compiling():
            return self.max_cache_len, 0
        return self._logical_len + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Position of this forward's first query. Under ``torch.compile`` a 0-d tensor updated each
        forward (a Python int would be specialised: one graph per step)."""
        if self._offset is not None and torch.compiler.is_compiling():
            return self._offset
        return self._logical_len

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:  # get_max_length before transformers 5.14
        return -1

    def activate_past_recording(self, **kwargs) -> None:
        """Pages keep every token anyway; linear-attention layers start keeping their conv inputs (and, from
        transformers 5.25, their last ``recurrent_states_to_keep`` recurrent states: the keywords go to them)."""
        for i in self.state_layers:
            self.layers[i].activate_past_recording(**kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write a layer's new K/V (B, Hk, L, D) into its pages.

        Returns the inputs unchanged (the paged attention reads the pages), or the whole padded
        K/V (B, Hk, past + L, D) when ``dense_view`` is on.
        """
        if self.plan is None:
            raise RuntimeError(
                "HFPagedCache.update() was called outside a planned forward: the model is not patched. "
                "Call flashpage.patch(model) before passing an HFPagedCache to it."
            )
        b, hk, length, d = key_states.shape
        k = key_states.transpose(1, 2).reshape(b * length, hk, d)
        v = value_states.transpose(1, 2).reshape(b * length, hk, value_states.shape[-1])
        step = self.step if self.step is not None and self.step.input_slots.device == k.device else self.plan
        self.kv.write(layer_idx, k, v, step)
        self.last_written = layer_idx
        if self.dense_view:
            if not self._owns_plan:  # the engine's step: each scheduled sequence's whole K/V
                return self.step_kv(layer_idx, key_states.dtype, b)
            return self.dense_kv(layer_idx, key_states.dtype)
        return key_states, value_states

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues row ``beam_idx[i]``; blocks are shared, never copied
        (linear-attention states are copied row by row, as transformers does)."""
        self._select(beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(torch.as_tensor(indices).tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select([i for i in range(max(len(self.rows), self._state_rows())) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers 5: ``crop(-n)``; ``crop(0)`` is a no-op).

        Where the installed transformers still crops to a length (``crop(n)``, n > 0, keeps the first
        n tokens: what its generate() calls before 5.14), that is accepted too."""
        if tokens_to_remove > 0:
            if not legacy_crop():
                raise ValueError(f"HFPagedCache.crop({tokens_to_remove}): pass a negative number of tokens to "
                                 "remove (transformers 5 semantics), e.g. crop(-2)")
            tokens_to_remove = min(0, tokens_to_remove - self._logical_len)
        for i in self.state_layers:  # raises unless recording (transformers' rule); crop(0) trims conv inputs
            self.layers[i].crop(tokens_to_remove)
        if tokens_to_remove == 0 or self.kv is None:
            return
        remove = min(-tokens_to_remove, self._logical_len)
        real_removed = self._real[:, self._logical_len - remove:].sum(dim=1).tolist()
        for seq, n in zip(self.rows, real_removed, strict=True):
            if n:
                self.kv.truncate(seq, self.kv.num_tokens(seq) - n)
        self._logical_len -= remove
        self._real = self._real[:, : self._logical_len]
        self._trim_indexer_positions()

    def reset(self) -> None:
        """Free every sequence (the pool stays allocated for reuse)."""
        if self.kv is not None:
            for seq in self.rows:
                self.kv.free(seq)
        for i in self.state_layers:
            self.layers[i].reset()
        self._states_lost = False
        self.rows = []
        self._logical_len = 0
        self._trim_indexer_positions()
        self._real = torch.zeros((0, 0), dtype=torch.bool)
        self.plan = None

    # ------------------------------------------------------------- planning
    def begin_forward(self, input_ids: torch.Tensor | None, batch: int, length: int,
                      attention_mask: torch.Tensor | None, device: torch.device | None = None) -> None:
        """Plan one forward of ``batch`` rows x ``length`` new tokens (called by the patch hook).

        Args:
            input_ids: (batch, length) token ids, or None (inputs_embeds); used for prefix hashing.
            attention_mask: 2D (batch, past + length) or (batch, length) padding mask, or None.
        """
        if self.plan is not None:  # left over from a forward that was interrupted
            self.end_forward(ok=False)
        if self._states_lost:
            raise RuntimeError(
                "HFPagedCache: an earlier forward failed part-way through this hybrid model's linear-attention / "
                "SSM layers, whose states cannot be rolled back; the cached sequences are lost. Start again "
                "with a new cache (or cache.reset()).")
        if self.kv is None:
            self._create_pool(batch, length, device)
        new_mask = self._new_token_mask(attention_mask, batch, length)
        layout = InputLayout(batch, length, None if bool(new_mask.all()) else new_mask)
        width = -(-self.max_cache_len // self.kv.block_size) if self.max_cache_len else None
        if not self.rows and self.enable_prefix_caching and input_ids is not None:
            tokens = self._token_lists(input_ids, new_mask)
            self._ensure_capacity([len(t) for t in tokens], rows=[])
            self.rows = [self._new_seq() for _ in range(batch)]
            plan = self.kv.plan(self.rows, token_ids=tokens, new_sequences=True, layout=layout, table_width=width)
            self._start(plan, new_mask, length, device)
            return
        if not self.rows:
            self._add_rows(batch)
        if batch != len(self.rows):
            raise ValueError(
                f"HFPagedCache holds {len(self.rows)} sequences but this forward has batch size {batch}; "
                "a cache continues the batch it was filled with (use a new cache, or cache.reset())"
            )
        counts = [length] * batch if layout.real is None else new_mask.sum(dim=1).tolist()
        if self._preallocated:  # the engine's scheduler allocated the slots (over_sequence)
            plan = self.kv.plan(self.rows, counts, allocated=True, layout=layout, context_lens=[self._logical_len])
            self._start(plan, new_mask, length, device)
            return
        tokens = self._token_lists(input_ids, new_mask) if self.enable_prefix_caching else None
        self._ensure_capacity(counts)
        plan = self.kv.plan(self.rows, counts, tokens, layout=layout, table_width=width)
        self._start(plan, new_mask, length, device)

    def _start(self, plan: StepPlan, new_mask: torch.Tensor, length: int, device: torch.device | None) -> None:
        self.plan = plan
        self.sees_later = False
        self.step = plan.to(device if device is not None else "cpu")
        if self._offset is None or self._offset.device != self.step.input_slots.device \
                or self._offset.is_inference() != torch.is_inference_mode_enabled():
            self._offset = torch.tensor(self._logical_len, device=self.step.input_slots.device)
        else:
            self._offset.fill_(self._logical_len)
        self._owns_plan = True
        self._pending = length
        first = len(self._real_parts) == 1 and not self._real_parts[0].shape[0]
        if first:
            self._real = new_mask
        else:  # concatenated only when read (crop, dense views, holes): not every decode step
            self._real_parts.append(new_mask)
        if first or not bool(new_mask.all()):  # only padding can open a hole (a pad after a real token)
            started = self._real.to(torch.int8).cummax(dim=1).values.to(torch.bool)
            self.has_holes = bool((started & ~self._real).any())

    @property
    def owns_plan(self) -> bool:
        """The current plan was made by :meth:`begin_forward` (not handed in with :meth:`set_plan`)."""
        return self._owns_plan

    def set_plan(self, plan: StepPlan, device: torch.device | str = "cpu") -> None:
        """Use a plan made by the caller (the engine) for the next forward on ``device``."""
        self.plan = plan
        self.step = plan.to(device)
        self._owns_plan = False
        self.sees_later = False

    def end_forward(self, ok: bool = True) -> None:
        """Commit the planned tokens (``ok``) or roll them back (the forward failed)."""
        plan, self.plan, self.step = self.plan, None, None
        self.sees_later = False
        if plan is None or not self._owns_plan:
            return
        if ok:
            self._logical_len += self._pending
        elif self._preallocated:  # an engine sequence's forward: the engine rolls its step back
            self._real = self._real[:, : self._logical_len]
        elif self._logical_len == 0:  # the first forward failed: start over with no rows
            for seq in self.rows:
                self.kv.truncate(seq, 0, invalidate=True)
                self.kv.free(seq)
            for i in self.state_layers:
                self.layers[i].reset()
            self.rows = []
            self._real = torch.zeros((0, 0), dtype=torch.bool)
            self._trim_indexer_positions()
        else:
            self._states_lost = self.has_states
            for seq, n in zip(plan.seq_ids, plan.context_lens, strict=True):
                self.kv.truncate(seq, n, invalidate=True)
            self._real = self._real[:, : self._logical_len]
            self._trim_indexer_positions()
        self._pending = 0

    def _create_pool(self, batch: int, length: int, device: torch.device | None) -> None:
        block_size = self._block_size or default_block_size(device)
        per_seq = self.max_cache_len or (length + 256)
        num_blocks = self._requested_blocks or batch * (math.ceil(per_seq / block_size) + 1) + 1
        self.kv = PagedKVCache(self.num_layers, None, None, num_blocks=num_blocks, block_size=block_size,
                               dtype=None, enable_prefix_caching=self.enable_prefix_caching,
                               shared_layers=self.shared_layers)

    def _add_rows(self, batch: int) -> None:
        for _ in range(batch):
            self.rows.append(self._new_seq())
            self.kv.add_sequence(self.rows[-1])
        self._real = torch.zeros((batch, self._logical_len), dtype=torch.bool)

    def _new_seq(self) -> int:
        self._next_seq += 1
        return self._next_seq

    def _new_token_mask(self, attention_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
        if attention_mask is None or attention_mask.dim() != 2:
            return torch.ones((batch, length), dtype=torch.bool)
        width = attention_mask.shape[1]
        if width not in (length, self._logical_len + length):
            raise ValueError(
                f"attention_mask has {width} columns; expected {self._logical_len + length} (cached "
                f"{self._logical_len} + new {length}) or {length}; a filled HFPagedCache continues its own "
                "sequences: pass them whole plus the new tokens, or use a new cache (or cache.reset())"
            )
        return attention_mask[:, width - length:].to("cpu", torch.bool)

    @staticmethod
    def _token_lists(input_ids: torch.Tensor | None, new_mask: torch.Tensor) -> list[list[int]] | None:
        if input_ids is None:
            return None
        rows = input_ids.tolist()
        if bool(new_mask.all()):
            return rows
        return [[t for t, real in zip(row, keep, strict=True) if real]
                for row, keep in zip(rows, new_mask.tolist(), strict=True)]

    def _ensure_capacity(self, counts: Sequence[int], rows: Sequence[int] | None = None) -> None:
        rows = self.rows if rows is None else rows
        if rows:
            needed = self.kv.blocks_needed(rows, counts)
        else:  # sequences not added yet: a full prompt's worth of blocks each at most
            needed = sum(-(-n // self.kv.block_size) for n in counts)
        free = self.kv.blocks.num_free_blocks
        if needed > free and self.growable:
            self.kv.grow(max(2 * self.kv.num_blocks, self.kv.num_blocks + needed - free))

    def _state_rows(self) -> int:
        """Batch rows the linear-attention states hold (0 before the first forward)."""
        for i in self.state_layers:
            layer = self.layers[i]
            for states in (layer.conv_states, layer.recurrent_states):
                tensor = next((t for t in states.values() if t is not None), None)
                if tensor is not None:
                    return int(tensor.shape[0])
        return 0

    def _select(self, rows: list[int]) -> None:
        """New row i continues old row ``rows[i]`` (fork: shared blocks, COW of the last one; the
        linear-attention states are gathered row by row)."""
        if self.state_layers and self._state_rows():
            index = torch.as_tensor(rows, dtype=torch.long)
            for i in self.state_layers:
                self.layers[i].reorder_cache(index)
        self._select_indexer_positions(rows)
        if self.kv is None or not self.rows:
            return
        old = self.rows
        new_rows = []
        for src in rows:
            seq = self._new_seq()
            self.kv.fork(old[src], seq)
            new_rows.append(seq)
        for seq in old:
            self.kv.free(seq)
        self.rows = new_rows
        self._real = self._real[torch.as_tensor(rows, dtype=torch.long)]

    def dense_kv(self, layer_idx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Hk, logical_len, D) K/V with stored tokens at their logical positions, zeros at pads."""
        k, v, lengths = self.kv.gather(layer_idx, self.rows)
        dense_k, dense_v = self._logical(k, lengths), self._logical(v, lengths)
        return dense_k.transpose(1, 2).to(dtype), dense_v.transpose(1, 2).to(dtype)

    def _logical(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """(B, Lmax, ...) stored rows per sequence -> (B, logical_len, ...) at their logical positions, zeros
        at padding (the layout transformers' dynamic caches have, with pads' entries zeroed)."""
        b, total = len(self.rows), self._logical_len + self._pending
        real = self._real.to(x.device)
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None]
        dense = x.new_zeros((b, total, *x.shape[2:]))
        dense[real] = x[valid]
        return dense

    # ------------------------------------------------------ sparse-attention indexers
    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Store a sparse-attention indexer's new keys (DeepSeek-V3.2's DSA lightning indexer and its kin)
        and return all of the layer's indexer keys, as transformers' ``DynamicIndexedLayer`` does.

        The keys live in an extra page group of the pool ("indexer"), addressed by the same block tables
        as the layer's K/V (vLLM keeps them so): they fork, crop and free with the sequences.

        Args:
            indexer_key_states: (B, L, Di) the new tokens' indexer keys.

        Returns:
            (B, past + L, Di) the keys at their logical positions (zeros at padding, which the indexer's
            mask excludes).
        """
        if self.plan is None or not self._owns_plan:
            raise RuntimeError(
                "HFPagedCache.update_indexer() was called outside a forward planned by patched generate() or "
                "HFPagedCache.over_sequence(); the engine's packed steps do not run sparse-attention indexers "
                "(flashpage.LLM runs such models one sequence per forward: ModelRunner's solo steps)")
        b, length = indexer_key_states.shape[:2]
        rows = indexer_key_states.reshape(b * length, 1, *indexer_key_states.shape[2:])
        step = self.step if self.step is not None and self.step.input_slots.device == rows.device else self.plan
        self.kv.write_extra(INDEXER_GROUP, layer_idx, rows, step)
        stored, lengths = self.kv.gather_extra(INDEXER_GROUP, layer_idx, self.rows)
        return self._logical(stored[:, :, 0], lengths).to(indexer_key_states.dtype)

    def _trim_indexer_positions(self) -> None:
        """Keep each layer's ``indexer_position_ids`` (P, B, L) (positions a model records on the cache layer,
        e.g. Qwen4-Exp's) as long as the logical length."""
        for layer in self.layers:
            ids = getattr(layer, "indexer_position_ids", None)
            if ids is not None and ids.shape[-1] > self._logical_len:
                layer.indexer_position_ids = ids[..., : self._logical_len] if self._logical_len else None

    def _select_indexer_positions(self, rows: list[int]) -> None:
        for layer in self.layers:
            ids = getattr(layer, "indexer_position_ids", None)
            if ids is not None:
                layer.indexer_position_ids = ids.index_select(1, torch.as_tensor(rows, dtype=torch.long,
                                                                                 device=ids.device))

    def step_kv(self, layer_idx: int, dtype: torch.dtype, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense view of a step the caller planned (the engine): every sequence's whole K/V, this
        step's tokens included, read from the pages.

        ``rows`` is the forward's batch: 1 (the packed ``[1, T]`` step) gives ``(1, Hk, sum_k, D)``, the
        sequences' keys back to back (``plan.cu_seqlens_k`` splits them); one row per sequence (the
        ``[B, L]`` steps of models with recurrent layers) gives ``(B, Hk, max_k, D)``, right-padded with
        zeros. The model may transform them per token (expand MLA latents, split or repeat heads) before
        its attention call; :meth:`step_keys` turns what it hands the attention back into packed rows.
        """
        k_pages, v_pages = self.kv.k_pages(layer_idx), self.kv.v_pages(layer_idx)
        index, valid = self._step_index(rows, k_pages.device)
        k = k_pages.flatten(0, 1).index_select(0, index)
        v = v_pages.flatten(0, 1).index_select(0, index)
        if valid is None:
            return k.transpose(0, 1).unsqueeze(0).to(dtype), v.transpose(0, 1).unsqueeze(0).to(dtype)
        dense_k = k.new_zeros((rows, valid.shape[1], *k.shape[1:]))
        dense_v = v.new_zeros((rows, valid.shape[1], *v.shape[1:]))
        dense_k[valid] = k
        dense_v[valid] = v
        return dense_k.transpose(1, 2).to(dtype), dense_v.transpose(1, 2).to(dtype)

    def step_keys(self, t: torch.Tensor) -> torch.Tensor:
        """``(R, H, W, D)`` as :meth:`step_kv` laid it out (possibly transformed per token) ->
        ``(sum_k, H, D)`` packed sequence after sequence, as ``plan.cu_seqlens_k`` splits them."""
        _, valid = self._step_index(t.shape[0], t.device)
        if valid is None:
            return t[0].transpose(0, 1)
        return t.transpose(1, 2)[valid]

    def _step_index(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Page slot of every key of this step's sequences ``(sum_k,)`` int64, and for a ``[B, L]``
        input the ``(B, max_k)`` bool mask of real keys (None for a packed input), on ``device``.
        Built once per step and device, shared by the layers."""
        plan = self.plan
        cached = self._step_keys_cache
        if cached is None or cached[0] is not plan or cached[1] != rows:
            cached = self._step_keys_cache = (plan, rows, {}, *self._step_slots(plan, rows))
        on_device = cached[2].get(device)
        if on_device is None:
            index, valid = cached[3], cached[4]
            on_device = cached[2][device] = (index.to(device), valid.to(device) if valid is not None else None)
        return on_device

    @staticmethod
    def _step_slots(plan: StepPlan, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Host side of :meth:`_step_index`: slot ``table[b, p // P] * P + p % P`` of key p of sequence b."""
        n = len(plan.seq_ids)
        if rows not in (1, n):
            raise RuntimeError(f"HFPagedCache: a dense-view step of {n} sequences needs a packed [1, T] input or one "
                               f"row per sequence, got {rows} rows")
        lens = torch.tensor(plan.key_lens, dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(n), lens)
        starts = torch.cumsum(lens, 0) - lens
        pos = torch.arange(int(lens.sum())) - starts[seq]
        bs = plan.block_size
        index = plan.block_table.to(torch.long)[seq, pos // bs] * bs + pos % bs
        valid = None
        if rows > 1:
            valid = torch.arange(int(lens.max()))[None, :] < lens[:, None]
        return index, valid

    # -------------------------------------------------------------- reporting
    # ------------------------------------------------------- engine state slots
    def read_states(self) -> tuple[dict[tuple[int, str, int], torch.Tensor], dict[tuple[int, int], bool]]:
        """The state layers' current states ``{(layer, "conv" | "recurrent", index): (B, *shape)}`` (and
        ``{("module", attribute, j): (B, *shape)}`` for ``module_states[j]``) and their has-previous-state
        flags ``{(layer, index): bool}`` (for the engine's state slots)."""
        states: dict[tuple[int, str, int], torch.Tensor] = {}
        previous: dict[tuple[int, int], bool] = {}
        for i in self.state_layers:
            layer = self.layers[i]
            for kind, tensors in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
                for j, tensor in tensors.items():
                    if tensor is not None:
                        states[(i, kind, j)] = tensor
            for j, flag in layer.has_previous_state.items():
                previous[(i, j)] = bool(flag)
        for j, (module, attr) in enumerate(self.module_states):
            tensor = getattr(module, attr)
            if tensor is not None:
                states[("module", attr, j)] = tensor
        return states, previous

    def load_states(self, states: dict[tuple[int, str, int], torch.Tensor] | None,
                    previous: dict[tuple[int, int], bool] | None = None) -> None:
        """Set the state layers for the next forward: ``states`` as :meth:`read_states` gives them
        (rows = the forward's batch rows), or None for sequences that start here (no previous state)."""
        for i in self.state_layers:
            layer = self.layers[i]
            _LinearLayer.__init__(layer, number_of_states=layer.number_of_states)  # forget the last forward's rows
            if isinstance(layer, _PagedLayer):
                layer.is_initialized = True
        for module, attr in self.module_states:  # None: the module starts from zeros (as at a prompt)
            setattr(module, attr, None)
        if not states:
            return
        for (i, kind, j), tensor in states.items():
            if i == "module":
                setattr(self.module_states[j][0], kind, tensor)
                continue
            layer = self.layers[i]
            layer.device, layer.dtype = tensor.device, tensor.dtype
            if kind == "conv":
                layer.conv_states[j] = tensor
                layer.conv_kernel_size[j] = tensor.shape[-1]
                layer.is_conv_states_initialized[j] = True
            else:
                layer.recurrent_states[j] = tensor
                layer.is_recurrent_states_initialized[j] = True
        for (i, j), flag in (previous or {}).items():
            self.layers[i].has_previous_state[j] = flag

    def state_bytes(self) -> int:
        """Bytes of the linear-attention / SSM states held (all rows, all state layers)."""
        total = 0
        for i in self.state_layers:
            layer = self.layers[i]
            for states in (layer.conv_states, layer.recurrent_states):
                total += sum(t.numel() * t.element_size() for t in states.values() if t is not None)
        return total

    def memory_stats(self) -> MemoryStats:
        """Blocks, bytes and tokens held, against a dense cache for the same batch (both counting the
        linear-attention / SSM states of a hybrid model, which are the same in either)."""
        state = self.state_bytes()
        if self.kv is None or self.kv.dtype is None:
            return MemoryStats(0, self._block_size or 0, 0, 0, 0, state, state, state, state)
        stats = self.kv.stats()
        paged_layers = sum(1 for layer in self.layers if isinstance(layer, _PagedLayer))
        per_block = self.kv.bytes_per_block() * paged_layers // self.num_layers
        per_token = per_block // self.kv.block_size
        return MemoryStats(
            num_blocks=stats.num_blocks,
            block_size=stats.block_size,
            blocks_in_use=stats.in_use,
            tokens_stored=sum(self.kv.num_tokens(s) for s in self.rows),
            token_slots_in_use=stats.in_use * stats.block_size,
            bytes_in_use=stats.in_use * per_block + state,
            bytes_allocated=self.kv.allocated_bytes() + state,
            dense_bytes=len(self.rows) * self._logical_len * per_token + state,
            state_bytes=state,
            groups=tuple(self.kv.groups()),
        )

    def __repr__(self) -> str:
        return (f"HFPagedCache(rows={len(self.rows)}, logical_len={self._logical_len}, "
                f"block_size={self.kv.block_size if self.kv else self._block_size})")
