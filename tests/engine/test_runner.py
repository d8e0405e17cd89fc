"""flashpage.engine.runner.ModelRunner driven directly: one scheduled step through ``llm.runner.run``.

The runner is built by LLM's own construction (its pool, scheduler rollback and patched model); the step's
logits must equal the unpatched model's logits for the same prompts (float32).
"""

from __future__ import annotations

import torch
from model_zoo import tiny_model

from flashpage import LLM, SamplingParams
from flashpage.engine.runner import ModelRunner, step_inputs

ATOL = 1e-5


def _reference_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """Every position's logits (T, V) of the model's own forward (before LLM patches it)."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([prompt])).logits[0].float()


def test_prefill_logits_equal_the_unpatched_model():
    model = tiny_model("llama")
    prompt = [5, 17, 42, 99, 3, 120, 7, 64, 11]
    want = _reference_logits(model, prompt)[-1]
    llm = LLM(model, num_blocks=32, block_size=16, compile=False)
    assert isinstance(llm.runner, ModelRunner) and llm.runner.kv is llm.kv and llm._cache is llm.runner._cache
    llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    schedule = llm.scheduler.schedule()
    assert [c.num_tokens for c in schedule.chunks] == [len(prompt)]
    logits = llm.runner.run(schedule)
    assert logits.shape == (1, llm.vocab_size)
    torch.testing.assert_close(logits[0].float(), want, atol=ATOL, rtol=0)
    assert schedule.chunks[0].seq.num_computed == len(prompt)


def test_packed_step_keeps_emitting_rows_then_extra_rows():
    model = tiny_model("llama")
    prompts = [[5, 17, 42, 99, 3], [8, 4, 100, 27, 90, 12, 61]]
    refs = [_reference_logits(model, p) for p in prompts]
    llm = LLM(model, num_blocks=32, block_size=16, compile=False)
    for p in prompts:
        llm.add_request(p, SamplingParams(max_tokens=1, temperature=0.0))
    schedule = llm.scheduler.schedule()
    ids, pos, keep = step_inputs(schedule, [1, 6])
    assert ids == prompts[0] + prompts[1] and pos == list(range(5)) + list(range(7)) and keep == [4, 11, 1, 6]
    logits = llm.runner.run(schedule, [1, 6])  # packed rows 1 (first prompt) and 6 (second prompt's 2nd)
    assert logits.shape == (4, llm.vocab_size)
    want = torch.stack([refs[0][-1], refs[1][-1], refs[0][1], refs[1][1]])
    torch.testing.assert_close(logits.float(), want, atol=ATOL, rtol=0)
