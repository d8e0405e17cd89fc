"""Draft-model speculative decoding: greedy outputs and seeded samples identical to the LLM without it.

The built-in tiny model drafts for itself (nearly every proposal accepted), and a second random engine test
model drafts for the first (few accepted): both must leave the target's outputs unchanged, batch 1 and 8.
"""

from __future__ import annotations

import pytest
from engine_helpers import engine_model, random_prompts

from flashpage import LLM, SamplingParams
from flashpage.tiny import load_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Return a new list of the", "import os\nimport",
         "Raise an exception if the value is", "The list of items is", "def f(x):\n    return",
         "a b c d e f g", "Repeat after me: hello world"]


def _ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("batch", [1, 8])
def test_tiny_drafting_for_itself_is_greedy_identical(tiny, batch):
    model, tok = tiny
    draft, _ = load_tiny_model()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = LLM(model, tok).generate(TEXTS[:batch], params, use_tqdm=False)
    spec = LLM(model, tok, speculative_config={"model": draft, "num_speculative_tokens": 4}, check_invariants=True)
    got = spec.generate(TEXTS[:batch], params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    stats = spec.stats()
    assert stats.spec_mean_acceptance_length > 3.0  # the same weights: (nearly) every proposal holds
    assert stats.steps < 40 * batch / 2


def test_a_different_draft_keeps_greedy_and_seeded_outputs():
    target, draft = engine_model("llama"), engine_model("llama", seed=1)
    prompts = random_prompts(8, 6, 20, seed=5)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=24, temperature=0.9, seed=i, ignore_eos=True) for i in range(8)]
    base = LLM(target, num_blocks=256, block_size=8)
    spec = LLM(target, num_blocks=256, block_size=8, check_invariants=True,
               speculative_config={"model": draft, "num_speculative_tokens": 3})
    assert _ids(spec.generate(prompts, greedy, use_tqdm=False)) == _ids(base.generate(prompts, greedy, use_tqdm=False))
    assert _ids(spec.generate(prompts, seeded, use_tqdm=False)) == _ids(base.generate(prompts, seeded, use_tqdm=False))
    assert spec.stats().spec_proposed_tokens > 0
    assert spec._spec.draft.llm.kv.stats().in_use == 0  # finished sequences' shadows were freed


def test_a_draft_of_another_vocabulary_is_refused(tiny):
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(*tiny, speculative_config={"model": engine_model("llama"), "num_speculative_tokens": 2})


def test_a_draft_with_fewer_positions_is_refused_naming_it():
    from model_zoo import tiny_model

    short = tiny_model("llama", seed=2, max_position_embeddings=64)
    with pytest.raises(ValueError, match="the draft model cannot serve this LLM: max_model_len=512"):
        LLM(engine_model("llama"), num_blocks=64, speculative_config={"model": short, "num_speculative_tokens": 2})


def test_preemption_and_a_full_draft_pool(tiny):
    """A pool too small for every sequence: the target preempts, the draft's pool (as small) runs out and its
    shadows propose nothing for a while; outputs as without speculation."""
    model, tok = tiny
    draft, _ = load_tiny_model()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = LLM(model, tok).generate(TEXTS, params, use_tqdm=False)
    spec = LLM(model, tok, num_blocks=24, block_size=8, check_invariants=True,
               speculative_config={"model": draft, "num_speculative_tokens": 4})
    got = spec.generate(TEXTS, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    assert spec.stats().preemptions > 0 and spec.stats().spec_accepted_tokens > 0
    assert spec._spec.draft.llm.kv.stats().in_use == 0
