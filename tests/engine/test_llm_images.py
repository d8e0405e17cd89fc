"""Images in flashpage.LLM (issue 36): ``{"prompt": text, "multi_modal_data": {"image": ...}}`` exact against
unpatched transformers generate() on the same tiny VLM and processor inputs, one request at a time.

Oracle: float32, greedy; tokens identical and every generated token's logprob within 1e-4 of the unpatched model's
log-softmax. Each test first shows its images change the output (else it would check nothing).
"""

from __future__ import annotations

import pytest
import torch
from sweep_vlm import prompt_alone
from vlm_zoo import NotBuildable, sweep_image_case, tiny_gemma3, tiny_gemma4, tiny_image, tiny_llava, tiny_paligemma

import flashpage
from flashpage import LLM, SamplingParams
from flashpage.engine.multimodal import IMAGE_TYPES

ATOL = 1e-4
MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=0, ignore_eos=True)


def _oracle(model, inputs: dict, max_new: int = MAX_NEW) -> tuple[list[int], list[torch.Tensor]]:
    """Unpatched generate() on one request's processor tensors: (new tokens, per-step log-softmax)."""
    assert not flashpage.is_patched(model)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences[0, n:].tolist(), [torch.log_softmax(x[0].float(), -1) for x in out.logits]


def _assert_exact(output, ref: tuple[list[int], list[torch.Tensor]]) -> None:
    comp = output.outputs[0]
    assert comp.token_ids == ref[0]
    diff = max(abs(lp.logprob - float(ref[1][i][lp.token_id])) for i, lp in enumerate(comp.logprobs))
    assert diff <= ATOL, diff


@pytest.fixture(scope="module")
def llava():
    model, processor = tiny_llava()
    return model, processor


def _request(processor, text: str, image) -> tuple[dict, dict]:
    """(the LLM request, the processor's tensors for the oracle)."""
    return ({"prompt": text, "multi_modal_data": {"image": image}},
            dict(processor(text=text, images=[image], return_tensors="pt")))


PROMPTS = ["<image> what is it", "a picture: <image> describe it in detail please", "<image>",
           "first some text that fills more than one block, then <image> and a question"]


@pytest.mark.parametrize("budget", [2048, 5])
def test_image_requests_batched_with_a_text_request_equal_generate(llava, budget) -> None:
    """Three image requests and a text request in one LLM, batched; budget 5: every image block (17 tokens) is
    cut by chunk boundaries, steps mix image rows and other requests' decodes."""
    model, processor = llava
    reqs = [_request(processor, p, tiny_image(i)) for i, p in enumerate(PROMPTS[:3])]
    text = "just some text"
    text_inputs = dict(processor.tokenizer(text, return_tensors="pt"))
    refs = [_oracle(model, inputs) for _, inputs in reqs] + [_oracle(model, text_inputs)]
    other = _oracle(model, _request(processor, PROMPTS[0], tiny_image(7))[1])
    assert other[0] != refs[0][0] or float((other[1][0] - refs[0][1][0]).abs().max()) > 1e-3  # images matter
    llm = LLM(model, processor, max_num_batched_tokens=budget, block_size=4, check_invariants=True)
    try:
        outs = llm.generate([r for r, _ in reqs] + [text], GREEDY, use_tqdm=False)
        for out, ref in zip(outs, refs, strict=True):
            _assert_exact(out, ref)
        assert outs[0].prompt == PROMPTS[0]
        assert len(outs[0].prompt_token_ids) == reqs[0][1]["input_ids"].shape[1]  # image tokens expanded
    finally:
        flashpage.unpatch(model)


def test_same_text_different_images_never_share_pages(llava) -> None:
    """Equal text, different images: equal token ids, so pages keyed by ids alone would hand the second request the
    first one's image K/V. Keys carry the image hash from the first image token on: the text before the image is
    shared, the rest is not; the same text and image again hits the cache through the image block."""
    model, processor = llava
    text = "a shared instruction of a few blocks: <image> what is it"
    a, b = (_request(processor, text, tiny_image(s)) for s in (2, 3))
    assert torch.equal(a[1]["input_ids"], b[1]["input_ids"])
    ref_a, ref_b = _oracle(model, a[1]), _oracle(model, b[1])
    assert ref_a[0] != ref_b[0] or float((ref_a[1][0] - ref_b[1][0]).abs().max()) > 1e-3
    first_image = a[1]["input_ids"][0].tolist().index(processor.tokenizer.convert_tokens_to_ids("<image>"))
    llm = LLM(model, processor=processor, block_size=4, check_invariants=True)
    try:
        out_a = llm.generate(a[0], GREEDY, use_tqdm=False)[0]
        out_b = llm.generate(b[0], GREEDY, use_tqdm=False)[0]
        _assert_exact(out_a, ref_a)
        _assert_exact(out_b, ref_b)
        assert 0 < out_b.metrics.cached_prompt_tokens <= first_image  # the text before the image only
        again = llm.generate(a[0], GREEDY, use_tqdm=False)[0]
        _assert_exact(again, ref_a)
        assert again.metrics.cached_prompt_tokens >= first_image + 17  # through the image block
    finally:
        flashpage.unpatch(model)


@pytest.mark.parametrize("caching", [False, True])
def test_preempted_image_requests_recompute_exactly(llava, caching) -> None:
    """A pool too small for all requests at once: image requests are preempted (recompute) and resume from their
    kept embeddings (with prefix caching: from their own salted blocks), exact; add_request / step and stream take
    images too."""
    model, processor = llava
    reqs = [_request(processor, f"<image> question number {i}", tiny_image(10 + i)) for i in range(4)]
    refs = [_oracle(model, inputs, max_new=12) for _, inputs in reqs]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    llm = LLM(model, processor=processor, block_size=4, num_blocks=20, max_num_batched_tokens=16,
              enable_prefix_caching=caching, check_invariants=True, max_model_len=80)
    try:
        for i, (r, _) in enumerate(reqs):
            llm.add_request(r, params, request_id=str(i))
        done = {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    done[out.request_id] = out
        assert llm.stats().preemptions > 0
        for i, ref in enumerate(refs):
            _assert_exact(done[str(i)], ref)
        streamed = [d.token_ids for d in llm.stream(reqs[1][0], GREEDY)]
        assert sum(streamed, []) == refs[1][0][:MAX_NEW]
    finally:
        flashpage.unpatch(model)


def test_preprocessed_inputs_with_prompt_token_ids(llava) -> None:
    """``{"prompt_token_ids": ids, "multi_modal_data": {"image": processor_outputs}}`` equals the text form."""
    model, processor = llava
    req, inputs = _request(processor, PROMPTS[1], tiny_image(4))
    ref = _oracle(model, inputs)
    tensors = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    llm = LLM(model, processor=processor)
    try:
        out = llm.generate({"prompt_token_ids": inputs["input_ids"][0].tolist(),
                            "multi_modal_data": {"image": tensors}}, GREEDY, use_tqdm=False)[0]
        _assert_exact(out, ref)
        with pytest.raises(ValueError, match="processor's outputs"):
            llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": tiny_image(0)}}, use_tqdm=False)
        with pytest.raises(ValueError, match="'image' only"):
            llm.generate({"prompt": "x", "multi_modal_data": {"video": [1]}}, use_tqdm=False)
    finally:
        flashpage.unpatch(model)


# (gemma4's 63-token image block: test_two_way_...; paligemma's whole prompt is one span: test_paligemma_...)
# (a budget of 7 tokens: not for whole-prompt steps, PaliGemma's and the sparse-indexer models', tested with their
# own budgets here and in test_llm_sparse_indexer.py)
SWEEP_TYPES = sorted(IMAGE_TYPES - {"llava", "gemma4", "paligemma", "mistral_large4", "qwen4_exp"})
# M-RoPE types (the model's 3-D positions per request); qwen3_vl(_moe) and cosmos3_omni with deepstack features,
# qwen3_5(_moe) with recurrent layers
MROPE_TYPES = ["qwen2_vl", "qwen2_5_vl", "glm4v", "glm4v_moe", "glm46v", "glm_ocr", "glmga", "hunyuan_vl",
               "hyperclovax_vision_v2", "qwen3_vl", "qwen3_vl_moe", "cosmos3_omni", "qwen3_5", "qwen3_5_moe"]


def _image_case(model_type: str):
    """The sweep's image case, with what the engine test needs beyond the sweep: images that move the logits by
    more than the 1e-3 the tests ask (Idefics2's perceiver latents drown its image at random init: scaled down) and
    room for Janus' 583-token prompt (its tiny config says 512 positions; plain RoPE, no table); ShieldGemma 2's
    image tokens marked as its processor marks them (two-way blocks)."""
    try:
        case = sweep_image_case(model_type)
    except NotBuildable as e:
        pytest.skip(str(e))
    model = case.model
    with torch.no_grad():
        if model_type == "idefics2":
            model.model.connector.perceiver_resampler.latents.mul_(0.05)
    if model_type == "shieldgemma2":  # a Gemma 3: its processor marks the image tokens, which then attend both ways
        for batch in (case.inputs, case.other):
            batch["token_type_ids"] = (batch["input_ids"] == model.config.image_token_id).long()
    text = model.config.get_text_config(decoder=True)
    if model_type == "janus":
        text.max_position_embeddings = 1024
    return case


def _case_requests(case) -> tuple[list[dict], list]:
    """The case's four image requests (two prompts, two image sets; pre-processed form) and their oracles."""
    reqs, refs = [], []
    for batch in (case.inputs, case.other):
        for row in range(2):
            ids, tensors = prompt_alone(batch, row)
            refs.append(_oracle(case.model, {"input_ids": torch.tensor([ids]), **tensors}, max_new=MAX_NEW))
            reqs.append({"prompt_token_ids": ids, "multi_modal_data": {"image": tensors}})
    assert refs[0][0] != refs[2][0] or float((refs[0][1][0] - refs[2][1][0]).abs().max()) > 1e-3  # images matter
    return reqs, refs


@pytest.mark.parametrize("model_type", SWEEP_TYPES)
def test_image_types_equal_generate(model_type: str) -> None:
    """Every type LLM takes images for (engine/multimodal.py IMAGE_TYPES) against unpatched generate(), with the
    sweep's hand-built image inputs (pre-processed form), two images, chunk boundaries inside the image blocks."""
    case = _image_case(model_type)
    model = case.model
    reqs, refs = _case_requests(case)
    text = reqs[0]["prompt_token_ids"][:3]  # a text request beside them (M-RoPE: 1-D positions beside 3-D)
    refs.append(_oracle(model, {"input_ids": torch.tensor([text])}))
    llm = LLM(model, max_num_batched_tokens=7, block_size=4, check_invariants=True)
    try:
        outs = llm.generate(reqs + [text], GREEDY, use_tqdm=False)
        for out, ref in zip(outs, refs, strict=True):
            _assert_exact(out, ref)
    finally:
        flashpage.unpatch(model)


@pytest.mark.parametrize("model_type", MROPE_TYPES)
def test_mrope_image_types_split_and_preempted(model_type: str) -> None:
    """M-RoPE (and deepstack) types with every image block split across chunks (3 tokens a step: the 6-token block
    <vision_start> + 4 image tokens + <vision_end> takes two or three steps; deepstack features go to the rows each
    chunk covers; recurrent models: each chunk's own forward carries its image rows) and a pool too small for the
    four requests at once (preempted, recomputed from the kept embeddings, positions and deepstack features), with
    prefix caching asked for (recurrent models turn it off): exact."""
    case = _image_case(model_type)
    model = case.model
    reqs, refs = _case_requests(case)
    llm = LLM(model, max_num_batched_tokens=3, block_size=2, num_blocks=12, max_model_len=24,
              enable_prefix_caching=True, check_invariants=True)
    try:
        outs = llm.generate(reqs, GREEDY, use_tqdm=False)
        assert llm.stats().preemptions > 0
        for out, ref in zip(outs, refs, strict=True):
            _assert_exact(out, ref)
    finally:
        flashpage.unpatch(model)


def _gemma4(shared_kv_layers: int = 0):
    """The zoo's Gemma 4 with its video / audio token ids inside the tiny vocabulary (a checkpoint's are: the
    model's inputs_embeds path looks their embeddings up)."""
    model, processor = tiny_gemma4(shared_kv_layers)
    model.config.audio_token_id = processor.tokenizer.audio_token_id
    model.config.video_token_id = model.config.text_config.vocab_size - 1
    return model, processor


# builder, image placeholder, budget (a little over the image block: the chunk before a block stops at its start),
# pool blocks (too few for every request at once: preemption), max_model_len
TWO_WAY = {"gemma3": (tiny_gemma3, "<start_of_image>", 9, 14, 40),
           "gemma4": (_gemma4, "<|image|>", 66, 34, 96),
           "gemma4-shared-kv": (lambda: _gemma4(2), "<|image|>", 66, 34, 96)}
TWO_WAY_PROMPTS = ["{} what is it", "some words before {} and after it, a longer question", "{}"]


@pytest.fixture(scope="module", params=sorted(TWO_WAY))
def two_way(request):
    build, image, budget, blocks, max_len = TWO_WAY[request.param]
    model, processor = build()
    return model, processor, image, budget, blocks, max_len


@pytest.mark.parametrize("small", [False, True])
def test_two_way_image_blocks_equal_generate(two_way, small) -> None:
    """Gemma 3's image tokens attend both ways (token_type_ids; Gemma 4's on its sliding layers, earlier keys within
    the window): each block is computed in one chunk (small: a budget a little over the block, so the chunk before a
    block stops at its start, and a pool too small for every request: preempted requests recompute), its queries
    attend under the model's mask (flashpage/plan.py two-way spans; the sliding layers' window hides keys the block
    sees), batched with a text request and with each other; the same image and text again hits the prefix cache
    into the block (Gemma 4: a hit ending inside its block, whose rest is computed in one chunk from there)."""
    model, processor, image, budget, blocks, max_len = two_way
    reqs = [_request(processor, p.format(image), tiny_image(60 + i)) for i, p in enumerate(TWO_WAY_PROMPTS)]
    text = "just some text"
    refs = [_oracle(model, inputs, max_new=12) for _, inputs in reqs]
    refs.append(_oracle(model, dict(processor.tokenizer(text, return_tensors="pt")), max_new=12))
    types = "token_type_ids" if "token_type_ids" in reqs[1][1] else "mm_token_type_ids"
    causal = model.generate(**{k: v for k, v in reqs[1][1].items() if k != types}, max_new_tokens=1,
                            do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    assert float((torch.log_softmax(causal.logits[0][0].float(), -1) - refs[1][1][0]).abs().max()) > 1e-3  # 2-way
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    llm = LLM(model, processor, max_num_batched_tokens=budget if small else 2048, block_size=4,
              num_blocks=blocks if small else None, max_model_len=max_len, enable_prefix_caching=True,
              check_invariants=True)
    try:
        outs = llm.generate([r for r, _ in reqs] + [text], params, use_tqdm=False)
        for out, ref in zip(outs, refs, strict=True):
            _assert_exact(out, ref)
        assert llm.stats().preemptions > 0 or not small
        again = llm.generate(reqs[1][0], params, use_tqdm=False)[0]
        _assert_exact(again, refs[1])
        marks = reqs[1][1][types][0].tolist()
        assert again.metrics.cached_prompt_tokens > marks.index(1) + 2  # into (Gemma 3: through) the image block
    finally:
        flashpage.unpatch(model)


def test_two_way_block_longer_than_the_budget_refused_at_add() -> None:
    """A block of tokens attending both ways is computed in one step: a budget smaller than it is refused when the
    request is added, naming the setting, before anything is queued or computed."""
    model, processor = tiny_gemma3()
    llm = LLM(model, processor=processor, max_num_batched_tokens=3)
    try:
        with pytest.raises(ValueError, match="attend both ways.*max_num_batched_tokens=3.*at least 4"):
            llm.add_request({"prompt": "<start_of_image> hi", "multi_modal_data": {"image": tiny_image(0)}})
        assert not llm.has_unfinished_requests() and llm.stats().steps == 0
    finally:
        flashpage.unpatch(model)


def test_text_model_refuses_images() -> None:
    from model_zoo import tiny_model

    model = tiny_model("llama")
    llm = LLM(model)
    try:
        with pytest.raises(ValueError, match="not a vision-language model"):
            llm.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": {}}}, use_tqdm=False)
    finally:
        flashpage.unpatch(model)


def test_gemma4_placeholder_ids_outside_the_vocabulary_refused_at_add() -> None:
    """Gemma 4's forward on inputs_embeds (the engine's image steps) looks its video / audio placeholder ids up in
    the embedding table: a config with them outside it (the zoo's tiny vocabulary) is refused when the image request
    is added, naming the ids, instead of failing inside a step; a text request accepted before still finishes."""
    model, processor = tiny_gemma4()
    assert model.config.video_token_id >= model.get_input_embeddings().num_embeddings
    llm = LLM(model, processor=processor, block_size=4, num_blocks=64, max_model_len=96,
              max_num_batched_tokens=96)
    try:
        llm.add_request([5, 6, 7], GREEDY, request_id="text")
        with pytest.raises(ValueError, match="video_token_id=.*outside its 4112-row embedding table"):
            llm.add_request({"prompt": "<|image|> what is it", "multi_modal_data": {"image": tiny_image(0)}}, GREEDY,
                            request_id="image")
        done = {}
        while llm.has_unfinished_requests():
            done.update({out.request_id: out for out in llm.step() if out.finished})
        assert list(done) == ["text"] and len(done["text"].outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        flashpage.unpatch(model)


def test_weight_change_encodes_unfinished_requests_images_again(llava) -> None:
    """Weights changed in place while an image request is half-way through its prefill: its KV is dropped (as for
    any request) and its image embeddings come from the new weights too, so it equals generate() with them."""
    model, processor = llava
    req, inputs = _request(processor, PROMPTS[3], tiny_image(20))
    projector = model.model.multi_modal_projector.linear_2.weight
    with torch.no_grad():
        old = projector.clone()
        projector.mul_(-1.5)
        ref_new = _oracle(model, inputs)
        projector.copy_(old)
    ref_old = _oracle(model, inputs)
    assert ref_new[0] != ref_old[0] or float((ref_new[1][0] - ref_old[1][0]).abs().max()) > 1e-3
    llm = LLM(model, processor=processor, block_size=4, max_num_batched_tokens=8)
    try:
        llm.add_request(req, GREEDY, request_id="r")
        llm.step()
        llm.step()  # part of the image block computed with the old weights
        with torch.no_grad():
            projector.mul_(-1.5)
        done = None
        while llm.has_unfinished_requests():
            done = next((o for o in llm.step() if o.finished), done)
        _assert_exact(done, ref_new)
    finally:
        flashpage.unpatch(model)
        with torch.no_grad():
            projector.copy_(old)


def test_llm_from_a_path_loads_the_processor(llava, tmp_path) -> None:
    """LLM(path) of a vision-language checkpoint: its image-text-to-text class and its AutoProcessor are loaded,
    and a text prompt with an image equals generate() on the original model."""
    model, processor = llava
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    req, inputs = _request(processor, PROMPTS[0], tiny_image(30))
    ref = _oracle(model, inputs)
    llm = LLM(str(tmp_path), dtype=torch.float32, device="cpu")
    assert type(llm.processor).__name__ == "LlavaProcessor"
    _assert_exact(llm.generate(req, GREEDY, use_tqdm=False)[0], ref)


def test_images_with_prompt_logprobs_and_samples(llava) -> None:
    """Images compose with the rest of the engine: prompt logprobs (every prompt position, image rows included,
    within 1e-4 of the unpatched forward) and n=2 samples (forked from the image prompt: greedy twins equal the
    oracle)."""
    model, processor = llava
    req, inputs = _request(processor, PROMPTS[1], tiny_image(40))
    ref = _oracle(model, inputs, max_new=10)
    with torch.no_grad():
        full = torch.log_softmax(model(**inputs).logits[0].float(), -1)
    ids = inputs["input_ids"][0].tolist()
    llm = LLM(model, processor=processor, block_size=4, max_num_batched_tokens=12)
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, ignore_eos=True, prompt_logprobs=0, n=2)
        out = llm.generate(req, params, use_tqdm=False)[0]
        for comp in out.outputs:
            assert comp.token_ids == ref[0]
        lps = out.prompt_logprobs
        assert lps[0] is None and len(lps) == len(ids)
        diff = max(abs(lps[i].logprob - float(full[i - 1, ids[i]])) for i in range(1, len(ids)))
        assert diff <= ATOL, diff
    finally:
        flashpage.unpatch(model)


def test_two_images_in_one_prompt(llava) -> None:
    """A list of images for one prompt (two placeholders) equals generate() with the processor's tensors for both;
    swapping the images changes the output."""
    model, processor = llava
    text = "<image> then <image> which one?"
    images = [tiny_image(50), tiny_image(51)]
    inputs = dict(processor(text=text, images=images, return_tensors="pt"))
    swapped = dict(processor(text=text, images=images[::-1], return_tensors="pt"))
    ref, ref_swapped = _oracle(model, inputs), _oracle(model, swapped)
    assert ref[0] != ref_swapped[0] or float((ref[1][0] - ref_swapped[1][0]).abs().max()) > 1e-3
    llm = LLM(model, processor=processor, block_size=4, max_num_batched_tokens=9)
    try:
        outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}},
                             {"prompt": text, "multi_modal_data": {"image": images[::-1]}}], GREEDY, use_tqdm=False)
        _assert_exact(outs[0], ref)
        _assert_exact(outs[1], ref_swapped)
    finally:
        flashpage.unpatch(model)


# ------------------------------------------------------------------------ PaliGemma: whole prompts both ways
@pytest.fixture(scope="module")
def paligemma():
    return tiny_paligemma()


def _pg_image(processor, text: str, image) -> tuple[dict, dict]:
    """A PaliGemma image request and its oracle tensors (the processor's ``labels`` left out)."""
    req, inputs = _request(processor, text, image)
    inputs.pop("labels", None)
    return req, inputs


def _assert_top_exact(output, ref: tuple[list[int], list[torch.Tensor]]) -> None:
    """Tokens identical, the chosen and the top-k tokens' logprobs within 1e-4 of the oracle's."""
    _assert_exact(output, ref)
    for i, lp in enumerate(output.outputs[0].logprobs):
        assert lp.top and all(abs(v - float(ref[1][i][t])) <= ATOL for t, v in lp.top.items()), i


def _causal_first_logprobs(model, inputs: dict) -> torch.Tensor:
    """The first generated step's log-softmax of unpatched PaliGemma with its text attention causal (no
    token_type_ids; is_causal True): what the engine would compute without the prompt's two-way span."""
    text_attention = [m for n, m in model.named_modules() if n.startswith("model.language_model.layers.")
                      and n.endswith("self_attn")]
    assert text_attention and not any(m.is_causal for m in text_attention)
    for m in text_attention:
        m.is_causal = True
    try:
        causal = _oracle(model, {k: v for k, v in inputs.items() if k != "token_type_ids"}, max_new=1)
    finally:
        for m in text_attention:
            m.is_causal = False
    return causal[1][0]


PG_TEXT = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36], [40],
           list(range(50, 61))]
PG_PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)


def test_paligemma_text_prompts_batched_equal_generate(paligemma) -> None:
    """Transformers attends to an unpadded PaliGemma prompt both ways (no mask; its text attention says
    is_causal=False): in LLM each prompt is one span computed whole in one step while the other requests' chunks
    split around it (budget 16 for 35 prompt tokens, 4-token blocks), batched with decodes: tokens identical and
    logprobs (top-3 too) within 1e-4 of unpatched generate(), which a causal prefill misses by more."""
    model, _ = paligemma
    refs = [_oracle(model, {"input_ids": torch.tensor([p])}, max_new=8) for p in PG_TEXT]
    causal = _causal_first_logprobs(model, {"input_ids": torch.tensor([PG_TEXT[0]])})
    assert float((causal - refs[0][1][0]).abs().max()) > 10 * ATOL  # the span matters
    llm = LLM(model, block_size=4, max_num_batched_tokens=16, max_model_len=64, check_invariants=True)
    try:
        outs = llm.generate(PG_TEXT, PG_PARAMS, use_tqdm=False)
        for out, ref in zip(outs, refs, strict=True):
            _assert_top_exact(out, ref)
    finally:
        flashpage.unpatch(model)


def test_paligemma_prompt_longer_than_the_budget_refused_at_add(paligemma) -> None:
    """A PaliGemma prompt is computed in one step: one longer than max_num_batched_tokens is refused when it is
    added, naming the setting; the request accepted before it is not lost and still equals generate()."""
    model, _ = paligemma
    ref = _oracle(model, {"input_ids": torch.tensor([PG_TEXT[1]])}, max_new=8)
    llm = LLM(model, block_size=4, max_num_batched_tokens=8, max_model_len=64)
    try:
        llm.add_request(PG_TEXT[1], PG_PARAMS, request_id="kept")
        with pytest.raises(ValueError, match="attend both ways.*max_num_batched_tokens=8.*at least 13"):
            llm.add_request(PG_TEXT[0], PG_PARAMS, request_id="long")
        done = {}
        while llm.has_unfinished_requests():
            done.update({o.request_id: o for o in llm.step() if o.finished})
        assert sorted(done) == ["kept"]
        _assert_top_exact(done["kept"], ref)
    finally:
        flashpage.unpatch(model)


@pytest.mark.parametrize("caching", [False, True])
def test_paligemma_images_with_text_preempted_equal_generate(paligemma, caching) -> None:
    """PaliGemma's image + prompt prefix attends both ways (token_type_ids): the span the engine reads from the
    model's mask is the whole prompt; image requests (a text prompt with an image, and pre-processed pixel values
    without token_type_ids: no mask, both ways again) batched with text requests, in a pool too small for all of
    them (preempted requests recompute their span whole): exact, and the causal prefill is not."""
    model, processor = paligemma
    image_reqs = [_pg_image(processor, text, tiny_image(70 + i)) for i, text in enumerate(["what is it", "cat?"])]
    ids = image_reqs[0][1]["input_ids"][0].tolist()
    plain = {"input_ids": torch.tensor([ids]), "pixel_values": image_reqs[0][1]["pixel_values"],
             "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}  # (its bos is the pad id 0: not padding)
    reqs = [r for r, _ in image_reqs] + [{"prompt_token_ids": ids, "multi_modal_data": {"image": {
        "pixel_values": plain["pixel_values"]}}}] + PG_TEXT[:3]
    refs = [_oracle(model, inputs, max_new=8) for _, inputs in image_reqs] + [_oracle(model, plain, max_new=8)]
    refs += [_oracle(model, {"input_ids": torch.tensor([p])}, max_new=8) for p in PG_TEXT[:3]]
    assert refs[0][0] != refs[1][0] or float((refs[0][1][0] - refs[1][1][0]).abs().max()) > 1e-3  # images matter
    causal = _causal_first_logprobs(model, image_reqs[0][1])
    assert float((causal - refs[0][1][0]).abs().max()) > 10 * ATOL
    llm = LLM(model, processor=processor, block_size=4, num_blocks=16, max_num_batched_tokens=32, max_model_len=48,
              enable_prefix_caching=caching, check_invariants=True)
    try:
        outs = llm.generate(reqs, PG_PARAMS, use_tqdm=False)
        assert llm.stats().preemptions > 0
        for out, ref in zip(outs, refs, strict=True):
            _assert_top_exact(out, ref)
    finally:
        flashpage.unpatch(model)


def test_paligemma_prefix_cache_shares_only_the_identical_prompt(paligemma) -> None:
    """A PaliGemma prompt's K/V depend on all of its tokens (they attend both ways): a prompt sharing its first two
    blocks with an earlier one but differing later shares no page (a causal cache would hand it the earlier
    prompt's K/V) and equals generate(); the identical prompt again hits the cache and equals it too; so does the
    same image and text again."""
    model, processor = paligemma
    first, other = PG_TEXT[4], PG_TEXT[4][:9] + [99, 98]
    image_req, image_inputs = _pg_image(processor, "what is it", tiny_image(80))
    refs = [_oracle(model, {"input_ids": torch.tensor([p])}, max_new=8) for p in (first, other)]
    refs.append(_oracle(model, image_inputs, max_new=8))
    assert float((refs[0][1][0] - refs[1][1][0]).abs().max()) > 10 * ATOL
    llm = LLM(model, processor=processor, block_size=4, max_num_batched_tokens=32, max_model_len=48,
              enable_prefix_caching=True, check_invariants=True)
    try:
        _assert_top_exact(llm.generate(first, PG_PARAMS, use_tqdm=False)[0], refs[0])
        out = llm.generate(other, PG_PARAMS, use_tqdm=False)[0]
        assert out.metrics.cached_prompt_tokens == 0
        _assert_top_exact(out, refs[1])
        again = llm.generate(first, PG_PARAMS, use_tqdm=False)[0]
        assert again.metrics.cached_prompt_tokens >= 8
        _assert_top_exact(again, refs[0])
        for expect_cached in (False, True):
            out = llm.generate(image_req, PG_PARAMS, use_tqdm=False)[0]
            assert (out.metrics.cached_prompt_tokens > 0) == expect_cached
            _assert_top_exact(out, refs[2])
    finally:
        flashpage.unpatch(model)


def _tiny_paligemma2():
    """PaliGemma 2: the zoo's PaliGemma (its processor and vision tower) with a Gemma 2 text model, sliding layers of
    window 5 among full ones. Transformers runs Gemma 2 eager: a text prompt gets its causal masks, while the image +
    prompt prefix (token_type_ids) attends both ways on both layer kinds, the window lifted inside it."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    base, processor = tiny_paligemma()
    old = base.config.text_config
    text = dict(model_type="gemma2", vocab_size=old.vocab_size, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                max_position_embeddings=256, pad_token_id=old.pad_token_id, bos_token_id=old.bos_token_id,
                eos_token_id=old.eos_token_id)
    config = PaliGemmaConfig(text_config=text, vision_config=base.config.vision_config.to_dict(),
                             image_token_index=base.config.image_token_id, projection_dim=64, hidden_size=64)
    torch.manual_seed(0)
    return PaliGemmaForConditionalGeneration(config).eval(), processor


def test_paligemma2_sliding_layers_equal_generate() -> None:
    """PaliGemma 2 (Gemma 2 text, sliding and full layers, eager): its image prompts' spans are read per layer kind
    from the model's two masks (the whole prompt on both), its text prompts attend causally (an eager mask is always
    built); batched, a budget that splits the text prompts' chunks around the image prompts, a pool that preempts:
    exact."""
    model, processor = _tiny_paligemma2()
    image_reqs = [_pg_image(processor, text, tiny_image(90 + i)) for i, text in enumerate(["what is it", "cat?"])]
    refs = [_oracle(model, inputs, max_new=8) for _, inputs in image_reqs]
    refs += [_oracle(model, {"input_ids": torch.tensor([p])}, max_new=8) for p in PG_TEXT[:3]]
    llm = LLM(model, processor=processor, block_size=4, num_blocks=16, max_num_batched_tokens=24, max_model_len=48,
              enable_prefix_caching=True, check_invariants=True)
    try:
        outs = llm.generate([r for r, _ in image_reqs] + PG_TEXT[:3], PG_PARAMS, use_tqdm=False)
        assert llm.stats().preemptions > 0
        for out, ref in zip(outs, refs, strict=True):
            _assert_top_exact(out, ref)
    finally:
        flashpage.unpatch(model)
