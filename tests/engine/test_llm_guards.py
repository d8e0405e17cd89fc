"""LLM guards from issue 21: abort() from another thread while step() runs (each request reported
finished exactly once), and arguments refused before any work (a model object's dtype/device, a
max_model_len beyond the model's positions, a prompt that is not text or token ids)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter

import pytest
import torch
from model_zoo import tiny_model

from flashpage import LLM, SamplingParams

POSITIONS = 256  # max_position_embeddings of model_zoo's llama


def _race(llm: LLM, rng: random.Random) -> Counter[str]:
    """One trial: a thread steps the engine to the end while this thread aborts some requests at random
    moments; returns how many times each request was reported finished."""
    ids = [llm.add_request([3 + i, 5, 7, 11], SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0,
                                                             ignore_eos=True)) for i in range(6)]
    finished: Counter[str] = Counter()
    errors: list[BaseException] = []

    def stepper() -> None:
        try:
            while llm.has_unfinished_requests():
                finished.update(o.request_id for o in llm.step() if o.finished)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=stepper)
    thread.start()
    for rid in rng.sample(ids, 4):
        time.sleep(rng.random() * 0.004)
        llm.abort(rid)
    thread.join(timeout=120)
    assert not thread.is_alive() and not errors, errors
    while llm.has_unfinished_requests():  # an abort that came after the stepper's last step
        finished.update(o.request_id for o in llm.step() if o.finished)
    assert set(finished) == set(ids), f"requests never reported finished: {set(ids) - set(finished)}"
    return finished


def test_abort_from_another_thread_reports_each_request_once() -> None:
    llm = LLM(tiny_model("llama"), max_num_seqs=8, num_blocks=64, block_size=4, check_invariants=True)
    rng = random.Random(0)
    for trial in range(40):
        finished = _race(llm, rng)
        twice = {rid: n for rid, n in finished.items() if n != 1}
        assert not twice, f"trial {trial}: reported finished more than once: {twice}"
        assert llm.stats().blocks_used == 0, f"trial {trial}: blocks not given back"
        llm.kv.blocks.check_invariants()


def test_the_race_is_real_without_the_step_lock() -> None:
    """The same trials with the lock removed do report some request twice (or corrupt the step): the
    test above is not passing by luck of timing."""
    llm = LLM(tiny_model("llama"), max_num_seqs=8, num_blocks=64, block_size=4)
    llm._step_lock = contextlib.nullcontext()  # type: ignore[assignment]
    rng = random.Random(0)
    broken = 0
    for _ in range(100):  # stops at the first misreport (usually within a few trials)
        try:
            finished = _race(llm, rng)
        except AssertionError:
            broken += 1
            break
        if any(n != 1 for n in finished.values()):
            broken += 1
            break
    assert broken, "100 unlocked trials never misreported: the threaded test cannot tell a race from none"


# ------------------------------------------------------------------------------------ arguments
def test_model_object_with_another_dtype_or_device_is_refused() -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"dtype='bfloat16'.*model object is torch.float32.*model.to"):
        LLM(model, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"device='meta'.*model object is on cpu"):
        LLM(model, device="meta")
    assert next(model.parameters()).dtype == torch.float32 and not hasattr(model, "_flashpage_patch")
    llm = LLM(model, dtype=torch.float32, device="cpu")  # what the model already is: fine
    assert llm.generate([[3, 5, 7]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0].token_ids


def test_unknown_dtype_and_device_names() -> None:
    with pytest.raises(ValueError, match="not a torch dtype"):
        LLM(tiny_model("llama"), dtype="float33")
    with pytest.raises(ValueError, match="not a device torch knows"):
        LLM(tiny_model("llama"), device="gpu")


def test_cuda_without_cuda_is_refused_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM("/nonexistent/checkpoint", device="cuda")  # the device is refused before the path is looked at


def test_max_model_len_beyond_the_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")
    monkeypatch.delenv("FLASHPAGE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match=rf"max_model_len=5000 is more than the model's {POSITIONS} positions"):
        LLM(model, max_model_len=5000)
    assert LLM(model, max_model_len=POSITIONS).max_model_len == POSITIONS
    monkeypatch.setenv("FLASHPAGE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with pytest.warns(UserWarning, match="FLASHPAGE_ALLOW_LONG_MAX_MODEL_LEN"):
        assert LLM(model, max_model_len=POSITIONS + 8, num_blocks=8).max_model_len == POSITIONS + 8


@pytest.mark.parametrize("prompt", [None, 3.5, b"bytes"])
def test_a_prompt_that_is_neither_text_nor_token_ids(prompt: object) -> None:
    llm = LLM(tiny_model("llama"), num_blocks=16)
    with pytest.raises(TypeError, match="a prompt must be a text .* or a list of token ids"):
        llm.generate([[3, 5], prompt], use_tqdm=False)  # type: ignore[list-item]
    assert not llm.has_unfinished_requests()  # the good prompt before it was not queued either


def test_vllm_prompt_dicts_and_images_refused_by_name() -> None:
    llm = LLM(tiny_model("llama"), num_blocks=16)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    plain = llm.generate([[3, 5, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    as_dict = llm.generate({"prompt_token_ids": [3, 5, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert as_dict == plain and len(plain) == 4
    with pytest.raises(ValueError, match=r"LLM cannot take images for LlamaForCausalLM \(model_type='llama'\): it is "
                                         "not a vision-language model"):
        llm.generate([[3, 5], {"prompt_token_ids": [3], "multi_modal_data": {"image": object()}}], use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of 'prompt' .* or 'prompt_token_ids'"):
        llm.generate([{"prompt_ids": [3]}], use_tqdm=False)
    assert not llm.has_unfinished_requests()  # the good prompt before it was not queued either
