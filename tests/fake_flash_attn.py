"""Strict fake `flash_attn` (FA2) and `flash_attn_interface` (FA3) modules for CPU tests.

They enforce the checks the real libraries make (flash_api.cpp, hopper/flash_api.cpp and the Python
wrappers), accept keyword arguments only, record every call, refuse what would read or write out
of bounds, and compute results with the independent float64 oracle (tests/kernel_oracle.py).
Use them through flashpage.kernels.dispatch.force_backend.
"""

from __future__ import annotations

import inspect
import types

import torch
from kernel_oracle import oracle_kvcache, oracle_varlen


def _fa2_kvcache_sig(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    pass


def _fa2_varlen_sig(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    pass


def _fa3_kvcache_sig(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
):
    pass


def _fa3_varlen_sig(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    pass


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def _summary(kwargs: dict) -> dict:
    out = {}
    for key, val in kwargs.items():
        if isinstance(val, torch.Tensor):
            out[key] = (tuple(val.shape), str(val.dtype).replace("torch.", ""))
        else:
            out[key] = val
    return out


def _bind(sig, name: str, args: tuple, kwargs: dict) -> dict:
    if args:
        raise TypeError(
            f"fake {name}: positional arguments are not allowed (forks order them differently); "
            "call with keyword arguments"
        )
    bound = inspect.signature(sig).bind(**kwargs)  # TypeError on unknown or missing arguments
    bound.apply_defaults()
    return dict(bound.arguments)


def _check_common(a: dict, kname: str, vname: str) -> None:
    q, kk, vv = a["q"], a[kname], a[vname]
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(kk.dtype == q.dtype, "query and key must have the same dtype")
    _check(vv.dtype == q.dtype, "query and value must have the same dtype")
    for t in (q, kk, vv):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(
        q.shape[-2] % kk.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query"
    )


def _check_int32(t: torch.Tensor | None, name: str, shape: tuple[int, ...] | None = None) -> None:
    if t is None:
        return
    _check(isinstance(t, torch.Tensor), f"{name} must be a tensor")
    _check(t.dtype == torch.int32, f"{name} must have dtype int32")
    _check(t.stride(-1) == 1 if t.dim() else True, f"{name} must have contiguous last dimension")
    if shape is not None:
        _check(tuple(t.shape) == shape, f"{name} must have shape {shape}")


def _check_alibi(a: dict, batch: int, heads: int) -> None:
    slopes = a.get("alibi_slopes")
    if slopes is not None:
        _check(slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32")
        _check(tuple(slopes.shape) in ((heads,), (batch, heads)), "alibi_slopes has the wrong shape")


def _in_bounds(table: torch.Tensor, lengths: list[int], page: int, num_blocks: int) -> None:
    for b, n in enumerate(lengths):
        blocks = (n + page - 1) // page
        assert blocks <= table.shape[1], (
            f"fake: sequence {b} overruns its block_table row (memory corruption)"
        )
        ids = table[b, :blocks]
        assert bool(((ids >= 0) & (ids < num_blocks)).all()), f"fake: sequence {b} reads a bad block id"


def _kvcache_common(a: dict, table_name: str, fa2: bool) -> None:
    q, kc = a["q"], a["k_cache"]
    _check_common(a, "k_cache", "v_cache")
    assert kc.stride(-1) == 1 and a["v_cache"].stride(-1) == 1, "k_cache must have contiguous last dimension"
    batch = q.shape[0]
    table = a[table_name]
    seqlens = a["cache_seqlens"]
    if isinstance(seqlens, int):  # what the wrapper does: expands to k_cache.shape[0] entries
        seqlens = torch.full((kc.shape[0],), seqlens, dtype=torch.int32)
    if table is not None:
        _check(a["cache_batch_idx"] is None, "Paged KVcache does not support cache_batch_idx")
        _check(
            a["cache_leftpad"] is None, "We don't support Paged KV and leftpad_k running at the same time yet"
        )
        _check_int32(table, "block_table", (batch, table.shape[1]) if table.dim() == 2 else None)
        if fa2:
            _check(kc.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
    _check_int32(seqlens, "seqlens_k", (batch,))
    _check_int32(a["cache_batch_idx"], "cache_batch_idx", (batch,))
    _check_int32(a["cache_leftpad"], "leftpad_k", (batch,))
    if a["k"] is not None:
        _check(a["v"] is not None, "If key is supplied, value must also be passed in")
        _check(seqlens is not None, "If key is supplied, seqlens_k must also be passed in")
    if a["rotary_cos"] is not None:
        _check(
            a["k"] is not None,
            "If rotary cos/sin are provided, new key / value to be appended to KV cache "
            "must also be provided",
        )
        rd = a["rotary_cos"].shape[1] * 2
        _check(rd <= q.shape[-1], "rotary_dim must be <= headdim")
        _check(rd % 16 == 0, "Only rotary dimensions divisible by 16 are currently supported")
        _check(a["rotary_cos"].dtype == q.dtype, "rotary_cos must have the same dtype as query")
        _check(a["rotary_sin"] is not None, "If rotary cos is provided, rotary sin must also be provided")


def make_fake_fa2(version: str = "2.8.3") -> types.ModuleType:
    """A fake `flash_attn` module (FA2 API) that records calls in `.calls`."""
    mod = types.ModuleType("flash_attn")
    mod.__version__ = version
    mod.calls = []

    def flash_attn_with_kvcache(*args, **kwargs):
        a = _bind(_fa2_kvcache_sig, "flash_attn_with_kvcache", args, kwargs)
        mod.calls.append(("flash_attn_with_kvcache", _summary(kwargs)))
        _kvcache_common(a, "block_table", fa2=True)
        _check_alibi(a, a["q"].shape[0], a["q"].shape[2])
        return _run_kvcache(a, a["block_table"])

    def flash_attn_varlen_func(*args, **kwargs):
        a = _bind(_fa2_varlen_sig, "flash_attn_varlen_func", args, kwargs)
        mod.calls.append(("flash_attn_varlen_func", _summary(kwargs)))
        _check_common(a, "k", "v")
        assert a["dropout_p"] == 0.0, "fake: forward-only callers must pass dropout_p=0"
        _check_int32(a["cu_seqlens_q"], "cu_seqlens_q")
        _check_int32(a["cu_seqlens_k"], "cu_seqlens_k")
        table = a["block_table"]
        if table is not None:
            _check_int32(table, "block_table")
            _check(a["k"].shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
        batch = a["cu_seqlens_q"].numel() - 1
        _check_alibi(a, batch, a["q"].shape[1])
        return _run_varlen(a, table, a["max_seqlen_k"], a["return_attn_probs"], triple=True)

    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod


def make_fake_fa3() -> types.ModuleType:
    """A fake `flash_attn_interface` module (FA3 API: page_table, any page size, no ALiBi)."""
    mod = types.ModuleType("flash_attn_interface")
    mod.__version__ = "3.0.0b1"
    mod.calls = []

    def flash_attn_with_kvcache(*args, **kwargs):
        a = _bind(_fa3_kvcache_sig, "flash_attn_with_kvcache", args, kwargs)
        mod.calls.append(("flash_attn_with_kvcache", _summary(kwargs)))
        if a["cu_seqlens_q"] is None:
            _kvcache_common(a, "page_table", fa2=False)
            return _run_kvcache(a, a["page_table"])
        _check_common(a, "k_cache", "v_cache")
        _check_int32(a["cu_seqlens_q"], "cu_seqlens_q")
        _check_int32(a["cache_seqlens"], "seqused_k")
        _check_int32(a["page_table"], "page_table")
        assert a["k"] is None and a["max_seqlen_q"] is not None
        seqlens = a["cache_seqlens"]
        cu_k = torch.zeros(seqlens.numel() + 1, dtype=torch.int32)
        cu_k[1:] = seqlens.cumsum(0)
        table = a["page_table"]
        capacity = table.shape[1] * a["k_cache"].shape[1]
        b = dict(a, k=a["k_cache"], v=a["v_cache"], cu_seqlens_k=cu_k, alibi_slopes=None)
        out = _run_varlen(b, table, capacity, a["return_softmax_lse"], triple=False)
        return out

    def flash_attn_varlen_func(*args, **kwargs):
        a = _bind(_fa3_varlen_sig, "flash_attn_varlen_func", args, kwargs)
        mod.calls.append(("flash_attn_varlen_func", _summary(kwargs)))
        _check_common(a, "k", "v")
        _check_int32(a["cu_seqlens_q"], "cu_seqlens_q")
        _check_int32(a["cu_seqlens_k"], "cu_seqlens_k")
        b = dict(a, alibi_slopes=None)
        return _run_varlen(b, None, a["max_seqlen_k"], a["return_attn_probs"], triple=False)

    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod


def _run_kvcache(a: dict, table: torch.Tensor | None):
    q, kc, vc = a["q"], a["k_cache"], a["v_cache"]
    seqlens = a["cache_seqlens"]
    new = 0 if a["k"] is None else a["k"].shape[1]
    if table is not None:
        cap = table.shape[1] * kc.shape[1]
        lengths = [cap] * q.shape[0] if seqlens is None else [int(x) + new for x in seqlens]
        _in_bounds(table, lengths, kc.shape[1], kc.shape[0])
    elif seqlens is not None:
        assert all(int(x) + new <= kc.shape[1] for x in seqlens), "fake: append past the dense cache end"
    out, lse, new_k, new_v = oracle_kvcache(
        q,
        kc,
        vc,
        a["k"],
        a["v"],
        a["rotary_cos"],
        a["rotary_sin"],
        seqlens,
        a["cache_batch_idx"],
        a["cache_leftpad"],
        table,
        a["softmax_scale"],
        a["causal"],
        a["window_size"],
        a["softcap"],
        a["rotary_interleaved"],
        a.get("alibi_slopes"),
    )
    if a["k"] is not None:
        kc.copy_(new_k)
        vc.copy_(new_v)
    out = out.to(q.dtype)
    return (out, lse.float()) if a["return_softmax_lse"] else out


def _run_varlen(a: dict, table: torch.Tensor | None, max_seqlen_k: int, want_lse: bool, triple: bool):
    if table is not None:
        cu_k = a["cu_seqlens_k"]
        lengths = [int(cu_k[i + 1] - cu_k[i]) for i in range(cu_k.numel() - 1)]
        _in_bounds(table, lengths, a["k"].shape[1], a["k"].shape[0])
    out, lse = oracle_varlen(
        a["q"],
        a["k"],
        a["v"],
        a["cu_seqlens_q"],
        a["cu_seqlens_k"],
        a["max_seqlen_q"],
        max_seqlen_k,
        a["softmax_scale"],
        a["causal"],
        a["window_size"],
        a["softcap"],
        a["alibi_slopes"],
        table,
    )
    out = out.to(a["q"].dtype)
    if not want_lse:
        return out
    return (out, lse.float(), None) if triple else (out, lse.float())
