"""PagedKVCache: per-layer K/V pages in flash-attn's layout, sequence lifecycle and the step plan.

Pages of layer ``i`` are ``k_pages(i)`` / ``v_pages(i)``, each of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``: exactly what
``flash_attn_with_kvcache(block_table=...)`` and ``flash_attn_varlen_func(block_table=...)``
read. A :class:`~flashpage.blocks.BlockManager` decides which block holds which token; a
:class:`StepPlan`, built once per forward, tells every layer where to write its new K/V and what
block tables and lengths to hand the kernel. No transformers import here.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from flashpage.blocks import BlockManager, BlockStats
from flashpage.errors import NoFreeBlocksError
from flashpage.kernels import backend_info
from flashpage.plan import DeviceStep, InputLayout, StepPlan, build_plan

DeviceLike = torch.device | str | int | None


def _as_device(device: DeviceLike) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device if device is not None else "cpu")


def default_block_size(device: DeviceLike = None) -> int:
    """Block size for pages on ``device``: 16, or 256 where upstream flash-attn 2 is the kernel.

    flash-attn 2 only accepts page sizes divisible by 256; flash-attn 3 and the reference take any.
    """
    dev = _as_device(device)
    small = backend_info(device=dev, dtype=torch.float16, block_size=16)["flash_attn_with_kvcache"]
    if small.name != "reference" or dev.type != "cuda":
        return 16
    large = backend_info(device=dev, dtype=torch.float16, block_size=256)["flash_attn_with_kvcache"]
    return 256 if large.name != "reference" else 16


@dataclass
class _LayerPages:
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class LayerGeometry:
    """What one layer's pages hold per token: ``num_kv_heads`` (Hk) heads of ``head_dim`` (D) keys and
    ``v_head_dim`` (Dv) values. Layers of one geometry share a page pool (one allocation)."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """K+V bytes of one token in one layer of this geometry."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVGroup:
    """One page pool: the layers of one geometry on one device. Every pool has ``num_blocks`` blocks
    and all pools share the block manager's block tables (vLLM's KV cache groups).

    Attributes:
        geometry: the layers' (Hk, D, Dv).
        device: where the pool lives (None: not allocated yet).
        layers: layer indices whose K/V the pool holds.
        readers: layers that hold no K/V of their own and read a layer of this pool (shared KV).
        bytes_per_block: K+V bytes of one block in this pool (all its layers).
    """

    geometry: LayerGeometry
    device: torch.device | None
    layers: tuple[int, ...]
    readers: tuple[int, ...]
    bytes_per_block: int


class PagedKVCache:
    """K/V pages for every layer of a model, plus the block accounting and step planning.

    Args:
        num_layers: decoder layers that store K/V.
        num_kv_heads: K/V heads per layer (``Hk``).
        head_dim: key head dim (``D``).
        num_blocks: pages per layer (``NB``).
        block_size: tokens per page (``P``); flash-attn 2 needs a multiple of 256.
        dtype: page dtype.
        device: one device for all layers, a list with one device per layer (accelerate
            device maps), or None to allocate each layer lazily on the device of the first K/V
            it receives.
        v_head_dim: value head dim when it differs from ``head_dim`` (MLA latents); default same.
        enable_prefix_caching: share full blocks between sequences with equal prefixes.
        layer_geometry: per-layer (Hk, D, Dv) when layers differ (Gemma 4's sliding vs global layers,
            MiMo-V2-Flash): one :class:`LayerGeometry` per layer, None for a layer that stores no K/V.
            Layers of one geometry share a page pool; every pool has ``num_blocks`` blocks addressed by
            the same block tables (:meth:`groups`). Default: every layer ``(num_kv_heads, head_dim,
            v_head_dim)``.
        shared_layers: ``{reader: owner}`` for layers that reuse another layer's K/V (Gemma 3n, Gemma 4
            KV sharing): the reader stores nothing and reads the owner's pages.

    Example:
        >>> kv = PagedKVCache(2, 2, 8, num_blocks=16, block_size=4, dtype=torch.float32)
        >>> kv.add_sequence("a", [1, 2, 3, 4, 5])
        0
        >>> plan = kv.plan(["a"], [5], [[1, 2, 3, 4, 5]])
        >>> plan.block_table.shape, plan.seqlens_k.tolist()
        (torch.Size([1, 2]), [5])
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int | None,
        head_dim: int | None,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = torch.float32,
        device: DeviceLike | Sequence[DeviceLike] = None,
        v_head_dim: int | None = None,
        enable_prefix_caching: bool = True,
        layer_geometry: Sequence[LayerGeometry | None] | None = None,
        shared_layers: Mapping[int, int] | None = None,
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_blocks", num_blocks), ("block_size", block_size)):
            if value is not None and int(value) < 1:
                raise ValueError(f"PagedKVCache: {name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self._shared = _check_shared(shared_layers, num_layers)
        self._explicit_geometry = layer_geometry is not None
        if layer_geometry is not None:
            self._geometry = _check_geometry(layer_geometry, num_layers, self._shared)
            first = next((g for g in self._geometry if g is not None), None)
            if num_kv_heads is None and first is not None:
                num_kv_heads, head_dim, v_head_dim = first.num_kv_heads, first.head_dim, first.v_head_dim
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        if layer_geometry is None:
            uniform = LayerGeometry(num_kv_heads, head_dim, self.v_head_dim) if num_kv_heads and head_dim else None
            self._geometry = [None if i in self._shared else uniform for i in range(num_layers)]
        self._geometry_known = num_kv_heads is not None and head_dim is not None and dtype is not None
        self.block_size = block_size
        self.dtype = dtype
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self._layers: list[_LayerPages | None] = [None] * num_layers
        self._extra: dict[tuple[str, int], torch.Tensor] = {}  # (group, layer) -> (NB, P, *shape) side pages
        self._layer_devices = self._resolve_devices(device)
        if self._layer_devices is not None:
            if not self._geometry_known:
                raise ValueError("PagedKVCache: eager allocation (device=...) needs num_kv_heads, head_dim "
                                 "and dtype; pass them, or device=None to size pages from the first write")
            self._allocate_eagerly()

    # ------------------------------------------------------------------ storage
    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def _resolve_devices(self, device: DeviceLike | Sequence[DeviceLike]) -> list[torch.device] | None:
        if device is None:
            return None
        if isinstance(device, (list, tuple)):
            if len(device) != self.num_layers:
                raise ValueError(
                    f"PagedKVCache: got {len(device)} layer devices for {self.num_layers} layers; "
                    "pass one device per layer or a single device"
                )
            return [_as_device(d) for d in device]
        return [_as_device(device)] * self.num_layers

    def _allocate_eagerly(self) -> None:
        """One allocation per (device, geometry) pool; each layer's pages are a view of its pool's."""
        assert self._layer_devices is not None
        pools: dict[tuple[torch.device, LayerGeometry], list[int]] = {}
        for layer, dev in enumerate(self._layer_devices):
            geometry = self._geometry[layer]
            if geometry is not None:
                pools.setdefault((dev, geometry), []).append(layer)
        for (dev, g), layers in pools.items():
            k = torch.zeros((len(layers), *self._page_shape(g.num_kv_heads, g.head_dim)), dtype=self.dtype, device=dev)
            v = torch.zeros((len(layers), *self._page_shape(g.num_kv_heads, g.v_head_dim)), dtype=self.dtype,
                            device=dev)
            for i, layer in enumerate(layers):
                self._layers[layer] = _LayerPages(k[i], v[i])

    def _page_shape(self, heads: int, dim: int) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, heads, dim)

    def _pages(self, layer: int) -> _LayerPages:
        pages = self._layers[layer]
        if pages is None:
            owner = self._shared.get(layer)
            if owner is not None:  # a layer reusing another layer's K/V reads the owner's pages
                return self._pages(owner)
            raise RuntimeError(
                f"PagedKVCache: layer {layer} has no pages yet (nothing was written to it); "
                "write K/V first or create the cache with device=... to allocate eagerly"
            )
        return pages

    def _pages_for(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> _LayerPages:
        """Pages of ``layer``, allocated on ``k``'s device with its geometry on first use."""
        pages = self._layers[layer]
        if pages is None:
            hk, d, dv = k.shape[-2], k.shape[-1], v.shape[-1]
            if self.num_kv_heads is None:
                self.num_kv_heads, self.head_dim, self.v_head_dim = hk, d, dv
            if self.dtype is None:
                self.dtype = k.dtype
            self._geometry_known = True
            self._geometry[layer] = LayerGeometry(hk, d, dv)
            pages = _LayerPages(
                torch.zeros((self.num_blocks, self.block_size, hk, d), dtype=self.dtype, device=k.device),
                torch.zeros((self.num_blocks, self.block_size, hk, dv), dtype=self.dtype, device=k.device),
            )
            self._layers[layer] = pages
        return pages

    def k_pages(self, layer: int) -> torch.Tensor:
        """Key pages of ``layer``: (num_blocks, block_size, num_kv_heads, head_dim)."""
        return self._pages(layer).k

    def v_pages(self, layer: int) -> torch.Tensor:
        """Value pages of ``layer``: (num_blocks, block_size, num_kv_heads, v_head_dim)."""
        return self._pages(layer).v

    def layer_device(self, layer: int) -> torch.device | None:
        """Device of ``layer``'s pages (None while a lazily placed layer has not been written)."""
        pages = self._layers[layer]
        if pages is None and layer in self._shared:
            return self.layer_device(self._shared[layer])
        return pages.k.device if pages is not None else None

    def layer_geometry(self, layer: int) -> LayerGeometry | None:
        """(Hk, D, Dv) of the K/V ``layer`` stores; None for a layer that stores none (a reader of
        another layer's K/V, a layer without attention) or whose geometry is not known yet."""
        return self._geometry[layer]

    @property
    def shared_layers(self) -> dict[int, int]:
        """``{reader: owner}``: layers that read another layer's pages instead of storing K/V."""
        return dict(self._shared)

    def _stored_geometries(self) -> list[LayerGeometry]:
        """Geometry of every layer that stores K/V (a lazily placed layer not written yet counts as the
        first written layer's, as long as no per-layer geometry was given)."""
        default = None
        if not self._explicit_geometry and self.num_kv_heads and self.head_dim:
            default = LayerGeometry(self.num_kv_heads, self.head_dim, self.v_head_dim)
        out = []
        for layer, g in enumerate(self._geometry):
            g = g if g is not None or layer in self._shared else default
            if g is not None:
                out.append(g)
        return out

    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers (every geometry group), keys and values."""
        if not self._geometry_known:
            raise ValueError("PagedKVCache: geometry unknown until the first write (pass num_kv_heads, "
                             "head_dim and dtype to know block bytes up front)")
        return self.block_size * sum(g.bytes_per_token(self.dtype) for g in self._stored_geometries())

    def groups(self) -> list[KVGroup]:
        """The page pools: one per (geometry, device), in layer order; all share the block tables."""
        keyed: dict[tuple[LayerGeometry, torch.device | None], tuple[list[int], list[int]]] = {}
        for layer, g in enumerate(self._geometry):
            if g is not None and layer not in self._shared:
                keyed.setdefault((g, self.layer_device(layer)), ([], []))[0].append(layer)
        for reader, owner in self._shared.items():
            key = (self._geometry[owner], self.layer_device(owner))
            if key in keyed:
                keyed[key][1].append(reader)
        elem = self.dtype if self.dtype is not None else torch.float32
        return [KVGroup(g, dev, tuple(layers), tuple(sorted(readers)),
                        self.block_size * len(layers) * g.bytes_per_token(elem))
                for (g, dev), (layers, readers) in keyed.items()]

    def allocated_bytes(self) -> int:
        """Bytes of page memory allocated so far (all layers, K and V)."""
        kv = sum(p.k.numel() * p.k.element_size() + p.v.numel() * p.v.element_size()
                 for p in self._layers if p is not None)
        return kv + sum(t.numel() * t.element_size() for t in self._extra.values())

    def grow(self, num_blocks: int) -> None:
        """Enlarge the pool to ``num_blocks`` blocks, keeping every page's content and block id."""
        if num_blocks <= self.num_blocks:
            return
        extra = num_blocks - self.num_blocks
        for i, pages in enumerate(self._layers):
            if pages is None:
                continue
            k_pad = pages.k.new_zeros((extra, *pages.k.shape[1:]))
            v_pad = pages.v.new_zeros((extra, *pages.v.shape[1:]))
            self._layers[i] = _LayerPages(torch.cat([pages.k, k_pad]), torch.cat([pages.v, v_pad]))
        for key, pages in self._extra.items():
            self._extra[key] = torch.cat([pages, pages.new_zeros((extra, *pages.shape[1:]))])
        self.blocks.grow(num_blocks)

    # --------------------------------------------------------------- sequences
    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = None) -> int:
        """Register a sequence; with ``token_ids`` reuse cached full blocks of its prefix.

        Returns the number of prompt tokens already in the cache (a multiple of ``block_size``,
        always fewer than ``len(token_ids)``): those need no compute.
        """
        return self.blocks.add_sequence(seq_id, token_ids)

    def fork(self, src: Hashable, dst: Hashable) -> None:
        """``dst`` shares ``src``'s blocks; the shared partial block is copied on its next write."""
        self.blocks.fork(src, dst)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks (hashed full blocks stay reusable until evicted)."""
        self.blocks.free(seq_id)

    def truncate(self, seq_id: Hashable, num_tokens: int, *, invalidate: bool = False) -> None:
        """Shorten a sequence to ``num_tokens`` tokens (speculative-decoding rollback).

        ``invalidate=True`` when the dropped tokens' K/V was never written (a failed forward): their
        blocks are removed from the prefix cache so nothing is ever served from them.
        """
        self.blocks.truncate(seq_id, num_tokens, invalidate=invalidate)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.blocks.num_tokens(seq_id)

    def has_sequence(self, seq_id: Hashable) -> bool:
        return self.blocks.has_sequence(seq_id)

    def stats(self) -> BlockStats:
        return self.blocks.stats()

    # ------------------------------------------------------------------ planning
    def blocks_needed(self, seq_ids: Sequence[Hashable], num_new: Sequence[int]) -> int:
        """Blocks a step adding ``num_new[i]`` tokens to ``seq_ids[i]`` would allocate."""
        return sum(self.blocks.blocks_needed(s, n) for s, n in zip(seq_ids, num_new, strict=True))

    def plan(
        self,
        seq_ids: Sequence[Hashable],
        num_new: Sequence[int] | None = None,
        token_ids: Sequence[Sequence[int] | None] | None = None,
        *,
        new_sequences: bool = False,
        allocated: bool = False,
        layout: InputLayout | None = None,
        table_width: int | None = None,
        context_lens: Sequence[int] | None = None,
    ) -> StepPlan:
        """Allocate this step's slots (unless ``allocated``) and build the plan every layer reuses.

        Either every sequence gets its slots or, when the pool is short, ``NoFreeBlocksError``
        (with ``needed`` and ``free``) is raised and nothing changes. Pending copy-on-write copies
        run before the plan is returned (so before any layer writes).

        Args:
            seq_ids: sequences taking part, in batch order.
            num_new: tokens to compute per sequence (ignored with ``new_sequences``).
            token_ids: the new tokens' ids per sequence (prefix hashing), or None. With
                ``new_sequences`` the whole prompt of each sequence (required).
            new_sequences: register ``seq_ids`` first, each reusing cached full blocks of its prompt
                (also blocks of the sequences added just before it); only the uncached rest is
                computed: ``plan.context_lens[i]`` tokens were cached.
            allocated: the slots were already allocated with ``blocks.append`` (a scheduler that
                allocates while it schedules); ``num_new`` says how many of each sequence's last
                tokens this step computes (or, with ``context_lens``, the ``num_new[i]`` after the first
                ``context_lens[i]``: a step may compute allocated tokens one at a time).
            layout: how the forward's input maps to sequences (padding), see :class:`InputLayout`;
                None when the input is the computed tokens packed sequence by sequence.
            table_width: block-table columns at least (static shapes across steps).
        """
        if new_sequences:
            context, counts = self._add_new(seq_ids, token_ids)
        elif allocated:
            counts = list(num_new)
            context = [self.blocks.num_tokens(s) - n for s, n in zip(seq_ids, counts, strict=True)] \
                if context_lens is None else list(context_lens)
        else:
            counts = list(num_new)
            context = self._allocate(seq_ids, counts, token_ids)
        tables = [self.blocks.block_table(s) for s in seq_ids]
        self._copy_blocks(self.blocks.pop_copies())
        return build_plan(list(seq_ids), counts, context, tables, self.block_size, layout, table_width)

    def _allocate(self, seq_ids: Sequence[Hashable], counts: list[int],
                  token_ids: Sequence[Sequence[int] | None] | None) -> list[int]:
        needed = self.blocks_needed(seq_ids, counts)
        if needed > self.blocks.num_free_blocks:
            raise NoFreeBlocksError(needed, self.blocks.num_free_blocks, "this step")
        context = [self.blocks.num_tokens(s) for s in seq_ids]
        for i, (seq, n) in enumerate(zip(seq_ids, counts, strict=True)):
            self.blocks.append(seq, n, token_ids[i] if token_ids is not None else None)
        return context

    def _add_new(self, seq_ids: Sequence[Hashable],
                 token_ids: Sequence[Sequence[int] | None] | None) -> tuple[list[int], list[int]]:
        if token_ids is None or any(t is None for t in token_ids) or len(token_ids) != len(seq_ids):
            raise ValueError("PagedKVCache.plan(new_sequences=True) needs every sequence's prompt in token_ids")
        taken = [s for s in seq_ids if self.blocks.has_sequence(s)]
        if taken or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"PagedKVCache.plan: new sequence ids must be new and distinct; got {list(seq_ids)!r} "
                             f"({'already in the cache: ' + repr(taken) if taken else 'repeated ids'})")
        needed = sum(-(-len(t) // self.block_size) for t in token_ids)
        if needed > self.blocks.num_free_blocks:
            raise NoFreeBlocksError(needed, self.blocks.num_free_blocks, "adding these sequences")
        context, counts = [], []
        for seq, toks in zip(seq_ids, token_ids, strict=True):
            cached = self.blocks.add_sequence(seq, list(toks))
            self.blocks.append(seq, len(toks) - cached, list(toks[cached:]))
            context.append(cached)
            counts.append(len(toks) - cached)
        return context, counts

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Run copy-on-write copies (src -> dst block) in every allocated layer, before any write."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.long)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long)
        for pages in self._layers:
            if pages is None:
                continue
            s, d = src.to(pages.k.device), dst.to(pages.k.device)
            pages.k.index_copy_(0, d, pages.k.index_select(0, s))
            pages.v.index_copy_(0, d, pages.v.index_select(0, s))
        for pages in self._extra.values():
            s, d = src.to(pages.device), dst.to(pages.device)
            pages.index_copy_(0, d, pages.index_select(0, s))

    # ------------------------------------------------------------------- writes
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan | DeviceStep) -> None:
        """Store a layer's new K/V into its pages.

        Args:
            layer: layer index.
            k: (N, Hk, D) new keys, one row per input position of the plan's layout (N = T when
                the input is the packed computed tokens); rows the plan does not write are skipped.
            v: (N, Hk, Dv) new values, same layout.
            plan: this step's plan, or its :class:`DeviceStep` on the pages' device.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"PagedKVCache: layer {layer} does not exist, the cache has {self.num_layers} layers; "
                             "was it built for (or filled by) another model? Use one cache per model")
        pages = self._pages_for(layer, k, v)
        if k.shape[1:] != pages.k.shape[2:] or v.shape[1:] != pages.v.shape[2:]:
            raise ValueError(
                f"PagedKVCache: layer {layer} got K/V with (Hk, D) = {tuple(k.shape[1:])} / {tuple(v.shape[1:])} but "
                f"its pages hold {tuple(pages.k.shape[2:])} / {tuple(pages.v.shape[2:])}; was the cache built for "
                "(or filled by) a model of another geometry? Use one cache per model"
            )
        step = plan.to(pages.k.device) if isinstance(plan, StepPlan) else plan
        if k.shape[0] != step.input_slots.shape[0]:
            raise ValueError(f"PagedKVCache.write: got {k.shape[0]} K/V rows but the plan's input has "
                             f"{step.input_slots.shape[0]} positions")
        if k.shape[0]:
            step.write(pages.k, pages.v, k, v)

    def gather(self, layer: int, seq_ids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Read sequences' stored K/V back as padded dense tensors.

        Returns ``(k, v, lengths)`` with k (B, Lmax, Hk, D) and v (B, Lmax, Hk, Dv), rows past a
        sequence's length zero-filled.
        """
        pages = self._pages(layer)
        lengths = [self.blocks.num_tokens(s) for s in seq_ids]
        lmax = max(lengths, default=0)
        nblk = -(-lmax // self.block_size)
        table = torch.zeros((len(seq_ids), max(nblk, 1)), dtype=torch.long)
        for i, s in enumerate(seq_ids):
            ids = self.blocks.block_table(s)
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        table = table[:, :nblk].to(pages.k.device)
        b = len(seq_ids)
        k = pages.k[table].reshape(b, nblk * self.block_size, *pages.k.shape[2:])[:, :lmax]
        v = pages.v[table].reshape(b, nblk * self.block_size, *pages.v.shape[2:])[:, :lmax]
        valid = torch.arange(lmax, device=k.device)[None, :] < torch.tensor(lengths, device=k.device)[:, None]
        return k * valid[..., None, None], v * valid[..., None, None], lengths


    # ------------------------------------------------------------ extra page groups
    def write_extra(self, group: str, layer: int, x: torch.Tensor, plan: StepPlan | DeviceStep) -> None:
        """Store per-token side data of a layer (e.g. a sparse-attention indexer's keys) in its own pages.

        The side pages of ``(group, layer)`` have shape (num_blocks, block_size, *x.shape[1:]), are
        allocated on ``x``'s device at the first write, and are addressed by the same block tables as the
        K/V: they grow, fork (copy-on-write) and are freed with the sequences, and prefix-cached blocks
        carry them (a block's side data is a function of its tokens, as its K/V is).

        Args:
            x: (N, *shape) one row per input position of the plan's layout; rows not written are skipped.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"PagedKVCache: layer {layer} does not exist, the cache has {self.num_layers} layers")
        key = (group, layer)
        pages = self._extra.get(key)
        if pages is None:
            pages = torch.zeros((self.num_blocks, self.block_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
            self._extra[key] = pages
        if tuple(x.shape[1:]) != tuple(pages.shape[2:]):
            raise ValueError(f"PagedKVCache: {group} pages of layer {layer} hold rows of shape "
                             f"{tuple(pages.shape[2:])}, got {tuple(x.shape[1:])}; use one cache per model")
        step = plan.to(pages.device) if isinstance(plan, StepPlan) else plan
        slots = step.input_slots
        if x.shape[0] != slots.shape[0]:
            raise ValueError(f"PagedKVCache.write_extra: got {x.shape[0]} rows but the plan's input has "
                             f"{slots.shape[0]} positions")
        flat = pages.view(-1, *pages.shape[2:])
        if step.all_written:
            flat.index_copy_(0, slots, x.to(pages.dtype))
        else:
            keep = slots >= 0
            flat.index_copy_(0, slots[keep], x[keep].to(pages.dtype))

    def has_extra(self, group: str, layer: int) -> bool:
        """Whether ``layer`` has side pages of ``group`` (something was written with :meth:`write_extra`)."""
        return (group, layer) in self._extra

    def gather_extra(self, group: str, layer: int, seq_ids: Sequence[Hashable]) -> tuple[torch.Tensor, list[int]]:
        """Read sequences' side data back as a padded dense tensor: ``(x, lengths)`` with x
        (B, Lmax, *shape), rows past a sequence's length zero-filled."""
        pages = self._extra.get((group, layer))
        if pages is None:
            raise RuntimeError(f"PagedKVCache: layer {layer} has no {group} pages yet (nothing was written to them)")
        return _gather_pages(pages, [self.blocks.block_table(s) for s in seq_ids],
                             [self.blocks.num_tokens(s) for s in seq_ids], self.block_size)


def _gather_pages(pages: torch.Tensor, tables: list[list[int]], lengths: list[int],
                  block_size: int) -> tuple[torch.Tensor, list[int]]:
    """(B, Lmax, *shape) rows of ``pages`` (NB, P, *shape) along each block table, zeros past each length."""
    lmax = max(lengths, default=0)
    nblk = -(-lmax // block_size)
    table = torch.zeros((len(tables), max(nblk, 1)), dtype=torch.long)
    for i, ids in enumerate(tables):
        ids = ids[:nblk]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    table = table[:, :nblk].to(pages.device)
    x = pages[table].reshape(len(tables), nblk * block_size, *pages.shape[2:])[:, :lmax]
    valid = torch.arange(lmax, device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None]
    return x * valid.view(*valid.shape, *([1] * (x.dim() - 2))).to(x.dtype), lengths

def _check_shared(shared: Mapping[int, int] | None, num_layers: int) -> dict[int, int]:
    """Validate ``{reader: owner}``: both existing layers, an owner that stores its own K/V."""
    out = {int(r): int(o) for r, o in (shared or {}).items()}
    for reader, owner in out.items():
        if not (0 <= reader < num_layers and 0 <= owner < num_layers) or reader == owner or owner in out:
            raise ValueError(f"PagedKVCache: shared_layers maps layer {reader} to layer {owner}; both must be layers "
                             f"of the cache (0..{num_layers - 1}), and the owner a layer that stores its own K/V "
                             "(not itself a reader)")
    return out


def _check_geometry(geometry: Sequence[LayerGeometry | None], num_layers: int,
                    shared: Mapping[int, int]) -> list[LayerGeometry | None]:
    """One geometry (or None) per layer; readers of another layer's K/V store none."""
    items = list(geometry)
    if len(items) != num_layers:
        raise ValueError(f"PagedKVCache: layer_geometry has {len(items)} entries for {num_layers} layers; "
                         "give one LayerGeometry (or None for a layer that stores no K/V) per layer")
    out: list[LayerGeometry | None] = []
    for layer, g in enumerate(items):
        if g is not None and not isinstance(g, LayerGeometry):
            g = LayerGeometry(*g)
        if g is not None and min(g.num_kv_heads, g.head_dim, g.v_head_dim) < 1:
            raise ValueError(f"PagedKVCache: layer {layer} has geometry {g}; heads and dims must be >= 1")
        out.append(None if layer in shared else g)
    return out


__all__ = ["DeviceStep", "InputLayout", "KVGroup", "LayerGeometry", "PagedKVCache", "StepPlan", "default_block_size"]
