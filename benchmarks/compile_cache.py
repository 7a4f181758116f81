"""Compile time with Inductor's compile caches: a cold compile, then the same model in new processes.

    python benchmarks/compile_cache.py [--models qwen3 mixtral deepseek_v3] [--layers 2] [--size decode]
        [--modes inductor moe_npu] [--warm 2] [--device cuda] [--tiny] [--compile-mode reduce-overhead]
        [--out benchmarks/results]

The models are ``bench_e2e.py``'s (the real models' layer dimensions, random weights, bf16; ``--tiny``
shrinks them for a CPU run). For each model and mode, every measurement is a new Python process that
builds the model, compiles it and times its first call (which compiles), synchronised: first with an
empty cache folder (cold), then ``--warm`` times with the folder the cold run filled (warm: Inductor's
FX graph and AOTAutograd caches; for moe_npu the pass does not run and its decisions are replayed).
Each warm process builds the model with another seed, so it is served another model's compile. Prints
a table (cold s, warm s, warm/cold, and the warm run's cache hits and MoE blocks rewritten) and writes
``compile_cache.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

import torch  # noqa: E402


def child(args) -> None:
    import moe_compile  # noqa: F401  (registers the backend)
    from bench_e2e import SIZES, build

    torch.manual_seed(args.seed)
    model = build(args.model, args.layers, args.tiny, args.device)
    with torch.no_grad():  # another seed: the warm process compiles another model of the same shape
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01 * args.seed)
    batch, seq = SIZES[args.size]
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), device=args.device)
    torch._dynamo.utils.counters.clear()
    t0 = time.perf_counter()
    with torch.no_grad():
        inner = {"inner_compiler": "inductor", **({"mode": args.compile_mode} if args.compile_mode else {})}
        options = {"options": inner} if args.mode == "moe_npu" else {"mode": args.compile_mode}
        fast = torch.compile(model, backend=args.mode, dynamic=False, **options)
        out = fast(input_ids=ids).logits.clone()
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        ref = model(input_ids=ids).logits
    counters = torch._dynamo.utils.counters
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    print("RESULT " + json.dumps({
        "seconds": seconds, "rel_err": err, "moe_compile": dict(counters["moe_compile"]),
        "cache": {k: v for k, v in counters["inductor"].items() if "cache" in k},
        "aot": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
    }))


def measure(args, model: str, mode: str, cache: str, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--mode", mode, "--seed", str(seed),
           "--layers", str(args.layers), "--size", args.size, "--device", args.device]
    if args.tiny:
        cmd.append("--tiny")
    if args.compile_mode:
        cmd += ["--compile-mode", args.compile_mode]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(Path(__file__).parent))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError("child failed (%s %s):\n%s" % (model, mode, proc.stderr[-3000:]))
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3", "mixtral", "deepseek_v3"],
                        choices=["qwen3", "mixtral", "deepseek_v3"])
    parser.add_argument("--modes", nargs="+", default=["inductor", "moe_npu"], choices=["inductor", "moe_npu"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--size", default="decode")
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead")
    parser.add_argument("--json-name", default="compile_cache.json")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warm < 1:
        parser.error("--warm must be at least 1, but got %d" % args.warm)
    if args.child:
        child(args)
        return 0
    rows = []
    print("| model | mode | cold s | warm s | warm/cold | warm run: FX cache, AOT cache, rewritten (from cache) "
          "| rel. err |")
    print("|---|---|---:|---:|---:|---|---:|")
    for model in args.models:
        for mode in args.modes:
            with tempfile.TemporaryDirectory() as cache:
                cold = measure(args, model, mode, cache, seed=0)
                warm = [measure(args, model, mode, cache, seed=1 + i) for i in range(args.warm)]
            best = min(warm, key=lambda r: r["seconds"])
            row = {"model": model, "mode": mode, "cold": cold, "warm": warm}
            rows.append(row)
            ours = best["moe_compile"]
            print("| %s | %s | %.1f | %.1f | %.2f | %s, %s, %s (%s) | %.1e |" % (
                model, mode, cold["seconds"], best["seconds"], best["seconds"] / cold["seconds"],
                best["cache"], best["aot"], ours.get("rewritten", "-"), ours.get("from_cache", 0),
                max(r["rel_err"] for r in [cold] + warm)), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "device": args.device, "layers": args.layers, "size": args.size,
            "tiny": args.tiny, "compile_mode": args.compile_mode}
    (out / args.json_name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
