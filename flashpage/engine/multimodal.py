"""Images in :class:`flashpage.LLM`: the vision encoder once per request, its embeddings fed to the packed step.

A request with images (``{"prompt": text, "multi_modal_data": {"image": PIL | [PIL, ...]}}``, or
``{"prompt_token_ids": ids, "multi_modal_data": {"image": processor_outputs}}``) is turned into its prompt ids
(image placeholders expanded by the processor) and its image embeddings, once, when it is added:

- :meth:`ImageEncoder.encode` runs the model's own forward up to its language model (vision tower, projector and
  the placeholder merge are the model's code, exactly as in ``generate()``) and captures the ``inputs_embeds`` the
  language model receives; the rows that differ from the plain token embedding (the image rows) are kept with
  their positions (:class:`PromptEmbeds`), for the request's lifetime, so a preempted request recomputes its
  prompt from them;
- a step whose chunks cover such positions runs the model's eager forward on ``inputs_embeds`` (the token
  embedding of the step's ids with those rows put back; ``ModelRunner._embeds_logits``), never the flat or
  compiled step kinds;
- M-RoPE models (Qwen2-VL, Qwen2.5-VL): the 3-D position ids the model computed for the prompt are kept too,
  and every step of such a request runs that way, its positions after the prompt shifted by the request's delta;
- the prefix cache keys of a request's tokens from its first image row on carry a hash of the image inputs
  (:meth:`PromptEmbeds.cache_keys`; every processor output, grid sizes included): equal text with other images
  never shares pages; the text before the first image still does;
- after a weight change the unfinished requests' embeddings are computed again from the kept image inputs.

Exact for the decoders whose language model takes ``inputs_embeds`` as the only image input and attends causally
(:data:`IMAGE_TYPES`, each one tested against unpatched ``generate()`` in tests/engine/test_llm_images.py); the
others are refused by name (:data:`REFUSED`) when a request with images is added, before any forward.
"""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# model types whose images in LLM equal unpatched generate() (tests/engine/test_llm_images.py)
IMAGE_TYPES = frozenset({
    "llava", "llava_next", "llava_next_video", "llava_onevision", "video_llava", "vipllava", "mistral3", "lighton_ocr",
    "aya_vision", "cohere2_vision", "deepseek_vl", "got_ocr2", "pp_chart2table", "idefics3", "smolvlm", "internvl",
    "qianfan_ocr", "ovis2", "qwen2_vl", "qwen2_5_vl"})

_BIDIRECTIONAL = "its image tokens attend both ways (token_type_ids), which the engine's causal chunked prefill " \
                 "cannot do; flashpage.patch(model) with model.generate() is exact for it"
_MROPE = "its M-RoPE image positions are not verified in LLM yet (qwen2_vl and qwen2_5_vl are); " \
         "flashpage.patch(model) with model.generate() is exact for it"
_DEEPSTACK = "its language model takes the image features at several layers (deepstack_visual_embeds), which the " \
             "engine's steps do not carry; flashpage.patch(model) with model.generate() is exact for it"
REFUSED = {"gemma3": _BIDIRECTIONAL, "gemma3n": _BIDIRECTIONAL, "gemma4": _BIDIRECTIONAL,
           "paligemma": _BIDIRECTIONAL, "shieldgemma2": _BIDIRECTIONAL,
           "qwen3_vl": _DEEPSTACK, "qwen3_vl_moe": _DEEPSTACK,
           **{t: _MROPE for t in ("qwen3_5", "qwen3_5_moe", "glm4v", "glm4v_moe", "glm46v", "qwen2_5_omni",
                                  "qwen3_omni_moe", "ernie4_5_vl", "ernie4_5_vl_moe", "paddleocr_vl", "video_llama_3",
                                  "glm_ocr")}}


class _Captured(Exception):
    """Raised by the pre-hook once the language model's inputs are seen (nothing after it runs)."""

    def __init__(self, kw: dict[str, Any]) -> None:
        super().__init__("captured")
        self.kw = kw


@dataclass
class PromptEmbeds:
    """One request's image embeddings: ``rows`` (k, hidden) at prompt ``positions`` (k,), on the model's device,
    ``salt`` (a hash of the image inputs) for prefix-cache keys from ``positions[0]`` on, and the image ``inputs``
    they came from (encoded again when the weights change: LLM._check_weights)."""

    positions: torch.Tensor  # int64, CPU, ascending, not empty
    rows: torch.Tensor
    salt: str
    inputs: dict[str, Any]
    mrope: torch.Tensor | None = None  # M-RoPE (Qwen2-VL): the prompt's (3, L) position ids; None: 1-D positions
    delta: int = 0  # ... and the offset of the positions after the prompt (max position + 1 - L)

    def __post_init__(self) -> None:
        self.first, self.last = int(self.positions[0]), int(self.positions[-1])

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE position ids (3, end - start) of positions [start, end): the prompt's, then ``p + delta``."""
        assert self.mrope is not None
        length = self.mrope.shape[1]
        head = self.mrope[:, start:min(end, length)]
        tail = torch.arange(max(start, length), max(end, length)).add_(self.delta).expand(3, -1)
        return torch.cat([head, tail], 1)

    def overlaps(self, start: int, end: int) -> bool:
        """Whether prompt positions [start, end) hold image rows."""
        return self.first < end and self.last >= start

    def put(self, embeds: torch.Tensor, offset: int, start: int, end: int) -> None:
        """Write the image rows of positions [start, end) into ``embeds`` (T, hidden) from row ``offset`` on."""
        sel = (self.positions >= start) & (self.positions < end)
        if bool(sel.any()):
            idx = (self.positions[sel] - start + offset).to(embeds.device)
            embeds[idx] = self.rows[sel.to(self.rows.device)].to(embeds.dtype)

    def cache_keys(self, token_ids: Sequence[int], start: int) -> list[Any]:
        """Prefix-cache keys of ``token_ids`` (positions ``start``...): ids before the first image row, ``(id,
        salt)`` from it on."""
        first = self.first
        return [t if start + i < first else (t, self.salt) for i, t in enumerate(token_ids)]


def image_refusal(model: Any) -> str | None:
    """Why LLM cannot take images for ``model`` (None: it can)."""
    config = model.config
    mtype = getattr(config, "model_type", "")
    if mtype in REFUSED:
        return REFUSED[mtype]
    if getattr(config, "vision_config", None) is None:
        return "it is not a vision-language model (its config has no vision_config)"
    if mtype not in IMAGE_TYPES:
        return (f"images in LLM are verified exact for model types {sorted(IMAGE_TYPES)} only; flashpage.patch(model) "
                "with model.generate() may still be exact for it (docs/models.md)")
    if _language_model(model) is None:
        return "no language_model submodule to take the merged embeddings from"
    return None


def _language_model(model: Any) -> Any:
    for owner in (getattr(model, "model", None), model):
        for name in ("language_model", "text_model"):  # Idefics3 / SmolVLM: text_model
            lm = getattr(owner, name, None) if owner is not None else None
            if isinstance(lm, torch.nn.Module):
                return lm
    return None


class ImageEncoder:
    """Prompt ids and image embeddings of image requests for one model (see the module docstring)."""

    def __init__(self, model: Any, processor: Any = None) -> None:
        self.model = model
        self.processor = processor
        self.device = next(model.parameters()).device

    def process(self, prompt: str, images: list[Any],
                kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], dict[str, Any]]:
        """The processor on one prompt and its images (``kwargs``: vLLM's ``mm_processor_kwargs``, passed to the
        processor call): (prompt ids, the other tensors)."""
        if self.processor is None:
            raise ValueError("a text prompt with images needs the model's processor: LLM(model, processor=...) (or "
                             "tokenizer=processor; loaded with the model from a path that has one), or pass "
                             "{'prompt_token_ids': ids, 'multi_modal_data': {'image': processor_outputs}}")
        out = dict(self.processor(text=prompt, images=images, return_tensors="pt", **dict(kwargs or {})))
        ids = out.pop("input_ids")
        out.pop("attention_mask", None)
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"the processor gave input_ids of shape {tuple(ids.shape)} for one prompt")
        return ids[0].tolist(), out

    def encode(self, ids: list[int], inputs: Mapping[str, Any]) -> PromptEmbeds:
        """Run the model's forward on ``ids`` and the image tensors ``inputs`` (batch of one) up to its language
        model; keep the rows of the language model's ``inputs_embeds`` that differ from the token embedding."""
        lm = _language_model(self.model)
        kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        for k, v in list(kwargs.items()):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                kwargs[k] = v.to(self.model.dtype)
        input_ids = torch.tensor([ids], device=self.device)

        def grab(_module: Any, args: tuple, kw: dict) -> None:
            raise _Captured(kw)

        inner = getattr(self.model, "model", None)
        saved = getattr(inner, "rope_deltas", _MISSING)  # Qwen-VL keeps the last forward's deltas: left as it was
        handle = lm.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.inference_mode():
                self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False, **kwargs)
        except _Captured as got:
            seen = got.kw
        else:
            raise ValueError(f"{type(self.model).__name__}'s forward never called its language model")
        finally:
            handle.remove()
            if saved is not _MISSING:
                inner.rope_deltas = saved
        extra = sorted(k for k, v in seen.items() if v is not None and k not in _LM_KWARGS)
        if extra or seen.get("inputs_embeds") is None:
            raise ValueError(f"{type(self.model).__name__}'s language model takes image inputs beyond inputs_embeds "
                             f"({', '.join(extra) or 'no inputs_embeds'}), which the engine's steps do not carry")
        embeds = seen["inputs_embeds"][0]
        mrope, delta = _mrope(seen.get("position_ids"), len(ids))
        with torch.inference_mode():
            plain = self.model.get_input_embeddings()(input_ids)[0]
        differ = (embeds != plain).any(-1).nonzero().flatten().cpu()
        if not len(differ):
            raise ValueError("the images changed no prompt embedding: does the prompt hold the model's image "
                             "placeholder tokens?")
        return PromptEmbeds(differ, embeds[differ.to(embeds.device)].clone(), _digest(inputs), dict(inputs),
                            mrope, delta)


_MISSING = object()
# what a language model's forward takes besides image inputs (anything else, e.g. Qwen3-VL's deepstack_visual_embeds,
# is refused)
_LM_KWARGS = frozenset({"input_ids", "inputs_embeds", "position_ids", "attention_mask", "cache", "past_key_values",
                        "use_cache", "cache_position", "return_dict", "output_attentions", "output_hidden_states",
                        "logits_to_keep", "output_router_logits"})


def _mrope(position_ids: Any, length: int) -> tuple[torch.Tensor | None, int]:
    """The (3, L) M-RoPE ids the model computed for the prompt and its delta; (None, 0) for 1-D positions."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 3:
        return None, 0
    rows = position_ids[-3:, 0, :].to("cpu", torch.long)  # (4, 1, L): the text row first, dropped
    if bool((rows == torch.arange(length)).all()):
        return None, 0
    return rows.clone(), int(rows.max()) + 1 - length


def _digest(inputs: Mapping[str, Any]) -> str:
    """A hash of the image tensors (their bytes, shapes and names): the prefix-cache salt."""
    h = hashlib.sha256()
    for k in sorted(inputs):
        v = inputs[k]
        h.update(k.encode())
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(str((tuple(t.shape), t.dtype)).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------- inputs
def split_multimodal(data: Any) -> tuple[list[Any] | None, dict[str, Any] | None]:
    """vLLM's ``multi_modal_data``: ``{"image": PIL | [PIL, ...]}`` -> (images, None); ``{"image": {processor
    outputs}}`` -> (None, tensors). Anything else is refused by name."""
    if not isinstance(data, Mapping):
        raise TypeError(f"multi_modal_data must be a dict like {{'image': image}}, got {type(data).__name__}")
    unknown = set(data) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data takes 'image' only here, got {sorted(map(str, unknown))}")
    image = data["image"]
    if isinstance(image, Mapping):
        return None, dict(image)
    images = list(image) if isinstance(image, (list, tuple)) else [image]
    if not images:
        raise ValueError("multi_modal_data['image'] is an empty list")
    return images, None


def load_image_url(url: str) -> Any:
    """A ``data:image/...;base64,...`` URL as a PIL image; other URLs refused (nothing is fetched)."""
    from PIL import Image

    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError(f"image_url {str(url)[:60]!r}: only data: URLs (data:image/png;base64,...) are taken; "
                         "flashpage fetches nothing: pass the image itself ({'type': 'image', 'image': PIL image})")
    head, _, payload = url.partition(",")
    if ";base64" not in head:
        raise ValueError("image_url data: URL must be base64 encoded (data:image/png;base64,...)")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        image.load()
    except Exception as e:
        raise ValueError(f"image_url data: URL holds no readable image ({e})") from None
    return image


# ------------------------------------------------------------------------------------------- the processor
def split_processor(tokenizer: Any, processor: Any) -> tuple[Any, Any]:
    """``LLM(model, tokenizer=processor)`` or ``LLM(model, processor=processor)``: (its tokenizer, the processor).
    A processor is anything with a ``tokenizer`` and an ``image_processor``."""
    if processor is None and _is_processor(tokenizer):
        processor = tokenizer
    if processor is not None:
        if not _is_processor(processor):
            raise TypeError(f"LLM(processor=...) takes a transformers processor (with a tokenizer and an "
                            f"image_processor), got {type(processor).__name__}")
        if tokenizer is None or tokenizer is processor:
            tokenizer = processor.tokenizer
    return tokenizer, processor


def _is_processor(obj: Any) -> bool:
    return obj is not None and getattr(obj, "tokenizer", None) is not None \
        and getattr(obj, "image_processor", None) is not None


def load_processor(path: str, model: Any) -> Any:
    """The checkpoint's processor (``AutoProcessor``) for a vision-language model loaded from ``path``; None when
    the model takes no images or the checkpoint has none (then text prompts only, or pre-processed inputs)."""
    if getattr(model.config, "vision_config", None) is None:
        return None
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(path)
    except Exception:  # no processor files, or one that cannot be built here (torchvision)
        return None
    return processor if _is_processor(processor) else None
