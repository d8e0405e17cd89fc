"""Which ``LLM`` engines run on a model, so that a model an ``LLM`` loaded itself goes when the last one goes.

``patch(model)`` gives every module a patch state that names the model and puts bound methods on the model, and
the CPU fast path gives norms, gated MLPs and linears forwards that are bound methods of their modules: a patched
model refers to itself, so only Python's cyclic collector would free it. For a model the caller passed in that does
not matter (the caller holds it, and it stays patched for the caller's next ``LLM``). A model that ``LLM(path)``
loaded belongs to the engines: :func:`release` by the last ``LLM`` running on it takes the fast path's forwards off
and unpatches it, which breaks those cycles, and reference counting frees it at once. Someone still holding
``llm.model`` then holds an ordinary transformers model, which generates exactly as transformers does.
"""

from __future__ import annotations

import weakref
from typing import Any

from flashpage.engine.fastpath import uninstall_fastpath
from flashpage.engine.linears import uninstall_onednn_linears
from flashpage.patches import unpatch

_ENGINES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # model -> live LLMs running on it
_LOADED: weakref.WeakSet[Any] = weakref.WeakSet()  # models an LLM loaded from a path (patched by that LLM)


def hold(model: Any, loaded: bool) -> None:
    """One more ``LLM`` (fully built) runs on ``model``; ``loaded``: that ``LLM`` loaded ``model`` itself."""
    if loaded:
        _LOADED.add(model)
    _ENGINES[model] = _ENGINES.get(model, 0) + 1


def engines_on(model: Any) -> int:
    """How many live ``LLM`` engines run on ``model``."""
    return _ENGINES.get(model, 0)


def release(model: Any) -> None:
    """One ``LLM`` on ``model`` is gone; the last one hands back a model an ``LLM`` loaded itself unpatched."""
    left = _ENGINES.get(model, 1) - 1
    if left > 0:
        _ENGINES[model] = left
        return
    _ENGINES.pop(model, None)
    if model in _LOADED:
        _LOADED.discard(model)
        uninstall_fastpath(model)
        uninstall_onednn_linears(model)
        unpatch(model)  # a no-op where the caller already unpatched it
