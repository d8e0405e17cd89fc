"""The fused C++ CPU paged-attention kernel (flashpage/kernels/cpu_attention.py) against the float64 oracle.

Random ragged batches (empty query rows, sequences with no keys, Sq > Sk, block tables padded with
-1 past the used pages, page sizes 1/16/128), GQA/MQA groups, causal, sliding windows, softcap,
attention sinks, D != Dv (with and without a partial last vector, and D past the vector path's
128), float32 and float64; both the portable path (per-key loop for few rows, per-page GEMMs for
prefill tiles) and the float32 AVX-512 path where the CPU has it (``generic=False``). Then the
layer entry points that take it (``attend_static``, ``layer_varlen``), the reference fallback
(forced by the environment variable, or no compiler), and what ``flashpage info`` reports. The
first test in a fresh environment builds the kernel once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_oracle import attend_one, effective_mask

from flashpage.kernels import cpu_attention, dispatch, paged

pytestmark = pytest.mark.skipif(cpu_attention.status().name != "cpp",
                                reason="no C++ compiler / ninja here: the reference runs (tested elsewhere)")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@st.composite
def batches(draw) -> dict:
    batch = draw(st.integers(1, 5))
    seq_q = draw(st.lists(st.sampled_from([0, 1, 1, 1, 2, 4, 5, 7, 19, 40]), min_size=batch, max_size=batch))
    seq_k = draw(st.lists(st.integers(0, 300), min_size=batch, max_size=batch))
    head_dim = draw(st.sampled_from([16, 64, 72, 80, 144]))
    return dict(
        seq_q=seq_q,
        seq_k=seq_k,
        page=draw(st.sampled_from([1, 16, 128])),
        head_dim=head_dim,
        value_dim=draw(st.sampled_from([head_dim, head_dim, 32])),
        kv_heads=draw(st.sampled_from([1, 2, 3])),
        group=draw(st.sampled_from([1, 2, 4, 8])),
        dtype=draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])),
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([(-1, -1), (-1, -1), (16, 0), (5, 5), (-1, 3), (0, 0)])),
        softcap=draw(st.sampled_from([0.0, 0.0, 10.0])),
        s_aux=draw(st.booleans()),
        extra_cols=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**16)),
        generic=draw(st.booleans()),
    )


def _build(c: dict) -> dict:
    """Pages in random block order, a block table padded with -1, packed queries."""
    g = torch.Generator().manual_seed(c["seed"])
    dt, page, hk = c["dtype"], c["page"], c["kv_heads"]
    used = [-(-n // page) for n in c["seq_k"]]
    width = max(max(used), 1) + c["extra_cols"]
    num_blocks = sum(used) + 2
    ids = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(used), width), -1, dtype=torch.int32)
    pos = 0
    for b, u in enumerate(used):
        table[b, :u] = torch.tensor(ids[pos:pos + u], dtype=torch.int32)
        pos += u
    for members, pages in c.get("share", []):  # these sequences' tables start with the first one's `pages` blocks
        for b in members[1:]:
            table[b, :pages] = table[members[0], :pages]
    heads = hk * c["group"]
    return dict(
        q=torch.randn(sum(c["seq_q"]), heads, c["head_dim"], generator=g).to(dt),
        k_pages=torch.randn(num_blocks, page, hk, c["head_dim"], generator=g).to(dt),
        v_pages=torch.randn(num_blocks, page, hk, c["value_dim"], generator=g).to(dt),
        table=table,
        sinks=torch.randn(heads, generator=g) if c["s_aux"] else None,
    )


def _oracle(c: dict, t: dict, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 out (T, H, Dv) and lse (T, H), sequence by sequence."""
    outs, lses, row = [], [], 0
    for b, (sq, sk) in enumerate(zip(c["seq_q"], c["seq_k"], strict=True)):
        r = torch.arange(sk)
        blk = t["table"][b].long()[r // c["page"]] if sk else r
        keys = t["k_pages"][blk, r % c["page"]].double()
        values = t["v_pages"][blk, r % c["page"]].double()
        rule = effective_mask(c["causal"], c["window"], sq, 10**9, False)  # the kernel takes windows literally
        sinks = t["sinks"].double() if t["sinks"] is not None else None
        o, lse = attend_one(t["q"][row:row + sq].double(), keys, values, scale, c["softcap"], rule, None, sinks, None)
        outs.append(o)
        lses.append(lse.T)
        row += sq
    return torch.cat(outs), torch.cat(lses)


def _tolerance(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """float32: 2e-5 of the largest output; float64: 1e-10. bfloat16 / float16 (inputs exact in float64, float32
    arithmetic, the output rounded once): one rounding step of the dtype (its eps, twice the rounding error) of
    the largest output, plus float32's."""
    scale = 1.0 + (ref[torch.isfinite(ref)].abs().max().item() if ref.numel() else 0.0)
    if dtype in (torch.bfloat16, torch.float16):
        return (torch.finfo(dtype).eps + 2e-5) * scale
    return (2e-5 if dtype == torch.float32 else 1e-10) * scale


@settings(deadline=None, max_examples=150, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(c=batches())
def test_kernel_matches_oracle(c: dict):
    t = _build(c)
    scale = c["head_dim"] ** -0.5
    cu = torch.tensor([0, *c["seq_q"]]).cumsum(0)
    sk = torch.tensor(c["seq_k"], dtype=torch.int32)
    window = cpu_attention.window_sides(c["causal"], c["window"])
    res = cpu_attention.paged_attention(t["q"], t["k_pages"], t["v_pages"], t["table"], sk, cu, scale, c["softcap"],
                                        window, t["sinks"], generic=c["generic"])
    assert res is not None
    out, lse = res
    ref, ref_lse = _oracle(c, t, scale)
    assert out.dtype == c["dtype"] and out.shape == ref.shape and not out.isnan().any()
    if ref.numel():
        assert (out.double() - ref).abs().max().item() <= _tolerance(ref, c["dtype"])
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without keys (and no sink): LSE +inf, only they"
    assert (out[torch.isinf(ref_lse)] == 0).all(), "rows without keys give 0"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert ((lse.double()[fin] - ref_lse[fin]).abs() / (1 + ref_lse[fin].abs())).max().item() <= 1e-5


def _run(c: dict, threads: int = 1) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run config ``c`` on ``threads`` threads: (its tensors, out, lse, the oracle's out, the oracle's lse)."""
    t = _build(c)
    scale = c["head_dim"] ** -0.5
    cu = torch.tensor([0, *c["seq_q"]]).cumsum(0)
    sk = torch.tensor(c["seq_k"], dtype=torch.int32)
    window = cpu_attention.window_sides(c["causal"], c["window"])
    torch.set_num_threads(threads)
    try:
        out, lse = cpu_attention.paged_attention(t["q"], t["k_pages"], t["v_pages"], t["table"], sk, cu, scale,
                                                 c["softcap"], window, t["sinks"], generic=c["generic"],
                                                 cascade=c.get("cascade"))
    finally:
        torch.set_num_threads(1)
    ref, ref_lse = _oracle(c, t, scale)
    return t, out, lse, ref, ref_lse


def _check(c: dict, threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Run config ``c`` on ``threads`` threads, check it against the oracle; returns (out, lse)."""
    _, out, lse, ref, ref_lse = _run(c, threads)
    assert (out.double() - ref).abs().max().item() <= _tolerance(ref, c["dtype"])
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert ((lse.double()[fin] - ref_lse[fin]).abs() / (1 + ref_lse[fin].abs())).max().item() <= 1e-5
    return out, lse


_AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@pytest.mark.parametrize("softcap", [0.0, 10.0])
def test_decode_scores_take_the_vector_loop(softcap: float):
    """Outside the portable mode, decode tiles' scores run vectorised: AVX-512's decode path, or on AVX2 + FMA
    CPUs eight keys at a time with one reduction tree for the eight (head dims that are multiples of 8). The
    bits then differ from the portable per-key loop's, both within the oracle's tolerance (``_check``)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2" and not _AVX512:
        pytest.skip("neither AVX2 nor AVX-512 here: decodes take the portable loops in every mode")
    c = dict(seq_q=[1, 1, 2, 1, 4, 1], seq_k=[37, 90, 130, 8, 61, 300], page=16, head_dim=64, value_dim=64,
             kv_heads=2, group=4, dtype=torch.float32, causal=True, window=(-1, -1), softcap=softcap, s_aux=False,
             extra_cols=1, seed=11, generic=False)
    vector, _ = _check(c)
    portable, _ = _check(dict(c, generic=True))
    assert not torch.equal(vector, portable)
    odd, _ = _check(dict(c, head_dim=20, value_dim=20))  # not a multiple of 8: the per-key loop, still exact
    assert odd.shape[-1] == 20


_STEP = dict(page=16, head_dim=64, value_dim=64, group=2, dtype=torch.float32, causal=True, softcap=0.0,
             s_aux=False, extra_cols=2, generic=False)


@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("window", [(-1, -1), (20, 0)])
@pytest.mark.parametrize("generic", [False, True])
def test_decode_step_many_sequences(kv_heads, window, generic):
    """A decode-heavy step (the float32 AVX-512 path reads every KV head of a page row in one task):
    40 sequences of 1-4 query rows next to a prefill chunk, several KV heads, pages in shuffled order,
    tables padded with -1, a sliding window; then the same step on 2 threads (one decode sequence per
    thread at most: tasks split per KV head) gives the same bits as on one."""
    g = torch.Generator().manual_seed(kv_heads * 7 + (window[0] > 0))
    seq_q = [1 + int(x) % 4 for x in torch.randint(0, 16, (40,), generator=g)] + [37]
    seq_k = [q + int(x) for q, x in zip(seq_q, torch.randint(0, 150, (41,), generator=g), strict=True)]
    c = dict(_STEP, seq_q=seq_q, seq_k=seq_k, kv_heads=kv_heads, window=window, seed=kv_heads, generic=generic)
    out1, lse1 = _check(c)
    out2, lse2 = _check(c, threads=2)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    few = dict(c, seq_q=[1], seq_k=[150])  # one decode, 2 threads: one task per KV head
    assert all(torch.equal(x, y) for x, y in zip(_check(few), _check(few, threads=2), strict=True))


# Prefill tiles (16+ (query, head) rows, float32 AVX-512: keys in blocks of 128 gathered across pages, 8 rows
# scored / normalised / multiplied by V together): (head_dim, value_dim, page, group, causal, window, softcap, sinks).
# Pages smaller than the key block (1, 16), not dividing it (48: a block starts mid-page), larger (256).
_PREFILL_TILES = [
    (64, 64, 16, 4, True, (-1, -1), 0.0, False),  # the shared-prefix step's shape
    (64, 64, 128, 4, True, (-1, -1), 0.0, True),
    (16, 16, 1, 8, True, (16, 0), 0.0, False),
    (72, 32, 48, 2, False, (5, 5), 10.0, True),
    (80, 80, 16, 1, False, (-1, 3), 0.0, False),
    (64, 64, 256, 4, True, (40, 0), 10.0, False),
    (80, 32, 48, 8, True, (-1, -1), 0.0, True),
]


@pytest.mark.parametrize("case", _PREFILL_TILES)
def test_prefill_tiles(case):
    """Prefill tiles against the oracle: queries after hundreds of cached keys (several key blocks), a prompt
    with no cache, tiles split at 32 query rows, partial first and last pages, windows, softcap, sinks, D != Dv."""
    d, dv, page, group, causal, window, softcap, sinks = case
    c = dict(seq_q=[58, 19, 40, 33], seq_k=[570, 19, 300, 170], page=page, head_dim=d, value_dim=dv, kv_heads=2,
             group=group, dtype=torch.float32, causal=causal, window=window, softcap=softcap, s_aux=sinks,
             extra_cols=1, seed=d + page + group, generic=False)
    _check(c)


# Cascade (float32 AVX-512): decodes whose tables start with the same blocks run those keys once, stacked.
# (page, group, softcap, sinks, causal, window)
_CASCADES = [
    (16, 4, 0.0, False, True, (-1, -1)),  # the shared-prefix bench's GQA shape
    (128, 1, 10.0, True, True, (-1, -1)),  # one head per KV head: 8 sequences make the 8 stacked rows
    (48, 2, 0.0, True, False, (-1, -1)),
    (16, 8, 0.0, False, True, (30, 0)),  # a left window: no cascade, same results
]


@pytest.mark.parametrize("case", _CASCADES)
@pytest.mark.parametrize("threads", [1, 2])
def test_cascade_decodes_sharing_pages(case, threads):
    """Decode rows (1-4 per sequence) of sequences that share their first pages: a group of 9 sharing 5 pages
    (one of them shares only 3: the group takes 3), a group of 2 (too few rows to stack unless the GQA group is
    wide), a pair sharing a page that one of them cannot see all of (its keys end mid-page), sequences that share
    nothing, and a prefill chunk beside them. Every output and log-sum-exp against the float64 oracle, and
    within float rounding of the same step without the cascade."""
    page, group, softcap, sinks, causal, window = case
    seq_q = [1, 1, 2, 1, 4, 1, 1, 3, 1, 1, 2, 1, 1, 33, 1, 1]
    lens = [5 * page + 7, 5 * page + 1, 6 * page, 5 * page + 30, 7 * page + 3, 5 * page + 2, 8 * page, 5 * page + 9,
            3 * page + 5, 2 * page + 3, 3 * page, page - 2 if page > 2 else 1, page + 5, 2 * page + 40, 4 * page, 90]
    share = [([0, 1, 2, 3, 4, 5, 6, 7, 8], 5), ([9, 10], 2), ([11, 12], 1)]
    c = dict(seq_q=seq_q, seq_k=[max(q, n) for q, n in zip(seq_q, lens, strict=True)], page=page, head_dim=64,
             value_dim=64, kv_heads=2, group=group, dtype=torch.float32, causal=causal, window=window,
             softcap=softcap, s_aux=sinks, extra_cols=1, seed=page + group, generic=False, share=share)
    c_short = dict(c)
    c_short["share"] = [([0, 1, 2, 3, 4, 5, 6, 7], 5), ([0, 8], 3), ([9, 10], 2), ([11, 12], 1)]
    for config in (c, c_short):
        out, lse = _check(dict(config, cascade=True), threads=threads)
        plain, plain_lse = _check(dict(config, cascade=False), threads=threads)
        assert (out - plain).abs().max().item() <= 1e-5 * (1 + plain.abs().max().item())
        fin = torch.isfinite(plain_lse)
        assert torch.equal(fin, torch.isfinite(lse))
        assert (lse[fin] - plain_lse[fin]).abs().max().item() <= 1e-5 * (1 + plain_lse[fin].abs().max().item())


def test_cascade_runs_for_shared_pages(monkeypatch):
    """The cascade changes the arithmetic's order on shared pages only: with a group of decodes sharing pages the
    outputs differ in float rounding from the per-sequence path (so it ran), and without sharing they are equal
    to the bit."""
    seq_q = [1] * 12
    base = dict(seq_q=seq_q, seq_k=[300 + 7 * i for i in range(12)], page=16, head_dim=64, value_dim=64, kv_heads=2,
                group=4, dtype=torch.float32, causal=True, window=(-1, -1), softcap=0.0, s_aux=False, extra_cols=0,
                seed=3, generic=False)
    shared = dict(base, share=[(list(range(12)), 18)])
    on, _ = _check(dict(shared, cascade=True))
    off, _ = _check(dict(shared, cascade=False))
    if _AVX512:
        assert not torch.equal(on, off)
    else:  # the cascade is part of the AVX-512 path: without it the switch changes nothing
        assert torch.equal(on, off)
    assert all(torch.equal(x, y) for x, y in zip(_check(dict(base, cascade=True)), _check(dict(base, cascade=False)),
                                                 strict=True))


def _layer_case(seed: int, sq: int, lengths: list[int], page: int = 16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    b, heads, hk, d = len(lengths), 8, 2, 64
    width = max(-(-n // page) for n in lengths) + 1
    nb = b * width + 1
    table = torch.randperm(nb, generator=g)[: b * width].view(b, width).to(torch.int32)
    # transformers' layout: (B, Sq, H, D) projections viewed as (B, H, Sq, D)
    qh = torch.randn(b, sq, heads, d, generator=g).to(dtype).transpose(1, 2)
    k_pages = torch.randn(nb, page, hk, d, generator=g).to(dtype)
    v_pages = torch.randn(nb, page, hk, d, generator=g).to(dtype)
    return qh, k_pages, v_pages, table, torch.tensor(lengths, dtype=torch.int32)


def _spy(monkeypatch) -> list[int]:
    """Counts the calls that ran the C++ kernel (the wrapper returns None when it is off)."""
    calls: list[int] = []
    real = cpu_attention.paged_attention

    def counted(*args, **kwargs):
        res = real(*args, **kwargs)
        if res is not None:
            calls.append(1)
        return res

    monkeypatch.setattr(cpu_attention, "paged_attention", counted)
    return calls


def _forced_reference(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setenv(cpu_attention.ENV, "reference")
        return fn()


@pytest.mark.parametrize("opts", [paged.LayerOptions(), paged.LayerOptions(window_size=(9, -1)),
                                  paged.LayerOptions(softcap=20.0, softmax_scale=0.1),
                                  paged.LayerOptions(causal=False)])
@pytest.mark.parametrize("sq", [1, 5, 37])
def test_attend_static_takes_the_kernel_and_equals_the_reference(monkeypatch, opts, sq):
    """The layer path (eager and inside the compiled-step op) runs the kernel, with the reference's results,
    including left-padded rows that see no key (lengths shorter than the query)."""
    qh, k_pages, v_pages, table, lengths = _layer_case(sq, sq, [3, 90, 40, sq + 60])
    sinks = torch.randn(8) if opts.softcap else None
    calls = _spy(monkeypatch)
    fast = paged.attend_static(qh, k_pages, v_pages, table, lengths, opts, sinks)
    assert calls, "float32 CPU attention must take the C++ kernel"
    ref = _forced_reference(monkeypatch, lambda: paged.attend_static(qh, k_pages, v_pages, table, lengths, opts, sinks))
    assert len(calls) == 1, f"{cpu_attention.ENV}=reference must keep the kernel off"
    assert fast.shape == ref.shape == (4, 8, sq, 64)
    assert (fast - ref).abs().max().item() <= 2e-5 * (1 + ref.abs().max().item())
    op = paged.attend_compiled(qh, k_pages, v_pages, table, lengths, opts, sinks, True)
    assert len(calls) == 2 and torch.allclose(op, fast, atol=1e-6, rtol=0)


def test_layer_varlen_takes_the_kernel(monkeypatch):
    """A packed mixed step (prefill chunk over a cached prefix, decodes) through dispatch.layer_varlen."""
    g = torch.Generator().manual_seed(3)
    query_lens, key_lens, page = [23, 1, 1, 4], [80, 17, 1, 4], 16
    width = 6
    table = torch.randperm(4 * width, generator=g).view(4, width).to(torch.int32)
    q = torch.randn(sum(query_lens), 8, 64, generator=g)
    k_pages, v_pages = torch.randn(2, 4 * width, page, 2, 64, generator=g).unbind(0)
    cu_q = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *key_lens]).cumsum(0).to(torch.int32)
    opts = paged.LayerOptions(window_size=(30, -1))

    def run():
        return dispatch.layer_varlen(q, k_pages, v_pages, cu_q, cu_k, max(query_lens), max(key_lens), table, opts,
                                     None, query_lens, key_lens, page)

    calls = _spy(monkeypatch)
    fast = run()
    ref = _forced_reference(monkeypatch, run)
    assert len(calls) == 1 and fast.shape == ref.shape == q.shape
    assert (fast - ref).abs().max().item() <= 2e-5 * (1 + ref.abs().max().item())


def test_no_compiler_falls_back_with_one_warning(monkeypatch):
    """Without a compiler the kernel is never built: one warning, then the reference, same results."""
    qh, k_pages, v_pages, table, lengths = _layer_case(7, 3, [10, 50])
    expected = paged.attend_static(qh, k_pages, v_pages, table, lengths, paged.LayerOptions())
    monkeypatch.setattr(cpu_attention, "_module", None)
    monkeypatch.setattr(cpu_attention, "_failure", None)
    monkeypatch.setattr(cpu_attention, "_missing_tools", lambda: "no C++ compiler ('c++' / g++ not on PATH)")
    monkeypatch.setattr(cpu_attention, "_build", lambda: pytest.fail("must not try to build"))
    with pytest.warns(UserWarning, match="C\\+\\+ CPU attention kernel is unavailable .*no C\\+\\+ compiler"):
        out = paged.attend_static(qh, k_pages, v_pages, table, lengths, paged.LayerOptions())
    assert (out - expected).abs().max().item() <= 2e-5 * (1 + expected.abs().max().item())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only once
        paged.attend_static(qh, k_pages, v_pages, table, lengths, paged.LayerOptions())
    state = cpu_attention.status()
    assert state.name == "reference" and "no C++ compiler" in state.reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_take_the_kernel(monkeypatch, dtype):
    """bfloat16 / float16 layers run the C++ kernel (float32 arithmetic, output in the dtype, LSE float32) and
    agree with the reference within one rounding step of the dtype."""
    calls = _spy(monkeypatch)
    qh, k_pages, v_pages, table, lengths = _layer_case(1, 2, [5, 9], dtype=dtype)
    got = paged.attend_static(qh, k_pages, v_pages, table, lengths, paged.LayerOptions())
    assert calls and got.dtype == dtype
    want = _forced_reference(monkeypatch, lambda: paged.attend_static(qh, k_pages, v_pages, table, lengths,
                                                                        paged.LayerOptions()))
    assert (got.float() - want.float()).abs().max().item() <= 2 * torch.finfo(dtype).eps * want.float().abs().max()
    res = cpu_attention.paged_attention(qh.transpose(1, 2).reshape(-1, qh.shape[1], qh.shape[3]).contiguous(),
                                        k_pages, v_pages, table, lengths, torch.tensor([0, 2, 4]), 0.125, 0.0,
                                        (-1, 0), None)
    assert res is not None and res[0].dtype == dtype and res[1].dtype == torch.float32


def test_autograd_stays_on_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_attention, "load", lambda: pytest.fail("the kernel must not be asked for"))
    qh, k_pages, v_pages, table, lengths = _layer_case(1, 2, [5, 9])
    qh = qh.detach().requires_grad_()
    out = paged.attend_static(qh, k_pages, v_pages, table, lengths, paged.LayerOptions())
    out.sum().backward()
    assert qh.grad is not None and qh.grad.abs().sum() > 0


def test_info_says_which_cpu_attention_runs(monkeypatch):
    from flashpage.info import collect_info, format_info

    info = collect_info()
    assert info["cpu_attention"]["backend"] == "cpp"
    assert "CPU attention (float32/float64/bfloat16/float16 pages): cpp" in format_info(info)
    assert "-> cpp: fused C++ paged-attention kernel" in format_info(info)  # the kernels table says so too
    monkeypatch.setenv(cpu_attention.ENV, "reference")
    info = collect_info()
    assert info["cpu_attention"]["backend"] == "reference" and cpu_attention.ENV in info["cpu_attention"]["reason"]
