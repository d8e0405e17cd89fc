"""DeepSeek-V2/V3 adapter: multi-head latent attention (MLA).

These models cache the compressed latent (``kv_nope``, kv_lora_rank wide, one "head") and the
shared rotary key (``k_rot``) and expand them to per-head K/V after the cache. The pages hold
the latents (the memory saving MLA exists for: one latent row per token instead of H heads of K
and V); ``update`` returns them gathered back (``dense_view``) and the attention runs on the
expanded K/V through flashpage's dense varlen path (value head dim padded to the key's, like
transformers' flash path).
"""

from flashpage.patches.families import FamilySpec, register_family

NOTE = "MLA: compressed latents in pages, expanded after the cache; attention via the dense varlen kernel"
SPECS = [register_family(FamilySpec(t, "dense-view", True, NOTE)) for t in ("deepseek_v2", "deepseek_v3")]
