"""The packed GEMMs' original weights paged out (engine/linears.py ``Prepacked.release``): an LLM on a saved
float32 checkpoint (weights in a private mapping of the file) releases them after packing, computes the same
tokens as with them kept and as transformers, runs steps of one to four rows on the packed weights (so the
originals stay out), repacks and releases again after a weight update; an LM head tied to the embedding is
released too (a lookup reads only its tokens' rows), and the tokens stay the same."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_matches_hf, random_prompts
from model_zoo import tiny_model

from flashpage import LLM, SamplingParams, cpu_memory
from flashpage.engine import linears
from flashpage.patches import unpatch

pytestmark = [pytest.mark.skipif(not linears.onednn_available(), reason="this torch has no oneDNN linear"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_PAGEOUT): Linux"),
              pytest.mark.usefixtures("one_thread")]

# weights of 1-2 MiB each: the kernel pages out whole (large) folios of the file, which a weight of a few pages
# may share with its neighbours
WIDE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8)
TAIL = [2, 3, 5, 6, 8, 10]  # max_tokens per request: the run's last steps have 4, 3, 2 then 1 rows


def _saved(tmp_path: Path, tied: bool, **extra: int) -> Path:
    model = tiny_model("llama", seed=9, tie_word_embeddings=tied, max_position_embeddings=512, **{**WIDE, **extra})
    model.save_pretrained(tmp_path)
    return tmp_path


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in TAIL]


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, _params(), use_tqdm=False)]


def _llm(path: Path, release: bool) -> LLM:
    """LLM on the checkpoint as ``from_pretrained`` loads it (float32: its tensors in a mapping of the file)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
    llm = LLM(model, max_num_seqs=len(TAIL), cpu_prepack=True)
    llm._prepack.release = release
    return llm


def _kept_reference(path: Path, prompts: list[list[int]], check: Callable[[linears.Prepacked], bool]) -> list:
    """The outputs of an LLM that keeps its originals resident (``check`` holds for its packs), which is then
    dropped: its mapping of the file would keep the pages the next LLM pages out (the kernel pages out no page that
    two mappings share)."""
    kept = _llm(path, release=False)
    try:
        ref = _generate(kept, prompts)
        assert check(kept._prepack)
    finally:
        unpatch(kept.model)
    del kept
    gc.collect()
    return ref


def _spy(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, record: Callable[..., Any]) -> None:
    """``owner.name`` calls ``record`` with its arguments first, then itself."""
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: record(*args, **kwargs) or original(*args, **kwargs))


def _same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        for p, q in zip(x.logprobs, y.logprobs, strict=True):
            assert abs(p.logprob - q.logprob) < 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_released_originals_same_tokens_and_few_rows_on_the_packs(tmp_path, monkeypatch, tied):
    path = _saved(tmp_path, tied)
    prompts = random_prompts(len(TAIL), 3, 30, seed=4)
    ref = _kept_reference(path, prompts, lambda packs: packs.released() == 0
                          and not any(packs.paged_out(m) for m in packs.model.modules()))
    advised: list[int] = []
    cached: list[int] = []  # advised to the page cache only (keep_cached)

    def record(ts: list[torch.Tensor], files: Any = None, keep_cached: bool = False) -> None:
        advised.extend(t.data_ptr() for t in ts)
        cached.extend(t.data_ptr() for t in ts if keep_cached)

    _spy(monkeypatch, cpu_memory, "page_out", record)
    few: list[torch.nn.Linear] = []
    _spy(monkeypatch, linears, "_few_rows", lambda m, x: few.append(m))
    packed_rows: list[int] = []
    _spy(monkeypatch, linears, "_packed_call", lambda x, w, b: packed_rows.append(x.numel() // x.shape[-1]))
    llm = _llm(path, release=True)
    model = llm.model
    try:
        got = _generate(llm, prompts)
        packs = llm._prepack
        assert packs.state == "packed" and packs.released() > 0, "the saved checkpoint's weights were not released"
        embed = model.model.embed_tokens.weight
        assert model.lm_head.weight.data_ptr() in advised  # tied or not: a lookup reads only its tokens' rows
        assert (embed.data_ptr() in advised) is tied  # an untied embedding is no packed GEMM's: never advised
        # the embedding a tied LM head shares goes to the page cache only (lookups read it back a row at a time)
        assert cached == ([embed.data_ptr()] if tied else [])
        layer = model.model.layers[1]
        assert packs.paged_out(layer.mlp.gate_proj) and packs.paged_out(layer.self_attn.q_proj)
        _same(got, ref)
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), "pt") as f:  # the paged-out original reads back the same
            assert torch.equal(model.model.layers[0].mlp.down_proj.weight.detach(),
                               f.get_tensor("model.layers.0.mlp.down_proj.weight"))
        few.clear()  # the probe step ran every linear's small-row kernel; since, only those not paged out
        packed_rows.clear()
        got = _generate(llm, prompts)
        assert not any(packs.paged_out(m) for m in few)
        assert {1, 2, 3, 4} <= set(packed_rows)  # the run's tail: steps of 4, 3, 2 and 1 rows on the packs
        _same(got, ref)
        # a weight update in place, then a repack of what changed and its release (the written pages stay)
        with torch.no_grad():
            layer.self_attn.k_proj.weight.mul_(1.5)
            layer.mlp.up_proj.weight[:8].add_(0.01)  # a few pages written, the rest still the file's
        advised.clear()
        got = _generate(llm, prompts)
        assert layer.self_attn.q_proj.weight.data_ptr() in advised and layer.mlp.gate_proj.weight.data_ptr() in advised
        assert model.model.layers[0].mlp.gate_proj.weight.data_ptr() not in advised  # not repacked
        assert packs.paged_out(layer.mlp.gate_proj)  # its fused group kept most of its pages the file's
    finally:
        unpatch(model)
    for prompt, out, n in zip(prompts, got, TAIL, strict=True):
        assert_matches_hf(model, [prompt], [out], n, eos=False)
    plain = LLM(model, max_num_seqs=len(TAIL), cpu_prepack=False)
    try:
        _same(got, _generate(plain, prompts))
    finally:
        unpatch(model)


def test_padded_packed_calls_match_the_plain_gemm():
    """A packed call of one to three rows runs zero-padded to PACKED_MIN_ROWS rows: the rows asked for, same
    values as F.linear (float32 rounding)."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, linears.PACK_BATCH_HINT)
    for shape in [(1, 24), (2, 24), (1, 3, 24), (1, 1, 24), (5, 24), (2, 4, 24)]:
        x = torch.randn(*shape, generator=gen)
        got = linears._packed_call(x, packed, b)
        assert got.shape == (*shape[:-1], 40)
        assert torch.allclose(got, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5), shape


def test_bench_small_rows_runs():
    from flashpage.bench import linears as bench
    from flashpage.kernels import cpu_fused

    if cpu_fused.load() is None:
        pytest.skip("no C++ compiler here: no small-M kernel to compare with")
    row = bench.measure_small_rows("o", 2, layers=1, repeats=1)
    assert row is not None and min(row.small_us, row.packed_us, row.padded_us) > 0


def test_a_wide_linear_packs_in_parts_paged_out_as_it_goes(tmp_path, monkeypatch):
    """A linear alone with more than SPLIT_OUT outputs (the LM head here, tied to the embedding) is packed in parts
    of SPLIT_OUT outputs, each part's rows of the original paged out right after that part is packed (the packing
    never holds the whole original beside its copy); its steps, few-row ones included, run on the parts, with the
    tokens and logprobs of the whole weight kept and of transformers."""
    path = _saved(tmp_path, tied=True, vocab_size=4096)  # an LM head of 8 MiB: parts of 2 MiB, many pages each
    prompts = random_prompts(len(TAIL), 3, 30, seed=4)
    # the default SPLIT_OUT: no head this narrow is split
    ref = _kept_reference(path, prompts, lambda packs: all(not g.parts for g in packs.gemms))
    part = 1024
    monkeypatch.setattr(linears, "SPLIT_OUT", part)
    order: list[tuple[str, int]] = []  # packs and page-outs, in order
    _spy(monkeypatch, torch.ops.mkldnn, "_reorder_linear_weight", lambda w, hint: order.append(("pack", w.data_ptr())))
    _spy(monkeypatch, cpu_memory, "page_out",
         lambda ts, files=None, **kw: order.extend(("out", t.data_ptr()) for t in ts))
    split_calls: list[int] = []
    _spy(monkeypatch, linears, "_split_call", lambda x, parts, b: split_calls.append(x.numel() // x.shape[-1]))
    llm = _llm(path, release=True)
    model = llm.model
    try:
        got = _generate(llm, prompts)
        packs = llm._prepack
        head = model.lm_head.weight
        gemm = next(g for g in packs.gemms if g.members == (model.lm_head,))
        vocab, hidden = head.shape
        assert gemm.weight is None and len(gemm.parts) == -(-vocab // part) and gemm.released > 0
        assert packs.paged_out(model.lm_head)
        rows = [head.data_ptr() + i * part * hidden * head.element_size() for i in range(len(gemm.parts))]
        head_events = [e for e in order if e[1] in rows]
        assert head_events == [(kind, r) for r in rows for kind in ("pack", "out")]  # each part out before the next
        assert all(g.parts == () for g in packs.gemms if g is not gemm)  # the layers' GEMMs are narrower
        assert {1, 2, 3, 4} <= set(split_calls)  # the run's tail: steps of 4, 3, 2 and 1 rows on the parts
        _same(got, ref)
    finally:
        unpatch(model)
    for prompt, out, n in zip(prompts, got, TAIL, strict=True):
        assert_matches_hf(model, [prompt], [out], n, eos=False)


def test_split_call_matches_the_whole_gemm():
    """The parts' outputs side by side, the bias added after: the whole packed GEMM's values (float32 rounding)."""
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(250, 40, generator=gen), torch.randn(250, generator=gen)
    parts = tuple(torch.ops.mkldnn._reorder_linear_weight(r, linears.PACK_BATCH_HINT) for r in w.split(96))
    whole = torch.ops.mkldnn._reorder_linear_weight(w, linears.PACK_BATCH_HINT)
    for shape in [(1, 40), (3, 40), (7, 40), (2, 5, 40)]:
        x = torch.randn(*shape, generator=gen)
        for bias in (b, None):
            got = linears._split_call(x, parts, bias)
            assert got.shape == (*shape[:-1], 250)
            assert torch.allclose(got, linears._packed_call(x, whole, bias), atol=1e-5, rtol=1e-5), shape
            assert torch.allclose(got, torch.nn.functional.linear(x, w, bias), atol=1e-5, rtol=1e-5), shape
