"""The routing kernel's launch: tokens per program and warps, per shape and token count (CUDA).

    python benchmarks/sweep_route.py [--shapes qwen3 ...] [--ms 1 32 256 2048 8192] [--out DIR]

For each shape's routing (Mixtral: softmax top-2; Qwen3: softmax top-8 of 128; DeepSeek-V3: grouped
sigmoid top-8 with bias) and token count, the CUDA-graph time of ``route`` over ``ROTATE`` logits
with ``route_launch``'s choice and with each ``(tokens per program, warps)`` candidate. Every
candidate's ids must equal the default's and its weights match to 1e-6, else it is reported and
skipped. Writes ``sweep_route.json``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import MS, ROTATE, SHAPES, graph_time_us, routing_config, write_json  # noqa: E402

from moe_compile.kernels.triton.routing import _pow2, route, route_launch  # noqa: E402

BLOCK_T = (1, 2, 4, 8, 16, 32, 64)
WARPS = (1, 2, 4, 8)
MAX_TILE = 8192  # scores per program


def sweep(name: str, ms, reps: int, deadline: float) -> list[dict]:
    shape = SHAPES[name]
    cfg = routing_config(shape)
    groups = cfg.group_count if cfg.grouped else 1
    tile = _pow2(groups) * _pow2(cfg.num_experts // groups)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(shape.num_experts, device="cuda", generator=gen) * 0.05 if name == "deepseek_v3" else None
    dtype = torch.float32 if name == "deepseek_v3" else torch.bfloat16  # as each model's router emits
    rows = []
    for m in ms:
        logits = [torch.randn(m, shape.num_experts, device="cuda", generator=gen).to(dtype) for _ in range(ROTATE)]
        default = route_launch(m, tile)
        ref_w, ref_ids = route(logits[0], cfg, bias)
        cands = [default] + [(bt, w) for bt in BLOCK_T for w in WARPS
                             if bt <= _pow2(m) and bt * tile <= MAX_TILE and (bt, w) != default]
        row = {"shape": name, "M": m, "default": list(default), "timed": []}
        for launch in cands:
            if time.time() > deadline:
                break
            try:
                w, ids = route(logits[0], cfg, bias, launch=launch)
                if not (torch.equal(ids, ref_ids) and torch.allclose(w, ref_w, rtol=1e-6, atol=1e-6)):
                    print(f"  {name} M={m} {launch}: differs from the default launch", flush=True)
                    continue
                us = graph_time_us(lambda x, la=launch: route(x, cfg, bias, launch=la), logits, reps)
            except Exception as exc:
                print(f"  {name} M={m} {launch}: failed {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            row["timed"].append({"block_t": launch[0], "warps": launch[1], "us": us})
        best = min(row["timed"], key=lambda t: t["us"])
        base = row["timed"][0]
        print(f"{name:12s} M={m:5d} default {default}: {base['us']:6.2f} us   best ({best['block_t']}, "
              f"{best['warps']}): {best['us']:6.2f} us", flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--ms", nargs="+", type=int, default=list(MS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--out", default=None, help="directory for sweep_route.json")
    args = parser.parse_args(argv)
    deadline = time.time() + args.budget_s
    rows = []
    for name in args.shapes:
        rows += sweep(name, args.ms, args.reps, deadline)
        write_json(args.out, "sweep_route.json", {"rows": rows})  # after every shape
    return 0


if __name__ == "__main__":
    sys.exit(main())
