"""The half-precision closeness contract (issue 33 item 4), on Qwen3-0.6B's full width cut to 2 layers.

Token identity to transformers' bfloat16 is not a meaningful target (bfloat16 GEMMs round differently with the batch
shape), so the contract is statistical: teacher-forced on long sequences (4 x 384 random tokens), the
log-probability of every next token under

- flashpage's ``LLM`` in bfloat16 (``SamplingParams(prompt_logprobs=0)``: the engine's own step, with its C++
  paged attention, fused norm / rotary / activation ops and half-precision linears), and
- patched ``generate()`` in bfloat16 (flashpage's paged cache and attention in the model's own modules): the
  first 128 tokens as the prompt, the other 256 teacher-forced decode steps (a logits processor forces the token,
  ``output_logits`` returns the raw logits),

is compared with the float32 reference (the same weights in float32, unpatched transformers' forward); the median
and the 99th percentile of |logprob error| must be within :data:`FACTOR` (1.1x) of transformers' own bfloat16
error against the same reference, measured the same way (its forward for the engine, its unpatched
``generate()`` for patched ``generate()``). float32 stays token-identical to transformers
(tests/engine/test_fastpath.py, test_memory_real_shape.py).

The model: :func:`flashpage.bench.shapes.build_shape` (seeded random weights whose logits have real margins), 187M
parameters; float32 748 MB + bfloat16 374 MB in memory. About a minute on one thread.
"""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.bench.shapes import build_shape
from flashpage.kernels import cpu_attention
from flashpage.patches import patch, unpatch

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 2
SEQUENCES, LENGTH = 4, 384
PROMPT = 128  # generate()'s prompt; the other LENGTH - PROMPT tokens are teacher-forced decode steps
FACTOR = 1.1  # flashpage's error may be at most this multiple of transformers' own bfloat16 error
QUANTILES = (0.5, 0.99)


def _sequences(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(33)
    return torch.randint(0, vocab, (SEQUENCES, LENGTH), generator=g).tolist()


def _teacher_forced(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """(SEQUENCES, LENGTH - 1) float64 log-probability of token i + 1 given tokens 0..i (one forward per sequence,
    ``use_cache=True`` as generate()'s prefill), log-softmax of the logits in float32."""
    rows = []
    with torch.inference_mode():
        for s in seqs:
            ids = torch.tensor([s])
            logits = model(input_ids=ids, use_cache=True).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            rows.append(logp.gather(-1, ids[0, 1:, None])[:, 0].double())
    return torch.stack(rows)


class _Teacher:
    """A logits processor that makes greedy decoding emit the given sequences' next tokens (teacher forcing
    through ``generate()``; ``output_logits`` still returns the raw logits)."""

    def __init__(self, seqs: list[list[int]]) -> None:
        self.seqs = torch.tensor(seqs)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        target = self.seqs[:, input_ids.shape[1]]
        forced = torch.full_like(scores, float("-inf"))
        forced[torch.arange(len(target)), target] = 0.0
        return forced


def _generated(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """(SEQUENCES, LENGTH - PROMPT) float64 log-probabilities of tokens PROMPT.. from ``model.generate()``: the
    first PROMPT tokens as the prompt (one prefill), the rest teacher-forced one decode step at a time."""
    from transformers import LogitsProcessorList

    ids = torch.tensor(seqs)
    with torch.inference_mode():
        out = model.generate(ids[:, :PROMPT], attention_mask=torch.ones(len(seqs), PROMPT, dtype=torch.long),
                             max_new_tokens=LENGTH - PROMPT, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, logits_processor=LogitsProcessorList([_Teacher(seqs)]),
                             pad_token_id=0)
    assert torch.equal(out.sequences, ids)
    logp = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
    return logp.gather(-1, ids[:, PROMPT:, None])[..., 0].double()


def _engine(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """The same log-probabilities from ``LLM(model)``'s prompt logprobs (one engine step takes all four prompts)."""
    llm = LLM(model, block_size=128, max_num_batched_tokens=2048, kv_cache_memory=64 << 20, max_model_len=1024)
    outs = llm.generate(seqs, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    rows = []
    for out, s in zip(outs, seqs, strict=True):
        got = out.prompt_logprobs
        assert got is not None and got[0] is None and [t.token_id for t in got[1:]] == s[1:]
        rows.append(torch.tensor([t.logprob for t in got[1:]], dtype=torch.float64))
    return torch.stack(rows)


def _quantiles(err: torch.Tensor) -> list[float]:
    return [float(torch.quantile(err.flatten(), q)) for q in QUANTILES]


@pytest.fixture(scope="module")
def errors() -> dict[str, list[float]]:
    """Median and p99 of |logprob - float32 reference| for transformers' bfloat16, flashpage's patched forward and
    flashpage's LLM, all in bfloat16 on the same (bfloat16-rounded) weights."""
    model = build_shape("qwen3-0.6b", torch.float32, num_layers=LAYERS)
    seqs = _sequences(model.config.vocab_size)
    reference = _teacher_forced(model, seqs)
    decoded = reference[:, PROMPT - 1:]  # the positions generate() decodes
    model = model.to(torch.bfloat16)  # the same weights rounded (build_shape's weights are dtype-independent)
    result = {"transformers": _quantiles((_teacher_forced(model, seqs) - reference).abs()),
              "transformers-generate": _quantiles((_generated(model, seqs) - decoded).abs())}
    calls: list[int] = []
    real = cpu_attention.run_kernel

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    patch(model)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_attention, "run_kernel", counted)
            result["patched"] = _quantiles((_generated(model, seqs) - decoded).abs())
        assert calls, "the patched bfloat16 forward runs flashpage's C++ attention"
        result["llm"] = _quantiles((_engine(model, seqs) - reference).abs())
    finally:
        unpatch(model)
    print(f"median / p99 |logprob error| vs float32: {result}")  # shown with pytest -s
    return result


@pytest.mark.parametrize(("system", "baseline"), [("patched", "transformers-generate"), ("llm", "transformers")])
def test_bfloat16_logprobs_as_close_as_transformers(errors, system, baseline):
    """median and p99 |logprob error| of flashpage in bfloat16 <= 1.1x transformers' own bfloat16's (patched
    generate() against unpatched generate(), the engine against a plain forward)."""
    ours, theirs = errors[system], errors[baseline]
    for q, mine, ref in zip(QUANTILES, ours, theirs, strict=True):
        assert mine <= FACTOR * ref, f"{system}: quantile {q} of |logprob error| {mine:.4f} > {FACTOR} x {ref:.4f}"
    assert theirs[0] > 0, "bfloat16 differs from float32 (the comparison is not vacuous)"
