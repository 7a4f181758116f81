"""``benchmarks/probe_capacity.py``'s routing of the rows past the capacity (no GPU needed)."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_capacity  # noqa: E402


@pytest.mark.parametrize("counts,cap,top_k", [
    ([500, 530, 490, 520, 512, 510, 505, 529], 384, 2),   # Mixtral-like, every expert over C
    ([130, 100, 96, 140, 97, 120, 96, 111], 96, 8),       # top-8, some experts exactly at C
    ([0, 964, 10, 300, 256, 0, 700, 50], 256, 4),         # skewed, experts under C get nothing
])
def test_rest_rows_per_expert(counts, cap, top_k):
    counts = torch.tensor(counts)
    x, w, ids = probe_capacity.rest_problem(counts, cap, top_k, hidden=16)
    rest = (counts - cap).clamp(min=0)
    tokens = -(-int(rest.sum()) // top_k)
    assert ids.shape == (tokens, top_k) and ids.dtype == torch.int32
    assert x.shape == (tokens, 16) and x.dtype == torch.bfloat16
    assert torch.allclose(w.sum(1), torch.ones(tokens))
    got = torch.bincount(ids.flatten().long(), minlength=counts.numel())
    pad = got - rest
    assert (pad >= 0).all() and int(pad.sum()) == tokens * top_k - int(rest.sum()) < top_k
    if int(rest.max()) <= tokens:  # dealt top_k apart: a token never meets an expert twice
        assert all(len(set(row.tolist())) == top_k for row in ids)


@pytest.mark.parametrize("argv,says", [(["--caps", "0"], "--caps"), (["--caps", "-0.5"], "--caps"),
                                       (["--rounds", "0"], "--rounds"), (["--reps", "0"], "--reps")])
def test_bad_arguments_are_named(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        probe_capacity.main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err
