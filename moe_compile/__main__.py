"""``python -m moe_compile {demo, inspect MODEL_TYPE, selfcheck --device npu|cuda, plan --shape E,top_k,H,I,
tune --shape E,top_k,H,I}``."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _count(text: str) -> int:
    """An argparse type: an int >= 1 (token counts, batch, repeats)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def _argument_problem(args) -> str | None:
    """What is wrong with ``demo``/``inspect``'s model and ``--dump-dir``, found before anything is built
    or compiled (``None``: nothing)."""
    from moe_compile.testing.zoo import is_available

    model, impl = (args.model, None) if args.command == "demo" else (args.model_type, args.experts_implementation)
    try:
        is_available(model, impl)  # the zoo's ValueError names the model type or experts implementation
    except ValueError as exc:
        return f"--model: {exc}" if args.command == "demo" else str(exc)
    if args.dump_dir:
        try:
            os.makedirs(args.dump_dir, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=args.dump_dir):
                pass
        except OSError as exc:
            return f"cannot write graph files to --dump-dir {args.dump_dir!r} ({type(exc).__name__}: {exc})"
    return None


def demo(args) -> int:
    import moe_compile
    from moe_compile.testing.zoo import build_inputs, build_model, first_tensor

    dtype = getattr(torch, args.dtype)
    model, inputs = build_model(args.model, dtype=dtype)
    inputs = build_inputs(args.model, num_tokens=args.tokens, batch=args.batch)
    print("model: tiny random %s (%s), %d tokens, inner compiler %s" % (
        args.model, args.dtype, args.tokens * args.batch, args.inner_compiler))
    options = {"inner_compiler": args.inner_compiler}
    counters = torch._dynamo.utils.counters["moe_compile"]
    counters.pop("cpu_decode", None)
    report = moe_compile.explain(model, **inputs, options=options)  # always runs the pass (no cache hit)
    print(report)
    cpu_decode = counters.get("cpu_decode", 0)
    compiled = torch.compile(model, backend="moe_npu", options=options)
    with torch.no_grad():
        eager_out = first_tensor(model(**inputs))
        compiled_out = first_tensor(compiled(**inputs))
        diff = (compiled_out.float() - eager_out.float()).abs().max().item()
        t_eager = _time(lambda: model(**inputs), args.repeats)
        t_compiled = _time(lambda: compiled(**inputs), args.repeats)
    print("max |compiled - eager| = %.3e" % diff)
    print("eager %.2f ms, compiled %.2f ms per forward (mean of %d, after one warm-up; CPU, %d threads)" % (
        t_eager * 1e3, t_compiled * 1e3, args.repeats, torch.get_num_threads()))
    if cpu_decode:
        print("CPU decode: %d fused MoE node(s) compiled by Inductor as gather-GEMVs with the graph "
              "(a fixed, small token count; options={'cpu_decode': False} keeps the op)" % cpu_decode)
    if args.dump_dir:
        paths = report.write_graphs(args.dump_dir)
        print("wrote %d graph files to %s" % (len(paths), args.dump_dir))
    return 0 if report.rewritten else 1


def inspect(args) -> int:
    import moe_compile
    from moe_compile.testing.zoo import build_model

    model, inputs = build_model(args.model_type, experts_implementation=args.experts_implementation)
    if args.export:  # the same pass on a torch.export program (moe_compile.rewrite_exported)
        with torch.no_grad():
            _, report = moe_compile.rewrite_exported(torch.export.export(model, (), inputs))
    else:
        report = moe_compile.explain(model, **inputs, options={"inner_compiler": args.inner_compiler})
    print(report)
    if args.dump_dir:
        report.write_graphs(args.dump_dir)
    return 0


def selfcheck(args) -> int:
    from moe_compile.tools.selfcheck import main as selfcheck_main

    return selfcheck_main(["--device", args.device] + (["--interpret"] if args.interpret else []))


def plan(args) -> int:
    """Which CUDA experts plan each token count would run for a shape, and where it comes from."""
    from moe_compile.kernels.triton import configs

    try:
        experts, top_k, hidden, inter = configs.parse_shape(args.shape)
    except ValueError as exc:
        print(f"--{exc}", file=sys.stderr)
        return 2
    if args.device_key:
        key, capability = args.device_key, (9, 0) if args.sm90 else None
    elif torch.cuda.is_available():
        key = configs.device_key(torch.device("cuda"))
        capability = tuple(torch.cuda.get_device_capability())
    else:
        key, capability = configs.SM90_TUNED, (9, 0)
        print(f"(no CUDA device here: showing what an {key} would run)")
    keys = tuple(configs.tuned_device_keys(key, capability))
    dtype = getattr(torch, args.dtype)
    print(f"shape E={experts} top_k={top_k} H={hidden} I={inter} {args.dtype} on {key}; "
          f"tuned files from {', '.join(str(d) for d in configs.config_dirs())}")
    for m in args.tokens:
        chosen, source = configs.plan_and_source(num_tokens=m, top_k=top_k, num_local=experts, hidden=hidden,
                                                 inter=inter, dtype=dtype, keys=keys)
        print(f"M={m:<6d} {configs.describe_plan(chosen)}\n         from {source}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_compile")
    sub = parser.add_subparsers(dest="command", required=True)
    p = demo_parser = sub.add_parser(
        "demo", help="compile a small MoE model with backend='moe_npu' and show the rewrite")
    p.add_argument("--model", default="mixtral")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=_count, default=16)
    p.add_argument("--batch", type=_count, default=2)
    p.add_argument("--repeats", type=_count, default=20)
    p.add_argument("--inner-compiler", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="what compiles the rewritten graph (inductor: the backend's own default off NPUs)")
    p.add_argument("--dump-dir", default=None)
    p.set_defaults(fn=demo)
    p = inspect_parser = sub.add_parser(
        "inspect", help="build a tiny random model of a transformers MoE type and report")
    p.add_argument("model_type")
    p.add_argument("--experts-implementation", default=None)
    p.add_argument("--inner-compiler", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--export", action="store_true",
                   help="export the model with torch.export and rewrite the program (moe_compile.rewrite_exported)")
    p.add_argument("--dump-dir", default=None)
    p.set_defaults(fn=inspect)
    p = sub.add_parser("selfcheck", help="check the device kernels against their references on a real NPU or GPU")
    p.add_argument("--device", default="npu", choices=["npu", "cuda"])
    p.add_argument("--interpret", action="store_true", help="cuda: run on the CPU under Triton's interpreter")
    p.set_defaults(fn=selfcheck)
    p = sub.add_parser("plan", help="which CUDA experts plan each token count runs for a shape, and from where")
    p.add_argument("--shape", required=True, help="E,top_k,H,I (experts, top-k, hidden size, expert intermediate size)")
    p.add_argument("--tokens", nargs="+", type=_count, default=[1, 32, 256, 2048, 8192])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device-key", default=None, help="a device's file key (e.g. NVIDIA_H200) instead of this GPU's")
    p.add_argument("--sm90", action="store_true", help="with --device-key: the device is sm_90 (reads the H200's files)")
    p.set_defaults(fn=plan)
    p = sub.add_parser("tune", add_help=False,
                       help="tune the CUDA experts' plans for a shape on this GPU (python -m moe_compile tune -h)")
    p.set_defaults(fn=None)
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "tune":  # the tuner parses its own options
        try:
            from moe_compile.tools.tune import main as tune_main
        except ImportError as exc:  # no triton: the CUDA experts it tunes cannot run either
            print(f"python -m moe_compile tune needs the CUDA extras (pip install 'moe-compile[cuda]'): {exc}",
                  file=sys.stderr)
            return 2
        return tune_main(list(argv[1:]))
    args = parser.parse_args(argv)
    if args.command in ("demo", "inspect"):
        problem = _argument_problem(args)
        if problem:
            (demo_parser if args.command == "demo" else inspect_parser).error(problem)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
