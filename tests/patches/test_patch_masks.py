"""What transformers' own test suite does that a new user also does: right padding, arbitrary
masks, attention weights, and switching the attention implementation of a patched model.

- A prompt whose last position is padding: transformers takes the first next-token logits from
  that padded position, whose query still attends to the real keys before it; patched logits must
  equal unpatched ones there too (and for masks with holes), at every step.
- ``output_attentions=True`` returns the weights transformers' eager attention computes.
- ``set_attn_implementation`` / ``config._attn_implementation`` on a patched model unpatch it
  cleanly (warning), or, with a paged cache passed explicitly, raise a clear error.
"""

from __future__ import annotations

import pytest
import torch
from model_zoo import tiny_model

import flashpage
from flashpage.patches import HFPagedCache

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

MASKS = {
    "right": [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]],
    "single": [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0]],
    "holes": [[1, 0, 1, 1, 0, 1, 1], [0, 1, 1, 0, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]],
}
FAMILIES = ("llama", "gpt2", "gemma2", "qwen3")


def _inputs(mask_rows: list[list[int]]) -> dict[str, torch.Tensor]:
    mask = torch.tensor(mask_rows)
    ids = torch.randint(3, 128, mask.shape, generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids * mask, "attention_mask": mask}


def _run(model: torch.nn.Module, inputs: dict[str, torch.Tensor], **kw) -> object:
    with torch.inference_mode():
        return model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0,
                              return_dict_in_generate=True, output_logits=True, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("masks", sorted(MASKS))
def test_masked_prompts_match_transformers(family: str, masks: str) -> None:
    model = tiny_model(family)
    inputs = _inputs(MASKS[masks])
    ref = _run(model, inputs)
    with flashpage.patched(model):
        got = _run(model, inputs)
    for step, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
        diff = (a - b).abs().max().item()
        assert diff < 1e-4, f"{family} {masks}: step {step} logits differ by {diff}"
    assert torch.equal(ref.sequences, got.sequences)


def test_right_padded_query_rows_attend_in_the_plan() -> None:
    """The plan of a right-padded prefill: varlen mode, and the padded positions attend."""
    model = tiny_model("llama")
    flashpage.patch(model)
    cache = HFPagedCache(model.config)
    inputs = _inputs(MASKS["right"])
    with torch.inference_mode():
        model(**inputs, cache=cache, use_cache=True)
    assert cache.kv.num_tokens(cache.rows[0]) == 5 and cache.kv.num_tokens(cache.rows[1]) == 3


@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_output_attentions_equal_eager_weights(family: str) -> None:
    eager = tiny_model(family)
    eager.set_attn_implementation("eager")
    inputs = _inputs([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    ref = _run(eager, inputs, output_attentions=True)
    model = tiny_model(family)
    with flashpage.patched(model):
        got = _run(model, inputs, output_attentions=True)
    assert len(got.attentions) == len(ref.attentions)
    for step, (layers_ref, layers_got) in enumerate(zip(ref.attentions, got.attentions, strict=True)):
        assert len(layers_got) == len(layers_ref) > 0
        for a, b in zip(layers_ref, layers_got, strict=True):
            assert b is not None and a.shape == b.shape, f"step {step}: {None if b is None else b.shape}"
            real_rows = inputs["attention_mask"].bool() if step == 0 else torch.ones(2, 1, dtype=torch.bool)
            diff = (a - b).abs().amax(dim=(1, 3))[real_rows].max().item()  # padded query rows are junk in both
            assert diff < 1e-5, f"{family} step {step}: weights differ by {diff}"
    assert torch.equal(ref.sequences, got.sequences)


def test_assisted_decoding_with_attentions() -> None:
    """transformers' assisted loop reads outputs.attentions[0]: it must work on a patched model."""
    model, assistant = tiny_model("llama"), tiny_model("llama", seed=1)
    inputs = _inputs([[1, 1, 1, 1, 1, 1, 1]])
    ref = _run(model, inputs, assistant_model=assistant)
    with flashpage.patched(model):
        got = _run(model, inputs, assistant_model=assistant, output_attentions=True)
    assert torch.equal(ref.sequences, got.sequences)
    assert got.attentions and all(a is not None for step in got.attentions for a in step)


def test_set_attn_implementation_unpatches_cleanly() -> None:
    model = tiny_model("llama")
    inputs = _inputs(MASKS["right"])
    flashpage.patch(model)
    with pytest.warns(UserWarning, match="unpatched it"):
        model.set_attn_implementation("eager")
    assert not flashpage.is_patched(model) and model.config._attn_implementation == "eager"
    eager = tiny_model("llama")
    eager.set_attn_implementation("eager")
    assert torch.equal(_run(model, inputs).sequences, _run(eager, inputs).sequences)
    flashpage.patch(model)  # patching again routes it through flashpage
    assert model.config._attn_implementation == flashpage.patches.ATTN_NAME
    out = _run(model, inputs)
    assert isinstance(getattr(out, "cache", None) or out.past_key_values, HFPagedCache)


def test_config_attn_implementation_switch_unpatches_at_generate() -> None:
    model = tiny_model("llama")
    inputs = _inputs(MASKS["holes"])
    ref = _run(tiny_model("llama"), inputs)
    flashpage.patch(model)
    model.config._attn_implementation = "sdpa"
    with pytest.warns(UserWarning, match="unpatched it"):
        got = _run(model, inputs)
    assert not flashpage.is_patched(model)
    assert torch.equal(ref.sequences, got.sequences)


def test_config_switch_with_explicit_paged_cache_is_refused() -> None:
    model = tiny_model("llama")
    flashpage.patch(model)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(RuntimeError, match="only flashpage's attention can read"):
        with torch.inference_mode():
            model(**_inputs(MASKS["right"]), cache=HFPagedCache(model.config), use_cache=True)


# ------------------------------------------------------------------------------ bidirectional image attention
def _tiny_gemma3_vlm() -> torch.nn.Module:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=7)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=290,
                          boi_token_index=291, eoi_token_index=292)
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(config).eval()


def test_image_tokens_attending_both_ways_are_exact_on_the_pages() -> None:
    """Gemma 3 lets image tokens (token_type_ids 1) attend to each other both ways; flashpage's paged kernels are
    causal. Patched generate() on such an input writes the K/V to the pages and attends under transformers' own
    mask over the keys read back (it was silently causal, then refused): tokens and logits equal the unpatched
    model's; text-only prompts on the same model stay exact. (More in tests/patches/test_vlm.py.)"""
    model = _tiny_gemma3_vlm()
    with torch.no_grad():  # transformers zero-initialises the projector: the image would change nothing
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    ids = torch.tensor([[2, 291, 290, 290, 290, 290, 292, 10, 11, 12]])
    image = dict(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=(ids == 290).long(),
                 pixel_values=torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(1)))
    text = dict(input_ids=torch.tensor([[2, 10, 11, 12, 13]]))
    steps = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref_text = model.generate(**text, max_new_tokens=5, do_sample=False)
    ref = model.generate(**image, **steps)
    with flashpage.patched(model):
        out = model.generate(**image, **steps)
        assert torch.equal(model.generate(**text, max_new_tokens=5, do_sample=False), ref_text)
    assert torch.equal(out.sequences, ref.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits, strict=True)) <= 1e-4


def test_bidirectional_mask_in_an_engine_step_is_refused() -> None:
    """A step the engine planned (packed sequences, the cache does not own the plan) cannot attend under a
    per-request 4D mask: a mask letting tokens see later ones raises NonCausalMaskError before any layer runs."""
    from types import SimpleNamespace

    from transformers.masking_utils import causal_mask_function

    from flashpage.errors import NonCausalMaskError
    from flashpage.patches.attention import paged_mask, set_paged_forward

    def both_ways(batch_idx, head_idx, q_idx, kv_idx):
        return causal_mask_function(batch_idx, head_idx, q_idx, kv_idx) | (kv_idx < 3)

    args = dict(batch_size=1, q_length=4, kv_length=4, q_offset=0, kv_offset=0, mask_function=both_ways,
                attention_mask=None, allow_is_causal_skip=False, dtype=torch.float32, device=torch.device("cpu"))
    engine_cache = SimpleNamespace(owns_plan=False, sees_later=False)
    own_cache = SimpleNamespace(owns_plan=True, sees_later=False)
    try:
        set_paged_forward("Model", engine_cache)
        with pytest.raises(NonCausalMaskError, match="later tokens"):
            paged_mask(**args)
        set_paged_forward("Model", own_cache)
        assert paged_mask(**args) is not None and own_cache.sees_later
    finally:
        set_paged_forward(None)


def test_later_token_check_reads_positions_and_padding() -> None:
    from flashpage.patches.attention import sees_later_tokens

    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    assert not sees_later_tokens(causal, {})
    assert sees_later_tokens(torch.ones(1, 1, 4, 4, dtype=torch.bool), {})
    # 2 queries after 3 cached keys (positions 3 and 4), bottom-right causal: only the position says it is causal
    block = torch.tensor([[[[True, True, True, True, False], [True, True, True, True, True]]]])
    assert not sees_later_tokens(block, {"q_offset": 3}) and sees_later_tokens(block, {"q_offset": 1})
    assert not sees_later_tokens(block, {"cache_position": torch.tensor([3, 4])})
    assert sees_later_tokens(block, {"cache_position": torch.tensor([2, 3])})
    # a padded query row that sees everything does not count
    row = torch.tensor([[[[True, True, True], [True, True, False], [True, True, True]]]])
    assert sees_later_tokens(row, {})
    assert not sees_later_tokens(row, {"attention_mask": torch.tensor([[0, 1, 1]])})
