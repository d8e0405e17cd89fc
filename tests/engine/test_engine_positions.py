"""LLM gives models the positions and logits rows they expect, and honours their generation_config.

- BART-family decoders derive positions from ``cache.get_seq_length()``: under the engine each
  packed sequence must still see its own positions.
- whisper's decoder ignores ``logits_to_keep``: the engine must read the rows it asked for.
- ``generation_config`` processors (``forced_eos_token_id``, ``suppress_tokens``,
  ``begin_suppress_tokens``, ``no_repeat_ngram_size``) apply as in ``generate()``; its sampling
  defaults are the SamplingParams of requests given none (vLLM's ``generation_config="auto"``).

Oracle: unpatched ``generate()`` on each prompt alone (these decoders count left padding as
positions, so an unpadded prompt is what a served request is), tokens tie-aware, logprobs of the
chosen tokens within 1e-4 of the reference's raw logits.
"""

from __future__ import annotations

import warnings
from functools import cache
from typing import Any

import pytest
import torch
from model_zoo import PAD, left_padded_batch, model_from_config, tiny_model, torch_threads
from transformers import AutoConfig
from transformers.generation.logits_process import EncoderNoRepeatNGramLogitsProcessor, NoRepeatNGramLogitsProcessor

import flashpage
from flashpage import SamplingParams
from flashpage.engine.generation_config import banned_ngram_tokens, banned_prompt_ngram_tokens
from flashpage.patches import is_patched, unpatch
from flashpage.testing import compare_greedy

MAX_NEW = 8
_ED = dict(vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False, d_model=64,
           decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=96, encoder_layers=2,
           encoder_attention_heads=4, encoder_ffn_dim=96, max_position_embeddings=128)
DECODERS: dict[str, dict] = {
    "bart": {}, "mbart": {}, "marian": {"decoder_start_token_id": 0}, "pegasus": {}, "plbart": {}, "blenderbot": {},
    "blenderbot-small": {}, "bigbird_pegasus": {"attention_type": "original_full"},
    "whisper": {"max_target_positions": 128, "max_source_positions": 16, "num_mel_bins": 8},
}
PROMPTS = [[5, 17, 33, 8, 90], [44, 3, 71, 12, 9, 101, 60, 27, 15, 88, 7], [64, 22, 19]]


@cache
def _decoder(model_type: str) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **{**_ED, **DECODERS[model_type]})
    return model_from_config(model_type, config)


def _reference(model: torch.nn.Module, prompt: list[int], **kw) -> tuple[list[int], list[torch.Tensor]]:
    if is_patched(model):
        unpatch(model)
    with torch_threads(1):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=PAD,
                             return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]


def _check_llm(model: torch.nn.Module, prompts: list[list[int]], **llm_kw) -> None:
    refs = [_reference(model, p) for p in prompts]
    with torch_threads(1):
        llm = flashpage.LLM(model, num_blocks=48, block_size=4, max_model_len=96, **llm_kw)
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=0),
                                use_tqdm=False)
        finally:
            unpatch(model)
    for (ref_tokens, ref_logits), out in zip(refs, outs, strict=True):
        got = out.outputs[0]
        match = compare_greedy(ref_tokens, got.token_ids, ref_logits)
        assert match.ok, f"{match.explain()}\nref={ref_tokens}\ngot={got.token_ids}"
        for step, (tok, lp) in enumerate(zip(got.token_ids[: match.position], got.logprobs, strict=False)):
            want = torch.log_softmax(ref_logits[step].double(), -1)[tok].item()
            assert abs(lp.logprob - want) < 1e-4, (step, lp.logprob, want)


def _assert_samples_match(refs: list[tuple[list[int], list[torch.Tensor]]], outs: list) -> None:
    """Every sample of every output equals its prompt's reference (tie-aware), logprobs within 1e-4."""
    for (ref_tokens, ref_logits), out in zip(refs, outs, strict=True):
        for got in out.outputs:
            match = compare_greedy(ref_tokens, got.token_ids, ref_logits)
            assert match.ok, f"{match.explain()}\nref={ref_tokens}\ngot={got.token_ids}"
            for step, (tok, lp) in enumerate(zip(got.token_ids[: match.position], got.logprobs, strict=False)):
                want = torch.log_softmax(ref_logits[step].double(), -1)[tok].item()
                assert abs(lp.logprob - want) < 1e-4, (step, lp.logprob, want)


@pytest.mark.parametrize("model_type", list(DECODERS))
def test_llm_positions_and_logits_match_generate(model_type: str) -> None:
    """Three prompts of different lengths packed in one step (and chunked: 8 tokens per step)."""
    model = _decoder(model_type)
    _check_llm(model, PROMPTS, max_num_batched_tokens=8)


@pytest.mark.parametrize("model_type", ["bart", "whisper"])
def test_patched_generate_matches_on_a_padded_batch(model_type: str) -> None:
    model = _decoder(model_type)
    ids, mask = left_padded_batch([5, 9], seed=3)
    if is_patched(model):
        unpatch(model)
    with torch_threads(1):
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=PAD,
                             return_dict_in_generate=True, output_logits=True)
        with flashpage.patched(model):
            got = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=PAD, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(ref.sequences, got.sequences)
    for a, b in zip(ref.logits, got.logits, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------ generation_config
def _llama_with(**gen: object) -> torch.nn.Module:
    model = tiny_model("llama", seed=4)
    for k, v in gen.items():
        setattr(model.generation_config, k, v)
    return model


@pytest.mark.parametrize("gen", [
    {"forced_eos_token_id": 5},
    {"suppress_tokens": [10, 11, 12, 40, 50, 60, 70, 80, 90, 100], "begin_suppress_tokens": [20, 21, 30, 31]},
    {"no_repeat_ngram_size": 2},
    {"encoder_no_repeat_ngram_size": 1},
], ids=["forced_eos", "suppress", "no_repeat_ngram", "prompt_no_repeat_ngram"])
def test_generation_config_processors_match_generate(gen: dict) -> None:
    model = _llama_with(**gen)
    prompts = [[7, 7, 3, 9, 7, 3], [44, 3, 71, 12, 9, 101, 60, 27, 15]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these fields are applied: no warning
        _check_llm(model, prompts)


def test_processors_change_the_output() -> None:
    """The processor cases above are not vacuous: each changes what plain greedy decoding picks."""
    model = _llama_with()
    plain, _ = _reference(model, [44, 3, 71, 12, 9, 101, 60, 27, 15])
    forced, _ = _reference(model, [44, 3, 71, 12, 9, 101, 60, 27, 15], forced_eos_token_id=5)
    assert plain[-1] != 5 and forced[-1] == 5
    assert banned_ngram_tokens([7, 7, 3, 9, 7, 3], 2) == [9]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_banned_ngrams_equal_transformers(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    for _ in range(20):
        tokens = torch.randint(0, 6, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
        scores = NoRepeatNGramLogitsProcessor(n)(torch.tensor([tokens]), torch.zeros(1, 6))
        want = torch.isinf(scores[0]).nonzero().flatten().tolist()
        assert banned_ngram_tokens(tokens, n) == want, tokens
        prompt = tokens[: max(1, len(tokens) // 2)]
        scores = EncoderNoRepeatNGramLogitsProcessor(n, torch.tensor([prompt]))(torch.tensor([tokens]),
                                                                                torch.zeros(1, 6))
        want = torch.isinf(scores[0]).nonzero().flatten().tolist()
        assert banned_prompt_ngram_tokens(tokens, len(prompt), n) == want, (tokens, prompt)


def test_sampling_defaults_from_generation_config() -> None:
    model = _llama_with(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=5,
                        repetition_penalty=1.1)
    with torch_threads(1):
        llm = flashpage.LLM(model, num_blocks=32, block_size=4, max_model_len=64)
        try:
            p = llm.get_default_sampling_params()
            assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.repetition_penalty) == (0.7, 20, 0.9, 5, 1.1)
            out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]  # no SamplingParams: the defaults
            assert len(out.token_ids) == 5 or out.finish_reason == "stop"
            given = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
            assert len(given[0].outputs[0].token_ids) == 3 or given[0].outputs[0].finish_reason == "stop"
        finally:
            unpatch(model)
        neutral = flashpage.LLM(model, num_blocks=32, block_size=4, max_model_len=64, generation_config="vllm")
        unpatch(model)
    assert neutral.get_default_sampling_params() == SamplingParams()
    assert neutral.sampler.processors is None


def test_unapplied_generation_config_fields_are_named() -> None:
    model = _llama_with(bad_words_ids=[[9]], forced_eos_token_id=5)
    with torch_threads(1), pytest.warns(UserWarning, match=r"sets bad_words_ids, which the engine does not apply"):
        flashpage.LLM(model, num_blocks=32, block_size=4, max_model_len=64)
    unpatch(model)
    with pytest.raises(ValueError, match=r"generation_config='nope'"):
        flashpage.LLM(model, generation_config="nope")


def _tiny_pool_forks(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[flashpage.LLM, list, Any]:
    """Greedy n=2 samples of ``prompts`` through an LLM with a pool small enough to chunk prompts and
    preempt (8 blocks of 4, 8 batched tokens, invariants checked); the model is unpatched afterwards.
    Returns (llm, outputs, stats)."""
    with torch_threads(1):
        llm = flashpage.LLM(model, num_blocks=8, block_size=4, max_model_len=32, max_num_batched_tokens=8,
                            check_invariants=True)
        try:
            outs = llm.generate(prompts, SamplingParams(n=2, max_tokens=MAX_NEW, temperature=0, logprobs=0),
                                use_tqdm=False)
            return llm, outs, llm.stats()
        finally:
            unpatch(model)


def test_own_rnn_state_cache_is_stood_in_for() -> None:
    """xLSTM keeps its recurrent states in its own cache class (``rnn_state`` per layer) and ignores
    ``logits_to_keep``: the engine's cache holds those states (from the state slots, zeros for new
    sequences) and picks the kept rows itself. Chunked prompts, n=2 forks and preemption: exact."""
    config = AutoConfig.for_model("xlstm", vocab_size=128, hidden_size=64, embedding_dim=64, num_hidden_layers=2,
                                  num_heads=4, chunk_size=16, qk_dim_factor=1.0, pad_token_id=0, eos_token_id=1)
    model = model_from_config("xlstm", config)
    refs = [_reference(model, p) for p in PROMPTS]
    llm, outs, stats = _tiny_pool_forks(model, PROMPTS)
    assert stats.preemptions > 0 and stats.kv_bytes_per_token == 0 and stats.state_bytes_per_seq > 0
    assert any(key[0] == "rnn" for key in llm._states.pools)
    _assert_samples_match(refs, outs)


def test_module_held_recurrent_state_is_kept_per_sequence() -> None:
    """RecurrentGemma keeps its recurrent state in its modules (one row per sequence, reset by each prompt):
    the engine swaps each sequence's rows in and out of them around every forward (its state slots), and
    runs continuing prompt chunks token by token (its conv restarts on a multi-token input). Chunked
    prompts, n=2 forks and preemption in a tiny pool: exact."""
    config = AutoConfig.for_model("recurrent_gemma", vocab_size=128, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                  lru_width=64, attention_window_size=8, block_types=["recurrent", "attention"],
                                  pad_token_id=0, eos_token_id=1)
    model = model_from_config("recurrent_gemma", config)
    refs = [_reference(model, p) for p in PROMPTS]
    llm, outs, stats = _tiny_pool_forks(model, PROMPTS)
    assert llm._token_by_token and stats.preemptions > 0 and stats.state_bytes_per_seq > 0
    _assert_samples_match(refs, outs)


def test_own_linear_state_cache_is_stood_in_for() -> None:
    """MiniMax's forward takes only its own MiniMaxCache (lightning attention's K^T V state per layer): the
    engine's cache is both an HFPagedCache and a MiniMaxCache, the linear states live in the state slots.
    Chunked prompts, n=2 forks and preemption in a tiny pool: exact."""
    import sweep_models as sm

    model = sm.build_model("minimax")
    prompts = [[3 + t % 90 for t in p] for p in PROMPTS]
    refs = [_reference(model, p) for p in prompts]
    llm, outs, stats = _tiny_pool_forks(model, prompts)
    assert type(llm._cache).__name__ == "PagedMiniMaxCache" and stats.preemptions > 0
    assert any(key[0] == "linear" for key in llm._states.pools) and stats.kv_bytes_per_token > 0
    _assert_samples_match(refs, outs)


def test_forced_eos_applies_with_ignore_eos() -> None:
    """generate() forces EOS at the last position whatever stops it; so does the engine (ignore_eos only
    says EOS does not end the request)."""
    model = _llama_with(forced_eos_token_id=5)
    with torch_threads(1):
        llm = flashpage.LLM(model, num_blocks=32, block_size=4, max_model_len=64)
        try:
            out = llm.generate([[44, 3, 71]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
        finally:
            unpatch(model)
    assert len(out.token_ids) == 4 and out.token_ids[-1] == 5


def test_decoders_that_take_position_ids_get_no_hooks() -> None:
    """OPT's positional embedding also takes a cache length, but OPT honours the caller's position_ids:
    no hook (its steps may compile); BART's decoder takes none: hooked."""
    from flashpage.engine.positions import EnginePositions, cache_position_modules

    opt = tiny_model("opt")
    assert cache_position_modules(opt) and EnginePositions.install(opt) is None
    assert EnginePositions.install(_decoder("bart")) is not None
