"""`flashpage serve` and `flashpage bench serve` on the command line: help and bad values (exit 2
with a message naming the option), before any model is loaded."""

from __future__ import annotations

import pytest

from flashpage.cli import main


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_serve_help_lists_server_and_engine_options(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "serve")
    for option in ("--model", "--host", "--port", "--served-model-name", "--chat-template", "--max-waiting-requests",
                   "--drain-timeout", "--max-engine-restarts", "--max-num-seqs", "--num-blocks", "--block-size",
                   "--max-model-len", "--no-enable-prefix-caching", "--dtype", "--device"):
        assert option in text, option
    assert "serve" in _help(capsys)
    text = _help(capsys, "bench", "serve")
    for option in ("--base-url", "--request-rates", "--num-prompts", "--max-tokens", "--no-transformers", "--plot"):
        assert option in text, option


@pytest.mark.parametrize(("argv", "message"), [
    (["--chat-template", "/no/such/template.jinja"], "--chat-template /no/such/template.jinja: no such file"),
    (["--model", "./no-such-checkpoint"], "--model ./no-such-checkpoint: no such directory"),
    (["--dtype", "float33"], "--dtype float33: not a torch dtype"),
    (["--max-engine-restarts", "-1"], "--max-engine-restarts must be a number of restarts >= 0; got -1"),
    (["--no-engine-process", "--max-engine-restarts", "2"], "--max-engine-restarts 2: only an engine process"),
], ids=["chat-template", "model", "dtype", "max-engine-restarts", "max-engine-restarts-thread"])
def test_serve_bad_values_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["serve", "--port", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashpage serve: error:") and message in err


def test_free_port_skips_ports_already_handed_out(monkeypatch) -> None:
    """`serve -tp N` picks torchrun's rendezvous port with bind(0) (and the vLLM serve bench two server ports);
    the kernel can hand back a port just released (the HTTP port a caller probed as free), so that one is
    skipped."""
    from flashpage.serve import ports

    handed = iter([5000, 5000, 5001])

    class FakeSocket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, addr):
            pass

        def getsockname(self):
            return ("127.0.0.1", next(handed))

    monkeypatch.setattr(ports.socket, "socket", FakeSocket)
    assert ports.free_port(avoid=(5000,)) == 5001


def test_serve_restarts_a_dead_engine_process_3_times_by_default() -> None:
    from flashpage.cli import _serve_max_engine_restarts

    assert _serve_max_engine_restarts(None, True) == 3
    assert _serve_max_engine_restarts(0, True) == 0
    assert _serve_max_engine_restarts(None, False) == 3  # unused: a thread engine is never restarted


FRONT_PROBE = """
import json, os, signal, sys, threading, time
import httpx
from flashpage.cli import main

url = "http://127.0.0.1:%d"
seen = {}

def client():
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    body = {"model": "flashpage-tiny", "max_tokens": 4, "temperature": 0}
    text = {**body, "prompt": "The list"}
    seen["completion"] = httpx.post(url + "/v1/completions", json=text, timeout=60).status_code
    chat = {**body, "messages": [{"role": "user", "content": "hi"}]}
    seen["chat"] = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code
    seen["metrics"] = httpx.get(url + "/metrics", timeout=10).status_code
    heavy = ("transformers.modeling_utils", "flashpage.engine.llm", "flashpage.patches.patching")
    seen["heavy"] = sorted(m for m in heavy if m in sys.modules)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=client, daemon=True).start()
code = main(["serve", "--port", "%d", "--log-level", "warning", "--max-num-seqs", "4"])
print("PROBE " + json.dumps({**seen, "code": code}))
"""


def test_serve_front_does_not_import_the_engine_or_modeling_code() -> None:
    """`flashpage serve`'s HTTP front (its engine runs in another process) answers completions, chat and
    /metrics without importing `flashpage.LLM`, the patches or transformers' modeling code (about 90 MiB of
    the front's RSS on CPU: the serve tree's peak memory in `flashpage bench memory`)."""
    import json
    import subprocess
    import sys

    from flashpage.serve.ports import free_port

    port = free_port()
    proc = subprocess.run([sys.executable, "-c", FRONT_PROBE % (port, port)], capture_output=True, text=True,
                          timeout=300, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    seen = json.loads(line[len("PROBE "):])
    assert seen == {"completion": 200, "chat": 200, "metrics": 200, "heavy": [], "code": 0}, proc.stderr[-4000:]
