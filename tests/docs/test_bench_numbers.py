"""Every bench number in docs/benchmarks.md and README.md is backed by a stored bench output it cites.

A *unit* of a page is one table row or one paragraph (consecutive non-blank lines outside tables, code
fences and HTML comments; a heading is a unit of its own). A unit that holds a bench number must cite at
least one stored ``--json`` output as a markdown link to ``results/<slug>.json`` (from README:
``docs/results/<slug>.json``; any link text, ``[results](...)`` by convention), and every bench number in
it must be found in one of the files it cites:

* a number with a unit: ``tok/s``, ``ms`` (also ``ms/token``), ``s``, ``MiB``, ``GiB``, ``%`` or a ratio
  ``x`` (``4.01x``; ``x`` and ``%`` written right after the digits, the others after an optional space);
  a list written ``a / b / c ms``, ``a, b tok/s``, ``a; b ms``, ``a vs b ms``, ``a -> b tok/s`` or ``a and b s``
  gives the unit to every number in it,
  and a range ``a-b ms`` checks both ends;
* in a table whose header cell names a unit (``tok/s``, ``ms``, ``MiB``, ``GiB``, ``%``, ``(s)``), the
  bare numbers of that column's cells carry it.

A number *is found* when some numeric JSON value, rounded to the decimals shown, equals it, after the
unit's conversion (ms: the value or the value x 1000, from seconds; s: also ms / 1000; %: also a fraction
x 100; MiB / GiB: also from bytes, GiB also from MiB); a ratio ``N.NNx`` may also be the quotient of two
related JSON values, either order, rounded likewise: two numbers under the same key name
(``output_tokens_per_s`` of two systems, ``paged_ms`` of two files, ``runs_tok_s`` of two rounds). Any two
values would back almost any two-decimal ratio (a mutation test passed 22 of 29 invented ratios that way);
keys that hold ratios already (``ratio``, ``speedup``, ``*_vs_*``, ...) are no operands. Even so a file with
many similar figures (ten ratios of the sampler) backs a number copied from the wrong cell: the test catches
invented numbers, not misplaced ones.
The values of ``recorded_with`` (the run's settings) back nothing.

Exempt, by construction: numbers inside backticks (commands and their settings), numbers in link
targets, and numbers without one of the units above (request counts, token lengths, layers, threads,
dates, versions, hardware, load averages). Every cited file must exist, parse as JSON and carry the
``recorded_with`` object that flashpage/bench/record.py adds (command line, commit, versions, CPU, date).
"""

from __future__ import annotations

import bisect
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "benchmarks.md", ROOT / "README.md"]

_NUM = r"\d+(?:\.\d+)?"
_SEP = r"\s*(?:->|-|/|,|;|\bvs\b|\band\b)\s*"
# A unit after a number (or a list / range of numbers); x and % sit right after the digits.
_UNIT = r"(?:(?P<att>x|%)(?![\w/])|\s?(?P<sp>tok/s|ms|MiB|GiB|s)(?![\w]))"
NUMBER_WITH_UNIT = re.compile(rf"(?<![\w.])(?P<list>{_NUM}(?:{_SEP}{_NUM})*){_UNIT}")
BARE_NUMBER = re.compile(rf"(?<![\w.\-]){_NUM}(?![\w.%]|-\d)")
HEADER_UNIT = re.compile(r"tok/s|\bms\b|MiB|GiB|%|\(s\)")
CITATION = re.compile(r"\[[^\]]*\]\((?P<target>(?:docs/)?results/[\w.\-]+\.json)\)")
LINK = re.compile(r"\[(?P<text>[^\]]*)\]\([^)]*\)")
CODE_SPAN = re.compile(r"`[^`]*`")
FENCE = re.compile(r"^\s*```")
RATIO_KEY = re.compile(r"ratio|speedup|_vs_|saving|goal|target|measured", re.I)
# Unit conversions from a JSON value to the unit shown.
SCALES = {"tok/s": (1.0,), "ms": (1.0, 1000.0), "s": (1.0, 1e-3), "%": (1.0, 100.0), "x": (1.0,),
          "MiB": (1.0, 2.0 ** -20), "GiB": (1.0, 2.0 ** -30, 2.0 ** -10)}


@dataclass
class Unit:
    """One table row or paragraph of a page: where it starts, its text, and its table header if a row."""

    line: int
    text: str
    header: list[str] | None = None


@dataclass
class Number:
    """A bench number as shown: its text (decimals matter) and its unit."""

    shown: str
    unit: str

    @property
    def value(self) -> float:
        return float(self.shown)

    @property
    def half_step(self) -> float:
        decimals = len(self.shown.partition(".")[2])
        return 0.5 * 10.0 ** -decimals * (1 + 1e-9) + 1e-12


@dataclass
class Results:
    """The numeric values of the cited JSON files, sorted, and the groups of related values whose quotients
    may back a ratio: the numbers under one key name (one figure of several systems, runs or files)."""

    values: list[float] = field(default_factory=list)
    groups: dict[str, list[float]] = field(default_factory=dict)

    def add(self, doc: dict) -> None:
        """The run's figures: every number but those of ``recorded_with`` (the settings of the run)."""
        figures = {k: v for k, v in doc.items() if k != "recorded_with"}
        for key, value in _numbers(figures):
            self.values.append(value)
            if not RATIO_KEY.search(key) and value > 0:  # a ratio of ratios backs nothing
                self.groups.setdefault(key, []).append(value)
        self.values.sort()
        for group in self.groups.values():
            group.sort()

    def has_value(self, target: float, tol: float, scales: tuple[float, ...]) -> bool:
        return any(_in_range(self.values, (target - tol) / s, (target + tol) / s) for s in scales)

    def has_ratio(self, target: float, tol: float) -> bool:
        lo, hi = target - tol, target + tol
        for group in self.groups.values():  # a / b in [lo, hi]  <=>  a in [lo * b, hi * b] (b > 0)
            if any(_in_range(group, lo * b, hi * b) for b in group):
                return True
        return False


def _in_range(values: list[float], lo: float, hi: float) -> bool:
    i = bisect.bisect_left(values, lo)
    return i < len(values) and values[i] <= hi


def _numbers(doc: object, key: str = "") -> Iterator[tuple[str, float]]:
    """(key name, value) of every int / float in a JSON document (booleans are not numbers here); the items of
    a list of numbers are under the list's key."""
    if isinstance(doc, bool):
        return
    if isinstance(doc, (int, float)):
        yield key, float(doc)
    elif isinstance(doc, dict):
        for k, v in doc.items():
            yield from _numbers(v, k)
    elif isinstance(doc, list):
        for v in doc:
            yield from _numbers(v, key)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def split_units(text: str) -> list[Unit]:
    """The page's table rows and paragraphs (code fences and HTML comments left out)."""
    units: list[Unit] = []
    para: list[str] = []
    para_line, header, in_fence, in_comment = 0, None, False, False

    def flush() -> None:
        if para:
            units.append(Unit(para_line, " ".join(para)))
            para.clear()

    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if FENCE.match(line):
            flush()
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if in_comment or stripped.startswith("<!--"):
            flush()
            in_comment = "-->" not in stripped
            continue
        if stripped.startswith("|"):
            flush()
            if re.fullmatch(r"\|?[\s:|-]+\|?", stripped):
                continue  # the separator row
            if header is None:  # the header row: a unit without a header of its own
                header = _cells(stripped)
                units.append(Unit(n, stripped))
            else:
                units.append(Unit(n, stripped, header))
            continue
        header = None
        if not stripped or stripped.startswith("#"):
            flush()
            if stripped:
                units.append(Unit(n, stripped))
            continue
        if not para:
            para_line = n
        para.append(stripped)
    flush()
    return units


def _plain(text: str) -> str:
    """Text with code spans and link targets removed and emphasis markers dropped."""
    text = CODE_SPAN.sub(" ", text)
    text = LINK.sub(lambda m: m.group("text"), text)
    return text.replace("**", "").replace("*", "")


def bench_numbers(unit: Unit) -> list[Number]:
    """The numbers of ``unit`` that must be backed: with a unit, or bare in a table column that names one."""
    found: list[Number] = []
    cells = _cells(unit.text) if unit.header is not None else [unit.text]
    for i, cell in enumerate(cells):
        plain = _plain(cell)
        for m in NUMBER_WITH_UNIT.finditer(plain):
            name = m.group("att") or m.group("sp")
            found += [Number(s, name) for s in re.findall(_NUM, m.group("list"))]
        header_unit = _header_unit(unit.header, i)
        if header_unit:
            rest = NUMBER_WITH_UNIT.sub(" ", plain)
            found += [Number(m.group(0), header_unit) for m in BARE_NUMBER.finditer(rest)]
    return found


def _header_unit(header: list[str] | None, column: int) -> str | None:
    if header is None or column >= len(header):
        return None
    m = HEADER_UNIT.search(_plain(header[column]))
    if m is None:
        return None
    return {"(s)": "s"}.get(m.group(0), m.group(0))


def _load(path: Path) -> tuple[dict | None, str | None]:
    """A cited results file, or why it cannot back anything."""
    if not path.is_file():
        return None, f"cites {path.name}, which does not exist (save the bench's --json output there)"
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        return None, f"cites {path.name}, which is not JSON ({exc})"
    if not isinstance(doc, dict) or not isinstance(doc.get("recorded_with"), dict):
        return None, (f"cites {path.name}, which has no 'recorded_with' settings: write it with "
                      "flashpage.bench.record.dumps (the command, commit, versions and CPU of the run)")
    return doc, None


def _found(number: Number, results: Results) -> bool:
    tol = number.half_step
    if results.has_value(number.value, tol, SCALES[number.unit]):
        return True
    return number.unit == "x" and results.has_ratio(number.value, tol)


def check_page(text: str, base: Path, name: str = "page") -> list[str]:
    """Problems of one page: uncited bench numbers, numbers its cited files do not hold, bad citations."""
    problems: list[str] = []
    for unit in split_units(text):
        numbers = bench_numbers(unit)
        targets = [m.group("target") for m in CITATION.finditer(unit.text)]
        if not numbers:
            continue
        where = f"{name}:{unit.line}"
        if not targets:
            shown = ", ".join(f"{n.shown}{n.unit}" for n in numbers[:4])
            problems.append(f"{where}: bench numbers ({shown}) without a [results](results/<slug>.json) citation")
            continue
        results = Results()
        for target in targets:
            doc, why = _load(base / target)
            if why:
                problems.append(f"{where}: {why}")
            else:
                results.add(doc)
        problems += [f"{where}: {n.shown}{'' if n.unit in 'x%' else ' '}{n.unit} is in none of {targets} "
                     f"(as a value rounded to the decimals shown{', or a quotient of two' if n.unit == 'x' else ''})"
                     for n in numbers if not _found(n, results)]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_bench_number_is_backed(page: Path) -> None:
    problems = check_page(page.read_text(), page.parent, page.relative_to(ROOT).as_posix())
    assert not problems, "\n".join(problems)


def test_stored_results_carry_their_settings() -> None:
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        doc, why = _load(path)
        assert why is None, why
        assert doc["recorded_with"].get("command"), f"{path.name}: recorded_with has no command"


# --- the checker itself, on a synthetic page ---------------------------------------------------------------

def _synthetic(tmp_path: Path, body: str) -> list[str]:
    (tmp_path / "results").mkdir(exist_ok=True)
    doc = {"tok_s": [416.24, 381.5], "ttft_s": 0.0681, "kv_bytes": 14050918, "hit_rate": 0.8951,
           "recorded_with": {"command": "flashpage bench engine --json"}}
    (tmp_path / "results" / "run.json").write_text(json.dumps(doc))
    return check_page(body, tmp_path)


def test_checker_passes_backed_numbers(tmp_path: Path) -> None:
    body = ("Throughput 416.2 tok/s against 381.5 tok/s, 1.09x ([results](results/run.json)); TTFT 68.1 ms,\n"
            "89.5% hits, KV 13.4 MiB, range 381.5-416.2 tok/s; settings `--num-prompts 64 --rate 4.5` exempt,\n"
            "as are 48 requests and 2 threads.\n\n"
            "| system | output tok/s | ratio |\n|---|---|---|\n"
            "| flashpage | 416.2 | 1.09x [results](results/run.json) |\n")
    assert _synthetic(tmp_path, body) == []


def test_checker_fails_a_wrong_number(tmp_path: Path) -> None:
    problems = _synthetic(tmp_path, "Throughput 417.2 tok/s ([results](results/run.json)).\n")
    assert len(problems) == 1 and "417.2 tok/s" in problems[0]


def test_checker_fails_a_wrong_ratio_and_a_wrong_range_end(tmp_path: Path) -> None:
    problems = _synthetic(tmp_path, "1.50x, 381.5-420.0 tok/s [results](results/run.json)\n")
    assert len(problems) == 2 and "1.50x" in problems[0] and "420.0" in problems[1]


def test_checker_fails_a_wrong_bare_number_in_a_unit_column(tmp_path: Path) -> None:
    body = "| system | output tok/s |\n|---|---|\n| flashpage | 999.9 [results](results/run.json) |\n"
    problems = _synthetic(tmp_path, body)
    assert len(problems) == 1 and "999.9" in problems[0]


def test_checker_fails_an_uncited_number(tmp_path: Path) -> None:
    problems = _synthetic(tmp_path, "Throughput 416.2 tok/s on this host.\n\n| a | b |\n|---|---|\n| x | 4.01x |\n")
    assert len(problems) == 2 and all("without a [results]" in p for p in problems)


def test_checker_fails_a_missing_or_unrecorded_file(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "bare.json").write_text(json.dumps({"tok_s": 416.2}))
    problems = check_page("416.2 tok/s [results](results/bare.json) [results](results/gone.json)\n", tmp_path)
    assert any("recorded_with" in p for p in problems) and any("does not exist" in p for p in problems)


def test_checker_takes_ratios_of_related_values_only(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    doc = {"flashpage": {"tok_s": 416.24, "ttft_ms": 52.0}, "vllm": {"tok_s": 381.5, "ttft_ms": 44.0},
           "recorded_with": {"command": "flashpage bench engine --json", "load": 4.0}}
    (tmp_path / "results" / "run.json").write_text(json.dumps(doc))
    cite = " [results](results/run.json)\n"
    assert check_page("1.09x the throughput, 1.18x the TTFT" + cite, tmp_path) == []  # same key, two systems
    problems = check_page("8.00x, 13.00x" + cite, tmp_path)  # 416.24 / 52.0 (unrelated); 52.0 / 4.0 (settings)
    assert len(problems) == 2


def test_record_says_how_a_result_was_made(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashpage.bench import record

    for name in [k for k in os.environ if k.startswith(("FLASHPAGE_", "VLLM_CPU_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("FLASHPAGE_CPU_ATTENTION", "reference")
    monkeypatch.setattr("sys.argv", ["/venv/bin/flashpage", "bench", "kernels", "--quick", "--json"])
    doc = json.loads(record.dumps({"paged_ms": 1.5}))
    rec = doc["recorded_with"]
    assert doc["paged_ms"] == 1.5
    env = "FLASHPAGE_CPU_ATTENTION=reference OMP_NUM_THREADS=1"
    assert rec["command"] == f"{env} flashpage bench kernels --quick --json"
    assert rec["torch"] and rec["transformers"] and rec["python"] and rec["cpu"]["logical_cpus"] >= 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rec["date_utc"])
    assert rec["flashpage_commit"] is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", rec["flashpage_commit"])
