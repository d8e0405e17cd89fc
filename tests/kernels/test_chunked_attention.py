"""Chunked attention (Llama 4's local layers): a key is visible iff it is in the query's chunk and causal.

The PyTorch paged kernels take it as ``LayerOptions.chunk`` (flash-attn has no such mode, so those layers
always run on the PyTorch mask path); checked in float64 against a loop over every query. Then Llama 4
with chunks smaller than its prompts: patched generate() (left-padded batch) and LLM (packed steps,
a prefix-cache hit whose cached part ends mid-chunk) against unpatched generate(), and the same run
with the chunk switched off differs (so the chunk is what makes it exact).
"""

from __future__ import annotations

import pytest
import torch
from sweep_models import _check_generate, _check_llm, _greedy, _prompts, build_model

import flashpage
from flashpage.cache import PagedKVCache
from flashpage.kernels.paged import LayerOptions, attend_static, visible_keys
from flashpage.patches.patching import patch_state

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")


# ------------------------------------------------------------------------------ the kernel contract
def _naive(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], chunk: int,
           scale: float) -> torch.Tensor:
    """q (B, H, Sq, D); keys[b] / values[b] (Sk_b, Hk, D): chunked causal attention, one query at a time."""
    b_, h, sq, _ = q.shape
    out = torch.zeros_like(q)
    for b in range(b_):
        k, v = keys[b], values[b]
        sk, group = k.shape[0], h // k.shape[1]
        for i in range(sq):
            p = i + sk - sq
            lo = p - p % chunk
            for head in range(h):
                kh, vh = k[lo: p + 1, head // group], v[lo: p + 1, head // group]
                w = torch.softmax((kh @ q[b, head, i]) * scale, dim=0)
                out[b, head, i] = w @ vh
    return out


@pytest.mark.parametrize("sq", [1, 3, 7])
def test_chunked_attend_static_matches_a_loop_in_float64(sq: int) -> None:
    g = torch.Generator().manual_seed(0)
    chunk, page, heads, kv_heads, d = 4, 4, 4, 2, 8
    lengths = [7, 9, 13]
    kv = PagedKVCache(1, kv_heads, d, num_blocks=16, block_size=page, dtype=torch.float64)
    keys, values = [], []
    for s, n in enumerate(lengths):
        kv.add_sequence(s)
        keys.append(torch.randn(n, kv_heads, d, generator=g, dtype=torch.float64))
        values.append(torch.randn(n, kv_heads, d, generator=g, dtype=torch.float64))
    plan = kv.plan(list(range(len(lengths))), lengths)
    kv.write(0, torch.cat(keys), torch.cat(values), plan)
    q = torch.randn(len(lengths), heads, sq, d, generator=g, dtype=torch.float64)
    seqlens = torch.tensor(lengths)
    opts = LayerOptions(0.3, True, (-1, -1), 0.0, chunk=chunk)
    got = attend_static(q, kv.k_pages(0), kv.v_pages(0), plan.block_table, seqlens, opts)
    torch.testing.assert_close(got, _naive(q, keys, values, chunk, 0.3), rtol=1e-12, atol=1e-12)
    # the chunk is what restricts it: without it the result is plain causal attention
    plain = attend_static(q, kv.k_pages(0), kv.v_pages(0), plan.block_table, seqlens,
                          LayerOptions(0.3, True, (-1, -1), 0.0))
    assert not torch.allclose(plain, got)


def test_visible_keys_chunk_boundaries() -> None:
    # one sequence of 6 keys, 3 queries (positions 3, 4, 5), chunks of 4: keys {0..3}, {4}, {4, 5}
    mask = visible_keys(torch.tensor([6]), 3, 8, True, (-1, -1), chunk=4)[0, 0]
    assert mask.tolist() == [[True] * 4 + [False] * 4,
                             [False] * 4 + [True] + [False] * 3,
                             [False] * 4 + [True, True] + [False] * 2]


# ------------------------------------------------------------------------------------- Llama 4
@pytest.fixture(scope="module")
def llama4() -> torch.nn.Module:
    model = build_model("llama4_text")
    assert model.config.attention_chunk_size < 7  # the sweep prompts (7 and 4 tokens) + 12 new cross chunks
    return model


def test_llama4_generate_and_llm_exact(llama4: torch.nn.Module) -> None:
    prompts = _prompts(llama4.config.vocab_size)
    ref = _greedy(llama4, prompts)
    result = _check_generate(llama4, prompts, ref)
    assert result.outcome == "exact", result.detail
    flashpage.patch(llama4)
    try:
        chunks = patch_state(llama4).chunks
    finally:
        flashpage.unpatch(llama4)
    assert chunks and set(chunks.values()) == {llama4.config.attention_chunk_size}
    refs = [_greedy(llama4, [p]) for p in prompts]
    result = _check_llm(llama4, prompts, refs)
    assert result.outcome == "exact", result.detail


def test_llama4_llm_prefix_hit_mid_chunk(llama4: torch.nn.Module) -> None:
    """Two requests sharing 8 prompt tokens: the second reuses two cached blocks of 4, which end inside a
    chunk of 5 (the chunk is counted from the sequence's start, not from the cached part)."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 99, (8,), generator=g).tolist()
    prompts = [shared + [5, 6, 7], shared + [9, 10]]
    flashpage.unpatch(llama4)  # the reference is the unpatched model (an earlier LLM left it patched)
    refs = [_greedy(llama4, [p]) for p in prompts]
    llm = flashpage.LLM(llama4, block_size=4, num_blocks=64, max_num_seqs=1, compile=False)
    params = flashpage.SamplingParams(temperature=0.0, max_tokens=8)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert llm.stats().prefix_cache_hit_rate > 0
    for out, (ref_tokens, _) in zip(outs, refs, strict=True):
        assert list(out.token_ids) == ref_tokens[0][:8]


def test_llama4_without_the_chunk_differs(llama4: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle can fail: with the chunk dropped (plain causal attention) patched generate() differs."""
    from flashpage.patches import checks

    monkeypatch.setattr(checks, "chunked_layers", lambda report: {})
    prompts = _prompts(llama4.config.vocab_size)
    flashpage.unpatch(llama4)  # LLM (earlier tests) leaves it patched, with the chunks it found
    ref = _greedy(llama4, prompts)
    llama4.__dict__.pop("_flashpage_checked", None)
    try:
        result = _check_generate(llama4, prompts, ref)
    finally:
        llama4.__dict__.pop("_flashpage_checked", None)
    assert result.outcome == "silent"


def test_llama4_llm_compile_runs_chunked_models_eagerly(llama4: torch.nn.Module) -> None:
    """LLM's compiled step (the CPU default) would specialise Llama 4's mask code on the step length:
    chunked models run eagerly, exact, and an explicit compile=True says so."""
    prompts = _prompts(llama4.config.vocab_size)
    flashpage.unpatch(llama4)
    refs = [_greedy(llama4, [p]) for p in prompts]
    with pytest.warns(UserWarning, match="chunked-attention layers; its steps run eagerly"):
        llm = flashpage.LLM(llama4, block_size=4, num_blocks=64, compile=True)
    outs = llm.generate(prompts, flashpage.SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == [r[0][0] for r in refs]
    assert llm.stats().compiled_steps == 0
