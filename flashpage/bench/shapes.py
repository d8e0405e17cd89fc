"""Real-shape model zoo: published configs of real checkpoints, random weights, offline.

Every bench so far ran toy float32 models; users run real checkpoints in bfloat16. This registry
holds the published ``config.json`` values of a few of them (Qwen3-0.6B, Llama-3.2-1B, Gemma-3-1B
and a Qwen3-30B-A3B-shaped MoE), so a bench can run their exact widths, heads, vocabularies, rope
settings and sliding-window layouts without downloading anything:

- :func:`shape_config` gives the transformers config (optionally with fewer layers);
- :func:`count_parameters` counts its parameters on the ``meta`` device (no memory);
- :func:`build_shape` builds the model with seeded random weights;
- :func:`saved_shape` builds it once and saves it (model + the built-in tiny model's tokenizer, its
  vocabulary filled up to the shape's: :func:`covering_tokenizer`) to a cache folder that
  ``flashpage.LLM(path)`` and vLLM both load.

Weights: every matrix (embeddings, projections, experts, routers) is drawn from N(0, initializer_range)
in float32 from one seeded generator, in chunks, then cast to the model's dtype, so the same seed gives
the same weights in every dtype (bfloat16 = float32 rounded). Norm weights keep transformers' init.
Random std-0.02 weights give near-uniform logits (greedy decoding would be a string of near-ties), so the
final norm's weight multiplies every logit by :data:`LOGIT_SCALE` (see :func:`_scale_logits` for why not the
embedding). Measured in float32, greedy, 4 random 16-token prompts x 32 new tokens, top-1 minus top-2 logit:
median 0.68 / 10th percentile 0.11 (Qwen3-0.6B, 1 layer), 0.54 / 0.06 (Llama-3.2-1B, 2 layers),
0.51 / 0.09 (Gemma-3-1B, 2 layers), 0.67 / 0.08 (the MoE, 4 layers); 4 to 32 distinct tokens per 32.

The MoE entry keeps Qwen3-30B-A3B's widths but has 4 of its 48 layers and 16 of its 128 experts by
default (its name says so): the full model is 30.5B parameters.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

LOGIT_SCALE = 4.0  # every logit x4, through the final norm
EMBED_SHRINK = 8.0  # an embedding the model scales up itself (Gemma) / 8; the final norm makes up for it
CACHE_ENV = "FLASHPAGE_SHAPES_CACHE"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CHUNK = 1 << 22  # float32 values drawn at once while filling a matrix (16 MiB)


@dataclass(frozen=True)
class Shape:
    """One registry entry: a published config, and what this zoo changes by default."""

    name: str
    source: str  # the hub id whose config.json this is
    published_params: float  # the parameter count the model card gives (full model)
    config: dict[str, Any]  # config.json values, model_type included
    reduced: dict[str, Any] = field(default_factory=dict)  # defaults of this entry that differ from the published

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    @property
    def layers(self) -> int:
        """Layers this entry builds by default."""
        return int(self.reduced.get("num_hidden_layers", self.config["num_hidden_layers"]))


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("qwen3-0.6b", "Qwen/Qwen3-0.6B", 0.6e9, {
        "model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
        "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645}),
    Shape("llama-3.2-1b", "meta-llama/Llama-3.2-1B", 1.24e9, {
        "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001}),
    Shape("gemma-3-1b", "google/gemma-3-1b-pt", 1.0e9, {
        "model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912, "vocab_size": 262144,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window": 512,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "tie_word_embeddings": True,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}),
    Shape("qwen3-30b-a3b-4l16e", "Qwen/Qwen3-30B-A3B", 30.5e9, {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 151936, "hidden_act": "silu", "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "tie_word_embeddings": False, "attention_bias": False,
        "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645},
        reduced={"num_hidden_layers": 4, "num_experts": 16}),
)}


def get_shape(name: str) -> Shape:
    """The registry entry ``name``; ValueError naming the choices otherwise."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}: choose from {', '.join(SHAPES)}") from None


def _layer_types(num_layers: int, pattern: int) -> list[str]:
    """Gemma 3's layout: ``pattern - 1`` sliding-window layers, then one full-attention layer, repeating."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def shape_config(name: str, num_layers: int | None = None, full: bool = False) -> Any:
    """The transformers config of shape ``name``: its defaults (``full``: the published model, nothing
    reduced), with ``num_layers`` layers when given."""
    from transformers import AutoConfig

    shape = get_shape(name)
    values = dict(shape.config) if full else {**shape.config, **shape.reduced}
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--num-layers {num_layers}: give at least 1")
        values["num_hidden_layers"] = num_layers
    if "sliding_window_pattern" in values:
        values["layer_types"] = _layer_types(values["num_hidden_layers"], values["sliding_window_pattern"])
    model_type = values.pop("model_type")
    return AutoConfig.for_model(model_type, **values)


def count_parameters(config: Any) -> int:
    """Parameters of a model built from ``config`` (tied weights once), counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _fill_matrices(model: torch.nn.Module, std: float, seed: int) -> None:
    """Every parameter of 2+ dims ~ N(0, std), drawn in float32 chunks from one seeded generator and cast
    (the same weights in every dtype); tied weights are filled once."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.dim() < 2:
                continue
            flat = param.view(-1)
            for start in range(0, flat.numel(), _CHUNK):
                n = min(_CHUNK, flat.numel() - start)
                flat[start:start + n].copy_(torch.empty(n).normal_(0.0, std, generator=gen))


def _scale_logits(model: Any) -> None:
    """Multiply every logit by ``LOGIT_SCALE`` through the final norm's weight (Gemma's norms scale by
    ``1 + weight``). Scaling the embedding instead makes a tied model copy its last input token forever:
    the residual stream is then mostly that token's embedding, and so is its best match in the LM head
    (measured: 1 distinct token in 32 on Qwen3-0.6B, 1 layer). For the same reason an embedding that the
    model multiplies by ``embed_scale`` (Gemma: sqrt(hidden), 34) is divided by ``EMBED_SHRINK``, and the
    final norm makes up for it in the (tied) LM head."""
    embedding = model.get_input_embeddings()
    shrink = EMBED_SHRINK if getattr(embedding, "embed_scale", None) is not None else 1.0
    gain = LOGIT_SCALE * shrink
    norm = model.model.norm.weight
    with torch.no_grad():
        embedding.weight.div_(shrink)
        if model.config.model_type.startswith("gemma"):
            norm.add_(1.0).mul_(gain).sub_(1.0)
        else:
            norm.mul_(gain)


def build_shape(name: str, dtype: torch.dtype = torch.bfloat16, num_layers: int | None = None, seed: int = 0) -> Any:
    """Shape ``name`` with seeded random weights (see the module docstring), in ``dtype``, eval mode, CPU."""
    from transformers import AutoModelForCausalLM

    config = shape_config(name, num_layers)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: a float32 copy of Gemma's 262k vocabulary is 1.2 GB
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    _fill_matrices(model, float(getattr(config, "initializer_range", 0.02)), seed)
    _scale_logits(model)
    return model.eval()  # already in dtype; .to(dtype) would also round the float32 rope buffers


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``; ValueError for a dtype this zoo does not build."""
    text = str(dtype).removeprefix("torch.")
    if text not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    return text


def cache_root() -> Path:
    """Where saved shapes live: ``$FLASHPAGE_SHAPES_CACHE``, else ``~/.cache/flashpage/shapes``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "flashpage" / "shapes"


TOKENIZER_FILE = "tokenizer.json"
_LETTERS = "etaoinsrhldcumfpgwybvkxjqz"  # byte-level BPE vocabulary strings of plain letters decode to themselves


def _filler(index: int) -> str:
    """A word for vocabulary slot ``index`` beyond the tiny tokenizer's: 'Ġ' (a leading space) + 3-6 letters."""
    letters = []
    n = index
    while True:
        n, r = divmod(n, len(_LETTERS))
        letters.append(_LETTERS[r])
        if n == 0 and len(letters) >= 3:
            return "\u0120" + "".join(letters)


def covering_tokenizer(vocab_size: int) -> dict[str, Any]:
    """The built-in tiny model's ``tokenizer.json`` with its BPE vocabulary filled up to ``vocab_size`` ids.

    The tiny tokenizer has 4096 ids; a real shape's model generates ids up to its vocabulary (151,936 for
    Qwen3), which would decode to nothing, so a server would stream empty chunks and a serving bench could time
    no token. Each id beyond 4096 gets a vocabulary entry of its own: a space and 3-6 letters (" eta", " xqzo"),
    distinct from every other entry. No merge produces these entries, so encoding text is unchanged: the same
    prompt gives the same ids as the tiny tokenizer; only decoding the new ids changes.
    """
    from flashpage import tiny_model_path

    data = json.loads((tiny_model_path() / TOKENIZER_FILE).read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in data.get("added_tokens", [])}
    used_ids = _token_ids(data)
    index = 0
    for token_id in range(vocab_size):
        if token_id in used_ids:
            continue
        word = _filler(index)
        while word in taken:
            index += 1
            word = _filler(index)
        vocab[word] = token_id
        taken.add(word)
        index += 1
    return data


def _covers(folder: Path, vocab_size: int) -> bool:
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        return False
    return len(_token_ids(json.loads(path.read_text()))) >= vocab_size


def _token_ids(data: dict[str, Any]) -> set[int]:
    """The ids a ``tokenizer.json`` gives text: its model's vocabulary and its added tokens."""
    return set(data["model"]["vocab"].values()) | {int(t["id"]) for t in data.get("added_tokens", [])}


def _save_tokenizer(folder: Path, vocab_size: int) -> None:
    """The built-in tiny model's tokenizer, filled up to the shape's vocabulary (:func:`covering_tokenizer`);
    written to a temporary file and renamed into place (a cache folder saved before the filling is updated)."""
    from flashpage import tiny_model_path

    for name in ("tokenizer_config.json", "chat_template.jinja"):
        source = tiny_model_path() / name
        if source.is_file() and not (folder / name).is_file():
            shutil.copyfile(source, folder / name)
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(covering_tokenizer(vocab_size), f, ensure_ascii=False)
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / TOKENIZER_FILE)


def saved_shape(name: str, dtype: torch.dtype | str = torch.bfloat16, num_layers: int | None = None) -> Path:
    """The folder of shape ``name`` saved with ``save_pretrained`` (seed 0): built once, written to a temporary
    folder beside it and renamed into place, reused when present."""
    text = dtype_name(dtype)
    layers = num_layers if num_layers is not None else get_shape(name).layers
    root = cache_root()
    target = root / f"{name}-{text}-{layers}l"
    if (target / "config.json").is_file():
        vocab_size = int(json.loads((target / "config.json").read_text())["vocab_size"])
        if not _covers(target, vocab_size):
            _save_tokenizer(target, vocab_size)
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        model = build_shape(name, DTYPES[text], layers)
        model.save_pretrained(str(tmp))
        _save_tokenizer(tmp, int(model.config.vocab_size))
        (tmp / "flashpage_shape.json").write_text(json.dumps({"shape": name, "dtype": text, "layers": layers,
                                                              "seed": 0, "logit_scale": LOGIT_SCALE}))
        del model
        tmp.chmod(0o755)  # mkdtemp's 0700 would outlive the rename
        os.rename(tmp, target)  # atomic; fails when another process got there first
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def describe(name: str, dtype: torch.dtype | str, num_layers: int | None = None) -> dict[str, Any]:
    """What a bench header says about a shape: name, source, model_type, layers of the published count,
    dtype and parameters."""
    shape = get_shape(name)
    config = shape_config(name, num_layers)
    return {"name": name, "source": shape.source, "model_type": shape.model_type,
            "layers": int(config.num_hidden_layers), "published_layers": int(shape.config["num_hidden_layers"]),
            "dtype": dtype_name(dtype), "parameters": count_parameters(config)}


def header_line(info: dict[str, Any]) -> str:
    """One line for a bench report, from :func:`describe`."""
    return (f"shape: {info['name']} ({info['source']} config, {info['model_type']}, random weights), "
            f"{info['layers']} of {info['published_layers']} layers, {info['dtype']}, "
            f"{info['parameters'] / 1e6:.1f}M params")


def load_shape_bench_model(name: str, dtype: str = "bfloat16", num_layers: int | None = None) -> Any:
    """:func:`saved_shape` loaded with ``from_pretrained`` as a bench model (sdpa attention, eval)."""
    from transformers import AutoModelForCausalLM

    from flashpage.bench.models import BenchModel

    path = saved_shape(name, dtype, num_layers)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype_name(dtype)]).eval()
    if model.config._attn_implementation not in ("sdpa", "eager"):
        model.set_attn_implementation("sdpa")
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    return BenchModel(model=model, name=f"{name} ({path})", vocab_size=int(model.config.vocab_size),
                      eos_token_id=None if eos is None else int(eos),
                      parameters=sum(p.numel() for p in model.parameters()), dtype=dtype_name(dtype))


def registry_rows() -> list[dict[str, Any]]:
    """One row per entry for ``flashpage bench shapes``: its default build and the published model."""
    rows = []
    for shape in SHAPES.values():
        config = shape_config(shape.name)
        params = count_parameters(config)
        rows.append({"name": shape.name, "source": shape.source, "model_type": shape.model_type,
                     "layers": int(config.num_hidden_layers), "hidden": int(config.hidden_size),
                     "vocab": int(config.vocab_size), "parameters": params, "bytes_bf16": params * 2,
                     "published_layers": int(shape.config["num_hidden_layers"]),
                     "published_params": shape.published_params,
                     "full_parameters": count_parameters(shape_config(shape.name, full=True))})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The registry as a table."""
    lines = [f"{'name':<22}{'model_type':<13}{'layers':>8}{'hidden':>8}{'vocab':>8}{'params':>10}{'bf16':>10}"
             f"   published ({'source'})"]
    for r in rows:
        lines.append(f"{r['name']:<22}{r['model_type']:<13}{r['layers']:>8}{r['hidden']:>8}{r['vocab']:>8}"
                     f"{r['parameters'] / 1e6:>9.1f}M{r['bytes_bf16'] / 2**30:>7.2f} GiB   "
                     f"{r['published_layers']} layers, {r['full_parameters'] / 1e9:.2f}B computed, "
                     f"{r['published_params'] / 1e9:.2f}B published ({r['source']})")
    lines.append("random weights, built offline; use with: flashpage bench engine --model-shape NAME "
                 "[--dtype bfloat16] [--num-layers N]")
    return "\n".join(lines)


def run_cli(args: Any) -> int:
    """``flashpage bench shapes``: print the registry (``--json``: the rows)."""
    rows = registry_rows()
    print(json.dumps(rows, indent=2) if getattr(args, "json", False) else format_rows(rows))
    return 0
