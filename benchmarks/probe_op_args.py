"""What the number of an op's arguments costs per call (a probe, not a product).

    python benchmarks/probe_op_args.py [--device cuda]

Two throwaway ops registered the way ``moe_compile`` registers its own (``ops/registration.py``), both with
a body that returns its first input: one with ``fused_moe``'s 28 arguments (called with them all positional,
and with the 21 scalars by keyword as Inductor's wrapper code calls it), one with its 7 tensors and the
21 scalars packed into one string (decoded by a cached ``json.loads``). Host µs per call, best of 5 rounds
of 5000 calls, with and without ``torch.inference_mode``. Twenty-ninth session's question: would an op with
its scalars packed remove most of a graphed call's ~46 µs of dispatch?
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_compile.ops.custom_op as co  # noqa: E402
from moe_compile.ops.registration import op  # noqa: E402


def _wide(*args):
    return args[0]


_wide.__signature__ = inspect.signature(co.fused_moe_impl)  # fused_moe's 28 arguments, as the op declares them
op("moe_compile::probe_wide")(_wide)


@functools.lru_cache(maxsize=None)
def _unpack(spec: str) -> tuple:
    return tuple(json.loads(spec))


@op("moe_compile::probe_packed")
def packed(hidden_states: torch.Tensor, router_logits: torch.Tensor, w13_weight: torch.Tensor,
           w2_weight: torch.Tensor, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
           e_score_correction_bias: Optional[torch.Tensor], spec: str) -> torch.Tensor:
    _unpack(spec)
    return hidden_states


def per_call_us(fn, args, calls: int = 5000, rounds: int = 5) -> float:
    for _ in range(1000):
        fn(*args)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    x = torch.randn(1, 16, device=args.device)
    scalars = (8, 2, "softmax", True, 1.0, 1, 1, 0, True, False, "silu", 1.702, 7.0, False, False, None, None,
               None, False, True, "auto")
    tensors = (x, x, x, x, None, None, None)
    spec = json.dumps(scalars)
    wide_op = torch.ops.moe_compile.probe_wide.default
    names = [a.name for a in wide_op._schema.arguments[len(tensors):]]
    kw = dict(zip(names, scalars))
    for mode in ("plain", "inference_mode"):
        with torch.inference_mode(mode == "inference_mode"):
            w = per_call_us(wide_op, tensors + scalars)
            k = per_call_us(lambda: wide_op(*tensors, **kw), ())
            p = per_call_us(torch.ops.moe_compile.probe_packed.default, tensors + (spec,))
        print(f"{args.device} {mode}: 28 arguments {w:.2f} us, the same with the scalars by keyword (as Inductor's "
              f"wrapper calls an op) {k:.2f} us, 8 (scalars packed) {p:.2f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
