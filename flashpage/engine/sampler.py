"""Sampler: picks each sequence's next token from its logits row, following its SamplingParams.

Order: repetition / presence / frequency penalties, ``min_tokens`` suppression of EOS and stop
ids, then greedy argmax (temperature 0) or temperature, top-k, top-p, min-p and a draw. A seeded
sequence draws alone from its own generator on the logits' device (so it samples the same tokens
whatever it is batched with); unseeded rows are filtered and drawn together, one multinomial on
the global RNG. Log-probabilities are those of the model's raw logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from flashpage.engine.generation_config import ModelProcessors
from flashpage.engine.outputs import TokenLogprob
from flashpage.engine.sequence import Seq


class Sampler:
    """Stateless apart from the EOS ids of the model.

    Args:
        eos_token_ids: ids that end a sequence unless ``ignore_eos``.
        sync: maps the chosen tokens to the ones to keep, before log-probabilities are recorded
            (tensor parallel: rank 0's tokens on every rank, see ``flashpage.engine.distributed``).
    """

    def __init__(self, eos_token_ids: Sequence[int], sync: Callable[[list[int]], list[int]] | None = None) -> None:
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.sync = sync
        self.processors: ModelProcessors | None = None  # the model's generation_config processors (LLM sets them)

    def __call__(self, logits: torch.Tensor, seqs: Sequence[Seq]) -> list[int]:
        """Choose one token per row.

        Args:
            logits: (N, V) next-token logits, row i for ``seqs[i]``.
            seqs: the N sequences (their params, tokens so far and generators).

        Returns:
            N token ids. Appends a :class:`TokenLogprob` to ``seq.logprobs`` where requested.
        """
        raw = logits.float()
        scores = raw if not self._needs_processing(seqs) else self._process(raw.clone(), seqs)
        chosen = [0] * len(seqs)
        greedy, seeded, unseeded = _split_rows(seqs)
        if greedy:
            _put(chosen, greedy, scores[greedy].argmax(dim=-1).tolist())
        for i in seeded:
            chosen[i] = self._sample_seeded(scores[i], seqs[i])
        if unseeded:
            _put(chosen, unseeded, self._sample_batched(scores[unseeded], [seqs[i] for i in unseeded]))
        if self.sync is not None:
            chosen = self.sync(chosen)
        self._record_logprobs(raw, seqs, chosen)
        return chosen

    def _needs_processing(self, seqs: Sequence[Seq]) -> bool:
        return self.processors is not None or any(s.group.params.has_penalties
                                                  or s.num_output < s.group.params.min_tokens for s in seqs)

    def _process(self, scores: torch.Tensor, seqs: Sequence[Seq]) -> torch.Tensor:
        for i, s in enumerate(seqs):
            p = s.group.params
            if p.has_penalties:
                apply_penalties(scores[i], s.token_ids, s.num_prompt, p.repetition_penalty,
                                p.presence_penalty, p.frequency_penalty)
            if s.num_output < p.min_tokens:
                banned = set(p.stop_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                if banned:
                    scores[i, sorted(t for t in banned if t < scores.shape[1])] = float("-inf")
        if self.processors is not None:
            self.processors.apply(scores, seqs)
        return scores

    @staticmethod
    def _sample_seeded(row: torch.Tensor, seq: Seq) -> int:
        """One row on its own generator (on the row's device): the same draw alone or in any batch."""
        p = seq.group.params
        row = filter_logits(row / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = torch.softmax(row, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=seq.generator(probs.device))
        return int((probs / noise).argmax())

    @staticmethod
    def _sample_batched(scores: torch.Tensor, seqs: Sequence[Seq]) -> list[int]:
        """Unseeded rows (K, V): filtered together, one multinomial on the global RNG."""
        params = [s.group.params for s in seqs]
        temps = torch.tensor([p.temperature for p in params], dtype=scores.dtype, device=scores.device)
        rows = filter_logits_batched(scores / temps[:, None], [p.top_k for p in params],
                                     [p.top_p for p in params], [p.min_p for p in params])
        return torch.multinomial(torch.softmax(rows, dim=-1), 1).squeeze(1).tolist()

    @staticmethod
    def _record_logprobs(raw: torch.Tensor, seqs: Sequence[Seq], chosen: list[int]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        if not rows:
            return
        logp = torch.log_softmax(raw[rows], dim=-1)
        for r, i in enumerate(rows):
            k = seqs[i].group.params.logprobs or 0
            top = {}
            if k:
                vals, ids = logp[r].topk(k)
                top = dict(zip(ids.tolist(), vals.tolist(), strict=True))
            seqs[i].logprobs.append(TokenLogprob(chosen[i], float(logp[r, chosen[i]]), top))


def _split_rows(seqs: Sequence[Seq]) -> tuple[list[int], list[int], list[int]]:
    """Row indices of greedy, seeded-sampling and unseeded-sampling sequences."""
    greedy: list[int] = []
    seeded: list[int] = []
    unseeded: list[int] = []
    for i, s in enumerate(seqs):
        if s.group.params.greedy:
            greedy.append(i)
        else:
            (unseeded if s.seed is None else seeded).append(i)
    return greedy, seeded, unseeded


def _put(chosen: list[int], rows: list[int], tokens: list[int]) -> None:
    for i, t in zip(rows, tokens, strict=True):
        chosen[i] = t


def apply_penalties(row: torch.Tensor, token_ids: list[int], num_prompt: int, repetition: float,
                    presence: float, frequency: float) -> None:
    """Penalise ``row`` (V,) in place: HF repetition penalty over prompt and output, OpenAI-style
    presence and frequency penalties over the output."""
    if repetition != 1.0 and token_ids:
        ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
        ids = ids[ids < row.shape[0]]
        vals = row[ids]
        row[ids] = torch.where(vals > 0, vals / repetition, vals * repetition)
    out = token_ids[num_prompt:]
    if (presence or frequency) and out:
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=row.shape[0])[: row.shape[0]]
        row -= frequency * counts.to(row.dtype) + presence * (counts > 0).to(row.dtype)


def filter_logits(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, the top-p nucleus, and below min-p; row is (V,)."""
    if top_k > 0 and top_k < row.shape[0]:
        kth = row.topk(top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = row.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep tokens until the mass reaches top_p
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return row


def filter_logits_batched(rows: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float],
                          min_p: Sequence[float]) -> torch.Tensor:
    """:func:`filter_logits` over (N, V) rows at once, each row with its own top_k / top_p / min_p."""
    vocab = rows.shape[1]
    dev = rows.device
    neg_inf = float("-inf")
    k_list = [k if 0 < k < vocab else 0 for k in top_k]
    use_k, use_p, use_min = any(k_list), any(p < 1.0 for p in top_p), any(m > 0.0 for m in min_p)
    if use_k or use_p:
        sorted_rows, order = rows.sort(dim=-1, descending=True)
        if use_k:
            ks = torch.tensor(k_list, dtype=torch.long, device=dev)[:, None]
            kth = sorted_rows.gather(1, (ks - 1).clamp(min=0))
            kth = torch.where(ks > 0, kth, torch.full_like(kth, neg_inf))
            rows = rows.masked_fill(rows < kth, neg_inf)
            sorted_rows = sorted_rows.masked_fill(sorted_rows < kth, neg_inf)  # still sorted
        if use_p:
            ps = torch.tensor(list(top_p), dtype=rows.dtype, device=dev)[:, None]
            probs = sorted_rows.softmax(-1)
            drop = (probs.cumsum(-1) - probs >= ps) & (ps < 1.0)  # keep tokens until the mass reaches top_p
            rows = rows.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), neg_inf)
    if use_min:
        mins = torch.tensor(list(min_p), dtype=rows.dtype, device=dev)[:, None]
        probs = rows.softmax(-1)
        rows = rows.masked_fill(probs < mins * probs.max(dim=-1, keepdim=True).values, neg_inf)
    return rows
