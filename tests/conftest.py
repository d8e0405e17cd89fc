"""Shared fixtures: one torch thread per module (tiny models are faster and reproducible that way,
and CI machines have few cores) and silenced warnings for tests that compare noisy HF runs.

Use them with ``pytestmark = pytest.mark.usefixtures("one_thread", "quiet")``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from engine_helpers import engine_model
from model_zoo import torch_threads

from flashpage.patches import unpatch
from flashpage.tiny import load_tiny_model


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def models() -> Iterator[dict[str, torch.nn.Module]]:
    """A module's models, built on first use by its tests (name -> model) and unpatched at the module's
    end. Files that build a fixed set up front define their own ``models``."""
    built: dict[str, torch.nn.Module] = {}
    yield built
    for m in built.values():
        unpatch(m)


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[torch.nn.Module, object]]:
    """The built-in model and its tokenizer (a module's tests share them; unpatched at the end)."""
    model, tok = load_tiny_model()
    yield model, tok
    unpatch(model)


@pytest.fixture(scope="module")
def model() -> Iterator[torch.nn.Module]:
    """The engine tests' tiny llama (a module's tests share it; unpatched at the end)."""
    m = engine_model()
    yield m
    unpatch(m)


@pytest.fixture
def fresh_backends() -> Iterator[None]:
    """One thread, and flash-attn imported afresh before and after (tests that swap backends)."""
    from flashpage.kernels import dispatch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dispatch.clear_backend_cache()
    yield
    dispatch.clear_backend_cache()
    torch.set_num_threads(threads)
