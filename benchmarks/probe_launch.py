"""Where the host time of one eager ``fused_moe()`` call goes on CUDA, and what a Triton launch costs.

    python benchmarks/probe_launch.py [--shapes qwen3 mixtral deepseek_v3] [--ms 1 32] [--calls 300]

Three parts, all on the host clock (``time.perf_counter``), no synchronisation between calls (the
GPU runs far less than the host at these sizes, so the host sets the pace):

1. *whole call*: one eager ``fused_moe()`` per call (the direct call plain eager inference takes),
   and the same through ``torch.ops.moe_compile.fused_moe`` (what a compiled graph without CUDA
   graphs calls); the mean of ``--calls`` calls after a warm-up, best of 3 rounds.
2. *breakdown*: the same direct calls with timers wrapped around Triton's ``JITFunction.run`` (the
   whole ``kernel[grid](...)`` launch), the compiled kernel's launcher (``CudaLauncher.__call__``,
   the C launch with its TMA descriptor handling) and each of our stages; inclusive µs per call.
3. *one launch*: an empty Triton kernel with this op's argument mix (a GEMM's 29 runtime arguments
   and 24 constexprs) launched through ``kernel[grid](...)``, through ``launch.launcher`` (ours:
   the compiled kernel looked up by our own key), and through the compiled kernel's ``run``
   directly (the floor of any Python-side launcher); also ``torch.empty`` on CUDA.

``--fast both`` (the default) runs parts 1-2 with ``moe_compile``'s launch cache off and on, alternated.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton.language as tl  # the kernel below resolves its annotations here

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_eager_call import op_call  # noqa: E402
from bench_moe_layer import SHAPES  # noqa: E402

from moe_compile import fused_moe  # noqa: E402
from moe_compile.kernels.triton import launch as launch_mod  # noqa: E402


def per_call_us(fn, calls: int, rounds: int = 3) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def make_inputs(shape, m: int):
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h ** -0.5).bfloat16().transpose(1, 2)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i ** -0.5).bfloat16().transpose(1, 2)
    x = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(m, e, device="cuda", generator=gen).bfloat16()
    return x, logits, w13, w2


class Timers:
    """Inclusive perf_counter time of wrapped callables, keyed by name (re-entrant calls counted once)."""

    def __init__(self):
        self.total = defaultdict(float)
        self.count = defaultdict(int)
        self.depth = defaultdict(int)
        self.undo = []

    def wrap(self, owner, attr: str, name: str):
        orig = getattr(owner, attr)

        @functools.wraps(orig)
        def timed(*args, **kwargs):
            self.depth[name] += 1
            start = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.depth[name] -= 1
                if self.depth[name] == 0:
                    self.total[name] += time.perf_counter() - start
                    self.count[name] += 1

        setattr(owner, attr, timed)
        self.undo.append((owner, attr, orig))

    def restore(self):
        for owner, attr, orig in reversed(self.undo):
            setattr(owner, attr, orig)
        self.undo.clear()


def breakdown(fn, calls: int) -> dict:
    import triton.runtime.jit as jit
    from triton.runtime import driver

    import moe_compile.kernels.triton.experts as experts
    import moe_compile.lowering.cuda as cuda_lowering
    import moe_compile.ops.custom_op as custom_op

    fused_mod = importlib.import_module("moe_compile.ops.fused_moe")  # the package re-exports the function

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    timers = Timers()
    timers.wrap(jit.JITFunction, "run", "triton JITFunction.run (kernel[grid])")
    timers.wrap(driver.active.launcher_cls, "__call__", "  of which the compiled launcher")
    timers.wrap(launch_mod, "_direct", "ours: cached launch (hits)")
    timers.wrap(fused_mod, "validate_tensors", "fused_moe: validate_tensors")
    timers.wrap(fused_mod, "validate_scalars", "fused_moe: validate_scalars")
    timers.wrap(custom_op, "fused_moe_impl", "fused_moe_impl (config + lowering)")
    timers.wrap(cuda_lowering.CudaLowering, "run", "CudaLowering.run")
    timers.wrap(cuda_lowering.CudaLowering, "select_experts", "  select_experts (route)")
    timers.wrap(experts, "fused_experts", "  fused_experts")
    for mod_name, attr in (("gemm", "moe_gemm"), ("combine", "combine"), ("align", "align"),
                           ("gemv", "gemv_experts"), ("decode", "decode_experts")):
        if hasattr(experts, attr):
            timers.wrap(experts, attr, f"    {attr}")
    timers.wrap(experts, "plan_for", "    plan_for")
    timers.wrap(torch, "empty", "torch.empty (python-level calls)")
    try:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        wall = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
    finally:
        timers.restore()
    rows = {name: dict(us=timers.total[name] / calls * 1e6, per_call=timers.count[name] / calls)
            for name in timers.total}
    return dict(wall_us=wall, rows=rows)


def one_launch_figures(reps: int = 2000) -> dict:
    import triton

    @triton.jit
    def _empty(a, b, c, d, e, f, g, h, w_desc, a_desc, n0, n1, n2, n3, n4, n5, s0, s1, s2, s3, s4, s5, s6, s7, s8,
               s9, s10, f0, f1, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
               C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr,
               C9: tl.constexpr, C10: tl.constexpr, C11: tl.constexpr, C12: tl.constexpr, C13: tl.constexpr,
               C14: tl.constexpr, C15: tl.constexpr, C16: tl.constexpr, C17: tl.constexpr, C18: tl.constexpr,
               C19: tl.constexpr, C20: tl.constexpr, C21: tl.constexpr, C22: tl.constexpr, C23: tl.constexpr):
        pass

    t = torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16)
    args = (t, t, t, t, t, t, t, t, None, None, 128, 768, 2048, 8, 1536, 0, 2048, 1, 1536, 1, 2048, 0, 0, 768, 0,
            768, 1, 0.0, 0.0)
    consts = {f"C{i}": (i % 3 == 0) if i < 12 else 16 * (i + 1) for i in range(24)}
    consts.update(num_warps=4, num_stages=3)
    out = {}
    grid = (1,)
    _empty[grid](*args, **consts)
    compiled = _empty.run(*args, grid=grid, warmup=False, **consts)
    stream = torch.cuda.current_stream().cuda_stream
    from triton import knobs

    full = args + tuple(consts[f"C{i}"] for i in range(24))
    fns = {
        "kernel[grid](...)": lambda: _empty[grid](*args, **consts),
        "launch.launcher (ours)": lambda: launch_mod.launch(_empty, grid, *args, **consts),
        "compiled.run(...) directly": lambda: compiled.run(1, 1, 1, stream, compiled.function,
                                                           compiled.packed_metadata, None,
                                                           knobs.runtime.launch_enter_hook,
                                                           knobs.runtime.launch_exit_hook, *full),
        "torch.empty(1, 2048) cuda": lambda: torch.empty(1, 2048, device="cuda", dtype=torch.bfloat16),
    }
    for name, fn in fns.items():
        out[name] = per_call_us(fn, reps)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3", "mixtral", "deepseek_v3"], choices=list(SHAPES))
    parser.add_argument("--ms", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--fast", choices=["both", "on", "off"], default="both")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_launch.py needs CUDA")
        return 1
    result = {"one_launch_us": one_launch_figures(), "points": []}
    for name, us in result["one_launch_us"].items():
        print(f"one launch: {name:32s} {us:8.2f} us")
    sides = {"both": (False, True), "on": (True,), "off": (False,)}[args.fast]
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        for m in args.ms:
            x, logits, w13, w2 = make_inputs(shape, m)
            direct = lambda: fused_moe(x, logits, shape.num_experts, shape.top_k, w13, w2, **shape.routing)  # noqa
            via_op = lambda: op_call(x, logits, w13, w2, shape)  # noqa: E731
            point = dict(shape=shape_name, m=m, sides={})
            ref = None
            for _round in range(2):
                for fast in sides:
                    launch_mod.ENABLED = fast
                    got = direct()
                    if ref is None:
                        ref = got.clone()
                    elif not torch.equal(got, ref):
                        raise AssertionError(f"{shape_name} M={m}: fast launch {fast} changed the result")
                    side = point["sides"].setdefault("fast" if fast else "triton", dict(direct=[], op=[]))
                    side["direct"].append(per_call_us(direct, args.calls))
                    side["op"].append(per_call_us(via_op, args.calls))
            for side_name, side in point["sides"].items():
                launch_mod.ENABLED = side_name == "fast"
                side["breakdown"] = breakdown(direct, args.calls)
                print(f"\n{shape_name} M={m} launches {side_name}: direct {min(side['direct']):.1f} us "
                      f"(rounds {[round(v, 1) for v in side['direct']]}), torch.ops {min(side['op']):.1f} us; "
                      f"instrumented wall {side['breakdown']['wall_us']:.1f} us")
                for row, v in sorted(side["breakdown"]["rows"].items(), key=lambda kv: -kv[1]["us"]):
                    print(f"    {row:45s} {v['us']:8.1f} us  ({v['per_call']:.1f} calls/call)")
            result["points"].append(point)
    launch_mod.ENABLED = True
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    stats = [(p["shape"], p["m"], min(p["sides"]["triton"]["direct"]), min(p["sides"]["fast"]["direct"]))
             for p in result["points"] if len(p["sides"]) == 2]
    if stats:
        print("\nshape | M | triton launches us | cached launches us | ratio")
        for s, m, a, b in stats:
            print(f"{s} | {m} | {a:.1f} | {b:.1f} | {a / b:.2f}")
        print(f"median ratio {statistics.median(a / b for _, _, a, b in stats):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
