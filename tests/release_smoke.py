"""Release smoke: every generate() mode and the engine, patched vs unpatched, on the installed transformers.

Run as a script (``python tests/release_smoke.py``); ``.ci/smoke`` runs it once per transformers 5.x minor
line. It is the fast, broad check (a few seconds a release): each ``generate()`` mode transformers offers
on a patched model (greedy, seeded sampling, beam search, assisted decoding, prompt lookup, early exit
(self-speculation), ``output_attentions``
with ``return_dict_in_generate``, a returned cache continued by a second call) must give exactly the unpatched
model's tokens, and ``LLM`` must give ``generate()``'s greedy tokens; on llama and mistral (sliding window),
plus the patch of the families with their own attention code (falcon, gpt2, gpt_neox) and a hybrid model.
Every check prints one line; the script exits 1 if any fails (a crash counts as a failure, with its traceback).
The thorough per-feature tests are ``tests/patches/test_patch_generate.py`` and friends (CI runs them on fewer
releases).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_zoo import tiny_hybrid  # noqa: E402
from model_zoo import EOS, left_padded_batch, tiny_model  # noqa: E402

import flashpage  # noqa: E402
from flashpage.patches import UnsupportedModelError  # noqa: E402
from flashpage.patches.compat import cache_kwarg  # noqa: E402

MAX_NEW = 10


def _same(ref: torch.Tensor, got: torch.Tensor, what: str) -> None:
    if not torch.equal(ref, got):
        raise AssertionError(f"{what}: patched tokens differ from unpatched\n{ref}\n{got}")


class SameError(Exception):
    """transformers itself fails this mode on this release, and the patched model fails the same way."""


NOTES: list[str] = []  # what a check compared against, where not the unpatched run of the same call


def _ab(model: torch.nn.Module, run: Callable[[], Any], also: tuple[torch.nn.Module, ...] = (),
        fallback: Callable[[], Any] | None = None) -> tuple[Any, Any]:
    """``run()`` unpatched, then with ``model`` (and ``also``) patched; everything unpatched afterwards.

    Where the unpatched run raises (transformers' own bug on this release): with ``fallback`` (an unpatched call
    that must give the same tokens, e.g. plain greedy for greedy speculative decoding) that is the reference;
    without, the patched run must raise the same exception type (transformers' error, not flashpage's), and
    :class:`SameError` says so."""
    torch.manual_seed(0)
    error: Exception | None = None
    try:
        ref = run()
    except Exception as exc:  # noqa: BLE001 - transformers' own failure is the reference
        error, ref = exc, None
    for m in (model, *also):
        flashpage.patch(m)
    try:
        torch.manual_seed(0)
        got = run()
    except Exception as exc:
        if error is not None and type(exc) is type(error):
            raise SameError(f"unpatched transformers fails too: {type(error).__name__}: {error}") from exc
        raise
    finally:
        for m in (model, *also):
            flashpage.unpatch(m)
    if error is not None:
        if fallback is None:
            raise AssertionError(f"unpatched raised {type(error).__name__}: {error}, patched returned") from error
        NOTES.append(f"unpatched fails ({type(error).__name__}); checked against the plain greedy tokens")
        torch.manual_seed(0)
        ref = fallback()
    return ref, got


def _sequences(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.sequences


def generate_modes(family: str) -> dict[str, Callable[[], None]]:
    """One check per generate() mode on a tiny ``family`` model."""
    model = tiny_model(family)
    ids, mask = left_padded_batch([5, 11, 8])
    batch = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    one = dict(input_ids=ids[1:2], attention_mask=mask[1:2], max_new_tokens=MAX_NEW)

    def check(kwargs: dict[str, Any], what: str, also: tuple[torch.nn.Module, ...] = ()) -> Callable[[], None]:
        drafting = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
        speculative = any(k in kwargs for k in drafting)
        plain = {k: v for k, v in kwargs.items() if k not in drafting}

        def run() -> None:  # greedy speculative decoding gives plain greedy's tokens: the fallback reference
            ref, got = _ab(model, lambda: model.generate(**kwargs), also,
                           (lambda: model.generate(**plain)) if speculative else None)
            _same(_sequences(ref), _sequences(got), f"{family} {what}")
            if kwargs.get("output_attentions"):
                if not got.attentions or any(a is None for step in got.attentions for a in step):
                    raise AssertionError(f"{family} {what}: no attention weights returned")
        return run

    assistant = tiny_model(family, seed=1)

    def continued() -> None:
        def run() -> torch.Tensor:
            first = model.generate(**batch, do_sample=False, return_dict_in_generate=True)
            cache = flashpage.returned_cache(first)
            attention = torch.cat([mask, torch.ones_like(first.sequences[:, ids.shape[1]:])], dim=1)
            return model.generate(input_ids=first.sequences, attention_mask=attention, max_new_tokens=4,
                                  do_sample=False, **{cache_kwarg(model): cache})
        ref, got = _ab(model, run)
        _same(ref, got, f"{family} continued cache")

    return {
        "greedy": check({**batch, "do_sample": False}, "greedy"),
        "sampling": check({**batch, "do_sample": True, "temperature": 0.9, "top_k": 20, "top_p": 0.9}, "sampling"),
        "beam search": check({**batch, "do_sample": False, "num_beams": 3}, "beam search"),
        "assisted": check({**one, "do_sample": False, "assistant_model": assistant}, "assisted", (assistant,)),
        "prompt lookup": check({**one, "do_sample": False, "prompt_lookup_num_tokens": 3}, "prompt lookup"),
        "early exit": check({**one, "do_sample": False, "assistant_early_exit": 1}, "early exit"),
        "output_attentions": check({**batch, "do_sample": False, "output_attentions": True,
                                    "return_dict_in_generate": True}, "output_attentions"),
        "assisted+attentions": check({**one, "do_sample": False, "assistant_model": assistant,
                                      "output_attentions": True, "return_dict_in_generate": True},
                                     "assisted+attentions", (assistant,)),
        "continued cache": continued,
    }


def engine(family: str) -> None:
    """LLM's greedy tokens equal patched generate()'s, request by request."""
    model = tiny_model(family)
    ids, mask = left_padded_batch([5, 11, 8])
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    refs = [model.generate(input_ids=torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(p):]
            for p in prompts]
    llm = flashpage.LLM(model)
    params = flashpage.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=False, stop_token_ids=[EOS])
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, ref, out in zip(prompts, refs, outs, strict=True):
        want = ref.tolist()
        if EOS in want:
            want = want[: want.index(EOS) + 1]
        got = list(out.token_ids)
        if got != want:
            raise AssertionError(f"{family} LLM: prompt {p}: {got} != generate()'s {want}")


def patched_greedy(family: str, build: Callable[[str], torch.nn.Module] = tiny_model,
                   **extra: Any) -> Callable[[], None]:
    """Greedy (with ``extra`` generate() options) patched == unpatched; a clear refusal by ``patch()`` passes."""
    def run() -> None:
        try:
            model = build(family)
        except Exception as exc:  # noqa: BLE001 - transformers' own config/model code, before flashpage
            NOTES.append(f"transformers cannot build it here: {type(exc).__name__}")
            return
        ids, mask = left_padded_batch([5, 11, 8])
        if extra:  # speculative modes: batch 1 (transformers' rule)
            ids, mask = ids[1:2], mask[1:2]
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
        try:
            ref, got = _ab(model, lambda: model.generate(**kwargs, **extra),
                           fallback=(lambda: model.generate(**kwargs)) if extra else None)
        except UnsupportedModelError as exc:
            NOTES.append(f"refused by patch(): {str(exc)[:120]}")
            return
        _same(ref, got, f"{family} greedy {extra}")
    return run


def _available(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def checks() -> dict[str, Callable[[], None]]:
    out: dict[str, Callable[[], None]] = {}
    for family in ("llama", "mistral"):
        for mode, run in generate_modes(family).items():
            out[f"{family} generate {mode}"] = run
        out[f"{family} LLM greedy"] = lambda family=family: engine(family)
    for family in ("falcon", "gpt2", "gpt_neox", "gemma2", "gpt_oss", "deepseek_v3"):
        out[f"{family} generate greedy"] = patched_greedy(family)
    for family in ("qwen3_next", "lfm2", "jamba", "falcon_h1", "mamba"):  # state layers beside (or without) pages
        if _available(family):
            out[f"{family} generate greedy"] = patched_greedy(family, tiny_hybrid)
            out[f"{family} generate prompt lookup"] = patched_greedy(family, tiny_hybrid, prompt_lookup_num_tokens=3)
    return out


def main() -> int:
    import transformers

    torch.set_num_threads(1)
    failed = 0
    ran = 0
    for name, run in checks().items():
        ran += 1
        NOTES.clear()
        try:
            with torch.inference_mode():
                run()
        except SameError as exc:
            print(f"ok   {name} ({exc})".splitlines()[0][:300])
        except Exception as exc:  # noqa: BLE001 - every failure is reported, crashes included
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}".splitlines()[0][:300])
            traceback.print_exc(limit=-4)
        else:
            print(f"ok   {name}" + "".join(f" ({note})" for note in NOTES))
    print(f"release smoke, transformers {transformers.__version__}: {ran - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
