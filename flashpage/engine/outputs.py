"""What the engine hands back: RequestOutput (vLLM's shape), CompletionOutput and StreamOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of the chosen token and of the top candidates at one step.

    Attributes:
        token_id: the chosen token.
        logprob: its log-probability under the model's raw logits (log-softmax).
        top: ``{token_id: logprob}`` of the ``SamplingParams.logprobs`` most likely tokens.
    """

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    """One sample of a request (``SamplingParams.n`` of them).

    Attributes:
        index: sample number, 0..n-1.
        token_ids: generated tokens (EOS / stop token included when it ended the output).
        text: detokenized output, cut before a stop string.
        finish_reason: "stop", "length", "abort", or None while running.
        logprobs: one :class:`TokenLogprob` per generated token when requested, else None.
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestMetrics:
    """Timestamps (``time.perf_counter`` seconds) and counters of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    cached_prompt_tokens: int = 0
    preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """Result of one request. ``token_ids``/``text``/``finish_reason``/``logprobs`` mirror
    ``outputs[0]``; with ``n > 1`` every sample is in ``outputs``.

    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``): one entry per prompt token, None
    for the first (nothing predicts it), else a :class:`TokenLogprob` of that prompt token given the
    tokens before it (``top``: the ``prompt_logprobs`` most likely tokens there). Complete once the
    prompt is computed (from the first output with a generated token on).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs


@dataclass
class StreamOutput:
    """New output of one sample since the previous StreamOutput of that sample.

    Concatenating a sample's ``token_ids`` gives its final ``token_ids``; concatenating ``text``
    gives its final ``text``.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
