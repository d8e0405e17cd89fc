"""Tiny random vision-language models with processors, built offline (no download, no torchvision).

Each builder returns ``(model, processor)``: a float32 model in eval mode with random weights and a processor
made of flashpage's built-in tokenizer (``flashpage.tiny``) plus the model's image tokens and the family's PIL
image processor, sized to a 28x28 image and a handful of image tokens, so tests run in a second on CPU.
:func:`image_inputs` turns prompts and images into the processor's tensors (left padded, as for generate()).
"""

from __future__ import annotations

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
    text = values["text_config"]
    half = (text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]) // 2
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                               "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]}
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, **values)).eval()


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
