"""A slice of transformers' own generation tests (GenerationTesterMixin style) on patched models.

transformers' test files are not installed with the package, so this is the slice written
again: each check is one ``generate()`` call (or a short chain of them) run on the same model
unpatched (the reference) and then patched, and every output of the call is compared, call by
call: token ids exactly, scores and logits to 1e-4. The patched run must go through
flashpage's paged cache; the unpatched one must not.

Checks: greedy with output_scores/output_logits, sampling with a seed, sampling with
num_return_sequences, beam search (with num_return_sequences and sequence scores), beam
sampling, assisted decoding with a second model, prompt lookup decoding, stopping criteria
(custom criteria and several EOS ids), continuation from a returned cache, and the forward's
logits on a left-padded batch. Families: llama, gpt2, gemma2 (sliding window, softcaps) and
qwen2, from ``tests/model_zoo.py``. Left padding, and right padding (the padded last position
still attends to the real keys before it, as in transformers).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from model_zoo import EOS, PAD, left_padded_batch, tiny_model
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

import flashpage
from flashpage.patches import HFPagedCache

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

FAMILIES = ["llama", "gpt2", "gemma2", "qwen2"]
LENGTHS = [5, 11, 8]
MAX_NEW = 8
SEED = 7
ATOL = 1e-4


@dataclass
class Inputs:
    """What a check runs on: the model, a second model (assistant), a left-padded batch."""

    model: torch.nn.Module
    assistant: torch.nn.Module
    ids: torch.Tensor
    mask: torch.Tensor

    def generate(self, **kwargs: Any) -> Any:
        kwargs.setdefault("input_ids", self.ids)
        kwargs.setdefault("attention_mask", self.mask)
        kwargs.setdefault("max_new_tokens", MAX_NEW)
        kwargs.setdefault("pad_token_id", PAD)
        with torch.inference_mode():
            return self.model.generate(**kwargs)


Check = Callable[[Inputs], dict[str, Any]]


def _seeded(run: Check) -> Check:
    def wrapped(inp: Inputs) -> dict[str, Any]:
        torch.manual_seed(SEED)
        return run(inp)

    return wrapped


def _dict_out(out: Any, *fields: str) -> dict[str, Any]:
    return {f: getattr(out, f) for f in ("sequences", *fields)}


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _cache_kwarg(model: torch.nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class StopOnTokens(StoppingCriteria):
    """Ends each row (independently) once its last token is one of ``tokens``."""

    def __init__(self, tokens: set[int]) -> None:
        self.tokens = torch.tensor(sorted(tokens))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.isin(input_ids[:, -1], self.tokens)


# ------------------------------------------------------------------------------------ the checks
def greedy(inp: Inputs) -> dict[str, Any]:
    out = inp.generate(do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
    return _dict_out(out, "scores", "logits")


def sample(inp: Inputs) -> dict[str, Any]:
    out = inp.generate(do_sample=True, temperature=0.9, top_k=20, top_p=0.95, return_dict_in_generate=True,
                       output_scores=True)
    return _dict_out(out, "scores")


def sample_num_return_sequences(inp: Inputs) -> dict[str, Any]:
    return {"sequences": inp.generate(do_sample=True, num_return_sequences=3)}


def beam_search(inp: Inputs) -> dict[str, Any]:
    out = inp.generate(do_sample=False, num_beams=3, num_return_sequences=2, return_dict_in_generate=True,
                       output_scores=True, length_penalty=1.0, early_stopping=False)
    return _dict_out(out, "sequences_scores", "beam_indices")


def beam_sample(inp: Inputs) -> dict[str, Any]:
    return {"sequences": inp.generate(do_sample=True, num_beams=2, temperature=1.2)}


def assisted(inp: Inputs) -> dict[str, Any]:
    # assisted decoding takes one row; the shortest, so its left padding is in the mask
    out = inp.generate(input_ids=inp.ids[:1], attention_mask=inp.mask[:1], do_sample=False,
                       assistant_model=inp.assistant, return_dict_in_generate=True, output_scores=True)
    return _dict_out(out, "scores")


def prompt_lookup(inp: Inputs) -> dict[str, Any]:
    ids = torch.cat([inp.ids[1:2], inp.ids[1:2, -6:], inp.ids[1:2, -6:]], dim=1)  # repeats to look up
    out = inp.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       prompt_lookup_num_tokens=3, return_dict_in_generate=True, output_logits=True)
    return _dict_out(out, "logits")


def stopping_criteria(inp: Inputs) -> dict[str, Any]:
    stop = StopOnTokens({t for t in range(3, 128) if t % 5 == 0})
    custom = inp.generate(do_sample=False, max_new_tokens=16, stopping_criteria=StoppingCriteriaList([stop]))
    several_eos = inp.generate(do_sample=False, max_new_tokens=16, eos_token_id=[EOS, 40, 41, 42, 43])
    return {"custom": custom, "several_eos": several_eos}


def continue_from_cache(inp: Inputs) -> dict[str, Any]:
    first = inp.generate(do_sample=False, max_new_tokens=4, return_dict_in_generate=True)
    more = torch.tensor([[11, 12, 13]] * inp.ids.shape[0])
    ids = torch.cat([first.sequences, more], dim=1)
    mask = torch.cat([inp.mask, torch.ones(ids.shape[0], ids.shape[1] - inp.mask.shape[1], dtype=inp.mask.dtype)], 1)
    cache = _cache_of(first)
    second = inp.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6,
                          return_dict_in_generate=True, output_logits=True, **{_cache_kwarg(inp.model): cache})
    return {"first": first.sequences, "second": second.sequences, "logits": second.logits,
            "cache_length": cache.get_seq_length()}


def left_padded_forward(inp: Inputs) -> dict[str, Any]:
    """Two forwards by hand: the padded prompt, then one token per row on the returned cache."""
    cache = HFPagedCache(inp.model.config) if flashpage.is_patched(inp.model) else DynamicCache()
    kw = _cache_kwarg(inp.model)
    with torch.inference_mode():
        first = inp.model(input_ids=inp.ids, attention_mask=inp.mask, use_cache=True, **{kw: cache})
        step = first.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([inp.mask, torch.ones_like(step)], dim=1)
        position = mask.sum(dim=1, keepdim=True) - 1
        second = inp.model(input_ids=step, attention_mask=mask, position_ids=position, use_cache=True,
                           **{kw: cache})
    return {"real_positions": first.logits[inp.mask.bool()], "next": second.logits}


CHECKS: dict[str, Check] = {
    "greedy": greedy,
    "sample": _seeded(sample),
    "sample_num_return_sequences": _seeded(sample_num_return_sequences),
    "beam_search": beam_search,
    "beam_sample": _seeded(beam_sample),
    "assisted": assisted,
    "prompt_lookup": prompt_lookup,
    "stopping_criteria": stopping_criteria,
    "continue_from_cache": continue_from_cache,
    "left_padded_forward": left_padded_forward,
}


# ------------------------------------------------------------------------------------ comparing
def assert_same(ref: Any, got: Any, where: str) -> None:
    """Token ids and ints exactly, floating tensors to ATOL, through tuples, lists and dicts."""
    if isinstance(ref, dict):
        assert ref.keys() == got.keys(), where
        for key in ref:
            assert_same(ref[key], got[key], f"{where}.{key}")
    elif isinstance(ref, (tuple, list)):
        assert len(ref) == len(got), f"{where}: {len(ref)} vs {len(got)} items"
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            assert_same(r, g, f"{where}[{i}]")
    elif isinstance(ref, torch.Tensor):
        assert ref.shape == got.shape, f"{where}: shape {tuple(ref.shape)} vs {tuple(got.shape)}"
        if ref.is_floating_point():
            finite = torch.isfinite(ref)
            assert torch.equal(finite, torch.isfinite(got)), f"{where}: -inf/inf in different places"
            assert torch.allclose(ref[finite], got[finite], atol=ATOL, rtol=0), \
                f"{where}: max diff {float((ref[finite] - got[finite]).abs().max())}"
        else:
            assert torch.equal(ref, got), f"{where}: tokens differ\n{ref}\n{got}"
    else:
        assert ref == got, f"{where}: {ref!r} vs {got!r}"


@pytest.fixture(scope="module")
def zoo() -> Iterator[dict[str, tuple[torch.nn.Module, torch.nn.Module]]]:
    built = {name: (tiny_model(name), tiny_model(name, seed=1)) for name in FAMILIES}
    yield built
    for model, assistant in built.values():
        flashpage.unpatch(model)
        flashpage.unpatch(assistant)


@pytest.fixture
def paged_forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per forward an HFPagedCache planned."""
    seen: list[int] = []
    original = HFPagedCache.begin_forward

    def counting(self: HFPagedCache, *args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(HFPagedCache, "begin_forward", counting)
    return seen


def run_both(check: Check, inp: Inputs, paged_forwards: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``check`` unpatched, then with the model and its assistant patched (unpatched again after)."""
    assert not flashpage.is_patched(inp.model)
    ref = check(inp)
    assert not paged_forwards, "the unpatched run used the paged cache"
    flashpage.patch(inp.model)
    flashpage.patch(inp.assistant)
    try:
        got = check(inp)
    finally:
        flashpage.unpatch(inp.model)
        flashpage.unpatch(inp.assistant)
    assert paged_forwards, "the patched run did not go through the paged cache"
    return ref, got


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_matches_unpatched(family: str, check: str, zoo, paged_forwards: list[int]) -> None:
    model, assistant = zoo[family]
    ids, mask = left_padded_batch(LENGTHS, seed=3)
    ref, got = run_both(CHECKS[check], Inputs(model, assistant, ids, mask), paged_forwards)
    assert_same(ref, got, f"{family}/{check}")


def _right_padded(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = mask.sum(dim=1).tolist()
    right_ids, right_mask = torch.full_like(ids, PAD), torch.zeros_like(mask)
    for row, n in enumerate(lengths):
        right_ids[row, :n] = ids[row, mask[row].bool()]
        right_mask[row, :n] = 1
    return right_ids, right_mask


@pytest.mark.parametrize("family", FAMILIES)
def test_right_padding_greedy(family: str, zoo, paged_forwards: list[int]) -> None:
    model, assistant = zoo[family]
    ids, mask = _right_padded(*left_padded_batch(LENGTHS, seed=3))
    ref, got = run_both(greedy, Inputs(model, assistant, ids, mask), paged_forwards)
    assert_same(ref, got, f"{family}/right-padded greedy")


def test_the_comparison_can_fail() -> None:
    """assert_same is not vacuous: a changed token, a drifted score and a missing item fail."""
    ref = {"sequences": torch.tensor([[1, 2]]), "scores": (torch.tensor([0.5, -torch.inf]),)}
    assert_same(ref, {"sequences": torch.tensor([[1, 2]]), "scores": (torch.tensor([0.50001, -torch.inf]),)}, "ok")
    for bad in ({"sequences": torch.tensor([[1, 3]]), "scores": ref["scores"]},
                {"sequences": ref["sequences"], "scores": (torch.tensor([0.6, -torch.inf]),)},
                {"sequences": ref["sequences"], "scores": (torch.tensor([0.5, 0.0]),)},
                {"sequences": ref["sequences"], "scores": ()}):
        with pytest.raises(AssertionError):
            assert_same(ref, bad, "bad")
