"""No stale KV, ever: after the weights change, nothing the engine computed before is reused.

A prompt generated before and after a real optimizer step (and after ``load_state_dict``, a LoRA
merge, a hand edit) with prefix caching on matches a fresh transformers ``generate()`` on the
weights of that moment, and requests running across a change are recomputed. The weight
fingerprint itself is checked against every way a training loop changes weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import assert_matches_hf, hf_greedy
from model_zoo import VOCAB, tiny_model

from flashpage import LLM, SamplingParams
from flashpage.blocks import BlockManager
from flashpage.engine.weights import WeightWatcher, weights_fingerprint

PROMPT = [(7 * i + 3) % (VOCAB - 3) + 3 for i in range(45)]  # 2 full blocks of 16 cached + a partial one
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)


def _model() -> torch.nn.Module:
    return tiny_model("llama", seed=3, max_position_embeddings=512)


def _train_step(model: torch.nn.Module, lr: float = 0.05, seed: int = 0, **adam: object) -> None:
    """One real optimizer step of next-token loss on random tokens (the model keeps its mode)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 24), generator=g)
    was = model.training
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, **adam)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.train(was)


def _first_logprob_error(model: torch.nn.Module, out) -> float:
    """|engine logprob of the first new token - log_softmax of HF's first-step logits| (fresh forward)."""
    _, logits = hf_greedy(model, PROMPT, 1, eos=False)
    ref = torch.log_softmax(logits[0].float(), -1)[out.token_ids[0]]
    return abs(out.logprobs[0].logprob - float(ref))


def _generate_and_check(llm: LLM, model: torch.nn.Module) -> list[int]:
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert_matches_hf(model, [PROMPT], [out], GREEDY.max_tokens, eos=False)
    assert _first_logprob_error(model, out) < 1e-4
    return out.token_ids


def test_optimizer_step_and_load_state_dict_never_reuse_old_kv():
    model = _model()
    original = copy.deepcopy(model.state_dict())
    llm = LLM(model, block_size=16, num_blocks=64, check_invariants=True)
    first = _generate_and_check(llm, model)
    assert llm.stats().blocks_cached >= 2  # the prompt's full blocks are in the prefix cache now
    _generate_and_check(llm, model)  # same weights: served from the cache, still exact
    assert llm.stats().prefix_cache_hit_rate > 0
    assert llm.weights_version == 0

    _train_step(model)
    after_step = _generate_and_check(llm, model)
    assert llm.weights_version == 1
    assert after_step != first  # the step changed the model's answer: the check above had teeth

    model.load_state_dict(original)
    assert _generate_and_check(llm, model) == first
    assert llm.weights_version == 2


def test_a_missed_change_would_have_served_stale_kv():
    """The oracle above detects stale KV: with the watcher blinded, the cached prefix is wrong."""
    model = _model()
    llm = LLM(model, block_size=16, num_blocks=64)
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    llm._weights.changed = lambda extra=None, full=True: False  # blind it
    _train_step(model)
    stale = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert _first_logprob_error(model, stale) > 1e-3
    assert llm.reset_prefix_cache() is True  # the manual escape hatch fixes it
    fresh = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert _first_logprob_error(model, fresh) < 1e-4


def test_running_requests_are_recomputed_after_a_change():
    model = _model()
    llm = LLM(model, block_size=16, num_blocks=64, check_invariants=True)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    rid = llm.add_request(PROMPT, params)
    done = None
    for _ in range(4):  # prefill + a few decodes under the old weights
        for out in llm.step():
            done = out
    before = list(done.token_ids)
    assert 0 < len(before) < 10
    _train_step(model)
    final = None
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final.token_ids[: len(before)] == before  # what was produced stays
    ref, logits = hf_greedy(model, PROMPT + before, 10 - len(before), eos=False)  # the rest: the new weights
    from flashpage.testing import compare_greedy
    match = compare_greedy(ref, final.token_ids[len(before):], logits)
    assert match.ok, match.explain()
    assert llm.weights_version == 1


def test_param_data_edit_needs_the_manual_reset():
    """``param.data += x`` keeps storage and the tensor's version (documented blind spot)."""
    model = _model()
    watcher = WeightWatcher(model)
    with torch.no_grad():
        model.lm_head.weight.data += 0.5
    assert not watcher.changed()
    model.lm_head.weight.data = model.lm_head.weight.data.clone()  # new storage: seen
    assert watcher.changed()


@pytest.mark.parametrize("how", ["adamw_loop", "adamw_foreach", "adamw_fused", "sgd", "assign", "to_dtype",
                                 "buffer", "new_parameter"])
def test_fingerprint_sees_every_training_update(how):
    model = tiny_model("llama", seed=1)
    watcher = WeightWatcher(model)
    assert not watcher.changed()
    if how.startswith("adamw"):
        kind = how.split("_")[1]
        _train_step(model, foreach=kind == "foreach", fused=True if kind == "fused" else None)
    elif how == "sgd":
        model(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    elif how == "assign":
        state = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
    elif how == "to_dtype":
        model.to(torch.float64)
    elif how == "buffer":
        next(b for b in model.buffers()).mul_(1.0)
    else:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    assert watcher.changed()
    assert watcher.version == 1
    assert not watcher.changed()  # once per change


def test_fingerprint_takes_an_extra_key():
    model = tiny_model("llama", seed=1)
    assert weights_fingerprint(model, 3) != weights_fingerprint(model, 4)
    assert weights_fingerprint(model, 3) == weights_fingerprint(model, 3)


def test_lora_merge_is_a_weight_change():
    peft = pytest.importorskip("peft")
    model = _model()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8,
                                                      init_lora_weights=False))
    base = lora.get_base_model()
    llm = LLM(base, block_size=16, num_blocks=64, check_invariants=True)
    _generate_and_check(llm, base)
    lora.merge_adapter()  # writes through .data: seen through the adapter layers' merged state
    _generate_and_check(llm, base)
    assert llm.weights_version == 1
    lora.unmerge_adapter()
    with lora.disable_adapter():
        _generate_and_check(llm, base)
        assert llm.weights_version == 2  # unmerge and disable: one change between two generate() calls


def test_block_manager_reset_prefix_cache():
    bm = BlockManager(8, 4)
    bm.add_sequence("a", list(range(9)))
    bm.append("a", 9, list(range(9)))
    bm.add_sequence("b", list(range(9)))  # shares a's two full blocks
    assert bm.num_tokens("b") == 8
    bm.free("b")
    bm.free("a")
    assert bm.stats().cached == 2
    assert bm.reset_prefix_cache() == 2
    bm.check_invariants()
    assert bm.stats().cached == 0
    assert bm.add_sequence("c", list(range(9))) == 0  # nothing found any more
    bm.append("c", 9, list(range(9)))
    assert bm.reset_prefix_cache() == 2  # held blocks lose their keys too
    bm.check_invariants()
    bm.free("c")
    assert bm.add_sequence("d", list(range(9))) == 0
