"""Speculative sampling keeps the target distribution: chi-square tests on the built-in tiny model.

2,000 unseeded samples of a repetitive prompt, with n-gram speculation (proposals from the second output
token on: the first comes from the prefill). The first speculated token (output position 1) is tested
against its exact distribution, computed with transformers on an unpatched copy of the model
(sum over the first token x of p1(x) p2(. | x), after the request's temperature / top-p); a later token
(output position 3, reached through accepted proposals) against 2,000 samples without speculation
(homogeneity). A test fails when p < 0.01.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.bench.rl import chi2_homogeneity, chi2_sf
from flashpage.tiny import load_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

SAMPLES = 2000
PROMPT = ", ".join(str(i) for i in range(1, 14)) + ","  # the model continues with tokens of the prompt
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CASES = {"temperature 0.8": SamplingParams(max_tokens=4, temperature=0.8, ignore_eos=True),
         "top-p 0.9": SamplingParams(max_tokens=4, top_p=0.9, ignore_eos=True)}


@pytest.fixture(scope="module")
def reference():
    """An unpatched copy of the tiny model (the exact distributions come from transformers alone)."""
    model, tok = load_tiny_model()
    return model, tok


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(N, V) logits -> the request's sampling distribution: softmax(logits / T) restricted to the top-p
    nucleus (tokens kept while the mass of likelier ones is below top_p), renormalised. Written here
    independently of the engine's sampler."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def second_token_distribution(model, prompt: list[int], params: SamplingParams, mass: float = 1 - 1e-7):
    """P(output[1] = t) = sum_x p1(x) p2(t | prompt + [x]), over the first tokens x holding ``mass`` of p1."""
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        sorted_p, order = p1.sort(descending=True)
        count = int((sorted_p.cumsum(0) < mass).sum()) + 1
        firsts = order[:count]
        batch = torch.cat([torch.tensor([prompt]).expand(count, -1), firsts[:, None]], dim=1)
        rows = []
        for part in batch.split(256):
            rows.append(target_probs(model(part).logits[:, -1], params))
        p2 = torch.cat(rows)
    return (p1[firsts, None] * p2).sum(0)


def goodness_of_fit(samples: list[int], expected: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of a chi-square test of ``samples`` against the distribution ``expected`` (V,), rare tokens
    pooled into one cell."""
    n = len(samples)
    counts = Counter(samples)
    exp = expected * n
    big = (exp >= min_expected).nonzero().flatten().tolist()
    stat, cells = 0.0, 0
    for t in big:
        stat += (counts[t] - float(exp[t])) ** 2 / float(exp[t])
        cells += 1
    rest_exp = n - sum(float(exp[t]) for t in big)
    rest_obs = n - sum(counts[t] for t in big)
    if rest_exp > 1e-9:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        cells += 1
    else:
        assert rest_obs == 0
    return chi2_sf(stat, cells - 1)


@pytest.mark.parametrize("case", list(CASES))
def test_speculated_tokens_follow_the_target_distribution(tiny, reference, case):
    params = CASES[case]
    model, tok = reference
    prompt = tok(PROMPT)["input_ids"]
    spec = LLM(*tiny, max_num_seqs=256, speculative_config=NGRAM)
    spec._spec.step_overhead_tokens = 1e9  # propose whenever there is a match, whatever the batch size
    outs = spec.generate([prompt] * SAMPLES, params, use_tqdm=False)
    stats = spec.stats()
    assert stats.spec_verifications >= SAMPLES // 2 and stats.spec_accepted_tokens >= SAMPLES // 4
    firsts = [o.outputs[0].token_ids[1] for o in outs]
    p_first = goodness_of_fit(firsts, second_token_distribution(model, prompt, params))
    assert p_first > 0.01, f"{case}: speculated token 1 does not follow the target (p={p_first:.2g})"
    base = LLM(*tiny, max_num_seqs=256).generate([prompt] * SAMPLES, params, use_tqdm=False)
    later, later_base = ([o.outputs[0].token_ids[3] for o in x] for x in (outs, base))
    stat, dof = chi2_homogeneity(later, later_base)
    assert dof >= 2
    p_later = chi2_sf(stat, dof)
    assert p_later > 0.01, f"{case}: token 3 differs from sampling without speculation (p={p_later:.2g})"
