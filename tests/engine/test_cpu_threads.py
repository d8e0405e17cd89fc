"""Binding CPU threads to cores (flashpage/cpu_threads.py) and ``flashpage serve --cpu-bind``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from flashpage import cpu_threads as ct

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")


@pytest.mark.parametrize(("spec", "cores"), [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0-1,5,7-8", (0, 1, 5, 7, 8))])
def test_parse_and_format_round_trip(spec: str, cores: tuple[int, ...]) -> None:
    assert ct.parse_cores(spec) == cores
    assert ct.format_cores(cores) == spec


@pytest.mark.parametrize("spec", ["a", "3-1", "0,0", "-1", "1-"])
def test_bad_core_lists_name_the_problem(spec: str) -> None:
    with pytest.raises(ValueError, match="CPU cores"):
        ct.parse_cores(spec)


def test_auto_binds_fewer_threads_than_cores_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ct, "usable_cores", lambda: (2, 3, 5, 7))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert ct.choose_cores("auto")[0] == (2, 3)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    cores, why = ct.choose_cores("auto")
    assert cores == () and "every one of the 4 usable cores" in why
    assert ct.choose_cores("none")[0] == ()
    with pytest.raises(ValueError, match="not usable by this process"):
        ct.choose_cores("0-2")


@linux_only
def test_binding_restricts_every_thread_and_undo_restores() -> None:
    core = ct.usable_cores()[-1]
    before_threads, before_cores = torch.get_num_threads(), os.sched_getaffinity(0)
    started, release = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def worker() -> None:  # a thread that exists before binding, like an OpenMP pool thread
        started.set()
        release.wait(10)
        seen["worker"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    started.wait(10)
    with ct.bound_cpu_threads([core]) as binding:
        assert binding.bound and binding.cores == (core,) and torch.get_num_threads() == 1
        assert os.sched_getaffinity(0) == {core}
        release.set()
        t.join(10)
        assert seen["worker"] == {core}
        assert f"cores {core}" in binding.describe()
    assert torch.get_num_threads() == before_threads
    assert os.sched_getaffinity(0) == before_cores


@linux_only
def test_serve_refuses_a_bad_core_list_before_loading() -> None:
    proc = subprocess.run([sys.executable, "-m", "flashpage.cli", "serve", "--cpu-bind", "0-x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "CPU cores '0-x'" in proc.stderr and "'0-3,6'" in proc.stderr


def test_serve_cpu_bind_is_checked_before_loading() -> None:
    from flashpage import cli

    assert cli._serve_cpu_bind(None, ranks=1) in ("auto", __import__("os").environ.get(ct.ENV))
    assert cli._serve_cpu_bind(None, ranks=2) == "none"
    with pytest.raises(ValueError, match="tensor parallelism"):
        cli._serve_cpu_bind("0", ranks=2)
    with pytest.raises(ValueError, match="CPU cores"):
        cli._serve_cpu_bind("0-x", ranks=1)


@linux_only
def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
        except (OSError, ValueError):
            continue
    return kids


def _affinities(pid: int) -> dict[int, set[int]]:
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_serve_binds_after_the_engine_and_reports_it(engine_process: bool) -> None:
    """A real `flashpage serve --cpu-bind CORE` on the built-in model prints the binding once its
    engine is built, then serves. By default the engine process (every thread of it) is on that core; with
    --no-engine-process the engine thread is. The HTTP front (the server's process, its event loop) keeps
    the machine's cores, as vLLM's API server process does."""
    import signal
    import socket
    import time
    import urllib.request

    core = ct.usable_cores()[-1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mode = [] if engine_process else ["--no-engine-process"]
    proc = subprocess.Popen([sys.executable, "-m", "flashpage.cli", "serve", "--port", str(port), "--cpu-bind",
                             str(core), "--log-level", "warning", *mode], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise AssertionError("flashpage serve did not start")
        front = _affinities(proc.pid)
        assert front[proc.pid] == set(ct.usable_cores())  # the main thread: the event loop
        if engine_process:
            assert set(map(frozenset, front.values())) == {frozenset(ct.usable_cores())}
            (engine,) = _children(proc.pid)
            assert set(map(frozenset, _affinities(engine).values())) == {frozenset({core})}
        else:
            assert {core} in front.values()  # the engine thread
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    what = "the engine process" if engine_process else "the engine thread"
    assert f"CPU 1 thread(s) bound to cores {core} (as asked): {what}" in err


@pytest.mark.parametrize(("vllm_env", "expected"), [(None, "0"), ("nobind", "none"), ("auto", "auto"), ("0-1", "0-1")])
def test_bench_binds_flashpage_as_vllm_is_told(monkeypatch: pytest.MonkeyPatch, vllm_env: str | None,
                                               expected: str) -> None:
    from flashpage.bench.vs_vllm import flashpage_bind_spec

    if vllm_env is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", vllm_env)
    assert flashpage_bind_spec(1) == expected
    if expected not in ("auto", "none"):
        ct.parse_cores(expected)  # flashpage's side accepts what vLLM is given


def test_governor_falls_to_one_thread_under_contention_and_backs_off_its_retries() -> None:
    gov = ct.ThreadGovernor()
    gov.decide(0.5, now=10.0)  # half a second of run-queue wait per thread-second: shared cores
    assert gov.reduced and gov._retry_at == 20.0
    gov.decide(0.0, now=12.0)  # free again, but before the retry time: stays on one thread
    assert gov.reduced
    gov.decide(0.0, now=20.0)
    assert not gov.reduced  # tries the caller's count
    gov.decide(0.6, now=21.0)  # still shared: back to one thread, and the next try waits twice as long
    assert gov.reduced and gov._retry_at == 41.0
    gov.decide(0.0, now=41.0)
    gov.decide(0.01, now=42.0)  # a whole window free at the caller's count: the next fall waits the least again
    gov.decide(0.4, now=43.0)
    assert gov.reduced and gov._retry_at == 53.0
    gov.decide(0.1, now=60.0)  # between the thresholds: no change
    assert gov.reduced


def test_governor_starts_on_one_thread_when_the_load_already_covers_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ct, "run_queue_wait_ns", lambda: 0)
    monkeypatch.setattr(ct, "usable_cores", lambda: (0, 1))
    monkeypatch.setattr(os, "getloadavg", lambda: (2.5, 1.0, 1.0))
    busy = ct.ThreadGovernor.for_device(torch.device("cpu"))
    assert busy.enabled and busy.reduced and busy._wait == busy.backoff_s
    monkeypatch.setattr(os, "getloadavg", lambda: (0.4, 1.0, 1.0))
    free = ct.ThreadGovernor.for_device(torch.device("cpu"))
    assert free.enabled and not free.reduced


def test_governor_steps_restore_the_callers_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gov = ct.ThreadGovernor(reduced=True)
        gov.begin()
        assert torch.get_num_threads() == 1 and gov.reduced_steps == 1
        gov.end()
        assert torch.get_num_threads() == 2
        off = ct.ThreadGovernor(enabled=False, reduced=True)
        off.begin()
        assert torch.get_num_threads() == 2 and off.reduced_steps == 0
        off.end()
        monkeypatch.setenv(ct.GOVERNOR_ENV, "0")
        assert not ct.ThreadGovernor.for_device(torch.device("cpu")).enabled
        monkeypatch.delenv(ct.GOVERNOR_ENV)
        assert not ct.ThreadGovernor.for_device(torch.device("meta")).enabled
    finally:
        torch.set_num_threads(before)


@linux_only
def test_llm_steps_drop_to_one_thread_while_the_cores_are_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake run-queue clock that says every thread waited the whole window: after the first window the
    engine's steps run on one thread (same tokens), and the caller's count is back after generate()."""
    from flashpage import LLM, SamplingParams
    from flashpage.tiny import load_tiny_model

    model, tok = load_tiny_model()
    prompts = ["the cat sat on", "a long time ago"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        reference = [o.outputs[0].token_ids for o in LLM(model, tok).generate(prompts, params, use_tqdm=False)]
        clock = {"ns": 0}

        def waiting() -> int:
            clock["ns"] += 10**10  # ten seconds more per look: far past down_at
            return clock["ns"]

        monkeypatch.setattr(ct, "run_queue_wait_ns", waiting)
        monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # starts on the caller's count
        llm = LLM(model, tok)
        llm.runner.threads.window_s = 0.0  # a verdict after every step
        threads_seen: list[int] = []
        run = llm.runner._run

        def recording(*args, **kwargs):
            threads_seen.append(torch.get_num_threads())
            return run(*args, **kwargs)

        monkeypatch.setattr(llm.runner, "_run", recording)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == reference
        assert threads_seen[:2] == [2, 2] and set(threads_seen[2:]) == {1}  # the first verdict needs two looks
        assert llm.runner.threads.reduced_steps == len(threads_seen) - 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
