"""flashpage.patch on every model family of the zoo: patched greedy generate() == unpatched.

For each family a left-padded batch of three prompts of different lengths is generated greedily
with the same model object, first unpatched (the reference, with per-step logits), then patched,
then unpatched again. Checks:

- tokens: ``compare_greedy`` against the reference must be ``.ok`` (identical, or first differing
  at a reference tie); across the zoo the vast majority of rows must be identical;
- logits: per-step logits agree to 1e-4 (fp32) up to each row's first differing token;
- routing: the family took the expected path (``patch_state(model).family.path``), interface
  families run on flashpage's "pagedkv" attention, adapter families keep their own;
- unpatch restores the attention implementation the model had before, exactly.

``flashpage.patches.support_matrix`` is exercised on three families, and README's support table must
equal what this module measured on the whole zoo (``FLASHPAGE_UPDATE_README=1`` rewrites it).
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from model_zoo import (
    FAMILIES,
    config_kwargs,
    left_padded_batch,
    model_from_config,
    tiny_config,
    tiny_model,
)

import flashpage
from flashpage.patches import ATTN_NAME
from flashpage.patches.patching import patch_state
from flashpage.patches.support_matrix import format_markdown, run_matrix
from flashpage.testing import GreedyMatch, compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENGTHS = [5, 11, 8]
MAX_NEW_TOKENS = 16
LOGIT_ATOL = 1e-4
MIN_IDENTICAL_FRACTION = 0.9

# Families routed through an adapter rather than the generic attention-interface path.
EXPECTED_PATH = {"falcon": "adapter", "bloom": "adapter"}
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")


def expected_path(name: str) -> str:
    """How patch() must route a family on the installed transformers.

    DeepSeek's MLA caches its compressed latents (``cache.update`` before ``expand_kv``) since 5.1:
    what the attention sees is not what was stored, so the probe picks the dense view. transformers
    5.0 caches the expanded K/V and attends on them as given, so the pages serve it directly.
    """
    if name in MLA_FAMILIES:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        attention = getattr(module, name.title().replace("_", "") + "Attention")
        return "dense-view" if hasattr(attention, "expand_kv") else "interface"
    return EXPECTED_PATH.get(name, "interface")
# Families whose attention does not go through transformers' AttentionInterface: patch must leave it.
KEEPS_OWN_ATTENTION = {"falcon", "bloom"}

@dataclass
class FamilyRun:
    """Everything one family's unpatched/patched/unpatched round trip produced."""

    name: str
    prompt_width: int
    ref_tokens: torch.Tensor  # (B, new) unpatched greedy tokens
    ref_logits: list[torch.Tensor]  # per step (B, V)
    attn_before: str | None
    attn_patched: str | None
    attn_after: str | None
    path: str | None
    got_tokens: torch.Tensor | None = None
    got_logits: list[torch.Tensor] | None = None
    error: BaseException | None = None

    def matches(self) -> list[GreedyMatch]:
        assert self.got_tokens is not None
        return [compare_greedy(self.ref_tokens[i].tolist(), self.got_tokens[i].tolist(),
                               [step[i] for step in self.ref_logits])
                for i in range(self.ref_tokens.shape[0])]


def _greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences[:, ids.shape[1]:], [step.float() for step in out.logits]


def _run_family(name: str) -> FamilyRun:
    model = tiny_model(name)
    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_tokens, ref_logits = _greedy(model, ids, mask)
    attn_before = model.config._attn_implementation
    flashpage.patch(model)
    state = patch_state(model)
    run = FamilyRun(name, ids.shape[1], ref_tokens, ref_logits, attn_before, model.config._attn_implementation,
                    None, state.family.path if state is not None else None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.got_tokens, run.got_logits = _greedy(model, ids, mask)
    except Exception as exc:  # reported by the tests that need the patched run
        run.error = exc
    finally:
        flashpage.unpatch(model)
    run.attn_after = model.config._attn_implementation
    return run


@pytest.fixture(scope="module")
def family_run() -> Iterator[Callable[[str], FamilyRun]]:
    """name -> FamilyRun, each family built and generated once per module."""
    runs: dict[str, FamilyRun] = {}

    def get(name: str) -> FamilyRun:
        if name not in runs:
            runs[name] = _run_family(name)
        return runs[name]

    yield get
    runs.clear()


def _patched_outputs(run: FamilyRun) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if run.error is not None:
        raise run.error
    assert run.got_tokens is not None and run.got_logits is not None
    return run.got_tokens, run.got_logits


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_unpatched(family_run: Callable[[str], FamilyRun], name: str) -> None:
    run = family_run(name)
    got, _ = _patched_outputs(run)
    assert got.shape[0] == run.ref_tokens.shape[0]
    for row, match in enumerate(run.matches()):
        assert match.ok, f"{name} row {row} (prompt length {PROMPT_LENGTHS[row]}): {match.explain()}"


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_close_until_first_difference(family_run: Callable[[str], FamilyRun], name: str) -> None:
    run = family_run(name)
    _, got_logits = _patched_outputs(run)
    assert len(got_logits) >= 1
    for row, match in enumerate(run.matches()):
        last = match.position if match.position is not None else len(run.ref_logits) - 1
        last = min(last, len(run.ref_logits) - 1, len(got_logits) - 1)
        for step in range(last + 1):
            diff = float((run.ref_logits[step][row] - got_logits[step][row]).abs().max())
            assert diff <= LOGIT_ATOL, f"{name} row {row} step {step}: max |logit diff| {diff:.3g}"


@pytest.mark.parametrize("name", FAMILIES)
def test_routing_path(family_run: Callable[[str], FamilyRun], name: str) -> None:
    run = family_run(name)
    assert run.path == expected_path(name)
    if name in KEEPS_OWN_ATTENTION:
        assert run.attn_patched == run.attn_before, "patch must not touch the attention of adapter families"
        assert run.attn_patched != ATTN_NAME
    else:
        assert run.attn_patched == ATTN_NAME == "pagedkv"


@pytest.mark.parametrize("name", FAMILIES)
def test_unpatch_restores_attention(family_run: Callable[[str], FamilyRun], name: str) -> None:
    run = family_run(name)
    assert run.attn_before is not None
    assert run.attn_after == run.attn_before


def test_vast_majority_identical(family_run: Callable[[str], FamilyRun]) -> None:
    """Ties are rare with the zoo's widened logits: almost every row must match token for token."""
    identical = total = 0
    tie_exempt: list[str] = []
    for name in FAMILIES:
        run = family_run(name)
        if run.error is not None:
            continue  # a failing family is reported by its own tests
        matches = run.matches()
        total += len(matches)
        identical += sum(m.identical for m in matches)
        if not all(m.identical for m in matches):
            tie_exempt.append(name)
    assert total >= 3 * (len(FAMILIES) - 1)
    if tie_exempt:
        warnings.warn(f"families that needed the tie exemption: {tie_exempt}", stacklevel=1)
    assert identical >= MIN_IDENTICAL_FRACTION * total, (
        f"only {identical}/{total} rows identical; tie-exempt families: {tie_exempt}")


# ------------------------------------------------------------------------------ support matrix
MATRIX_FAMILIES = ["llama", "gemma2", "falcon"]  # plain interface, interface + softcap/window, adapter


def test_support_matrix_rows_and_markdown() -> None:
    rows = run_matrix([(name, tiny_config(name)) for name in MATRIX_FAMILIES],
                      build_model=lambda name, config: model_from_config(name, config), max_new_tokens=8)
    assert [row["family"] for row in rows] == MATRIX_FAMILIES
    for row in rows:
        assert set(row) >= {"family", "path", "attention", "exact", "max_logit_diff"}
        assert row["error"] is None, row["error"]
        assert row["exact"] is True, row
        assert 0.0 <= row["max_logit_diff"] <= LOGIT_ATOL
        assert row["path"] == expected_path(row["family"])
    assert [row["attention"] == ATTN_NAME for row in rows] == [True, True, False]
    assert rows[2]["attention"] in ("sdpa", "eager")

    table = format_markdown(rows).strip().splitlines()
    assert len(table) == 2 + len(rows)
    assert table[0].startswith("| Family |") and set(table[1]) <= set("|-: ")
    for line, row in zip(table[2:], rows, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:4] == [row["family"], row["path"], row["attention"], "yes"]
        assert float(cells[4]) == pytest.approx(row["max_logit_diff"], rel=0.06, abs=1e-12)


def test_support_matrix_default_builder_and_failures() -> None:
    """Config kwargs with the default builder; a family that fails becomes a row, not an exception."""

    def broken(name: str, config: object) -> torch.nn.Module:
        raise RuntimeError("cannot build | this one")

    good = run_matrix([("llama", config_kwargs("llama"))], max_new_tokens=4)[0]
    assert good["error"] is None and good["path"] == "interface" and good["attention"] == ATTN_NAME
    assert good["max_logit_diff"] <= LOGIT_ATOL
    bad = run_matrix([("llama", tiny_config("llama"))], build_model=broken)[0]
    assert bad["exact"] is False and bad["error"].startswith("RuntimeError: cannot build")
    line = format_markdown([good, bad]).strip().splitlines()[-1]
    assert "\\|" in line and line.count(" | ") == 5, line  # the error's "|" is escaped inside its cell


# ------------------------------------------------------------------------------ README's table
README = Path(__file__).resolve().parents[2] / "docs" / "models.md"  # the page that holds the table
MATRIX_START, MATRIX_END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"


def _matrix_row(run: FamilyRun) -> dict:
    """A support_matrix row from this module's run of one family."""
    row = {"family": run.name, "path": run.path, "attention": run.attn_patched, "exact": False,
           "max_logit_diff": None, "error": None}
    if run.error is not None:
        row["error"] = f"{type(run.error).__name__}: {run.error}"
        return row
    assert run.got_logits is not None
    matches = run.matches()
    row["exact"] = all(m.identical for m in matches)
    steps = min(len(run.ref_logits), len(run.got_logits))
    row["max_logit_diff"] = max(float((run.ref_logits[s] - run.got_logits[s]).abs().max()) for s in range(steps))
    if not row["exact"]:
        row["error"] = "differs only at a reference tie (top-2 within 1e-5)" if all(m.ok for m in matches) else ""
    return row


def _readme_cells(table: str) -> list[list[str]]:
    """Family, path, attention, exact of each data line of a Markdown support table."""
    lines = [line for line in table.strip().splitlines() if line.startswith("|")][2:]
    return [[c.strip() for c in line.strip("|").split("|")][:4] for line in lines]


def test_readme_support_matrix_is_current(family_run: Callable[[str], FamilyRun]) -> None:
    """README's table is generated from these runs; regenerate with FLASHPAGE_UPDATE_README=1."""
    table = format_markdown(_matrix_row(family_run(name)) for name in FAMILIES)
    text = README.read_text()
    assert MATRIX_START in text and MATRIX_END in text, f"docs/models.md lacks the {MATRIX_START} markers"
    head, rest = text.split(MATRIX_START, 1)
    current, tail = rest.split(MATRIX_END, 1)
    if os.environ.get("FLASHPAGE_UPDATE_README") == "1":
        README.write_text(f"{head}{MATRIX_START}\n{table}{MATRIX_END}{tail}")
        current = table
    assert _readme_cells(current) == _readme_cells(table), (
        "README's support matrix is out of date: run FLASHPAGE_UPDATE_README=1 pytest "
        "tests/patches/test_patch_families.py -k readme")
