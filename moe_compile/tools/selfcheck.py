"""``python -m moe_compile selfcheck --device npu``: check the NPU path on real Ascend hardware
(``--device cuda``: the CUDA kernels on this GPU, see ``selfcheck_cuda``).

1. Every torch_npu op the lowering uses runs on the device for a few cases; its output (the part
   the docs define) is compared with the CPU emulation (``testing/npu_kernels.py``) and with the
   row-by-row goldens written from the op docs (``testing/npu_goldens.py``). A table shows op,
   case, max error against each, tolerance and PASS/FAIL: a FAIL against both means the emulation
   (and so every CPU test) models the op wrongly on this torch_npu/CANN.
2. A small MoE layer runs through the NPU lowering eagerly and through TorchAir in GE mode
   (``max-autotune``) and aclgraph mode (``npugraph_ex``), compared with the CPU reference.

Without an NPU it prints why and exits with status 2. Nothing here was run on hardware by the
authors (see the README).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from moe_compile.testing import npu_goldens, npu_kernels
from moe_compile.testing.emulated_npu import npu_unavailable


@dataclass(frozen=True)
class OpCase:
    op: str
    case: str
    make: Callable[[torch.Generator], tuple[tuple, dict]]  # CPU inputs
    defined: Callable[[tuple, tuple, dict], list[torch.Tensor]]  # (outputs, args, kwargs) -> defined parts
    golden: Callable[[tuple, dict], list[torch.Tensor]]
    rtol: float = 1e-5
    atol: float = 1e-5


@dataclass(frozen=True)
class Row:
    op: str
    case: str
    err_emulation: float
    err_reference: float
    tol: str
    ok: bool
    note: str = ""


def _ids(gen, tokens, top_k, experts):
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)


def _gating_cases() -> list[OpCase]:
    def softmax_case(dtype, tokens, experts, k):
        def make(g):
            return (torch.randn(tokens, experts, generator=g).to(dtype),), {"k": k}

        return OpCase("npu_moe_gating_top_k_softmax", f"{dtype} [{tokens},{experts}] k={k}", make,
                      lambda out, a, kw: list(out),
                      lambda a, kw: list(npu_goldens.gating_top_k_softmax(a[0], kw["k"])),
                      rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)

    def topk_case(name, experts, k, **opts):
        def make(g):
            kwargs = dict(opts)
            if kwargs.pop("with_bias", False):
                kwargs["bias"] = torch.randn(experts, generator=g) * 0.1
            return (torch.randn(16, experts, generator=g), k), kwargs

        def golden(a, kw):
            keep = ("bias", "k_group", "group_count", "group_select_mode", "norm_type", "routed_scaling_factor")
            return list(npu_goldens.gating_top_k(a[0], a[1], **{n: kw[n] for n in keep if n in kw}))

        return OpCase("npu_moe_gating_top_k", name, make, lambda out, a, kw: list(out[:2]), golden)

    return [
        softmax_case(torch.float32, 16, 8, 2),
        softmax_case(torch.bfloat16, 16, 64, 6),
        topk_case("softmax groups mode0", 32, 4, k_group=2, group_count=4),
        topk_case("sigmoid bias groups mode1 x2.5", 64, 6, k_group=4, group_count=8, group_select_mode=1,
                  norm_type=1, routed_scaling_factor=2.5, with_bias=True),
    ]


def _routing_cases() -> list[OpCase]:
    def init_case(dtype, start, end):
        def make(g):
            x = torch.randn(12, 32, generator=g).to(dtype)
            return (x, _ids(g, 12, 2, 8)), dict(active_num=24, expert_num=8, expert_tokens_num_type=1,
                                                expert_tokens_num_flag=True, active_expert_range=[start, end])

        def defined(out, a, kw):
            valid = int(((a[1] >= start) & (a[1] < end)).sum())
            return [out[0][:valid], out[1], out[2]]

        return OpCase("npu_moe_init_routing_v2", f"{dtype} range [{start},{end})", make, defined,
                      lambda a, kw: list(npu_goldens.init_routing_v2(a[0], a[1], start, end, 24)))

    def permute_make(g):
        return (torch.randn(10, 16, generator=g).to(torch.bfloat16), _ids(g, 10, 3, 6)), {"num_out_tokens": 30}

    def unpermute_make(g):
        rows = torch.randn(30, 16, generator=g).to(torch.bfloat16)
        return (rows, torch.randperm(30, generator=g).to(torch.int32)), {"probs": torch.rand(10, 3, generator=g).to(torch.bfloat16)}

    def finalize_make(g):
        rows, skip = torch.randn(12, 8, generator=g), torch.randn(6, 8, generator=g)
        return (rows, skip, None, torch.randn(4, 8, generator=g), torch.rand(6, 2, generator=g),
                torch.randperm(12, generator=g).to(torch.int32), torch.randint(0, 4, (6, 2), generator=g, dtype=torch.int32)), {}

    return [
        init_case(torch.float32, 0, 8),
        init_case(torch.bfloat16, 2, 6),
        OpCase("npu_moe_token_permute", "bf16 [10,16] k=3", permute_make, lambda out, a, kw: list(out),
               lambda a, kw: list(npu_goldens.token_permute(a[0], a[1], 30))),
        OpCase("npu_moe_token_unpermute", "bf16 30 rows k=3 probs", unpermute_make, lambda out, a, kw: list(out),
               lambda a, kw: [npu_goldens.token_unpermute(a[0], a[1], kw["probs"])], rtol=2e-2, atol=2e-2),
        OpCase("npu_moe_finalize_routing", "fp32 k-major bias skip1", finalize_make, lambda out, a, kw: list(out),
               lambda a, kw: [npu_goldens.finalize_routing(*a)], rtol=1e-4, atol=1e-4),
    ]


def _mlp_cases() -> list[OpCase]:
    def gmm_case(dtype, counts):
        def make(g):
            x = torch.randn(20, 16, generator=g).to(dtype)
            w = torch.randn(len(counts), 24, 16, generator=g).to(dtype).transpose(1, 2)  # a transposed view
            bias = torch.randn(len(counts), 24, generator=g)  # fp32 (bf16 x) / x's dtype
            bias = bias if dtype == torch.bfloat16 else bias.to(dtype)
            return ([x], [w]), dict(bias=[bias], group_list=torch.tensor(counts, dtype=torch.int64),
                                    split_item=2, group_type=0, group_list_type=1)

        def golden(a, kw):
            return [npu_goldens.grouped_matmul(a[0][0], a[1][0], counts, kw["bias"][0])]

        loose = dtype == torch.bfloat16
        return OpCase("npu_grouped_matmul", f"{dtype} counts={counts} bias, transposed W", make,
                      lambda out, a, kw: [out[0][: sum(counts)]], golden,
                      rtol=2e-2 if loose else 2e-3, atol=2e-2 if loose else 2e-3)

    def swiglu_case(dtype):
        def make(g):
            return (torch.randn(8, 32, generator=g).to(dtype),), {"dim": -1}

        return OpCase("npu_swiglu", str(dtype), make, lambda out, a, kw: list(out),
                      lambda a, kw: [npu_goldens.swiglu(a[0])], rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)

    # counts summing to less than the rows: the static-EP shape ([AMBIG] the doc wants == M)
    return [gmm_case(torch.float32, [5, 0, 7, 6]), gmm_case(torch.bfloat16, [4, 6, 10]),
            swiglu_case(torch.float32), swiglu_case(torch.bfloat16)]


def op_cases() -> list[OpCase]:
    return _gating_cases() + _routing_cases() + _mlp_cases()


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _max_err(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float, atol: float) -> tuple[float, bool]:
    worst, ok = 0.0, True
    for a, b in zip(got, want):
        a, b = a.detach().cpu().double(), b.detach().cpu().double()
        if a.shape != b.shape:
            return float("inf"), False
        if a.numel():
            worst = max(worst, float((a - b).abs().max()))
            ok = ok and bool(torch.allclose(a, b, rtol=rtol, atol=atol))
    return worst, ok


def run_op_checks(ops, device, cases: list[OpCase] | None = None, seed: int = 0) -> list[Row]:
    """Run each case through ``ops.<op>`` on ``device``; compare with the emulation and the golden."""
    rows = []
    for case in cases or op_cases():
        args, kwargs = case.make(torch.Generator().manual_seed(seed))
        tol = f"rtol={case.rtol:g} atol={case.atol:g}"
        try:
            out = getattr(ops, case.op)(*_to(args, device), **_to(kwargs, device))
            out = _to(out if isinstance(out, (tuple, list)) else (out,), "cpu")
        except Exception as exc:  # report and go on: one broken op must not hide the others
            rows.append(Row(case.op, case.case, float("nan"), float("nan"), tol, False, f"{type(exc).__name__}: {exc}"))
            continue
        emulated = npu_kernels.KERNELS[case.op](*args, **kwargs)
        emulated = emulated if isinstance(emulated, (tuple, list)) else (emulated,)
        got = case.defined(tuple(out), args, kwargs)
        err_emu, ok_emu = _max_err(got, case.defined(tuple(emulated), args, kwargs), case.rtol, case.atol)
        err_ref, ok_ref = _max_err(got, case.golden(args, kwargs), case.rtol, case.atol)
        rows.append(Row(case.op, case.case, err_emu, err_ref, tol, ok_emu and ok_ref))
    return rows


def format_table(rows: list[Row]) -> str:
    header = ("op", "case", "max err vs emulation", "max err vs reference", "tolerance", "result")
    body = [(r.op, r.case, f"{r.err_emulation:.3g}", f"{r.err_reference:.3g}", r.tol,
             "PASS" if r.ok else "FAIL" + (f" ({r.note})" if r.note else "")) for r in rows]
    widths = [max(len(str(line[i])) for line in [header] + body) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def check_model(device, compilers: dict, seed: int = 0) -> list[Row]:
    """A small MoE layer through the NPU lowering (eager and each compiler) against the CPU reference."""
    from moe_compile import fused_moe

    g = torch.Generator().manual_seed(seed)
    num_experts, hidden, inter = 8, 64, 32
    cpu = [torch.randn(16, hidden, generator=g).to(torch.bfloat16), torch.randn(16, num_experts, generator=g),
           (torch.randn(num_experts, 2 * inter, hidden, generator=g) / 8).to(torch.bfloat16).transpose(1, 2),
           (torch.randn(num_experts, inter, hidden, generator=g) / 6).to(torch.bfloat16)]

    def layer(x, logits, w13, w2, lowering="npu"):
        return fused_moe(x, logits, num_experts, 2, w13, w2, renormalize=True, lowering=lowering)

    reference = layer(*cpu, lowering="cpu")
    dev = _to(cpu, device)
    runs = {"eager": layer, **{name: torch.compile(layer, backend=backend) for name, backend in compilers.items()}}
    rows = []
    for name, fn in runs.items():
        try:
            out = fn(*dev).cpu()
            err, ok = _max_err([out], [reference], 2e-2, 2e-2)
            rows.append(Row("fused_moe (model)", name, float("nan"), err, "rtol=0.02 atol=0.02", ok))
        except Exception as exc:
            rows.append(Row("fused_moe (model)", name, float("nan"), float("nan"), "", False,
                            f"{type(exc).__name__}: {exc}"))
        torch._dynamo.reset()
    return rows


def _torchair_compilers() -> dict:
    from moe_compile.lowering.torchair import compile_with_torchair

    return {mode: (lambda gm, ex, mode=mode: compile_with_torchair(gm, ex, mode))
            for mode in ("max-autotune", "npugraph_ex")}


def cuda_main(interpret: bool) -> int:
    """``--device cuda``: the CUDA kernels against their references (``selfcheck_cuda``)."""
    import os
    import subprocess

    if interpret:
        from moe_compile.kernels.triton import interpreter_problem

        problem = interpreter_problem()
        if problem:
            print(f"selfcheck --interpret cannot run here: {problem}.", file=sys.stderr)
            return 2
    if interpret and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # the flag must be set before triton is first imported (importing moe_compile imports it)
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "moe_compile", "selfcheck", "--device", "cuda", "--interpret"]
        return subprocess.run(cmd, env=env).returncode
    if not interpret and not torch.cuda.is_available():
        print("selfcheck --device cuda needs a CUDA GPU (torch.cuda.is_available() is False); "
              "--interpret runs the same checks on the CPU under Triton's interpreter.", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError as exc:
        print(f"selfcheck --device cuda needs triton ({exc}); pip install 'moe-compile[cuda]'.", file=sys.stderr)
        return 2
    from moe_compile.tools.selfcheck_cuda import format_checks, run_cuda_checks

    device = torch.device("cpu" if interpret else "cuda")
    where = "CPU, Triton interpreter" if interpret else torch.cuda.get_device_name(device)
    print(f"torch {torch.__version__}, triton {triton.__version__}, device {where}")
    checks = run_cuda_checks(device)
    print(format_checks(checks))
    failed = [c for c in checks if not c.ok]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed")
    return 0 if not failed else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_compile selfcheck")
    parser.add_argument("--device", default="npu", choices=["npu", "cuda"])
    parser.add_argument("--interpret", action="store_true",
                        help="cuda only: run the checks on the CPU under Triton's interpreter (tests the tool)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        return cuda_main(args.interpret)
    reason = npu_unavailable()
    if reason is not None:
        print(f"selfcheck --device {args.device} needs an Ascend NPU with torch_npu and CANN installed: {reason}.\n"
              "On CPU, the NPU lowering is tested against the emulation instead "
              "(pytest tests/lowering/test_npu_*.py tests/testing/test_emulated_npu*.py).", file=sys.stderr)
        return 2
    import torch_npu

    print(f"torch {torch.__version__}, torch_npu {torch_npu.__version__}, device {torch.npu.get_device_name()}")
    rows = run_op_checks(torch_npu, "npu")
    rows += check_model("npu", _torchair_compilers())
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed")
    return 0 if not failed else 1
