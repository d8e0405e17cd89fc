"""`python -m flashpage.bench.prefill_kernel`: the prefill microbenchmark's cases, reference and report."""

from __future__ import annotations

import json

import pytest
import torch

from flashpage.bench import prefill_kernel
from flashpage.kernels import cpu_attention

pytestmark = pytest.mark.skipif(cpu_attention.status().name != "cpp", reason="no C++ compiler / ninja here")


@pytest.mark.parametrize("case", prefill_kernel.CASES)
@pytest.mark.parametrize("block_size", [16, 128])
def test_cases_are_well_formed_and_the_kernel_agrees(case, block_size):
    c = prefill_kernel.make_case(case, block_size, quick=True)
    sq = c.cu_q.diff()
    assert int(c.cu_q[-1]) == c.q.shape[0] and (sq <= c.seqlens_k).all()
    assert (c.table.long() < c.k_pages.shape[0]).all() and c.table.shape[1] * block_size >= int(c.seqlens_k.max())
    if case == "shared-prefix":  # the prefix's whole pages are the same blocks in every table
        shared = int(c.seqlens_k[0] - sq[0]) // block_size
        assert shared > 0 and (c.table[:, :shared] == c.table[0, :shared]).all()
    r = prefill_kernel.run(case, block_size, repeats=2, quick=True)
    assert r["outputs_agree"] and r["max_abs_diff"] < 1e-4 and r["cpu_ms"] >= 0 and r["gflop"] > 0


def test_reference_catches_a_wrong_output():
    c = prefill_kernel.make_case("prompts", 16, quick=True)
    out = prefill_kernel._call(c)
    assert (out.double() - prefill_kernel.reference(c)).abs().max().item() < 1e-4
    c.v_pages[c.table[0, 0].long(), 0] += 1.0  # the first key's value of the first sequence: every row of it sees it
    assert (out.double() - prefill_kernel.reference(c)).abs().max().item() > 1e-2


def test_main_prints_json_and_report(capsys):
    prefill_kernel.main(["--quick", "--case", "prompts", "--block-size", "16", "--repeats", "1", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [r["case"] for r in rows] == ["prompts"] and rows[0]["threads"] == torch.get_num_threads()
    prefill_kernel.main(["--quick", "--repeats", "1"])
    text = capsys.readouterr().out
    assert text.count("GFLOP/s") == 4 and "shared-prefix" in text
