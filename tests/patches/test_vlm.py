"""Vision-language models through patch(): exact against transformers' own unpatched generate() (issue 36).

Oracles: the unpatched model, same tiny random weights, same processor output; float32, tokens identical and every
generated step's logits within 1e-4. A token check alone is not enough (Gemma 3's tokens once survived a 0.36 logit
change), so logits are compared too, and the tests first show that what they check changes the output.
"""

from __future__ import annotations

import pytest
import torch
from vlm_zoo import BUILDERS, image_inputs, tiny_image, tiny_llava, tiny_qwen_vl, tiny_vibevoice_asr

import flashpage
from flashpage.patches.compat import cache_kwarg
from flashpage.patches.hf_cache import HFPagedCache

ATOL = 1e-4
GREEDY = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)


def _max_logit_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits, strict=True))


def _assert_same(ref, out) -> None:
    assert torch.equal(ref.sequences, out.sequences)
    assert _max_logit_diff(ref, out) <= ATOL


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def vlm(request):
    model, processor = BUILDERS[request.param]()
    return request.param, model, processor


def test_bidirectional_image_attention_is_exact_in_generate(vlm) -> None:
    """Gemma 3 / Gemma 4 image tokens and PaliGemma's image + prompt prefix attend both ways (token_type_ids /
    mm_token_type_ids). Patched generate() writes their K/V to the pages and attends under transformers' own mask
    over the keys read back: a left-padded batch of two prompts with two images equals unpatched generate()."""
    name, model, processor = vlm
    inputs = image_inputs(processor, ["Describe this picture", "hi"], [tiny_image(0), tiny_image(1)])
    inputs.pop("labels", None)
    assert bool((inputs["attention_mask"] == 0).any())  # the batch is padded
    ref = model.generate(**inputs, **GREEDY)
    types = next(k for k in ("token_type_ids", "mm_token_type_ids") if k in inputs)
    causal = model.generate(**{k: v for k, v in inputs.items() if k != types}, **GREEDY)
    assert _max_logit_diff(ref, causal) > 1e-3, f"{name}: the bidirectional mask changes nothing here"
    with flashpage.patched(model):
        out = model.generate(**inputs, **GREEDY)
    _assert_same(ref, out)


def test_same_text_different_images_share_no_pages(vlm) -> None:
    """Two rows with the same text and different images have the same token ids (image placeholders): pages
    shared by token ids would give the second row the first one's image. With small blocks (full blocks of
    placeholder tokens), both rows equal unpatched generate() and differ from each other."""
    _same_text_different_images(*vlm)


def test_same_text_different_images_share_no_pages_on_causal_vlm() -> None:
    """The same on LLaVA, whose image tokens attend causally (it was silently wrong too: a different token and a
    0.77 logit difference on the second row)."""
    _same_text_different_images("llava", *tiny_llava())


def _same_text_different_images(name: str, model: torch.nn.Module, processor) -> None:
    inputs = image_inputs(processor, ["what is it", "what is it"], [tiny_image(2), tiny_image(3)])
    inputs.pop("labels", None)
    assert torch.equal(inputs["input_ids"][0], inputs["input_ids"][1])
    ref = model.generate(**inputs, **GREEDY)
    assert float((ref.logits[0][0] - ref.logits[0][1]).abs().max()) > 1e-3, f"{name}: the images change nothing"
    with flashpage.patched(model, block_size=4):
        out = model.generate(**inputs, **GREEDY)
    _assert_same(ref, out)


def test_image_prompt_then_continuation_on_the_returned_cache(vlm) -> None:
    """A second generate() continues the paged cache of an image prompt (text only now: decode steps on the
    pages) as transformers continues its own cache."""
    name, model, processor = vlm
    inputs = image_inputs(processor, ["Describe this picture"], [tiny_image(4)])
    inputs.pop("labels", None)
    steps = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    first = model.generate(**inputs, **steps)
    more = _continue(model, first)
    with flashpage.patched(model):
        first_p = model.generate(**inputs, **steps)
        assert isinstance(_cache_of(first_p), HFPagedCache)
        more_p = _continue(model, first_p)
    assert torch.equal(first.sequences, first_p.sequences)
    _assert_same(more, more_p)


def _cache_of(output) -> object:
    return output.cache if getattr(output, "cache", None) is not None else output.past_key_values


def _continue(model, first) -> object:
    """generate() on the prompt plus the first call's tokens, with the first call's cache."""
    ids = first.sequences
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          **{cache_kwarg(model): _cache_of(first)}, **GREEDY)


# ------------------------------------------------------------------------------------------------ unpatch
def _attention_choices(model: torch.nn.Module) -> dict[str, str]:
    return {name or "<root>": m.config._attn_implementation for name, m in model.named_modules()
            if callable(getattr(m, "_can_set_attn_implementation", None))}


def test_unpatch_gives_each_sub_model_its_own_attention_back() -> None:
    """VibeVoice-ASR's audio tokenizers support no sdpa: unpatch() used to put the text model's "sdpa" on the
    whole model, which transformers refuses (ValueError) with the model left half patched. Each sub-model gets its
    own implementation back, and the model patches again."""
    model = tiny_vibevoice_asr()
    before = _attention_choices(model)
    assert "eager" in before.values() and "sdpa" in before.values()  # the mix that broke unpatch
    flashpage.patch(model)
    assert set(_attention_choices(model).values()) == {"pagedkv"}
    flashpage.unpatch(model)
    assert not flashpage.is_patched(model)
    assert _attention_choices(model) == before
    flashpage.patch(model)
    flashpage.unpatch(model)
    assert _attention_choices(model) == before


# --------------------------------------------------------------------------- patch after unpatched generate
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_patch_after_an_unpatched_generate_on_qwen_vl(model_type: str) -> None:
    """Qwen-VL models keep the last batch's M-RoPE ``rope_deltas`` on the model; patch()'s probe forward (another
    batch size) tripped on them and patch() refused the model. The probe runs as on a fresh model (the deltas set
    aside, then given back), and patched generate() equals unpatched generate() on the same prompts."""
    model = tiny_qwen_vl(model_type)
    ids = torch.tensor([[3, 4, 5, 6, 7], [0, 0, 8, 9, 10]])
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(), pad_token_id=0)
    ref = model.generate(**inputs, **GREEDY)
    assert model.model.rope_deltas is not None  # the state that broke the probe
    with flashpage.patched(model):
        out = model.generate(**inputs, **GREEDY)
    _assert_same(ref, out)


# ------------------------------------------------------------------------------------------ kosmos-2.5 in LLM
def test_kosmos_2_5_text_in_llm_matches_generate() -> None:
    """Kosmos-2.5's sinusoidal positions start at padding_idx + 1 (its generate() lets the embedding count them);
    the engine passes 0-based positions, which it used to hand over as they were (first token 27 instead of 70,
    logprobs off by up to 0.26). Greedy LLM equals unpatched generate() per prompt: tokens and logprobs."""
    from sweep_configs import sweep_config
    from transformers import AutoModelForImageTextToText

    from flashpage import LLM, SamplingParams

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(sweep_config("kosmos-2.5")).eval()
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    refs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **GREEDY)
        refs.append((out.sequences[0, len(prompt):].tolist(), [step[0].log_softmax(-1) for step in out.logits]))
    llm = LLM(model, block_size=4, num_blocks=64, max_num_seqs=4, compile=False, max_model_len=256)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3), use_tqdm=False)
    for out, (tokens, logprobs) in zip(outputs, refs, strict=True):
        assert list(out.token_ids) == tokens
        for step, got in enumerate(out.logprobs):
            assert abs(got.logprob - float(logprobs[step][tokens[step]])) <= ATOL
            assert all(abs(lp - float(logprobs[step][tok])) <= ATOL for tok, lp in got.top.items())


# ------------------------------------------------------------------- PaliGemma text-only: unmasked prefill
def test_paligemma_unpadded_text_prefill_attends_both_ways_as_transformers() -> None:
    """PaliGemma's text attention says is_causal=False (use_bidirectional_attention) but is handed causal masks,
    so patch() makes it causal; where transformers skips the mask (an unpadded prompt: attention_mask None) the
    unpatched module attends to every key, both ways. Patched generate() does the same (it was off by ~3e-4 in
    logprobs: the 'paligemma in LLM' drift), and so does a forward without a cache (training). flashpage.LLM
    computes such a prompt as one span attending both ways (tests/engine/test_llm_images.py test_paligemma_...)."""
    model, _ = BUILDERS["paligemma"]()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=0)
    ref = model.generate(**inputs, **GREEDY)
    with torch.no_grad():
        forward_ref = model(input_ids=ids, use_cache=False).logits
    text_attention = [m for n, m in model.named_modules() if n.startswith("model.language_model.layers.")
                      and n.endswith("self_attn")]
    assert text_attention and not any(m.is_causal for m in text_attention)
    for m in text_attention:  # what patched generate() computed before: causal
        m.is_causal = True
    causal = model.generate(**inputs, **GREEDY)
    for m in text_attention:
        m.is_causal = False
    assert _max_logit_diff(ref, causal) > ATOL
    with flashpage.patched(model):
        out = model.generate(**inputs, **GREEDY)
        with torch.no_grad():
            forward = model(input_ids=ids, use_cache=False).logits
    _assert_same(ref, out)
    assert float((forward - forward_ref).abs().max()) <= ATOL
    assert not any(m.is_causal for m in text_attention)  # unpatch gives the flag back


def test_llm_refuses_a_text_model_whose_unmasked_prompt_attends_both_ways() -> None:
    """LLM reads a both-ways prompt's span from the masks a vision-language model hands its language model
    (PaliGemma: tests/engine/test_llm_images.py). A plain causal LM whose sdpa attention says is_causal=False has
    none to read: refused before any step, saying why, and left as it was (unpatched)."""
    from model_zoo import tiny_model

    from flashpage import LLM
    from flashpage.patches import UnsupportedModelError

    model = tiny_model("llama")
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.is_causal = False
    with pytest.raises(UnsupportedModelError, match="is_causal=False.*both ways.*language_model.*generate"):
        LLM(model, block_size=4, num_blocks=64, compile=False, max_model_len=256)
    assert not flashpage.is_patched(model)
