"""GPU benchmark scripts on a machine without CUDA: they say so and return 2 instead of failing in
their first kernel."""
import importlib
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
@pytest.mark.parametrize("script,argv", [("bench_untuned", []), ("tune_triton", ["--shape", "8,2,64,32"]),
                                         ("sweep_gemm", []), ("probe_gemv", []),
                                         ("ab_layer", ["--points", "qwen3:8"]), ("probe_capacity", []),
                                         ("probe_decode", []), ("probe_decode1", ["--models", "gemma4", "--tokens", "32"])])
def test_says_it_needs_cuda(script, argv, capsys):
    assert importlib.import_module(script).main(argv) == 2
    assert f"{script} needs a CUDA device" in capsys.readouterr().err
