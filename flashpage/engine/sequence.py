"""Engine state: a Group is one user request; each of its ``n`` samples is a Seq in the KV cache."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from flashpage.engine.detok import Detokenizer
from flashpage.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from flashpage.engine.params import SamplingParams

_seq_ids = itertools.count(1)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Seq:
    """One output stream: prompt + generated tokens, and how many of them are in the cache.

    ``num_computed`` tokens have K/V in the cache; the rest (at least the last sampled token while
    running) are computed by the next steps. When ``num_computed == len(token_ids)`` after a step,
    the step's logits for this sequence yield its next token.
    """

    group: Group
    index: int
    token_ids: list[int]
    generator: torch.Generator | None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    detok: Detokenizer | None = None
    streamed_tokens: int = 0
    final_streamed: bool = False
    in_cache: bool = False

    @property
    def num_prompt(self) -> int:
        return len(self.group.prompt_token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def remaining(self) -> int:
        """Tokens still to compute before this sequence can emit its next token."""
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Group:
    """One request: its prompt, parameters, samples and metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    tokenizer: Any = None
    seqs: list[Seq] = field(default_factory=list)
    streamed: bool = False
    max_total_tokens: int = 0  # model positions cap (prompt + output)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs) and len(self.seqs) == self.params.n

    def new_seq(self, index: int, token_ids: list[int]) -> Seq:
        seq = Seq(self, index, list(token_ids), _generator(self.params.seed, index))
        if self.params.logprobs is not None:
            seq.logprobs = []
        if self.tokenizer is not None and (self.streamed or self.params.stop_strings):
            seq.detok = Detokenizer(self.tokenizer, self.params.stop_strings, self.params.skip_special_tokens)
        self.seqs.append(seq)
        return seq

    def to_output(self) -> RequestOutput:
        outputs = [CompletionOutput(s.index, s.output_ids, _text(self, s), s.finish_reason,
                                    list(s.logprobs) if s.logprobs is not None else None)
                   for s in sorted(self.seqs, key=lambda s: s.index)]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), outputs,
                             self.finished, self.metrics)


def _generator(seed: int | None, index: int) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed * 1_000_003 + index)
    return g


def _text(group: Group, seq: Seq) -> str:
    if seq.detok is not None:
        return seq.detok.text
    if group.tokenizer is None:
        return ""
    return group.tokenizer.decode(seq.output_ids, skip_special_tokens=group.params.skip_special_tokens,
                                  clean_up_tokenization_spaces=False)
