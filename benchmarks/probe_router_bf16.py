"""bf16 router logits: our Triton kernels (PDL) vs cuBLAS ``F.linear``, alone and inside the layer.

    python benchmarks/probe_router_bf16.py [--tokens 1 32 256 2048 8192] [--no-layer] [--out benchmarks/results]

Mixtral's (E = 8, H = 4096) and Qwen3's (E = 128, H = 2048) bf16 routers. For each token count:

- alone (CUDA graph over ``ROTATE`` inputs): ``F.linear(x, w)`` against ``router_logits(x, w,
  out_dtype=bf16)`` with its default tiles and, above the GEMV's 16 tokens, every tile of a small
  sweep; how many logits differ from cuBLAS's and by how much at most (relative to the largest),
  and both errors against fp64 (largest error / largest logit);
- in the layer (``bench_moe_layer.our_layer``): router + ``fused_moe`` with ``router="cublas"``
  and ``router="ours"``, timed alternately twice (A B A B), so the two are side by side in one run.

Writes ``router_bf16.json``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import ROTATE, SHAPES, build_hf_block, cuda_or_say, graph_time_us, our_layer, write_json  # noqa: E402

from moe_compile.kernels.triton import router  # noqa: E402
from moe_compile.kernels.triton.gemm import num_programs  # noqa: E402

ROUTERS = {"mixtral": (8, 4096), "qwen3": (128, 2048)}
TILES_T = (16, 32, 64)
TILES_E = (16, 32, 64, 128)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|a - b|`` over the largest ``|b|``: two roundings of one fp32 sum in different
    orders differ by at most one bf16 ulp of the logit (2^-7 of the largest, at most)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def rel_err(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = F.linear(x.double(), w.double())
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def alone(name: str, tokens: list[int], reps: int) -> list[dict]:
    experts, hidden = ROUTERS[name]
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(experts, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16()
    rows = []
    for t in tokens:
        xs = [torch.randn(t, hidden, device="cuda", generator=gen).bfloat16() for _ in range(ROTATE)]
        idx = list(range(ROTATE))
        row = {"router": name, "tokens": t}
        row["cublas_us"] = graph_time_us(lambda i: F.linear(xs[i], w), idx, reps)
        row["ours_us"] = graph_time_us(lambda i: router.router_logits(xs[i], w, None, torch.bfloat16), idx, reps)
        got, ref = router.router_logits(xs[0], w, None, torch.bfloat16), F.linear(xs[0], w)
        row["differ_frac"] = (got != ref).float().mean().item()
        row["max_diff"] = max_diff(got, ref)
        row["cublas_err"], row["ours_err"] = rel_err(ref, xs[0], w), rel_err(got, xs[0], w)
        if t > router.GEMV_MAX_TOKENS:
            row["default_tiles"] = list(router.lowp_tiles(t, experts, num_programs(xs[0].device)))
            sweep = {}
            for bt in TILES_T:
                for be in TILES_E:
                    if be > max(16, 1 << (experts - 1).bit_length()) or bt > max(16, 1 << (t - 1).bit_length()):
                        continue
                    outs = [torch.empty(t, experts, device="cuda", dtype=torch.bfloat16) for _ in idx]
                    sweep[f"{bt}x{be}"] = graph_time_us(lambda i: router._gemm(xs[i], w, None, outs[i], (bt, be)),
                                                        idx, reps)
            row["sweep_us"] = sweep
            best = min(sweep, key=sweep.get)
            row["best"] = best
        rows.append(row)
        extra = f" best {row['best']} {row['sweep_us'][row['best']]:.1f}" if "best" in row else ""
        print(f"{name:<8}{t:>6} cuBLAS {row['cublas_us']:6.1f} us  ours {row['ours_us']:6.1f} us{extra}  "
              f"differ {row['differ_frac']:.1e} (<= {row['max_diff']:.1e} of the largest)  err cuBLAS {row['cublas_err']:.1e} "
              f"ours {row['ours_err']:.1e}", flush=True)
        if "sweep_us" in row:
            print("        " + "  ".join(f"{k} {v:.1f}" for k, v in row["sweep_us"].items()), flush=True)
    return rows


def in_layer(name: str, ms: list[int], reps: int) -> list[dict]:
    shape = SHAPES[name]
    block = build_hf_block(shape)
    layers = {r: our_layer(block, shape, router=r) for r in ("cublas", "ours")}
    rows = []
    for m in ms:
        gen = torch.Generator(device="cuda").manual_seed(m)
        inputs = [torch.randn(m, shape.hidden, device="cuda", generator=gen).bfloat16() for _ in range(ROTATE)]
        times = {"cublas": [], "ours": []}
        with torch.no_grad():
            outs = {r: f(inputs[0]) for r, f in layers.items()}
            for _ in range(2):
                for r, f in layers.items():
                    times[r].append(graph_time_us(f, inputs, reps))
        row = {"shape": name, "M": m, "cublas_us": statistics.median(times["cublas"]),
               "ours_us": statistics.median(times["ours"]), "runs": times,
               "out_differs": (outs["ours"] != outs["cublas"]).float().mean().item()}
        rows.append(row)
        print(f"layer {name:<8}{m:>6} router cuBLAS {row['cublas_us']:9.1f} us  ours {row['ours_us']:9.1f} us  "
              f"saved {row['cublas_us'] - row['ours_us']:6.1f} us  runs {times}  "
              f"outputs differ {row['out_differs']:.1e}", flush=True)
    del block, layers
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 256, 2048, 8192])
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    parser.add_argument("--no-layer", action="store_true")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    if not cuda_or_say("probe_router_bf16"):
        return 2
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "alone": [], "layer": []}
    for name in args.routers:
        result["alone"] += alone(name, args.tokens, args.reps)
        write_json(args.out, "router_bf16.json", result)
    if not args.no_layer:
        for name in args.routers:
            result["layer"] += in_layer(name, args.tokens, args.reps)
            write_json(args.out, "router_bf16.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
