"""Dispatch tests: the real dispatcher driven onto strict fake flash-attn modules on CPU.

Shows that eligible calls reach flash-attn (keyword arguments, int32 indices, checks passed) and
agree with the reference; that ineligible calls fall back with the right reason; that import
failures never escape; and that invalid inputs raise clear errors on both paths.
"""

from __future__ import annotations

import sys

import pytest
import torch
from fake_flash_attn import make_fake_fa2, make_fake_fa3

from flashpage.errors import CapacityError, KernelInputError
from flashpage.kernels import (
    backend_info,
    dispatch,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    store_kv,
)


@pytest.fixture(autouse=True)
def _fresh_imports():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: worker threads only add contention on a shared machine
    dispatch.clear_backend_cache()
    yield
    dispatch.clear_backend_cache()
    torch.set_num_threads(threads)


def _kvcache_case(
    dtype=torch.float16,
    page=256,
    batch=2,
    seqlen_q=2,
    new=1,
    heads=4,
    kv_heads=2,
    dim=32,
    blocks_per_seq=2,
    seed=0,
):
    g = torch.Generator().manual_seed(seed)
    nb = batch * blocks_per_seq + 1
    k_cache = torch.randn(nb, page, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(nb, page, kv_heads, dim, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    cap = blocks_per_seq * page
    lengths = torch.randint(0, cap - new + 1, (batch,), generator=g).to(torch.int32)
    return dict(
        q=torch.randn(batch, seqlen_q, heads, dim, generator=g).to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        k=torch.randn(batch, new, kv_heads, dim, generator=g).to(dtype),
        v=torch.randn(batch, new, kv_heads, dim, generator=g).to(dtype),
        cache_seqlens=lengths,
        block_table=table,
    )


def _varlen_case(dtype=torch.float16, page=256, paged=True, seed=0, heads=4, kv_heads=2, dim=32):
    g = torch.Generator().manual_seed(seed)
    seq_q, seq_k = [1, 5, 3], [7, 300, 40]
    cu_q = torch.tensor([0, 1, 6, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 307, 347], dtype=torch.int32)
    q = torch.randn(sum(seq_q), heads, dim, generator=g).to(dtype)
    case = dict(q=q, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(seq_q), max_seqlen_k=max(seq_k))
    if paged:
        per_seq = -(-max(seq_k) // page)
        nb = 3 * per_seq + 2
        case["k"] = torch.randn(nb, page, kv_heads, dim, generator=g).to(dtype)
        case["v"] = torch.randn(nb, page, kv_heads, dim, generator=g).to(dtype)
        case["block_table"] = torch.randperm(nb, generator=g)[: 3 * per_seq].view(3, per_seq).to(torch.int32)
    else:
        case["k"] = torch.randn(sum(seq_k), kv_heads, dim, generator=g).to(dtype)
        case["v"] = torch.randn(sum(seq_k), kv_heads, dim, generator=g).to(dtype)
    return case


def _clone(case: dict) -> dict:
    return {key: val.clone() if isinstance(val, torch.Tensor) else val for key, val in case.items()}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-5)
    finite = torch.isfinite(b)
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    assert (a.double()[finite] - b.double()[finite]).abs().max().item() <= tol


def _extra(variant: str, heads: int, cap: int, dtype: torch.dtype) -> dict:
    if variant == "causal_alibi":
        return dict(causal=True, alibi_slopes=torch.rand(heads))
    if variant == "rotary_window":
        ang = torch.rand(cap, 8, generator=torch.Generator().manual_seed(3)) * 6
        return dict(
            rotary_cos=ang.cos().to(dtype),
            rotary_sin=ang.sin().to(dtype),
            window_size=(100, 0),
            rotary_interleaved=False,
        )
    if variant == "softcap":
        return dict(softcap=5.0, softmax_scale=0.3)
    return {}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", ["plain", "causal_alibi", "rotary_window", "softcap"])
def test_fa2_kvcache_reaches_fake_and_matches_reference(dtype, variant):
    case = _kvcache_case(dtype)
    extra = _extra(variant, 4, 512, dtype)
    fake = make_fake_fa2()
    a, b = _clone(case), _clone(case)
    with dispatch.force_backend("fa2", fake):
        out_fa, lse_fa = flash_attn_with_kvcache(**a, **extra, return_softmax_lse=True)
    out_ref, lse_ref = flash_attn_with_kvcache(**b, **extra, return_softmax_lse=True)
    assert [name for name, _ in fake.calls] == ["flash_attn_with_kvcache"]
    summary = fake.calls[0][1]
    assert summary["cache_seqlens"] == ((2,), "int32") and summary["block_table"][1] == "int32"
    _close(out_fa, out_ref, dtype)
    _close(lse_fa, lse_ref, dtype)
    assert torch.equal(a["v_cache"], b["v_cache"])
    if "rotary_cos" not in extra:
        assert torch.equal(a["k_cache"], b["k_cache"])
    else:
        _close(a["k_cache"], b["k_cache"], dtype)


@pytest.mark.parametrize("paged", [True, False])
def test_fa2_varlen_reaches_fake_and_matches_reference(paged):
    case = _varlen_case(torch.bfloat16, paged=paged)
    fake = make_fake_fa2()
    with dispatch.force_backend("fa2", fake):
        out_fa, lse_fa, none = flash_attn_varlen_func(**case, causal=True, return_attn_probs=True)
    out_ref, lse_ref, _ = flash_attn_varlen_func(**case, causal=True, return_attn_probs=True)
    assert none is None and [name for name, _ in fake.calls] == ["flash_attn_varlen_func"]
    assert fake.calls[0][1]["dropout_p"] == 0.0
    _close(out_fa, out_ref, torch.bfloat16)
    _close(lse_fa, lse_ref, torch.bfloat16)


def test_fa3_takes_any_page_size_with_page_table():
    case = _kvcache_case(torch.float16, page=16, blocks_per_seq=6)
    fake = make_fake_fa3()
    a, b = _clone(case), _clone(case)
    with dispatch.force_backend("fa3", fake):
        out_fa = flash_attn_with_kvcache(**a, causal=True)
        info = backend_info(device="cpu", dtype=torch.float16, block_size=16)
    out_ref = flash_attn_with_kvcache(**b, causal=True)
    assert info["flash_attn_with_kvcache"].name == "fa3"
    name, summary = fake.calls[0]
    assert name == "flash_attn_with_kvcache" and "page_table" in summary and "block_table" not in summary
    _close(out_fa, out_ref, torch.float16)
    assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])


@pytest.mark.parametrize("paged", [True, False])
def test_fa3_varlen(paged):
    case = _varlen_case(torch.float16, page=16, paged=paged)
    fake = make_fake_fa3()
    with dispatch.force_backend("fa3", fake):
        out_fa, lse_fa, _ = flash_attn_varlen_func(**case, return_attn_probs=True)
    out_ref, lse_ref, _ = flash_attn_varlen_func(**case, return_attn_probs=True)
    name, summary = fake.calls[0]
    if paged:  # FA3's paged varlen is flash_attn_with_kvcache(q_packed, page_table=, cu_seqlens_q=)
        assert name == "flash_attn_with_kvcache" and summary["cu_seqlens_q"][1] == "int32"
        assert summary["cache_seqlens"] == ((3,), "int32")
    else:
        assert name == "flash_attn_varlen_func"
    _close(out_fa, out_ref, torch.float16)
    _close(lse_fa, lse_ref, torch.float16)


def test_ineligible_inputs_fall_back_with_reason():
    fake = make_fake_fa2()
    with dispatch.force_backend("fa2", fake):
        flash_attn_with_kvcache(**_kvcache_case(torch.float16, page=16, blocks_per_seq=3))
        flash_attn_with_kvcache(**_kvcache_case(torch.float32))
        flash_attn_with_kvcache(**_kvcache_case(torch.float16), s_aux=torch.zeros(4))
        flash_attn_varlen_func(**_varlen_case(torch.float16, page=16))
        info16 = backend_info(device="cpu", dtype=torch.float16, block_size=16)
        info32 = backend_info(device="cpu", dtype=torch.float32, block_size=256)
        sink = dispatch.explain(
            "flash_attn_with_kvcache", device="cpu", dtype=torch.float16, block_size=256, s_aux=True
        )
        ok = backend_info(device="cpu", dtype=torch.bfloat16, block_size=512)
    assert fake.calls == []
    for entry in ("flash_attn_with_kvcache", "flash_attn_varlen_func"):
        assert info16[entry] == dispatch.BackendChoice(
            "reference",
            "cpp: fused C++ paged-attention kernel (the PyTorch reference for what it does not take); "
            "block_size 16 not supported by flash-attn 2 (needs a multiple of 256); "
            "use block_size=256 or install flash-attn 3",
        )
        assert info32[entry].name == "reference" and "dtype float32 not supported" in info32[entry].reason
        assert ok[entry].name == "fa2"
    assert sink.name == "reference" and "s_aux" in sink.reason
    assert backend_info()["store_kv"].name == "torch"


def test_fa3_without_alibi_support_falls_back():
    fake = make_fake_fa3()
    with dispatch.force_backend("fa3", fake):
        flash_attn_with_kvcache(**_kvcache_case(torch.float16, page=16, blocks_per_seq=6), alibi_slopes=torch.rand(4))
        why = dispatch.explain("flash_attn_with_kvcache", device="cpu", dtype=torch.float16, alibi=True)
    assert fake.calls == [] and "ALiBi is not supported by flash-attn 3" in why.reason


def test_missing_flash_attn_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    info = backend_info(device="cuda", dtype=torch.float16, block_size=256)
    reason = info["flash_attn_with_kvcache"].reason
    assert info["flash_attn_with_kvcache"].name == "reference"
    assert reason.startswith("reference: flash-attn not importable: ") and "flash-attn 3 not importable" in reason


@pytest.mark.parametrize(
    "body, expected",
    [
        ("import flash_attn_2_cuda\n", "flash-attn not importable: No module named 'flash_attn_2_cuda'"),
        (
            "raise RuntimeError('CUDA driver too old')\n",
            "flash-attn import failed (broken install?): RuntimeError: CUDA driver too old",
        ),
        ("raise OSError('libcudart.so.12: cannot open shared object file')\n", "OSError: libcudart.so.12"),
        ("__version__ = '2.4.2'\n", "flash-attn 2.4.2 is too old"),
    ],
)
def test_broken_install_never_escapes(tmp_path, monkeypatch, body, expected):
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    (tmp_path / "flash_attn_interface.py").write_text("import flash_attn_3._C\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    info = backend_info(device="cpu", dtype=torch.float16)
    assert info["flash_attn_with_kvcache"].name == "reference"
    assert expected in info["flash_attn_with_kvcache"].reason
    assert "flash-attn 3 not importable: No module named 'flash_attn_3'" in info["flash_attn_varlen_func"].reason
    case = _kvcache_case(torch.float16)
    out = flash_attn_with_kvcache(**case)  # still works, on the reference
    assert out.shape == case["q"].shape and not out.isnan().any()


def _mut(**changes):
    def apply(case):
        for key, val in changes.items():
            case[key] = val(case) if callable(val) else val
        return case

    return apply


KVCACHE_BAD = [
    ("q/cache dtype mismatch", _mut(q=lambda c: c["q"].to(torch.bfloat16)), "must share one dtype"),
    ("integer q", _mut(q=lambda c: c["q"].to(torch.int32)), "not supported"),
    ("int64 block_table", _mut(block_table=lambda c: c["block_table"].long()), "block_table.to(torch.int32)"),
    (
        "int64 cache_seqlens",
        _mut(cache_seqlens=lambda c: c["cache_seqlens"].long()),
        "cache_seqlens.to(torch.int32)",
    ),
    ("heads do not divide", _mut(q=lambda c: c["q"][:, :, :3].contiguous()), "must divide"),
    (
        "capacity overflow",
        _mut(cache_seqlens=lambda c: torch.full((2,), 512, dtype=torch.int32)),
        "give the sequence more blocks in block_table",
    ),
    ("python int seqlens with block_table", _mut(cache_seqlens=3), "pass a (B,) int32 tensor"),
    (
        "head dim 300",
        _mut(
            q=lambda c: torch.zeros(2, 2, 4, 300, dtype=c["q"].dtype),
            k_cache=lambda c: torch.zeros(5, 256, 2, 300, dtype=c["q"].dtype),
            v_cache=lambda c: torch.zeros(5, 256, 2, 300, dtype=c["q"].dtype),
            k=None,
            v=None,
        ),
        "larger than 256",
    ),
    (
        "cache_leftpad with block_table",
        _mut(cache_leftpad=lambda c: torch.zeros(2, dtype=torch.int32)),
        "does not support cache_leftpad",
    ),
    (
        "cache_batch_idx with block_table",
        _mut(cache_batch_idx=lambda c: torch.arange(2, dtype=torch.int32)),
        "does not support cache_batch_idx",
    ),
    ("k without v", _mut(v=None), "k and v must be given together"),
    ("k without cache_seqlens", _mut(cache_seqlens=None), "cache_seqlens must also be passed"),
    (
        "rotary without k",
        _mut(
            k=None,
            v=None,
            rotary_cos=lambda c: torch.ones(512, 8, dtype=c["q"].dtype),
            rotary_sin=lambda c: torch.zeros(512, 8, dtype=c["q"].dtype),
        ),
        "new key / value to be appended",
    ),
    (
        "rotary dim 8",
        _mut(
            rotary_cos=lambda c: torch.ones(512, 4, dtype=c["q"].dtype),
            rotary_sin=lambda c: torch.zeros(512, 4, dtype=c["q"].dtype),
        ),
        "divisible by 16",
    ),
    (
        "rotary table too short",
        _mut(
            rotary_cos=lambda c: torch.ones(100, 8, dtype=c["q"].dtype),
            rotary_sin=lambda c: torch.zeros(100, 8, dtype=c["q"].dtype),
        ),
        "at least the seqlen of the KV cache",
    ),
    ("fp16 alibi", _mut(alibi_slopes=lambda c: torch.ones(4, dtype=torch.float16)), "alibi_slopes.float()"),
    (
        "block id past the pool",
        _mut(block_table=lambda c: torch.full((2, 2), 5, dtype=torch.int32)),
        "is not a block id in [0, 5)",
    ),
    (
        "strided q",
        _mut(q=lambda c: c["q"].transpose(-1, -2).contiguous().transpose(-1, -2)),
        "contiguous last dimension",
    ),
    ("k batch mismatch", _mut(k=lambda c: c["k"][:1], v=lambda c: c["v"][:1]), "(B, Sn, Hk, D)"),
    ("v_cache shape", _mut(v_cache=lambda c: c["v_cache"][:, :, :1]), "(NB, P, Hk, D)"),
]

VARLEN_BAD = [
    ("dropout", _mut(dropout_p=0.1), "dropout_p must be 0"),
    (
        "int64 cu_seqlens_q",
        _mut(cu_seqlens_q=lambda c: c["cu_seqlens_q"].long()),
        "cu_seqlens_q.to(torch.int32)",
    ),
    (
        "capacity overflow",
        _mut(block_table=lambda c: c["block_table"][:, :1].contiguous()),
        "give the sequence more blocks in block_table",
    ),
    ("max_seqlen_k too small", _mut(max_seqlen_k=10), "max_seqlen_k = 10 is smaller"),
    ("block_table batch", _mut(block_table=lambda c: c["block_table"][:2]), "block_table must have shape"),
    (
        "q/k dtype mismatch",
        _mut(k=lambda c: c["k"].float(), v=lambda c: c["v"].float()),
        "must share one dtype",
    ),
]


@pytest.mark.parametrize("path", ["reference", "fa2"])
@pytest.mark.parametrize("name, mutate, message", KVCACHE_BAD, ids=[c[0] for c in KVCACHE_BAD])
def test_invalid_kvcache_inputs_raise(path, name, mutate, message):
    case = mutate(_kvcache_case(torch.float16))
    fake = make_fake_fa2()
    expected = CapacityError if "capacity" in name else KernelInputError
    if path == "fa2":
        with dispatch.force_backend("fa2", fake), pytest.raises(expected) as info:
            flash_attn_with_kvcache(**case)
    else:
        with pytest.raises(expected) as info:
            flash_attn_with_kvcache(**case)
    assert message in str(info.value) and fake.calls == []
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("path", ["reference", "fa2"])
@pytest.mark.parametrize("name, mutate, message", VARLEN_BAD, ids=[c[0] for c in VARLEN_BAD])
def test_invalid_varlen_inputs_raise(path, name, mutate, message):
    case = mutate(_varlen_case(torch.float16))
    fake = make_fake_fa2()
    expected = CapacityError if "capacity" in name else KernelInputError
    if path == "fa2":
        with dispatch.force_backend("fa2", fake), pytest.raises(expected) as info:
            flash_attn_varlen_func(**case)
    else:
        with pytest.raises(expected) as info:
            flash_attn_varlen_func(**case)
    assert message in str(info.value) and fake.calls == []


def test_capacity_error_names_sequence_and_numbers():
    case = _kvcache_case(torch.float16)
    case["cache_seqlens"] = torch.tensor([3, 512], dtype=torch.int32)
    with pytest.raises(CapacityError, match=r"sequence 1 .*512 plus 1 new token\(s\) = 513 > 512"):
        flash_attn_with_kvcache(**case)


def test_store_kv_skips_minus_one_and_validates():
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv(k_cache, v_cache, k, v, torch.tensor([5, -1, 0], dtype=torch.int32))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[0, 0], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2
    store_kv(k_cache, v_cache, k, v, torch.tensor([-1, -1, -1]))  # nothing stored, nothing changed
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2
    with pytest.raises(KernelInputError, match="slot_mapping values"):
        store_kv(k_cache, v_cache, k, v, torch.tensor([12, 0, 1]))
    with pytest.raises(KernelInputError, match="dtype"):
        store_kv(k_cache, v_cache, k.half(), v.half(), torch.tensor([1, 0, 2]))


def test_force_reference_and_bad_name():
    fake = make_fake_fa2()
    with dispatch.force_backend("fa2", fake):
        with dispatch.force_backend("reference", None):
            flash_attn_with_kvcache(**_kvcache_case(torch.float16))
            info = backend_info(device="cpu", dtype=torch.float16, block_size=256)
        assert fake.calls == [] and info["flash_attn_with_kvcache"].name == "reference"
        assert "disabled by force_backend('reference')" in info["flash_attn_with_kvcache"].reason
        flash_attn_with_kvcache(**_kvcache_case(torch.float16))  # the outer force is back
    assert len(fake.calls) == 1
    with pytest.raises(ValueError, match="'fa2', 'fa3', 'fa4' or 'reference'"):
        with dispatch.force_backend("fa5", fake):
            pass


def test_python_int_cache_seqlens_reaches_flash_attn_as_int32_tensor():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 4, 32, generator=g).half()
    k_cache = torch.randn(2, 40, 2, 32, generator=g).half()
    v_cache = torch.randn(2, 40, 2, 32, generator=g).half()
    k, v = torch.randn(2, 1, 2, 32, generator=g).half(), torch.randn(2, 1, 2, 32, generator=g).half()
    fake = make_fake_fa2()
    a = dict(k_cache=k_cache.clone(), v_cache=v_cache.clone())
    with dispatch.force_backend("fa2", fake):
        out_fa = flash_attn_with_kvcache(q, **a, k=k, v=v, cache_seqlens=7, causal=True)
    b = dict(k_cache=k_cache.clone(), v_cache=v_cache.clone())
    out_ref = flash_attn_with_kvcache(q, **b, k=k, v=v, cache_seqlens=7, causal=True)
    assert fake.calls[0][1]["cache_seqlens"] == ((2,), "int32")
    _close(out_fa, out_ref, torch.float16)
    assert torch.equal(a["v_cache"], b["v_cache"]) and torch.equal(b["v_cache"][:, 7], v[:, 0])
