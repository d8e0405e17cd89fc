"""Shared fixtures: one torch thread per module (tiny models are faster and reproducible that way,
and CI machines have few cores) and silenced warnings for tests that compare noisy HF runs.

Use them with ``pytestmark = pytest.mark.usefixtures("one_thread", "quiet")``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
from model_zoo import torch_threads


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
