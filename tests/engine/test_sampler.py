"""The batched sampler keeps the old outputs: seeded draws equal the per-row path it replaced, filters
keep exactly the old tokens and transformers' warpers' tokens, candidate draws have the same distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from flashpage.bench import sampler as sampler_bench
from flashpage.bench.sampler import sampling_seqs
from flashpage.engine import SamplingParams
from flashpage.engine.sampler import (
    NUCLEUS_TRIES,
    Sampler,
    draw,
    filter_logits,
    filter_logits_batched,
    sample_nucleus,
    top_k_candidates,
)


def _old_filter_batched(rows: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """The batched filter before this change (one full sort of every row), kept as the oracle."""
    vocab = rows.shape[1]
    neg_inf = float("-inf")
    k_list = [k if 0 < k < vocab else 0 for k in top_k]
    use_k, use_p, use_min = any(k_list), any(p < 1.0 for p in top_p), any(m > 0.0 for m in min_p)
    if use_k or use_p:
        sorted_rows, order = rows.sort(dim=-1, descending=True)
        if use_k:
            ks = torch.tensor(k_list, dtype=torch.long)[:, None]
            kth = sorted_rows.gather(1, (ks - 1).clamp(min=0))
            kth = torch.where(ks > 0, kth, torch.full_like(kth, neg_inf))
            rows = rows.masked_fill(rows < kth, neg_inf)
            sorted_rows = sorted_rows.masked_fill(sorted_rows < kth, neg_inf)
        if use_p:
            ps = torch.tensor(list(top_p), dtype=rows.dtype)[:, None]
            probs = sorted_rows.softmax(-1)
            drop = (probs.cumsum(-1) - probs >= ps) & (ps < 1.0)
            rows = rows.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), neg_inf)
    if use_min:
        mins = torch.tensor(list(min_p), dtype=rows.dtype)[:, None]
        probs = rows.softmax(-1)
        rows = rows.masked_fill(probs < mins * probs.max(dim=-1, keepdim=True).values, neg_inf)
    return rows


def _old_seeded_draw(row: torch.Tensor, params: SamplingParams, seed: int) -> int:
    """The seeded draw before this change: one row filtered alone, exponential noise on its generator."""
    row = filter_logits(row / params.temperature, params.top_k, params.top_p, params.min_p)
    probs = torch.softmax(row, dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(seed))
    return int((probs / noise).argmax())


def _random_settings(g: torch.Generator, n: int, vocab: int) -> tuple[list[int], list[float], list[float]]:
    ks = [k if k < vocab + 3 else -1 for k in torch.randint(-1, vocab + 6, (n,), generator=g).tolist()]
    ps = [p if p < 0.9 else 1.0 for p in torch.rand(n, generator=g).tolist()]
    ms = [m if m < 0.4 else 0.0 for m in (torch.rand(n, generator=g) * 0.5).tolist()]
    return ks, ps, ms


def test_batched_filter_is_bit_identical_to_the_old_one():
    g = torch.Generator().manual_seed(1)
    for trial in range(80):
        rows = torch.randn(7, 40, generator=g) * 3
        if trial % 3 == 0:
            rows[:, :5] = rows[:, :1]  # ties at the top
        if trial % 4 == 1:
            rows[:, 10:20] = rows[:, 10:11]  # ties in the middle (at a k-th value)
        ks, ps, ms = _random_settings(g, 7, 40)
        new, old = filter_logits_batched(rows, ks, ps, ms), _old_filter_batched(rows, ks, ps, ms)
        assert torch.equal(new, old), (trial, ks, ps, ms)


def test_rows_that_filter_nothing_are_not_touched():
    rows = torch.randn(3, 50)
    assert filter_logits_batched(rows, [-1, 0, 50], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]) is rows
    out = filter_logits_batched(rows, [-1, 5, 0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    assert torch.equal(out[[0, 2]], rows[[0, 2]]) and torch.isinf(out[1]).sum() == 45
    assert not torch.isinf(rows).any(), "the input is not modified"


def test_seeded_draws_equal_the_old_per_row_path():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 300, generator=g) * 2
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=100 + i)
              for i, (t, k, p, m) in enumerate([(1.0, -1, 1.0, 0.0), (0.7, 20, 1.0, 0.0), (1.3, 0, 0.8, 0.0),
                                                (1.0, 50, 0.6, 0.1), (0.5, -1, 1.0, 0.2), (2.0, 299, 0.95, 0.0)] * 2)]
    seqs = sampling_seqs(params)
    for step in range(3):  # the generators advance step after step, as in the old path
        got = Sampler([])(logits, seqs)
        # the old path: each row's own generator, advanced once per step
        old = []
        for i, p in enumerate(params):
            gen = torch.Generator().manual_seed(seqs[i].seed)
            for _ in range(step + 1):
                row = filter_logits(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
                probs = torch.softmax(row, dim=-1)
                tok = int((probs / torch.empty_like(probs).exponential_(generator=gen)).argmax())
            old.append(tok)
        assert got == old, step


def test_seeded_draw_alone_equals_draw_in_a_batch():
    p = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, seed=5)
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(3))
    batch = sampling_seqs([SamplingParams(), p, SamplingParams(top_k=3), SamplingParams(temperature=0.0)])
    alone = sampling_seqs([p])
    in_batch = Sampler([])(logits, batch)[1]
    assert in_batch == Sampler([])(logits[1:2], alone)[0] == _old_seeded_draw(logits[1], p, batch[1].seed)


@pytest.mark.parametrize("vocab", [100, 2000])
def test_masks_equal_transformers_warpers(vocab):
    """TopK, TopP and MinP warpers keep the same tokens (logits without ties; top-p boundaries whose
    cumulative mass lies within 1e-5 of top_p are checked to be the only differences)."""
    g = torch.Generator().manual_seed(vocab)
    ids = torch.zeros(6, 1, dtype=torch.long)
    for trial in range(20):
        rows = torch.randn(6, vocab, generator=g) * (1 + trial % 4)
        k = int(torch.randint(1, vocab, (1,), generator=g))
        p = float(torch.rand(1, generator=g)) * 0.9 + 0.05
        m = float(torch.rand(1, generator=g)) * 0.3
        for ours, theirs in [(filter_logits_batched(rows, [k] * 6, [1.0] * 6, [0.0] * 6), TopKLogitsWarper(k)),
                             (filter_logits_batched(rows, [-1] * 6, [1.0] * 6, [m] * 6), MinPLogitsWarper(m))]:
            assert torch.equal(torch.isinf(ours), torch.isinf(theirs(ids, rows.clone())))
        ours = torch.isinf(filter_logits_batched(rows, [-1] * 6, [p] * 6, [0.0] * 6))
        hf = torch.isinf(TopPLogitsWarper(p)(ids, rows.clone()))
        for r in (ours != hf).any(-1).nonzero().flatten().tolist():
            probs = rows[r].softmax(-1).sort(descending=True).values.cumsum(-1)
            assert (probs - p).abs().min() < 1e-5, (trial, r, "differs from transformers away from a tie")


def test_top_k_candidates_have_the_filtered_distribution():
    g = torch.Generator().manual_seed(4)
    for trial in range(40):
        rows = torch.randn(5, 200, generator=g) * 3
        ks = torch.randint(1, 60, (5,), generator=g).tolist()
        _, ps, ms = _random_settings(g, 5, 200)
        probs, ids, whole = top_k_candidates(rows, ks, ps, ms)
        assert whole == []
        dense = torch.zeros(5, 200).scatter_add_(1, ids, probs)
        want = torch.softmax(filter_logits_batched(rows, ks, ps, ms), -1)
        assert torch.allclose(dense, want, atol=1e-6), trial
        assert torch.equal(dense > 0, want > 0), trial


def test_top_k_candidates_send_ties_past_k_to_the_whole_row():
    rows = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    _, _, whole = top_k_candidates(rows, [3, 3], [1.0, 1.0], [0.0, 0.0])
    assert whole == [0]  # row 0 keeps 5 tokens (three tie at the 3rd value); row 1 its 3
    torch.manual_seed(0)
    seqs = sampling_seqs([SamplingParams(top_k=3), SamplingParams(top_k=3)])
    picks = torch.tensor([Sampler([])(rows, seqs) for _ in range(600)])
    assert set(picks[:, 0].tolist()) == {0, 1, 2, 3, 4} and set(picks[:, 1].tolist()) == {0, 1, 2}


def test_candidate_draws_follow_the_filtered_softmax():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -4.0])
    rows = 6000
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05)
    tokens = torch.tensor(Sampler([])(logits.repeat(rows, 1), sampling_seqs([params] * rows)))
    want = torch.softmax(filter_logits(logits / 0.9, 6, 0.9, 0.05), -1)
    freq = torch.bincount(tokens, minlength=8).float() / rows
    assert torch.equal(freq > 0, want > 0)
    assert torch.allclose(freq, want, atol=0.03), (freq, want)


def test_bench_sampler_case_runs():
    row = sampler_bench.run_case(sampler_bench.CASES[3], batch=4, vocab=1000, iters=1, repeats=1)
    assert row["flashpage_s"] > 0 and row["transformers_s"] > 0
    assert row["ratio"] == pytest.approx(row["flashpage_s"] / row["transformers_s"])
    text = sampler_bench.format_report({"batch": 4, "threads": 1, "load_average_1m": 0.0, "rows": [row],
                                        "goal": "g", "goal_met": row["ratio"] <= 1.0})
    assert "k=50" in text and "ms" in text


def test_draw_follows_the_probabilities_and_never_draws_a_zero():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]])  # unnormalised rows allowed
    torch.manual_seed(0)
    picks = torch.stack([draw(probs.expand(2, 5)) for _ in range(4000)])
    freq = torch.bincount(picks[:, 0], minlength=5).float() / 4000
    assert torch.equal(freq > 0, probs[0] > 0)
    assert torch.allclose(freq, probs[0], atol=0.03), freq
    assert set(picks[:, 1].tolist()) == {4}


@pytest.mark.parametrize("tries", [NUCLEUS_TRIES, 0])  # 0: every row through the sort-based fallback
def test_nucleus_draws_follow_the_filtered_softmax(tries):
    """Rejection draws (and the sort fallback) have the distribution of filter_logits' row, for
    top-p alone, min-p alone, both, and a small top-p whose nucleus is one or two tokens."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -4.0])
    settings = [(0.9, 0.0), (1.0, 0.2), (0.8, 0.1), (0.3, 0.0), (1.0, 0.0)]
    rows = 3000
    torch.manual_seed(1)
    for top_p, min_p in settings:
        tokens = torch.tensor(sample_nucleus(logits.repeat(rows, 1), [top_p] * rows, [min_p] * rows, tries))
        want = torch.softmax(filter_logits(logits, 0, top_p, min_p), -1)
        freq = torch.bincount(tokens, minlength=8).float() / rows
        assert torch.equal(freq > 0, want > 0), (top_p, min_p, freq, want)
        assert torch.allclose(freq, want, atol=0.035), (top_p, min_p, freq, want)


def test_sampler_top_p_rows_without_top_k_follow_the_filtered_softmax():
    """The engine's unseeded top-p path (what RL rollouts use): rows of different settings in one batch."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 50, generator=g) * 2
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(top_p=0.6, min_p=0.02)]
    rows = 2500
    torch.manual_seed(2)
    seqs = sampling_seqs([params[0]] * rows + [params[1]] * rows)
    tokens = torch.tensor(Sampler([])(torch.cat([logits[:1].repeat(rows, 1), logits[1:].repeat(rows, 1)]), seqs))
    for i, p in enumerate(params):
        want = torch.softmax(filter_logits(logits[i] / p.temperature, -1, p.top_p, p.min_p), -1)
        freq = torch.bincount(tokens[i * rows:(i + 1) * rows], minlength=50).float() / rows
        assert torch.equal(freq > 0, want > 0) or bool((want[freq == 0] < 2e-3).all()), (i, freq, want)
        assert not bool((freq[want == 0] > 0).any()), i  # never a token outside the nucleus
        assert torch.allclose(freq, want, atol=0.035), (i, freq, want)


def test_a_uniform_rounded_past_the_total_draws_the_last_positive_entry():
    from flashpage.engine.sampler import _last_positive_past_end

    values = torch.tensor([[0.2, 0.5, 0.0, 0.0], [0.1, 0.0, 0.3, 0.6]])
    got = _last_positive_past_end(torch.tensor([4, 2]), values)  # row 0 past the end, row 1 inside
    assert got.tolist() == [1, 2]


def test_a_row_with_no_probability_left_is_refused_not_drawn():
    with pytest.raises(RuntimeError, match="no token with a positive probability"):
        draw(torch.tensor([[0.2, 0.8], [0.0, 0.0]]))
    with pytest.raises(RuntimeError, match="no token with a positive probability"):
        draw(torch.tensor([[float("nan"), 0.5]]))
