"""Module attributes imported on first use (PEP 562 ``__getattr__``), so importing a package stays light.

``flashpage``, ``flashpage.engine`` and ``flashpage.patches`` name their heavy exports (``LLM``, ``patch``:
transformers' modeling code) in a table of ``name -> module`` and set ``__getattr__ = lazy_names(...)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(namespace: dict[str, Any], table: dict[str, str], owner: str,
               on_import_error: Callable[[], None] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``owner`` (its ``globals()`` as ``namespace``): a name in ``table`` is
    imported from its module on first use and kept in ``namespace``; any other name raises AttributeError.
    ``on_import_error`` runs before an ImportError propagates (to raise a clearer error instead)."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {owner!r} has no attribute {name!r}")
        try:
            value = getattr(importlib.import_module(module), name)
        except ImportError:
            if on_import_error is not None:
                on_import_error()
            raise
        namespace[name] = value
        return value

    return __getattr__
