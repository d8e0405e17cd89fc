"""The ``flashpage`` command: help of every subcommand, ``info``, ``generate`` (greedy, streamed,
seeded sampling), ``demo`` and the quick benchmarks' JSON and plots.

Everything runs in-process through :func:`flashpage.cli.main` (one torch import for all), on the
built-in tiny model, offline; one test runs the installed console script. ``bench generate`` and
``bench engine --workload shared-prefix`` at their real ``--quick`` size, with ``--plot``, are
tests/bench/test_bench.py's; here ``bench generate --quick`` runs a smaller workload (monkeypatched) to
check the command's wiring, and ``bench engine --quick`` runs its default mixed workload.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashpage.cli import main
from flashpage.commands import DEMO_PROMPTS

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = ("flash_attn_with_kvcache", "flash_attn_varlen_func", "store_kv")
SUBCOMMANDS = (
    ("info",),
    ("generate",),
    ("demo",),
    ("bench",),
    ("bench", "kernels"),
    ("bench", "generate"),
    ("bench", "engine"),
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_WORD_FRACTION = 0.7


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000, f"{path} was not written"
    assert path.read_bytes()[:8] == PNG_MAGIC


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


# ------------------------------------------------------------------------------------------- help
def test_top_level_help_lists_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys)
    assert text.startswith("usage: flashpage")
    for sub in ("info", "generate", "demo", "bench"):
        assert sub in text


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_subcommand_help(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]) -> None:
    text = _help(capsys, *argv)
    assert text.startswith(f"usage: flashpage {' '.join(argv)}")
    expected = {
        ("info",): ["--json"],
        ("generate",): ["--prompt", "--max-tokens", "--temperature", "--seed", "--stream", "--model"],
        ("demo",): ["--model", "--json"],
        ("bench",): ["kernels", "generate", "engine"],
        ("bench", "kernels"): ["--json", "--plot", "--quick"],
        ("bench", "generate"): ["--json", "--plot", "--quick", "--model"],
        ("bench", "engine"): ["--json", "--plot", "--quick", "--model", "--workload"],
    }[argv]
    for option in expected:
        assert option in text, f"{option} missing from `flashpage {' '.join(argv)} --help`"


@pytest.mark.parametrize("argv", [(), ("bench",), ("generate",), ("bench", "nope")], ids=repr)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    assert "usage: flashpage" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- info
def test_info_names_entry_points_and_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "info")
    assert code == 0
    assert out.startswith("flashpage ")
    for entry in ENTRY_POINTS:
        lines = [line for line in out.splitlines() if line.strip().startswith(entry)]
        assert lines, f"`flashpage info` does not mention {entry}"
        for line in lines:
            backend, _, reason = line.partition("-> ")[2].partition(": ")
            assert backend in ("fa3", "fa2", "fa4", "cpp", "reference", "torch") and reason.strip(), line

    code, out, _ = _run(capsys, "info", "--json")
    assert code == 0
    info = json.loads(out)
    assert {"flashpage", "torch", "transformers", "devices", "kernels", "default_block_size"} <= set(info)
    cpu = {k["entry_point"]: k for k in info["kernels"] if k["device"] == "cpu"}
    assert set(cpu) == set(ENTRY_POINTS)
    for k in info["kernels"]:
        assert k["reason"].startswith(f"{k['backend']}: ") and len(k["reason"]) > len(k["backend"]) + 5, k
    # flash-attn never runs on a CPU: the reason says why the C++ kernel (or the reference) does
    from flashpage.kernels import cpu_attention

    for entry in ("flash_attn_with_kvcache", "flash_attn_varlen_func"):
        assert cpu[entry]["backend"] == ("cpp" if cpu_attention.status().name == "cpp" else "reference")
        assert "flash-attn" in cpu[entry]["reason"]


# --------------------------------------------------------------------------------------- generate
def test_generate_greedy_and_streamed(capsys: pytest.CaptureFixture[str]) -> None:
    code, plain, _ = _run(capsys, "generate", "--prompt", "The list", "--max-tokens", "8")
    assert code == 0
    assert plain.startswith("The list") and len(plain.strip()) > len("The list"), plain
    code, streamed, _ = _run(capsys, "generate", "--prompt", "The list", "--max-tokens", "8", "--stream")
    assert code == 0
    assert streamed == plain  # greedy: the streamed deltas add up to the same text


def test_generate_seeded_sampling_is_reproducible(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("generate", "--prompt", "If the", "--max-tokens", "8", "--temperature", "0.8", "--seed", "1")
    code, first, _ = _run(capsys, *argv)
    assert code == 0 and first.startswith("If the")
    code, second, _ = _run(capsys, *argv)
    assert code == 0
    assert second == first


def test_generate_text_is_mostly_words(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI path (flashpage.LLM on the patched tiny model) writes real words.

    tests/docs/test_tiny_model.py checks transformers' own greedy output against the whole training
    corpus; this checks what a user of `flashpage generate` sees, against the words of the help
    topics alone (the corpus's first part, quick to build).
    """
    from flashpage.tiny.corpus import corpus_words, help_topics, normalize_word

    words = corpus_words(help_topics())
    for prompt in ("The list", "If the"):
        code, out, _ = _run(capsys, "generate", "--prompt", prompt, "--max-tokens", "40")
        assert code == 0
        tokens = [w for w in (normalize_word(t) for t in out[len(prompt) :].split()) if w]
        unknown = [w for w in tokens if w not in words]
        assert len(tokens) >= 5, out
        assert 1 - len(unknown) / len(tokens) >= MIN_WORD_FRACTION, (out, unknown)


# ------------------------------------------------------------------------------------------- demo
def test_demo_reports_identical_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "demo")
    assert code == 0, out
    assert out.startswith("model: built-in tiny model")
    for prompt in DEMO_PROMPTS:
        assert f"> {prompt}" in out
    assert "patched generate() == transformers generate(): True" in out
    assert "flashpage.LLM       == transformers generate(): True" in out
    assert "dense cache (transformers):" in out and "flashpage pages in use:" in out
    assert "x less;" in out, "the demo batch (one long prompt among short ones) must show the pages' saving"
    assert "throughput (new tokens/s):" in out


# ------------------------------------------------------------------------------------------ bench
def test_bench_kernels_quick_json_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "kernels.png"
    code, out, err = _run(capsys, "bench", "kernels", "--quick", "--json", "--plot", str(plot))
    assert code == 0, err
    result = json.loads(out)  # progress and the plot notice go to stderr: stdout is one JSON document
    assert result["outputs_agree"] is True
    assert result["num_seqs"] == 32 and result["max_len"] == 512
    assert result["paged_ms"] > 0 and result["dense_sdpa_ms"] > 0
    from flashpage.kernels import cpu_attention

    label = "cpp: " if cpu_attention.status().name == "cpp" else "reference: "  # what actually runs, named
    assert result["paged_backend"].startswith(label)
    _png(plot)
    assert str(plot) in err


def test_bench_generate_quick_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from flashpage.bench import generate

    small = generate.GenerateWorkload(
        batch=2, min_prompt=8, max_prompt=24, cases=(("short", 6), ("long", 12)), warmup_tokens=2
    )
    monkeypatch.setattr(generate, "QUICK", small)
    plot = tmp_path / "generate.png"
    code, out, err = _run(capsys, "bench", "generate", "--quick", "--json", "--plot", str(plot))
    assert code == 0, err
    result = json.loads(out)
    assert result["bench"] == "generate" and result["quick"] is True and result["batch"] == 2
    assert set(result["cases"]) == {"short", "long"}
    for case in result["cases"].values():
        assert case["outputs_agree"] is True, case["mismatches"]
        assert case["kv_within_bound"] is True
        assert case["tok_s_patched"] > 0 and case["tok_s_unpatched"] > 0
    _png(plot)


def test_bench_engine_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "bench", "engine", "--quick", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["bench"] == "engine" and result["workload"] == "mixed" and result["quick"] is True
    assert set(result["systems"]) == {"flashpage", "flashpage_capped", "hf_generate", "hf_cb"}
    assert result["ratios"]["capped_tpot_vs_hf_generate"] > 0 and "tpot_vs_hf_generate" in result["goals"]
    assert result["outputs_agree"] is True
    for name, system in result["systems"].items():
        assert system["output_tokens_per_s"] > 0, name
        assert system["output_tokens"] == result["useful_output_tokens"], name


# ---------------------------------------------------------------------------------- console script
def test_installed_console_script() -> None:
    exe = shutil.which("flashpage", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip(f"no `flashpage` console script next to {sys.executable}: pip install -e . first")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [exe, "info", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout)
    assert {k["entry_point"] for k in info["kernels"]} == set(ENTRY_POINTS)
    import flashpage

    assert info["flashpage"] == flashpage.__version__


@pytest.mark.parametrize(("argv", "words"), [
    (("generate", "--prompt", "The list", "--max-tokens", "0"), "max_tokens"),
    (("generate", "--prompt", "", "--max-tokens", "3"), "prompt is empty"),
    (("generate", "--model", "/nonexistent/model", "--prompt", "x"), "no such directory"),
], ids=["max-tokens-0", "empty-prompt", "missing-model-dir"])
def test_bad_values_exit_2_with_a_message(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                          words: str) -> None:
    """Values argparse cannot check still end in one 'error:' line and exit status 2, not a traceback."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert f"flashpage {argv[0]}: error:" in err and words in err and "Traceback" not in err


# ------------------------------------------------------------------ refused before any work (issue 21)
@pytest.fixture
def transformers_4(monkeypatch: pytest.MonkeyPatch) -> str:
    """Pretend transformers 4.57.6 is installed (the version flashpage detects, nothing else)."""
    from flashpage.patches import compat

    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version", lambda dist: "4.57.6" if dist == "transformers" else real(dist))
    return "4.57.6"


def _must_not_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load (tiny, path, bench model) fails the test: the command had to stop before."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded although the command should have stopped first")

    monkeypatch.setattr("flashpage.engine.loading.load_model", refuse)
    monkeypatch.setattr("flashpage.tiny.load_tiny_model", refuse)
    monkeypatch.setattr("flashpage.bench.models.load_bench_model", refuse)


EVERY_COMMAND = (
    ("generate", "--prompt", "The list"), ("demo",), ("serve",), ("bench", "kernels", "--quick"),
    ("bench", "generate", "--quick"), ("bench", "engine", "--quick"), ("bench", "hotpath", "--quick"),
    ("bench", "tp", "--quick"), ("bench", "serve", "--quick"), ("bench", "sampler", "--quick"),
)


@pytest.mark.parametrize("argv", EVERY_COMMAND, ids=["-".join(a[:2]) for a in EVERY_COMMAND])
def test_every_command_refuses_transformers_4(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                              transformers_4: str, argv: tuple[str, ...]) -> None:
    _must_not_load(monkeypatch)
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert f"needs transformers>=5.0,<6, but transformers {transformers_4} is installed" in err
    assert 'pip install "transformers>=5.0,<6"' in err and "Traceback" not in err


def test_info_reports_transformers_4_instead_of_refusing(capsys: pytest.CaptureFixture[str],
                                                         transformers_4: str) -> None:
    code, out, _ = _run(capsys, "info")
    assert code == 0 and "transformers 4.57.6: NOT supported (install transformers>=5.0,<6)" in out


def test_hf_paged_cache_refuses_transformers_4(transformers_4: str) -> None:
    from transformers import AutoConfig

    from flashpage.patches import HFPagedCache, UnsupportedTransformersError
    from flashpage.tiny import tiny_model_path

    config = AutoConfig.from_pretrained(tiny_model_path())
    with pytest.raises(UnsupportedTransformersError, match="4.57.6"):
        HFPagedCache(config)


FAKE_TRANSFORMERS_4 = (
    "import importlib.metadata as m, sys\n"
    "real = m.version\n"
    "m.version = lambda dist: '4.57.6' if dist == 'transformers' else real(dist)\n"
)


def _run_with_transformers_4(body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter whose package metadata says transformers 4.57.6."""
    return subprocess.run([sys.executable, "-c", FAKE_TRANSFORMERS_4 + body], capture_output=True, text=True,
                          timeout=300, check=False, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_import_of_the_patches_refuses_transformers_4() -> None:
    """In a fresh interpreter whose package metadata says transformers 4.57.6: the import itself fails."""
    proc = _run_with_transformers_4(
        "sys.modules.pop('transformers', None)\n"
        "try:\n"
        "    import flashpage.patches\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "else:\n"
        "    print('imported')\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("UnsupportedTransformersError flashpage needs transformers>=5.0,<6, "
                                  "but transformers 4.57.6 is installed"), proc.stdout


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    import transformers

    import flashpage

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    versions = f"transformers {transformers.__version__}, torch {torch.__version__}"
    assert out == f"flashpage {flashpage.__version__} ({versions})"


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_serve_refuses_a_bad_port_before_loading(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                                 port: str) -> None:
    _must_not_load(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", port])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port" in err and "1..65535" in err


def test_serve_refuses_cuda_without_cuda_before_loading(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _must_not_load(monkeypatch)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["serve", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "flashpage serve: error: device='cuda', but CUDA is not available" in err and "device='cpu'" in err


def test_model_argument_is_a_file(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                  tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a model")
    assert main(["generate", "--model", str(weights), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "that is a file, not a model" in err and f"--model {tmp_path}" in err and "no such directory" not in err


def test_served_name_of_the_builtin_model_loads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model flashpage-tiny`` (the name `flashpage serve` gives the built-in model) is that model,
    not a hub id to look up."""
    from transformers import AutoModelForCausalLM

    from flashpage import commands, tiny_model_path

    asked: list[object] = []
    real = AutoModelForCausalLM.from_pretrained

    def from_pretrained(name: object, *args: object, **kwargs: object) -> object:
        asked.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    model, tok = commands.load_model("flashpage-tiny")
    assert asked == [tiny_model_path()] and model.config.model_type == "llama" and tok.pad_token_id is not None


def test_max_tokens_beyond_the_context_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "The list", "--max-tokens", "2000"]) == 2
    err = capsys.readouterr().err
    assert "maximum context length" in err and "is 1024 tokens" in err and "lower max_tokens to at most" in err


@pytest.mark.parametrize("bench", ["generate", "engine", "tp"])
def test_bench_help_names_the_bench_model(capsys: pytest.CaptureFixture[str], bench: str) -> None:
    text = " ".join(_help(capsys, "bench", bench).split())
    assert "default: a random-weight Llama built from a config" in text and "tiny model" not in text


def test_missing_serve_extra_says_how_to_install_from_a_checkout(capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _must_not_load(monkeypatch)
    monkeypatch.setitem(sys.modules, "flashpage.serve.server", None)  # as if uvicorn/fastapi were missing
    assert main(["serve"]) == 2
    assert 'pip install -e ".[serve]"' in capsys.readouterr().err


def test_readme_cli_synopsis_names_only_real_options() -> None:
    """Every ``flashpage ...`` line of README's CLI section uses a command and options that exist."""
    import argparse
    import re

    from flashpage.cli import build_parser

    def options(parser: argparse.ArgumentParser) -> set[str]:
        return {o for a in parser._actions for o in a.option_strings}

    def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return dict(action.choices)

    readme = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    synopsis = re.search(r"# CLI\n\n```\n(.*?)```", readme, re.S)
    assert synopsis, "docs/cli.md has no CLI synopsis block"
    parser = build_parser()
    commands = subparsers(parser)
    lines = [ln.split("#")[0].split() for ln in synopsis.group(1).splitlines() if ln.startswith("flashpage")]
    assert {words[1] for words in lines if not words[1].startswith("-")} == set(commands)
    for words in lines:
        if words[1].startswith("-"):
            assert words[1] in options(parser)
            continue
        targets = [commands[words[1]]]
        if words[1] == "bench":
            benches = subparsers(commands["bench"])
            targets = [benches[name] for name in words[2].split("|")]
        used = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", " ".join(words)))
        for target in targets:
            assert used <= options(target), f"{' '.join(words)}: {used - options(target)} not accepted"


def test_missing_extra_messages_work_from_a_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """flashpage is installed from its repository: `pip install 'flashpage[X]'` would not find it on PyPI."""
    from flashpage.engine.structured import _llguidance

    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ValueError, match=r'pip install llguidance \(from a flashpage checkout: pip install -e '
                                         r'"\.\[structured\]"\)'):
        _llguidance()


def test_info_runs_where_the_patches_refuse_to_import() -> None:
    """In a fresh interpreter whose package metadata says transformers 4.57.6, ``flashpage info`` still
    reports (the version verdict included) while ``demo`` refuses."""
    proc = _run_with_transformers_4(
        "from flashpage.cli import main\n"
        "print('info exit', main(['info']))\n"
        "print('demo exit', main(['demo']))\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "transformers 4.57.6: NOT supported (install transformers>=5.0,<6)" in proc.stdout
    assert "info exit 0" in proc.stdout and "demo exit 2" in proc.stdout, proc.stdout[-2000:]
    assert "flashpage demo: error: flashpage needs transformers>=5.0,<6" in proc.stderr
