"""Tests of flashpage's built-in tiny model (``flashpage/tiny/model``): loads offline, is small,
its tokenizer round-trips text and greedy generations are made mostly of real corpus words."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from flashpage.tiny import tiny_model_path
from flashpage.tiny.corpus import build_corpus, corpus_words, normalize_word

PROMPTS = ("The list", "Return the", "If the", "This module")
MIN_WORD_FRACTION = 0.7
MAX_SAFETENSORS_BYTES = 15 * 2**20


def _child_env() -> dict[str, str]:
    """Environment for a child interpreter that imports the same flashpage as this one."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    from flashpage.tiny import load_tiny_model

    return load_tiny_model()


@pytest.fixture(scope="module")
def words() -> set[str]:
    return corpus_words(build_corpus())


def test_saved_files_present_and_small() -> None:
    path = tiny_model_path()
    assert (path.parent.name, path.name) == ("tiny", "model")
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    ):
        assert (path / name).is_file(), name
    size = (path / "model.safetensors").stat().st_size
    assert 1_000_000 < size < MAX_SAFETENSORS_BYTES
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["tie_word_embeddings"] is True


def test_loads_offline_in_fresh_process() -> None:
    code = (
        "import json, torch\n"
        "from flashpage.tiny import load_tiny_model\n"
        "m, t = load_tiny_model()\n"
        "p = next(m.parameters())\n"
        "print(json.dumps({'dtype': str(p.dtype), 'training': m.training, 'cls': type(m).__name__,"
        " 'eos': t.eos_token, 'n': sum(x.numel() for x in m.parameters())}))\n"
    )
    env = {**_child_env(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info == {
        "dtype": "torch.float32",
        "training": False,
        "cls": "LlamaForCausalLM",
        "eos": "<|endoftext|>",
        "n": info["n"],
    }
    assert 1_000_000 < info["n"] < 8_000_000


def test_import_is_cheap() -> None:
    # flashpage itself may import torch; flashpage.tiny must add neither torch nor transformers.
    code = (
        "import sys, json\n"
        "import flashpage\n"
        "before = set(sys.modules)\n"
        "import flashpage.tiny, flashpage.tiny.corpus\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(json.dumps(sorted(new & {'torch', 'transformers', 'tokenizers'})))\n"
        "print(json.dumps('transformers' in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_child_env(), capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["[]", "false"]


def test_load_dtype_options(tiny: tuple[Any, Any]) -> None:
    import torch

    from flashpage.tiny import load_tiny_model

    model, _ = tiny
    half, _ = load_tiny_model(dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16
    assert not half.training
    with pytest.raises(ValueError):
        load_tiny_model(dtype="not_a_dtype")
    # float16 storage upcast to float32: the weights agree with a bfloat16 load up to rounding
    a = model.get_input_embeddings().weight
    b = half.get_input_embeddings().weight.float()
    assert torch.allclose(a, b, atol=1e-2, rtol=1e-2)


def test_tokenizer_round_trip(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.pad_token_id
    texts = [
        "Return the list of keyword arguments.",
        'def f(x, *args, **kwargs):\n    """Docstring."""\n    return x  # done\n',
        "  leading spaces, tabs\tand\n\nblank lines; unicode: café ∑ 日本 🙂",
        "",
    ]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    ids = tok("The list", add_special_tokens=False)["input_ids"]
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True) == "The list"
    assert len(tok) <= 8192


def _word_fraction(text: str, vocab: set[str]) -> tuple[float, list[str]]:
    tokens = [normalize_word(t) for t in text.split()]
    tokens = [t for t in tokens if t]
    unknown = [t for t in tokens if t not in vocab]
    return 1.0 - len(unknown) / max(1, len(tokens)), unknown


@pytest.fixture(scope="module")
def greedy(tiny: tuple[Any, Any]) -> dict[str, str]:
    """40 greedy new tokens per prompt, all prompts in one left-padded batch."""
    import torch

    model, tok = tiny
    inputs = tok(list(PROMPTS), return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        # min_new_tokens suppresses an early <|endoftext|> so there are always 40 tokens to judge
        out = model.generate(**inputs, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    new = out[:, inputs["input_ids"].shape[1] :]
    assert new.shape == (len(PROMPTS), 40)
    return {p: tok.decode(row, skip_special_tokens=True) for p, row in zip(PROMPTS, new, strict=True)}


def test_batched_greedy_matches_single(tiny: tuple[Any, Any], greedy: dict[str, str]) -> None:
    import torch

    model, tok = tiny
    prompt = PROMPTS[0]
    inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    single = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert single.split()[:10] == greedy[prompt].split()[:10]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generation_is_mostly_real_words(greedy: dict[str, str], words: set[str], prompt: str) -> None:
    text = greedy[prompt]
    fraction, unknown = _word_fraction(text, words)
    assert len(text.split()) >= 5, text
    assert fraction >= MIN_WORD_FRACTION, (text, unknown)


def test_generation_config_defaults(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    gen = model.generation_config
    assert gen.eos_token_id == tok.eos_token_id
    assert gen.pad_token_id == tok.pad_token_id
    assert gen.do_sample is False
