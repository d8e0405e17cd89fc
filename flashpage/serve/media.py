"""Images in ``/v1/chat/completions``: OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` content parts.

- ``data:image/...;base64,...`` URLs are decoded with PIL (as ``LLM.chat`` does: the same image object, no
  conversion), ``file://`` URLs are read only under ``--allowed-local-media-path DIR`` (vLLM's flag), and http(s)
  URLs are refused: flashpage serve fetches nothing (send the image inline as a data: URL).
- at most ``--limit-mm-per-prompt`` images per request (default :data:`DEFAULT_IMAGE_LIMIT`), each at most
  ``--max-image-bytes`` bytes once decoded (default :data:`DEFAULT_MAX_IMAGE_BYTES`) and
  :data:`MAX_IMAGE_PIXELS` pixels; every refusal is a 400 naming the flag or the part.
- the conversation is rendered by the processor's chat template (:func:`flashpage.engine.chat.render`, what
  ``LLM.chat`` runs), then the processor runs here, on the front's tokenizer threads (never the event loop, never
  the engine), and the engine gets ``{"prompt_token_ids": ids, "multi_modal_data": {"image": processor
  outputs}}``: the same ids and tensors as ``LLM.chat`` with the same images, so the same text.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from flashpage.serve.protocol import APIError

DEFAULT_IMAGE_LIMIT = 4  # --limit-mm-per-prompt: images per request
DEFAULT_MAX_IMAGE_BYTES = 5 << 20  # --max-image-bytes: one image's bytes (the decoded file)
MAX_IMAGE_PIXELS = 50_000_000  # width x height of one image, at most (checked before its pixels are decoded)


@dataclass(frozen=True)
class MediaOptions:
    """What the server accepts as images (``flashpage serve`` flags)."""

    limit_per_prompt: int = DEFAULT_IMAGE_LIMIT
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    allowed_local_media_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.limit_per_prompt, bool) or not isinstance(self.limit_per_prompt, int) \
                or self.limit_per_prompt < 0:
            raise ValueError(f"--limit-mm-per-prompt: images per request must be >= 0, got {self.limit_per_prompt!r}")
        if isinstance(self.max_image_bytes, bool) or not isinstance(self.max_image_bytes, int) \
                or self.max_image_bytes < 1:
            raise ValueError(f"--max-image-bytes must be >= 1, got {self.max_image_bytes!r}")
        if self.allowed_local_media_path is not None and not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path}: no such directory")


def parse_limit_mm_per_prompt(text: str) -> int:
    """``--limit-mm-per-prompt``: vLLM's JSON (``'{"image": 2}'``), ``image=2``, or a plain ``2``."""
    text = text.strip()
    try:
        if text.startswith("{"):
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError
            pairs = value
        elif "=" in text:
            pairs = dict(p.split("=", 1) for p in text.split(","))
        else:
            pairs = {"image": text}
        unknown = sorted(str(k).strip() for k in pairs if str(k).strip() != "image")
        if unknown:
            raise ValueError(f"only images are taken, not {unknown}")
        limit = int(pairs.get("image", DEFAULT_IMAGE_LIMIT))
    except ValueError as exc:
        why = f" ({exc})" if str(exc) else ""
        raise ValueError(f"--limit-mm-per-prompt {text}: give the images per request, e.g. 4, image=4 or "
                         f"'{{\"image\": 4}}'{why}") from None
    if limit < 0:
        raise ValueError(f"--limit-mm-per-prompt {text}: images per request must be >= 0")
    return limit


# ------------------------------------------------------------------------------------- what the model takes
def images_refused(llm: Any) -> str | None:
    """Why the served model takes no images (None: it does). An engine process's ``RemoteLLM`` carries the answer
    its engine gave; an :class:`~flashpage.LLM` is asked."""
    if hasattr(llm, "images_refused"):
        return llm.images_refused
    refusal = getattr(llm, "_image_refusal", None)
    reason = refusal() if callable(refusal) else "it is not a flashpage.LLM"
    if reason is None and getattr(llm, "processor", None) is None:
        reason = "its checkpoint has no processor (AutoProcessor) to turn images into the model's inputs"
    return reason


def count_images(messages: list[Any]) -> int:
    return sum(1 for m in messages if isinstance(m.content, list) for p in m.content if p.type == "image_url")


def check_images(num_images: int, refused: str | None, model_name: str, options: MediaOptions) -> None:
    """Refusals that need no image read: a model without images, too many images."""
    if num_images and refused is not None:
        raise APIError(f"the model `{model_name}` takes no images: {refused}; send text content only",
                       param="messages")
    if num_images > options.limit_per_prompt:
        raise APIError(f"this request has {num_images} images; this server takes at most {options.limit_per_prompt} "
                       f"per request (flashpage serve --limit-mm-per-prompt {options.limit_per_prompt})",
                       param="messages")


# ------------------------------------------------------------------------------------------------- reading
def load_image(url: str, options: MediaOptions, where: str) -> Any:
    """The PIL image an ``image_url`` names (``where``: the part's path, for messages), or APIError(400)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, options, where)
    elif scheme == "file":
        data = _local_bytes(url, options, where)
    elif scheme in ("http", "https"):
        raise APIError(f"{where}: {scheme} image URLs are not fetched: flashpage serve fetches nothing from the "
                       "network; send the image inline as a data: URL (data:image/png;base64,...), or a file:// URL "
                       "under --allowed-local-media-path", param=where)
    else:
        raise APIError(f"{where}: an image URL must be a data: URL (data:image/png;base64,...) or, with "
                       f"--allowed-local-media-path, a file:// URL; got {url[:40]!r}", param=where)
    return _open(data, where)


def _data_url_bytes(url: str, options: MediaOptions, where: str) -> bytes:
    head, comma, payload = url.partition(",")
    if not comma or ";base64" not in head.lower():
        raise APIError(f"{where}: a data: URL must be base64 encoded: data:image/png;base64,<the file's bytes>",
                       param=where)
    media_type = head[5:].split(";", 1)[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise APIError(f"{where}: the data: URL holds {media_type!r}, not an image (image/png, image/jpeg, ...)",
                       param=where)
    payload = payload.strip()
    if len(payload) // 4 * 3 > options.max_image_bytes + 2:  # before decoding anything
        raise _too_big(where, (len(payload) // 4) * 3, options)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise APIError(f"{where}: the data: URL is not valid base64 ({exc})", param=where) from None
    if len(data) > options.max_image_bytes:
        raise _too_big(where, len(data), options)
    return data


def _local_bytes(url: str, options: MediaOptions, where: str) -> bytes:
    root = options.allowed_local_media_path
    if root is None:
        raise APIError(f"{where}: file:// image URLs are refused: start the server with --allowed-local-media-path "
                       "DIR to let it read images under DIR, or send the image inline as a data: URL", param=where)
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise APIError(f"{where}: a file:// URL names a local path (file:///path/to/image.png), got host "
                       f"{parsed.netloc!r}", param=where)
    path = Path(os.path.realpath(unquote(parsed.path)))
    if not path.is_relative_to(os.path.realpath(root)):
        raise APIError(f"{where}: {path} is not under --allowed-local-media-path {root}", param=where)
    try:
        size = path.stat().st_size
        if size > options.max_image_bytes:
            raise _too_big(where, size, options)
        return path.read_bytes()
    except OSError as exc:
        raise APIError(f"{where}: cannot read {path}: {exc.strerror or exc}", param=where) from None


def _too_big(where: str, size: int, options: MediaOptions) -> APIError:
    return APIError(f"{where}: the image is {size} bytes; this server takes images of at most "
                    f"{options.max_image_bytes} bytes (flashpage serve --max-image-bytes)", param=where)


def _open(data: bytes, where: str) -> Any:
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
    except Exception as exc:
        raise APIError(f"{where}: not an image PIL can read ({type(exc).__name__}: {exc})", param=where) from None
    pixels = image.width * image.height
    if pixels > MAX_IMAGE_PIXELS:
        raise APIError(f"{where}: the image is {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS} "
                       "are taken", param=where)
    try:
        image.load()
    except Exception as exc:
        raise APIError(f"{where}: the image cannot be decoded ({type(exc).__name__}: {exc})", param=where) from None
    return image


# ----------------------------------------------------------------------------------------------- messages
def part_messages(messages: list[Any], base: list[dict[str, Any]], options: MediaOptions) -> list[dict[str, Any]]:
    """``base`` (the template messages of ``messages``) with each list content as parts for ``LLM.chat``'s
    renderer: ``{"type": "text", ...}`` and ``{"type": "image", "image": PIL}`` (image URLs read here)."""
    out = []
    for i, (m, msg) in enumerate(zip(messages, base, strict=True)):
        if isinstance(m.content, list):
            parts: list[Mapping[str, Any]] = []
            for j, p in enumerate(m.content):
                if p.type == "image_url":
                    parts.append({"type": "image",
                                  "image": load_image(p.image_url.url, options, f"messages.{i}.content.{j}.image_url")})
                else:
                    parts.append({"type": "text", "text": p.text})
            msg = {**msg, "content": parts}
        out.append(msg)
    return out


def processed(processor: Any, prompt: Mapping[str, Any]) -> dict[str, Any]:
    """``LLM.chat``'s rendered prompt (text + images) through the processor, as ``LLM`` runs it: the engine's
    ``{"prompt_token_ids": ids, "multi_modal_data": {"image": processor outputs}}``."""
    if "prompt_token_ids" in prompt:  # no image: rendered and tokenized already
        return dict(prompt)
    try:
        out = dict(processor(text=prompt["prompt"], images=prompt["multi_modal_data"]["image"], return_tensors="pt",
                             **dict(prompt.get("mm_processor_kwargs") or {})))
    except Exception as exc:
        raise APIError(f"the model's processor rejected the messages and images: {type(exc).__name__}: {exc}",
                       param="messages") from None
    ids = out.pop("input_ids")
    out.pop("attention_mask", None)
    return {"prompt_token_ids": ids[0].tolist(), "multi_modal_data": {"image": out}}
