"""Compile the Triton kernels ahead of time for a CUDA target, without a GPU.

    python -m moe_compile.kernels.triton.aot [--arch 90]

Four sets, each compiled for ``sm_{arch}`` with the ptxas that ships in the triton wheel:

- the router kernels (``ROUTER_VARIANTS``: the tensor-core GEMM on split fp32 weights and on bf16
  weights, and both kernels writing rounded bf16 logits under PDL);
- the decode GEMV experts (``GEMV_VARIANTS``: the up kernel with SwiGLU, map and bias, the down
  kernel with the combine, both under PDL);
- the expert GEMM's hand-picked bf16 variants (``VARIANTS``: sorted / pair / batched rows,
  gather, bias, expert map, TMA descriptors, the persistent kernel with and without a flattened
  tile loop);
- every kernel launch of ``selfcheck --device cuda --interpret`` (routing, alignment, the GEMMs
  on each path, combine, the batched experts), recorded with its argument types and constexpr
  values in a child process running under Triton's interpreter.

Prints one JSON object ``{variant: cubin size in bytes, or "error: ..."}`` (plus
``interpreter_failed``: the selfcheck checks that failed under this triton's interpreter, whose
launches are then missing). Run it where
``TRITON_INTERPRET`` is unset; CI's test runs it as a subprocess, so kernels that only ever ran
under the interpreter are known to compile for Hopper.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

BASE = dict(TOP_K=8, GATHER_A=True, PAIR_BLOCKS=False, HAS_MAP=False, GATED=True, ACT=0, HAS_BIAS=False,
            EVEN_K=True, IEEE=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, E_PAD=128, W_TMA=False,
            A_TMA=False, BATCHED=False, TAIL_M=0, PERSISTENT=False, FLATTEN=False, PDL=False, MERGE_M=0, MERGE_PASS=0,
            SPLIT_K=1)
DESC = "tensordesc<bf16[64, 64]>"
VARIANTS = {
    "sorted-gemm1": {},
    "sorted-gemm1-pdl": dict(PDL=True),
    "sorted-gemm1-silu-clamped": dict(ACT=4),
    "pairs-gemm1-map": dict(PAIR_BLOCKS=True, HAS_MAP=True),
    "sorted-gemm2-bias": dict(GATHER_A=False, GATED=False, ACT=-1, HAS_BIAS=True),
    "sorted-gemm1-tma": dict(W_TMA=True, w_desc=DESC),
    "batched-gemm1": dict(GATHER_A=False, BATCHED=True),
    "batched-gemm2-tma": dict(GATHER_A=False, GATED=False, ACT=-1, BATCHED=True, W_TMA=True, A_TMA=True,
                              w_desc=DESC, a_desc=DESC),
    "persistent-gemm1-pregathered-tma": dict(PERSISTENT=True, FLATTEN=False, GATHER_A=False, W_TMA=True,
                                             A_TMA=True, w_desc=DESC, a_desc=DESC),
    "persistent-flat-gemm1": dict(PERSISTENT=True, FLATTEN=True),
    "sorted-gemm1-tail": dict(BLOCK_M=128, TAIL_M=32, W_TMA=True, w_desc=DESC),
    "persistent-gemm2-tail-tma": dict(PERSISTENT=True, FLATTEN=False, BLOCK_M=128, TAIL_M=64, GATHER_A=False,
                                      GATED=False, ACT=-1, W_TMA=True, A_TMA=True, w_desc=DESC,
                                      a_desc="tensordesc<bf16[128, 64]>"),
    "sorted-gemm1-merged-tail-tma": dict(BLOCK_M=128, BLOCK_N=128, TAIL_M=32, MERGE_M=32, W_TMA=True,
                                         w_desc="tensordesc<bf16[128, 64]>"),
    "persistent-flat-gemm2-merged-tma": dict(PERSISTENT=True, FLATTEN=True, BLOCK_M=128, BLOCK_N=256, MERGE_M=32,
                                             GATHER_A=False, GATED=False, ACT=-1, W_TMA=True, A_TMA=True,
                                             w_desc="tensordesc<bf16[256, 64]>", a_desc="tensordesc<bf16[128, 64]>"),
    "sorted-gemm1-merged-bias": dict(MERGE_M=16, HAS_BIAS=True, EVEN_K=False),
    "sorted-gemm1-merged-first-launch-tma": dict(BLOCK_M=128, BLOCK_N=128, MERGE_M=32, MERGE_PASS=1, W_TMA=True,
                                                 w_desc="tensordesc<bf16[128, 64]>"),
    "sorted-gemm1-merged-second-launch-tma": dict(BLOCK_M=128, BLOCK_N=128, MERGE_M=32, MERGE_PASS=2, W_TMA=True,
                                                  w_desc="tensordesc<bf16[128, 64]>"),
    "batched-gemm2-merged-second-launch": dict(GATHER_A=False, GATED=False, ACT=-1, BATCHED=True, MERGE_M=16,
                                               MERGE_PASS=2),
    "persistent-flat-gemm2-tma": dict(PERSISTENT=True, FLATTEN=True, GATHER_A=False, GATED=False, ACT=-1,
                                      W_TMA=True, A_TMA=True, w_desc=DESC, a_desc=DESC),
    "persistent-flat-gemm2-split-k-tma": dict(PERSISTENT=True, FLATTEN=True, GATHER_A=False, GATED=False, ACT=-1,
                                              W_TMA=True, A_TMA=True, w_desc=DESC, a_desc=DESC, SPLIT_K=2),
    "sorted-gemm2-split-k-bias": dict(GATHER_A=False, GATED=False, ACT=-1, HAS_BIAS=True, EVEN_K=False, SPLIT_K=3),
    "sorted-gemm2-split-k-merged-second-launch": dict(GATHER_A=False, GATED=False, ACT=-1, MERGE_M=16, MERGE_PASS=2,
                                                      SPLIT_K=2),
}
# the router kernels (kernels/triton/router.py): the tensor-core GEMM on fp32 weights split into bf16
# parts or bf16 weights as they are, with and without bias, and both kernels writing bf16 logits
# (rounded by integer arithmetic) under PDL (selfcheck runs them only on a GPU)
ROUTER_VARIANTS = {
    "router-gemm-split-fp32-weights": dict(w="*fp32", SPLIT=True, HAS_BIAS=True),
    "router-gemm-bf16-weights": dict(w="*bf16", SPLIT=False, HAS_BIAS=False),
    "router-gemm-bf16-logits-pdl": dict(w="*bf16", SPLIT=False, HAS_BIAS=True, OUT_BF16=True, PDL=True),
    "router-gemv-bf16-logits-pdl": dict(kernel="gemv", w="*bf16", HAS_BIAS=False, OUT_BF16=True, PDL=True),
}
# the decode GEMV experts (kernels/triton/gemv.py; no tuned plan uses them on the H200, so neither
# the selfcheck nor a recorded launch covers them)
GEMV_VARIANTS = {
    "gemv-up-swiglu-map-bias-pdl": dict(kernel="up", HAS_MAP=True, HAS_BIAS=True, GATED=True, ACT=0),
    "gemv-down-combine-map-pdl": dict(kernel="down", HAS_MAP=True, HAS_BIAS=False, WEIGHTED=True),
}
SCALARS = {"a_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ptr": "*i32",
           "counts_ptr": "*i32", "ids_ptr": "*i32", "map_ptr": "*i32", "alpha": "fp32", "limit": "fp32"}


DTYPES = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16", "torch.int32": "i32",
          "torch.int64": "i64", "torch.int8": "i8", "torch.uint8": "u8", "torch.bool": "i1"}


def _describe(value) -> dict:
    """A launch argument as the compiler's signature needs it (recorded under the interpreter)."""
    import torch

    if value is None:
        return {"kind": "none"}
    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "dtype": DTYPES[str(value.dtype)]}
    if type(value).__name__ == "TensorDescriptor":
        return {"kind": "desc", "dtype": DTYPES[str(value.base.dtype)], "block": list(value.block_shape)}
    if isinstance(value, bool):
        return {"kind": "bool", "value": value}
    if isinstance(value, int):
        return {"kind": "int", "value": value}
    if isinstance(value, float):
        return {"kind": "float", "value": value}
    return {"kind": "other", "value": getattr(value, "value", repr(value))}


def record_launches() -> dict:
    """Run the CUDA selfcheck under the interpreter and record every kernel launch."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from moe_compile.tools.selfcheck_cuda import run_cuda_checks

    records, real_run = [], InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        bound = dict(zip(self.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        records.append({"module": self.fn.__module__, "name": self.fn.__name__, "options": options,
                        "args": {k: _describe(v) for k, v in bound.items()}})
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        checks = run_cuda_checks(torch.device("cpu"))
    finally:
        InterpretedFunction.run = real_run
    unique = {json.dumps(r, sort_keys=True): r for r in records}
    failed = ["%s: %s (%s)" % (c.name, c.case, c.note) for c in checks if not c.ok]
    return {"launches": list(unique.values()), "failed": failed}


def compile_record(record: dict, arch: int, pdl: bool = False) -> int:
    """Compile one recorded launch; ``pdl``: with its ``PDL`` constexpr on (the interpreter never
    launches with programmatic dependent launch, a GPU does)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(record["module"]), record["name"])
    signature, constexprs = {}, {}
    for param in fn.params:
        # a constexpr left at its default was not passed, so not recorded
        arg = record["args"].get(param.name, {"kind": "default", "value": param.default})
        if param.name == "PDL":
            arg = {"kind": "bool", "value": pdl}
        kind = arg["kind"]
        if param.is_constexpr or kind == "none":
            signature[param.name] = "constexpr"
            constexprs[param.name] = arg.get("value")
        elif kind == "tensor":
            signature[param.name] = "*" + arg["dtype"]
        elif kind == "desc":
            signature[param.name] = "tensordesc<%s[%s]>" % (arg["dtype"], ", ".join(map(str, arg["block"])))
        elif kind == "int":
            signature[param.name] = "i32" if -2 ** 31 <= arg["value"] < 2 ** 31 else "i64"
        else:
            signature[param.name] = {"float": "fp32", "bool": "i1"}[kind]
    options = {"num_warps": 4, "num_stages": 3, **record["options"]}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    return len(compiled.asm["cubin"])


def _param_names(record: dict) -> set[str]:
    import importlib

    fn = getattr(importlib.import_module(record["module"]), record["name"])
    return {p.name for p in fn.params}


def _recorded(root: str) -> dict:
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "moe_compile.kernels.triton.aot", "--record"], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError("recording the interpreter launches failed:\n" + proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_variant(choice: dict, arch: int) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_compile.kernels.triton import gemm

    fn = gemm._moe_gemm_kernel
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


def compile_router_variant(choice: dict, arch: int) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_compile.kernels.triton import router

    out_bf16 = choice.get("OUT_BF16", False)
    pointers = {"x_ptr": "*bf16", "w_ptr": choice["w"], "b_ptr": "*fp32", "out_ptr": "*bf16" if out_bf16 else "*fp32"}
    common = dict(HAS_BIAS=choice["HAS_BIAS"], OUT_BF16=out_bf16, PDL=choice.get("PDL", False))
    if choice.get("kernel") == "gemv":
        fn, constexprs = router._gemv_kernel, dict(common, BLOCK_T=2, BLOCK_H=4096)
    else:
        fn = router._gemm_kernel
        constexprs = dict(common, SPLIT=choice["SPLIT"], IEEE=False, BLOCK_T=128, BLOCK_E=128, BLOCK_H=64)
    signature = {p.name: "constexpr" if p.name in constexprs else pointers.get(p.name, "i32") for p in fn.params}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": 8, "num_stages": 3})
    return len(compiled.asm["cubin"])


def compile_gemv_variant(choice: dict, arch: int) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_compile.kernels.triton import gemv

    fn = gemv._gemv_up_kernel if choice["kernel"] == "up" else gemv._gemv_down_kernel
    constexprs = {k: v for k, v in choice.items() if k != "kernel"}
    constexprs.update(TOP_K=8, BLOCK_N=16, BLOCK_K=256, PDL=True)
    pointers = {"ids_ptr": "*i32", "map_ptr": "*i32", "tw_ptr": "*fp32", "alpha": "fp32", "limit": "fp32"}
    signature = {p.name: "constexpr" if p.name in constexprs else
                 pointers.get(p.name, "*bf16" if p.name.endswith("_ptr") else "i32") for p in fn.params}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
    return len(compiled.asm["cubin"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--record", action="store_true", help="(internal) print the interpreter's launches")
    args = parser.parse_args(argv)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if args.record:
        if not interpreting:
            print("--record runs under TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        print(json.dumps(record_launches()))
        return 0
    if interpreting:
        print("unset TRITON_INTERPRET: the kernels must be imported in compile mode", file=sys.stderr)
        return 2
    out = {}
    for name, extra in VARIANTS.items():
        try:
            out[name] = compile_variant(dict(BASE, **extra), args.arch)
        except Exception as exc:  # noqa: BLE001 - reported per variant
            out[name] = f"error: {type(exc).__name__}: {str(exc)[:500]}"
    for name, choice in ROUTER_VARIANTS.items():
        try:
            out[name] = compile_router_variant(choice, args.arch)
        except Exception as exc:  # noqa: BLE001 - reported per variant
            out[name] = f"error: {type(exc).__name__}: {str(exc)[:500]}"
    for name, choice in GEMV_VARIANTS.items():
        try:
            out[name] = compile_gemv_variant(choice, args.arch)
        except Exception as exc:  # noqa: BLE001 - reported per variant
            out[name] = f"error: {type(exc).__name__}: {str(exc)[:500]}"
    root = str(Path(__file__).resolve().parents[3])
    recorded = _recorded(root)
    # checks that failed under this triton's interpreter launched fewer kernels: say so
    out["interpreter_failed"] = recorded["failed"]
    for i, record in enumerate(recorded["launches"]):
        fn_params = _param_names(record)
        for pdl in (False, True) if "PDL" in fn_params else (False,):
            key = "launch %d: %s%s" % (i, record["name"], " +pdl" if pdl else "")
            try:
                out[key] = compile_record(record, args.arch, pdl)
            except Exception as exc:  # noqa: BLE001
                out[key] = f"error: {type(exc).__name__}: {str(exc)[:500]}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
