"""bfloat16 / float16 in the one-pass C++ CPU ops (flashpage/kernels/cpu_fused.py) and the engine's linears.

Every op against a float64 oracle on random shapes, with the tolerance its rounding gives: the inputs are exact in
float64, the ops compute in float32 and round to the dtype where transformers' modules round, so the error is a
few rounding steps of the dtype (``eps``: 2^-7 bfloat16, 2^-10 float16) of the magnitudes involved, plus float32's
summation error for the linear. Then the same ops against transformers' own half-precision modules (RMSNorm,
silu-and-mul, rotary): the same bits, up to float32 rounding of an intermediate (at most one step, in a few
elements). Each runs on the engine's build (-march=native), the portable build (plain loops: CPUs without AVX-512)
and, on x86-64, a -march=native build without AVX-512 BF16 (the widened-FMA linear). The half-precision attention
kernel is in test_kernels_cpu.py (its hypothesis cases draw bfloat16 / float16 too); its decode tiles that read the
pages in place (head dims a multiple of 16, value dims of 128: real models' shapes, which those cases do not draw)
are checked here against the same float64 oracle, and so are its prefill tiles on long prompts: bfloat16's
vdpbf16ps path on AVX512_BF16 CPUs (P rounded to bfloat16 before P.V, as flash-attn does: its rounding is in the
tolerance), the widened float32 copies (float16, the portable mode, shapes that path does not take).
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kernels_cpu import _check, _run, _tolerance  # its float64 oracle and tolerance

from flashpage.engine import linears
from flashpage.kernels import cpp_build, cpu_attention, cpu_fused

pytestmark = [pytest.mark.skipif(cpu_fused.status().name != "cpp", reason="no C++ compiler / ninja here"),
              pytest.mark.usefixtures("one_thread")]

HALF = [torch.bfloat16, torch.float16]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(scope="module", params=["native", "portable", "no_bf16"])
def ops(request) -> cpu_fused.Ops:
    """The engine's build, the portable one, and (x86-64) -march=native without AVX-512 BF16."""
    if request.param == "no_bf16" and not _X86:
        pytest.skip("an x86-64 build flavour")
    if request.param != "native":
        return cpu_fused._build(portable=True if request.param == "portable" else "no_bf16")
    built = cpu_fused.load()
    assert built is not None
    return built


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _sub(dtype: torch.dtype) -> float:
    """Four steps of the dtype's subnormal range (the absolute error of a rounding below its normal range)."""
    return 4 * torch.finfo(dtype).tiny * torch.finfo(dtype).eps


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 tensor rounded to ``dtype`` and back (a rounding point of transformers' half-precision ops)."""
    return t.to(dtype).double()


@SETTINGS
@given(rows=st.sampled_from([1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 20, 31, 32, 33, 47, 48, 64, 95, 96, 129, 193]),
       k=st.sampled_from([1, 7, 16, 31, 32, 33, 100, 1024, 3072, 5000]),
       n=st.sampled_from([1, 3, 4, 5, 64, 65, 130]), bias=st.booleans(), dtype=st.sampled_from(HALF),
       seed=st.integers(0, 999))
def test_small_linear_matches_float64(ops, rows, k, n, bias, dtype, seed):
    """float32 sums of exact products, rounded once: |err| <= eps/2 |want| (the rounding) + float32's summation
    error (k * 2^-24 * |x| @ |w|^T, bounded loosely). Rows past 128 (at k 1024) and past 40 (at k 3072) run in
    several passes of rows (the kernel keeps a pass's rows in L2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = x.double() @ w.double().T + (b.double() if b is not None else 0)
    got = cpu_fused.small_linear(ops, x, w, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    bound = _eps(dtype) / 2 * want.abs() + k * 2**-22 * (x.double().abs() @ w.double().abs().T) + _sub(dtype)
    assert bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_small_linear_rounds_as_torch_does(ops, rows, dtype):
    """Each output is the float32 sum rounded to the dtype once, to nearest-even, bit for bit as torch's
    ``.to(dtype)`` rounds it: k = 1, w = 1 and a bias make output (r, j) x_r + b_j (one float32 addition), with x
    in [1, 2) and biases of half a step there (halfway cases), an overflow to infinity, infinities and NaN (NaN where
    torch gives NaN). 1 and 5 rows take the few-row tiles (their 8-lane and scalar rounding), 40 the blocked GEMM
    (builds without AVX-512); 37 outputs leave a scalar tail after the vector loops."""
    g = torch.Generator().manual_seed(rows)
    finfo = torch.finfo(dtype)
    x = (1 + torch.rand(rows, 1, generator=g)).to(dtype)
    half_step = finfo.eps / 2
    b = torch.cat([torch.tensor([half_step, -half_step, 3 * half_step, -3 * half_step] * 4),
                   torch.randn(21, generator=g) * 2.0 ** torch.randint(-12, 4, (21,), generator=g)]).to(dtype)
    x[0, 0] = finfo.max  # with the bias finfo.max: overflow to infinity
    b[-1] = finfo.max
    if rows > 2:
        x[1, 0], x[2, 0] = float("nan"), float("inf")
    got = cpu_fused.small_linear(ops, x, torch.ones(37, 1, dtype=dtype), b)
    want = (x.float() + b.float()).to(dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and bool(torch.isinf(got[0, -1]))
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("rows", "k"), [(200, 3072), (257, 1024), (130, 5000)])
def test_small_linear_passes_of_rows(ops, rows, k, dtype):
    """Many rows run in passes of rows that fit L2 (40 at k 3072, 128 at k 1024, 24 at k 5000): each pass is what
    a call of just its rows gives (same tiles, same sums, bias added once), and every row is within the bound.
    Builds without AVX-512 (float32 GEMMs on widened weights, in blocks of 48 rows at k 5000: 70 outputs span two)
    take no passes of rows; the GEMM's sums may depend on the row count, so only the bound is checked there."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(70, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(70, generator=g).to(dtype)
    got = cpu_fused.small_linear(ops, x, w, b)
    chunk = max(4, (128 << 10) // k // 4 * 4)
    for start in sorted({0, chunk, (rows - 1) // chunk * chunk} if not ops.half_any_rows else ()):
        part = slice(start, min(rows, start + chunk))
        assert torch.equal(got[part], cpu_fused.small_linear(ops, x[part].contiguous(), w, b))
    want = x.double() @ w.double().T + b.double()
    bound = _eps(dtype) / 2 * want.abs() + k * 2**-22 * (x.double().abs() @ w.double().abs().T) + _sub(dtype)
    assert bool(((got.double() - want).abs() <= bound).all())


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), d=st.sampled_from([1, 15, 16, 17, 64, 128, 1024]),
       offset=st.sampled_from([0.0, 1.0]), round_normed=st.booleans(), dtype=st.sampled_from(HALF),
       seed=st.integers(0, 999))
def test_rms_norm_matches_float64(ops, lead, d, offset, round_normed, dtype, seed):
    """The oracle rounds where the op says it rounds; what is left is float32's error before a rounding, which can
    move a result by one step: |err| <= eps |want| (+ the weight times one step of the rounded normalised x)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, d, generator=g) * 3 + 0.5).to(dtype)
    w = torch.randn(d, generator=g).to(dtype)
    x64, w64 = x.double(), w.double() + offset
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = _rounded(w64 * _rounded(normed, dtype), dtype) if round_normed else _rounded(normed * w64, dtype)
    got = cpu_fused.rms_norm(ops, x, w, 1e-6, offset, round_normed)
    assert got.dtype == dtype and got.is_contiguous()
    bound = _eps(dtype) * (want.abs() + w64.abs() * normed.abs()) + _sub(dtype)
    assert bool(((got.double() - want).abs() <= bound).all())


@SETTINGS
@given(rows=st.integers(1, 6), inner=st.sampled_from([1, 15, 16, 17, 100, 3072]),
       act=st.sampled_from(["silu", "gelu_tanh"]), dtype=st.sampled_from(HALF), seed=st.integers(0, 999))
def test_act_and_mul_matches_float64(ops, rows, inner, act, dtype, seed):
    """o = S(S(act(g)) * u) on the two halves of one fused gate|up output: within two rounding steps of the exact
    act(g) * u (plus 1e-5 |g u|: gelu's float32 1 + tanh(y) cancels for large negative g)."""
    g = torch.Generator().manual_seed(seed)
    both = (torch.randn(rows, 2 * inner, generator=g) * 3).to(dtype)
    gate, up = both[:, :inner], both[:, inner:]
    g64 = gate.double()
    a = F.silu(g64) if act == "silu" else F.gelu(g64, approximate="tanh")
    want = a * up.double()
    got = cpu_fused.act_and_mul(ops, gate, up, act)
    assert got.dtype == dtype and got.shape == gate.shape
    bound = 2 * _eps(dtype) * want.abs() + 1e-5 * (g64 * up.double()).abs() + _sub(dtype)  # 1 + tanh cancels: g << 0
    assert bool(((got.double() - want).abs() <= bound).all())


@SETTINGS
@given(batch=st.integers(1, 2), length=st.integers(1, 5), heads=st.sampled_from([1, 4]),
       d=st.sampled_from([2, 16, 128]), unsqueeze_dim=st.sampled_from([1, 2]), dtype=st.sampled_from(HALF),
       seed=st.integers(0, 999))
def test_rotary_matches_float64(ops, batch, length, heads, d, unsqueeze_dim, dtype, seed):
    """``x * cos + rotate_half(x) * sin`` with each product and the sum rounded: within two steps of the exact."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, length, d) if unsqueeze_dim == 1 else (batch, length, heads, d)
    q, k = torch.randn(*shape, generator=g).to(dtype), torch.randn(*shape, generator=g).to(dtype)
    cos = torch.randn(batch, length, d, generator=g).to(dtype)
    sin = torch.randn(batch, length, d, generator=g).to(dtype)
    gq, gk = cpu_fused.rotary(ops, q, k, cos, sin, unsqueeze_dim)
    c, s = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    for x, got in ((q, gq), (k, gk)):
        x64 = x.double()
        rot = torch.cat((-x64[..., d // 2:], x64[..., : d // 2]), dim=-1)
        want = x64 * c + rot * s
        bound = 2 * _eps(dtype) * ((x64 * c).abs() + (rot * s).abs()) + 3 * _sub(dtype)
        assert got.dtype == dtype and bool(((got.double() - want).abs() <= bound).all())


def _steps_apart(want: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Per element: how many rounding steps of the dtype apart two half tensors are (0: the same bits)."""
    step = want.float().abs() * _eps(want.dtype) + torch.finfo(want.dtype).tiny
    return ((want.float() - got.float()).abs() / step)


@pytest.mark.parametrize("dtype", HALF)
def test_same_bits_as_transformers_modules(ops, dtype):
    """Qwen3 / Llama RMSNorm, silu(gate) * up and apply_rotary_pos_emb in half precision: the C++ ops give the
    modules' own results (at most one step apart in at most 1% of the elements: float32 rounding before a
    rounding); gelu(tanh) within two steps, or 1e-5 |gate * up| where 1 + tanh cancels (its tanh is computed
    another way)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    norm = Qwen3RMSNorm(1024, 1e-6).to(dtype)
    norm.weight.data = (torch.randn(1024, generator=g) * 0.5 + 1).to(dtype)
    x = torch.randn(6, 1024, generator=g).to(dtype)
    gate, up = (torch.randn(6, 3072, generator=g) * 3).to(dtype), torch.randn(6, 3072, generator=g).to(dtype)
    q, k = torch.randn(2, 16, 5, 128, generator=g).to(dtype), torch.randn(2, 8, 5, 128, generator=g).to(dtype)
    cos, sin = torch.randn(2, 5, 128, generator=g).to(dtype), torch.randn(2, 5, 128, generator=g).to(dtype)
    wq, wk = apply_rotary_pos_emb(q, k, cos, sin)
    gq, gk = cpu_fused.rotary(ops, q, k, cos, sin)
    pairs = [(norm(x), cpu_fused.rms_norm(ops, x, norm.weight, 1e-6)),
             (F.silu(gate) * up, cpu_fused.act_and_mul(ops, gate, up)), (wq, gq), (wk, gk)]
    for want, got in pairs:
        apart = _steps_apart(want, got)
        assert apart.max() <= 1 and (apart > 0).float().mean() <= 0.01
    want = F.gelu(gate, approximate="tanh") * up
    diff = (want.float() - cpu_fused.act_and_mul(ops, gate, up, "gelu_tanh").float()).abs()
    assert bool((diff <= 2 * _eps(dtype) * want.float().abs() + 1e-5 * (gate.float() * up.float()).abs()).all())


@pytest.mark.parametrize("dtype", HALF)
def test_half_linears_take_the_small_kernel_inside_the_scope(dtype):
    """A bfloat16 / float16 nn.Linear with the engine's forward: at most HALF_SMALL_ROWS rows run the C++ small-M
    kernel inside the engine's scope, more rows F.linear (on builds without AVX-512, where torch's half-precision
    GEMM is scalar code, the C++ kernel too: ``half_any_rows``); outside the scope always F.linear (the model
    computes what it did); never packed (no copy of a half-precision weight)."""
    ops = cpu_fused.load()
    layer = torch.nn.Linear(64, 48).to(dtype)
    assert linears.install_onednn_linears(layer) == 1
    few = torch.randn(1, linears.HALF_SMALL_ROWS, 64).to(dtype)
    many = torch.randn(1, linears.HALF_SMALL_ROWS + 1, 64).to(dtype)
    packs = linears.Prepacked(layer, mode=True)
    with torch.inference_mode():
        for _ in range(2):  # a probe step, then a packed one
            with linears.onednn_scope(True, packs):
                assert torch.equal(layer(few), ops.small_linear(few, layer.weight, layer.bias))
                many_path = ops.small_linear if ops.half_any_rows else F.linear
                assert torch.equal(layer(many), many_path(many, layer.weight, layer.bias))
        assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))
    assert packs.nbytes() == 0


@st.composite
def _decode_batches(draw) -> dict:
    """Paged-attention cases whose tiles are decode tiles (fewer than 16 (query, head) rows) with head_dim % 16 == 0
    and value_dim % 128 == 0: the half-precision kernel's in-place path (attention_half.h, page_rows_direct)."""
    batch = draw(st.integers(1, 5))
    head_dim = draw(st.sampled_from([16, 128, 256]))
    return dict(
        seq_q=draw(st.lists(st.sampled_from([0, 1, 1, 1, 2, 3]), min_size=batch, max_size=batch).filter(any)),
        seq_k=draw(st.lists(st.integers(3, 300), min_size=batch, max_size=batch)),  # every row sees a key
        page=draw(st.sampled_from([1, 16, 128])), head_dim=head_dim,
        value_dim=draw(st.sampled_from([128, 128, 256])), kv_heads=draw(st.sampled_from([1, 2, 3])),
        group=draw(st.sampled_from([1, 2, 3, 4])), dtype=draw(st.sampled_from(HALF)), causal=draw(st.booleans()),
        window=draw(st.sampled_from([(-1, -1), (-1, -1), (16, 0), (5, 5), (-1, 3), (0, 0)])),
        softcap=draw(st.sampled_from([0.0, 0.0, 10.0])), s_aux=draw(st.booleans()),
        extra_cols=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**16)), generic=False,
    )


@settings(deadline=None, max_examples=60, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(c=_decode_batches())
def test_half_attention_decode_tiles_match_float64(c):
    """The in-place decode tiles against the float64 oracle, with test_kernels_cpu's tolerance (one rounding step of
    the dtype of the largest output, plus float32's) and its LSE checks."""
    if cpu_attention.status().name != "cpp":
        pytest.skip("no C++ attention kernel here")
    _check(c)



def _avx512_bf16() -> bool:
    """Whether this CPU has AVX512_BF16 (the native build then takes the bfloat16 prefill tiles' vdpbf16ps path)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in fh)
    except OSError:
        return False


def _bf16_prefill_path() -> bool:
    """Whether the attention kernel's build takes bfloat16 prefill tiles through vdpbf16ps: -march=native on a CPU
    with AVX512_BF16 (a build with -mno-avx512bf16, or without -march=native, widens them to float32)."""
    flags = cpp_build.arch_flags()
    return _avx512_bf16() and "-march=native" in flags and "-mno-avx512bf16" not in flags


def _check_prefill(c: dict, threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """_check with the tolerance of P rounded to the dtype before P.V (flash-attn's numerics for half inputs,
    docs/flash-attn-contract.md): each probability p_j is off by at most eps / 2 of itself (round to nearest), the
    running sum l is taken from the unrounded ones, so a row's output moves by at most eps / 2 * sum_j p_j |v_j| / l
    <= eps / 2 * max |v| on top of test_kernels_cpu's tolerance (one rounding step of the largest output, plus
    float32's). flash-attn's own test allows 2x (varlen) the error of the whole computation done in the dtype."""
    t, out, lse, ref, ref_lse = _run(c, threads)
    p_rounding = _eps(c["dtype"]) / 2 * t["v_pages"].double().abs().max().item()
    assert (out.double() - ref).abs().max().item() <= _tolerance(ref, c["dtype"]) + p_rounding
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert (out[torch.isinf(ref_lse)] == 0).all()
    fin = torch.isfinite(ref_lse)
    assert ((lse.double()[fin] - ref_lse[fin]).abs() / (1 + ref_lse[fin].abs())).max().item() <= 1e-5
    return out, lse


_PREFILL = dict(page=128, head_dim=128, value_dim=128, kv_heads=2, group=2, dtype=torch.bfloat16, causal=True,
                window=(-1, -1), softcap=0.0, s_aux=False, extra_cols=1, seed=5, generic=False)


@st.composite
def _prefill_batches(draw) -> dict:
    """Paged-attention cases whose tiles are prefill tiles (16 or more (query, head) rows): long prompts over several
    pages (page sizes that do and do not divide the 128-key blocks), chunks after cached keys (seqlens_k > query
    rows), even head dims (not all multiples of 16 or 32: 72, 80) and value dims a multiple of 16: bfloat16's
    vdpbf16ps path on an AVX512_BF16 build (attention_half.h, bf16_prefill), float16's widened copies."""
    batch = draw(st.integers(1, 3))
    seq_q = draw(st.lists(st.sampled_from([8, 16, 33, 130, 300]), min_size=batch, max_size=batch))
    cached = draw(st.lists(st.sampled_from([0, 0, 1, 77, 256, 300]), min_size=batch, max_size=batch))
    head_dim = draw(st.sampled_from([64, 128, 72, 80]))
    return dict(
        seq_q=seq_q, seq_k=[q + k for q, k in zip(seq_q, cached, strict=True)],
        page=draw(st.sampled_from([16, 48, 128])), head_dim=head_dim,
        value_dim=draw(st.sampled_from([head_dim, head_dim, 48, 128])), kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 4])), dtype=draw(st.sampled_from([torch.bfloat16] * 3 + [torch.float16])),
        causal=draw(st.booleans()), window=draw(st.sampled_from([(-1, -1), (-1, -1), (100, 0), (5, 5), (-1, 3)])),
        softcap=draw(st.sampled_from([0.0, 0.0, 30.0])), s_aux=draw(st.booleans()),
        extra_cols=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**16)), generic=False,
    )


@settings(deadline=None, max_examples=40, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(c=_prefill_batches())
def test_half_attention_prefill_tiles_match_float64(c):
    """Prefill tiles against the float64 oracle, with P's rounding in the tolerance (_check_prefill)."""
    if cpu_attention.status().name != "cpp":
        pytest.skip("no C++ attention kernel here")
    _check_prefill(c)


@pytest.mark.parametrize("case", [
    dict(seq_q=[700], seq_k=[700]),                                   # a long prompt over six pages
    dict(seq_q=[300, 58, 58], seq_k=[1100, 570, 570], group=4),       # chunks after cached keys, GQA 4
    dict(seq_q=[260], seq_k=[260], group=1, head_dim=64, value_dim=64, page=16),
    dict(seq_q=[200], seq_k=[450], head_dim=80, value_dim=80, window=(64, 0), s_aux=True),  # 80: not % 32
    dict(seq_q=[100], seq_k=[100], head_dim=72, value_dim=64, group=1, page=16, extra_cols=2),  # 72: not % 16
    dict(seq_q=[150], seq_k=[150], softcap=30.0, causal=False, page=48),
])
def test_bf16_prefill_long_prompts(case):
    """Long bfloat16 prompts (16 heads' shapes scaled down) on both the vdpbf16ps tiles and the widened copies
    (generic: the portable mode): each within the tolerance; on an AVX512_BF16 CPU they differ (P rounded)."""
    if cpu_attention.status().name != "cpp":
        pytest.skip("no C++ attention kernel here")
    c = dict(_PREFILL, **case)
    new, new_lse = _check_prefill(c)
    old, _ = _check_prefill(dict(c, generic=True))
    assert torch.equal(new, old) != _bf16_prefill_path()


@pytest.mark.parametrize("case", [
    dict(head_dim=33, value_dim=33),             # an odd head dim: no bfloat16 pairs
    dict(head_dim=64, value_dim=40),             # a value dim not a multiple of 16
    dict(dtype=torch.float16),                   # float16: the widened copies on every build
])
def test_half_prefill_falls_back_to_widened_copies(case):
    """Prefill tiles the vdpbf16ps path does not take give the widened copies' bits exactly (the portable mode's)."""
    if cpu_attention.status().name != "cpp":
        pytest.skip("no C++ attention kernel here")
    c = dict(_PREFILL, seq_q=[90, 40], seq_k=[200, 40], **case)
    new, _ = _check_prefill(c)
    old, _ = _check_prefill(dict(c, generic=True))
    assert torch.equal(new, old)


def test_bf16_prefill_bits_do_not_depend_on_the_tile():
    """The vdpbf16ps tiles take up to 128 query rows where that leaves 4 tasks per thread (130 rows, 2 KV heads: 128
    on one thread, 32 on two); key blocks are fixed and each row's sums its own, so the bits are the same."""
    if cpu_attention.status().name != "cpp":
        pytest.skip("no C++ attention kernel here")
    c = dict(_PREFILL, seq_q=[130], seq_k=[400], window=(150, 0), s_aux=True)
    out1, lse1 = _check_prefill(c)
    out2, lse2 = _check_prefill(c, threads=2)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
