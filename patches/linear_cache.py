"""The engine's cache for models that demand their own cache class for linear-attention state (MiniMax).

MiniMax's forward refuses any cache that is not its ``MiniMaxCache`` (a ``DynamicCache`` whose
``get_linear_cache`` / ``set_linear_cache`` keep each lightning-attention layer's ``K^T V`` state,
``(B, H, D, D)``). ``patch()`` + ``generate()`` leaves that cache alone; ``flashpage.LLM`` needs pages
for the softmax-attention layers and per-sequence slots for the linear state, so
:func:`engine_cache_class` builds a class that is both an :class:`HFPagedCache` and the model's own
class: K/V go to the pages, the linear states are kept by the cache and handed to the engine's state
slots with the others (``read_states`` / ``load_states``).

xLSTM's own ``xLSTMCache`` is no ``Cache`` at all: a holder of ``rnn_state[layer]`` (a tuple of
``(B, ...)`` tensors the model copies its new states into). The engine's class for it holds those
tensors as its states (zeros for sequences that start in the forward), so they too go through the
state slots; such a model has no attention layer, so its pool has no pages.

A model qualifies by what its own cache class offers (a ``DynamicCache`` subclass in the model's
module with ``get_linear_cache`` and ``set_linear_cache``; or a cache class built from
``(config, max_batch_size)`` that holds an ``rnn_state`` dict), not by its type name.
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


class _RnnStates(HFPagedCache):
    """An own cache class that is a plain holder of per-layer recurrent states (xLSTM's ``xLSTMCache``:
    ``rnn_state[layer]``, a tuple of ``(B, ...)`` tensors the model copies into, and a ``seqlen_offset``),
    stood in for: the states come from the engine's slots (``("rnn", layer, j)``), zeros for sequences
    that start in this forward (one row per row of the planned input)."""

    _own: type
    _dtype: torch.dtype
    _device: torch.device

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._own_config = config
        self._rnn: dict[int, tuple[torch.Tensor, ...]] | None = None
        self.seqlen_offset = torch.tensor([0], dtype=torch.long)

    @property
    def rnn_state(self) -> dict[int, tuple[torch.Tensor, ...]]:
        if self._rnn is None:
            rows = self.plan.layout.rows if self.plan is not None else 1
            self._rnn = self._own(config=self._own_config, max_batch_size=rows, dtype=self._dtype,
                                  device=self._device).rnn_state
        return self._rnn

    @property
    def has_states(self) -> bool:
        return True

    def read_states(self) -> tuple[dict, dict]:
        states, previous = super().read_states()
        for layer, tensors in (self._rnn or {}).items():
            for j, tensor in enumerate(tensors):
                states[("rnn", layer, j)] = tensor
        return states, previous

    def load_states(self, states: dict | None, previous: dict | None = None) -> None:
        own = {k: v for k, v in (states or {}).items() if k[0] == "rnn"}
        super().load_states({k: v for k, v in (states or {}).items() if k[0] != "rnn"}, previous)
        layers = sorted({layer for _, layer, _ in own})
        self._rnn = {layer: tuple(own[("rnn", layer, j)] for j in range(sum(1 for k in own if k[1] == layer)))
                     for layer in layers} if own else None

    def reset(self) -> None:
        super().reset()
        self._rnn = None


def own_rnn_cache_class(model: torch.nn.Module) -> type | None:
    """The model's own cache class when it is a plain holder of ``rnn_state`` per layer (xLSTM's), found by
    building one for a batch of one; None otherwise."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if not callable(supports) or supports():
        return None
    module = sys.modules.get(type(model).__module__)
    for value in vars(module).values() if module is not None else ():
        if not isinstance(value, type) or issubclass(value, Cache) or not value.__name__.endswith("Cache"):
            continue
        try:
            made = value(config=model.config, max_batch_size=1)
        except Exception:  # not a cache built from (config, max_batch_size): not this kind
            continue
        if isinstance(getattr(made, "rnn_state", None), dict):
            return value
    return None


_CLASSES: dict[Any, type] = {}


def engine_cache_class(model: torch.nn.Module) -> type[HFPagedCache]:
    """HFPagedCache, or for a model whose forward demands its own linear-state cache class (MiniMax) a
    class that is both, or for one whose own cache only holds recurrent states (xLSTM) a class that
    holds them as its states (see the module docstring)."""
    own = own_linear_cache_class(model)
    if own is None:
        rnn = own_rnn_cache_class(model)
        if rnn is None:
            return HFPagedCache
        param = next(model.parameters())
        key = (rnn, param.dtype, param.device)
        if key not in _CLASSES:
            _CLASSES[key] = type(f"Paged{rnn.__name__}", (_RnnStates,),
                                 {"_own": rnn, "_dtype": param.dtype, "_device": param.device})
        return _CLASSES[key]
    made = _CLASSES.get(own)
    if made is None:
        def __init__(self: Any, layers: Any = None, **kwargs: Any) -> None:  # noqa: N807
            Cache.__init__(self, layers=layers, **kwargs)  # not the own class's (it would empty the layers)

        shim = type(f"_{own.__name__}Base", (own,), {"__init__": __init__})
        made = _CLASSES[own] = type(f"Paged{own.__name__}", (_LinearStates, shim), {})
    return made
