"""The Triton kernels compile to sm_90 (H100/H200) cubins, without a GPU.

CI has no GPU, so a kernel that only ever ran under Triton's interpreter there could still fail to
compile for the device. ``python -m moe_compile.kernels.triton.aot`` compiles the kernel's variants
(sorted / pair blocks / batched rows, gather, bias, expert map, TMA descriptors) for Hopper with
the ptxas shipped in the triton wheel, in a subprocess without ``TRITON_INTERPRET``, and every
kernel launch of the interpreted ``selfcheck --device cuda`` likewise. This checks
that the code compiles, not what it computes (the interpreter tests and the H200 runs do that).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from moe_compile.kernels.triton import interpreter_problem  # noqa: E402
from moe_compile.kernels.triton.aot import GEMV_VARIANTS, ROUTER_VARIANTS, VARIANTS  # noqa: E402


def _ptxas_available() -> bool:
    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return shipped.exists() or shutil.which("ptxas") is not None


@pytest.fixture(scope="module")
def compiled():
    if not _ptxas_available():
        pytest.skip("no ptxas to compile for sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "moe_compile.kernels.triton.aot", "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", list(VARIANTS) + list(ROUTER_VARIANTS) + list(GEMV_VARIANTS))
def test_moe_gemm_kernel_compiles_for_sm90(compiled, variant):
    size = compiled[variant]
    assert isinstance(size, int) and size > 10_000, size


def test_every_launch_of_the_interpreted_selfcheck_compiles_for_sm90(compiled):
    if compiled["interpreter_failed"]:
        problem = interpreter_problem()  # a known interpreter defect of this install, or a real failure
        assert problem, f"the interpreted selfcheck failed: {compiled['interpreter_failed']}"
        pytest.skip(f"the selfcheck's launches were not recorded: {problem}")
    launches = {k: v for k, v in compiled.items() if k.startswith("launch ")}
    kernels = {k.split(": ")[1] for k in launches}
    chain = {"_route_kernel", "_sort_align_kernel", "_block_hist_kernel", "_block_scatter_kernel", "_count_kernel",
             "_scatter_kernel", "_moe_gemm_kernel", "_combine_kernel"}
    assert chain | {"_gemv_kernel"} <= kernels
    # the kernels a GPU launches with programmatic dependent launch build with it for sm_90 too
    assert {k + " +pdl" for k in chain} <= kernels
    bad = {k: v for k, v in launches.items() if not isinstance(v, int)}
    assert not bad, bad
