"""GPU checks: the reference on CUDA against the oracle, and real flash-attn against both.

Skipped without CUDA. FLASHPAGE_TEST_DEVICE=cpu runs the same code on CPU (to check the tests
themselves); the flash-attn comparisons additionally need flash-attn importable.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from kernel_oracle import oracle_kvcache, oracle_varlen

from flashpage.kernels import backend_info, dispatch, flash_attn_varlen_func, flash_attn_with_kvcache

DEVICE = os.environ.get("FLASHPAGE_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
HAS_FLASH = any(importlib.util.find_spec(m) is not None for m in ("flash_attn", "flash_attn_interface"))


def _case(dtype, page, seed=0, batch=4, seqlen_q=3, new=2, heads=8, kv_heads=2, dim=128, per_seq=3):
    g = torch.Generator().manual_seed(seed)
    nb = batch * per_seq + 2
    lengths = torch.randint(0, per_seq * page - new + 1, (batch,), generator=g).to(torch.int32)
    table = torch.randperm(nb, generator=g)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    cpu = dict(
        q=torch.randn(batch, seqlen_q, heads, dim, generator=g).to(dtype),
        k_cache=torch.randn(nb, page, kv_heads, dim, generator=g).to(dtype),
        v_cache=torch.randn(nb, page, kv_heads, dim, generator=g).to(dtype),
        k=torch.randn(batch, new, kv_heads, dim, generator=g).to(dtype),
        v=torch.randn(batch, new, kv_heads, dim, generator=g).to(dtype),
        cache_seqlens=lengths,
        block_table=table,
    )
    return cpu


def _to(kw: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _within_rule(out: torch.Tensor, ref: torch.Tensor, ref_dt: torch.Tensor | None, dtype) -> None:
    err = (out.double().cpu() - ref).abs().max().item()
    tol = 2e-5 * (1 + ref.abs().max().item()) if ref_dt is None else 3 * (ref_dt - ref).abs().max().item() + 1e-5
    assert err <= tol, (err, tol)


FEATURES = [
    dict(),
    dict(causal=True),
    dict(causal=True, window_size=(64, 0), softcap=20.0),
    dict(causal=True, alibi_slopes=torch.rand(8) * 0.2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("features", FEATURES, ids=["plain", "causal", "window_softcap", "alibi"])
def test_reference_on_device_matches_oracle(dtype, page, features):
    kw = _case(dtype, page)
    ref, ref_lse, ref_k, ref_v = oracle_kvcache(**{k: v.clone() for k, v in kw.items()}, **features)
    ref_dt = None
    if dtype != torch.float32:
        ref_dt = oracle_kvcache(**{k: v.clone() for k, v in kw.items()}, **features, round_dtype=dtype)[0]
    dev = _to(kw, DEVICE)
    with dispatch.force_backend("reference", None):
        out, lse = flash_attn_with_kvcache(**dev, **_to(features, DEVICE), return_softmax_lse=True)
    assert out.device.type == torch.device(DEVICE).type
    _within_rule(out, ref, ref_dt, dtype)
    assert torch.equal(dev["v_cache"].cpu(), ref_v) and torch.equal(dev["k_cache"].cpu(), ref_k)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse.cpu()))
    assert (lse.cpu().double()[fin] - ref_lse[fin]).abs().max().item() < 2e-3


@pytest.mark.skipif(not HAS_FLASH, reason="flash-attn not installed")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("features", FEATURES, ids=["plain", "causal", "window_softcap", "alibi"])
def test_flash_attn_matches_reference_and_oracle(dtype, features):
    kw = _case(dtype, 256, seed=1)
    info = backend_info(DEVICE, dtype, 256)["flash_attn_with_kvcache"]
    if info.name == "reference":
        pytest.skip(f"flash-attn not usable here: {info.reason}")
    if "alibi_slopes" in features and info.name == "fa3":
        pytest.skip("flash-attn 3 has no ALiBi (goes to the reference)")
    ref, _, _, ref_v = oracle_kvcache(**{k: v.clone() for k, v in kw.items()}, **features)
    ref_dt = oracle_kvcache(**{k: v.clone() for k, v in kw.items()}, **features, round_dtype=dtype)[0]
    fa_kw, ref_kw = _to(kw, DEVICE), _to(kw, DEVICE)
    out_fa, lse_fa = flash_attn_with_kvcache(**fa_kw, **_to(features, DEVICE), return_softmax_lse=True)
    with dispatch.force_backend("reference", None):
        out_ref, lse_ref = flash_attn_with_kvcache(**ref_kw, **_to(features, DEVICE), return_softmax_lse=True)
    _within_rule(out_fa, ref, ref_dt, dtype)
    _within_rule(out_ref, ref, ref_dt, dtype)
    assert torch.equal(fa_kw["v_cache"].cpu(), ref_v) and torch.equal(fa_kw["v_cache"], ref_kw["v_cache"])
    assert torch.equal(fa_kw["k_cache"], ref_kw["k_cache"])
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse_fa))
    assert (lse_fa[fin] - lse_ref[fin]).abs().max().item() < 2e-3


@pytest.mark.skipif(not HAS_FLASH, reason="flash-attn not installed")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_varlen_paged_matches_reference(dtype):
    g = torch.Generator().manual_seed(2)
    seq_q, seq_k = [1, 1, 7, 64], [300, 5, 513, 64]
    cu_q = torch.tensor([0, 1, 2, 9, 73], dtype=torch.int32)
    cu_k = torch.tensor([0, 300, 305, 818, 882], dtype=torch.int32)
    page, per_seq = 256, 3
    nb = 4 * per_seq
    kw = dict(
        q=torch.randn(sum(seq_q), 8, 128, generator=g).to(dtype),
        k=torch.randn(nb, page, 2, 128, generator=g).to(dtype),
        v=torch.randn(nb, page, 2, 128, generator=g).to(dtype),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(seq_q),
        max_seqlen_k=max(seq_k),
        block_table=torch.randperm(nb, generator=g).view(4, per_seq).to(torch.int32),
        causal=True,
    )
    info = backend_info(DEVICE, dtype, page)["flash_attn_varlen_func"]
    if info.name == "reference":
        pytest.skip(f"flash-attn not usable here: {info.reason}")
    ref, _ = oracle_varlen(**kw)
    ref_dt, _ = oracle_varlen(**kw, round_dtype=dtype)
    dev = _to(kw, DEVICE)
    out_fa = flash_attn_varlen_func(**dev)
    with dispatch.force_backend("reference", None):
        out_ref = flash_attn_varlen_func(**dev)
    _within_rule(out_fa, ref, ref_dt, dtype)
    _within_rule(out_ref, ref, ref_dt, dtype)
