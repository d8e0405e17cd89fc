"""The engine's cache for models that demand their own cache class for linear-attention state (MiniMax).

MiniMax's forward refuses any cache that is not its ``MiniMaxCache`` (a ``DynamicCache`` whose
``get_linear_cache`` / ``set_linear_cache`` keep each lightning-attention layer's ``K^T V`` state,
``(B, H, D, D)``). ``patch()`` + ``generate()`` leaves that cache alone; ``flashpage.LLM`` needs pages
for the softmax-attention layers and per-sequence slots for the linear state, so
:func:`engine_cache_class` builds a class that is both an :class:`HFPagedCache` and the model's own
class: K/V go to the pages, the linear states are kept by the cache and handed to the engine's state
slots with the others (``read_states`` / ``load_states``).

A model qualifies by what its own cache class offers (a ``DynamicCache`` subclass in the model's
module with ``get_linear_cache`` and ``set_linear_cache``), not by its type name.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache

from flashpage.patches.hf_cache import HFPagedCache

_METHODS = ("get_linear_cache", "set_linear_cache")


def own_linear_cache_class(model: torch.nn.Module) -> type | None:
    """The model's own ``DynamicCache`` subclass keeping linear-attention state through
    ``get_linear_cache`` / ``set_linear_cache`` (MiniMax's ``MiniMaxCache``), or None."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if not callable(supports) or supports():
        return None
    module = sys.modules.get(type(model).__module__)
    for value in vars(module).values() if module is not None else ():
        if isinstance(value, type) and issubclass(value, DynamicCache) and all(hasattr(value, m) for m in _METHODS):
            return value
    return None


class _LinearStates(HFPagedCache):
    """``get_linear_cache`` / ``set_linear_cache`` on an HFPagedCache: one ``(B, ...)`` state per layer,
    carried by ``read_states`` / ``load_states`` as ``("linear", "recurrent", layer)``."""

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self._linear_states().get(layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self._linear_states()[layer_idx] = linear_cache

    def _linear_states(self) -> dict[int, torch.Tensor]:
        states = vars(self).get("_linear")
        if states is None:
            states = self._linear = {}
        return states

    def read_states(self) -> tuple[dict, dict]:
        states, previous = super().read_states()
        for layer, tensor in self._linear_states().items():
            states[("linear", "recurrent", layer)] = tensor
        return states, previous

    def load_states(self, states: dict | None, previous: dict | None = None) -> None:
        own = {k: v for k, v in (states or {}).items() if k[0] == "linear"}
        super().load_states({k: v for k, v in (states or {}).items() if k[0] != "linear"}, previous)
        self._linear = {layer: tensor for (_, _, layer), tensor in own.items()}

    @property
    def has_states(self) -> bool:
        return True

    def reset(self) -> None:
        super().reset()
        self._linear = {}

    def __len__(self) -> int:
        return len(self.layers)


_CLASSES: dict[type, type] = {}


def engine_cache_class(model: torch.nn.Module) -> type[HFPagedCache]:
    """HFPagedCache, or for a model whose forward demands its own linear-state cache class (MiniMax) a
    class that is both (see the module docstring)."""
    own = own_linear_cache_class(model)
    if own is None:
        return HFPagedCache
    made = _CLASSES.get(own)
    if made is None:
        def __init__(self: Any, layers: Any = None, **kwargs: Any) -> None:  # noqa: N807
            Cache.__init__(self, layers=layers, **kwargs)  # not the own class's (it would empty the layers)

        shim = type(f"_{own.__name__}Base", (own,), {"__init__": __init__})
        made = _CLASSES[own] = type(f"Paged{own.__name__}", (_LinearStates, shim), {})
    return made
