"""OpenAI-compatible request models, their validation, and the mapping to SamplingParams.

Requests are parsed strictly from JSON (an int field refuses ``true`` and ``"3"``, a float field
refuses ``"0.5"``); unknown fields are ignored, as vLLM does. Every problem becomes an
:class:`APIError` naming the field (``param``), rendered as OpenAI's error body.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flashpage.engine import SamplingParams, StructuredOutputsParams
from flashpage.engine.chat import TEXT_PART_SEPARATOR


@dataclass
class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    message: str
    status: int = 400
    type: str = "invalid_request_error"
    param: str | None = None
    headers: dict[str, str] | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured outputs (flashpage.serve.structured): OpenAI's response_format, vLLM's structured_outputs
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names for structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: str | None = None  # OpenAI's "auto" / "low" / "high": accepted, the processor decides the size


class ImagePart(_Strict):
    """``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (flashpage/serve/media.py)."""

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[ContentPart | ImagePart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (rendered by the template)
    tool_call_id: str | None = None  # a tool result's call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return TEXT_PART_SEPARATOR.join(p.text for p in self.content if isinstance(p, ContentPart))  # as LLM.chat


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True


_TYPE_TAGS = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|literal\[.*\]|.*Part|"
                        r"json-or-python\[.*\])$")


def parse(model: type[_Strict], body: bytes) -> Any:
    """Validate a JSON body into ``model``; raise APIError(400) naming the first bad field."""
    if not body.strip():
        raise APIError("request body is empty: send a JSON object (Content-Type: application/json)")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        if errors[0]["type"] == "json_invalid":
            raise APIError(f"request body is not valid JSON: {errors[0]['msg']}") from None
        # the most specific error: for a union field, the branch that got deepest into the value
        err = max(errors, key=lambda e: len(_field_path(e["loc"])))
        loc = _field_path(err["loc"])
        param = ".".join(loc) or None
        where = f"'{param}'" if param else "request body"
        got = f" (got {_short(err.get('input'))})" if param and err["type"] != "missing" else ""
        raise APIError(f"{where}: {err['msg']}{got}", param=param) from None


_PART_TAGS = frozenset({"text", "image_url"})  # a content part's "type": its tag in pydantic's error locations


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """A pydantic error location without its union-branch tags: ("stop", "list[str]", 0) -> ["stop", "0"],
    ("content", 0, "image_url", "image_url", "url") -> ["content", "0", "image_url", "url"]."""
    kept = [p for p in loc if isinstance(p, int) or not _TYPE_TAGS.match(str(p))]
    return [str(p) for i, p in enumerate(kept)
            if not (i and isinstance(kept[i - 1], int) and p in _PART_TAGS and i + 1 < len(kept))]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_common(req: _Sampling) -> None:
    """Fields OpenAI defines that flashpage cannot honour, and combinations that make no sense."""
    if req.stream_options is not None and not req.stream:
        raise APIError("'stream_options' is only allowed with stream=true", param="stream_options")
    if req.logit_bias:
        raise APIError("'logit_bias' is not supported by flashpage", param="logit_bias")
    if req.include_stop_str_in_output:
        raise APIError("'include_stop_str_in_output' is not supported by flashpage",
                       param="include_stop_str_in_output")


def sampling_params(req: _Sampling, max_tokens: int, logprobs: int | None,
                    renames: dict[str, str] | None = None,
                    structured: StructuredOutputsParams | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams for ``req``; out-of-range values raise APIError naming the request field
    (``renames``: SamplingParams field -> request field, where they differ)."""
    fields = {
        "max_tokens": max_tokens, "min_tokens": req.min_tokens, "n": req.n, "seed": req.seed,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "top_k": 0 if req.top_k is None else req.top_k,
        "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "stop": req.stop, "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "logprobs": logprobs, "skip_special_tokens": req.skip_special_tokens, "structured_outputs": structured,
        "prompt_logprobs": prompt_logprobs,
    }
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        err = engine_error(exc)
        for old, new in (renames or {}).items():
            if err.param == old:
                err.param, err.message = new, err.message.replace(old, new, 1)
        raise err from None


_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")


def engine_error(exc: Exception, prompt_param: str = "prompt") -> APIError:
    """A ValueError/TypeError from flashpage as a 400 naming the request field it concerns."""
    message = str(exc)
    m = _PARAM_IN_MESSAGE.search(message)
    if m:
        param = m.group(1)
        message = message.replace("SamplingParams.", "")
    elif "prompt" in message or "token id" in message:
        param = prompt_param
    else:
        param = None
    return APIError(message, param=param)


def completion_max_tokens(req: CompletionRequest) -> int:
    """The engine's max_tokens: ``max_tokens=0`` with ``echo`` (score the prompt only, as lm-eval does)
    generates one token that the response leaves out (see :func:`echo_only`), as vLLM does."""
    if req.max_tokens == 0:
        if not req.echo:
            raise APIError("'max_tokens' = 0 is only allowed with echo=true (to score the prompt); "
                           "ask for at least 1 token", param="max_tokens")
        return 1
    return 16 if req.max_tokens is None else req.max_tokens


def echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens=0``: the response holds the prompt (and its logprobs) only."""
    return req.echo and req.max_tokens == 0


def completion_logprobs(req: CompletionRequest) -> int | None:
    return req.logprobs


def completion_prompt_logprobs(req: CompletionRequest) -> int | None:
    """With ``echo`` and ``logprobs=k``, the echoed prompt tokens get their logprobs and top-k too (as vLLM)."""
    return req.logprobs if req.echo else None


def chat_logprobs(req: ChatRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("'top_logprobs' needs logprobs=true", param="top_logprobs")
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("'best_of' other than n is not supported by flashpage (it returns every sample)",
                       param="best_of")
    if req.suffix:
        raise APIError("'suffix' is not supported by flashpage", param="suffix")
    if isinstance(req.prompt, list) and not req.prompt:
        raise APIError("'prompt' is empty: give a text, a list of texts or a list of token ids", param="prompt")


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one text, texts, one token-id list, or token-id lists."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]


def check_chat(req: ChatRequest) -> None:
    check_common(req)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise APIError("give 'max_tokens' or 'max_completion_tokens', not both", param="max_completion_tokens")
