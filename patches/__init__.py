"""HuggingFace patches (the repository's ``patches/`` folder, shipped as ``flashpage.patches``).

``patch(model)`` routes a transformers causal LM's attention through flashpage's paged KV
cache and makes ``generate()`` use it; ``unpatch`` undoes it; ``patched`` scopes it.

Importing this package checks the installed transformers (:mod:`flashpage.patches.compat`) and
nothing more: the names below that need transformers' modeling code are imported on first use,
so the version check (which every ``flashpage`` command runs) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashpage.lazy import lazy_names
from flashpage.patches.compat import UnsupportedTransformersError, require_supported_transformers, returned_cache

require_supported_transformers()  # transformers 4.x imports below too, and would fail later and obscurely

if TYPE_CHECKING:
    from flashpage.patches.attention import ATTN_NAME
    from flashpage.patches.hf_cache import HFPagedCache, MemoryStats
    from flashpage.patches.patching import UnsupportedModelError, is_patched, patch, patched, unpatch

_LAZY = {
    "ATTN_NAME": "flashpage.patches.attention",
    "HFPagedCache": "flashpage.patches.hf_cache",
    "MemoryStats": "flashpage.patches.hf_cache",
    **{name: "flashpage.patches.patching"
       for name in ("UnsupportedModelError", "is_patched", "patch", "patched", "unpatch")},
}

__all__ = ["ATTN_NAME", "HFPagedCache", "MemoryStats", "UnsupportedModelError", "UnsupportedTransformersError",
           "is_patched", "patch", "patched", "returned_cache", "unpatch"]

# a transformers without the APIs flashpage uses fails these imports: name the supported range instead
__getattr__ = lazy_names(globals(), _LAZY, "flashpage.patches", on_import_error=require_supported_transformers)
