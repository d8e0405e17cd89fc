"""Which ``LLM`` engines run on a model, so that a model an ``LLM`` loaded itself is unpatched when the last goes.

``patch(model)`` gives every module a patch state that names the model, and puts bound methods on the model: a
patched model refers to itself, so only Python's cyclic collector frees it. For a model the caller passed in that
does not matter (the caller holds it, and it stays patched for the caller's next ``LLM``). A model that
``LLM(path)`` loaded belongs to the engines: when the last ``LLM`` running on it goes, :func:`engine_released`
unpatches it, which breaks those cycles, and reference counting frees it at once. Someone still holding
``llm.model`` then holds an ordinary transformers model, which still generates exactly as transformers does.
"""

from __future__ import annotations

import weakref
from typing import Any

from flashpage.patches import is_patched, unpatch

_ENGINES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # model -> live LLMs running on it
_LOADED: weakref.WeakSet[Any] = weakref.WeakSet()  # models an LLM loaded from a path (patched by that LLM)


def hold(engine: object, model: Any, loaded: bool) -> None:
    """Count ``engine`` (an ``LLM``, fully built) as running on ``model``; ``loaded``: ``engine`` loaded ``model``
    itself and patched it. When ``engine`` is freed, :func:`engine_released` runs (not at interpreter exit)."""
    if loaded:
        _LOADED.add(model)
    _ENGINES[model] = _ENGINES.get(model, 0) + 1
    weakref.finalize(engine, engine_released, model).atexit = False


def engines_on(model: Any) -> int:
    """How many live ``LLM`` engines run on ``model``."""
    return _ENGINES.get(model, 0)


def engine_released(model: Any) -> None:
    """One ``LLM`` on ``model`` is gone; the last one unpatches a model an ``LLM`` loaded itself."""
    left = _ENGINES.get(model, 1) - 1
    if left > 0:
        _ENGINES[model] = left
        return
    _ENGINES.pop(model, None)
    if model in _LOADED:
        _LOADED.discard(model)
        if is_patched(model):
            unpatch(model)
