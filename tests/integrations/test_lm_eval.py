"""lm-evaluation-harness against ``flashpage serve``: its ``local-completions`` backend (loglikelihood
through echo + prompt logprobs, generate_until through plain completions) on local tasks made here
equals its ``hf`` backend (transformers on the same model) item by item.

Needs lm-eval (``pip install 'flashpage[eval]'``: large, so not in the ``test`` extra); without it
the test is skipped, saying so. Nothing is downloaded: the tasks are jsonl files written here, read
by ``datasets``' packaged json loader, and the model is the built-in tiny one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import MODEL, tiny_server

from flashpage import tiny_model_path

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

MC = [  # question, four choices, the index of the right one
    ("The list", [" of", " is", " module", " returns"], 0),
    ("Return the number of", [" items", " the", " bytes", " object"], 0),
    ("A module is", [" a", " the", " not", " used"], 0),
    ("If the file", [" is", " does", " exists", " name"], 0),
    ("The dictionary", [" of", " is", " keys", " object"], 1),
    ("This function", [" returns", " is", " takes", " raises"], 0),
]
GEN = ["The default value is", "Raise an exception", "The list of", "A string is"]
LL_TOL = 1e-4  # a sum over a continuation's tokens, each within ~1e-5 (float32)


def _write_tasks(root: Path) -> None:
    mc = root / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC))
    gen = root / "gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p, "target": ""}) + "\n" for p in GEN))
    (root / "flashpage_mc.yaml").write_text(f"""task: flashpage_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (root / "flashpage_gen.yaml").write_text(f"""task: flashpage_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 64  # the tiny model's generation_config says max_new_tokens=64, which the hf backend obeys
  do_sample: false
metric_list:
  - metric: exact_match
""")


@pytest.fixture(scope="module")
def lm_eval_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("lm_eval")
    for key, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "HF_DATASETS_CACHE": str(root / "cache"), "TOKENIZERS_PARALLELISM": "false"}.items():
        mp.setenv(key, value)
    why = "lm-eval with its api extra is not installed (pip install 'flashpage[eval]'): the lm-eval comparison " \
          "does not run"
    lm_eval = pytest.importorskip("lm_eval", reason=why)
    pytest.importorskip("tenacity", reason=why)  # what lm-eval's API models need (its `api` extra)
    _write_tasks(root)
    yield lm_eval, root
    mp.undo()


def _samples(lm_eval: Any, root: Path, model: str, model_args: dict[str, Any]) -> dict[str, list[dict]]:
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["flashpage_mc", "flashpage_gen"],
                                  task_manager=TaskManager(include_path=str(root)), batch_size=1,
                                  bootstrap_iters=0, log_samples=True, random_seed=0)
    return {task: sorted(rows, key=lambda r: r["doc_id"]) for task, rows in out["samples"].items()}


def test_local_completions_equal_the_hf_backend(lm_eval_env: tuple[Any, Path]) -> None:
    lm_eval, root = lm_eval_env
    path = str(tiny_model_path())
    want = _samples(lm_eval, root, "hf", {"pretrained": path, "dtype": "float32", "device": "cpu"})
    with tiny_server() as (server, _):
        got = _samples(lm_eval, root, "local-completions", {
            "base_url": f"{server.url}/v1/completions", "model": MODEL, "tokenizer": path,
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1,
            "max_length": 1024})
    assert len(got["flashpage_mc"]) == len(MC) and len(got["flashpage_gen"]) == len(GEN)
    for w, g in zip(want["flashpage_mc"], got["flashpage_mc"], strict=True):
        w_ll = [r[0] for r in w["resps"]]
        g_ll = [r[0] for r in g["resps"]]
        assert len(w_ll) == len(g_ll) == 4
        for (wl, wg), (gl, gg) in zip(w_ll, g_ll, strict=True):
            assert math.isfinite(gl) and gl < 0.0
            assert abs(float(wl) - float(gl)) <= LL_TOL, (w["doc_id"], w_ll, g_ll)
            assert bool(wg) == bool(gg), (w["doc_id"], w_ll, g_ll)  # is_greedy agrees
        assert w["acc"] == g["acc"]
    for w, g in zip(want["flashpage_gen"], got["flashpage_gen"], strict=True):
        assert w["resps"] == g["resps"] and w["resps"][0][0], (w["doc_id"], w["resps"], g["resps"])
