"""Property tests of the reference kernels against the independent float64 oracle.

Random shapes (batch 1-8, query 1-33, cached 0-300, block sizes 1/16/256, head dims 32-256, GQA
1/2/4/8 and MQA, fp32/fp16/bf16) and features (causal, windows, softcap, ALiBi, rotary in both
layouts, append, LSE, s_aux). Tolerance: the contract's rule max|out - ref| <= 3 * max|ref_in_dtype
- ref| + 1e-5 for fp16/bf16, a tight absolute bound for fp32. Set FLASHPAGE_HYPOTHESIS_SCALE to run
more (or fewer) examples.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_oracle import oracle_kvcache, oracle_varlen

from flashpage.kernels import cpu_attention, flash_attn_varlen_func, flash_attn_with_kvcache, reference, store_kv

SCALE = float(os.environ.get("FLASHPAGE_HYPOTHESIS_SCALE", "1"))
EXAMPLES: dict[str, int] = {}


def _settings(n: int):
    return settings(
        deadline=None,
        max_examples=max(1, int(n * SCALE)),
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _count(name: str) -> None:
    EXAMPLES[name] = EXAMPLES.get(name, 0) + 1


@pytest.fixture(scope="module", autouse=True)
def _report_examples(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: worker threads only add contention on a shared machine
    yield
    torch.set_num_threads(threads)
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None and EXAMPLES:
        total = sum(EXAMPLES.values())
        detail = ", ".join(f"{k}={v}" for k, v in sorted(EXAMPLES.items()))
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nkernel hypothesis examples run: {total} ({detail})")


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (keys per chunk, score rows per tile): None keeps the defaults; small values force many key
# chunks (online softmax, sequences dropping out) and query-row tiles on small test shapes.
TILINGS = st.sampled_from([(None, None), (None, None), (16, None), (48, 8), (16, 24)])


@contextmanager
def tiling(chunk: int | None, row_tile: int | None):
    """Small reference tilings; any tiling also forces the PyTorch reference over the fused C++ CPU
    kernel (float32 / float64 paged calls take that kernel by default: test_kernels_cpu.py), so both
    CPU paths meet the oracle here."""
    saved = (reference._MIN_CHUNK, reference._MAX_CHUNK, reference._ROW_TILE)
    saved_env = os.environ.get(cpu_attention.ENV)
    if chunk is not None:
        reference._MIN_CHUNK = reference._MAX_CHUNK = chunk
    if row_tile is not None:
        reference._ROW_TILE = row_tile
    if chunk is not None or row_tile is not None:
        os.environ[cpu_attention.ENV] = "reference"
    try:
        yield
    finally:
        reference._MIN_CHUNK, reference._MAX_CHUNK, reference._ROW_TILE = saved
        if saved_env is None:
            os.environ.pop(cpu_attention.ENV, None)
        else:
            os.environ[cpu_attention.ENV] = saved_env


@dataclass
class Case:
    """One drawn flash_attn_with_kvcache configuration (tensors are built from `seed`)."""

    batch: int
    seqlen_q: int
    new: int
    lengths: list[int]
    page: int
    extra_blocks: int
    pad_value: int
    head_dim: int
    kv_heads: int
    group: int
    dtype: torch.dtype
    causal: bool
    window: tuple[int, int]
    softcap: float
    alibi: str
    rotary: str
    rotary_dim: int
    s_aux: bool
    scale: float | None
    seed: int


@st.composite
def cases(draw, max_batch=8, max_q=33, max_cached=300) -> Case:
    batch = draw(st.integers(1, max_batch))
    seqlen_q = draw(st.integers(1, max_q))
    new = draw(st.sampled_from([0, 0, 1, seqlen_q, draw(st.integers(1, max_q))]))
    head_dim = draw(st.sampled_from([32, 64, 80, 128, 256]))
    rotary = draw(st.sampled_from(["none", "interleaved", "neox"])) if new else "none"
    return Case(
        batch=batch,
        seqlen_q=seqlen_q,
        new=new,
        lengths=draw(st.lists(st.integers(0, max_cached), min_size=batch, max_size=batch)),
        page=draw(st.sampled_from([1, 16, 256])),
        extra_blocks=draw(st.integers(0, 2)),
        pad_value=draw(st.sampled_from([0, -1])),
        head_dim=head_dim,
        kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 4, 8])),
        dtype=draw(st.sampled_from(DTYPES)),
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([(-1, -1), (-1, -1), (8, 0), (0, 0), (40, 3), (-1, 5), (17, -1), (1000, 1000)])),
        softcap=draw(st.sampled_from([0.0, 0.0, 2.0, 30.0])),
        alibi=draw(st.sampled_from(["none", "none", "h", "bh"])),
        rotary=rotary,
        rotary_dim=draw(st.sampled_from([d for d in range(16, head_dim + 1, 16)])),
        s_aux=draw(st.booleans()),
        scale=draw(st.sampled_from([None, None, 0.05])),
        seed=draw(st.integers(0, 2**16)),
    )


def build(case: Case) -> dict:
    """Paged-cache kwargs for flash_attn_with_kvcache (cache values in the test dtype)."""
    g = torch.Generator().manual_seed(case.seed)
    dt, heads = case.dtype, case.kv_heads * case.group

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    ends = [n + case.new for n in case.lengths]
    per_seq = -(-max(max(ends), 1) // case.page) + case.extra_blocks
    if case.new:  # flash-attn requires Sq <= cache capacity when appending
        per_seq = max(per_seq, -(-case.seqlen_q // case.page))
    used = [-(-e // case.page) for e in ends]
    num_blocks = sum(used) + 3
    ids = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((case.batch, per_seq), case.pad_value, dtype=torch.int32)
    pos = 0
    for b, u in enumerate(used):
        table[b, :u] = torch.tensor(ids[pos : pos + u], dtype=torch.int32)
        pos += u
    kw = dict(
        q=randn(case.batch, case.seqlen_q, heads, case.head_dim),
        k_cache=randn(num_blocks, case.page, case.kv_heads, case.head_dim),
        v_cache=randn(num_blocks, case.page, case.kv_heads, case.head_dim),
        cache_seqlens=torch.tensor(case.lengths, dtype=torch.int32),
        block_table=table,
        causal=case.causal,
        window_size=case.window,
        softcap=case.softcap,
        softmax_scale=case.scale,
    )
    if case.new:
        kw["k"] = randn(case.batch, case.new, case.kv_heads, case.head_dim)
        kw["v"] = randn(case.batch, case.new, case.kv_heads, case.head_dim)
    if case.alibi != "none":
        shape = (heads,) if case.alibi == "h" else (case.batch, heads)
        kw["alibi_slopes"] = torch.rand(*shape, generator=g) * 0.3
    if case.rotary != "none":
        cap = per_seq * case.page
        inv = 1.0 / (10000 ** (torch.arange(case.rotary_dim // 2) / (case.rotary_dim // 2)))
        ang = torch.arange(cap)[:, None] * inv[None, :]
        kw.update(
            rotary_cos=ang.cos().to(dt),
            rotary_sin=ang.sin().to(dt),
            rotary_interleaved=case.rotary == "interleaved",
        )
    if case.s_aux:
        kw["s_aux"] = torch.randn(heads, generator=g)
    return kw


def _clone(kw: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def out_tolerance(ref: torch.Tensor, ref_dt: torch.Tensor | None, dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 2e-5 * (1.0 + ref.abs().max().item())
    return 3 * (ref_dt - ref).abs().max().item() + 1e-5


def check_lse(lse: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), "rows without keys must give +inf (and only they)"
    assert not lse.isnan().any()
    fin = torch.isfinite(ref)
    if fin.any():
        err = (lse.double()[fin] - ref[fin]).abs() / (1 + ref[fin].abs())
        assert err.max().item() <= (2e-6 if dtype == torch.float32 else 2e-3)


def run_oracles(kw: dict, dtype: torch.dtype):
    ref = oracle_kvcache(**_clone(kw))
    ref_dt = None if dtype == torch.float32 else oracle_kvcache(**_clone(kw), round_dtype=dtype)
    return ref, ref_dt


@_settings(400)
@given(case=cases(), tiles=TILINGS)
def test_kvcache_matches_oracle(case: Case, tiles):
    _count("kvcache")
    kw = build(case)
    (ref, ref_lse, ref_k, ref_v), ref_dt = run_oracles(kw, case.dtype)
    mine = _clone(kw)
    with tiling(*tiles):
        out, lse = flash_attn_with_kvcache(**mine, return_softmax_lse=True)
    assert out.dtype == case.dtype and out.shape == kw["q"].shape and not out.isnan().any()
    err = (out.double() - ref).abs().max().item()
    assert err <= out_tolerance(ref, ref_dt[0] if ref_dt else None, case.dtype), err
    check_lse(lse, ref_lse, case.dtype)
    empty = torch.isinf(ref_lse).permute(0, 2, 1)  # (B, Sq, H)
    assert (out[empty] == 0).all(), "rows without keys must give 0"
    assert torch.equal(mine["v_cache"], ref_v), "appended values must be bit-exact in the pages"
    if case.rotary == "none":
        assert torch.equal(mine["k_cache"], ref_k), "appended keys must be bit-exact in the pages"
    else:  # rotary in fp32 vs the oracle's fp64 may differ by one rounding step
        assert (mine["k_cache"].double() - ref_k.double()).abs().max().item() <= 2**-6
    # without return_softmax_lse a plain tensor comes back, and the call is repeatable
    again = _clone(kw)
    with tiling(*tiles):
        plain = flash_attn_with_kvcache(**again)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


def _dense_from_paged(kw: dict, case: Case, g: torch.Generator) -> dict:
    """The same data laid out in a dense cache (B + 2 rows, S = paged capacity), shuffled batch rows."""
    table, page = kw["block_table"], case.page
    cap = table.shape[1] * page
    rows = torch.randperm(case.batch + 2, generator=g)[: case.batch]
    shape = (case.batch + 2, cap, case.kv_heads, case.head_dim)
    k_dense = torch.randn(*shape, generator=g).to(case.dtype)
    v_dense = torch.randn(*shape, generator=g).to(case.dtype)
    for b in range(case.batch):
        n = case.lengths[b]
        r = torch.arange(n)
        blk = table[b].long()[r // page]
        k_dense[rows[b], :n] = kw["k_cache"][blk, r % page]
        v_dense[rows[b], :n] = kw["v_cache"][blk, r % page]
    dense = dict(kw, k_cache=k_dense, v_cache=v_dense, cache_batch_idx=rows.to(torch.int32))
    del dense["block_table"]
    return dense


@_settings(200)
@given(case=cases(max_batch=5, max_q=17, max_cached=200), tiles=TILINGS)
def test_paged_equals_dense_and_varlen(case: Case, tiles):
    _count("paged_dense_varlen")
    with tiling(*tiles):
        _paged_dense_varlen(case)


def _paged_dense_varlen(case: Case) -> None:
    kw = build(case)
    g = torch.Generator().manual_seed(case.seed + 1)
    dense = _dense_from_paged(kw, case, g)
    paged_kw = _clone(kw)
    out_p, lse_p = flash_attn_with_kvcache(**paged_kw, return_softmax_lse=True)
    out_d, lse_d = flash_attn_with_kvcache(**dense, return_softmax_lse=True)
    rows = dense["cache_batch_idx"].long()
    if case.dtype == torch.float32:
        assert (out_p - out_d).abs().max().item() <= 1e-5 * (1 + out_p.abs().max().item())
    else:  # chunk boundaries may differ: allow one rounding step of the output dtype
        ulp = torch.finfo(case.dtype).eps * (1 + out_p.double().abs().max().item())
        assert (out_p.double() - out_d.double()).abs().max().item() <= 2 * ulp
    assert torch.equal(torch.isinf(lse_p), torch.isinf(lse_d))
    fin = torch.isfinite(lse_p)
    assert (lse_p[fin] - lse_d[fin]).abs().max().item() <= 1e-4 if fin.any() else True
    ends = [n + case.new for n in case.lengths]
    for b in range(case.batch):  # the appended rows landed at the same logical positions
        r = torch.arange(ends[b])
        blk = paged_kw["block_table"][b].long()[r // case.page]
        assert torch.equal(paged_kw["v_cache"][blk, r % case.page], dense["v_cache"][rows[b], : ends[b]])
    if case.rotary != "none":
        return  # varlen has no rotary: q would need rotating first
    # varlen over the updated paged cache computes the same as the kvcache call
    sq = case.seqlen_q
    cu_q = torch.arange(case.batch + 1, dtype=torch.int32) * sq
    cu_k = torch.tensor([0, *torch.tensor(ends).cumsum(0).tolist()], dtype=torch.int32)
    cap = kw["block_table"].shape[1] * case.page
    out_v, lse_v, none = flash_attn_varlen_func(
        kw["q"].reshape(-1, *kw["q"].shape[2:]),
        paged_kw["k_cache"],
        paged_kw["v_cache"],
        cu_q,
        cu_k,
        sq,
        cap,
        softmax_scale=case.scale,
        causal=case.causal,
        window_size=case.window,
        softcap=case.softcap,
        alibi_slopes=kw.get("alibi_slopes"),
        return_attn_probs=True,
        block_table=kw["block_table"],
        s_aux=kw.get("s_aux"),
    )
    assert none is None
    assert torch.equal(out_v.view_as(out_p), out_p)
    assert torch.equal(lse_v, lse_p.permute(1, 0, 2).reshape(lse_v.shape))


@st.composite
def varlen_cases(draw):
    batch = draw(st.integers(1, 8))
    seq_q = draw(st.lists(st.sampled_from([0, 1, 1, 1, 2, 5, 17, 33]), min_size=batch, max_size=batch))
    extra = draw(st.lists(st.integers(0, 300), min_size=batch, max_size=batch))
    return dict(
        seq_q=seq_q,
        seq_k=[q + e for q, e in zip(seq_q, extra, strict=True)],
        page=draw(st.sampled_from([1, 16, 256])),
        paged=draw(st.booleans()),
        head_dim=draw(st.sampled_from([32, 64, 80, 128, 256])),
        kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 4, 8])),
        dtype=draw(st.sampled_from(DTYPES)),
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([(-1, -1), (16, 0), (5, 5), (-1, 3)])),
        softcap=draw(st.sampled_from([0.0, 10.0])),
        alibi=draw(st.booleans()),
        s_aux=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@_settings(250)
@given(c=varlen_cases(), tiles=TILINGS)
def test_varlen_matches_oracle(c: dict, tiles):
    _count("varlen")
    g = torch.Generator().manual_seed(c["seed"])
    dt, heads, hk, d = c["dtype"], c["kv_heads"] * c["group"], c["kv_heads"], c["head_dim"]
    total_q = sum(c["seq_q"]) + 1  # one trailing row that belongs to no sequence
    cu_q = torch.tensor([0, *torch.tensor(c["seq_q"]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(c["seq_k"]).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(total_q, heads, d, generator=g).to(dt)
    if c["paged"]:
        page = c["page"]
        per_seq = max(1, -(-max(c["seq_k"]) // page))
        nb = per_seq * len(c["seq_k"]) + 1
        k = torch.randn(nb, page, hk, d, generator=g).to(dt)
        v = torch.randn(nb, page, hk, d, generator=g).to(dt)
        table = torch.randperm(nb, generator=g)[: per_seq * len(c["seq_k"])].view(-1, per_seq).to(torch.int32)
    else:
        k = torch.randn(int(cu_k[-1]), hk, d, generator=g).to(dt)
        v = torch.randn(int(cu_k[-1]), hk, d, generator=g).to(dt)
        table = None
    extra = dict(causal=c["causal"], window_size=c["window"], softcap=c["softcap"])
    if c["alibi"]:
        extra["alibi_slopes"] = torch.rand(heads, generator=g) * 0.3
    if c["s_aux"]:
        extra["s_aux"] = torch.randn(heads, generator=g)
    max_q, max_k = max(c["seq_q"]), max(c["seq_k"])
    ref, ref_lse = oracle_varlen(q, k, v, cu_q, cu_k, max_q, max_k, block_table=table, **extra)
    with tiling(*tiles):
        out, lse, _ = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=True, block_table=table, **extra
        )
    ref_dt = None
    if dt != torch.float32:
        ref_dt, _ = oracle_varlen(q, k, v, cu_q, cu_k, max_q, max_k, block_table=table, round_dtype=dt, **extra)
    assert lse.shape == (heads, total_q) and out.shape == q.shape
    err = (out.double() - ref).abs().max().item()
    assert err <= out_tolerance(ref, ref_dt, dt), err
    check_lse(lse, ref_lse, dt)
    assert (out[-1] == 0).all() and torch.isinf(lse[:, -1]).all()


@_settings(50)
@given(
    dtype=st.sampled_from(DTYPES),
    page=st.sampled_from([1, 16, 256]),
    tokens=st.integers(0, 40),
    kv_heads=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**16),
)
def test_store_kv_scatters_exactly(dtype, page, tokens, kv_heads, seed):
    _count("store_kv")
    g = torch.Generator().manual_seed(seed)
    nb = max(1, -(-tokens // page) + 1)
    k_cache = torch.zeros(nb, page, kv_heads, 8, dtype=dtype)
    v_cache = torch.zeros(nb, page, kv_heads, 8, dtype=dtype)
    k = torch.randn(tokens, kv_heads, 8, generator=g).to(dtype)
    v = torch.randn(tokens, kv_heads, 8, generator=g).to(dtype)
    slots = torch.randperm(nb * page, generator=g)[:tokens]
    skip = torch.rand(tokens, generator=g) < 0.3
    slots[skip] = -1
    store_kv(k_cache, v_cache, k, v, slots.to(torch.int32))
    expect_k = torch.zeros_like(k_cache).view(-1, kv_heads, 8)
    expect_v = torch.zeros_like(v_cache).view(-1, kv_heads, 8)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect_k[s], expect_v[s] = k[t], v[t]
    assert torch.equal(k_cache.view(-1, kv_heads, 8), expect_k)
    assert torch.equal(v_cache.view(-1, kv_heads, 8), expect_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_without_keys_give_zero_and_inf(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 32, generator=g).to(dtype)
    k_cache = torch.randn(4, 16, 2, 32, generator=g).to(dtype)
    v_cache = torch.randn(4, 16, 2, 32, generator=g).to(dtype)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lengths = torch.tensor([0, 2], dtype=torch.int32)  # seq 0 empty; seq 1: causal rows 0-2 see nothing
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, causal=True, return_softmax_lse=True
    )
    assert (out[0] == 0).all() and torch.isinf(lse[0]).all()
    assert (out[1, :3] == 0).all() and torch.isinf(lse[1, :, :3]).all()
    assert torch.isfinite(lse[1, :, 3:]).all() and not out.isnan().any()
    # a window that excludes every key, and a sink: out 0, LSE = log(exp(s_aux)) = s_aux
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out2, lse2 = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=lengths,
        block_table=table,
        causal=True,
        return_softmax_lse=True,
        s_aux=sink,
    )
    assert (out2[0] == 0).all() and torch.allclose(lse2[0], sink[:, None].expand(4, 5))


def test_fp64_is_accepted_and_accurate():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 8, 64, generator=g, dtype=torch.float64)
    k_cache = torch.randn(6, 16, 2, 64, generator=g, dtype=torch.float64)
    v_cache = torch.randn(6, 16, 2, 64, generator=g, dtype=torch.float64)
    table = torch.arange(6, dtype=torch.int32).view(3, 2)
    lengths = torch.tensor([5, 32, 17], dtype=torch.int32)
    kw = dict(cache_seqlens=lengths, block_table=table, causal=True, window_size=(9, 1))
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw)
    ref, ref_lse, _, _ = oracle_kvcache(q, k_cache, v_cache, **kw)
    assert out.dtype == torch.float64 and (out - ref).abs().max().item() < 1e-12
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-12


def test_long_sequences_cross_many_chunks():
    """Keys spanning many chunks and sequences of very different lengths (online softmax, dropping out)."""
    g = torch.Generator().manual_seed(2)
    lengths = [3000, 1, 0, 1500, 777]
    page, per_seq = 16, 190
    nb = per_seq * len(lengths)
    k_cache = torch.randn(nb, page, 2, 64, generator=g)
    v_cache = torch.randn(nb, page, 2, 64, generator=g)
    table = torch.randperm(nb, generator=g).view(len(lengths), per_seq).to(torch.int32)
    q = torch.randn(len(lengths), 1, 8, 64, generator=g)
    kw = dict(
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
        block_table=table,
        alibi_slopes=torch.rand(8, generator=g) * 0.01,
        window_size=(2000, -1),
    )
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw)
    ref, ref_lse, _, _ = oracle_kvcache(q, k_cache, v_cache, **kw)
    assert (out.double() - ref).abs().max().item() < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-4
    assert math.isinf(lse[2, 0, 0].item())


@_settings(150)
@given(case=cases(max_batch=5, max_q=9, max_cached=120), leftpad=st.booleans(), tiles=TILINGS)
def test_dense_cache_with_batch_idx_and_leftpad_matches_oracle(case: Case, leftpad: bool, tiles):
    _count("dense_leftpad")
    g = torch.Generator().manual_seed(case.seed)
    heads, dt = case.kv_heads * case.group, case.dtype
    pads = [int(torch.randint(0, n + 1, (1,), generator=g)) if leftpad else 0 for n in case.lengths]
    cap = max(max(case.lengths) + case.new, case.seqlen_q if case.new else 1)
    shape = (case.batch + 1, cap, case.kv_heads, case.head_dim)
    kw = dict(
        q=torch.randn(case.batch, case.seqlen_q, heads, case.head_dim, generator=g).to(dt),
        k_cache=torch.randn(*shape, generator=g).to(dt),
        v_cache=torch.randn(*shape, generator=g).to(dt),
        cache_seqlens=torch.tensor(case.lengths, dtype=torch.int32),
        cache_batch_idx=torch.randperm(case.batch + 1, generator=g)[: case.batch].to(torch.int32),
        causal=case.causal,
        window_size=case.window,
        softcap=case.softcap,
    )
    if leftpad:
        kw["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32)
    if case.new:
        kw["k"] = torch.randn(case.batch, case.new, case.kv_heads, case.head_dim, generator=g).to(dt)
        kw["v"] = torch.randn(case.batch, case.new, case.kv_heads, case.head_dim, generator=g).to(dt)
        if case.rotary != "none":
            ang = torch.rand(cap, case.rotary_dim // 2, generator=g) * 7
            kw.update(rotary_cos=ang.cos().to(dt), rotary_sin=ang.sin().to(dt),
                      rotary_interleaved=case.rotary == "interleaved")  # fmt: skip
    (ref, ref_lse, ref_k, ref_v), ref_dt = run_oracles(kw, dt)
    mine = _clone(kw)
    with tiling(*tiles):
        out, lse = flash_attn_with_kvcache(**mine, return_softmax_lse=True)
    err = (out.double() - ref).abs().max().item()
    assert err <= out_tolerance(ref, ref_dt[0] if ref_dt else None, dt), err
    check_lse(lse, ref_lse, dt)
    assert torch.equal(mine["v_cache"], ref_v)
    if case.rotary == "none" or not case.new:
        assert torch.equal(mine["k_cache"], ref_k)
