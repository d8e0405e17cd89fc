"""Tiny random vision-language models with processors, built offline (no download, no torchvision).

Each builder returns ``(model, processor)``: a float32 model in eval mode with random weights and a processor
made of flashpage's built-in tokenizer (``flashpage.tiny``) plus the model's image tokens and the family's PIL
image processor, sized to a 28x28 image and a handful of image tokens, so tests run in a second on CPU.
:func:`image_inputs` turns prompts and images into the processor's tensors (left padded, as for generate()).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

_VOCAB_PAD = 16  # model vocab: the tokenizer's, rounded up (spare rows are never produced by the processor)


def tiny_image(seed: int, size: tuple[int, int] = (40, 30)) -> Any:
    """A random RGB PIL image (height, width) = ``size``."""
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (*size, 3), dtype=np.uint8))


def _tokenizer(**special: str) -> Any:
    """The built-in tokenizer with ``special`` tokens (name -> text) added as named special tokens, left padding."""
    from transformers import AutoTokenizer

    from flashpage.tiny import tiny_model_path

    tok = AutoTokenizer.from_pretrained(tiny_model_path(), extra_special_tokens=special)
    tok.padding_side = "left"
    return tok


def _vocab(tok: Any) -> int:
    return -(-len(tok) // _VOCAB_PAD) * _VOCAB_PAD


def tiny_gemma3() -> tuple[torch.nn.Module, Any]:
    """Gemma 3 (SigLIP tower, 4 tokens per image, one sliding + one full layer). The multimodal projector is
    initialised non-zero (transformers zero-initialises it: images would change nothing)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = _tokenizer(image_token="<image_soft_token>", boi_token="<start_of_image>", eoi_token="<end_of_image>")
    text = dict(vocab_size=_vocab(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=256, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=7)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
                          eoi_token_index=tok.eoi_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
                                tokenizer=tok, image_seq_length=4)
    return model, processor


def tiny_paligemma() -> tuple[torch.nn.Module, Any]:
    """PaliGemma (SigLIP tower, 16 tokens per image, Gemma decoder): image + prompt prefix attend both ways."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tok = _tokenizer(image_token="<image>")
    text = dict(model_type="gemma", vocab_size=_vocab(tok), hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=7, projection_dim=64)
    config = PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=tok.image_token_id,
                             projection_dim=64, hidden_size=64)
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config).eval()
    image_processor = SiglipImageProcessorPil(size={"height": 28, "width": 28})
    image_processor.image_seq_length = 16
    return model, PaliGemmaProcessor(image_processor=image_processor, tokenizer=tok)


def tiny_gemma4(shared_kv_layers: int = 0) -> tuple[torch.nn.Module, Any]:
    """Gemma 4 with ``use_bidirectional_attention="vision"`` (image tokens attend both ways on sliding layers);
    ``shared_kv_layers`` > 0: four layers, the last ones reading earlier layers' K/V (as Gemma 4 E2B / E4B)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    tok = _tokenizer(image_token="<|image|>", boi_token="<|boi|>", eoi_token="<|eoi|>", audio_token="<|audio|>",
                     boa_token="<|boa|>", eoa_token="<|eoa|>")  # the processor's check wants audio tokens too
    text = dict(vocab_size=_vocab(tok), vocab_size_per_layer_input=_vocab(tok), hidden_size=64,
                intermediate_size=96, num_hidden_layers=4 if shared_kv_layers else 2, num_attention_heads=4,
                num_key_value_heads=2, num_global_key_value_heads=2, head_dim=16, global_head_dim=16,
                hidden_size_per_layer_input=8,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"] * (2 if shared_kv_layers else 1),
                num_kv_shared_layers=shared_kv_layers, max_position_embeddings=256,
                use_bidirectional_attention="vision", pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                  position_embedding_size=64)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                          image_token_id=tok.image_token_id, boi_token_id=tok.boi_token_id,
                          eoi_token_id=tok.eoi_token_id)
    torch.manual_seed(0)
    return Gemma4ForConditionalGeneration(config).eval(), _gemma4_processor(tok)


def _gemma4_processor(tok: Any) -> Any:
    """Gemma4Processor for images only: its audio feature extractor and video processor (which needs torchvision)
    left out (the processor class accepts None for them through this subclass)."""
    from transformers import Gemma4Processor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    class ImageOnlyGemma4Processor(Gemma4Processor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name in ("feature_extractor", "video_processor"):
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    image_processor = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
    return ImageOnlyGemma4Processor(feature_extractor=None, image_processor=image_processor, tokenizer=tok,
                           video_processor=None, image_seq_length=70)


def tiny_llava() -> tuple[torch.nn.Module, Any]:
    """LLaVA (CLIP tower, 17 tokens per image: 16 patches + CLS; Llama decoder): image tokens attend causally."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = _tokenizer(image_token="<image>")
    text = dict(model_type="llama", vocab_size=_vocab(tok), hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=7, projection_dim=32)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tok.image_token_id,
                         vision_feature_layer=-1, vision_feature_select_strategy="full")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=7,
                               vision_feature_select_strategy="full", num_additional_image_tokens=1)
    return model, processor


def tiny_qwen_vl(model_type: str) -> torch.nn.Module:
    """A Qwen-VL family model (qwen2_vl, qwen2_5_vl, qwen3_vl, ...) from the sweep's tiny config, its M-RoPE
    sections fitted to the tiny head size (no processor: building one needs torchvision in transformers 5.25)."""
    from sweep_configs import sweep_config
    from transformers import AutoConfig, AutoModelForImageTextToText

    values = sweep_config(model_type).to_dict()
    values.pop("model_type", None)
    _fit_mrope(values["text_config"], force=True)
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, **values)).eval()


def _fit_mrope(text: dict[str, Any], force: bool = False) -> None:
    """M-RoPE sections fitted to the tiny head size (where the config has them, or always with ``force``)."""
    rope = text.get("rope_parameters") or {}
    if not force and not (isinstance(rope, dict) and "mrope_section" in rope):
        return
    head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    partial = text.get("partial_rotary_factor") or (rope.get("partial_rotary_factor") if isinstance(rope, dict) else 0)
    half = int(head * (partial or 1.0)) // 2
    text["rope_parameters"] = {**(rope if isinstance(rope, dict) and not force else {}), "rope_type": "default",
                               "rope_theta": 10000.0,
                               "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]}


def tiny_vibevoice_asr() -> torch.nn.Module:
    """VibeVoice-ASR: a Qwen2 decoder (sdpa) with convolutional audio tokenizers whose models support no sdpa
    (their own choice stays "eager")."""
    from transformers import VibeVoiceAsrConfig, VibeVoiceAsrForConditionalGeneration

    text = dict(model_type="qwen2", vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    encoder = dict(depths=[1, 1], downsampling_ratios=[2], num_filters=4, hidden_size=8)
    config = VibeVoiceAsrConfig(text_config=text, acoustic_tokenizer_encoder_config=encoder,
                                semantic_tokenizer_encoder_config=encoder, audio_token_id=1000,
                                audio_bos_token_id=1001, audio_eos_token_id=1002)
    torch.manual_seed(0)
    return VibeVoiceAsrForConditionalGeneration(config).eval()


BUILDERS = {"gemma3": tiny_gemma3, "paligemma": tiny_paligemma, "gemma4": tiny_gemma4,
            "gemma4-shared-kv": lambda: tiny_gemma4(shared_kv_layers=2)}


def image_inputs(processor: Any, prompts: list[str], images: list[Any]) -> dict[str, torch.Tensor]:
    """The processor's tensors for one image per prompt (the image token is put in front of prompts that lack
    it), left padded."""
    token = processor.image_token  # the placeholder the processor expands (Gemma 3: its boi token)
    if type(processor).__name__ == "PaliGemmaProcessor":
        texts = prompts
    else:
        texts = [p if token in p else f"{token} {p}" for p in prompts]
    out = processor(text=texts, images=[[im] for im in images], return_tensors="pt", padding=True)
    return dict(out)


# ------------------------------------------------------------------------------- the image sweep's cases
class NotBuildable(Exception):
    """No image prompt can be built for this type here (the reason says why); ``model``: the model, where it
    was built."""

    def __init__(self, reason: str, model: torch.nn.Module | None = None) -> None:
        super().__init__(reason)
        self.model = model


class ImageCase:
    """One type's image prompt for the sweep: the model, a left-padded batch of two prompts with one image each
    (``inputs``), the same prompts with other images (``other``: shows the image matters) and how it was built."""

    def __init__(self, model: torch.nn.Module, inputs: dict[str, Any], other: dict[str, Any], how: str) -> None:
        self.model, self.inputs, self.other, self.how = model, inputs, other, how


SWEEP_PROMPTS = ("Describe this picture", "hi")
_AUDIO_ONLY = ("audio", "speech", "asr", "voxtral", "transcribe", "kyutai", "fun_asr")


def sweep_image_case(model_type: str) -> ImageCase:
    """The sweep's image prompt for ``model_type``: the processor-built zoo models where there is one (gemma3,
    gemma4, paligemma, llava), M-RoPE models' patches and grid built by hand (the Qwen-VL processors need
    torchvision), else the sweep's tiny config with a square image of the vision tower's size and as many image
    tokens as the tower gives (found by asking the model). Raises :class:`NotBuildable` with the reason."""
    if model_type in _PROCESSOR_CASES:
        model, processor = _PROCESSOR_CASES[model_type]()
        pair = [image_inputs(processor, list(SWEEP_PROMPTS), [tiny_image(s), tiny_image(s + 1)]) for s in (0, 2)]
        for inputs in pair:
            inputs.pop("labels", None)
        _no_eos(model, processor.tokenizer.pad_token_id)
        return ImageCase(model, pair[0], pair[1], "processor")
    model = _sweep_vlm_model(model_type)
    config = model.config
    vision = getattr(config, "vision_config", None)
    if vision is None:
        audio = any(k in model_type for k in _AUDIO_ONLY) or hasattr(config, "audio_config")
        raise NotBuildable("no vision_config to build an image from: " + (
            "an audio model" if audio else "its image inputs (raw patches, an encoder-decoder) are not built here"),
            model)
    if getattr(vision, "spatial_merge_size", None) and getattr(vision, "temporal_patch_size", None):
        return _grid_case(model)
    return _square_case(model)


def _sweep_vlm_model(model_type: str) -> torch.nn.Module:
    """The sweep's tiny config of ``model_type`` as its image-text-to-text (else multimodal-LM) class, M-RoPE
    fitted, parameters transformers zero-initialises (projectors, gates) set non-zero so images change the output."""
    from sweep_configs import PAD, sweep_config
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoModelForMultimodalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    values = sweep_config(model_type).to_dict()
    values.pop("model_type", None)
    for key, value in _IMAGE_OVERRIDES.get(model_type, {}).items():
        values[key] = {**values[key], **value} if isinstance(value, dict) else value
    _usable_init(values)
    vision = values.get("vision_config") or {}
    text = values.get("text_config")
    grid = bool(vision.get("spatial_merge_size") and vision.get("temporal_patch_size"))
    if isinstance(text, dict):  # M-RoPE models (their sections default to the full size)
        _fit_mrope(text, force=grid)
        if vision.get("out_hidden_size"):  # the merger's output feeds the (shrunk) text model
            vision["out_hidden_size"] = text.get("hidden_size", vision["out_hidden_size"])
    if grid and vision.get("window_size"):  # Qwen2.5-VL window attention: whole merged patches
        vision["window_size"] = vision.get("patch_size", 14) * vision["spatial_merge_size"] * 2
    config = AutoConfig.for_model(model_type, **values)
    auto = AutoModelForImageTextToText if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES \
        else AutoModelForMultimodalLM
    torch.manual_seed(0)
    model = auto.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and not name.endswith("bias") and not bool(p.any()):
                p.normal_(0.0, 0.5)
            elif p.dim() == 2 and ("lm_head" in name or "embed_tokens" in name):
                p.mul_(4.0)  # wider greedy margins (as the text sweep)
    _no_eos(model, PAD)
    return model


# what the generic image prompt cannot know: smaller images where the tower's default size breaks a tiny model or
# runs slowly (4x4 patches: pixel shuffles / patch merges of 2 divide them), feature layers the 2-layer tower has
_SMALL_IMAGE = {"vision_config": {"image_size": 128}}
_IMAGE_OVERRIDES: dict[str, dict[str, Any]] = {
    "idefics3": _SMALL_IMAGE, "smolvlm": _SMALL_IMAGE,
    "mistral3": {"vision_config": {"image_size": 64}}, "mistral_large4": {"vision_config": {"image_size": 64}},
    "lighton_ocr": {"vision_config": {"image_size": 64}},
    "vipllava": {"vision_feature_layers": [-2, -1]},
    "shieldgemma2": {"mm_tokens_per_image": 4},
    "llama4": {"vision_config": {"vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 32,
                                 "intermediate_size": 128,  # the pixel shuffle's 4x32 channels
                                 "image_size": 112}},
    "janus": {"vision_config": {"projection_dim": 32}},
    "got_ocr2": {"vision_config": {"image_size": 256}}, "pp_chart2table": {"vision_config": {"image_size": 256}},
}


def _usable_init(values: dict[str, Any]) -> None:
    """Initialiser ranges that give weights, not zeros (GOT-OCR2's SAM tower says 1e-10: images would change
    nothing), in the config and its sub-configs."""
    for value in values.values():
        if isinstance(value, dict):
            _usable_init(value)
    if isinstance(values.get("initializer_range"), float) and values["initializer_range"] < 1e-3:
        values["initializer_range"] = 0.02


def _no_eos(model: torch.nn.Module, pad: int | None) -> None:
    model.generation_config.pad_token_id = pad
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None


def _set_token(config: Any, name: str, value: int) -> None:
    """Set a special-token id on the config and its text config (both are read, depending on the model)."""
    for c in (config, getattr(config, "text_config", None)):
        if c is not None and (hasattr(c, name) or c is config):
            setattr(c, name, value)


def _image_token_name(config: Any) -> str | None:
    """The config's image-token attribute (set where it is None: BLIP-2's query tokens); None: the model takes
    images without placeholders (a prefix, cross-attention)."""
    for name in ("image_token_id", "image_token_index", "image_token"):
        if isinstance(getattr(config, name, None), int):
            return name
    for name in ("image_token_id", "image_token_index"):
        if name in config.to_dict():
            setattr(config, name, 1 << 30)  # moved inside the vocab by the caller
            return name
    return None


def _rows(prefix: list[list[int]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids / attention_mask of token lists."""
    from sweep_configs import PAD

    width = width or max(len(r) for r in prefix)
    ids = torch.full((len(prefix), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(prefix):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def _text(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 80, (n,), generator=g).tolist()


def _square_case(model: torch.nn.Module) -> ImageCase:
    """pixel_values (2, C, S, S) at the vision tower's image size; the image-token count per image read from the
    model's own token / feature check (one placeholder first, then as many as it says the image gives)."""
    config, vision = model.config, model.config.vision_config
    name = _image_token_name(config)
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    if name and getattr(config, name) >= vocab:
        _set_token(config, name, vocab - 1)
    token = getattr(config, name) if name else None
    types = "mm_token_type_ids" in inspect.signature(model.forward).parameters and token is not None
    size = getattr(vision, "image_size", None) or getattr(vision, "img_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    if not isinstance(size, int):
        raise NotBuildable("the vision config has no image_size", model)
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    pixels = [torch.randn(2, channels, size, size, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]

    # the pixel layouts models take: (B, C, H, W); with image_sizes (Pixtral / LLaVA-NeXT); (B, images, C, H, W)
    variants = [("", lambda p: {"pixel_values": p}),
                (", image_sizes", lambda p: {"pixel_values": p, "image_sizes": torch.tensor([[size, size]] * 2)}),
                (", 5-d pixels", lambda p: {"pixel_values": p.unsqueeze(1)})]
    if getattr(config, "image_grid_pinpoints", None):  # LLaVA-NeXT: the base image and one tile of its own size
        config.image_grid_pinpoints = [[size, size]]
        variants.insert(0, (", base + 1 tile", lambda p: {"pixel_values": torch.stack([p, p.flip(-1)], 1),
                                                           "image_sizes": torch.tensor([[size, size]] * 2)}))
    reasons = []
    for label, layout in variants:
        def batch(n: int, pixel_values: torch.Tensor, layout: Any = layout) -> dict[str, Any]:
            ids, mask = _rows([_text(0, 3) + [token] * n + _text(1, 4), _text(2, 2) + [token] * n + _text(3, 1)])
            extra = {"mm_token_type_ids": (ids == token).long()} if types else {}
            return dict(input_ids=ids, attention_mask=mask, **layout(pixel_values), **extra)

        before = len(reasons)
        n = _placeholders(model, batch, pixels[0], reasons, first=1 if token is not None else 0)
        if n or (token is None and len(reasons) == before):
            return ImageCase(model, batch(n, pixels[0]), batch(n, pixels[1]),
                             f"hand-built {size}x{size}{label} ({n or 'no'} image tokens)")
    raise NotBuildable(f"no image prompt with a {size}x{size} image: {reasons[0]}", model)


def _placeholders(model: torch.nn.Module, batch: Any, pixels: torch.Tensor, reasons: list[str], first: int = 1) -> int:
    """Image tokens per image with which a forward of ``batch(n, pixels)`` runs (0: none found)."""
    import re

    hidden = int(model.config.get_text_config(decoder=True).hidden_size)
    tries = [first]
    while tries:
        n = tries.pop(0)
        try:
            with torch.no_grad():
                model(**batch(n, pixels))
            return n
        except Exception as exc:  # the placeholder check says how many features the images give (rows or numel)
            found = re.search(r"features:?\s*(\d+)", str(exc)) if first else None
            if not found or n != first:
                if not tries:
                    reasons.append(f"{type(exc).__name__}: {str(exc)[:160]}")
                continue
            total = int(found.group(1))
            tries = [c for c in (total // 2, total // (2 * hidden)) if c and c != first and c <= 4096]
            if not tries:
                reasons.append(f"{type(exc).__name__}: {str(exc)[:160]}")
    return 0


def _grid_case(model: torch.nn.Module) -> ImageCase:
    """M-RoPE (Qwen-VL style) inputs without the processor: flattened patches of a 4x4-patch image and its
    image_grid_thw, the prompt's image block <vision_start> + (16 / merge^2) image tokens + <vision_end>, the
    special ids moved inside the tiny vocab."""
    config, vision = model.config, model.config.vision_config
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    ids = {"image_token_id": vocab - 1, "vision_start_token_id": vocab - 2, "vision_end_token_id": vocab - 3,
           "video_token_id": vocab - 4}
    for key, value in ids.items():
        _set_token(config, key, value)
    merge, temporal = vision.spatial_merge_size, vision.temporal_patch_size
    temporal = temporal[0] if isinstance(temporal, (list, tuple)) else temporal
    patch = getattr(vision, "patch_size", 14)
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3
    side = 2 * merge  # patches per side
    per_image = side * side
    start, end = ids["vision_start_token_id"], ids["vision_end_token_id"]
    takes_types = "mm_token_type_ids" in inspect.signature(model.forward).parameters

    def batch(n: int, pixels: torch.Tensor) -> dict[str, Any]:
        block = [start] + [ids["image_token_id"]] * n + [end]
        input_ids, mask = _rows([_text(0, 3) + block + _text(1, 4), _text(2, 2) + block + _text(3, 1)])
        return dict(input_ids=input_ids, attention_mask=mask, pixel_values=pixels,
                    image_grid_thw=torch.tensor([[1, side, side]] * 2),
                    **({"mm_token_type_ids": (input_ids == ids["image_token_id"]).long()}  # 1: image (M-RoPE index)
                       if takes_types else {}))

    pixels = [torch.randn(2 * per_image, channels * temporal * patch * patch,
                          generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    reasons: list[str] = []
    n = _placeholders(model, batch, pixels[0], reasons, first=per_image // (merge * merge))
    if not n:
        raise NotBuildable(f"no image prompt from {side}x{side} patches: {reasons[0]}", model)
    return ImageCase(model, batch(n, pixels[0]), batch(n, pixels[1]), f"hand-built patches + grid ({n} image tokens)")


_PROCESSOR_CASES = {"gemma3": tiny_gemma3, "gemma4": tiny_gemma4, "paligemma": tiny_paligemma, "llava": tiny_llava}
