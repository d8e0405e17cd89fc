"""Positions and logits rows the engine's packed forward gives models that do not take them as asked.

The engine runs every scheduled sequence's new tokens as one row ``input_ids[1, T]`` with explicit
``position_ids[1, T]`` and ``logits_to_keep`` (the rows whose logits it samples). Two kinds of
transformers decoders do not honour that:

- BART-family decoders (bart, mbart, marian, pegasus, plbart, blenderbot(-small), bigbird_pegasus)
  compute their positions as ``arange(T) + cache.get_seq_length()`` and hand those to their
  positional embedding (``embed_positions(..., cache_length, position_ids=...)``), ignoring the
  caller's. Under the engine's cache that is 0 and one length for all packed sequences. A forward
  pre-hook on such an embedding replaces the positions it is given by the engine's, per token.
- Kosmos-2 / Kosmos-2.5 index their sinusoidal table with the positions they are given, counted from
  ``padding_idx + 1`` (their ``generate()`` drops ``position_ids`` so the embedding counts them itself
  that way). A pre-hook gives them the engine's 0-based positions shifted by ``padding_idx + 1``.
- Models whose forward has no ``logits_to_keep`` (whisper's decoder) return logits for every input
  row: :func:`kept_rows` picks the rows the engine asked for.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

_ATTR = "_flashpage_engine_positions"
# parameters of a positional embedding that falls back to the cache's length (transformers' BART family)
_CACHE_DERIVED = ("cache_length", "past_key_values_length")
# positional embeddings whose positions start at padding_idx + 1 and whose models let them count positions
# themselves in generate() (they pop position_ids from the generation inputs)
_PADDING_OFFSET = ("Kosmos2TextSinusoidalPositionalEmbedding", "Kosmos2_5TextSinusoidalPositionalEmbedding")


def _params(module: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def takes_position_ids(model: torch.nn.Module) -> bool:
    """Whether the model or its decoder takes ``position_ids`` itself (then it honours the engine's)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    decoder = decoder if isinstance(decoder, torch.nn.Module) else None
    return "position_ids" in _params(model) or (decoder is not None and "position_ids" in _params(decoder))


def cache_position_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Positional embeddings that take ``position_ids`` next to a cache length (what decoders that
    derive positions from ``cache.get_seq_length()`` call)."""
    found = []
    for module in model.modules():
        params = _params(module)
        if "position_ids" in params and any(p in params for p in _CACHE_DERIVED):
            found.append(module)
    return found


def padding_offset_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Positional embeddings (:data:`_PADDING_OFFSET`) whose position ``p`` is row ``padding_idx + 1 + p``."""
    return [m for m in model.modules()
            if type(m).__name__ in _PADDING_OFFSET and isinstance(getattr(m, "padding_idx", None), int)]


@dataclass
class EnginePositions:
    """Hooks that give cache-derived positional embeddings the engine's positions during a step.

    Attributes:
        current: the step's positions (1, T) long while a step runs, else None (hooks do nothing:
            ``generate()`` and direct calls keep transformers' behaviour).
        handles: the registered hooks (``remove()`` undoes them).
    """

    current: torch.Tensor | None = None
    handles: list[Any] = field(default_factory=list)

    @classmethod
    def install(cls, model: torch.nn.Module) -> EnginePositions | None:
        """Hooks on ``model``'s cache-derived positional embeddings; None when it has none (every
        decoder that takes ``position_ids`` itself: no hook, no cost)."""
        existing = getattr(model, _ATTR, None)
        if existing is not None:  # another LLM on the same model: one set of hooks
            return existing
        offset = padding_offset_modules(model)
        # OPT and every decoder that honours the caller's positions: no hook (but Kosmos' offset tables)
        modules = [] if takes_position_ids(model) else [m for m in cache_position_modules(model) if m not in offset]
        if not modules and not offset:
            return None
        holder = cls()
        for module in modules:
            holder.handles.append(module.register_forward_pre_hook(holder._hook, with_kwargs=True))
        for module in offset:
            holder.handles.append(module.register_forward_pre_hook(holder._offset_hook, with_kwargs=True))
        setattr(model, _ATTR, holder)
        return holder

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        given = kwargs.get("position_ids")
        pos = self.current
        if pos is None:
            return None
        if given is None and "position_ids" not in kwargs and _one_packed_row(args, pos):
            # called with no positions (TrOCR, MVP, RoFormer): it would count from the cache length; the
            # packed row's own positions, in the 1-D (T,) form these embeddings take them
            return args, {**kwargs, "position_ids": pos.reshape(-1)}
        if not isinstance(given, torch.Tensor) or given.numel() != pos.numel():
            return None
        return args, {**kwargs, "position_ids": pos.to(given.device).reshape(given.shape)}

    def _offset_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The step's positions as rows of a table that starts at ``padding_idx + 1`` (grown if they pass its end,
        as the embedding grows it for the cache length it is told, which is 0 under the engine's cache)."""
        pos = self.current
        if pos is None:
            return None
        given = kwargs.get("position_ids")
        if isinstance(given, torch.Tensor) and given.numel() != pos.numel():
            return None
        shifted = pos.to(given.device if isinstance(given, torch.Tensor) else pos.device) + module.padding_idx + 1
        shifted = shifted.reshape(given.shape) if isinstance(given, torch.Tensor) else shifted.reshape(1, -1)
        last = int(shifted.max())
        weights = getattr(module, "weights", None)
        if isinstance(weights, torch.Tensor) and last >= weights.shape[0] and hasattr(module, "make_weights"):
            module.make_weights(last + 1 + getattr(module, "offset", 0), module.embedding_dim, module.padding_idx)
        return args, {**kwargs, "position_ids": shifted}

    @contextmanager
    def step(self, position_ids: torch.Tensor) -> Iterator[None]:
        """Within the block, hooked embeddings see ``position_ids`` (1, T)."""
        self.current = position_ids
        try:
            yield
        finally:
            self.current = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _one_packed_row(args: tuple, pos: torch.Tensor) -> bool:
    """Whether the embedding's first argument (ids, embeddings or their shape) is one row of the step's T tokens."""
    first = args[0] if args else None
    shape = tuple(first.shape) if isinstance(first, torch.Tensor) else tuple(first) if isinstance(first, torch.Size) \
        else None
    return shape is not None and len(shape) >= 2 and shape[0] == 1 and shape[1] == pos.numel()


def honours_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` takes ``logits_to_keep`` (else it returns logits for every row)."""
    return "logits_to_keep" in _params(model)


def kept_rows(logits: torch.Tensor, keep: torch.Tensor, honoured: bool) -> torch.Tensor:
    """The logits rows the step asked for: ``logits`` (T or len(keep), V) -> (len(keep), V)."""
    return logits if honoured else logits.index_select(0, keep.to(logits.device))
