"""Falcon adapter: Falcon computes attention itself (SDPA or eager), never through the interface.

Its K/V still live in pages: the cache returns them gathered back in the padded layout
transformers' own mask expects (``dense_view``), so outputs are exactly the unpatched ones while
the storage is paged (only real tokens, shared blocks under beam search).
"""

from flashpage.patches.families import FamilySpec, register_family

SPEC = register_family(FamilySpec(
    "falcon", "dense-view", False,
    "bypasses the attention interface; K/V kept in pages and read back densely for Falcon's own attention",
))
