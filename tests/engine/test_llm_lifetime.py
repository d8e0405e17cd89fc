"""A dropped ``LLM`` (and a patched ``generate()``'s cache) frees its KV pool and packed weights at once.

Python frees an object when its last reference goes, unless it sits in a reference cycle: then only the cyclic
collector frees it, whenever it next runs a full collection, which can be never in a process that allocates
few Python objects. An engine in a cycle kept its pool and its packed weights (3.5 GiB on the Qwen3-0.6B shape
in float32) alive after ``del llm``, so a second ``LLM`` in the same process doubled the memory. These tests run
with the collector off: what they drop must go by reference counting alone.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from flashpage.engine import LLM, SamplingParams
from flashpage.patches import HFPagedCache, is_patched, patch, unpatch
from flashpage.tiny import load_tiny_model, tiny_model_path

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _everything_of(model: torch.nn.Module) -> list[tuple[str, weakref.ref]]:
    """Weak references to every module and parameter of ``model``, named."""
    return ([(name or "model", weakref.ref(m)) for name, m in model.named_modules()]
            + [(name, weakref.ref(p)) for name, p in model.named_parameters()])


def _alive(refs: list[tuple[str, weakref.ref]]) -> list[str]:
    return [name for name, ref in refs if ref() is not None]


def _paged_caches() -> int:
    return sum(isinstance(o, HFPagedCache) for o in gc.get_objects())


@pytest.mark.parametrize("fastpath", ["1", "torch"])
def test_dropped_llm_frees_its_pool_without_the_cyclic_collector(no_cyclic_gc, monkeypatch, fastpath):
    """LLM(path) with the CPU fast path (fused ops, packed linears, flat step) and without it."""
    from flashpage.engine import fastpath as fp

    monkeypatch.setenv(fp.ENV, fastpath)
    caches = _paged_caches()
    llm = LLM(str(tiny_model_path()), num_blocks=16, block_size=16)
    out = llm.generate(["the cat sat on", "once upon a time"], SamplingParams(max_tokens=6, temperature=0.0),
                       use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    refs = {"llm": weakref.ref(llm), "pool": weakref.ref(llm.kv), "cache": weakref.ref(llm._cache),
            "runner": weakref.ref(llm.runner)}
    model = _everything_of(llm.model)
    del llm, out
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert alive == [], f"still alive after del (held in a reference cycle): {alive}"
    assert _paged_caches() == caches
    # a patched model refers to itself (each module's patch state names the root model, the fast path's forwards
    # are bound methods of their modules); the last LLM on a model it loaded takes both off, so every module and
    # weight goes with the engine
    assert _alive(model) == []


def test_a_loaded_model_stays_patched_while_an_llm_runs_on_it(no_cyclic_gc):
    """LLM(llm.model): the second engine keeps the model it shares patched (and running) after the first goes;
    the model goes with the last one. A caller holding llm.model gets it back unpatched, still generating."""
    from flashpage.engine import lifetime

    params = SamplingParams(max_tokens=5, temperature=0.0)
    first = LLM(str(tiny_model_path()), num_blocks=16, block_size=16)
    want = first.generate(["the cat sat on"], params, use_tqdm=False)[0].outputs[0].token_ids
    second = LLM(first.model, first.tokenizer, num_blocks=16, block_size=16)
    model = weakref.ref(first.model)
    parts = _everything_of(first.model)
    assert lifetime.engines_on(first.model) == 2
    del first
    assert is_patched(model()) and lifetime.engines_on(model()) == 1
    assert second.generate(["the cat sat on"], params, use_tqdm=False)[0].outputs[0].token_ids == want
    kept = second.model
    del second
    assert not is_patched(kept) and lifetime.engines_on(kept) == 0
    del kept
    assert model() is None and _alive(parts) == []


def test_dropped_llm_on_a_callers_model_frees_its_pool(no_cyclic_gc):
    """LLM(model) on a model the caller keeps (an RL loop, a bench building one engine per round)."""
    model, tok = load_tiny_model()
    try:
        for _ in range(2):
            llm = LLM(model, tok, num_blocks=16, block_size=16)
            llm.generate(["the cat sat on"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
            refs = [weakref.ref(llm), weakref.ref(llm.kv), weakref.ref(llm.runner)]
            del llm
            assert [r() is None for r in refs] == [True, True, True]
            assert is_patched(model)  # the caller's model: left patched for its next LLM
    finally:
        unpatch(model)


def test_patched_generate_leaves_no_cache_behind(no_cyclic_gc):
    """Each patched generate() builds an HFPagedCache (its own pool); once generate() returns and the caller
    drops the output, the cache and pool are gone."""
    model, tok = load_tiny_model()
    patch(model)
    try:
        ids = tok(["the cat sat on"], return_tensors="pt").input_ids
        caches = _paged_caches()
        for _ in range(2):
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=5, do_sample=False)
            assert out.shape[1] == ids.shape[1] + 5
            del out
            assert _paged_caches() == caches
    finally:
        unpatch(model)


def test_the_heap_is_trimmed_after_the_engine_is_gone(no_cyclic_gc, monkeypatch):
    """A dropped LLM gives the C heap's free pages back (malloc_trim) once its pool, runner and loaded model are
    freed, not before: the tuned malloc would otherwise keep the freed engine's memory (GiBs on a real model)."""
    from flashpage.engine import llm as llm_module

    seen: list[list[str]] = []
    llm = LLM(str(tiny_model_path()), num_blocks=16, block_size=16)
    llm.generate(["the cat sat on"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    refs = [("pool", weakref.ref(llm.kv)), ("runner", weakref.ref(llm.runner)), *_everything_of(llm.model)]
    monkeypatch.setattr(llm_module, "trim_heap", lambda: seen.append(_alive(refs)) or True)
    del llm
    assert seen == [[]]
