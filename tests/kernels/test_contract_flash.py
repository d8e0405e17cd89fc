"""Contract tests: flashpage's flash-attn calls through flash-attn's *own* Python files.

flash-attn's interface files, as its PyPI releases ship them (FA2: flash-attn 2.5.9.post1,
2.6.0.post1, 2.6.1 and 2.8.3.post2; FA3: the hopper/ of flash-attn 2.8.3.post2, from before PR
#1851, and "main", after it, which no release ships yet, so its tests skip; FA4: flash-attn-4
4.0.0b27), are loaded over stand-ins for their compiled parts (tests/flash_standins.py: the C++
checks in order, float64 math; downloaded once, see docs/flash-attn-contract.md). Every call
flashpage sends must pass those checks and agree with flashpage's reference; a call a backend
cannot take must go elsewhere (the stand-in is never called) and still agree. The table of
issue 10 (A-G) has one test each; "bug demo" tests call the real interface directly with the
arguments flashpage used to send, to show the stand-in reproduces the upstream behaviour.
"""

from __future__ import annotations

import ast
import inspect
import random
import re
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass

import flash_standins as fs
import pytest
import torch

from flashpage.kernels import dispatch, flash_attn_varlen_func, flash_attn_with_kvcache, flash_backends

pytestmark = pytest.mark.usefixtures("fresh_backends")  # each loader skips when its release is missing
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}




def _clone(case: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert a.shape == b.shape and diff <= TOL.get(dtype, 1e-4), f"{what}: max diff {diff}, shapes {a.shape} {b.shape}"


def _lse_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    inf_a, inf_b = torch.isinf(a), torch.isinf(b)
    assert torch.equal(inf_a, inf_b) and torch.equal(a[inf_a], b[inf_b]), f"{what}: infinite LSE rows differ"
    _close(a[~inf_a], b[~inf_b], torch.float32, what)


# ------------------------------------------------------------------ random kvcache cases
@dataclass(frozen=True)
class Backend:
    key: str
    tag: str

    def load(self):
        if self.key == "fa2":
            return fs.load_fa2(self.tag)
        if self.key == "fa3":
            return fs.load_fa3(self.tag)
        mod, kernels = fs.load_fa4(int(self.tag))
        return mod, kernels


BACKENDS = [Backend("fa2", t) for t in fs.FA2_TAGS] + [Backend("fa3", t) for t in fs.FA3_TAGS] + \
    [Backend("fa4", "90"), Backend("fa4", "100")]


def _calls(ext) -> int:
    return len(ext.calls)


def random_kvcache(rng: random.Random, backend: Backend) -> tuple[dict, dict]:
    """A valid flash_attn_with_kvcache call; the second dict says which features it uses."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    dtype = rng.choice([torch.float16, torch.bfloat16])
    kv_heads = rng.choice([1, 2])
    heads = kv_heads * rng.choice([1, 2, 4])
    dim = rng.choice([32, 64])
    batch = rng.randint(1, 3)
    seqlen_q = rng.choice([1, 1, 2, 5])
    paged = rng.random() < 0.7
    if backend.key == "fa2":
        page = 256
    else:
        page = rng.choice([16, 64, 256])
    feats = {"alibi": backend.key == "fa2" and rng.random() < 0.3,
             "softcap": rng.random() < 0.3,
             "append": backend.key != "fa4" and rng.random() < 0.6,
             "causal": rng.random() < 0.6,
             "window": rng.random() < 0.4,
             "lse": rng.random() < 0.5}
    feats["rotary"] = feats["append"] and rng.random() < 0.5
    feats["leftpad"] = not paged and backend.key != "fa4" and rng.random() < 0.4
    feats["batch_idx"] = not paged and backend.key != "fa4" and rng.random() < 0.4
    new = rng.randint(1, 3) if feats["append"] else 0
    if feats["append"]:
        new = max(new, 1)
    if paged:
        per_seq = rng.randint(1, 3) if page == 256 else rng.randint(2, 12)
        capacity = per_seq * page
        nb = batch * per_seq + 2
        k_cache = torch.randn(nb, page, kv_heads, dim, generator=g).to(dtype)
        table = torch.randperm(nb, generator=g)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    else:
        capacity = rng.choice([24, 70, 300])
        rows = batch + (rng.randint(0, 2) if not feats["leftpad"] else 0)
        k_cache = torch.randn(rows, capacity, kv_heads, dim, generator=g).to(dtype)
        table = None
    v_cache = torch.randn_like(k_cache.float(), dtype=torch.float32).to(dtype)
    lengths = torch.tensor([rng.randint(0, capacity - new) for _ in range(batch)], dtype=torch.int32)
    case = dict(q=torch.randn(batch, seqlen_q, heads, dim, generator=g).to(dtype), k_cache=k_cache,
                v_cache=v_cache, cache_seqlens=lengths, block_table=table, causal=feats["causal"])
    if feats["append"]:
        case["k"] = torch.randn(batch, new, kv_heads, dim, generator=g).to(dtype)
        case["v"] = torch.randn(batch, new, kv_heads, dim, generator=g).to(dtype)
    if feats["window"]:
        case["window_size"] = (rng.choice([-1, 0, 3, 40, capacity]), rng.choice([-1, 0, 2, capacity]))
    if feats["softcap"]:
        case["softcap"] = rng.choice([5.0, 30.0])
    if feats["alibi"]:
        case["alibi_slopes"] = torch.rand(heads, generator=g) * 0.3
    if feats["rotary"]:
        rd = rng.choice([16, dim])
        angle = torch.rand(capacity, rd // 2, generator=g) * 6.28
        case.update(rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype),
                    rotary_interleaved=rng.random() < 0.5)
    if feats["leftpad"]:
        case["cache_leftpad"] = torch.tensor([rng.randint(0, int(n)) for n in lengths], dtype=torch.int32)
    if feats["batch_idx"]:
        case["cache_batch_idx"] = torch.randperm(k_cache.shape[0], generator=g)[:batch].to(torch.int32)
    if feats["lse"]:
        case["return_softmax_lse"] = True
    return case, feats


def _fa2_can(tag: str, feats: dict) -> bool:
    old = tag == "v2.5.9"
    return not ((old and (feats["softcap"] or feats["lse"])) or (tag in ("v2.5.9", "v2.6.0") and feats["leftpad"]))


def _run_pair(backend: Backend, case: dict, entry) -> tuple:
    mod, ext = backend.load()
    a, b = _clone(case), _clone(case)
    with dispatch.force_backend(backend.key, mod):
        got = entry(**a)
    want = entry(**b)
    return got, want, a, b, ext


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"{b.key}-{b.tag}")
def test_random_kvcache_calls_pass_checks_and_agree(backend: Backend):
    rng = random.Random(f"kvcache-{backend.key}-{backend.tag}")
    reached = 0
    for i in range(24):
        case, feats = random_kvcache(rng, backend)
        mod, ext = backend.load()
        a, b = _clone(case), _clone(case)
        with dispatch.force_backend(backend.key, mod):
            got = flash_attn_with_kvcache(**a)
        want = flash_attn_with_kvcache(**b)
        dtype = case["q"].dtype
        if feats["lse"]:
            _close(got[0], want[0], dtype, f"case {i} out")
            _lse_close(got[1], want[1], f"case {i} lse")
        else:
            _close(got, want, dtype, f"case {i} out")
        _close(a["k_cache"], b["k_cache"], dtype, f"case {i} k_cache")
        assert torch.equal(a["v_cache"], b["v_cache"]), f"case {i}: v_cache after the append differs"
        if backend.key == "fa2" and _fa2_can(backend.tag, feats):
            assert _calls(ext) == 1, f"case {i} ({feats}) should reach flash-attn {backend.tag}"
        if backend.key == "fa4":
            assert _calls(ext) == (0 if feats["alibi"] or feats["rotary"] else 1)
        reached += _calls(ext)
    assert reached >= 8


def random_varlen(rng: random.Random, backend: Backend) -> dict:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    dtype = rng.choice([torch.float16, torch.bfloat16])
    kv_heads = rng.choice([1, 2])
    heads = kv_heads * rng.choice([1, 2, 4])
    dim = rng.choice([32, 64])
    batch = rng.randint(1, 4)
    decode = rng.random() < 0.3
    seq_q = [1] * batch if decode else [rng.randint(0 if i else 1, 6) for i in range(batch)]
    seq_k = [rng.randint(max(q, 1), 400) for q in seq_q]
    cu_q = torch.tensor([0, *torch.tensor(seq_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(seq_k).cumsum(0).tolist()], dtype=torch.int32)
    extra_rows = rng.choice([0, 0, 2])
    case = dict(q=torch.randn(sum(seq_q) + extra_rows, heads, dim, generator=g).to(dtype), cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k, max_seqlen_q=max(seq_q), max_seqlen_k=max(seq_k), causal=rng.random() < 0.7)
    paged = backend.key != "fa3" or rng.random() < 0.7
    if paged:
        page = 256 if backend.key == "fa2" else rng.choice([16, 256])
        per_seq = -(-max(seq_k) // page) + rng.randint(0, 1)
        nb = batch * per_seq + 1
        case["k"] = torch.randn(nb, page, kv_heads, dim, generator=g).to(dtype)
        case["v"] = torch.randn(nb, page, kv_heads, dim, generator=g).to(dtype)
        case["block_table"] = torch.randperm(nb, generator=g)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    else:
        case["k"] = torch.randn(sum(seq_k), kv_heads, dim, generator=g).to(dtype)
        case["v"] = torch.randn(sum(seq_k), kv_heads, dim, generator=g).to(dtype)
    if rng.random() < 0.4:
        case["window_size"] = (rng.choice([-1, 0, 5, 100]), rng.choice([-1, 0, 3]))
    if rng.random() < 0.3:
        case["softcap"] = 20.0
    if backend.key == "fa2" and rng.random() < 0.3:
        case["alibi_slopes"] = torch.rand(batch, heads, generator=g) * 0.3
    if rng.random() < 0.4:
        case["return_attn_probs"] = True
    return case


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"{b.key}-{b.tag}")
def test_random_varlen_calls_pass_checks_and_agree(backend: Backend):
    rng = random.Random(f"varlen-{backend.key}-{backend.tag}")
    reached = 0
    for i in range(16):
        case = random_varlen(rng, backend)
        got, want, _, _, ext = _run_pair(backend, case, flash_attn_varlen_func)
        rows = int(case["cu_seqlens_q"][-1])  # rows past cu_seqlens_q[-1] are not defined by the contract
        if case.get("return_attn_probs"):
            _close(got[0][:rows], want[0][:rows], case["q"].dtype, f"case {i} out")
            _lse_close(got[1][:, :rows], want[1][:, :rows], f"case {i} lse")
        else:
            _close(got[:rows], want[:rows], case["q"].dtype, f"case {i} out")
        reached += _calls(ext)
    assert reached >= 8


# ------------------------------------------------------------------ issue 10's table
@contextmanager
def _on(backend: Backend):
    mod, ext = backend.load()
    with dispatch.force_backend(backend.key, mod):
        yield ext


def _plain_kvcache(dtype=torch.float16, page=256, dim=64, heads=4, kv_heads=2, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(2, 1, heads, dim, generator=g).to(dtype),
                k_cache=torch.randn(5, page, kv_heads, dim, generator=g).to(dtype),
                v_cache=torch.randn(5, page, kv_heads, dim, generator=g).to(dtype),
                k=torch.randn(2, 1, kv_heads, dim, generator=g).to(dtype),
                v=torch.randn(2, 1, kv_heads, dim, generator=g).to(dtype),
                cache_seqlens=torch.tensor([3, 200], dtype=torch.int32),
                block_table=torch.tensor([[0, 1], [3, 2]], dtype=torch.int32), causal=True)


@pytest.mark.parametrize("tag", fs.FA2_TAGS)
def test_a_every_fa2_release_takes_the_kvcache_call(tag):
    """A: flashpage used to pass return_softmax_lse (and cache_leftpad) to releases without them."""
    mod, _ = fs.load_fa2(tag)
    if tag in ("v2.5.9", "v2.6.0"):
        with pytest.raises(TypeError):  # what the old call did
            mod.flash_attn_with_kvcache(**_plain_kvcache(), cache_leftpad=None, return_softmax_lse=False)
    case = _plain_kvcache()
    with _on(Backend("fa2", tag)) as ext:
        got = flash_attn_with_kvcache(**_clone(case))
    assert len(ext.calls) == 1
    _close(got, flash_attn_with_kvcache(**_clone(case)), torch.float16, tag)
    with _on(Backend("fa2", tag)) as ext:  # the LSE needs >= 2.6: older releases route to the reference
        flash_attn_with_kvcache(**_clone(case), return_softmax_lse=True)
        why = dispatch.explain("flash_attn_with_kvcache", device="cpu", dtype=torch.float16, block_size=256)
    assert len(ext.calls) == (0 if tag == "v2.5.9" else 1) and why.name == "fa2"


@pytest.mark.parametrize("tag", fs.FA3_TAGS)
def test_b_fa3_varlen_without_a_cache_on_both_interfaces(tag):
    """B: return_attn_probs / deterministic only exist in FA3's varlen since PR #1851."""
    case = random_varlen(random.Random(3), Backend("fa3", tag))
    case.pop("block_table", None)
    g = torch.Generator().manual_seed(1)
    total_k = int(case["cu_seqlens_k"][-1])
    case["k"] = torch.randn(total_k, *case["k"].shape[-2:], generator=g).to(case["q"].dtype)
    case["v"] = torch.randn_like(case["k"], dtype=torch.float32).to(case["q"].dtype)
    case.pop("return_attn_probs", None)
    rows = int(case["cu_seqlens_q"][-1])
    for lse in (False, True):
        with _on(Backend("fa3", tag)) as ops:
            got = flash_attn_varlen_func(**_clone(case), return_attn_probs=lse)
        want = flash_attn_varlen_func(**_clone(case), return_attn_probs=lse)
        out_g, out_w = (got[0], want[0]) if lse else (got, want)
        _close(out_g[:rows], out_w[:rows], case["q"].dtype, f"{tag} lse={lse}")
        assert len(ops.calls) == (0 if lse and not fs.FA3_HAS_PR1851[tag] else 1)


def test_c1_fa3_dense_cache_with_more_rows_than_the_batch():
    """C1: FA3 checks batch_size == batch_size_k when there is no cache_batch_idx."""
    g = torch.Generator().manual_seed(2)
    case = dict(q=torch.randn(2, 3, 4, 32, generator=g).half(), k_cache=torch.randn(5, 40, 2, 32, generator=g).half(),
                v_cache=torch.randn(5, 40, 2, 32, generator=g).half(), k=torch.randn(2, 3, 2, 32, generator=g).half(),
                v=torch.randn(2, 3, 2, 32, generator=g).half(), cache_seqlens=torch.tensor([4, 30], dtype=torch.int32),
                causal=True)
    mod, _ = fs.load_fa3(fs.FA3_RELEASED)
    with pytest.raises(RuntimeError, match="batch_size must be equal to batch_size_k"):
        mod.flash_attn_with_kvcache(**_clone(case))
    got, want, a, b, ops = _run_pair(Backend("fa3", fs.FA3_RELEASED), case, flash_attn_with_kvcache)
    assert len(ops.calls) == 1
    _close(got, want, torch.float16, "out")
    assert torch.equal(a["k_cache"][:2], b["k_cache"][:2]) and torch.equal(a["k_cache"][2:], case["k_cache"][2:])


@pytest.mark.parametrize("backend", [Backend("fa2", fs.FA2_NEWEST), Backend("fa3", fs.FA3_RELEASED),
                                     Backend("fa4", "90")], ids=lambda b: b.key)
def test_c2_head_dim_not_a_multiple_of_8_never_reaches_flash_attn_with_a_cache(backend):
    """C2: FA3/FA4 reject head_dim % 8; FA2 pads by copying the whole KV cache on every call."""
    case = _plain_kvcache(page=256, dim=36)
    case.pop("k"), case.pop("v")
    with _on(backend) as ext:
        got = flash_attn_with_kvcache(**_clone(case))
        why = dispatch.explain("flash_attn_with_kvcache", device="cpu", dtype=torch.float16, block_size=256)
    assert len(ext.calls) == 0
    _close(got, flash_attn_with_kvcache(**_clone(case)), torch.float16, "out")
    assert why.name == backend.key  # the rule is about head_dim only
    varlen = random_varlen(random.Random(5), backend)
    d36 = {k: (torch.cat([v, v], -1)[..., :36].contiguous() if k in ("q", "k", "v") else v)
           for k, v in varlen.items()}
    assert d36["q"].shape[-1] == 36
    with _on(backend) as ext:
        flash_attn_varlen_func(**_clone(d36))
    assert len(ext.calls) == 0


def _decode_varlen(seq_q: list[int], extra_rows: int, paged: bool, seed: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    seq_k = [7, 300, 40][: len(seq_q)]
    heads, kv_heads, dim = 8, 2, 32
    case = dict(q=torch.randn(sum(seq_q) + extra_rows, heads, dim, generator=g).half(),
                cu_seqlens_q=torch.tensor([0, *torch.tensor(seq_q).cumsum(0).tolist()], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, *torch.tensor(seq_k).cumsum(0).tolist()], dtype=torch.int32),
                max_seqlen_q=1, max_seqlen_k=max(seq_k), causal=True)
    if paged:
        case["k"] = torch.randn(7, 256, kv_heads, dim, generator=g).half()
        case["v"] = torch.randn(7, 256, kv_heads, dim, generator=g).half()
        case["block_table"] = torch.tensor([[5, 0], [1, 2], [3, 6]], dtype=torch.int32)[: len(seq_q)]
    else:
        case["k"] = torch.randn(sum(seq_k), kv_heads, dim, generator=g).half()
        case["v"] = torch.randn(sum(seq_k), kv_heads, dim, generator=g).half()
    return case


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("seq_q,extra", [([1, 0, 1], 0), ([1, 0, 1], 1), ([1, 1, 1], 2)])
def test_d_one_query_gqa_varlen_with_empty_sequences_or_spare_rows(paged, seq_q, extra):
    """D: FA2 reshapes a max_seqlen_q == 1 GQA call by the batch size and ignores cu_seqlens_q."""
    case = _decode_varlen(seq_q, extra, paged)
    rows = sum(seq_q)
    mod, _ = fs.load_fa2(fs.FA2_NEWEST)
    if sum(seq_q) + extra == len(seq_q):  # the old call: silently wrong
        bad = mod.flash_attn_varlen_func(**_clone(case))
        assert (bad[:rows].double() - flash_attn_varlen_func(**_clone(case))[:rows].double()).abs().max() > 0.1
    else:  # the old call: a reshape error
        with pytest.raises(RuntimeError, match="invalid for input of size"):
            mod.flash_attn_varlen_func(**_clone(case))
    got, want, _, _, ext = _run_pair(Backend("fa2", fs.FA2_NEWEST), case, flash_attn_varlen_func)
    assert len(ext.calls) == 1
    _close(got[:rows], want[:rows], torch.float16, "out")


def test_d_uniform_decode_keeps_fa2_fast_path():
    case = _decode_varlen([1, 1, 1], 0, True)
    got, want, _, _, ext = _run_pair(Backend("fa2", fs.FA2_NEWEST), case, flash_attn_varlen_func)
    assert ext.calls[0][1]["window_size_left"] == -1  # the reshape (seqlenq_ngroups_swapped) still happens
    _close(got, want, torch.float16, "out")


def test_e_mqa_append_into_a_short_dense_cache():
    """E: FA2's decode reshape makes seqlen_q = heads per KV head before its length check."""
    g = torch.Generator().manual_seed(6)
    case = dict(q=torch.randn(2, 1, 8, 32, generator=g).half(), k_cache=torch.randn(2, 4, 1, 32, generator=g).half(),
                v_cache=torch.randn(2, 4, 1, 32, generator=g).half(), k=torch.randn(2, 1, 1, 32, generator=g).half(),
                v=torch.randn(2, 1, 1, 32, generator=g).half(), cache_seqlens=torch.tensor([1, 3], dtype=torch.int32))
    mod, _ = fs.load_fa2(fs.FA2_NEWEST)
    with pytest.raises(RuntimeError, match="must have seqlen <= the seqlen of the KV cache"):
        mod.flash_attn_with_kvcache(**_clone(case))
    got, want, a, b, ext = _run_pair(Backend("fa2", fs.FA2_NEWEST), case, flash_attn_with_kvcache)
    assert len(ext.calls) == 1
    _close(got, want, torch.float16, "out")
    assert torch.equal(a["v_cache"], b["v_cache"])


def _rotary_window_case() -> dict:
    g = torch.Generator().manual_seed(7)
    angle = torch.rand(512, 16, generator=g) * 6.28
    case = _plain_kvcache(dim=64)
    q = torch.randn(2, 4, 4, 64, generator=g).half()
    case.update(q=q, k=torch.randn(2, 4, 2, 64, generator=g).half(), v=torch.randn(2, 4, 2, 64, generator=g).half(),
                rotary_cos=angle.cos().half(), rotary_sin=angle.sin().half(), causal=False,
                window_size=(511, -1))  # FA2: local (rows rotated one by one); FA3: dropped (>= 512 - 1)
    return case


def test_f_fa3_does_not_take_rotary_with_a_window_it_would_drop():
    """F: FA3 drops a window that masks nothing earlier than FA2, which moves rotary's query rows."""
    case = _rotary_window_case()
    mod, _ = fs.load_fa3(fs.FA3_RELEASED)
    a, b = _clone(case), _clone(case)
    a["page_table"] = a.pop("block_table")
    old = mod.flash_attn_with_kvcache(**a)  # the old call
    want = flash_attn_with_kvcache(**b)
    assert (old.double() - want.double()).abs().max() > 0.5
    got, want, _, _, ops = _run_pair(Backend("fa3", fs.FA3_RELEASED), case, flash_attn_with_kvcache)
    assert len(ops.calls) == 0
    _close(got, want, torch.float16, "out")
    got, want, _, _, ext = _run_pair(Backend("fa2", fs.FA2_NEWEST), case, flash_attn_with_kvcache)
    assert len(ext.calls) == 1
    _close(got, want, torch.float16, "out")


@pytest.mark.parametrize("cap,fa3,fa4,order", [
    ((8, 0), None, "flash-attn 4 runs here", ("fa3", "fa2", "fa4")),
    ((8, 9), None, "flash-attn 4 runs here", ("fa3", "fa2", "fa4")),
    ((9, 0), None, None, ("fa3", "fa2", "fa4")),
    ((10, 0), None, None, ("fa4", "fa3", "fa2")),
    ((7, 5), "needs an Ampere", "flash-attn 4 runs here", ("fa3", "fa2", "fa4")),
])
def test_g_compute_capabilities(monkeypatch, cap, fa3, fa4, order):
    """G: FA3 builds sm80 kernels too; FA4 runs on Hopper and Blackwell; FA4 leads on Blackwell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    dev = torch.device("cuda", 0)
    for key, expected in (("fa3", fa3), ("fa4", fa4)):
        reason = flash_backends._device_problem(key, dev, forced=False)
        assert (reason is None) if expected is None else (expected in reason), (key, reason)
    assert flash_backends.preference(dev) == order


# ------------------------------------------------------------------ versions and info
def test_too_old_flash_attn_is_named_with_the_reason(monkeypatch):
    import types

    old = types.ModuleType("flash_attn")
    old.__version__ = "2.5.8"
    monkeypatch.setitem(__import__("sys").modules, "flash_attn", old)
    dispatch.clear_backend_cache()
    status = dispatch.import_status("fa2")
    assert "2.5.8 is too old" in status and ">= 2.5.9" in status
    from flashpage.info import collect_info, format_info

    text = format_info(collect_info())
    assert "2.5.8 is too old" in text


def test_signature_is_read_once_per_function():
    mod, _ = fs.load_fa2("v2.5.9")
    flash_backends._SIGNATURES.pop(mod.flash_attn_with_kvcache, None)
    names, required, open_kwargs = flash_backends.parameters(mod.flash_attn_with_kvcache)
    assert "return_softmax_lse" not in names and "softcap" not in names and not open_kwargs
    assert required == {"q", "k_cache", "v_cache"}
    assert flash_backends.parameters(mod.flash_attn_with_kvcache) is flash_backends._SIGNATURES[
        mod.flash_attn_with_kvcache]


def test_an_argument_a_release_lacks_is_never_dropped_silently():
    """Only neutral values (None, False, 0, (-1, -1)) of arguments a release lacks are left out."""
    mod, _ = fs.load_fa2("v2.5.9")
    case = _plain_kvcache()
    case.pop("k"), case.pop("v")
    with pytest.raises(RuntimeError, match="has no argument 'softcap'"):
        flash_backends._call(mod.flash_attn_with_kvcache, {**case, "softcap": 5.0})
    out = flash_backends._call(mod.flash_attn_with_kvcache, {**case, "softcap": 0.0, "cache_leftpad": None,
                                                             "return_softmax_lse": False})
    assert out[0].shape == case["q"].shape


def test_fa4_is_named_with_its_version_and_refusals():
    mod, _ = fs.load_fa4(90)
    with dispatch.force_backend("fa4", mod):
        ok = dispatch.explain("flash_attn_with_kvcache", device="cpu", dtype=torch.bfloat16, block_size=16)
        alibi = dispatch.explain("flash_attn_varlen_func", device="cpu", dtype=torch.bfloat16, block_size=16,
                                 alibi=True)
    assert ok.name == "fa4" and "flash-attn 4" in ok.reason
    assert alibi.name == "reference" and "ALiBi is not supported by flash-attn 4" in alibi.reason


# ------------------------------------------------------------------ the stand-in against flash_api.cpp
def _stand_in_messages(cls: type) -> set[str]:
    """The literal messages ``cls`` passes to ``_check`` / ``_int32`` (its copies of TORCH_CHECK texts)."""
    found = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("_check", "_int32") and node.args:
            msg = node.args[-1]
            if isinstance(msg, ast.Constant) and isinstance(msg.value, str):
                found.add(msg.value)
    return found


def _cpp_strings(text: str) -> tuple[list[str], set[str]]:
    """A C++ file's string literals (adjacent ones joined) and the names it passes to CHECK_CONTIGUOUS."""
    pieces = re.finditer(r'(?:"(?:[^"\\\n]|\\.)*"\s*)+', text)
    literals = ["".join(re.findall(r'"((?:[^"\\\n]|\\.)*)"', m.group(0))) for m in pieces]
    return literals, set(re.findall(r"CHECK_CONTIGUOUS\((\w+)\)", text))


def test_fa2_stand_in_checks_are_flash_api_cpp_checks():
    """Every check of the FA2 stand-in (bar those it marks "stand-in:") has its message, word for word,
    in the newest release's csrc/flash_attn/flash_api.cpp (``CHECK_CONTIGUOUS(x)`` says "x must be
    contiguous"). FA3's hopper/flash_api.cpp is in no PyPI release, so its stand-in is not checked here."""
    literals, contiguous = _cpp_strings(fs.require(fs.fa2_flash_api(fs.FA2_NEWEST)).read_text())
    messages = _stand_in_messages(fs.Fa2Extension)
    assert len(messages) >= 30, sorted(messages)

    def in_cpp(msg: str) -> bool:
        if msg.endswith(" must be contiguous") and msg.split()[0] in contiguous:
            return True
        return any(msg in literal for literal in literals)

    assert sorted(m for m in messages if not m.startswith("stand-in:") and not in_cpp(m)) == []
    assert not in_cpp("a message flash-attn never wrote")
