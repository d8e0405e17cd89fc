"""generate() features on a patched model match the unpatched model exactly.

Each test runs the same ``generate()`` call on the same model object unpatched (the reference)
and patched, and checks the outputs match. Two models: llama (full attention) and mistral with
a sliding window smaller than the sequences (the window changes the output; that is checked
too). Every patched run must really go through flashpage's paged cache (``HFPagedCache``
planned forwards are counted); every unpatched run must not.

Features: greedy, sampling (temperature/top_k/top_p/repetition_penalty), num_return_sequences,
beam search, custom StoppingCriteria, stop strings, TextStreamer / TextIteratorStreamer,
return_dict_in_generate + output_scores, max_length, min_new_tokens against an eos that would
fire at once, inputs_embeds, speculative decoding with an assistant model and with prompt lookup,
and caches the caller picks (``cache_implementation="static"``, an explicit DynamicCache), which
patching must leave in place and still get right.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest
import torch
from model_zoo import PAD, left_padded_batch, tiny_model, tiny_tokenizer
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer, TextStreamer

import flashpage
from flashpage.patches import HFPagedCache
from flashpage.patches.compat import cache_kwarg
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

T = TypeVar("T")

MODELS = ["llama", "mistral"]
SLIDING_WINDOW = 8  # the zoo's mistral window
PROMPT_LENGTHS = [5, 11, 8]
MAX_NEW = 12
SEED = 1234


@pytest.fixture(scope="module")
def models() -> Iterator[dict[str, torch.nn.Module]]:
    built = {name: tiny_model(name) for name in MODELS}
    yield built
    built.clear()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded_batch(PROMPT_LENGTHS)


@pytest.fixture
def paged_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Lengths of the forwards an HFPagedCache planned (appended as they happen)."""
    steps: list[int] = []
    original = HFPagedCache.begin_forward

    def counting(self: HFPagedCache, input_ids: Any, batch: int, length: int, *args: Any, **kwargs: Any) -> None:
        steps.append(length)
        return original(self, input_ids, batch, length, *args, **kwargs)

    monkeypatch.setattr(HFPagedCache, "begin_forward", counting)
    return steps


@pytest.fixture
def ab(paged_steps: list[int]) -> Callable[..., tuple[Any, Any]]:
    """``ab(run, model, *also)``: ``run()`` unpatched, then with ``model`` (and ``also``) patched.

    Asserts the unpatched run planned no paged forward and the patched one did; every model is
    unpatched again afterwards.
    """

    def run_both(run: Callable[[], T], model: torch.nn.Module, *also: torch.nn.Module) -> tuple[T, T]:
        assert not flashpage.is_patched(model)
        before = len(paged_steps)
        ref = run()
        assert len(paged_steps) == before, "the unpatched run used the paged cache"
        patched_models = (model, *also)
        for m in patched_models:
            flashpage.patch(m)
        try:
            got = run()
        finally:
            for m in patched_models:
                flashpage.unpatch(m)
        assert len(paged_steps) > before, "the patched run did not go through the paged cache"
        return ref, got

    return run_both


def _seeded(run: Callable[[], T]) -> Callable[[], T]:
    def wrapped() -> T:
        torch.manual_seed(SEED)
        return run()

    return wrapped


def _new(seqs: torch.Tensor, width: int) -> torch.Tensor:
    return seqs[:, width:]


def _returned_cache(out: Any) -> Any:
    """The cache a ``return_dict_in_generate`` output carries (``.cache`` from transformers 5.24)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _ab_assisted(ab: Callable[..., tuple[Any, Any]], run: Callable[[], T], plain: Callable[[], T],
                 *models: torch.nn.Module) -> tuple[T, T]:
    """``ab(run, *models)``; where the unpatched run fails because transformers (before 5.17) cannot
    crop its own sliding-window cache past the window, the reference is ``plain()`` instead (plain
    greedy, which assisted greedy must equal anyway) and only the patched run is ``run()``."""
    try:
        return ab(run, *models)
    except ValueError as exc:
        if "DynamicSlidingWindowLayer" not in str(exc):
            raise
    ref = plain()
    for m in models:
        flashpage.patch(m)
    try:
        return ref, run()
    finally:
        for m in models:
            flashpage.unpatch(m)


def _assert_same(ref: torch.Tensor, got: torch.Tensor) -> None:
    assert ref.shape == got.shape, f"shapes differ: {tuple(ref.shape)} vs {tuple(got.shape)}"
    assert torch.equal(ref, got), f"tokens differ:\n{ref}\n{got}"


# ------------------------------------------------------------------------------ the window
def test_sliding_window_matters(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                                ab: Callable[..., tuple[Any, Any]]) -> None:
    """The mistral window is smaller than the sequences: without it the output is different."""
    windowed = models["mistral"]
    assert windowed.config.sliding_window == SLIDING_WINDOW < max(PROMPT_LENGTHS) + MAX_NEW
    full = tiny_model("mistral", sliding_window=None)
    assert all(torch.equal(p, q) for p, q in zip(windowed.parameters(), full.parameters(), strict=True))
    ids, mask = batch
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    with_window = windowed.generate(**gen)
    without_window = full.generate(**gen)
    assert not torch.equal(with_window, without_window)
    ref, got = ab(lambda: full.generate(**gen), full)  # and the no-window model is exact too
    _assert_same(ref, got)


# ------------------------------------------------------------------------------ decoding modes
@pytest.mark.parametrize("name", MODELS)
def test_greedy(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                ab: Callable[..., tuple[Any, Any]], name: str) -> None:
    model, (ids, mask) = models[name], batch
    ref, got = ab(lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                         do_sample=False, return_dict_in_generate=True, output_logits=True), model)
    width = ids.shape[1]
    for row in range(ids.shape[0]):
        match = compare_greedy(ref.sequences[row, width:].tolist(), got.sequences[row, width:].tolist(),
                               [step[row] for step in ref.logits])
        assert match.identical, f"row {row}: {match.explain()}"
    assert isinstance(_returned_cache(got), HFPagedCache)


@pytest.mark.parametrize("name", MODELS)
def test_sampling_same_seed_same_tokens(models: dict[str, torch.nn.Module],
                                        batch: tuple[torch.Tensor, torch.Tensor],
                                        ab: Callable[..., tuple[Any, Any]], name: str) -> None:
    model, (ids, mask) = models[name], batch
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, temperature=0.8,
               top_k=20, top_p=0.9, repetition_penalty=1.3)
    ref, got = ab(_seeded(lambda: model.generate(**gen)), model)
    _assert_same(ref, got)
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    assert not torch.equal(ref, greedy), "sampling produced the greedy output: the test would not see sampling"


@pytest.mark.parametrize("name", MODELS)
def test_num_return_sequences_sampling(models: dict[str, torch.nn.Module],
                                       batch: tuple[torch.Tensor, torch.Tensor],
                                       ab: Callable[..., tuple[Any, Any]], name: str) -> None:
    model, (ids, mask) = models[name], batch
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True,
               num_return_sequences=3, return_dict_in_generate=True)
    ref, got = ab(_seeded(lambda: model.generate(**gen)), model)
    assert ref.sequences.shape[0] == 3 * ids.shape[0]
    _assert_same(ref.sequences, got.sequences)
    assert _returned_cache(got).batch_size == 3 * ids.shape[0]
    # the copies of one prompt were sampled independently
    width = ids.shape[1]
    assert not torch.equal(got.sequences[0, width:], got.sequences[1, width:])


@pytest.mark.parametrize("name", MODELS)
def test_beam_search_num_return_sequences(models: dict[str, torch.nn.Module],
                                          batch: tuple[torch.Tensor, torch.Tensor],
                                          ab: Callable[..., tuple[Any, Any]], name: str) -> None:
    model, (ids, mask) = models[name], batch
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=4,
               num_return_sequences=2, return_dict_in_generate=True, output_scores=True)
    ref, got = ab(lambda: model.generate(**gen), model)
    assert ref.sequences.shape[0] == 2 * ids.shape[0]
    _assert_same(ref.sequences, got.sequences)
    torch.testing.assert_close(got.sequences_scores, ref.sequences_scores, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------ stopping
class StopAfterToken(StoppingCriteria):
    """Stops a row once its last token is ``token`` (records every call)."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.calls = 0

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        self.calls += 1
        return input_ids[:, -1] == self.token


def _first_plain(tokens: Sequence[int], start: int) -> int:
    """Index of the first token at or after ``start`` that is not PAD/EOS/BOS."""
    return next(i for i in range(start, len(tokens)) if tokens[i] > 2)


@pytest.mark.parametrize("name", MODELS)
def test_custom_stopping_criteria(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                                  ab: Callable[..., tuple[Any, Any]], name: str) -> None:
    model, (ids, mask) = models[name], batch
    width = ids.shape[1]
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    row1 = _new(greedy, width)[1].tolist()
    at = _first_plain(row1, 4)
    token = row1[at]
    criteria: list[StopAfterToken] = []

    def run() -> torch.Tensor:
        criteria.append(StopAfterToken(token))
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                              stopping_criteria=StoppingCriteriaList([criteria[-1]]))

    ref, got = ab(run, model)
    _assert_same(ref, got)
    stop = row1.index(token)
    assert _new(got, width)[1, stop].item() == token
    assert (_new(got, width)[1, stop + 1:] == PAD).all(), "row 1 went on after the stopping criterion fired"
    assert criteria[0].calls == criteria[1].calls > 0


@pytest.mark.parametrize("name", MODELS)
def test_stop_strings(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                      ab: Callable[..., tuple[Any, Any]], tokenizer: Any, name: str) -> None:
    model, (ids, mask) = models[name], batch
    width = ids.shape[1]
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    row0 = _new(greedy, width)[0].tolist()
    stop_token = row0[_first_plain(row0, 3)]
    stop_string = tokenizer.decode([stop_token])
    assert len(stop_string) == 1
    ref, got = ab(lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                         do_sample=False, stop_strings=[stop_string], tokenizer=tokenizer), model)
    _assert_same(ref, got)
    stop = row0.index(stop_token)
    assert (_new(got, width)[0, stop + 1:] == PAD).all(), "row 0 went on after its stop string"
    assert tokenizer.decode(_new(got, width)[0, : stop + 1]).endswith(stop_string)


# ------------------------------------------------------------------------------ streaming
class CollectingStreamer(TextStreamer):
    """A TextStreamer that keeps the text instead of printing it."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, skip_prompt=True)
        self.pieces: list[str] = []

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.pieces.append(text)


@pytest.mark.parametrize("name", MODELS)
def test_text_streamer(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                       ab: Callable[..., tuple[Any, Any]], tokenizer: Any, name: str) -> None:
    model = models[name]
    prompt = batch[0][1:2, -PROMPT_LENGTHS[1]:]  # streamers take batch size 1

    def run() -> tuple[torch.Tensor, str]:
        streamer = CollectingStreamer(tokenizer)
        out = model.generate(input_ids=prompt, max_new_tokens=MAX_NEW, do_sample=False, streamer=streamer)
        return out, "".join(streamer.pieces)

    (ref, ref_text), (got, got_text) = ab(run, model)
    _assert_same(ref, got)
    assert got_text == tokenizer.decode(got[0, prompt.shape[1]:]) == ref_text
    assert len(got_text) >= MAX_NEW // 2


@pytest.mark.parametrize("name", MODELS)
def test_text_iterator_streamer(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                                ab: Callable[..., tuple[Any, Any]], tokenizer: Any, name: str) -> None:
    model = models[name]
    prompt = batch[0][2:3, -PROMPT_LENGTHS[2]:]

    def run() -> tuple[torch.Tensor, str]:
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
        result: dict[str, torch.Tensor] = {}

        def target() -> None:
            result["out"] = model.generate(input_ids=prompt, max_new_tokens=MAX_NEW, do_sample=False,
                                           streamer=streamer)

        thread = threading.Thread(target=target)
        thread.start()
        text = "".join(streamer)
        thread.join(timeout=60)
        assert "out" in result, "generate() in the streaming thread failed"
        return result["out"], text

    (ref, ref_text), (got, got_text) = ab(run, model)
    _assert_same(ref, got)
    assert got_text == tokenizer.decode(got[0, prompt.shape[1]:]) == ref_text


# ------------------------------------------------------------------------------ outputs and lengths
@pytest.mark.parametrize("name", MODELS)
def test_output_scores(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                       ab: Callable[..., tuple[Any, Any]], name: str) -> None:
    model, (ids, mask) = models[name], batch
    ref, got = ab(lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                         do_sample=False, return_dict_in_generate=True, output_scores=True), model)
    _assert_same(ref.sequences, got.sequences)
    assert len(got.scores) == len(ref.scores) == got.sequences.shape[1] - ids.shape[1]
    for step, (r, g) in enumerate(zip(ref.scores, got.scores, strict=True)):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=0, msg=lambda m, step=step: f"step {step}: {m}")


@pytest.mark.parametrize("name", MODELS)
def test_max_length(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                    ab: Callable[..., tuple[Any, Any]], name: str) -> None:
    model, (ids, mask) = models[name], batch
    max_length = ids.shape[1] + 7
    ref, got = ab(lambda: model.generate(input_ids=ids, attention_mask=mask, max_length=max_length,
                                         min_new_tokens=7, do_sample=False), model)
    assert got.shape[1] == max_length
    _assert_same(ref, got)


@pytest.mark.parametrize("name", MODELS)
def test_min_new_tokens_suppresses_eos(models: dict[str, torch.nn.Module],
                                       batch: tuple[torch.Tensor, torch.Tensor],
                                       ab: Callable[..., tuple[Any, Any]], name: str) -> None:
    """eos = the token greedy picks first for row 0: it fires at once unless min_new_tokens holds it off."""
    model, (ids, mask) = models[name], batch
    width = ids.shape[1]
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    eos = int(first[0, width])
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)

    ref, got = ab(lambda: model.generate(**gen), model)
    _assert_same(ref, got)
    assert got[0, width].item() == eos and (got[0, width + 1:] == PAD).all(), "eos did not end row 0 at once"

    min_new = 5
    ref, got = ab(lambda: model.generate(**gen, min_new_tokens=min_new), model)
    _assert_same(ref, got)
    assert got.shape[1] - width >= min_new
    assert not (got[:, width:width + min_new] == eos).any(), "min_new_tokens did not suppress eos"


@pytest.mark.parametrize("name", MODELS)
def test_inputs_embeds(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                       ab: Callable[..., tuple[Any, Any]], name: str) -> None:
    model, (ids, mask) = models[name], batch
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    ref, got = ab(lambda: model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=MAX_NEW,
                                         do_sample=False), model)
    _assert_same(ref, got)
    _assert_same(got, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                     do_sample=False)[:, ids.shape[1]:])


# ------------------------------------------------------------------------------ speculative decoding
def _cache_types(model: torch.nn.Module) -> tuple[list[type], Any]:
    seen: list[type] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen.append(type(cache))

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.fixture
def crops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tokens each HFPagedCache.crop call removed (transformers calls crop(-n), or crop(length) before 5.14)."""
    calls: list[int] = []
    original = HFPagedCache.crop

    def recording(self: HFPagedCache, tokens_to_remove: int) -> None:
        before = self.get_seq_length()
        original(self, tokens_to_remove)
        calls.append(before - self.get_seq_length())

    monkeypatch.setattr(HFPagedCache, "crop", recording)
    return calls


@pytest.mark.parametrize("name", MODELS)
def test_assistant_model(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                         ab: Callable[..., tuple[Any, Any]], crops: list[int], name: str) -> None:
    """A different assistant (candidates mostly rejected): the main cache rolls back with crop(-n)."""
    model = models[name]
    assistant = tiny_model(name, seed=1)
    prompt = batch[0][1:2, -PROMPT_LENGTHS[1]:]
    gen = dict(input_ids=prompt, max_new_tokens=MAX_NEW, do_sample=False)
    seen, handle = _cache_types(assistant)
    try:
        ref, got = _ab_assisted(ab, lambda: model.generate(**gen, assistant_model=assistant),
                                lambda: model.generate(**gen), model, assistant)
    finally:
        handle.remove()
    _assert_same(ref, got)
    _assert_same(got, model.generate(**gen))  # assisted greedy == plain greedy
    assert any(n > 0 for n in crops), "no candidate was rejected: the rollback was not exercised"
    assert HFPagedCache in seen, "the patched assistant did not use the paged cache"
    assert DynamicCache in seen, "the unpatched assistant did not use transformers' own cache"


@pytest.mark.parametrize("name", MODELS)
def test_assistant_model_all_accepted(models: dict[str, torch.nn.Module],
                                      batch: tuple[torch.Tensor, torch.Tensor],
                                      ab: Callable[..., tuple[Any, Any]], crops: list[int], name: str) -> None:
    """An assistant with the main model's weights: every candidate is accepted, crop(0) must keep all."""
    model = models[name]
    assistant = tiny_model(name)
    prompt = batch[0][1:2, -PROMPT_LENGTHS[1]:]
    gen = dict(input_ids=prompt, max_new_tokens=MAX_NEW, do_sample=False)
    ref, got = _ab_assisted(ab, lambda: model.generate(**gen, assistant_model=assistant),
                            lambda: model.generate(**gen), model, assistant)
    _assert_same(ref, model.generate(**gen))
    assert crops and not any(crops), "every candidate was accepted: crop must have been called and kept all"
    _assert_same(ref, got)


def test_batched_assisted_generation_gets_transformers_own_answer(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """transformers refuses an assistant with batch > 1 (or runs it, on a release that allows it): patched, the
    same happens, with transformers' own error, never one from flashpage's cache."""
    ids, mask = batch[0][:2], batch[1][:2]

    def run(model: torch.nn.Module, assistant: torch.nn.Module) -> Any:
        try:
            return model.generate(input_ids=ids, attention_mask=mask, assistant_model=assistant,
                                  max_new_tokens=4, do_sample=False, pad_token_id=PAD).tolist()
        except Exception as exc:  # noqa: BLE001 (the error is the answer compared)
            return f"{type(exc).__name__}: {exc}"

    model, assistant = tiny_model("llama"), tiny_model("llama", seed=1)
    ref = run(model, assistant)
    flashpage.patch(model)
    flashpage.patch(assistant)
    try:
        assert run(model, assistant) == ref
    finally:
        flashpage.unpatch(model)
        flashpage.unpatch(assistant)


@pytest.mark.parametrize("name", MODELS)
def test_prompt_lookup(models: dict[str, torch.nn.Module], ab: Callable[..., tuple[Any, Any]],
                       paged_steps: list[int], name: str) -> None:
    model = models[name]
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]])  # repeated n-grams: lookups hit
    gen = dict(input_ids=prompt, max_new_tokens=MAX_NEW, do_sample=False, prompt_lookup_num_tokens=3)
    ref, got = _ab_assisted(ab, lambda: model.generate(**gen),
                            lambda: model.generate(input_ids=prompt, max_new_tokens=MAX_NEW, do_sample=False), model)
    _assert_same(ref, model.generate(input_ids=prompt, max_new_tokens=MAX_NEW, do_sample=False))
    assert paged_steps[0] > prompt.shape[1], "the first forward carried no looked-up candidates"
    _assert_same(ref, got)


# ------------------------------------------------------------------------------ caches the caller picks
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_static_cache_implementation(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                                     name: str) -> None:
    """A cache the caller asks for by name is used as is; outputs must still match."""
    model, (ids, mask) = models[name], batch
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
               cache_implementation="static", return_dict_in_generate=True, output_logits=True)
    ref = model.generate(**gen)
    with flashpage.patched(model):
        got = model.generate(**gen)
    assert not isinstance(_returned_cache(got), HFPagedCache)
    for step, (r, g) in enumerate(zip(ref.logits, got.logits, strict=True)):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=0, msg=lambda m, step=step: f"step {step}: {m}")
    _assert_same(ref.sequences, got.sequences)


@pytest.mark.parametrize("name", MODELS)
def test_explicit_dynamic_cache(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                                ab: Callable[..., tuple[Any, Any]], paged_steps: list[int], name: str) -> None:
    """A DynamicCache passed by the caller is kept (flashpage's dense attention path runs on it)."""
    model, (ids, mask) = models[name], batch

    def run() -> Any:
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                              return_dict_in_generate=True,
                              **{cache_kwarg(model): DynamicCache(config=model.config)})

    ref = run()
    with flashpage.patched(model):
        got = run()
    assert not paged_steps and isinstance(_returned_cache(got), DynamicCache)
    _assert_same(ref.sequences, got.sequences)
