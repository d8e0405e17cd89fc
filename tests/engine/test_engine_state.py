"""Engine per-step cost and request bookkeeping (issue 9 item 4, issue 14):

incremental output text (equal to a full decode at every step, without re-decoding the whole
output), an O(1) ``Group.finished``, per-request generators on the logits' device, one batched
draw for unseeded rows, seeds of any size, atomic request admission, KV pool sizing, and a
clear error for a model path that is a file.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import flashpage
from flashpage import LLM, SamplingParams
from flashpage.bench.sampler import sampling_seqs
from flashpage.engine.outputs import RequestMetrics
from flashpage.engine.sampler import Sampler, filter_logits, filter_logits_batched
from flashpage.engine.sequence import SEED_MODULUS, Group, sample_seed
from flashpage.patches import unpatch

pytestmark = pytest.mark.usefixtures("one_thread")

# byte-level BPE ids of the tiny model's tokenizer that decode to pieces of multi-byte characters
# ('é€ 😀 café'), so the text passes through incomplete UTF-8 between tokens
MULTIBYTE_IDS = [128, 103, 159, 225, 106, 221, 173, 254, 247, 223, 1259, 70, 128, 103]


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, block_size=8, num_blocks=256)


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    m, tok = flashpage.load_tiny_model()
    yield m, tok
    unpatch(m)


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode() call was given."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decoded: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def _group(params: SamplingParams, tokenizer: Any = None, prompt: list[int] | None = None) -> Group:
    return Group("r", None, prompt or [5, 6, 7], params, RequestMetrics(0.0), tokenizer)


def _full_decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ------------------------------------------------------------------------------- output text
def test_output_text_equals_full_decode_at_every_step(tiny):
    _, tok = tiny
    group = _group(SamplingParams(max_tokens=64), CountingTokenizer(tok))
    seq = group.new_seq(0, group.prompt_token_ids)
    stream = MULTIBYTE_IDS + tok(" The list of files is returned")["input_ids"] + MULTIBYTE_IDS
    for token in stream:
        seq.token_ids.append(token)
        seq.detok.update(seq.output_ids)
        assert group.to_output().text == _full_decode(tok, seq.output_ids), seq.output_ids
    seq.detok.flush(seq.output_ids)
    assert group.to_output().text == _full_decode(tok, seq.output_ids)
    # every decode saw a short window of recent tokens, never the whole output again
    assert max(group.tokenizer.decoded) <= 8 < len(stream)


def test_engine_text_is_incremental(tiny):
    """Through LLM.step(): each step's output text is the full decode, at O(new tokens) decode cost."""
    model, tok = tiny
    counting = CountingTokenizer(tok)
    llm = LLM(model, counting, block_size=16, num_blocks=64)
    rid = llm.add_request("The list", SamplingParams(max_tokens=40, temperature=1.5, seed=3, ignore_eos=True))
    steps = 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id == rid
            assert out.text == _full_decode(tok, out.token_ids)
            steps += 1
    assert steps == 40 and len(out.token_ids) == 40
    # the prompt is tokenized with __call__, never decoded: every decode is a short window
    assert counting.decoded and max(counting.decoded) <= 8


# ------------------------------------------------------------------------------ finished count
def test_group_finished_is_a_counter():
    group = _group(SamplingParams(n=3, max_tokens=4))
    seqs = [group.new_seq(i, group.prompt_token_ids) for i in range(3)]
    seqs[0].mark_finished("stop")
    seqs[0].mark_finished("stop")  # twice counts once
    assert group.num_finished == 1 and not group.finished
    seqs[2].mark_finished("length")
    assert not group.finished
    seqs[1].mark_finished("abort")
    assert group.num_finished == 3 and group.finished
    assert [s.finish_reason for s in seqs] == ["stop", "abort", "length"]
    group.seqs = None  # finished no longer looks at the samples at all
    assert group.finished


def test_many_samples_finish_in_linear_time(llm, model):
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(n=300, max_tokens=1, temperature=1.0, seed=1),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 300 and all(len(c.token_ids) == 1 for c in out.outputs)
    assert out.finished and llm.stats().blocks_used == 0


# -------------------------------------------------------------------------------------- sampler


def test_seeded_generator_lives_on_the_logits_device():
    seq = sampling_seqs([SamplingParams(seed=7)])[0]
    logits = torch.randn(1, 50)
    token = Sampler([1])(logits, [seq])[0]
    assert seq._generator is not None and seq._generator.device == logits.device
    assert seq.generator(logits.device) is seq._generator  # reused, not re-created per step
    again = sampling_seqs([SamplingParams(seed=7)])[0]
    assert Sampler([1])(logits, [again])[0] == token
    assert sampling_seqs([SamplingParams()])[0].generator(torch.device("cpu")) is None  # unseeded: global RNG


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_sampling_on_cuda_logits():
    seqs = sampling_seqs([SamplingParams(seed=7), SamplingParams(seed=8), SamplingParams(temperature=0.5)])
    tokens = Sampler([1])(torch.randn(3, 50, device="cuda"), seqs)
    assert len(tokens) == 3
    assert seqs[0]._generator.device.type == "cuda"


def test_unseeded_rows_are_one_batched_draw(monkeypatch):
    from flashpage.engine import sampler as sampler_module

    calls = []
    real = sampler_module.draw

    def counting(probs, *args, **kwargs):
        calls.append(tuple(probs.shape))
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(sampler_module, "draw", counting)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in [(1.0, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (1.0, 3, 0.5, 0.1)]]
    seqs = sampling_seqs(params + [SamplingParams(temperature=0.0), SamplingParams(seed=1)])
    tokens = Sampler([1])(torch.randn(6, 40), seqs)
    # the 4 unseeded rows in two draws: the 2 with a top-k among their candidates (k 5 and 3: width 5),
    # the 2 others over the vocabulary (a top-p row whose draw fell outside its nucleus draws again,
    # alone); greedy and seeded rows apart
    assert calls[:2] == [(2, 5), (2, 40)]
    assert all(shape == (1, 40) for shape in calls[2:])
    assert len(tokens) == 6


def test_batched_filter_equals_the_row_filter():
    """Each row of filter_logits_batched keeps exactly the tokens filter_logits keeps for it (ties too)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        rows = torch.randn(5, 30, generator=g) * 3
        if trial % 3 == 0:
            rows[:, :4] = rows[:, :1]  # ties at the top
        ks = torch.randint(-1, 35, (5,), generator=g).tolist()
        ps = [p if p < 0.9 else 1.0 for p in torch.rand(5, generator=g).tolist()]
        ms = [m if m < 0.5 else 0.0 for m in (torch.rand(5, generator=g) * 0.6).tolist()]
        batched = filter_logits_batched(rows, ks, ps, ms)
        for i in range(5):
            alone = filter_logits(rows[i], ks[i], ps[i], ms[i])
            assert torch.equal(torch.isinf(alone), torch.isinf(batched[i])), (trial, i, ks[i], ps[i], ms[i])
            assert torch.equal(alone[~torch.isinf(alone)], batched[i][~torch.isinf(batched[i])])


def test_batched_sampling_distribution():
    """Many identical unseeded rows under a fixed global seed: frequencies follow the filtered softmax."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 4000
    torch.manual_seed(0)
    seqs = sampling_seqs([SamplingParams(temperature=0.8, top_k=4)] * rows)
    tokens = torch.tensor(Sampler([99])(logits.repeat(rows, 1), seqs))
    want = torch.softmax(logits[:4] / 0.8, -1)
    freq = torch.bincount(tokens, minlength=6).float() / rows
    assert freq[4:].sum() == 0, "top_k=4 lets no other token through"
    assert torch.allclose(freq[:4], want, atol=0.03), (freq, want)
    torch.manual_seed(0)
    seqs = sampling_seqs([SamplingParams(temperature=0.8, top_k=4)] * rows)
    again = torch.tensor(Sampler([99])(logits.repeat(rows, 1), seqs))
    assert torch.equal(tokens, again), "a fixed global seed reproduces unseeded draws"


# ------------------------------------------------------------------------------------------ seeds
@pytest.mark.parametrize("seed", [time.time_ns(), 2**63, 2**64 + 5, 10**40])
def test_any_seed_size_works(llm, seed):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, n=2, ignore_eos=True)
    first = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    second = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert all(len(c.token_ids) == 6 for c in first.outputs)


def test_sample_seed_reduction():
    assert sample_seed(None, 0) is None
    assert sample_seed(1234, 0) == 1234 * 1_000_003  # small seeds keep their old streams
    assert 0 <= sample_seed(10**40, 3) < SEED_MODULUS
    assert sample_seed(10**40, 0) != sample_seed(10**40, 1)


# ------------------------------------------------------------------------------------ atomicity
def _assert_empty(llm: LLM) -> None:
    assert not llm.has_unfinished_requests()
    assert not llm._groups and not llm.scheduler.waiting and not llm.scheduler.running
    assert llm.stats().blocks_used == 0


def test_refused_request_leaves_no_trace(llm):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    params.top_p = 0.0  # invalid after construction: refused by add_request
    with pytest.raises(ValueError, match="top_p"):
        llm.add_request([5, 6], params, request_id="again")
    _assert_empty(llm)
    rid = llm.add_request([5, 6], SamplingParams(max_tokens=2, temperature=0.0), request_id="again")
    assert rid == "again"
    while llm.has_unfinished_requests():
        llm.step()


def test_generate_with_a_refused_prompt_queues_none(llm):
    good = SamplingParams(max_tokens=4, temperature=0.0)
    bad = SamplingParams(max_tokens=4, temperature=0.0)
    bad.seed = -5
    with pytest.raises(ValueError, match="seed"):
        llm.generate([[5, 6], [7, 8], [9, 10]], [good, good, bad], use_tqdm=False)
    _assert_empty(llm)
    assert llm.step() == []  # nothing left behind to report later


def test_automatic_ids_skip_chosen_ones(llm):
    taken = str(int(llm._next_id()) + 1)  # the id the next automatic one would be
    llm.add_request([5, 6], SamplingParams(max_tokens=3, temperature=0.0), request_id=taken)
    outs = llm.generate([[7, 8]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert outs[0].request_id != taken
    while llm.has_unfinished_requests():
        llm.step()
    _assert_empty(llm)


# ----------------------------------------------------------------------------------- pool sizing
def test_default_cpu_pool_is_sized_from_the_model(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pool sized from max_model_len holds one sequence: no warning
        small = LLM(model, block_size=16, max_num_seqs=2)
        one = LLM(model, block_size=16, max_num_seqs=1, max_model_len=100)
    assert small.kv.num_blocks * 16 == 2 * 512  # max_position_embeddings=512 x max_num_seqs=2
    assert one.kv.num_blocks == 7  # ceil(100 / 16)
    capped = LLM(model, block_size=16, max_num_seqs=4, kv_cache_memory=small.sizing.total_bytes // 2)
    assert capped.kv.num_blocks == small.kv.num_blocks // 2


def test_pool_smaller_than_one_sequence_warns(model):
    with pytest.warns(UserWarning, match=r"KV pool holds 64 tokens \(4 blocks of 16\) but max_model_len is 512.*"
                      r"num_blocks=32"):
        LLM(model, block_size=16, num_blocks=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LLM(model, block_size=16, num_blocks=4, max_model_len=64)  # the limit is explicit: fine


@pytest.mark.parametrize("memory", [4, 0, 4.0, -1])
def test_kv_cache_memory_below_one_block_is_an_error(model, memory):
    with pytest.raises(ValueError, match=r"kv_cache_memory=.* less than one KV block .*in bytes: for 4 GiB"):
        LLM(model, block_size=16, kv_cache_memory=memory)


def test_kv_cache_memory_not_a_number(model):
    with pytest.raises(ValueError, match="kv_cache_memory must be a number of bytes"):
        LLM(model, kv_cache_memory="4GiB")


# ------------------------------------------------------------------------------------ model path
def test_model_path_that_is_a_file(tmp_path: Path):
    config = tmp_path / "config.json"
    config.write_text("{}")
    with pytest.raises(ValueError, match=r"that is a file, not a model.*checkpoint directory"):
        LLM(str(config))
    with pytest.raises(ValueError, match="no such directory"):
        LLM(tmp_path / "missing")
