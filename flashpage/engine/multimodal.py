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
- M-RoPE models (Qwen2/2.5/3-VL, GLM-4V, ...): the 3-D position ids the model computed for the prompt (its own
  ``get_rope_index``) are kept too, and every step of such a request runs that way, its positions after the prompt
  shifted by the request's delta;
- deepstack models (Qwen3-VL): the visual features the language model adds to its first layers' outputs at the
  visual rows (``visual_pos_masks`` / ``deepstack_visual_embeds``) are kept too (:class:`Deepstack`); a step gives
  the language model those of the rows its chunks cover, at their packed rows (:func:`deepstack_kwargs`);
- two-way image attention (Gemma 3's image blocks, from ``token_type_ids``; Gemma 4's on its sliding layers, whose
  per-layer inputs a step computes from its ids as the model does: :func:`per_layer_kwargs`): the spans of prompt
  tokens that attend both ways are read from the masks the model built for the prompt (:class:`TwoWay`, refused
  unless they rebuild those masks exactly); the scheduler never ends a chunk inside a span (a span longer than
  ``max_num_batched_tokens`` is refused when the request is added) and the step plan carries each chunk's spans to
  the attention, which computes those queries under the model's mask (flashpage/plan.py ``_two_way_rows``);
- PaliGemma attends to its whole prompt both ways (transformers: the image + prompt prefix from ``token_type_ids``;
  an unpadded prompt without them gets no mask, and its text attention says ``is_causal=False``): every request's
  prompt ``[0, L)`` is one two-way span, text-only ones included (:class:`PromptSpans`: no image rows), read from
  the masks the model builds for the prompt, where a skipped mask means the whole prompt (``both_ways``: the models
  ``flashpage.patches.checks.unmasked_bidirectional_prefill`` finds);
- the prefix cache keys of a request's tokens from its first image row on carry a hash of the image inputs
  (:meth:`PromptEmbeds.cache_keys`; every processor output, grid sizes included): equal text with other images
  never shares pages; the text before the first image still does; from a two-way span's first token on they also
  carry a hash of the span's tokens (:meth:`TwoWay.cache_keys`; PaliGemma: only the identical whole prompt shares);
- after a weight change the unfinished requests' embeddings are computed again from the kept image inputs.

Exact for the decoders whose language model takes ``inputs_embeds`` (and deepstack features) as its image inputs
and attends causally or in two-way spans (:data:`IMAGE_TYPES`, each one tested against unpatched ``generate()`` in
tests/engine/test_llm_images.py); the others are refused by name (:data:`REFUSED`) when a request with images is
added, before any forward.
"""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

# model types whose images in LLM equal unpatched generate() (tests/engine/test_llm_images.py)
IMAGE_TYPES = frozenset({
    "llava", "llava_next", "llava_next_video", "llava_onevision", "video_llava", "vipllava", "mistral3", "lighton_ocr",
    "aya_vision", "cohere2_vision", "deepseek_vl", "got_ocr2", "pp_chart2table", "idefics2", "idefics3", "smolvlm",
    "internvl", "qianfan_ocr", "ovis2", "janus", "llama4", "minimax_m3_vl",
    # M-RoPE: the model's own 3-D positions per request
    "qwen2_vl", "qwen2_5_vl", "glm4v", "glm4v_moe", "glm46v", "glm_ocr", "glmga", "hunyuan_vl", "hyperclovax_vision_v2",
    # M-RoPE and deepstack: visual features added after the first decoder layers, at the step's visual rows
    "qwen3_vl", "qwen3_vl_moe", "cosmos3_omni",
    # M-RoPE with recurrent (gated delta net) layers: the engine's per-chunk recurrent forwards (engine/states.py)
    "qwen3_5", "qwen3_5_moe",
    # image tokens attending both ways (Gemma 3's image blocks, Gemma 4's on its sliding layers, PaliGemma's whole
    # prompt): TwoWay spans
    "gemma3", "shieldgemma2", "gemma4", "paligemma",
    # sparse-attention indexers: one sequence per forward, as generate() runs it (engine/solo.py;
    # tests/engine/test_llm_sparse_indexer.py)
    "mistral_large4", "qwen4_exp"})

_BIDIRECTIONAL = "its image tokens attend both ways (token_type_ids) and the engine's two-way spans are verified " \
                 "for gemma3, shieldgemma2, gemma4 and paligemma only; flashpage.patch(model) with " \
                 "model.generate() is exact for it"
_MROPE = "its M-RoPE image positions are not verified in LLM yet (qwen2_vl, qwen3_vl, glm4v and others are); " \
         "flashpage.patch(model) with model.generate() is exact for it"
REFUSED = {"gemma3n": _BIDIRECTIONAL,
           **{t: _MROPE for t in ("qwen2_5_omni", "qwen3_omni_moe", "ernie4_5_vl", "ernie4_5_vl_moe", "paddleocr_vl",
                                  "video_llama_3")}}


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
    deep: Deepstack | None = None  # Qwen3-VL: the features its first decoder layers add at the visual positions
    two_way: TwoWay | None = None  # Gemma 3 / Gemma 4 / PaliGemma: prompt spans whose tokens attend both ways

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
        """Whether prompt positions [start, end) hold image rows (or deepstack rows)."""
        deep = self.deep is not None and self.deep.first < end and self.deep.last >= start
        two_way = self.two_way is not None and any(self.two_way.step_spans(0, start, end).values())
        return deep or two_way or (self.first < end and self.last >= start)

    def put(self, embeds: torch.Tensor, offset: int, start: int, end: int) -> None:
        """Write the image rows of positions [start, end) into ``embeds`` (T, hidden) from row ``offset`` on."""
        sel = (self.positions >= start) & (self.positions < end)
        if bool(sel.any()):
            idx = (self.positions[sel] - start + offset).to(embeds.device)
            embeds[idx] = self.rows[sel.to(self.rows.device)].to(embeds.dtype)

    def cache_keys(self, token_ids: Sequence[int], start: int) -> list[Any]:
        """Prefix-cache keys of ``token_ids`` (positions ``start``...): ids before the first image row, ``(id,
        salt)`` from it on; inside and after a two-way span also the hash of the spans' tokens
        (:meth:`TwoWay.cache_keys`)."""
        first = self.first
        keys = [t if start + i < first else (t, self.salt) for i, t in enumerate(token_ids)]
        return keys if self.two_way is None else self.two_way.cache_keys(keys, start)


@dataclass
class PromptSpans:
    """A text prompt (no images) whose tokens attend both ways: PaliGemma's, whose whole prompt transformers
    attends to both ways. Its ``two_way`` spans reach the scheduler, the step plan and the prefix cache as an image
    request's do (:class:`PromptEmbeds`, whose other inputs it has none of: no rows to put back, 1-D positions)."""

    two_way: TwoWay
    mrope: ClassVar[None] = None
    deep: ClassVar[None] = None

    def overlaps(self, start: int, end: int) -> bool:
        """Whether prompt positions [start, end) hold tokens of a span (computed by the step that carries spans)."""
        return any(self.two_way.step_spans(0, start, end).values())

    def put(self, embeds: torch.Tensor, offset: int, start: int, end: int) -> None:
        """No image rows: the step's token embedding is the prompt's."""

    def cache_keys(self, token_ids: Sequence[int], start: int) -> list[Any]:
        """Prefix-cache keys of ``token_ids`` (positions ``start``...): salted with the spans' hash from the first
        span on (PaliGemma: every key, so only the identical whole prompt shares pages)."""
        return self.two_way.cache_keys(list(token_ids), start)


PromptInputs = PromptEmbeds | PromptSpans  # what a request keeps beyond its ids (engine/sequence.py Group.mm)


@dataclass
class Deepstack:
    """Qwen3-VL's deepstack inputs of one prompt: ``positions`` (k,) of its visual rows (``visual_pos_masks``) and
    ``feats`` (layers, k, hidden): layer ``i``'s output gets ``feats[i]`` added at those rows."""

    positions: torch.Tensor  # int64, CPU, ascending
    feats: torch.Tensor

    def __post_init__(self) -> None:
        self.first, self.last = int(self.positions[0]), int(self.positions[-1])

    def rows(self, start: int, end: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed rows (from ``offset``) of prompt positions [start, end) that are visual, and their features
        (layers, n, hidden)."""
        sel = (self.positions >= start) & (self.positions < end)
        return self.positions[sel] - start + offset, self.feats[:, sel.to(self.feats.device)]


@dataclass
class TwoWay:
    """The prompt spans ``[a, b)`` whose tokens attend to each other both ways (on top of the layer's causal or
    sliding-window attention): to every later key of the span, and to earlier ones at most ``reach`` positions
    back, per layer kind (``"full"``, ``"sliding"``: a
    layer with a sliding window), read from the attention masks the model built for the prompt (Gemma 3's image
    blocks from ``token_type_ids``; Gemma 4's on its sliding layers, earlier keys within the window) and checked
    to rebuild them exactly. ``salt``: a hash of the spans' tokens (prefix-cache keys from the first span on)."""

    spans: dict[str, list[tuple[int, int, int]]]
    salt: str

    def __post_init__(self) -> None:
        every = [sp for kind in self.spans.values() for sp in kind]
        self.first = min(a for a, _, _ in every)
        self.longest = max(b - a for a, b, _ in every)

    def cut(self, start: int, n: int) -> int:
        """The most tokens (<= ``n``) a chunk from ``start`` may take without ending inside a span (whose later
        tokens its earlier ones attend to): it stops before the span, or takes it whole; 0: wait for a bigger
        budget (a chunk that starts inside a span, after a prefix-cache hit)."""
        end = start + n
        for kind in self.spans.values():
            for a, b, _ in kind:
                if a < end < b:
                    end = a if a > start else start
        return end - start

    def cache_keys(self, keys: list[Any], start: int) -> list[Any]:
        """``keys`` of positions ``start``... with those from the first span on paired with ``salt`` (a span's K/V
        depend on its later tokens: PaliGemma's span holds the prompt's text)."""
        return [k if start + i < self.first else (k, self.salt) for i, k in enumerate(keys)]

    def step_spans(self, index: int, start: int, end: int) -> dict[str, list[tuple[int, int, int, int]]]:
        """The spans a chunk of positions [start, end) (sequence ``index`` of the step) computes queries of, as
        ``(index, a, b, reach)`` per kind."""
        return {kind: [(index, a, b, r) for a, b, r in spans if a < end and b > start]
                for kind, spans in self.spans.items()}


def two_way_spans(spans: Sequence[tuple[PromptInputs | None, int, int]]
                  ) -> dict[str, list[tuple[int, int, int, int]]]:
    """A step's two-way spans per layer kind (``(sequence index, a, b, reach)``, what the step plan carries to the
    attention: flashpage/plan.py) from each chunk's (embeds, start, end), in the step's sequence order; empty:
    none."""
    out: dict[str, list[tuple[int, int, int, int]]] = {}
    for i, (mm, start, end) in enumerate(spans):
        if mm is not None and mm.two_way is not None:
            for kind, found in mm.two_way.step_spans(i, start, end).items():
                out.setdefault(kind, []).extend(found)
    return {k: v for k, v in out.items() if v}


def _two_way(mask: Any, ids: Sequence[int], window: int | None, both_ways: bool = False) -> TwoWay | None:
    """The two-way spans of the masks the language model got for the prompt (a (1, 1, L, L) mask, or one per
    layer type: ``{"full_attention": ..., "sliding_attention": ...}``); None when every one is causal. A mask that
    is not the layer's causal (sliding) mask plus blocks attending both ways (wholly, or later keys wholly and
    earlier ones within the sliding window) is refused. ``both_ways``: the model's attention attends to every key
    where it gets no mask (PaliGemma under sdpa, which transformers hands no mask for an unpadded prompt): a layer
    kind given None has the whole prompt as its span."""
    masks = mask if isinstance(mask, Mapping) else {"full_attention": mask, "sliding_attention": mask}
    length = len(ids)
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for name, m in masks.items():
        kind = "sliding" if "sliding" in str(name) else "full"
        if m is None and both_ways and length > 1:
            spans[kind] = [(0, length, length)]
            continue
        if not isinstance(m, torch.Tensor) or m.dim() != 4:  # None / a (1, L) padding mask: built causal inside
            continue
        if m.shape[0] != 1 or tuple(m.shape[-2:]) != (length, length):
            raise ValueError(f"its {name} mask for the prompt has shape {tuple(m.shape)}, not (1, 1, L, L)")
        grid = m[0, 0].cpu()
        grid = grid if grid.dtype == torch.bool else grid > torch.finfo(grid.dtype).min / 2
        blocks = _blocks(grid)
        if not blocks:  # no token sees a later one: the layer's own (causal, sliding, chunked) attention, as before
            continue
        left = window - 1 if kind == "sliding" and window else None
        for reach in [length] + ([left] if left is not None else []):
            found = [(a, b, min(reach, b - a)) for a, b in blocks]
            if torch.equal(_rebuilt(length, left, found), grid):
                spans[kind] = found
                break
        else:
            raise ValueError(f"its {name} attention mask for this prompt is not causal attention plus blocks of "
                             "tokens attending both ways, which is all the engine's steps can run")
    if not spans:
        return None
    h = hashlib.sha256(repr(sorted(spans.items())).encode())
    first = min(a for found in spans.values() for a, _, _ in found)
    last = max(b for found in spans.values() for _, b, _ in found)
    h.update(repr(list(ids[first:last])).encode())
    return TwoWay(spans, h.hexdigest())


def _rebuilt(length: int, left: int | None, spans: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """The (L, L) mask of causal attention (within ``left`` earlier keys) plus ``spans`` (a, b, reach): what
    flashpage/plan.py ``_two_way_rows`` computes."""
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    mask = k <= q
    if left is not None:
        mask &= k >= q - left
    for a, b, reach in spans:
        mask |= (q >= a) & (q < b) & (k >= a) & (k < b) & (q - k <= reach)
    return mask


def _blocks(grid: torch.Tensor) -> list[tuple[int, int]]:
    """Runs [a, b) of positions each of which (but the last) sees the next one: the blocks attending both ways."""
    nxt = torch.diagonal(grid, 1).tolist()  # row r sees key r + 1
    found: list[tuple[int, int]] = []
    for r, sees in enumerate(nxt):
        if not sees:
            continue
        if found and found[-1][1] == r + 1:
            found[-1] = (found[-1][0], r + 2)
        else:
            found.append((r, r + 2))
    return found


def deepstack_kwargs(spans: Sequence[tuple[PromptInputs | None, int, int]], total: int,
                     device: torch.device) -> dict[str, Any] | None:
    """A packed step's deepstack inputs for the language model: ``visual_pos_masks`` (1, ``total``) over the step's
    rows and ``deepstack_visual_embeds`` (per layer, the features of those rows in packed order), from each chunk's
    (embeds, start, end) in packing order: a chunk carries only the visual rows it covers. None: no visual row."""
    rows, feats, offset = [], [], 0
    for mm, start, end in spans:
        if mm is not None and mm.deep is not None:
            r, f = mm.deep.rows(start, end, offset)
            if len(r):
                rows.append(r)
                feats.append(f)
        offset += end - start
    if not rows:
        return None
    mask = torch.zeros(1, total, dtype=torch.bool)
    mask[0, torch.cat(rows)] = True
    stacked = torch.cat(feats, 1).to(device)
    return {"visual_pos_masks": mask.to(device), "deepstack_visual_embeds": list(stacked.unbind(0))}


@contextmanager
def language_model_inputs(model: Any, extra: Mapping[str, Any] | None) -> Iterator[None]:
    """Within the block, the model's language model is called with ``extra`` kwargs in place of its own (its outer
    forward, given ``inputs_embeds`` only, passes None for them)."""
    if not extra:
        yield
        return

    def give(_module: Any, args: tuple, kw: dict) -> tuple[tuple, dict]:
        return args, {**kw, **extra}

    handle = _language_model(model).register_forward_pre_hook(give, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def row_inputs(model: Any, chunks: Sequence[Any], ids: torch.Tensor, pos: torch.Tensor) -> tuple[dict[str, Any],
                                                                                         dict[str, Any] | None]:
    """A forward of ``chunks`` as ``[rows, length]`` (recurrent models' steps, engine/states.py; ``ids`` / ``pos``
    (rows, length)): the model's inputs (``input_ids`` and ``position_ids``; where a chunk's request has images,
    ``inputs_embeds`` with its image rows put back and, for M-RoPE, (3, rows, length) positions) and the deepstack
    kwargs for its language model (None: none; see :func:`language_model_inputs`)."""
    mms = [getattr(c.seq.group, "mm", None) for c in chunks]
    if all(mm is None for mm in mms):
        return {"input_ids": ids, "position_ids": pos}, None
    embeds = model.get_input_embeddings()(ids)
    length = ids.shape[1]
    for b, (mm, c) in enumerate(zip(mms, chunks, strict=True)):
        if mm is not None:
            mm.put(embeds[b], 0, c.start, c.start + length)
    if any(mm is not None and mm.mrope is not None for mm in mms):
        pos = torch.stack([mm.rope_positions(c.start, c.start + length) if mm is not None and mm.mrope is not None
                           else torch.arange(c.start, c.start + length).expand(3, -1)
                           for mm, c in zip(mms, chunks, strict=True)], 1).to(ids.device)
    rows = [deepstack_kwargs([(mm, c.start, c.start + length)], length, ids.device) for mm, c in zip(mms, chunks,
                                                                                                     strict=True)]
    deep = None
    if any(r is not None for r in rows):
        if len(chunks) > 1:  # never: a chunk with image rows is a prefill chunk, which runs alone
            raise ValueError("deepstack features in a batched recurrent step are not supported")
        deep = rows[0]
    return {"inputs_embeds": embeds, "position_ids": pos}, deep


def per_layer_kwargs(model: Any, input_ids: torch.Tensor, embeds: torch.Tensor) -> dict[str, Any]:
    """Gemma 4's per-layer inputs of a step fed ``inputs_embeds``: its model derives them from the token ids with
    the image placeholders replaced by the pad token (the image rows' embeddings cannot be looked up back), so the
    step computes them the same way, with the model's own placeholder mask and lookup. Empty for other models."""
    if not _per_layer(model):
        return {}
    inner, lm, text = model.model, _language_model(model), model.config.get_text_config(decoder=True)
    masks = inner.get_placeholder_mask(input_ids, embeds)
    placeholder = torch.zeros_like(input_ids, dtype=torch.bool)
    for m in masks if isinstance(masks, tuple) else (masks,):
        if isinstance(m, torch.Tensor):
            placeholder |= (m if m.dim() == input_ids.dim() else m[..., 0]).to(placeholder.device)
    ids = torch.where(placeholder, text.pad_token_id, input_ids)
    return {"per_layer_inputs": lm.get_per_layer_inputs(ids, None)}


def _per_layer(model: Any) -> bool:
    """Whether the model feeds its language model per-layer inputs derived from the token ids (Gemma 4)."""
    text = model.config.get_text_config(decoder=True)
    return bool(getattr(text, "hidden_size_per_layer_input", None)) \
        and hasattr(_language_model(model), "get_per_layer_inputs") \
        and hasattr(getattr(model, "model", None), "get_placeholder_mask")


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
    return _placeholder_refusal(model)


def _placeholder_refusal(model: Any) -> str | None:
    """Gemma 4's forward, given ``inputs_embeds`` (what the engine's steps with image rows feed it), finds its
    image / video / audio placeholders by looking each placeholder id up in its embedding table: an id outside the
    table (a config whose vocabulary was cut, not a published one) would fail inside the step, so it is refused
    when the request is added."""
    if not _per_layer(model):
        return None
    rows = model.get_input_embeddings().num_embeddings
    outside = {name: getattr(model.config, name) for name in ("image_token_id", "video_token_id", "audio_token_id")
               if isinstance(getattr(model.config, name, None), int) and getattr(model.config, name) >= rows}
    if not outside:
        return None
    ids = ", ".join(f"{k}={v}" for k, v in outside.items())
    return (f"its config's {ids} lie outside its {rows}-row embedding table, and with images its forward on the "
            "engine's inputs_embeds looks every placeholder id up in that table; give the config placeholder ids "
            "inside the vocabulary (published checkpoints have them there)")


def both_ways_refusal(model: Any) -> str | None:
    """Why LLM cannot run ``model``, whose attention attends to a prompt it gets no mask for both ways
    (``flashpage.patches.checks.unmasked_bidirectional_prefill``), exactly; None: it can (its prompts' spans are read
    from the masks its outer forward hands its language model: :meth:`ImageEncoder.text_spans`)."""
    if _language_model(model) is None:
        return ("its attention says is_causal=False: transformers attends to an unpadded prompt both ways (sdpa "
                "without a mask), and the engine reads such a prompt's span from the masks a vision-language model "
                "hands its language_model submodule, which it has none of")
    return None


def _language_model(model: Any) -> Any:
    for owner in (getattr(model, "model", None), model):
        for name in ("language_model", "text_model"):  # Idefics3 / SmolVLM: text_model
            lm = getattr(owner, name, None) if owner is not None else None
            if isinstance(lm, torch.nn.Module):
                return lm
    return None


class ImageEncoder:
    """Prompt ids and image embeddings of image requests for one model (see the module docstring), and the spans of
    text prompts that attend both ways (PaliGemma: :meth:`text_spans`)."""

    def __init__(self, model: Any, processor: Any = None, budget: int | None = None, both_ways: bool = False) -> None:
        self.model = model
        self.processor = processor
        self.budget = budget  # max_num_batched_tokens: a two-way span must fit one step
        self.both_ways = both_ways  # the model attends to a prompt it gets no mask for both ways (PaliGemma)
        self.device = next(model.parameters()).device

    def process(self, prompt: str, images: list[Any],
                kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], dict[str, Any]]:
        """The processor on one prompt and its images (``kwargs``: vLLM's ``mm_processor_kwargs``, passed to the
        processor call): (prompt ids, the other tensors; not ``labels``, which PaliGemma's processor adds)."""
        if self.processor is None:
            raise ValueError("a text prompt with images needs the model's processor: LLM(model, processor=...) (or "
                             "tokenizer=processor; loaded with the model from a path that has one), or pass "
                             "{'prompt_token_ids': ids, 'multi_modal_data': {'image': processor_outputs}}")
        out = dict(self.processor(text=prompt, images=images, return_tensors="pt", **dict(kwargs or {})))
        ids = out.pop("input_ids")
        out.pop("attention_mask", None)
        out.pop("labels", None)
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"the processor gave input_ids of shape {tuple(ids.shape)} for one prompt")
        return ids[0].tolist(), out

    def encode(self, ids: list[int], inputs: Mapping[str, Any]) -> PromptEmbeds:
        """Run the model's forward on ``ids`` and the image tensors ``inputs`` (batch of one) up to its language
        model; keep the rows of the language model's ``inputs_embeds`` that differ from the token embedding."""
        kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        for k, v in list(kwargs.items()):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                kwargs[k] = v.to(self.model.dtype)
        input_ids = torch.tensor([ids], device=self.device)
        seen = self._capture(input_ids, kwargs)
        taken = _LM_KWARGS | set(_DEEPSTACK_KW) | ({"per_layer_inputs"} if _per_layer(self.model) else set())
        extra = sorted(k for k, v in seen.items() if v is not None and k not in taken)
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
                            mrope, delta, _deepstack(seen), self._spans(seen.get("attention_mask"), ids))

    def text_spans(self, ids: list[int]) -> PromptSpans | None:
        """A text prompt's spans attending both ways, from the masks the model builds for it (a skipped one: the
        whole prompt, where ``both_ways``); None: it attends causally."""
        seen = self._capture(torch.tensor([ids], device=self.device), {})
        two_way = self._spans(seen.get("attention_mask"), ids)
        return None if two_way is None else PromptSpans(two_way)

    def _capture(self, input_ids: torch.Tensor, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The kwargs the model's forward on ``input_ids`` (1, L) and ``kwargs`` gives its language model (which
        does not run)."""

        def grab(_module: Any, args: tuple, kw: dict) -> None:
            raise _Captured(kw)

        inner = getattr(self.model, "model", None)
        saved = getattr(inner, "rope_deltas", _MISSING)  # Qwen-VL keeps the last forward's deltas: left as it was
        handle = _language_model(self.model).register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.inference_mode():
                self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False, **kwargs)
        except _Captured as got:
            return got.kw
        else:
            raise ValueError(f"{type(self.model).__name__}'s forward never called its language model")
        finally:
            handle.remove()
            if saved is not _MISSING:
                inner.rope_deltas = saved

    def _spans(self, mask: Any, ids: Sequence[int]) -> TwoWay | None:
        """The prompt's two-way spans from the language model's ``mask`` for it (:func:`_two_way`); one longer than
        a step's budget is refused (it is computed in one step)."""
        text = self.model.config.get_text_config(decoder=True)
        two_way = _two_way(mask, ids, getattr(text, "sliding_window", None), self.both_ways)
        if two_way is not None and self.budget is not None and two_way.longest > self.budget:
            where = ", ".join(f"[{a}, {b})" for a, b in sorted({sp[:2] for f in two_way.spans.values() for sp in f}))
            raise ValueError(f"this prompt's tokens at positions {where} attend both ways and are computed "
                             f"in one step, whose budget is max_num_batched_tokens={self.budget}: raise it to at "
                             f"least {two_way.longest} (or use a shorter prompt, fewer image tokens)")
        return two_way


_MISSING = object()
# what a language model's forward takes besides image inputs (anything else, e.g. Qwen3-VL's deepstack_visual_embeds,
# is refused)
_LM_KWARGS = frozenset({"input_ids", "inputs_embeds", "position_ids", "attention_mask", "cache", "past_key_values",
                        "use_cache", "cache_position", "return_dict", "output_attentions", "output_hidden_states",
                        "logits_to_keep", "output_router_logits"})


_DEEPSTACK_KW = ("visual_pos_masks", "deepstack_visual_embeds")


def _deepstack(seen: Mapping[str, Any]) -> Deepstack | None:
    """Qwen3-VL's deepstack inputs as its language model got them for the prompt (batch of one); None: none."""
    mask, feats = seen.get("visual_pos_masks"), seen.get("deepstack_visual_embeds")
    if mask is None or not feats:
        return None
    positions = mask[0].nonzero().flatten().cpu()
    if not len(positions):
        return None
    stacked = torch.stack([f.reshape(len(positions), -1) for f in feats])
    return Deepstack(positions, stacked.clone())


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
