"""Bloom adapter: Bloom adds ALiBi inside its own attention and never calls the interface.

Its K/V live in pages and are gathered back in the padded layout Bloom's mask and ALiBi bias
expect (``dense_view``): exact outputs, paged storage.
"""

from flashpage.patches.families import FamilySpec, register_family

SPEC = register_family(FamilySpec(
    "bloom", "dense-view", False,
    "bypasses the attention interface (ALiBi inline); K/V kept in pages and read back densely",
))
