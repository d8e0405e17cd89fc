"""flash-attn's own kernel tests, run on flashpage's reference (CPU, float64).

``test_flash_attn_kvcache`` and the paged cases of ``test_flash_attn_varlen_causal`` come from
flash-attn's ``tests/test_flash_attn.py`` as its newest PyPI sdist ships it (2.8.3.post2, fetched
once by tests/flash_standins.py; tests/flash_tests_loader.py loads it unchanged): their
``attention_ref`` and their rules ("flash-attn's error is at most 3x (5x with ALiBi, 2x for
varlen) the error of a PyTorch implementation, + 1e-5"; the appended v_cache is bit-identical).
In float64 the rule is meaningful: ``attention_ref(upcast=True)`` computes in fp32, so the PyTorch
baseline error is not 0. Their grids are subsampled with a fixed seed, keeping every value of every
axis; key lengths above 2048 (kvcache) / 800 (varlen) are left out (CPU time), as are the
combinations their own test skips.
"""

from __future__ import annotations

import flash_standins as fs
import pytest
import torch

from flashpage.kernels import dispatch


def _kvcache_ok(c: dict) -> bool:
    paged = c["paged_kv_block_size"] is not None
    return not ((c["seqlen_q"] > c["seqlen_k"] and c["new_kv"]) or (not c["new_kv"] and c["rotary_fraction"] > 0)
                or (c["has_batch_idx"] and paged) or (c["has_leftpad"] and paged) or c["seqlen_k"] > 2048)


def _varlen_ok(c: dict) -> bool:
    return c["paged_kv_block_size"] is not None and max(c["seqlen_q"], c["seqlen_k"]) <= 800


def _cases(name: str, n: int, keep) -> list:
    """The sampled grid of flash-attn's test ``name``; one skipped case naming what is missing when
    flash-attn's test file cannot be had (collection needs it to know the grid)."""
    why = fs.missing(fs.FA2_TESTS)
    if why:
        return [pytest.param({}, id="unavailable", marks=pytest.mark.skip(reason=f"flash-attn's tests: {why}"))]
    import flash_tests_loader as loader

    fn = getattr(loader.load(), name)
    return [pytest.param(c, id="-".join(f"{v}" for v in c.values()).replace(" ", ""))
            for c in loader.sample(loader.grid(fn), n, name, keep)]


@pytest.fixture(autouse=True)
def _reference_only():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with dispatch.force_backend("reference", None):
        yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("params", _cases("test_flash_attn_kvcache", 36, _kvcache_ok))
def test_flash_attn_kvcache(params):
    import flash_tests_loader as loader

    loader.load().test_flash_attn_kvcache(**{**params, "dtype": torch.float64})


@pytest.mark.filterwarnings("ignore:flashpage's attention is forward-only")  # their q/k/v require grad
@pytest.mark.parametrize("params", _cases("test_flash_attn_varlen_causal", 14, _varlen_ok))
def test_flash_attn_varlen_causal_paged(params):
    import flash_tests_loader as loader

    loader.load().test_flash_attn_varlen_causal(**{**params, "dtype": torch.float64})


def test_their_rule_catches_a_wrong_kernel(monkeypatch):
    """The ported rule fails when the kernel is off by a little (so a pass above means something)."""
    import flash_tests_loader as loader

    mod = loader.load()
    real = mod.flash_attn_with_kvcache
    monkeypatch.setattr(mod, "flash_attn_with_kvcache", lambda *a, **k: real(*a, **k) * (1 + 1e-4))
    params = next(p.values[0] for p in _cases("test_flash_attn_kvcache", 1, _kvcache_ok)
                  if p.values[0]["seqlen_k"] <= 339 and p.values[0]["d"] <= 64)
    with pytest.raises(AssertionError):
        mod.test_flash_attn_kvcache(**{**params, "dtype": torch.float64})
