"""GRPO rollouts for a vision-language model through flashpage_rollout() (issue 36, item 4).

TRL 1.16's GRPOTrainer hands ``rollout_func`` the conversational prompts with their images in the content parts
(``{"type": "image", "image": PIL}``, from the dataset's ``image`` / ``images`` column) and recomputes the
completions' logprobs itself with the processor's ``pixel_values``. Model: the tiny LLaVA of tests/vlm_zoo.py (CLIP
tower, 17 image tokens, Llama decoder; a type in ``flashpage.engine.multimodal.IMAGE_TYPES``) with a chat template
that writes ``<image>`` for an image part. Oracles (float32): a few GRPO steps run and train; each rollout's prompt
ids are TRL's own tokenization (image tokens expanded) and its logprobs equal the trainer's recomputation of the same
tokens within 1e-4; greedy completions equal unpatched ``generate()`` on the processor's tensors for the same
prompts, token for token, logprobs within 1e-4; other images give other answers (the check can fail).
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch
from vlm_zoo import tiny_image, tiny_llava

import flashpage
from flashpage.integrations import trl as fp_trl

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                               reason="TRL not installed: pip install 'flashpage[rl]'")
ATOL = 1e-4
MAX_NEW = 8
QUESTIONS = ["what is it", "describe the picture", "which colour", "count the things"]
# the role, then each part: an image part is the processor's placeholder, which it expands to 17 image tokens
TEMPLATE = ("{%- for message in messages -%}{{ message['role'] + ':' }}{%- for part in message['content'] -%}"
            "{%- if part['type'] == 'image' -%}<image>{%- else -%}{{ ' ' + part['text'] }}{%- endif -%}{%- endfor -%}"
            "{{ '\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}assistant:{%- endif -%}")


def test_prompt_images_are_the_image_parts_in_order():
    a, b = tiny_image(0), tiny_image(1)
    chat = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "and"},
                                         {"type": "image", "image": b}]}]
    assert fp_trl.prompt_images(chat) == [a, b]
    assert fp_trl.prompt_images("plain text") == [] == fp_trl.prompt_images([{"role": "user", "content": "hi"}])


def test_a_model_the_engine_takes_no_images_for_is_refused_before_any_forward():
    model, _ = flashpage.load_tiny_model()  # a text model: image prompts mean nothing to it
    chat = [{"role": "user", "content": [{"type": "image", "image": tiny_image(0)}, {"type": "text", "text": "x"}]}]
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match=r"cannot take images.*not a vision-language model.*rollout_func"):
        fp_trl.rollout_requests(SimpleNamespace(), [(chat, 2)], model)
    assert not forwards


# ----------------------------------------------------------------------------- with TRL
@pytest.fixture
def llava():
    model, processor = tiny_llava()
    processor.chat_template = TEMPLATE
    return model, processor


def _dataset(images: list | None = None):
    from datasets import Dataset

    images = images if images is not None else [tiny_image(i) for i in range(len(QUESTIONS))]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS], "image": images})


def _trainer(model, processor, rollout, tmp_path, **cfg):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig, GRPOTrainer

    # steps_per_generation=2: one rollout serves two optimizer steps, so TRL recomputes the rollout's logprobs
    # (old_per_token_logps, with the processor's pixel_values) right after generating
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=MAX_NEW, max_steps=4, steps_per_generation=2, report_to="none",
                    use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-2, logging_steps=1, seed=0,
                    bf16=False)
    settings.update(cfg)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(str(c))) for c in completions],
                       args=GRPOConfig(**settings), train_dataset=_dataset(), processing_class=processor,
                       rollout_func=rollout)


def _image_prompts(questions=QUESTIONS, seeds=None, repeat: int = 2) -> list:
    from trl.data_utils import prepare_multimodal_messages

    seeds = range(len(questions)) if seeds is None else seeds
    return [prepare_multimodal_messages([{"role": "user", "content": q}], images=[tiny_image(s)])
            for q, s in zip(questions, seeds, strict=True) for _ in range(repeat)]


@needs_trl
def test_grpo_steps_on_a_vlm_are_on_policy(llava, tmp_path):
    model, processor = llava
    rollout = fp_trl.flashpage_rollout()
    seen: list[tuple[list, dict]] = []

    def recording(prompts, trainer):
        out = rollout(prompts, trainer)
        seen.append((prompts, out))
        return out

    trainer = _trainer(model, processor, recording, tmp_path, temperature=0.9)
    recomputed = []
    own = trainer._get_per_token_logps_and_entropies

    def capture(*args, **kwargs):
        result = own(*args, **kwargs)
        if not torch.is_grad_enabled():  # the recomputation right after the rollout, not the loss's forward
            recomputed.append((args[1], kwargs.get("pixel_values"), result[0]))
        return result

    trainer._get_per_token_logps_and_entropies = capture
    before = model.lm_head.weight.detach().clone()
    trainer.train()
    assert not torch.equal(before, model.lm_head.weight)  # it trained
    assert model.training and not flashpage.is_patched(model)
    assert len(seen) == 2 == len(recomputed) and rollout.stats.rollouts == 2  # the second after two optimizer steps
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    for (prompts, out), (ids, pixels, logps) in zip(seen, recomputed, strict=True):
        assert pixels is not None and pixels.shape[0] == len(prompts)  # the trainer scored them with the images
        tokenized, images, _ = trainer._tokenize_prompts(prompts)
        assert images is not None and [list(t) for t in tokenized] == out["prompt_ids"]  # TRL's own ids
        assert all(p.count(image_id) == 17 for p in out["prompt_ids"])
        gap = max(abs(lp - float(logps[i, j])) for i, row in enumerate(out["logprobs"]) for j, lp in enumerate(row))
        assert len(out["logprobs"]) == len(prompts) and 0 < gap <= ATOL, gap
        assert ids.shape[0] == len(prompts)


def _generate(model, processor, prompt: list, trainer) -> tuple[list[int], list[torch.Tensor]]:
    """Unpatched generate() on the processor's tensors for one conversational prompt (its chat template)."""
    assert not flashpage.is_patched(model)
    inputs = processor.apply_chat_template([prompt], add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    eos = trainer.eos_token_ids
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, n:].tolist()
    if eos[0] in tokens:  # HF pads after EOS; the rollout stops at it (TRL's convention)
        tokens = tokens[: tokens.index(eos[0]) + 1]
    return tokens, [torch.log_softmax(x[0].float(), -1) for x in out.logits]


@needs_trl
def test_greedy_image_rollout_is_unpatched_generate(llava, tmp_path):
    model, processor = llava
    rollout = fp_trl.flashpage_rollout()
    trainer = _trainer(model, processor, rollout, tmp_path, generation_kwargs={"do_sample": False})
    prompts = _image_prompts()
    out = rollout(prompts, trainer)
    assert not flashpage.is_patched(model) and rollout._llm is None
    model.eval()
    for k in range(0, len(prompts), 2):
        assert out["completion_ids"][k] == out["completion_ids"][k + 1]  # n=2 greedy samples of one request
        ref, logps = _generate(model, processor, prompts[k], trainer)
        assert out["completion_ids"][k] == ref
        assert max(abs(lp - float(logps[j][t])) for j, (lp, t) in enumerate(
            zip(out["logprobs"][k], ref, strict=True))) <= ATOL
    other = rollout(_image_prompts(seeds=range(10, 14)), trainer)  # same questions, other images
    assert other["prompt_ids"] == out["prompt_ids"]
    assert other["completion_ids"] != out["completion_ids"] or max(
        abs(a - b) for x, y in zip(other["logprobs"], out["logprobs"], strict=True)
        for a, b in zip(x, y, strict=False)) > 1e-3  # the images reach the answers


@needs_trl
def test_a_batch_mixing_image_and_text_prompts(llava, tmp_path):
    model, processor = llava
    rollout = fp_trl.flashpage_rollout()
    trainer = _trainer(model, processor, rollout, tmp_path, generation_kwargs={"do_sample": False})
    text_only = [{"role": "user", "content": [{"type": "text", "text": "no picture here"}]}]
    prompts = _image_prompts(QUESTIONS[:1], [3], repeat=1) + [text_only]
    out = rollout(prompts, trainer)
    tokenized, _, _ = trainer._tokenize_prompts(prompts)
    assert [list(t) for t in tokenized] == out["prompt_ids"]
    model.eval()
    for prompt, completion in zip(prompts, out["completion_ids"], strict=True):
        assert completion == _generate(model, processor, prompt, trainer)[0]
