"""flashpage: a paged KV cache in flash-attn's layout for HuggingFace causal LMs.

Layers (each usable alone): kernels (``flash_attn_with_kvcache``, ``flash_attn_varlen_func``,
``store_kv``), the cache manager (``BlockManager``, ``PagedKVCache``), the HuggingFace patches
(``patch``, ``HFPagedCache``) and the engine (``LLM``, ``SamplingParams``). Names that need
transformers are imported on first use, so ``import flashpage`` stays light.
"""

from __future__ import annotations

from flashpage.blocks import BlockManager, BlockStats
from flashpage.cache import KVGroup, LayerGeometry, PagedKVCache, StepPlan, default_block_size
from flashpage.errors import (
    CapacityError,
    FlashpageError,
    InvariantError,
    KernelInputError,
    NoFreeBlocksError,
    UnknownSequenceError,
)
from flashpage.kernels import backend_info, flash_attn_varlen_func, flash_attn_with_kvcache, store_kv
from flashpage.lazy import lazy_names
from flashpage.tiny import tiny_model_path

__version__ = "0.1.0"

_LAZY = {
    "patch": "flashpage.patches", "unpatch": "flashpage.patches", "patched": "flashpage.patches",
    "is_patched": "flashpage.patches", "HFPagedCache": "flashpage.patches", "MemoryStats": "flashpage.patches",
    "UnsupportedModelError": "flashpage.patches", "returned_cache": "flashpage.patches",
    "LLM": "flashpage.engine", "SamplingParams": "flashpage.engine", "RequestOutput": "flashpage.engine",
    "CompletionOutput": "flashpage.engine", "StreamOutput": "flashpage.engine", "EngineStats": "flashpage.engine",
    "StructuredOutputsParams": "flashpage.engine",
    "load_tiny_model": "flashpage.tiny", "bind_cpu_threads": "flashpage.cpu_threads",
    "RankDivergence": "flashpage.engine.distributed",
}

__all__ = [
    "BlockManager", "BlockStats", "CapacityError", "FlashpageError", "InvariantError", "KernelInputError",
    "KVGroup", "LayerGeometry", "NoFreeBlocksError", "PagedKVCache", "StepPlan", "UnknownSequenceError", "backend_info",
    "default_block_size", "flash_attn_varlen_func", "flash_attn_with_kvcache", "store_kv", "tiny_model_path",
    *_LAZY,
]

__getattr__ = lazy_names(globals(), _LAZY, "flashpage")
