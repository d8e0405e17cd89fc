"""``LLM.chat``: conversations rendered by the chat template into prompts (vLLM's ``LLM.chat``).

A conversation is a list of ``{"role": ..., "content": ...}`` messages; content is a string or a list of parts:
``{"type": "text", "text": ...}``, ``{"type": "image", "image": PIL}`` (also ``"image_pil"``) or
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (data URLs only: nothing is fetched).

- text only: the tokenizer's chat template (or ``chat_template=``) renders it, text parts of one message joined
  with :data:`TEXT_PART_SEPARATOR` (a newline: vLLM's "string" content format, offline and served; ``flashpage
  serve`` joins them the same way, so a client's parts give the same prompt as here); the rendered text is
  tokenized without adding special tokens (the template writes them), as ``tokenizer.apply_chat_template(...,
  tokenize=True)`` does;
- with images (or when the chat template is the processor's only): the processor's chat template renders every
  message as parts (an image part becomes ``{"type": "image"}``, the placeholder the template writes), and the
  request is ``{"prompt": text, "multi_modal_data": {"image": [images in order]}}`` with the processor told not
  to add special tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flashpage.engine.multimodal import load_image_url

Message = Mapping[str, Any]
# how the text parts of one message become the string a text-only chat template takes (vLLM's choice; transformers'
# templates that take part lists iterate the parts themselves: those get the parts, see render)
TEXT_PART_SEPARATOR = "\n"


def conversations(messages: Sequence[Message] | Sequence[Sequence[Message]]) -> list[list[Message]]:
    """One conversation (a list of messages) or a list of them -> a list of conversations."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"LLM.chat takes a conversation (a list of {{'role', 'content'}} dicts) or a list of them, "
                        f"got {type(messages).__name__}")
    items = list(messages)
    if not items:
        raise ValueError("LLM.chat got no messages")
    if all(isinstance(m, Mapping) for m in items):
        return [items]
    convs = []
    for conv in items:
        if isinstance(conv, (str, bytes, Mapping)) or not isinstance(conv, Sequence) or not conv \
                or not all(isinstance(m, Mapping) for m in conv):
            raise TypeError("LLM.chat: each conversation must be a non-empty list of {'role', 'content'} dicts")
        convs.append(list(conv))
    return convs


def _image_of(part: Mapping[str, Any]) -> Any:
    kind = part.get("type")
    if kind in ("image", "image_pil"):
        image = part.get(kind, part.get("image"))
        if image is None:
            raise ValueError(f"a {kind!r} content part needs the image under {kind!r}")
        return image
    url = part.get("image_url")
    return load_image_url(url.get("url") if isinstance(url, Mapping) else url)


def _parts(content: Any) -> list[Mapping[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, Sequence) and all(isinstance(p, Mapping) for p in content):
        for p in content:
            if p.get("type") not in ("text", "image", "image_pil", "image_url"):
                raise ValueError(f"LLM.chat: content part type {p.get('type')!r} is not taken (text, image, "
                                 "image_pil, image_url)")
        return list(content)
    raise TypeError(f"LLM.chat: a message's content must be a string or a list of parts, got {type(content).__name__}")


def render(conversation: list[Message], tokenizer: Any, processor: Any, *, chat_template: str | None,
           add_generation_prompt: bool, continue_final_message: bool, tools: Any,
           chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """One conversation as an LLM prompt dict (see the module docstring)."""
    images: list[Any] = []
    text_messages, part_messages = [], []
    for m in conversation:
        if "role" not in m:
            raise ValueError(f"LLM.chat: a message needs a 'role', got keys {sorted(map(str, m))}")
        parts = _parts(m.get("content"))
        rendered_parts = []
        for p in parts:
            if p["type"] == "text":
                rendered_parts.append({"type": "text", "text": p.get("text", "")})
            else:
                images.append(_image_of(p))
                rendered_parts.append({"type": "image"})
        joined = TEXT_PART_SEPARATOR.join(p["text"] for p in rendered_parts if p["type"] == "text")
        text_messages.append({**m, "content": m["content"] if isinstance(m.get("content"), str) else joined})
        part_messages.append({**m, "content": rendered_parts})
    kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, tools=tools, **(chat_template_kwargs or {}))
    # a VLM checkpoint may keep its chat template on the processor only: then text-only chats render there too
    on_processor = processor is not None and chat_template is None and not getattr(tokenizer, "chat_template", None)
    if not images and not on_processor:
        if tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer: LLM(model, tokenizer)")
        text = tokenizer.apply_chat_template(text_messages, tokenize=False, **kwargs)
        return {"prompt_token_ids": list(tokenizer(text, add_special_tokens=False)["input_ids"])}
    if processor is None:
        raise ValueError("LLM.chat: image content parts need the model's processor: LLM(model, processor=...)")
    text = processor.apply_chat_template(part_messages, tokenize=False, **kwargs)
    if not images:
        return {"prompt_token_ids": list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])}
    return {"prompt": text, "multi_modal_data": {"image": images},
            "mm_processor_kwargs": {"add_special_tokens": False}}
