"""SamplingParams: how one request is decoded, validated field by field (vLLM's names)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from flashpage.engine.structured import StructuredOutputsParams, as_structured

MAX_LOGPROBS = 20
GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily (as in vLLM)


@dataclass
class SamplingParams:
    """Decoding parameters of one request.

    Attributes:
        max_tokens: new tokens to generate at most (>= 1).
        min_tokens: EOS and ``stop_token_ids`` are suppressed until this many were generated.
        temperature: 0 (or below 1e-5) is greedy; > 0 samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens; -1 (the default, as in vLLM) or 0: off.
        top_p: keep the smallest set of tokens whose probability reaches top_p (1: off).
        min_p: drop tokens below ``min_p`` x the top token's probability (0: off).
        repetition_penalty: HF-style penalty on tokens of prompt and output (1: off).
        presence_penalty / frequency_penalty: OpenAI-style penalties on output tokens (0: off).
        stop: strings that end the output; the text is cut before the first one.
        stop_token_ids: token ids that end the output (kept in ``token_ids``).
        ignore_eos: keep going after EOS.
        seed: makes this request's samples reproducible whatever else is batched with it; any
            int >= 0 (large ones such as ``time.time_ns()`` included: reduced modulo 2**63).
        logprobs: also return the log-probability of each chosen token and of the top
            ``logprobs`` tokens (log-softmax of the model's raw logits); None: off.
        prompt_logprobs: also return, for every prompt position after the first, the
            log-probability of the prompt's token there and of the top ``prompt_logprobs`` tokens
            (``RequestOutput.prompt_logprobs``, as vLLM); None: off. Computed in the prefill; such a
            request's prompt is computed in full (prefix-cache hits are not used for it).
        truncate_max_tokens: when the prompt plus ``max_tokens`` exceed the model's context
            (``LLM.max_model_len``), generate only what fits (with a warning) instead of raising
            ValueError.
        n: independent samples of the same prompt (the prompt's blocks are shared, not recomputed).
        skip_special_tokens: leave special tokens out of ``text``.
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar
            (a :class:`StructuredOutputsParams` or a dict of its fields; docs/structured-outputs.md).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    truncate_max_tokens: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False)
    _stop_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_ints()
        self._check_floats()
        self._stop = self._check_stop(self.stop)
        self._stop_ids = self._check_stop_ids(self.stop_token_ids)
        self.structured_outputs = as_structured(self.structured_outputs)

    # ------------------------------------------------------------- validation
    def _check_ints(self) -> None:
        _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        _int_at_least("top_k", self.top_k, -1)
        _int_at_least("n", self.n, 1)
        if self.seed is not None:
            _int_at_least("seed", self.seed, 0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int_at_least(name, value, 0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"SamplingParams.{name}={value} must be in [0, {MAX_LOGPROBS}] (or None)")

    def _check_floats(self) -> None:
        _float_in("temperature", self.temperature, 0.0, math.inf, "[0, inf); 0 means greedy")
        _float_in("top_p", self.top_p, 0.0, 1.0, "(0, 1]", open_low=True)
        _float_in("min_p", self.min_p, 0.0, 1.0, "[0, 1]")
        _float_in("repetition_penalty", self.repetition_penalty, 0.0, math.inf, "(0, inf); 1 means off",
                  open_low=True)
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")

    @staticmethod
    def _check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
        if stop is None:
            return ()
        if not isinstance(stop, (str, Iterable)):
            raise ValueError(f"SamplingParams.stop must be a string or a list of strings; got {stop!r}")
        items = (stop,) if isinstance(stop, str) else tuple(stop)
        for s in items:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop must be non-empty strings; got {s!r}")
        return items

    @staticmethod
    def _check_stop_ids(ids: Sequence[int] | None) -> frozenset[int]:
        if ids is None:
            return frozenset()
        if isinstance(ids, str) or not isinstance(ids, Iterable):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids; got {ids!r}")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"SamplingParams.stop_token_ids must be token ids (ints >= 0); got {t!r}")
        return frozenset(ids)

    # ---------------------------------------------------------------- helpers
    @property
    def greedy(self) -> bool:
        # below GREEDY_TEMPERATURE, logits / temperature overflow to inf (and sampling to NaN): argmax instead
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stop_ids

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _int_at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"SamplingParams.{name} must be an int >= {low}; got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"SamplingParams.{name}={value} is out of range: must be >= {low}")


def _float_in(name: str, value: object, low: float, high: float, allowed: str, open_low: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"SamplingParams.{name} must be a number in {allowed}; got {value!r}")
    v = float(value)
    if math.isnan(v):
        raise ValueError(f"SamplingParams.{name} is NaN; it must be a number in {allowed}")
    too_low = v <= low if open_low else v < low
    if too_low or v > high or (math.isinf(v) and math.isinf(high) is False):
        raise ValueError(f"SamplingParams.{name}={value} is out of range: allowed {allowed}")
    if math.isinf(v):
        raise ValueError(f"SamplingParams.{name}={value} must be finite; allowed {allowed}")
