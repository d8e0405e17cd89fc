"""LLM.chat (vLLM's): conversations rendered by the chat template, then generated; with image parts through the
processor's template. Each equals generate() of what transformers' apply_chat_template gives."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from vlm_zoo import tiny_image, tiny_llava

import flashpage
from flashpage import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
CONV = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a page?"}]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="module")
def tiny_llm():
    llm = LLM("flashpage-tiny", dtype=torch.float32)
    yield llm


def _ids(out) -> list[int]:
    return out.outputs[0].token_ids


def _template_ids(tokenizer, conv, **kw) -> list[int]:
    enc = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, **kw)
    return list(enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc)


def test_chat_equals_generate_of_the_templated_prompt(tiny_llm) -> None:
    """The built-in tokenizer's own chat template: chat() == generate() of apply_chat_template(tokenize=True)."""
    tok = tiny_llm.tokenizer
    assert tok.chat_template
    ids = _template_ids(tok, CONV)
    out = tiny_llm.chat(CONV, GREEDY, use_tqdm=False)[0]
    ref = tiny_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert _ids(out) == _ids(ref) and len(_ids(out)) == 6


def test_chat_many_conversations_explicit_template_and_text_parts(tiny_llm) -> None:
    """A list of conversations (outputs in order), an explicit chat_template=, content given as text parts (joined
    with newlines, vLLM's string format), and add_generation_prompt=False."""
    tok = tiny_llm.tokenizer
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    joined = [{"role": "user", "content": "one\ntwo"}]
    convs = [CONV, parts]
    outs = tiny_llm.chat(convs, GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    for out, conv in zip(outs, [CONV, joined], strict=True):
        ids = _template_ids(tok, conv, chat_template=TEMPLATE)
        assert out.prompt_token_ids == ids
        assert _ids(out) == _ids(tiny_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0])
    plain = tiny_llm.chat(CONV, GREEDY, use_tqdm=False, chat_template=TEMPLATE, add_generation_prompt=False)[0]
    assert plain.prompt_token_ids == list(tok(tok.apply_chat_template(CONV, tokenize=False, chat_template=TEMPLATE),
                                              add_special_tokens=False)["input_ids"])


def test_chat_refuses_bad_input(tiny_llm) -> None:
    with pytest.raises(TypeError):
        tiny_llm.chat("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="role"):
        tiny_llm.chat([{"content": "x"}], use_tqdm=False)
    with pytest.raises(ValueError, match="processor"):
        tiny_llm.chat([{"role": "user", "content": [{"type": "image", "image": tiny_image(0)}]}], use_tqdm=False)


LLAVA_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}{% if p['type'] == 'image' %}"
                  "<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


def _png_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_images_equals_unpatched_generate() -> None:
    """Image parts (a PIL image, or a data: URL of the same PNG) through the processor's chat template equal unpatched
    generate() on processor(text=rendered, images=...); other images give other outputs; http URLs are refused."""
    model, processor = tiny_llava()
    image, other = tiny_image(5), tiny_image(6)

    def conv(img_part):
        return [{"role": "user", "content": [{"type": "text", "text": "look "}, img_part,
                                             {"type": "text", "text": " what is it"}]}]

    rendered = processor.apply_chat_template(conv({"type": "image"}), chat_template=LLAVA_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
    refs = []
    for img in (image, other):
        inputs = processor(text=rendered, images=[img], return_tensors="pt", add_special_tokens=False)
        n = inputs["input_ids"].shape[1]
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        refs.append((out.sequences[0, n:].tolist(), torch.log_softmax(out.logits[0][0], -1)))
    assert refs[0][0] != refs[1][0] or float((refs[0][1] - refs[1][1]).abs().max()) > 1e-3
    processor.chat_template = LLAVA_TEMPLATE  # the template on the processor only, as VLM checkpoints keep it
    processor.tokenizer.chat_template = None
    llm = LLM(model, processor=processor)
    try:
        outs = llm.chat([conv({"type": "image", "image": image}),
                         conv({"type": "image_url", "image_url": {"url": _png_url(image)}}),
                         conv({"type": "image", "image": other})], GREEDY, use_tqdm=False)
        for out, ref in zip(outs, [refs[0], refs[0], refs[1]], strict=True):
            assert _ids(out) == ref[0]
            lp = out.outputs[0].logprobs[0]
            assert abs(lp.logprob - float(ref[1][lp.token_id])) <= 1e-4
        text_only = [{"role": "user", "content": "hello"}]
        out = llm.chat(text_only, GREEDY, use_tqdm=False)[0]  # rendered by the processor's template too
        assert out.prompt_token_ids == list(processor.tokenizer("user: helloassistant:",  # (trim_blocks)
                                                                add_special_tokens=False)["input_ids"])
        with pytest.raises(ValueError, match="only data: URLs"):
            llm.chat(conv({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}),
                     use_tqdm=False, chat_template=LLAVA_TEMPLATE)
    finally:
        flashpage.unpatch(model)


def test_served_text_parts_give_the_prompt_llm_chat_gives(tiny_llm) -> None:
    """``flashpage serve``'s chat path (the request parsed, messages made for the template, rendered and encoded
    on its tokenizer pool) joins a message's text parts as LLM.chat does (engine/chat.py TEXT_PART_SEPARATOR): the
    same prompt ids, which differ from those of the parts run together."""
    import asyncio
    import json

    from flashpage.serve import protocol as P
    from flashpage.serve.structured import template_messages
    from flashpage.serve.tokenize import TokenizerPool

    tok = tiny_llm.tokenizer
    content = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
    req = P.parse(P.ChatRequest, json.dumps({"model": "m", "messages": conv}).encode())
    pool = TokenizerPool(tok, workers=1)
    try:
        served = asyncio.run(pool.chat(template_messages(req.messages), tok.chat_template, True))
    finally:
        pool.close()
    offline = tiny_llm.chat(conv, GREEDY, use_tqdm=False)[0].prompt_token_ids
    assert served == offline
    together = [conv[0], {"role": "user", "content": "onetwo"}]
    assert served != _template_ids(tok, together)
