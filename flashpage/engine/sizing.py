"""Sizing the engine's KV pool: geometry from a one-token probe, blocks from a memory budget."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB


@dataclass(frozen=True)
class KVSizing:
    """Geometry and size of a KV pool.

    Attributes:
        num_layers / num_kv_heads / head_dim / v_head_dim / dtype: page geometry per layer.
        layer_devices: device of each layer's pages (its attention's device).
        block_size / num_blocks: page size and count.
        bytes_per_token: K+V bytes of one token over all layers.
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

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token


def probe_geometry(model: Any) -> tuple[int, int, int, int, torch.dtype, list[torch.device]]:
    """Run the (patched) model on one token to learn its KV heads, dims, dtype and layer devices."""
    from flashpage.patches import HFPagedCache

    cache = HFPagedCache(model.config, num_blocks=1, block_size=1, growable=False)
    device = next(model.parameters()).device
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True, **{kwarg: cache})
    kv = cache.kv
    devices = [kv.layer_device(i) or device for i in range(kv.num_layers)]
    return kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.v_head_dim, kv.dtype, devices


def plan_kv_pool(model: Any, device: torch.device, block_size: int, *, num_blocks: int | None,
                 kv_cache_memory: int | None, gpu_memory_utilization: float) -> KVSizing:
    """Decide the pool: ``num_blocks`` if given, else a byte budget (CUDA: a fraction of free memory)."""
    layers, heads, dim, vdim, dtype, devices = probe_geometry(model)
    per_token = layers * heads * (dim + vdim) * torch.empty((), dtype=dtype).element_size()
    if num_blocks is None:
        budget = kv_cache_memory if kv_cache_memory is not None else _default_budget(device, gpu_memory_utilization)
        num_blocks = max(1, budget // (per_token * block_size))
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    return KVSizing(layers, heads, dim, vdim, dtype, devices, block_size, int(num_blocks), per_token)


def _default_budget(device: torch.device, utilization: float) -> int:
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * utilization)
    return DEFAULT_CPU_KV_BYTES
