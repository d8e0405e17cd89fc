"""Bad input, layer by layer: a clear error of the right type, and nothing corrupted behind it.

Four tables (``pytest -k kernel``, ``-k cache``, ``-k patch``, ``-k engine``), one row per invalid
call. Every row says which exception it expects and a regex on the key words its message must
contain; after the error the harness checks that the object the call was made on is intact:

- kernels (``flash_attn_with_kvcache``, ``flash_attn_varlen_func``, ``store_kv``): the caches were
  not written, flash-attn (the strict fake of tests/fake_flash_attn.py, forced with
  ``force_backend``) was never called, and a valid call on the same tensors gives the expected
  result. The contract (docs/flash-attn-contract.md) wants int32 index tensors; the
  reference path rejects int64 too (validate.py is shared by every backend: "everything
  flash-attn rejects, the reference rejects too"), while it accepts fp32 and page sizes flash-attn
  2 refuses (those fall back to it: see ``test_accepted_not_errors``);
- cache (``BlockManager`` / ``PagedKVCache``): the failing call changed nothing (block tables,
  lengths, token ids, counters, page contents), ``check_invariants`` passes, and a valid
  append / copy-on-write / write / free sequence works on the same object;
- patches (``patch``, ``HFPagedCache``, ``generate``): the model still generates exactly the
  unpatched model's tokens, and a filled cache that a bad call was made with still continues its
  own batch exactly;
- engine (``LLM``, ``SamplingParams``): nothing was queued, no block is held, and a valid request on
  the same LLM gives transformers' greedy output.
``test_accepted_not_errors`` lists inputs that look wrong but are valid (and what they do).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from engine_helpers import VOCAB, engine_model, hf_greedy
from fake_flash_attn import make_fake_fa2
from model_zoo import left_padded_batch, tiny_model, tiny_tokenizer
from reliability_helpers import HoldHook, assert_pool_clean

import flashpage
from flashpage import (
    LLM,
    BlockManager,
    CapacityError,
    KernelInputError,
    NoFreeBlocksError,
    PagedKVCache,
    SamplingParams,
    UnknownSequenceError,
)
from flashpage.kernels import dispatch, flash_attn_varlen_func, flash_attn_with_kvcache, store_kv
from flashpage.patches import HFPagedCache, UnsupportedModelError
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")


@dataclass(frozen=True)
class Case:
    """One invalid call.

    Attributes:
        id: readable test id.
        exc: the exception type expected.
        match: regex the message must match (``re.search``): the key words naming the problem.
        bad: makes the invalid call on the object ``setup`` gave (or on the layer's environment).
        setup: builds that object from the environment (default: the environment itself).
        after: extra checks on that object once the error was raised.
    """

    id: str
    exc: type[BaseException]
    match: str
    bad: Callable[[Any], Any]
    setup: Callable[[Any], Any] | None = None
    after: Callable[[Any], None] | None = None


def _ids(cases: list[Case]) -> list[str]:
    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids), "duplicate case ids"
    return ids


def _raise_as(case: Case, obj: Any) -> BaseException:
    with pytest.raises(case.exc, match=case.match) as info:
        case.bad(obj)
    return info.value


@pytest.fixture(autouse=True)
def _fresh_backends() -> Iterator[None]:
    dispatch.clear_backend_cache()
    yield
    dispatch.clear_backend_cache()


# ======================================================================================= kernels
def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).half()


def _kvcache_base(page: int) -> dict[str, Any]:
    """Two sequences (3 and page + 5 cached tokens) appending one token each, paged."""
    g = torch.Generator().manual_seed(0)
    return dict(q=_randn(g, 2, 1, 4, 32), k_cache=_randn(g, 6, page, 2, 32), v_cache=_randn(g, 6, page, 2, 32),
                k=_randn(g, 2, 1, 2, 32), v=_randn(g, 2, 1, 2, 32),
                cache_seqlens=torch.tensor([3, page + 5], dtype=torch.int32),
                block_table=torch.tensor([[4, 0], [1, 3]], dtype=torch.int32), causal=True)


def _varlen_base(page: int) -> dict[str, Any]:
    """A decode over page + 2 keys and a 3-token chunk over 7 keys, packed, reading the pages."""
    g = torch.Generator().manual_seed(1)
    return dict(q=_randn(g, 4, 4, 32), k=_randn(g, 6, page, 2, 32), v=_randn(g, 6, page, 2, 32),
                cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, page + 2, page + 9], dtype=torch.int32),
                max_seqlen_q=3, max_seqlen_k=page + 2,
                block_table=torch.tensor([[2, 5], [0, 1]], dtype=torch.int32), causal=True)


def _store_base(page: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(2)
    return dict(k_cache=torch.randn(6, 4, 2, 8, generator=g), v_cache=torch.randn(6, 4, 2, 8, generator=g),
                k=torch.randn(3, 2, 8, generator=g), v=torch.randn(3, 2, 8, generator=g),
                slot_mapping=torch.tensor([5, -1, 20]))


KERNELS: dict[str, tuple[Callable[..., Any], Callable[[int], dict[str, Any]], tuple[str, ...]]] = {
    # entry point, valid case, the tensors it writes (or may write)
    "kvcache": (flash_attn_with_kvcache, _kvcache_base, ("k_cache", "v_cache")),
    "varlen": (flash_attn_varlen_func, _varlen_base, ("k", "v")),
    "store_kv": (store_kv, _store_base, ("k_cache", "v_cache")),
}


def _clone(case: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def _kernel(fn: str, name: str, exc: type[BaseException], match: str, mutate: Callable[[dict], dict],
            fa2: bool = False) -> Case:
    """A kernel call made invalid by ``mutate`` (a new dict; the given tensors are never modified)."""
    page = 256 if fa2 else 16  # a page flash-attn 2 takes, so the dispatcher would pick it

    def setup(_: Any) -> dict[str, Any]:
        entry, base, writes = KERNELS[fn]
        case = base(page)
        expected = _clone(case)
        out = entry(**expected)
        fake = make_fake_fa2()
        return dict(fn=fn, case=case, snapshot=_clone(case), expected=expected, out=out, fake=fake, fa2=fa2,
                    writes=writes, bad=mutate(dict(case)))

    def bad(ctx: dict[str, Any]) -> Any:
        entry = KERNELS[ctx["fn"]][0]
        with dispatch.force_backend("fa2", ctx["fake"]) if ctx["fa2"] else nullcontext():
            return entry(**ctx["bad"])

    return Case(f"kernel-{fn}-{name}{'-fa2' if fa2 else ''}", exc, match, bad, setup)


def _with(**changes: Any) -> Callable[[dict], dict]:
    def mutate(c: dict) -> dict:
        return {**c, **{k: v(c) if callable(v) else v for k, v in changes.items()}}

    return mutate


def _strided_last(t: torch.Tensor) -> torch.Tensor:
    """Same values, but stride(-1) == 2."""
    return t.repeat_interleave(2, dim=-1)[..., ::2]


KERNEL_CASES = [
    # index dtypes: flash-attn reads them as int32 (contract 1.); the reference refuses int64 too
    _kernel("kvcache", "int64-block-table", KernelInputError, r"block_table must have dtype torch\.int32.*"
            r"block_table\.to\(torch\.int32\)", _with(block_table=lambda c: c["block_table"].long())),
    _kernel("kvcache", "int64-block-table", KernelInputError, r"block_table must have dtype torch\.int32",
            _with(block_table=lambda c: c["block_table"].long()), fa2=True),
    _kernel("varlen", "int64-block-table", KernelInputError, r"block_table must have dtype torch\.int32",
            _with(block_table=lambda c: c["block_table"].long())),
    _kernel("kvcache", "int64-cache-seqlens", KernelInputError, r"cache_seqlens must have dtype torch\.int32",
            _with(cache_seqlens=lambda c: c["cache_seqlens"].long())),
    _kernel("varlen", "int64-cu-seqlens-k", KernelInputError, r"cu_seqlens_k must have dtype torch\.int32",
            _with(cu_seqlens_k=lambda c: c["cu_seqlens_k"].long())),
    _kernel("kvcache", "python-int-seqlens-with-block-table", KernelInputError, r"pass a \(B,\) int32 tensor",
            _with(cache_seqlens=3)),
    # dtypes
    _kernel("kvcache", "int32-q", KernelInputError, r"q has dtype torch\.int32, which is not supported",
            _with(q=lambda c: c["q"].to(torch.int32))),
    _kernel("kvcache", "q-cache-dtype-mismatch", KernelInputError, r"k_cache has dtype torch\.float16 but q has "
            r"torch\.bfloat16.*must share one dtype", _with(q=lambda c: c["q"].bfloat16())),
    _kernel("varlen", "fp32-pages-fp16-q", KernelInputError, r"k has dtype torch\.float32 but q has torch\.float16",
            _with(k=lambda c: c["k"].float(), v=lambda c: c["v"].float()), fa2=True),
    _kernel("store_kv", "dtype-mismatch", KernelInputError, r"k has dtype torch\.float16 but the caches have "
            r"torch\.float32.*cast", _with(k=lambda c: c["k"].half(), v=lambda c: c["v"].half())),
    # heads and head dims
    _kernel("kvcache", "heads-not-divisible", KernelInputError, r"number of heads in key/value \(2\) must divide "
            r"number of heads in query \(3\)", _with(q=lambda c: c["q"][:, :, :3].contiguous())),
    _kernel("varlen", "heads-not-divisible", KernelInputError, r"\(2\) must divide .* query \(3\)",
            _with(q=lambda c: c["q"][:, :3].contiguous()), fa2=True),
    _kernel("kvcache", "head-dim-mismatch", KernelInputError, r"k_cache must have shape \(NB, P, Hk, D\) = "
            r"\(6, 16, 2, 16\), got \(6, 16, 2, 32\)", _with(q=lambda c: c["q"][..., :16].contiguous())),
    _kernel("kvcache", "head-dim-300", KernelInputError, r"head dimension 300 is larger than 256",
            _with(q=lambda c: torch.zeros(2, 1, 4, 300).half(), k_cache=torch.zeros(6, 16, 2, 300).half(),
                  v_cache=torch.zeros(6, 16, 2, 300).half(), k=None, v=None)),
    _kernel("store_kv", "heads-mismatch", KernelInputError, r"k must have shape \(T, Hk, D\) = \(3, 2, 8\).*"
            r"got \(3, 4, 8\)", _with(k=lambda c: c["k"].repeat(1, 2, 1), v=lambda c: c["v"].repeat(1, 2, 1))),
    _kernel("store_kv", "k-v-pages-disagree", KernelInputError, r"k_cache and v_cache must be .* same NB, P and Hk",
            _with(v_cache=lambda c: c["v_cache"][:, :2])),
    # capacity and block ids (flash-attn 2.8.3 would read/write out of bounds: flashpage checks)
    _kernel("kvcache", "capacity-overflow", CapacityError, r"sequence 1 does not fit: cache_seqlens\[1\] = 32 plus "
            r"1 new token\(s\) = 33 > 32 .* give the sequence more blocks",
            _with(cache_seqlens=torch.tensor([3, 32], dtype=torch.int32))),
    _kernel("kvcache", "capacity-overflow", CapacityError, r"sequence 1 does not fit: .* more blocks",
            _with(cache_seqlens=torch.tensor([3, 512], dtype=torch.int32)), fa2=True),
    _kernel("varlen", "capacity-overflow", CapacityError, r"sequence 0 has 18 keys .* holds 16",
            _with(block_table=lambda c: c["block_table"][:, :1].contiguous())),
    _kernel("kvcache", "block-id-out-of-range", KernelInputError, r"block_table\[1, 1\] = 99 is not a block id "
            r"in \[0, 6\)", _with(block_table=torch.tensor([[4, 0], [1, 99]], dtype=torch.int32))),
    _kernel("varlen", "cu-seqlens-decreasing", KernelInputError, r"cu_seqlens_k must be non-decreasing",
            _with(cu_seqlens_k=torch.tensor([0, 18, 3], dtype=torch.int32))),
    _kernel("varlen", "max-seqlen-k-too-small", KernelInputError, r"max_seqlen_k = 5 is smaller than the longest",
            _with(max_seqlen_k=5)),
    _kernel("store_kv", "slot-out-of-range", KernelInputError, r"slot_mapping values must be -1 \(skip\) or in "
            r"\[0, NB \* P = 24\), got range \[-1, 24\]", _with(slot_mapping=torch.tensor([5, -1, 24]))),
    _kernel("store_kv", "float-slot-mapping", KernelInputError, r"slot_mapping must be a \(T,\) int32 or int64",
            _with(slot_mapping=torch.tensor([5.0, -1.0, 20.0]))),
    # layout
    _kernel("kvcache", "strided-q", KernelInputError, r"q must have a contiguous last dimension",
            _with(q=lambda c: c["q"].transpose(-1, -2).contiguous().transpose(-1, -2))),
    _kernel("kvcache", "strided-block-table", KernelInputError, r"block_table must have a contiguous last dimension",
            _with(block_table=lambda c: _strided_last(c["block_table"])), fa2=True),
    _kernel("varlen", "dropout", KernelInputError, r"dropout_p must be 0", _with(dropout_p=0.1)),
    _kernel("kvcache", "k-without-v", KernelInputError, r"k and v must be given together", _with(v=None)),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_ids(KERNEL_CASES))
def test_kernel_bad_input(case: Case) -> None:
    ctx = case.setup(None)
    err = _raise_as(case, ctx)
    assert isinstance(err, ValueError) and isinstance(err, RuntimeError), "KernelInputError is both"
    assert ctx["fake"].calls == [], "flash-attn was called with invalid inputs"
    # nothing was written ...
    for name, tensor in ctx["case"].items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, ctx["snapshot"][name]), f"the failed call changed {name}"
    # ... and the same tensors take a valid call with the expected result
    entry = KERNELS[ctx["fn"]][0]
    out = entry(**ctx["case"])
    if ctx["out"] is not None:
        assert torch.equal(out, ctx["out"])
    for name in ctx["writes"]:
        assert torch.equal(ctx["case"][name], ctx["expected"][name])


# ========================================================================================= cache
BS = 4


def _cache_setup(_: Any) -> PagedKVCache:
    """2 layers; "a" holds 6 tokens with K/V written, "b" shares them (fork), "gone" was freed."""
    kv = PagedKVCache(2, 2, 8, num_blocks=8, block_size=BS, dtype=torch.float32, device="cpu")
    kv.add_sequence("gone", [9, 9, 9])
    kv.free("gone")
    assert kv.add_sequence("a", [3, 4, 5, 6, 7, 8]) == 0
    plan = kv.plan(["a"], [6], [[3, 4, 5, 6, 7, 8]])
    g = torch.Generator().manual_seed(4)
    for layer in range(2):
        kv.write(layer, torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g), plan)
    kv.fork("a", "b")
    return kv


def _cache_state(kv: PagedKVCache) -> tuple[Any, ...]:
    b = kv.blocks
    seqs = {s: (b.block_table(s), b.num_tokens(s), b.token_ids(s)) for s in b.sequences}
    pages = [(kv.k_pages(i).clone(), kv.v_pages(i).clone()) for i in range(kv.num_layers)]
    return seqs, b.stats(), b._copies, pages


def _same_state(x: tuple[Any, ...], y: tuple[Any, ...]) -> bool:
    return x[:3] == y[:3] and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(x[3], y[3],
                                                                                                    strict=True))


def _cache_still_works(kv: PagedKVCache) -> None:
    """Append to the shared sequence (copy-on-write), write its K/V, read both back, free everything."""
    kv.blocks.check_invariants()
    a_before, _, _ = kv.gather(0, ["a"])
    plan = kv.plan(["a"], [3], [[10, 11, 12]])
    assert kv.blocks.num_tokens("a") == 9 and kv.blocks.num_tokens("b") == 6
    new_k, new_v = torch.ones(3, 2, 8), torch.full((3, 2, 8), 2.0)
    kv.write(0, new_k, new_v, plan)
    k, v, lengths = kv.gather(0, ["a", "b"])
    assert lengths == [9, 6]
    assert torch.equal(k[0, :6], a_before[0]) and torch.equal(k[1, :6], a_before[0]), "copy-on-write lost K/V"
    assert torch.equal(k[0, 6:9], new_k) and torch.equal(v[0, 6:9], new_v)
    kv.free("a")
    kv.free("b")
    kv.blocks.check_invariants()
    assert kv.stats().in_use == 0


def _cache(name: str, exc: type[BaseException], match: str, bad: Callable[[PagedKVCache], Any]) -> Case:
    return Case(f"cache-{name}", exc, match, bad, _cache_setup)


def _t(n: int) -> torch.Tensor:
    return torch.zeros(n, 2, 8)


CACHE_CASES = [
    _cache("double-free", UnknownSequenceError, r"sequence 'gone' is not in the block manager.*already freed",
           lambda kv: kv.free("gone")),
    _cache("append-unknown-sequence", UnknownSequenceError, r"sequence 'zz' is not in the block manager.*never "
           r"added", lambda kv: kv.blocks.append("zz", 2)),
    _cache("fork-of-freed-sequence", UnknownSequenceError, r"sequence 'gone' .*already freed",
           lambda kv: kv.fork("gone", "c")),
    _cache("fork-into-existing", ValueError, r"cannot fork into sequence 'b': it already exists",
           lambda kv: kv.fork("a", "b")),
    _cache("add-existing", ValueError, r"sequence 'a' already exists", lambda kv: kv.add_sequence("a", [1])),
    _cache("truncate-unknown", UnknownSequenceError, r"sequence 'gone'", lambda kv: kv.truncate("gone", 0)),
    _cache("truncate-beyond-length", ValueError, r"cannot truncate sequence 'a' to 7 tokens: it has 6",
           lambda kv: kv.truncate("a", 7)),
    _cache("append-negative", ValueError, r"num_tokens must be >= 0, got -1", lambda kv: kv.blocks.append("a", -1)),
    _cache("append-token-ids-length", ValueError, r"token_ids has 1 ids but num_tokens=2",
           lambda kv: kv.blocks.append("a", 2, [5])),
    _cache("out-of-blocks", NoFreeBlocksError, r"out of KV blocks: appending 30 token\(s\) to sequence 'a' needs 8 "
           r"block\(s\) but only 6 are free", lambda kv: kv.blocks.append("a", 30)),
    _cache("plan-out-of-blocks", NoFreeBlocksError, r"this step needs 8 block\(s\) but only 6",
           lambda kv: kv.plan(["a", "b"], [14, 14])),
    _cache("plan-unknown-sequence", UnknownSequenceError, r"sequence 'gone'",
           lambda kv: kv.plan(["a", "gone"], [1, 1])),
    _cache("plan-length-mismatch", ValueError, r"shorter than argument 1|longer than argument 1",
           lambda kv: kv.plan(["a", "b"], [1])),
    _cache("plan-new-existing-id", ValueError, r"must be new and distinct.*already in the cache: \['a'\]",
           lambda kv: kv.plan(["c", "a"], token_ids=[[1, 2], [3]], new_sequences=True)),
    _cache("plan-new-repeated-id", ValueError, r"must be new and distinct.*repeated ids",
           lambda kv: kv.plan(["c", "c"], token_ids=[[1, 2], [3]], new_sequences=True)),
    _cache("grow-smaller", ValueError, r"num_blocks must be an int >= 8, got 4", lambda kv: kv.blocks.grow(4)),
    _cache("write-other-heads", ValueError, r"layer 0 got K/V with \(Hk, D\) = \(4, 8\).*pages hold \(2, 8\).*"
           r"another geometry", lambda kv: kv.write(0, torch.zeros(2, 4, 8), torch.zeros(2, 4, 8),
                                                  kv.plan(["a"], [2], allocated=True))),
    _cache("write-unknown-layer", ValueError, r"layer 2 does not exist, the cache has 2 layers",
           lambda kv: kv.write(2, _t(1), _t(1), kv.plan(["a"], [1], allocated=True))),
    _cache("pages-of-unwritten-layer", RuntimeError, r"layer 0 has no pages yet",
           lambda kv: PagedKVCache(1, None, None, num_blocks=2, block_size=BS, dtype=None).k_pages(0)),
    _cache("bad-geometry", ValueError, r"num_kv_heads must be >= 1, got 0",
           lambda kv: PagedKVCache(2, 0, 8, num_blocks=8, block_size=BS)),
    _cache("block-manager-zero-blocks", ValueError, r"num_blocks must be an int >= 1, got 0",
           lambda kv: BlockManager(0, BS)),
]


@pytest.mark.parametrize("case", CACHE_CASES, ids=_ids(CACHE_CASES))
def test_cache_bad_input(case: Case) -> None:
    kv = case.setup(None)
    before = _cache_state(kv)
    err = _raise_as(case, kv)
    if isinstance(err, NoFreeBlocksError):
        assert err.needed > err.free and f"needs {err.needed}" in str(err) and f"only {err.free}" in str(err)
    assert _same_state(before, _cache_state(kv)), "the failed call changed the cache"
    _cache_still_works(kv)


# ======================================================================================= patches
HF_LENGTHS = [5, 11, 8]
HF_NEW = 6


class PatchEnv:
    """Tiny llamas (and variants of other geometry), a left-padded batch and unpatched references."""

    def __init__(self) -> None:
        self.model = tiny_model("llama")
        self.more_kv_heads = tiny_model("llama", num_key_value_heads=4)
        self.more_layers = tiny_model("llama", num_hidden_layers=3)
        self.ids, self.mask = left_padded_batch(HF_LENGTHS, seed=7)
        self.ref = self.unpatched(self.ids, self.mask)

    def unpatched(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        flashpage.unpatch(self.model)
        return self.generate(ids, mask)

    def generate(self, ids: torch.Tensor, mask: torch.Tensor, model: torch.nn.Module | None = None,
                 **kw: Any) -> Any:
        return (model or self.model).generate(input_ids=ids, attention_mask=mask, max_new_tokens=HF_NEW,
                                              min_new_tokens=HF_NEW, do_sample=False, **kw)

    def filled(self) -> dict[str, Any]:
        """A patched model and the HFPagedCache of a finished generate() (to be continued)."""
        flashpage.patch(self.model, block_size=4)
        out = self.generate(self.ids, self.mask, return_dict_in_generate=True)
        ids, mask = _extend(out.sequences, self.mask, [7, 8])
        return dict(cache=out.cache, ids=ids, mask=mask, held=_held(out.cache))

    def continues(self, ctx: dict[str, Any]) -> None:
        """The filled cache was left as it was and still continues its own batch exactly."""
        cache = ctx["cache"]
        cache.kv.blocks.check_invariants()
        assert _held(cache) == ctx["held"], "the failed call changed what the cache holds"
        want = self.unpatched(ctx["ids"], ctx["mask"])
        flashpage.patch(self.model, block_size=4)
        assert torch.equal(self.generate(ctx["ids"], ctx["mask"], cache=cache), want)

    def assert_usable(self) -> None:
        flashpage.patch(self.model, block_size=4)
        assert torch.equal(self.generate(self.ids, self.mask), self.ref), "patched generate() is no longer exact"
        flashpage.unpatch(self.model)
        assert torch.equal(self.generate(self.ids, self.mask), self.ref), "unpatched generate() changed"


def _held(cache: HFPagedCache) -> tuple[int, int, int]:
    """Logical length, blocks in use, real tokens stored (a growable pool may have grown meanwhile)."""
    stats = cache.memory_stats()
    return cache.get_seq_length(), stats.blocks_in_use, stats.tokens_stored


def _extend(seqs: torch.Tensor, mask: torch.Tensor, extra: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([seqs, torch.tensor([extra] * seqs.shape[0], dtype=seqs.dtype)], dim=1)
    ones = torch.ones((mask.shape[0], ids.shape[1] - mask.shape[1]), dtype=mask.dtype)
    return ids, torch.cat([mask, ones], dim=1)


@pytest.fixture(scope="module")
def patch_env() -> Iterator[PatchEnv]:
    env = PatchEnv()
    yield env
    for m in (env.model, env.more_kv_heads, env.more_layers):
        flashpage.unpatch(m)


def _tiny_t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                      decoder_start_token_id=0)
    return T5ForConditionalGeneration(config).eval()


def _with_other_model(attr: str) -> Callable[[dict[str, Any]], Any]:
    def bad(ctx: dict[str, Any]) -> Any:
        other = getattr(ctx["env"], attr)
        flashpage.patch(other, block_size=4)
        return ctx["env"].generate(ctx["ids"], ctx["mask"], model=other, cache=ctx["cache"])

    return bad


def _filled(env: PatchEnv) -> dict[str, Any]:
    return {**env.filled(), "env": env}


def _continues(ctx: dict[str, Any]) -> None:
    ctx["env"].continues(ctx)


def _patched(env: PatchEnv) -> PatchEnv:
    flashpage.patch(env.model, block_size=4)
    return env


PATCH_CASES = [
    Case("patch-encoder-decoder-t5", UnsupportedModelError, r"T5ForConditionalGeneration \(model_type='t5'\) is "
         r"encoder-decoder", lambda env: flashpage.patch(_tiny_t5())),
    Case("patch-not-a-causal-lm", UnsupportedModelError, r"needs a transformers causal LM.*got Linear",
         lambda env: flashpage.patch(torch.nn.Linear(4, 4))),
    Case("patch-unknown-option", TypeError, r"unknown cache option\(s\) \['blocksize'\]",
         lambda env: flashpage.patch(env.model, blocksize=16)),
    Case("patch-block-size-zero", ValueError, r"cache option block_size must be a positive int or None, got 0",
         lambda env: flashpage.patch(env.model, block_size=0)),
    Case("patch-num-blocks-text", ValueError, r"cache option num_blocks must be a positive int or None, got '8'",
         lambda env: flashpage.patch(env.model, num_blocks="8")),
    Case("hfcache-block-size-zero", ValueError, r"HFPagedCache: block_size must be a positive int",
         lambda env: HFPagedCache(env.model.config, block_size=0)),
    Case("hfcache-without-config", ValueError, r"needs the model config", lambda env: HFPagedCache()),
    Case("hfcache-on-unpatched-model", RuntimeError, r"outside a planned forward: the model is not patched.*"
         r"flashpage\.patch\(model\)",
         lambda env: env.generate(env.ids, env.mask, cache=HFPagedCache(env.model.config))),
    Case("hfcache-reused-by-model-with-other-kv-heads", ValueError, r"pages hold \(2, 16\).*another geometry",
         _with_other_model("more_kv_heads"), _filled, _continues),
    Case("hfcache-reused-by-model-with-more-layers", ValueError, r"layer 2 does not exist, the cache has 2 layers",
         _with_other_model("more_layers"), _filled, _continues),
    Case("hfcache-reused-with-other-batch-size", ValueError, r"holds 3 sequences but this forward has batch size 2",
         lambda ctx: ctx["env"].generate(ctx["ids"][:2], ctx["mask"][:2], cache=ctx["cache"]), _filled, _continues),
    Case("hfcache-reused-with-beams", ValueError, r"holds 3 sequences but this forward has batch size 6",
         lambda ctx: ctx["env"].generate(ctx["ids"], ctx["mask"], cache=ctx["cache"], num_beams=2), _filled,
         _continues),
    Case("hfcache-reused-with-unrelated-input", ValueError, r"attention_mask has 11 columns; expected .*continues "
         r"its own sequences", lambda ctx: ctx["env"].generate(ctx["env"].ids, ctx["env"].mask, cache=ctx["cache"]),
         _filled, _continues),
    Case("hfcache-crop-positive", ValueError, r"crop\(3\): pass a negative number",
         lambda ctx: ctx["cache"].crop(3), _filled, _continues),
    Case("hfcache-exhausted-not-growable", NoFreeBlocksError, r"out of KV blocks: .* needs \d+ block\(s\) but only",
         lambda env: env.generate(env.ids, env.mask, cache=HFPagedCache(env.model.config, num_blocks=3, block_size=4,
                                                                        growable=False)), _patched),
    Case("generate-cache-implementation-paged", ValueError, r"pagedkv is not supported for continuous batching",
         lambda env: env.generate(env.ids, env.mask, cache_implementation="paged"), _patched),
    Case("generate-cache-with-cache-implementation", ValueError, r"Passing both `cache_implementation`.*and `cache`",
         lambda env: env.generate(env.ids, env.mask, cache=HFPagedCache(env.model.config),
                                  cache_implementation="static"), _patched),
]


@pytest.mark.parametrize("case", PATCH_CASES, ids=_ids(PATCH_CASES))
def test_patch_bad_input(case: Case, patch_env: PatchEnv) -> None:
    try:
        obj = case.setup(patch_env) if case.setup else patch_env
        _raise_as(case, obj)
        if case.after:
            case.after(obj)
        patch_env.assert_usable()
    finally:
        for m in (patch_env.model, patch_env.more_kv_heads, patch_env.more_layers):
            flashpage.unpatch(m)
    assert patch_env.model.config._attn_implementation == "sdpa"


# ======================================================================================== engine
PROMPT = [5, 17, 99, 42, 8, 23, 61]
MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
NUM_BLOCKS = 32


class EngineEnv:
    """One LLM (small pool: 32 blocks of 4 tokens) shared by every engine case, and its reference."""

    def __init__(self) -> None:
        self.model = engine_model()
        self.llm = LLM(self.model, block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=4, max_num_batched_tokens=32,
                       check_invariants=True)
        self.ref = hf_greedy(self.model, PROMPT, MAX_NEW)
        self._text_llm: LLM | None = None
        self._unsupported: tuple[torch.nn.Module, torch.Tensor] | None = None
        self.concurrent: dict[str, Any] = {}

    @property
    def text_llm(self) -> LLM:
        if self._text_llm is None:
            self._text_llm = LLM(self.model, tiny_tokenizer(), block_size=BS, num_blocks=NUM_BLOCKS)
        return self._text_llm

    @property
    def unsupported(self) -> tuple[torch.nn.Module, torch.Tensor]:
        """A model LLM refuses an option for (Doge edits its attention mask itself: one sequence per forward, no
        speculative decoding) and its own output."""
        if self._unsupported is None:
            from sweep_models import build_model

            model = build_model("doge")
            self._unsupported = model, self.unsupported_generate(model)
        return self._unsupported

    @staticmethod
    def unsupported_generate(model: torch.nn.Module) -> torch.Tensor:
        ids, mask = left_padded_batch([4, 6], seed=1, vocab=model.config.vocab_size)  # the sweep's smaller vocabulary
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)

    def assert_exact(self, out: Any) -> None:
        match = compare_greedy(self.ref[0], out.outputs[0].token_ids, self.ref[1])
        assert match.ok, f"{match.explain()}\nref={self.ref[0]}\ngot={out.outputs[0].token_ids}"

    def assert_usable(self) -> None:
        for llm in (self.llm, self._text_llm):
            if llm is None:
                continue
            assert_pool_clean(llm)  # nothing was queued, no block is held
            self.assert_exact(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0])
            assert_pool_clean(llm)


@pytest.fixture(scope="module")
def engine_env() -> Iterator[EngineEnv]:
    env = EngineEnv()
    yield env
    flashpage.unpatch(env.model)


def _param(field: str, value: Any, match: str) -> Case:
    """A SamplingParams field out of range: refused when built, and when changed after being built."""

    def bad(env: EngineEnv) -> Any:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**{field: value})
        params = SamplingParams(max_tokens=4, temperature=0.0)
        setattr(params, field, value)  # generate() validates again: fields may change after construction
        return env.llm.generate([PROMPT], params, use_tqdm=False)

    return Case(f"engine-params-{field}={value!r}", ValueError, match, bad)


def _concurrently(second: Callable[[LLM], Any]) -> Callable[[EngineEnv], Any]:
    """``second(llm)`` while another thread's generate() is inside the model's forward."""

    def bad(env: EngineEnv) -> Any:
        env.concurrent.clear()

        def first() -> None:
            env.concurrent["out"] = env.llm.generate([PROMPT], GREEDY, use_tqdm=False)

        with HoldHook(env.model.model.layers[0]) as hold:
            thread = threading.Thread(target=first, daemon=True)
            thread.start()
            try:
                assert hold.entered.wait(60), "the first generate() never reached the model"
                return second(env.llm)
            finally:
                hold.release.set()
                thread.join(60)

    return bad


def _first_call_was_exact(env: EngineEnv) -> None:
    assert "out" in env.concurrent, "the first generate() did not finish"
    env.assert_exact(env.concurrent["out"][0])


def _llm_left_model_unpatched(env: EngineEnv) -> None:
    model, ref = env.unsupported
    assert not flashpage.is_patched(model), "the failed LLM() left the model patched"
    assert not [n for n, m in model.named_modules() if "_flashpage_state" in vars(m)]
    assert torch.equal(env.unsupported_generate(model), ref)


NAN, INF = math.nan, math.inf
ENGINE_CASES = [
    _param("max_tokens", 0, r"SamplingParams\.max_tokens=0 is out of range: must be >= 1"),
    _param("max_tokens", 2.5, r"SamplingParams\.max_tokens must be an int >= 1; got 2\.5 \(float\)"),
    _param("min_tokens", -1, r"SamplingParams\.min_tokens=-1 is out of range: must be >= 0"),
    _param("min_tokens", 17, r"SamplingParams\.min_tokens=17 must be <= max_tokens"),
    _param("temperature", -0.5, r"SamplingParams\.temperature=-0\.5 is out of range: allowed \[0, inf\)"),
    _param("temperature", NAN, r"SamplingParams\.temperature is NaN"),
    _param("temperature", INF, r"SamplingParams\.temperature=inf must be finite"),
    _param("temperature", "0.7", r"SamplingParams\.temperature must be a number"),
    _param("top_k", -2, r"SamplingParams\.top_k=-2 is out of range: must be >= -1"),
    _param("top_p", 0.0, r"SamplingParams\.top_p=0\.0 is out of range: allowed \(0, 1\]"),
    _param("top_p", 1.5, r"SamplingParams\.top_p=1\.5 is out of range"),
    _param("top_p", NAN, r"SamplingParams\.top_p is NaN"),
    _param("min_p", -0.1, r"SamplingParams\.min_p=-0\.1 is out of range: allowed \[0, 1\]"),
    _param("min_p", 1.5, r"SamplingParams\.min_p=1\.5 is out of range"),
    _param("repetition_penalty", 0.0, r"SamplingParams\.repetition_penalty=0\.0 is out of range: allowed \(0, inf\)"),
    _param("presence_penalty", 2.5, r"SamplingParams\.presence_penalty=2\.5 is out of range: allowed \[-2, 2\]"),
    _param("frequency_penalty", -2.5, r"SamplingParams\.frequency_penalty=-2\.5 is out of range"),
    _param("n", 0, r"SamplingParams\.n=0 is out of range: must be >= 1"),
    _param("seed", -1, r"SamplingParams\.seed=-1 is out of range"),
    _param("logprobs", 21, r"SamplingParams\.logprobs=21 must be in \[0, 20\]"),
    _param("logprobs", -1, r"SamplingParams\.logprobs=-1 is out of range"),
    _param("stop", [""], r"SamplingParams\.stop must be non-empty strings; got ''"),
    _param("stop", 5, r"SamplingParams\.stop must be a string or a list of strings; got 5"),
    _param("stop_token_ids", [-1], r"SamplingParams\.stop_token_ids must be token ids \(ints >= 0\); got -1"),
    _param("stop_token_ids", 7, r"SamplingParams\.stop_token_ids must be a list of token ids; got 7"),
    # prompts
    Case("engine-empty-prompt", ValueError, r"prompt is empty", lambda env: env.llm.generate([[]], use_tqdm=False)),
    Case("engine-empty-text-prompt", ValueError, r"prompt is empty",
         lambda env: env.text_llm.generate("", GREEDY, use_tqdm=False)),
    Case("engine-out-of-vocabulary-id", ValueError, rf"token id\(s\) outside the vocabulary \[0, {VOCAB}\): "
         rf"\[{VOCAB}\]", lambda env: env.llm.add_request([5, VOCAB, 7])),
    Case("engine-negative-id", ValueError, r"outside the vocabulary .*\[-3\]",
         lambda env: env.llm.generate([5, -3], use_tqdm=False)),
    Case("engine-float-ids", ValueError, r"token-id prompt must be a list of ints",
         lambda env: env.llm.generate([[5.0, 6.0]], use_tqdm=False)),
    Case("engine-bool-ids", ValueError, r"token-id prompt must be a list of ints",
         lambda env: env.llm.add_request([True, 5])),
    Case("engine-prompt-beyond-max-model-len", ValueError, r"prompt has 512 tokens but the model takes at most 512 "
         r"positions \(max_model_len\).*1 token\(s\) too many", lambda env: env.llm.generate([[5] * 512],
                                                                                            use_tqdm=False)),
    Case("engine-prompt-beyond-kv-pool", ValueError, rf"prompt needs 51 KV blocks but the whole pool has "
         rf"{NUM_BLOCKS} \(19 too many\).*num_blocks=", lambda env: env.llm.add_request([5] * 200)),
    Case("engine-text-without-tokenizer", ValueError, r"a text prompt needs a tokenizer",
         lambda env: env.llm.generate("hello", use_tqdm=False)),
    Case("engine-one-bad-prompt-in-a-batch", ValueError, r"outside the vocabulary",
         lambda env: env.llm.generate([PROMPT, [1, 2, 999], PROMPT], GREEDY, use_tqdm=False)),
    Case("engine-prompts-none", TypeError, r"prompts must be a text, a list of token ids, or a list of those; "
         r"got NoneType", lambda env: env.llm.generate(None, use_tqdm=False)),
    # parameters per prompt
    Case("engine-params-count-mismatch", ValueError, r"got 2 SamplingParams for 3 prompts",
         lambda env: env.llm.generate([PROMPT] * 3, [GREEDY, GREEDY], use_tqdm=False)),
    Case("engine-params-a-dict", TypeError, r"sampling_params must be a flashpage\.SamplingParams or a list of them.*"
         r"got dict", lambda env: env.llm.generate([PROMPT], {"temperature": 0.0}, use_tqdm=False)),
    Case("engine-params-list-of-dicts", TypeError, r"sampling_params must be a flashpage\.SamplingParams, got dict",
         lambda env: env.llm.generate([PROMPT], [{"temperature": 0.0}], use_tqdm=False)),
    # request ids
    Case("engine-duplicate-request-id", ValueError, r"request id 'dup' is already in use",
         lambda env: [env.llm.add_request(PROMPT, GREEDY, request_id="dup") for _ in range(2)],
         after=lambda env: (env.llm.abort("dup"), env.llm.step())),  # the abort is reported by the next step
    # concurrency
    Case("engine-concurrent-generate", RuntimeError, r"LLM\.generate\(\) is already running.*one generate\(\)/"
         r"stream\(\) at a time", _concurrently(lambda llm: llm.generate([PROMPT], GREEDY, use_tqdm=False)),
         after=_first_call_was_exact),
    Case("engine-stream-during-generate", RuntimeError, r"LLM\.stream\(\) is already running",
         _concurrently(lambda llm: next(iter(llm.stream([PROMPT], GREEDY)))), after=_first_call_was_exact),
    # construction
    Case("engine-llm-refused-option-for-model", ValueError, r"speculative_config: DogeForCausalLM runs one sequence "
         r"per forward, as generate\(\) does \(layers \[0, 1\] edit the attention mask.*leave speculative_config out",
         lambda env: LLM(env.unsupported[0], num_blocks=8,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
         after=_llm_left_model_unpatched),
    Case("engine-llm-zero-blocks", ValueError, r"num_blocks must be a positive int, got 0",
         lambda env: LLM(env.model, num_blocks=0)),
    Case("engine-llm-zero-block-size", ValueError, r"block_size must be a positive int, got 0",
         lambda env: LLM(env.model, block_size=0, num_blocks=8)),
    Case("engine-llm-zero-seats", ValueError, r"max_num_seqs must be a positive int, got 0",
         lambda env: LLM(env.model, num_blocks=8, max_num_seqs=0)),
    Case("engine-kv-cache-memory-in-gib", ValueError, r"kv_cache_memory=4 bytes is less than one KV block .*"
         r"in bytes: for 4 GiB pass 4 \* 2\*\*30", lambda env: LLM(env.model, kv_cache_memory=4)),
    Case("engine-llm-path-is-a-file", ValueError, r"config\.json'\): that is a file, not a model.*checkpoint "
         r"directory", lambda env: LLM(f"{flashpage.tiny_model_path()}/config.json")),
    Case("engine-seed-beyond-int64-then-bad-prompt", ValueError, r"outside the vocabulary",
         lambda env: env.llm.generate([PROMPT, [1, 2, 999]], [SamplingParams(seed=2**64 + 1), GREEDY],
                                      use_tqdm=False)),
]


@pytest.mark.parametrize("case", ENGINE_CASES, ids=_ids(ENGINE_CASES))
def test_engine_bad_input(case: Case, engine_env: EngineEnv) -> None:
    obj = case.setup(engine_env) if case.setup else engine_env
    _raise_as(case, obj)
    if case.after:
        case.after(obj)
    engine_env.assert_usable()


def test_case_count() -> None:
    total = len(KERNEL_CASES) + len(CACHE_CASES) + len(PATCH_CASES) + len(ENGINE_CASES)
    assert total >= 40 and min(map(len, (KERNEL_CASES, CACHE_CASES, PATCH_CASES, ENGINE_CASES))) >= 10


# ============================================================================ accepted, not errors
def test_accepted_not_errors(engine_env: EngineEnv) -> None:
    """Inputs that look wrong but are valid, and what they do."""
    # a page size flash-attn 2 refuses (16, not a multiple of 256): the dispatcher never hands it to
    # flash-attn (which would raise), the reference computes it; fp32 likewise
    for dtype in (torch.float16, torch.float32):
        case = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in _kvcache_base(16).items()}
        want = flash_attn_with_kvcache(**_clone(case))
        fake = make_fake_fa2()
        with dispatch.force_backend("fa2", fake):
            got = flash_attn_with_kvcache(**_clone(case))
        assert fake.calls == [] and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="block size must be divisible by 256"):
        make_fake_fa2().flash_attn_with_kvcache(**_kvcache_base(16))  # what flash-attn itself says
    llm = engine_env.llm
    # a temperature so small that logits / temperature overflow: decoded greedily
    engine_env.assert_exact(llm.generate([PROMPT], SamplingParams(max_tokens=MAX_NEW, temperature=1e-45),
                                         use_tqdm=False)[0])
    # no prompt at all: nothing to do
    assert llm.generate([], use_tqdm=False) == []
    # a seed of any size (time.time_ns(), beyond int64): reduced, reproducible, and per request
    huge = SamplingParams(max_tokens=4, temperature=1.0, seed=2**64 + 3, ignore_eos=True)
    first, second = (llm.generate([PROMPT], huge, use_tqdm=False)[0].token_ids for _ in range(2))
    assert first == second and len(first) == 4
    # a request outgrowing the whole KV pool (prompt + max_tokens > 32 blocks x 4 tokens) ends with
    # "length" when the pool is full, and its batch-mates are not failed with it
    long_prompt = [int(t) for t in torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(9))]
    outs = llm.generate([PROMPT, long_prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    long_out = outs[1].outputs[0]
    assert long_out.finish_reason == "length" and len(long_prompt) + len(long_out.token_ids) == NUM_BLOCKS * BS
    ref20 = hf_greedy(engine_env.model, PROMPT, 20, eos=False)
    assert compare_greedy(ref20[0], outs[0].outputs[0].token_ids, ref20[1]).ok
    engine_env.assert_usable()
