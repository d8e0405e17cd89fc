"""How each model family is routed through flashpage.

Most decoders call ``ALL_ATTENTION_FUNCTIONS.get_interface(...)``: the generic path (registered
attention function on the pages) covers them, including their extra kwargs (``sliding_window``,
Gemma2's ``softcap``, GPT-OSS's ``s_aux`` sinks). A family needs an adapter module only when it
bypasses that interface or caches something other than per-head K/V; those modules register a
:class:`FamilySpec` here. ``legacy.py`` adapts the models that compute attention inline (GPT-Neo,
GPT-NeoX-Japanese, BLOOM, MPT, Falcon, XGLM): their own projections, attention on the pages.

Models whose attention receives K/V other than the cache returned (MLA latents expanded after the
cache, see ``deepseek.py``; DiffLlama; JetMoE) are recognised by ``checks.py`` at patch time, by what
they do, and go to the dense view: no per-type registration.

GPT-NeoX calls ``cache.update`` without ``kwargs``: flashpage plans each forward from a hook and
finds the cache through the module, never through ``kwargs``, so it needs no adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FamilySpec:
    """Routing for one ``config.model_type``.

    Attributes:
        model_type: transformers' ``model_type``.
        path: "interface" (attention on the pages), "adapter" (the model's attention modules get a
            forward that runs attention on the pages, ``legacy.py``) or "dense-view" (the model's own
            attention, or an attention over expanded latents, reads the pages gathered back in its layout).
        set_attention: whether patching selects flashpage's attention implementation.
        note: what the adapter does and why.
        install: ``model -> [(object, attribute, previous value)]``: changes ``patch`` makes to the
            model's modules (``unpatch`` restores them; ``legacy.ABSENT``: delete the attribute).
    """

    model_type: str
    path: str
    set_attention: bool
    note: str
    install: Callable[[Any], list[tuple[Any, str, Any]]] | None = None

    @property
    def on_pages(self) -> bool:
        """Whether attention runs on the pages (what ``flashpage.LLM`` needs)."""
        return self.path in ("interface", "adapter")


GENERIC = FamilySpec("*", "interface", True, "attention interface; K/V in pages, paged kernels")
_FAMILIES: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> FamilySpec:
    """Record a family adapter (called by the family modules at import)."""
    _FAMILIES[spec.model_type] = spec
    return spec


def family_for(model_type: str) -> FamilySpec:
    """The spec for ``model_type`` (the generic one when no adapter exists)."""
    from flashpage.patches import gpt_oss, legacy  # noqa: F401  (register adapters)

    return _FAMILIES.get(model_type, GENERIC)


def known_families() -> dict[str, FamilySpec]:
    """Every family with an adapter module."""
    family_for("")
    return dict(_FAMILIES)
