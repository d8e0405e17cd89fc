"""HuggingFace patches (the repository's ``patches/`` folder, shipped as ``flashpage.patches``).

``patch(model)`` routes a transformers causal LM's attention through flashpage's paged KV
cache and makes ``generate()`` use it; ``unpatch`` undoes it; ``patched`` scopes it.
"""

from flashpage.patches.attention import ATTN_NAME
from flashpage.patches.hf_cache import HFPagedCache, MemoryStats
from flashpage.patches.patching import UnsupportedModelError, is_patched, patch, patched, unpatch

__all__ = ["ATTN_NAME", "HFPagedCache", "MemoryStats", "UnsupportedModelError", "is_patched", "patch",
           "patched", "unpatch"]
