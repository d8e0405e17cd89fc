"""HuggingFace patches (the repository's ``patches/`` folder, shipped as ``flashpage.patches``).

``patch(model)`` routes a transformers causal LM's attention through flashpage's paged KV
cache and makes ``generate()`` use it; ``unpatch`` undoes it; ``patched`` scopes it.
"""

from flashpage.patches.compat import UnsupportedTransformersError, require_supported_transformers, returned_cache

require_supported_transformers()  # transformers 4.x imports below too, and would fail later and obscurely
try:
    from flashpage.patches.attention import ATTN_NAME
    from flashpage.patches.hf_cache import HFPagedCache, MemoryStats
    from flashpage.patches.patching import UnsupportedModelError, is_patched, patch, patched, unpatch
except ImportError:  # a transformers without the APIs flashpage uses: name the supported range instead
    require_supported_transformers()
    raise

__all__ = ["ATTN_NAME", "HFPagedCache", "MemoryStats", "UnsupportedModelError", "UnsupportedTransformersError",
           "is_patched", "patch", "patched", "returned_cache", "unpatch"]
