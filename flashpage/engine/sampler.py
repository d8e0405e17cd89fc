"""Sampler: picks each sequence's next token from its logits row, following its SamplingParams.

Order: repetition / presence / frequency penalties, ``min_tokens`` suppression of EOS and stop
ids, then greedy argmax (temperature 0) or temperature, top-k, top-p, min-p and a draw. A seeded
sequence draws from its own generator on the logits' device (so it samples the same tokens
whatever it is batched with); unseeded rows are drawn together on the global RNG.
Filtering is batched either way: one ``topk`` for the rows with top-k alone, one sort for the rows
with top-p, one softmax for the rows with min-p; rows that ask for none pay nothing (see
:func:`filter_logits_batched`). Log-probabilities are those of the model's raw logits.

Unseeded draws avoid the two costliest CPU ops of a sampling step (measured on a (64, 4096) batch,
one thread: a full sort ~14-37 ms, ``torch.multinomial`` ~16 ms): a draw is an inverse-CDF lookup (a
two-level cumulative sum, one uniform per row, ~1 ms; see :func:`draw`), and rows with top-p / min-p
but no top-k draw from the whole softmax and keep the draw only if it lies in the row's nucleus
(tested without a sort: the mass of strictly likelier tokens is below top_p, and its probability is
at least min_p x the top one), redrawing rejected rows a few times before the exact sort-based
filter takes the rest. A draw accepted that way has exactly the filtered row's distribution
(rejection sampling); a row's nucleus holds at least top_p of its mass, so a redraw is rare (see
:func:`sample_nucleus`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from flashpage.engine.generation_config import ModelProcessors
from flashpage.engine.outputs import TokenLogprob
from flashpage.engine.params import SamplingParams
from flashpage.engine.sequence import Seq

CANDIDATES_MAX = 1024  # unseeded rows with top_k up to this draw among their top-k candidates
DRAW_BLOCK = 64  # draw(): entries per block of the two-level cumulative sum
NUCLEUS_TRIES = 3  # draws a top-p / min-p row may reject before the sort-based filter decides it


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
            _put(chosen, greedy, _rows(scores, greedy, len(seqs)).argmax(dim=-1).tolist())
        if seeded:
            _put(chosen, seeded, self._sample_seeded(_rows(scores, seeded, len(seqs)), [seqs[i] for i in seeded]))
        if unseeded:
            _put(chosen, unseeded, self._sample_batched(_rows(scores, unseeded, len(seqs)),
                                                        [seqs[i] for i in unseeded]))
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
    def _sample_seeded(scores: torch.Tensor, seqs: Sequence[Seq]) -> list[int]:
        """Seeded rows (K, V): filtered together, then each row draws on its own generator (on the
        rows' device), so a row samples the same token alone or in any batch."""
        probs = torch.softmax(_filtered(scores, seqs), dim=-1)
        out = []
        for row, seq in zip(probs, seqs, strict=True):
            noise = torch.empty_like(row).exponential_(generator=seq.generator(row.device))
            out.append(int((row / noise).argmax()))
        return out

    @staticmethod
    def _sample_batched(scores: torch.Tensor, seqs: Sequence[Seq]) -> list[int]:
        """Unseeded rows (K, V) on the global RNG: rows with a top-k of at most ``CANDIDATES_MAX``
        draw among their top-k candidates (one ``topk`` and one draw over (K', k) instead of
        (K', V): the same distribution); the other rows draw over the vocabulary (:func:`draw`),
        top-p / min-p by rejection (:func:`sample_nucleus`) when none of them has a top-k, else
        filtered together first."""
        params = [s.group.params for s in seqs]
        vocab = scores.shape[1]
        few = [i for i, p in enumerate(params) if 0 < p.top_k < vocab and p.top_k <= CANDIDATES_MAX]
        chosen = [0] * len(seqs)
        if few:
            sub = _tempered(_rows(scores, few, len(seqs)), [params[i] for i in few])
            probs, ids, whole = top_k_candidates(sub, [params[i].top_k for i in few],
                                                 [params[i].top_p for i in few], [params[i].min_p for i in few])
            _put(chosen, few, ids.gather(1, draw(probs).unsqueeze(1)).squeeze(1).tolist())
            rest = [i for i in range(len(seqs)) if i not in set(few)] + [few[j] for j in whole]
        else:
            rest = list(range(len(seqs)))
        if rest:
            rows = _tempered(_rows(scores, rest, len(seqs)), [params[i] for i in rest])
            if not any(0 < params[i].top_k < vocab for i in rest):  # top-p / min-p by rejection: no sort
                _put(chosen, rest, sample_nucleus(rows, [params[i].top_p for i in rest],
                                                  [params[i].min_p for i in rest]))
            else:
                rows = filter_logits_batched(rows, [params[i].top_k for i in rest], [params[i].top_p for i in rest],
                                             [params[i].min_p for i in rest])
                _put(chosen, rest, draw(torch.softmax(rows, dim=-1)).tolist())
        return chosen

    @staticmethod
    def _record_logprobs(raw: torch.Tensor, seqs: Sequence[Seq], chosen: list[int]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        if not rows:
            return
        logp = torch.log_softmax(raw if len(rows) == len(seqs) else raw[rows], dim=-1)
        tokens = torch.tensor([chosen[i] for i in rows], dtype=torch.long, device=logp.device)
        picked = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()  # one host read for every row
        for r, i in enumerate(rows):
            k = seqs[i].group.params.logprobs or 0
            top = {}
            if k:
                vals, ids = logp[r].topk(k)
                top = dict(zip(ids.tolist(), vals.tolist(), strict=True))
            seqs[i].logprobs.append(TokenLogprob(chosen[i], picked[r], top))


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs`` (N, V) (non-negative, rows need not sum to 1), drawn with
    probability proportional to its value: the distribution of ``torch.multinomial(probs, 1)`` at a
    fraction of its CPU cost. One uniform per row (global RNG) is looked up in the row's cumulative
    sum, two-level so that nothing of size (N, V) is made in float64: the cumulative mass of blocks of
    ``DRAW_BLOCK`` entries (float64), then the cumulative sum inside the chosen block. A zero entry
    is never drawn. Returns (N,) int64."""
    n, vocab = probs.shape
    width = -(-vocab // DRAW_BLOCK) * DRAW_BLOCK
    if width != vocab:
        probs = torch.nn.functional.pad(probs, (0, width - vocab))
    blocks = probs.view(n, width // DRAW_BLOCK, DRAW_BLOCK)
    mass = blocks.sum(-1).double()  # (N, nb)
    cum = mass.cumsum(-1)
    if not bool((cum[:, -1] > 0).all()):  # NaN or no mass left (what torch.multinomial refuses too)
        raise RuntimeError("sampler: a row has no token with a positive probability (its logits are all -inf "
                           "or NaN after the filters and processors)")
    u = torch.rand((n, 1), dtype=torch.float64, device=probs.device) * cum[:, -1:]
    block = _last_positive_past_end(torch.searchsorted(cum, u, right=True).squeeze(1), mass)
    rows = torch.arange(n, device=probs.device)
    before = torch.where(block > 0, cum[rows, (block - 1).clamp(min=0)], 0.0)
    inside = blocks[rows, block].double()  # (N, DRAW_BLOCK)
    offset = torch.searchsorted(inside.cumsum(-1), (u.squeeze(1) - before).unsqueeze(1), right=True).squeeze(1)
    return block * DRAW_BLOCK + _last_positive_past_end(offset, inside)


def _last_positive_past_end(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``index`` (N,), except where it points past the end of ``values`` (N, W) (a uniform that rounding
    put at or past the cumulative total): there the last positive entry of that row. No host sync
    (``values`` is small: block masses, or one block)."""
    last = values.shape[1] - 1 - (values.flip(-1) > 0).to(torch.int8).argmax(-1)
    return torch.where(index >= values.shape[1], last, index)


def sample_nucleus(rows: torch.Tensor, top_p: Sequence[float], min_p: Sequence[float],
                   tries: int = NUCLEUS_TRIES) -> list[int]:
    """One token per row of tempered logits ``rows`` (N, V), from the softmax restricted to the
    row's top-p nucleus and min-p survivors (:func:`filter_logits_batched` with no top-k), without
    sorting the vocabulary.

    Each pending row draws from its whole softmax (:func:`draw`) and keeps the token if it survives
    the filters: the probability of tokens strictly likelier than it sums below ``top_p`` (the sort
    keeps a token while the mass before it is below top_p), and its probability is at least
    ``min_p`` x the row's largest (min-p on the renormalised nucleus is the same test). A kept draw
    is distributed as the filtered softmax (rejection sampling). Rows still rejected after ``tries``
    draws (a nucleus of little mass: small top_p or large min_p) are filtered by sorting and drawn
    from: the result has the filtered distribution either way.
    """
    n = rows.shape[0]
    chosen = [0] * n
    ps = torch.tensor(list(top_p), dtype=torch.float32, device=rows.device)
    ms = torch.tensor(list(min_p), dtype=torch.float32, device=rows.device)
    probs = torch.softmax(rows.float(), dim=-1)
    pending = torch.arange(n, device=rows.device)
    sub, sub_p, sub_m = probs, ps, ms
    for _ in range(tries):
        token = draw(sub)
        p_tok = sub.gather(1, token.unsqueeze(1))
        above = (sub * (sub > p_tok)).sum(-1)  # mass of strictly likelier tokens
        keep = ((above < sub_p) | (sub_p >= 1.0)) & (p_tok.squeeze(1) >= sub_m * sub.amax(-1))
        if bool(keep.all()):
            _put(chosen, pending.tolist(), token.tolist())
            return chosen
        _put(chosen, pending[keep].tolist(), token[keep].tolist())
        left = ~keep
        pending, sub, sub_p, sub_m = pending[left], sub[left], sub_p[left], sub_m[left]
    which = pending.tolist()
    filtered = filter_logits_batched(rows[pending], [0] * len(which), [top_p[i] for i in which],
                                     [min_p[i] for i in which])
    _put(chosen, which, draw(torch.softmax(filtered, dim=-1)).tolist())
    return chosen


def _rows(scores: torch.Tensor, which: list[int], total: int) -> torch.Tensor:
    """scores[which] (no copy when ``which`` is every row, in order)."""
    return scores if len(which) == total else scores[which]


def _tempered(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Rows (K, V) divided by their temperatures (not copied when every one is 1.0: x / 1.0 == x)."""
    temps = [p.temperature for p in params]
    if all(t == 1.0 for t in temps):
        return scores
    return scores / torch.tensor(temps, dtype=scores.dtype, device=scores.device)[:, None]


def _filtered(scores: torch.Tensor, seqs: Sequence[Seq]) -> torch.Tensor:
    """Rows (K, V) divided by their temperature, then top-k / top-p / min-p filtered (batched)."""
    params = [s.group.params for s in seqs]
    return filter_logits_batched(_tempered(scores, params), [p.top_k for p in params], [p.top_p for p in params],
                                 [p.min_p for p in params])


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
    """:func:`filter_logits` over (N, V) rows at once, each row with its own top_k / top_p / min_p.

    Batched per filter: top-k rows without top-p share one ``topk`` of their largest k (not a sort
    of the whole vocabulary), top-p rows share one sort, min-p rows one softmax; a row that asks for
    none of them is not touched (nor copied). Row for row the same tokens as :func:`filter_logits`,
    ties included (the k-th largest value is the same whether found by ``topk`` or a sort).
    Returns a new (N, V) tensor (``rows`` itself when no row filters).
    """
    vocab = rows.shape[1]
    k_list = [k if 0 < k < vocab else 0 for k in top_k]
    p_rows = [i for i, p in enumerate(top_p) if p < 1.0]
    p_set = set(p_rows)
    k_rows = [i for i, k in enumerate(k_list) if k and i not in p_set]  # top-k alone: topk, no sort
    m_rows = [i for i, m in enumerate(min_p) if m > 0.0]
    if not (p_rows or k_rows or m_rows):
        return rows
    rows = rows.clone()
    if k_rows:
        _mask_rows(rows, k_rows, lambda sub: _top_k_drop(sub, [k_list[i] for i in k_rows]))
    if p_rows:
        _mask_rows(rows, p_rows, lambda sub: _top_p_drop(sub, [k_list[i] for i in p_rows],
                                                         [top_p[i] for i in p_rows]))
    if m_rows:
        _mask_rows(rows, m_rows, lambda sub: _min_p_drop(sub, [min_p[i] for i in m_rows]))
    return rows


def top_k_candidates(rows: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float],
                     min_p: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The sampling distribution of rows with a top-k, over their top-k candidates only.

    Args:
        rows: (M, V) tempered logits; top_k: M values in [1, V); top_p, min_p: M values (1.0 / 0.0: off).

    Returns:
        probs (M, K) and ids (M, K) int64 with K = max(top_k): row i draws ``ids[i, j]`` with
        probability ``probs[i, j]``, the softmax of :func:`filter_logits_batched`'s row restricted to
        its survivors (which all lie among the top k); and the rows whose k-th value ties with
        tokens beyond the K candidates (kept by the filter, absent here): the caller draws those
        from the whole row.
    """
    neg_inf = float("-inf")
    vals, ids = rows.topk(max(top_k), dim=-1)  # sorted descending
    kth = _kth(vals, list(top_k))
    vals = vals.masked_fill(vals < kth, neg_inf)
    whole = ((rows >= kth).sum(-1) > (vals >= kth).sum(-1)).nonzero().flatten().tolist()
    if any(p < 1.0 for p in top_p):
        ps = torch.tensor(list(top_p), dtype=rows.dtype, device=rows.device)[:, None]
        probs = vals.softmax(-1)
        vals = vals.masked_fill((probs.cumsum(-1) - probs >= ps) & (ps < 1.0), neg_inf)
    if any(m > 0.0 for m in min_p):
        ms = torch.tensor(list(min_p), dtype=rows.dtype, device=rows.device)[:, None]
        probs = vals.softmax(-1)
        vals = vals.masked_fill(probs < ms * probs[:, :1], neg_inf)
    return vals.softmax(-1), ids, whole


def _mask_rows(rows: torch.Tensor, which: list[int], drop_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Set to -inf, in place, the tokens ``drop_of`` drops in rows ``which`` of ``rows`` (N, V);
    ``drop_of`` maps those rows (M, V) to a bool mask (M, V). All rows: no gather, no scatter."""
    if len(which) == rows.shape[0]:
        rows.masked_fill_(drop_of(rows), float("-inf"))
        return
    index = torch.tensor(which, dtype=torch.long, device=rows.device)
    sub = rows.index_select(0, index)
    rows.index_copy_(0, index, sub.masked_fill_(drop_of(sub), float("-inf")))


def _kth(values: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """(M, 1): the ks[i]-th value of each row of ``values`` (M, >= max ks), sorted descending."""
    idx = torch.tensor(ks, dtype=torch.long, device=values.device)[:, None] - 1
    return values.gather(1, idx)


def _top_k_drop(sub: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Tokens below each row's k-th largest logit; sub (M, V), every k in [1, V)."""
    return sub < _kth(sub.topk(max(ks), dim=-1).values, ks)


def _top_p_drop(sub: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Tokens outside each row's top-k (k 0: none) and top-p nucleus; sub (M, V): one sort."""
    sorted_rows, order = sub.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sub, dtype=torch.bool)
    if any(ks):
        ks_t = torch.tensor(ks, dtype=torch.long, device=sub.device)[:, None]
        kth = sorted_rows.gather(1, (ks_t - 1).clamp(min=0))
        kth = torch.where(ks_t > 0, kth, torch.full_like(kth, float("-inf")))
        drop = sub < kth
        sorted_rows = sorted_rows.masked_fill(sorted_rows < kth, float("-inf"))  # still sorted
    probs = sorted_rows.softmax(-1)
    ps_t = torch.tensor(ps, dtype=sub.dtype, device=sub.device)[:, None]
    outside = probs.cumsum(-1) - probs >= ps_t  # keep tokens until the mass reaches top_p
    return drop | torch.zeros_like(outside).scatter(1, order, outside)


def _min_p_drop(sub: torch.Tensor, ms: list[float]) -> torch.Tensor:
    """Tokens below min_p x the row's top probability; sub (M, V)."""
    probs = sub.softmax(-1)
    mins = torch.tensor(ms, dtype=sub.dtype, device=sub.device)[:, None]
    return probs < mins * probs.max(dim=-1, keepdim=True).values
