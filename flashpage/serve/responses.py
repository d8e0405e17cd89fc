"""OpenAI response bodies from engine outputs: whole responses, stream deltas, logprobs, usage.

The engine reports cumulative outputs; :class:`SampleCursor` turns them into deltas. While a sample
runs, a text tail that may still become a stop string (or is an incomplete UTF-8 character) is held
back, so streamed text never has to be taken back.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from flashpage.engine import CompletionOutput, RequestOutput, TokenLogprob

_REPLACEMENT = "\ufffd"
_MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    text_offset: int  # characters of this sample sent before this delta


@dataclass
class SampleCursor:
    """How much of one sample a client has received."""

    stops: tuple[str, ...] = ()
    tokens: int = 0
    chars: int = 0
    finished: bool = False

    def advance(self, comp: CompletionOutput) -> Delta | None:
        """The part of ``comp`` not sent yet (None when there is nothing new to say)."""
        if self.finished:
            return None
        done = comp.finish_reason is not None
        text = comp.text
        end = len(text) if done else len(text) - _held_back(text, self.stops)
        end = max(end, self.chars)
        new_ids = comp.token_ids[self.tokens:]
        lps = comp.logprobs[self.tokens:] if comp.logprobs is not None else None
        delta = Delta(text[self.chars:end], new_ids, lps, comp.finish_reason, self.chars)
        if not (delta.text or new_ids or done):
            return None
        self.tokens, self.chars, self.finished = len(comp.token_ids), end, done
        return delta


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    n = len(text) - len(text.rstrip(_REPLACEMENT))  # an incomplete character
    longest = max((len(s) for s in stops), default=0)
    body = text[:len(text) - n]
    for k in range(min(longest - 1, len(body)), 0, -1):
        if any(s.startswith(body[-k:]) for s in stops):
            return n + k
    return n


@dataclass
class TokenText:
    """Token id -> its text (cached), for logprobs."""

    tokenizer: Any
    cache: dict[int, str] = field(default_factory=dict)

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else str(token_id)
            self.cache[token_id] = text
        return text


def _lp(value: float) -> float:
    return _MIN_LOGPROB if math.isinf(value) or math.isnan(value) else max(value, _MIN_LOGPROB)


def completion_logprobs(lps: list[TokenLogprob], tok: TokenText, offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs object."""
    tokens = [tok(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in lps],
            "top_logprobs": [{tok(i): _lp(v) for i, v in sorted(lp.top.items(), key=lambda kv: -kv[1])}
                             for lp in lps],
            "text_offset": offsets}


def prompt_logprobs(prompt_ids: list[int], entries: list[TokenLogprob | None], tok: TokenText) -> dict[str, Any]:
    """The echoed prompt's part of a completions logprobs object (``echo`` with ``logprobs``): every
    prompt token, None as the first token's logprob and top_logprobs (nothing predicts it), as vLLM."""
    tokens = [tok(t) for t in prompt_ids]
    offsets, offset = [], 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else _lp(e.logprob) for e in entries],
            "top_logprobs": [None if e is None else {tok(i): _lp(v) for i, v in sorted(e.top.items(),
                                                                                        key=lambda kv: -kv[1])}
                             for e in entries],
            "text_offset": offsets}


def join_logprobs(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions logprobs objects one after the other (the echoed prompt's, then the output's)."""
    if first is None or then is None:
        return then if first is None else first
    return {key: first[key] + then[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def without_output(out: RequestOutput) -> RequestOutput:
    """``out`` with no generated tokens (``echo`` with ``max_tokens=0``: the engine's one token is dropped)."""
    outputs = [dataclasses.replace(c, token_ids=[], text="", logprobs=[] if c.logprobs is not None else None,
                                   finish_reason="length" if c.finish_reason is not None else None)
               for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs)


def chat_logprobs(lps: list[TokenLogprob], tok: TokenText) -> dict[str, Any]:
    """OpenAI's chat logprobs object (``{"content": [...]}``)."""

    def entry(token_id: int, value: float) -> dict[str, Any]:
        text = tok(token_id)
        return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in sorted(lp.top.items(), key=lambda kv: -kv[1])]}
                        for lp in lps]}


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_choice(index: int, comp: CompletionOutput, tok: TokenText, echo: str | None,
                      echo_logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One completions choice; ``echo``: the prompt text before the output, ``echo_logprobs`` its
    logprobs (from :func:`prompt_logprobs`) before the output's."""
    text = (echo or "") + comp.text
    lps = completion_logprobs(comp.logprobs, tok, len(echo or "")) if comp.logprobs is not None else None
    return {"index": index, "text": text, "logprobs": join_logprobs(echo_logprobs, lps),
            "finish_reason": comp.finish_reason, "stop_reason": None}


def chat_choice(index: int, comp: CompletionOutput, tok: TokenText) -> dict[str, Any]:
    lps = chat_logprobs(comp.logprobs, tok) if comp.logprobs is not None else None
    return {"index": index, "message": {"role": "assistant", "content": comp.text}, "logprobs": lps,
            "finish_reason": comp.finish_reason}


def completion_chunk_choice(index: int, delta: Delta, tok: TokenText, prefix: str = "",
                            prefix_logprobs: dict[str, Any] | None = None, echo_len: int = 0) -> dict[str, Any]:
    """One streamed completions choice; ``prefix`` (and ``prefix_logprobs``): the echoed prompt, in the
    sample's first chunk; ``echo_len``: the echoed prompt's length, before every chunk's text offsets."""
    lps = completion_logprobs(delta.logprobs, tok, echo_len + delta.text_offset) \
        if delta.logprobs is not None else None
    return {"index": index, "text": prefix + delta.text, "logprobs": join_logprobs(prefix_logprobs, lps),
            "finish_reason": delta.finish_reason, "stop_reason": None}


def chat_chunk_choice(index: int, delta: Delta, tok: TokenText) -> dict[str, Any]:
    lps = chat_logprobs(delta.logprobs, tok) if delta.logprobs is not None else None
    body: dict[str, Any] = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
    return {"index": index, "delta": body, "logprobs": lps, "finish_reason": delta.finish_reason}
