"""Where one forward of a compiled MoE block spends its host time, without CUDA graphs.

    python benchmarks/profile_block_host.py [--types moe hash_moe] [--m 1] [--calls 200] [--out DIR]

DeepSeek-V4's block as ``bench_hash_layer.py`` builds it (bf16, the config's sizes), compiled with
``dynamic=True`` by inductor and by ``backend="moe_npu"``. For each: the host time of one forward (the
mean over ``--calls`` forwards without synchronising, after a warm-up; the best of 3 rounds), then, for
20 forwards, ``torch.profiler``'s table of host time by op (self CPU) with the GPU time and kernel
count per forward, and for ``moe_npu`` a ``cProfile`` of the Python calls (by own time). Writes
``<type>_<mode>.txt`` per profile and ``block_host.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hash_layer import VOCAB, build  # noqa: E402
from probe_launch import per_call_us  # noqa: E402


def profile_table(call, forwards: int = 20) -> tuple[str, float, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(forwards):
            call()
        torch.cuda.synchronize()
    events = prof.key_averages()
    table = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels) / forwards
    launches = sum(e.count for e in kernels) / forwards
    return table, gpu_us, launches


def python_profile(call, forwards: int = 50) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(forwards):
        call()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(35)
    return out.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="+", default=["moe", "hash_moe"], choices=["moe", "hash_moe"])
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    import moe_compile  # noqa: F401,F811  (registers backend="moe_npu")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for layer_type in args.types:
        block, cfg = build(layer_type, False, "cuda")
        x = torch.randn(1, args.m, cfg.hidden_size, device="cuda").bfloat16()
        ids = torch.randint(0, VOCAB, (1, args.m), device="cuda")
        for mode in ("inductor", "moe_npu"):
            torch._dynamo.reset()
            fn = torch.compile(block, dynamic=True, backend="inductor" if mode == "inductor" else "moe_npu")
            call = (lambda: fn(x, ids)) if layer_type == "hash_moe" else (lambda: fn(x))
            with torch.no_grad():
                for _ in range(10):
                    call()
                us = per_call_us(call, args.calls)
                table, gpu_us, launches = profile_table(call)
                text = f"{layer_type} M={args.m} {mode}: host {us:.1f} us per forward, GPU {gpu_us:.1f} us, " \
                       f"{launches:.1f} kernels per forward\n\n{table}\n"
                if mode == "moe_npu":
                    text += "\n" + python_profile(call)
            (out_dir / f"{layer_type}_{mode}.txt").write_text(text)
            print(text.split("\n")[0], flush=True)
            results.append(dict(layer_type=layer_type, m=args.m, mode=mode, host_us=us, gpu_us=gpu_us,
                                kernels=launches))
        del block
        torch.cuda.empty_cache()
    (out_dir / "block_host.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
