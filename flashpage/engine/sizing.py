"""Sizing the engine's KV pool: geometry from a one-token probe, blocks from a memory budget."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from flashpage.cache import LayerGeometry

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB


@dataclass(frozen=True)
class KVSizing:
    """Geometry and size of a KV pool.

    Attributes:
        num_layers / num_kv_heads / head_dim / v_head_dim / dtype: page geometry (of the first layer
            that stores K/V when layers differ; ``layer_geometry`` has every layer's).
        layer_devices: device of each layer's pages (its attention's device).
        block_size / num_blocks: page size and count.
        bytes_per_token: K+V bytes of one token over all layers (every geometry group).
        layer_geometry: (Hk, D, Dv) per layer; None for a layer that stores no K/V (a reader of another
            layer's K/V, a layer without attention). Layers of one geometry share a page pool.
        shared_layers: ``{reader: owner}`` layers that read another layer's pages.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    layer_devices: list[torch.device]
    block_size: int
    num_blocks: int
    bytes_per_token: int
    layer_geometry: tuple[LayerGeometry | None, ...] = ()
    shared_layers: dict[int, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def num_groups(self) -> int:
        """Page pools (distinct K/V geometries)."""
        return len({g for g in self.layer_geometry if g is not None})


@dataclass(frozen=True)
class ProbedGeometry:
    """What a one-token forward showed of a model's K/V: per-layer geometry, dtype and devices."""

    layer_geometry: tuple[LayerGeometry | None, ...]
    dtype: torch.dtype
    layer_devices: list[torch.device]
    shared_layers: dict[int, int]

    @property
    def stores_kv(self) -> bool:
        """Some layer stores K/V (False for a pure state-space model: no attention layer)."""
        return any(g is not None for g in self.layer_geometry)

    @property
    def first(self) -> LayerGeometry:
        """The first layer that stores K/V (what a single-geometry pool would use)."""
        stored = [g for g in self.layer_geometry if g is not None]
        if not stored:
            raise ValueError("flashpage.LLM: the model stored no K/V in a one-token forward (no attention layer "
                             "went through flashpage's cache); it cannot be served by the paged engine")
        return stored[0]

    def bytes_per_token(self) -> int:
        return sum(g.bytes_per_token(self.dtype) for g in self.layer_geometry if g is not None)


def probe_geometry(model: Any) -> ProbedGeometry:
    """Run the (patched) model on one token to learn each layer's KV heads and dims, the dtype and
    the layer devices. Layers whose K/V differ (Gemma 4's global vs sliding layers) each report
    their own; layers reading another layer's K/V report None."""
    from flashpage.patches.linear_cache import engine_cache_class

    refuse_custom_cache(model)
    cache = engine_cache_class(model)(model.config, num_blocks=1, block_size=1, growable=False)
    device = next(model.parameters()).device
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True, **{kwarg: cache})
    kv = cache.kv
    devices = [kv.layer_device(i) or device for i in range(kv.num_layers)]
    geometry = tuple(kv.layer_geometry(i) for i in range(kv.num_layers))
    dtype = kv.dtype if kv.dtype is not None else next(model.parameters()).dtype  # no K/V stored: the model's
    return ProbedGeometry(geometry, dtype, devices, kv.shared_layers)


def refuse_custom_cache(model: Any) -> None:
    """Refuse models that need their own cache class (transformers never gives them a DynamicCache:
    xLSTM, RWKV, Reformer, XLNet): the engine's paged cache cannot stand in for it. (MiniMax's, which only adds
    linear-attention state, it stands in for: ``patches/linear_cache.py``.)
    (Recurrent state a model keeps in its modules, RecurrentGemma's, the engine swaps per forward:
    ``HFPagedCache.module_states``.)"""
    from flashpage.patches import UnsupportedModelError
    from flashpage.patches.linear_cache import own_linear_cache_class, own_rnn_cache_class

    supports = getattr(model, "_supports_default_dynamic_cache", None)
    stood_in = own_linear_cache_class(model) is not None or own_rnn_cache_class(model) is not None  # MiniMax, xLSTM
    if supports is not None and not supports() and not stood_in:
        name = getattr(model.config, "model_type", type(model).__name__)
        raise UnsupportedModelError(
            f"flashpage.LLM does not serve {type(model).__name__} (model_type={name!r}): it keeps its state in its own "
            "cache class, which transformers never replaces by a standard cache and flashpage's paged cache cannot "
            "stand in for. flashpage.patch(model) + model.generate() leaves its cache alone (exact), or use it "
            "unpatched.")


def plan_kv_pool(model: Any, device: torch.device, block_size: int, *, num_blocks: int | None,
                 kv_cache_memory: int | None, gpu_memory_utilization: float,
                 max_model_len: int | None = None, max_num_seqs: int = 1) -> KVSizing:
    """Decide the pool: ``num_blocks`` if given, else a byte budget.

    The budget is ``kv_cache_memory`` when given; on CUDA a fraction of free memory otherwise;
    and on CPU what ``max_num_seqs`` sequences of ``max_model_len`` tokens need, capped at 1 GiB
    (a 4M-parameter model does not get a 1 GiB pool). A ``kv_cache_memory`` smaller than one
    block is an error (it is in bytes, not GiB). A block's bytes count every layer's own geometry.
    """
    check_utilization(gpu_memory_utilization)
    probed = probe_geometry(model)
    if not probed.stores_kv:  # a pure state-space model: blocks hold no pages, they only count tokens
        return KVSizing(len(probed.layer_geometry), 0, 0, 0, probed.dtype, probed.layer_devices, block_size,
                        num_blocks or state_only_blocks(block_size, max_model_len, max_num_seqs), 0,
                        probed.layer_geometry, probed.shared_layers)
    first = probed.first
    per_token = probed.bytes_per_token()
    block_bytes = per_token * block_size
    if num_blocks is None:
        if kv_cache_memory is not None:
            budget = _check_memory(kv_cache_memory, block_bytes, block_size)
        elif torch.device(device).type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget = int(free * gpu_memory_utilization)
        else:
            budget = default_cpu_budget(per_token, block_size, max_model_len, max_num_seqs)
        num_blocks = max(1, budget // block_bytes)
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    return KVSizing(len(probed.layer_geometry), first.num_kv_heads, first.head_dim, first.v_head_dim, probed.dtype,
                    probed.layer_devices, block_size, int(num_blocks), per_token, probed.layer_geometry,
                    probed.shared_layers)


STATE_ONLY_TOKENS = 1 << 16  # tokens per sequence a pool without pages counts by default (when the model has no limit)
STATE_ONLY_BLOCKS = 1 << 16  # blocks such a pool has at most by default (host bookkeeping only)


def state_only_blocks(block_size: int, max_model_len: int | None, max_num_seqs: int) -> int:
    """Blocks of a pool that stores no K/V (a pure state-space model): they cost no memory, so enough for
    ``max_num_seqs`` sequences of ``max_model_len`` tokens (of ``STATE_ONLY_TOKENS`` when unknown), at
    most ``STATE_ONLY_BLOCKS``."""
    per_seq = min(max_model_len or STATE_ONLY_TOKENS, STATE_ONLY_TOKENS)
    return max(1, min(max_num_seqs * -(-per_seq // block_size), STATE_ONLY_BLOCKS))


def default_cpu_budget(bytes_per_token: int, block_size: int, max_model_len: int | None, max_num_seqs: int) -> int:
    """Bytes for ``max_num_seqs`` sequences of ``max_model_len`` tokens (whole blocks), at most 1 GiB."""
    if max_model_len is None:
        return DEFAULT_CPU_KV_BYTES
    blocks_per_seq = -(-max_model_len // block_size)
    return min(DEFAULT_CPU_KV_BYTES, blocks_per_seq * block_size * bytes_per_token * max_num_seqs)


def pool_warning(num_blocks: int, block_size: int, max_model_len: int | None) -> str | None:
    """Why a pool is too small for one ``max_model_len`` sequence (None when it is big enough)."""
    capacity = num_blocks * block_size
    if max_model_len is None or capacity >= max_model_len:
        return None
    return (f"flashpage.LLM: the KV pool holds {capacity} tokens ({num_blocks} blocks of {block_size}) but "
            f"max_model_len is {max_model_len}: a request reaching {capacity} tokens ends early with "
            f"finish_reason='length'. Give more blocks (num_blocks={-(-max_model_len // block_size)} or more, or "
            f"kv_cache_memory= in bytes) or pass max_model_len={capacity} to make the limit explicit.")


def _check_memory(kv_cache_memory: object, block_bytes: int, block_size: int) -> int:
    if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, (int, float)):
        raise ValueError(f"kv_cache_memory must be a number of bytes, got {kv_cache_memory!r}")
    if not kv_cache_memory >= block_bytes:  # also refuses NaN
        raise ValueError(f"kv_cache_memory={kv_cache_memory!r} bytes is less than one KV block ({block_bytes} bytes "
                         f"= {block_size} tokens x {block_bytes // block_size} bytes per token). kv_cache_memory is in "
                         f"bytes: for 4 GiB pass 4 * 2**30; or give num_blocks= instead.")
    if kv_cache_memory == float("inf"):
        raise ValueError("kv_cache_memory=inf: give a finite number of bytes (or num_blocks=)")
    return int(kv_cache_memory)


def check_utilization(utilization: object) -> None:
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
