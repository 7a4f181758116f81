"""``selfcheck --device cuda``: every CUDA-kernel check passes (on a GPU when there is one, else
under Triton's interpreter, which is how CI tests the tool), a wrong kernel shows as FAIL, and
without a GPU the plain command says why and exits 2."""
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from moe_compile.kernels.triton import interpreter_problem  # noqa: E402
from moe_compile.tools import selfcheck, selfcheck_cuda  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETER_PROBLEM = interpreter_problem()  # "" where Triton's interpreter can run the kernels
# without a GPU these checks run under the interpreter
needs_interpreter = pytest.mark.skipif(DEVICE.type == "cpu" and bool(INTERPRETER_PROBLEM),
                                       reason=INTERPRETER_PROBLEM)


@needs_interpreter
def test_all_checks_pass():
    checks = selfcheck_cuda.run_cuda_checks(DEVICE)
    table = selfcheck_cuda.format_checks(checks)
    assert all(c.ok for c in checks), table
    names = {c.name for c in checks}
    assert {"routing", "align", "experts", "batched experts", "CUDA graph", "op graphs"} <= names, table
    assert ("routing", "sqrt-softplus + bias x1.5") in {(c.name, c.case) for c in checks}, table


@needs_interpreter
def test_a_wrong_kernel_fails(monkeypatch):
    from moe_compile.kernels.triton import experts

    real = experts.fused_experts

    def off_by_a_bit(*args, **kwargs):  # 10 %: above the bf16 tolerance on a GPU (2e-2) as well
        return real(*args, **kwargs) * 1.1

    monkeypatch.setattr(experts, "fused_experts", off_by_a_bit)
    checks = selfcheck_cuda.run_cuda_checks(DEVICE)
    failed = {(c.name, c.case) for c in checks if not c.ok}
    assert ("experts", "sorted") in failed and ("experts", "pairs") in failed, selfcheck_cuda.format_checks(checks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_the_command_says_why():
    proc = subprocess.run([sys.executable, "-m", "moe_compile", "selfcheck", "--device", "cuda"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--interpret" in proc.stderr, proc.stderr


def test_interpret_flag_says_why_when_the_interpreter_cannot_run(monkeypatch, capsys):
    import moe_compile.kernels.triton as kt

    monkeypatch.setattr(kt, "interpreter_problem", lambda: "Triton 3.6.0's interpreter cannot run ...")
    assert selfcheck.cuda_main(interpret=True) == 2
    assert "selfcheck --interpret cannot run here: Triton 3.6.0's interpreter" in capsys.readouterr().err


@pytest.mark.skipif(bool(INTERPRETER_PROBLEM), reason=INTERPRETER_PROBLEM)
def test_interpret_flag_runs_the_checks_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "moe_compile", "selfcheck", "--device", "cuda", "--interpret"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "17/17 checks passed" in proc.stdout, proc.stdout  # sqrt-softplus routing: the 16th; op graphs (n/a)


@pytest.mark.parametrize("triton_v,numpy_v,broken", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.5.0rc1", True), ("3.5.1", "2.4.0", True),
    ("3.7.0", "2.4.6", False), ("3.9.0", "2.5.2", False), ("3.6.0", "2.3.5", False)])
def test_interpreter_problem_reads_the_installed_versions(monkeypatch, triton_v, numpy_v, broken):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", {"triton": triton_v, "numpy": numpy_v}.__getitem__)
    problem = interpreter_problem.__wrapped__()  # uncached
    assert bool(problem) == broken
    if broken:
        assert f"Triton {triton_v}" in problem and f"NumPy {numpy_v}" in problem and "triton>=3.7" in problem


def test_interpreter_problem_without_triton(monkeypatch):
    import importlib.metadata

    def version(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert interpreter_problem.__wrapped__() == "triton is not installed"
