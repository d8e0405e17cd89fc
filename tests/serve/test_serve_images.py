"""Images through ``flashpage serve``: OpenAI chat content parts ``{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}`` for a tiny LLaVA served from its checkpoint directory (model + processor saved
there), in the engine thread and in the engine process (``flashpage serve``'s default; the processor loaded there
by ``build_llm``). The OpenAI client gets the text offline ``LLM.chat`` gives with the same image (greedy); other
images other answers; http URLs, file:// outside ``--allowed-local-media-path``, too many or too large images,
bad base64 and images sent to a text-only model are 400s naming the cause; ``/v1/models`` says which model takes
images (``"capabilities": {"vision": ...}``).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serve_helpers import ENGINES, MODEL, tiny_server
from vlm_zoo import tiny_image, tiny_llava

from flashpage import LLM, SamplingParams
from flashpage.serve import AsyncLLM, ServerThread, build_app
from flashpage.serve.engine_process import EngineProcess, EngineSpec
from flashpage.serve.media import MediaOptions, parse_limit_mm_per_prompt
from flashpage.serve.server import build_llm

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

NAME = "tiny-llava"
ENGINE = {"dtype": "float32", "device": "cpu"}
MAX_TOKENS = 8
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def png_url(image: Any, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def conversation(*urls: str, text: str = " what is it") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "look "}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA checkpoint directory: model, processor, and the chat template on the processor only."""
    path = tmp_path_factory.mktemp("llava")
    model, processor = tiny_llava()
    processor.chat_template = TEMPLATE
    processor.tokenizer.chat_template = None
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """--allowed-local-media-path: a directory with one image."""
    path = tmp_path_factory.mktemp("media")
    tiny_image(5).save(path / "five.png")
    return path


@pytest.fixture(scope="module")
def offline(checkpoint: Path) -> LLM:
    """The same checkpoint in its own LLM (LLM(path) loads the processor too), for reference answers."""
    return LLM(str(checkpoint), **ENGINE)


@pytest.fixture(scope="module", params=ENGINES)
def url(request: pytest.FixtureRequest, checkpoint: Path, media_dir: Path) -> Iterator[str]:
    engine: Any
    if request.param == "process":
        engine = EngineProcess(EngineSpec(str(checkpoint), ENGINE))  # build_llm in the engine process
    else:
        engine = AsyncLLM(build_llm(str(checkpoint), ENGINE))
    media = MediaOptions(limit_per_prompt=2, max_image_bytes=64 << 10, allowed_local_media_path=str(media_dir))
    try:
        with ServerThread(build_app(engine, NAME, media=media)) as server:
            yield server.url
    finally:
        engine.close()


def answer(url: str, messages: list[dict[str, Any]]) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    return out.choices[0].message.content


def refusal(url: str, messages: list[dict[str, Any]], model: str = NAME) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


def test_image_url_equals_offline_chat_and_other_images_answer_otherwise(url: str, offline: LLM,
                                                                         media_dir: Path) -> None:
    """The OpenAI client with a data: URL (PNG, JPEG) or an allowed file:// URL gets offline LLM.chat's text for
    the same image; another image, or two images, their own answers; text-only chat renders on the processor's
    template as LLM.chat does."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    convs = [conversation(png_url(tiny_image(5))), conversation(png_url(tiny_image(6))),
             conversation(png_url(tiny_image(5)), png_url(tiny_image(7))),
             conversation(png_url(tiny_image(8), "JPEG")), [{"role": "user", "content": "hello"}]]
    expected = [o.outputs[0].text for o in offline.chat(convs, params, use_tqdm=False)]
    assert expected[0] != expected[1] and expected[0] != expected[2]
    assert [answer(url, c) for c in convs] == expected
    assert answer(url, conversation((media_dir / "five.png").as_uri())) == expected[0]


def test_models_says_the_model_takes_images(url: str) -> None:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    assert model["id"] == NAME and model["capabilities"] == {"vision": True}


def test_bad_images_are_400s_naming_the_cause(url: str, media_dir: Path, tmp_path: Path) -> None:
    image = png_url(tiny_image(5))
    assert "fetches nothing" in refusal(url, conversation("https://example.com/cat.png"))
    assert "--limit-mm-per-prompt 2" in refusal(url, conversation(image, image, image))
    assert "not valid base64" in refusal(url, conversation("data:image/png;base64,@@not-base64@@"))
    assert "not an image PIL can read" in refusal(url, conversation("data:image/png;base64,"
                                                                    + base64.b64encode(b"hello").decode()))
    big = tiny_image(1, size=(300, 300))
    assert "--max-image-bytes" in refusal(url, conversation(png_url(big)))
    outside = tmp_path / "six.png"
    tiny_image(6).save(outside)
    assert "not under --allowed-local-media-path" in refusal(url, conversation(outside.as_uri()))
    assert "not under --allowed-local-media-path" in refusal(url, conversation(
        (media_dir / ".." / outside.parent.name / "six.png").as_uri()))
    assert "must be a data: URL" in refusal(url, conversation("ftp://example.com/a.png"))
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # nothing broke


@pytest.mark.parametrize("engine", ENGINES)
def test_text_only_model_refuses_images(engine: str) -> None:
    with tiny_server(engine_process=engine == "process") as (server, _):
        message = refusal(server.url, conversation(png_url(tiny_image(5))), MODEL)
        assert "takes no images" in message and "not a vision-language model" in message
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
        assert model["capabilities"] == {"vision": False}


def test_limit_mm_per_prompt_flag() -> None:
    assert parse_limit_mm_per_prompt("3") == parse_limit_mm_per_prompt("image=3") == 3
    assert parse_limit_mm_per_prompt('{"image": 0}') == 0
    for bad in ("video=2", "-1", "many", "[1]"):
        with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
            parse_limit_mm_per_prompt(bad)
