"""Kernel layer: flash-attn dispatch and the exact PyTorch reference.

flash_attn_with_kvcache / flash_attn_varlen_func have flash-attn's signatures and semantics
(docs/flash-attn-contract.md) and run flash-attn 3, flash-attn 2 or the PyTorch
reference; store_kv scatters new K/V into the pages; backend_info says which runs and why.
"""

from flashpage.kernels.dispatch import (
    BackendChoice,
    backend_info,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    store_kv,
)

__all__ = [
    "BackendChoice",
    "backend_info",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "store_kv",
]
