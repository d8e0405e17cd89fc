"""Which layers of a transformers model read another layer's K/V (KV sharing), from its config.

Gemma 3n and Gemma 4 (``num_kv_shared_layers``) let their last layers reuse the K/V of the last
non-shared layer of the same type (``config.kv_sharing_modes``: ``"reuse"`` readers, ``"store"``
owners, keyed by ``config.layer_types``). Such a reader never calls ``cache.update``; under
flashpage it attends on the owner's pages (``PagedKVCache(shared_layers=...)``).
"""

from __future__ import annotations

from typing import Any


def text_config_of(config: Any) -> Any:
    """The decoder's config (multimodal configs nest it)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def shared_kv_layers(config: Any) -> dict[int, int]:
    """``{reader: owner}`` for layers that reuse another layer's K/V; empty for ordinary models.

    The owner of a ``"reuse"`` layer is the ``"store"`` layer of the same ``layer_types`` entry
    (what the model's ``shared_kv_states[layer_type]`` hands it).
    """
    text = text_config_of(config)
    try:
        modes = getattr(text, "kv_sharing_modes", None)
    except (AttributeError, ValueError, TypeError):  # a config whose property cannot be evaluated
        return {}
    types = getattr(text, "layer_types", None)
    if not modes or types is None or "reuse" not in modes:
        return {}
    owners = {types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    return {i: owners[types[i]] for i, mode in enumerate(modes) if mode == "reuse" and types[i] in owners}
