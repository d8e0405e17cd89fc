"""flashpage as TRL GRPOTrainer's rollout_func (flashpage.integrations.trl).

The pieces run without TRL; the trainer tests need TRL >= 1.0 (``pip install 'flashpage[rl]'``)
and skip, visibly, without it. Oracles: a greedy rollout equals transformers' generate() on the
trainer's model (PEFT/LoRA included), rollout logprobs equal the trainer's own recomputation of
the same tokens within 1e-5 (float32), and the model comes back in the mode it was in.
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

import flashpage
from flashpage.integrations import trl as fp_trl
from flashpage.testing import compare_greedy

HAS_TRL = importlib.util.find_spec("trl") is not None
needs_trl = pytest.mark.skipif(not HAS_TRL, reason="TRL not installed: pip install 'flashpage[rl]'")
PROMPTS = ["The function", "A list of", "Return the"]
MAX_NEW = 12


# ----------------------------------------------------------------------------- pieces (no TRL)
def test_group_repeats_turns_repeated_prompts_into_requests_with_n():
    chat = [{"role": "user", "content": "hi"}]
    assert fp_trl.group_repeats(["a", "a", "b", "b", "b", "a"]) == [("a", 2), ("b", 3), ("a", 1)]
    assert fp_trl.group_repeats([chat, chat]) == [(chat, 2)]
    assert fp_trl.group_repeats([]) == []


def _fake_trainer(**overrides) -> SimpleNamespace:
    base = dict(max_completion_length=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1,
                eos_token_ids=[1, 7], args=SimpleNamespace(generation_kwargs=None))
    return SimpleNamespace(**{**base, **overrides})


def test_sampling_params_follow_the_trainer():
    p = fp_trl.sampling_params(_fake_trainer(), 4)
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == \
        (4, 9, 0.7, 0.9, 5, 0.05, 1.1)
    assert p.stop_ids == {1, 7} and p.logprobs == 0
    off = fp_trl.sampling_params(_fake_trainer(top_k=0, min_p=None, top_p=None), 1)
    assert (off.top_k, off.min_p, off.top_p) == (-1, 0.0, 1.0)
    kw = SimpleNamespace(generation_kwargs={"max_new_tokens": 3, "min_new_tokens": 2, "do_sample": False,
                                            "eos_token_id": 5, "pad_token_id": 0})
    p = fp_trl.sampling_params(_fake_trainer(args=kw), 2)
    assert (p.max_tokens, p.min_tokens, p.greedy, p.stop_ids) == (3, 2, True, {5})


def test_unknown_generation_kwargs_are_refused_by_name():
    bad = SimpleNamespace(generation_kwargs={"num_beams": 4, "temperature": 0.5})
    with pytest.raises(ValueError, match="num_beams"):
        fp_trl.sampling_params(_fake_trainer(args=bad), 1)


def test_kv_blocks_cover_every_sample():
    params = [flashpage.SamplingParams(n=4, max_tokens=10), flashpage.SamplingParams(n=1, max_tokens=3)]
    # prompt of 20 tokens, block 16: 1 shared full block + 4 x (ceil(30/16) - 1) ; prompt of 5: 0 + 1 x 1 ; + 1
    assert fp_trl.kv_blocks_needed([list(range(20)), list(range(5))], params, 16) == 1 + 4 * 1 + 1 + 1


def test_old_trl_is_refused_with_the_version_range(monkeypatch):
    fake = SimpleNamespace(__version__="0.29.1")
    monkeypatch.setitem(__import__("sys").modules, "trl", fake)
    with pytest.raises(ImportError, match=r"TRL >= 1\.0.*0\.29\.1.*use_vllm"):
        fp_trl.check_trl()


# ----------------------------------------------------------------------------- with TRL
@pytest.fixture
def tiny():
    model, tok = flashpage.load_tiny_model()
    return model, tok


def _trainer(model, tok, rollout, tmp_path, **cfg):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=MAX_NEW, max_steps=2, report_to="none", use_cpu=True, save_strategy="no",
                    disable_tqdm=True, learning_rate=1e-3, logging_steps=1, seed=0, bf16=False)  # float32
    settings.update(cfg)
    peft_config = settings.pop("peft_config", None)
    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    # distinct characters: two different completions of a group almost never tie, so every step has a
    # nonzero advantage and trains (a reward most samples miss, such as '"(" in c', can leave a whole run at
    # zero reward std and zero gradient, depending on which tokens happen to be drawn)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(set(c))) for c in completions],
                       args=GRPOConfig(**settings), train_dataset=dataset, processing_class=tok,
                       rollout_func=rollout, peft_config=peft_config)


def _hf_greedy(model, ids: list[int], eos: list[int]):
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos[0], return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(ids):].tolist(), [step[0] for step in out.logits]


def _assert_greedy_matches(model, rollout, eos):
    for prompt, completion in zip(rollout["prompt_ids"], rollout["completion_ids"], strict=True):
        ref, logits = _hf_greedy(model, prompt, eos)
        if eos[0] in ref:  # HF pads after EOS; the rollout stops at it (TRL's convention)
            ref = ref[: ref.index(eos[0]) + 1]
        match = compare_greedy(ref, completion, logits)
        assert match.ok, match.explain()


@needs_trl
def test_greedy_rollout_is_transformers_generate_and_leaves_the_model_as_found(tiny, tmp_path):
    model, tok = tiny
    rollout = fp_trl.flashpage_rollout()
    trainer = _trainer(model, tok, rollout, tmp_path, generation_kwargs={"do_sample": False})
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back as it was
    prompts = [p for p in PROMPTS for _ in range(2)]
    out = rollout(prompts, trainer)
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert not flashpage.is_patched(model)
    assert len(out["completion_ids"]) == len(prompts) == len(out["logprobs"])
    assert out["prompt_ids"][0] == tok("The function")["input_ids"] == out["prompt_ids"][1]
    assert [len(lp) for lp in out["logprobs"]] == [len(c) for c in out["completion_ids"]]
    model.eval()
    _assert_greedy_matches(model, out, trainer.eos_token_ids)
    assert rollout.stats.engines_built == 1 and rollout._llm is None  # the KV pool was released


@needs_trl
def test_trainer_settings_reach_the_sampler(tiny, tmp_path):
    model, tok = tiny
    trainer = _trainer(model, tok, fp_trl.flashpage_rollout(), tmp_path, temperature=0.6, top_p=0.8, top_k=7,
                       min_p=0.02, repetition_penalty=1.2, max_completion_length=5)
    p = fp_trl.sampling_params(trainer, 3)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (3, 0.6, 0.8, 7, 0.02, 1.2, 5)
    assert set(trainer.eos_token_ids) == p.stop_ids


@needs_trl
def test_grpo_training_with_flashpage_rollouts_is_on_policy(tiny, tmp_path):
    from flashpage.bench.rl import onpolicy_gap

    model, tok = tiny
    rollout = fp_trl.flashpage_rollout(release_kv=False)
    trainer = _trainer(model, tok, rollout, tmp_path, temperature=0.9)
    before = model.lm_head.weight.detach().clone()
    trainer.train()
    assert rollout.stats.rollouts == 2 and rollout.stats.engines_built == 1  # the kept pool served both
    assert not torch.equal(before, model.lm_head.weight)  # it trained
    assert model.training and not flashpage.is_patched(model)
    out = rollout([p for p in PROMPTS for _ in range(2)], trainer)  # after two optimizer steps: fresh KV
    gap = onpolicy_gap(trainer, out)
    assert gap.tokens > 0 and gap.max_abs <= 1e-5, gap


@needs_trl
def test_kept_engine_sees_the_optimizer_step(tiny, tmp_path):
    model, tok = tiny
    rollout = fp_trl.flashpage_rollout(release_kv=False)
    trainer = _trainer(model, tok, rollout, tmp_path, generation_kwargs={"do_sample": False})
    prompts = [p for p in PROMPTS for _ in range(2)]
    first = rollout(prompts, trainer)
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight) * 0.5)  # tied to the embeddings
    second = rollout(prompts, trainer)
    assert rollout.stats.engines_built == 1 and rollout._llm.weights_version == 1
    assert second["completion_ids"] != first["completion_ids"]
    model.eval()
    _assert_greedy_matches(model, second, trainer.eos_token_ids)


@needs_trl
def test_lora_model_rolls_out_with_its_adapter(tiny, tmp_path):
    peft = pytest.importorskip("peft")
    model, tok = tiny
    rollout = fp_trl.flashpage_rollout()
    config = peft.LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "o_proj"],
                             init_lora_weights=False, task_type="CAUSAL_LM")
    trainer = _trainer(model, tok, rollout, tmp_path, generation_kwargs={"do_sample": False},
                       peft_config=config)
    lora = trainer.model
    assert hasattr(lora, "peft_config")
    out = rollout([p for p in PROMPTS for _ in range(2)], trainer)
    assert not any(getattr(m, "merged_adapters", []) for m in lora.modules())  # ran unmerged
    lora.eval()
    _assert_greedy_matches(lora, out, trainer.eos_token_ids)
    with lora.disable_adapter():  # the adapter really changed the answer
        plain = [_hf_greedy(lora, p, trainer.eos_token_ids)[0] for p in out["prompt_ids"][::2]]
    assert plain != [c[: len(p)] for c, p in zip(out["completion_ids"][::2], plain, strict=True)] or \
        any(len(c) != len(p) for c, p in zip(out["completion_ids"][::2], plain, strict=True))
