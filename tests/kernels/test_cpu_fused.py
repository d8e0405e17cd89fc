"""The one-pass C++ CPU ops (flashpage/kernels/cpu_fused.py) against float64 references.

RMSNorm (offset 0 / 1, D not a multiple of 16, odd D, empty rows, non-contiguous input),
activation-and-product (silu, gelu tanh; gate / up as the strided halves of one fused GEMM output,
large magnitudes where exp saturates), rotary ((B, H, L, D) and (B, L, H, D) layouts, q / k as views
of one fused qkv output, cos / sin batch 1 or B; inputs never written). float32 and float64. Then the
errors for bad shapes, the fallback when no compiler is found, and what ``flashpage info`` says. The
engine-level checks (LLM tokens equal transformers' with the C++ ops taken) are in test_fastpath.py.
Each test runs on the engine's build (-march=native: AVX-512 where the CPU has it) and on a portable
build (plain loops). The first tests in a fresh environment build both once (about 10 s each).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashpage.kernels import cpu_fused

pytestmark = [pytest.mark.skipif(cpu_fused.status().name != "cpp",
                                 reason="no C++ compiler / ninja here: the torch forms run (tested in test_fastpath)"),
              pytest.mark.usefixtures("one_thread")]

DIMS = [1, 3, 15, 16, 17, 33, 64, 100, 256]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", params=["native", "portable"])
def ops(request) -> cpu_fused.Ops:
    """The ops as the engine loads them (-march=native: AVX-512 where the CPU has it) and the portable
    build (plain loops: what a CPU without AVX-512 runs)."""
    if request.param == "portable":
        return cpu_fused._build(portable=True)
    built = cpu_fused.load()
    assert built is not None, "status() said cpp"
    return built


def _tol(dtype: torch.dtype) -> float:
    return 2e-6 if dtype == torch.float32 else 1e-12


def _assert_close(got: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype,
                  scale: torch.Tensor | None = None) -> None:
    """got (any dtype) within a relative tolerance of the float64 reference, elementwise; ``scale`` (the
    factor a result was multiplied by, as ``up`` for ``act(gate) * up``) scales the bound."""
    assert got.dtype == dtype and got.shape == want64.shape
    err = (got.double() - want64).abs()
    bound = _tol(dtype) * (1 + want64.abs()) * 4
    if scale is not None:
        bound = bound * (1 + scale.double().abs())
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"


@SETTINGS
@given(lead=st.lists(st.integers(0, 5), min_size=0, max_size=3), d=st.sampled_from(DIMS),
       offset=st.sampled_from([0.0, 1.0]), eps=st.sampled_from([1e-6, 1e-5, 0.1]),
       dtype=st.sampled_from([torch.float32, torch.float64]), layout=st.sampled_from(["dense", "moved", "slice"]),
       seed=st.integers(0, 999))
def test_rms_norm_matches_float64(ops, lead, d, offset, eps, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, d, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)
    if layout == "moved":  # last dim strided: same values, other strides
        x = x.movedim(-1, 0).contiguous().movedim(0, -1)
    elif layout == "slice":  # rows at a stride, as a (B, L, H, D) view of a fused qkv GEMM output
        wide = (torch.randn(*lead, 3 * d + 1, generator=g, dtype=torch.float64) * 3).to(dtype)
        x = wide[..., d:2 * d]
        if len(lead) >= 2:
            x = x.transpose(0, 1)
    w = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
    x64, w64 = x.double(), w.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (w64 + offset)
    got = cpu_fused.rms_norm(ops, x, w, eps, offset)
    _assert_close(got, want, dtype)
    assert got.is_contiguous()


def _act64(g: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")


@SETTINGS
@given(rows=st.lists(st.integers(0, 7), min_size=1, max_size=2), inner=st.sampled_from(DIMS),
       act=st.sampled_from(sorted(cpu_fused.ACTIVATIONS)), dtype=st.sampled_from([torch.float32, torch.float64]),
       fused=st.booleans(), scale=st.sampled_from([1.0, 4.0, 60.0]), seed=st.integers(0, 999))
def test_act_and_mul_matches_float64_on_fused_gemm_halves(ops, rows, inner, act, dtype, fused, scale, seed):
    g = torch.Generator().manual_seed(seed)
    if fused:  # gate | up as one (..., 2I) GEMM output: both halves row-strided views
        both = (torch.randn(*rows, 2 * inner, generator=g, dtype=torch.float64) * scale).to(dtype)
        gate, up = both[..., :inner], both[..., inner:]
        assert gate.numel() == 0 or gate.stride(-2) == up.stride(-2) == 2 * inner
    else:
        gate = (torch.randn(*rows, inner, generator=g, dtype=torch.float64) * scale).to(dtype)
        up = torch.randn(*rows, inner, generator=g, dtype=torch.float64).to(dtype)
    before = (gate.clone(), up.clone())
    got = cpu_fused.act_and_mul(ops, gate, up, act)
    _assert_close(got, _act64(gate.double(), act) * up.double(), dtype, scale=up)  # act's error times |up|
    assert got.is_contiguous() and torch.equal(gate, before[0]) and torch.equal(up, before[1])


def test_act_and_mul_saturates_like_torch(ops):
    gate = torch.tensor([-1e4, -200.0, -88.0, -20.0, -1e-7, 0.0, 1e-7, 20.0, 88.0, 200.0, 1e4] * 3)
    up = torch.ones_like(gate)
    for act in cpu_fused.ACTIVATIONS:
        got = cpu_fused.act_and_mul(ops, gate, up, act)
        want = _act64(gate.double(), act)
        assert torch.isfinite(got).all(), act
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6), (act, got, want)


def _rotate_half64(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@SETTINGS
@given(batch=st.integers(1, 3), length=st.integers(0, 9), heads=st.sampled_from([1, 4, 6]),
       kv_heads=st.sampled_from([1, 2]), d=st.sampled_from([2, 6, 16, 34, 64, 130]),
       unsqueeze_dim=st.sampled_from([1, 2]),
       dtype=st.sampled_from([torch.float32, torch.float64]), cos_batch_one=st.booleans(), seed=st.integers(0, 999))
def test_rotary_matches_float64_in_both_layouts(ops, batch, length, heads, kv_heads, d, unsqueeze_dim, dtype,
                                                cos_batch_one, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, (heads + 2 * kv_heads) * d, generator=g, dtype=torch.float64).to(dtype)
    q = qkv[..., :heads * d].view(batch, length, heads, d)  # views of one fused qkv GEMM output
    k = qkv[..., heads * d:(heads + kv_heads) * d].view(batch, length, kv_heads, d)
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cb = 1 if cos_batch_one else batch
    cos = torch.randn(cb, length, d, generator=g, dtype=torch.float64).to(dtype)
    sin = torch.randn(cb, length, d, generator=g, dtype=torch.float64).to(dtype)
    before = qkv.clone()
    got_q, got_k = cpu_fused.rotary(ops, q, k, cos, sin, unsqueeze_dim)
    c, s = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    for got, x in ((got_q, q), (got_k, k)):
        _assert_close(got, x.double() * c + _rotate_half64(x.double()) * s, dtype)
        packed = got.transpose(1, 2) if unsqueeze_dim == 1 else got
        assert packed.is_contiguous(), "laid out (B, L, H, D): the attention's packed view needs no copy"
    assert torch.equal(qkv, before), "the inputs are never written"


@SETTINGS
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), rows=st.integers(0, 5),
       k=st.sampled_from([0, 1, 7, 8, 16, 24, 100, 256]), n=st.sampled_from([1, 5, 8, 13, 64, 130]),
       bias=st.booleans(), layout=st.sampled_from(["dense", "slice"]), seed=st.integers(0, 999))
def test_small_linear_matches_float64(ops, lead, rows, k, n, bias, layout, seed):
    """Every (rows, K, N): multiples of 8 take the vector loop, the rest (and the portable build) one dot per
    output; x may be a non-contiguous view (copied), a bias is added; float32 only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, k + (3 if layout == "slice" else 0), generator=g)[..., :k]
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_fused.small_linear(ops, x, w, b)
    want = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert got.shape == (*lead, rows, n) and got.is_contiguous()
    err = (got.double() - want).abs()
    bound = 1e-6 * (x.double().abs() @ w.double().abs().T + 1) * 4
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"


def test_bad_shapes_name_the_problem(ops):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"rms_norm: x \(\.\.\., D\) and w \(D,\)"):
        cpu_fused.rms_norm(ops, x, torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="rms_norm: float32 / float64 / bfloat16 / float16 x and w of one dtype"):
        cpu_fused.rms_norm(ops, x.half(), torch.randn(8).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="act_and_mul: gate and up of one shape"):
        cpu_fused.act_and_mul(ops, x, torch.randn(4, 9))
    with pytest.raises(RuntimeError, match=r"small_linear: x \(\.\.\., K\) and w \(N, K\)"):
        cpu_fused.small_linear(ops, x, torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="small_linear: float32 / bfloat16 / float16 x and w of one dtype"):
        cpu_fused.small_linear(ops, x.double(), torch.randn(3, 8).double())
    with pytest.raises(RuntimeError, match=r"small_linear: bias \(N,\) of x.s dtype"):
        cpu_fused.small_linear(ops, x, torch.randn(3, 8), torch.randn(4))
    q, cos = torch.randn(1, 2, 3, 6), torch.randn(1, 3, 6)
    with pytest.raises(RuntimeError, match="rotary: the head dim must be even"):
        cpu_fused.rotary(ops, q[..., :5], q[..., :5], cos[..., :5], cos[..., :5])
    with pytest.raises(RuntimeError, match="rotary: cos / sin .* do not match"):
        cpu_fused.rotary(ops, q, q, cos[:, :2], cos[:, :2])


class _Norm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], self.weight, self.variance_epsilon)


def test_no_compiler_warns_once_and_status_says_why(monkeypatch):
    import warnings

    monkeypatch.setattr(cpu_fused, "_ops", None)
    monkeypatch.setattr(cpu_fused, "_failure", None)
    monkeypatch.setattr(cpu_fused, "_missing_tools", lambda: "no C++ compiler ('c++' / g++ not on PATH)")
    monkeypatch.setattr(cpu_fused, "_build", lambda: pytest.fail("must not try to build"))
    with pytest.warns(UserWarning, match="fused C\\+\\+ CPU ops are unavailable .*no C\\+\\+ compiler"):
        assert cpu_fused.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only once
        assert cpu_fused.load() is None
    state = cpu_fused.status()
    assert state.name == "torch" and "no C++ compiler" in state.reason

    from flashpage.engine import fastpath

    fused = fastpath.probe_norm(torch.nn.Sequential())  # not a norm at all
    assert fused is None
    fused = fastpath.probe_norm(_Norm(8))
    assert fused is not None and not fused.cpp, "without the ops: the torch form, probed as before"


def test_info_says_whether_the_ops_run(monkeypatch):
    from flashpage.info import collect_info, format_info

    text = format_info(collect_info())
    assert "C++" in collect_info()["cpu_threads"]["eager_fastpath"]
    assert "FLASHPAGE_FASTPATH=torch" in text
    monkeypatch.setenv("FLASHPAGE_FASTPATH", "torch")
    assert "torch ops only" in collect_info()["cpu_threads"]["eager_fastpath"]
