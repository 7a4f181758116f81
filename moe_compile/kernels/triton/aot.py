"""Compile the expert GEMM kernel's variants ahead of time for a CUDA target, without a GPU.

    python -m moe_compile.kernels.triton.aot [--arch 90]

Prints one JSON object: ``{variant: cubin size in bytes, or "error: ..."}``. Run it in a process
where ``TRITON_INTERPRET`` is unset (triton must be imported in compile mode); CI's test runs it
as a subprocess, so kernels that only ever ran under the interpreter are known to compile for
Hopper. Needs the ptxas that ships in the triton wheel, nothing else.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

BASE = dict(TOP_K=8, GATHER_A=True, PAIR_BLOCKS=False, HAS_MAP=False, GATED=True, ACT=0, HAS_BIAS=False,
            EVEN_K=True, IEEE=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, E_PAD=128, W_TMA=False,
            A_TMA=False, BATCHED=False)
DESC = "tensordesc<bf16[64, 64]>"
VARIANTS = {
    "sorted-gemm1": {},
    "pairs-gemm1-map": dict(PAIR_BLOCKS=True, HAS_MAP=True),
    "sorted-gemm2-bias": dict(GATHER_A=False, GATED=False, ACT=-1, HAS_BIAS=True),
    "sorted-gemm1-tma": dict(W_TMA=True, w_desc=DESC),
    "batched-gemm1": dict(GATHER_A=False, BATCHED=True),
    "batched-gemm2-tma": dict(GATHER_A=False, GATED=False, ACT=-1, BATCHED=True, W_TMA=True, A_TMA=True,
                              w_desc=DESC, a_desc=DESC),
}
SCALARS = {"a_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ptr": "*i32",
           "counts_ptr": "*i32", "ids_ptr": "*i32", "map_ptr": "*i32", "alpha": "fp32", "limit": "fp32"}


def compile_variant(choice: dict, arch: int) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_compile.kernels.triton.gemm import _moe_gemm_kernel as fn

    signature, constexprs = {}, {}
    for param in fn.params:
        name = param.name
        if param.is_constexpr or (name in ("w_desc", "a_desc") and choice.get(name) is None):
            signature[name] = "constexpr"
            constexprs[name] = choice.get(name)
        elif name in ("w_desc", "a_desc"):
            signature[name] = choice[name]
        else:
            signature[name] = SCALARS.get(name, "i32")
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, "num_stages": 3})
    return len(compiled.asm["cubin"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the kernels must be imported in compile mode", file=sys.stderr)
        return 2
    out = {}
    for name, extra in VARIANTS.items():
        try:
            out[name] = compile_variant(dict(BASE, **extra), args.arch)
        except Exception as exc:  # noqa: BLE001 - reported per variant
            out[name] = f"error: {type(exc).__name__}: {str(exc)[:500]}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
