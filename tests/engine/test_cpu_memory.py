"""glibc malloc settings for CPU engine steps (flashpage/cpu_memory.py).

The settings are process-wide and cannot be undone, so whether they took is checked in fresh
interpreters, by what glibc then does with one 16 MiB ``malloc`` / ``free`` (``mallinfo2``): with
glibc's defaults it is mapped (and unmapped on free); tuned, it comes from the heap and stays there.
In this process, ``tune_malloc`` runs against a stand-in C library.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flashpage import cpu_memory as cm

ROOT = Path(__file__).resolve().parents[2]
glibc_only = pytest.mark.skipif(cm.mallinfo2() is None, reason="needs glibc >= 2.33 (mallinfo2)")
CLEARED = (cm.ENV, "LD_PRELOAD", "GLIBC_TUNABLES", *cm.MALLOC_ENVS)

PROBE = """
import json
from flashpage import cpu_memory as cm
tuning = cm.tune_malloc()
p = cm.probe()
print(json.dumps({"applied": tuning.applied, "reason": tuning.reason, "mapped": p.mapped, "kept": p.kept,
                  "again": cm.tune_malloc() is tuning}))
"""

LLM_ON_CPU = """
import json, sys
sys.path.insert(0, {tests!r})
from engine_helpers import engine_model
from flashpage import LLM
from flashpage import cpu_memory as cm
assert cm.malloc_tuning() is None
LLM(engine_model(), num_blocks=8, block_size=16)
p = cm.probe()
print(json.dumps({{"applied": cm.malloc_tuning().applied, "reason": cm.malloc_tuning().reason, "kept": p.kept}}))
"""


def _fresh(code: str, **env: str) -> dict[str, Any]:
    """Run ``code`` in a new interpreter with a malloc-neutral environment plus ``env``; its JSON line."""
    base = {k: v for k, v in os.environ.items() if k not in CLEARED}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_tuned_by_default_a_step_sized_block_stays_in_the_heap() -> None:
    r = _fresh(PROBE)
    assert r["applied"] and r["again"]
    assert not r["mapped"] and r["kept"]


@glibc_only
@pytest.mark.parametrize("env", [{cm.ENV: "system"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_opted_out_or_set_by_the_environment_glibc_keeps_its_own(env: dict[str, str]) -> None:
    r = _fresh(PROBE, **env)
    assert not r["applied"] and r["mapped"] and not r["kept"]
    assert next(iter(env)) in r["reason"]


@glibc_only
def test_an_llm_on_cpu_applies_it() -> None:
    r = _fresh(LLM_ON_CPU.format(tests=str(ROOT / "tests")))  # opting out: the tests above and below
    assert r["applied"] and r["kept"] and r["reason"] == "an LLM runs on CPU"


class FakeMallopt:
    """``mallopt`` of :class:`FakeLibc`: records its calls (ctypes attributes can be set on it)."""

    def __init__(self, refuse: tuple[int, ...]) -> None:
        self.calls: list[tuple[int, int]] = []
        self.refuse = refuse
        self.argtypes: Any = None
        self.restype: Any = None

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 0 if param in self.refuse else 1


class FakeLibc:
    """A glibc stand-in that refuses the ``mallopt`` params in ``refuse``."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.mallopt = FakeMallopt(refuse)

    @property
    def calls(self) -> list[tuple[int, int]]:
        return self.mallopt.calls

    @staticmethod
    def gnu_get_libc_version() -> bytes:
        return b"2.99"


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(cm, "_done", None)  # restored afterwards: this process's real state
    for name in CLEARED:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_applied_once_per_process_and_refusals_are_reported(fresh_state: pytest.MonkeyPatch) -> None:
    libc = FakeLibc(refuse=(-1,))
    fresh_state.setattr(cm, "_libc", lambda: libc)
    first = cm.tune_malloc()
    assert cm.tune_malloc() is first and cm.malloc_tuning() is first and cm.malloc_plan() is first
    assert libc.calls == [(s.param, s.value) for s in cm.SETTINGS]  # once, not twice
    assert first.applied and [s.name for s in first.settings] == ["M_MMAP_THRESHOLD"]
    assert first.refused == ("M_TRIM_THRESHOLD",) and "refused M_TRIM_THRESHOLD" in first.describe()


def test_not_glibc_is_a_no_op(fresh_state: pytest.MonkeyPatch) -> None:
    fresh_state.setattr(cm, "_libc", lambda: None)
    assert cm.glibc_version() is None and cm.mallinfo2() is None and cm.probe() is None
    plan = cm.malloc_plan()
    assert not plan.applied and not plan.settings and "not glibc" in plan.describe()
    done = cm.tune_malloc()
    assert not done.applied and not done.settings and done.glibc is None and "not glibc" in done.reason


@pytest.mark.parametrize(("env", "why"), [({cm.ENV: "system"}, "FLASHPAGE_MALLOC=system"),
                                          ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "jemalloc"),
                                          ({"MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX")])
def test_left_alone_never_calls_mallopt(fresh_state: pytest.MonkeyPatch, env: dict[str, str], why: str) -> None:
    libc = FakeLibc()
    fresh_state.setattr(cm, "_libc", lambda: libc)
    for k, v in env.items():
        fresh_state.setenv(k, v)
    done = cm.tune_malloc()
    assert not done.applied and why in done.reason and libc.calls == []


def test_an_unknown_choice_is_refused_and_info_says_so(fresh_state: pytest.MonkeyPatch) -> None:
    from flashpage.info import collect_info, format_info

    fresh_state.setattr(cm, "_libc", lambda: FakeLibc())
    fresh_state.setenv(cm.ENV, "jemalloc")
    with pytest.raises(ValueError, match="FLASHPAGE_MALLOC='jemalloc': expected one of tuned, system"):
        cm.tune_malloc()
    assert "expected one of tuned, system" in collect_info()["cpu_malloc"]
    fresh_state.delenv(cm.ENV)
    info = collect_info()
    assert "M_MMAP_THRESHOLD=32 MiB, M_TRIM_THRESHOLD=1 GiB" in info["cpu_malloc"]
    assert "CPU malloc: glibc 2.99: an LLM on CPU sets" in format_info(info)


# ------------------------------------------------------------------ page_out: file-backed pages handed back
def _mapping_rss(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_PAGEOUT): Linux")
def test_page_out_releases_a_file_backed_tensor_and_it_reads_back(tmp_path: Path) -> None:
    """A tensor saved with safetensors and mapped privately (as transformers loads a checkpoint in its own
    dtype): paging it out shrinks that mapping's resident pages, and reading it again gives the same values.
    An anonymous tensor gains nothing (0 bytes advised)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(2048, 1024)}, str(path))
    with safe_open(str(path), "pt") as f:
        want = f.get_tensor("w").clone()  # a copy in anonymous memory
    with path.open("rb") as f:
        header = int.from_bytes(f.read(8), "little")
        offset = json.loads(f.read(header))["w"]["data_offsets"][0] + 8 + header
    import mmap

    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    t = torch.frombuffer(mapped, dtype=torch.float32, offset=offset, count=want.numel()).view(want.shape)
    assert torch.equal(t, want)  # every page read: resident
    before = _mapping_rss(path)
    assert before >= want.nbytes - 4096
    advised = cm.page_out([t])
    if advised == 0:
        pytest.skip("the kernel refused MADV_PAGEOUT (Linux < 5.4)")
    assert advised >= want.nbytes - 2 * 4096
    assert _mapping_rss(path) < before - want.nbytes // 2
    assert torch.equal(t, want)  # read back from the file
    assert cm.page_out([want]) == 0  # anonymous memory: not advised
    del t
    mapped.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise: Linux")
def test_page_out_keep_cached_reads_back_without_the_file_and_keeps_written_pages(tmp_path: Path) -> None:
    """``keep_cached``: the mapping's resident pages shrink as with MADV_PAGEOUT, but reading the tensor again
    maps the pages back from the page cache (no major fault); a page this process wrote (copy on write) keeps
    what was written, which a plain MADV_DONTNEED would drop for the file's bytes."""
    import mmap
    import resource

    import torch
    from safetensors.torch import save_file

    path = tmp_path / "e.safetensors"
    want = torch.randn(2048, 1024)
    save_file({"e": want}, str(path))
    with path.open("rb") as f:
        header = int.from_bytes(f.read(8), "little")
        offset = json.loads(f.read(header))["e"]["data_offsets"][0] + 8 + header
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    t = torch.frombuffer(mapped, dtype=torch.float32, offset=offset, count=want.numel()).view(want.shape)
    assert torch.equal(t, want)
    with torch.no_grad():
        t[1000].fill_(7.0)  # copy on write (a row of 1024 float32 is one 4 KiB page): the file keeps the old row
    want[1000] = 7.0
    before = _mapping_rss(path)
    advised = cm.page_out([t], keep_cached=True)
    assert advised >= want.nbytes - 4 * 4096, advised  # every page but the written one (and the unaligned ends)
    assert _mapping_rss(path) < before - want.nbytes // 2
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    assert torch.equal(t, want)  # the written row kept; the others mapped back from the page cache
    assert resource.getrusage(resource.RUSAGE_SELF).ru_majflt == faults
    del t
    mapped.close()


@glibc_only
def test_the_c_library_is_opened_once_per_process() -> None:
    """Each ``ctypes.CDLL`` is a reference cycle (it caches its functions on itself), so one per call left garbage
    behind every LLM construction (dozens of them) until the cyclic collector ran."""
    import ctypes
    import gc

    def open_libraries() -> int:
        return sum(isinstance(o, ctypes.CDLL) for o in gc.get_objects())

    cm.glibc_version()
    gc.collect()
    gc.disable()
    try:
        before = open_libraries()
        for _ in range(5):
            assert cm.glibc_version() and cm.mallinfo2() is not None
            cm.malloc_plan()
            cm.trim_heap()
        assert open_libraries() == before
    finally:
        gc.enable()
