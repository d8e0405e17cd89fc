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
