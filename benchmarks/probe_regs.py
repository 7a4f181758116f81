"""Registers and stack (spill) bytes of expert-GEMM variants compiled for sm_90, without a GPU.

    python benchmarks/probe_regs.py

Compiles ``_moe_gemm_kernel`` for each variant in ``CASES`` with this machine's triton (the H200
runs triton 3.6, which may allocate differently) and prints the cubin's resource line from the
``cuobjdump`` that ships with triton. Eleventh session: the merged last blocks (``MERGE_M``) in
place and in two launches against the tuned Mixtral M = 2048 GEMMs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

D = "tensordesc<bf16[{}, {}]>".format
G1 = dict(BLOCK_M=128, BLOCK_N=128, TAIL_M=32, W_TMA=True, A_TMA=True, GATHER_A=False, w_desc=D(128, 64),
          a_desc=D(128, 64))
G2 = dict(BLOCK_M=128, BLOCK_N=256, PERSISTENT=True, FLATTEN=True, GATED=False, ACT=-1, GATHER_A=False, W_TMA=True,
          A_TMA=True, w_desc=D(256, 64), a_desc=D(128, 64))
CASES = {  # name: (constexprs over aot.BASE, num_warps, num_stages)
    "gemm1 mixtral 2048 tuned": (G1, 8, 4),
    "gemm1 merge32 in place": ({**G1, "MERGE_M": 32}, 8, 4),
    "gemm1 merge32 first launch": ({**G1, "MERGE_M": 32, "MERGE_PASS": 1}, 8, 4),
    "gemm1 merge32 second launch": ({**G1, "MERGE_M": 32, "MERGE_PASS": 2}, 8, 4),
    "gemm1 tail0": ({**G1, "TAIL_M": 0}, 8, 4),
    "gemm1 tail0 merge16 in place": ({**G1, "TAIL_M": 0, "MERGE_M": 16}, 8, 4),
    "gemm1 tail0 merge32 in place": ({**G1, "TAIL_M": 0, "MERGE_M": 32}, 8, 4),
    "gemm1 tail0 merge64 in place": ({**G1, "TAIL_M": 0, "MERGE_M": 64}, 8, 4),
    "gemm2 mixtral 2048 tuned": (G2, 8, 3),
    "gemm2 merge32 in place": ({**G2, "MERGE_M": 32}, 8, 3),
    "gemm2 split_k 2": ({**G2, "SPLIT_K": 2}, 8, 3),
    "gemm2 merge32 first launch": ({**G2, "MERGE_M": 32, "MERGE_PASS": 1}, 8, 3),
    "gemm2 merge32 second launch": ({**G2, "MERGE_M": 32, "MERGE_PASS": 2, "PERSISTENT": False, "FLATTEN": False},
                                    8, 3),
}


def resources(choice: dict, warps: int, stages: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_compile.kernels.triton import aot, gemm

    full = {**aot.BASE, **choice}
    signature, constexprs = {}, {}
    for param in gemm._moe_gemm_kernel.params:
        name = param.name
        if param.is_constexpr or (name in ("w_desc", "a_desc") and full.get(name) is None):
            signature[name], constexprs[name] = "constexpr", full.get(name)
        elif name in ("w_desc", "a_desc"):
            signature[name] = full[name]
        else:
            signature[name] = aot.SCALARS.get(name, "i32")
    compiled = triton.compile(ASTSource(fn=gemm._moe_gemm_kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    dump = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    line = next((ln.strip() for ln in dump.splitlines() if "REG" in ln), dump.strip()[-200:])
    return f"shared {compiled.metadata.shared} B, {line}"


def main() -> int:
    for name, (choice, warps, stages) in CASES.items():
        try:
            print(f"{name}: {resources(choice, warps, stages)}", flush=True)
        except Exception as exc:  # a variant that does not compile is reported, not fatal
            print(f"{name}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
