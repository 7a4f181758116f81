"""Would a capacity split pay? cuBLAS batched GEMMs over each expert's first ``C`` rows plus the
Triton grouped GEMMs over the rest, against the tuned experts, on the benchmark's routing (CUDA).

    python benchmarks/probe_capacity.py --points mixtral:2048 qwen3:8192 --caps 0.75 0.875

For each ``shape:M`` point and capacity fraction ``f`` (``C = f * M * top_k / E`` rows per expert,
rounded down to 16): the tuned ``fused_experts`` over the benchmark's ``ROTATE`` routings; the
"bulk", ``torch.bmm`` on ``[E, C, H]`` inputs, the activation kernel, ``torch.bmm`` again; the
"rest", ``fused_experts`` on a routing that gives each expert ``max(count - C, 0)`` rows of each of
the benchmark's routings; and the two in one graph, one after the other. All
times are CUDA-graph replays in one process, rounds interleaved (A B C ... A B C). It leaves out
the gather into ``[E, C, H]`` and the combine's second source, so it is the split's best case:
if this does not beat the tuned experts, the split cannot.

Fourteenth session, H200 (``results/README.md``): the bulk ran at 581-650 TFLOP/s, but the rest
reads every hit expert's weights again; Mixtral M = 2048 1.06-1.08x the tuned experts, M = 8192
1.00x, Qwen3 M = 8192 0.91-0.92x before the gather it leaves out, so the split was not built.
(That run timed a round as the mean of its replays; a round is now their median.)
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import (  # noqa: E402
    BF16_FLOP_PER_S, ROTATE, ALL_SHAPES, _event_time, capture_graph, cuda_or_say, point,
)
from tune_triton import hf_layout_weights, problem  # noqa: E402

from moe_compile.kernels.triton.activation import activation  # noqa: E402
from moe_compile.kernels.triton.experts import fused_experts, plan_for  # noqa: E402
from moe_compile.ops.config import ExpertsConfig  # noqa: E402


def graph_of(run):
    """A CUDA graph of ``run()`` (warmed up once on a side stream, as ``capture_graph`` does)."""
    return capture_graph(lambda _: run(), [None])[0]


def replay_us(graph, reps: int) -> float:
    """Per-call µs of one graph (``ROTATE`` calls): the median over ``reps`` timed replays."""
    return _event_time(graph.replay, reps) / ROTATE


def rest_problem(counts: torch.Tensor, cap: int, top_k: int, hidden: int):
    """``(x, topk_weights, topk_ids)`` on ``counts``' device: expert ``e`` gets ``max(counts[e] - cap,
    0)`` rows, plus fewer than ``top_k`` padding rows (to whole tokens) on the experts with the
    fewest. Rows are dealt out expert-sorted, ``top_k`` apart, so a token's experts are distinct
    while no expert has more rows than there are tokens."""
    device = counts.device
    rest = (counts - cap).clamp(min=0)
    flat = torch.repeat_interleave(torch.arange(counts.numel(), device=device), rest)
    tokens = max(1, -(-flat.numel() // top_k))
    pad = tokens * top_k - flat.numel()
    if pad:  # the padding rows go to the experts with the fewest rows left over
        flat = torch.cat([flat, torch.argsort(rest)[:pad].to(flat.dtype)])
        flat, _ = torch.sort(flat)
    ids = flat.view(top_k, tokens).t().contiguous().to(torch.int32)
    x = torch.randn(tokens, hidden, device=device).bfloat16()
    w = torch.full((tokens, top_k), 1.0 / top_k, device=device)
    return x, w, ids


def probe(name: str, m: int, fracs, reps: int, rounds: int, sync_each: bool = False) -> None:
    shape = ALL_SHAPES[name]
    e, k, h, i = shape.num_experts, shape.top_k, shape.hidden, shape.inter
    weights = hf_layout_weights(shape)
    calls = problem(shape, m, weights)
    counts = [torch.bincount(ids.flatten().long(), minlength=e) for _, _, ids in calls]  # on the GPU
    allc = torch.stack(counts).float()
    print(f"\n{name} M={m}: rows per expert mean {allc.mean():.1f}, min {allc.min():.0f}, max {allc.max():.0f}, "
          f"sd {allc.std():.1f}", flush=True)
    plan = plan_for(calls[0][0], k, weights)
    cfg = ExpertsConfig()

    def tuned():
        for x, w, ids in calls:
            fused_experts(x, w, ids, weights, plan=plan)
    graphs = {"tuned": graph_of(tuned)}
    flops = {}
    keep = []  # every graph's buffers stay alive until the graphs are done (a freed one is an illegal address)
    for frac in fracs:
        cap = max(16, int(frac * m * k / e) // 16 * 16)
        xs = torch.randn(e, cap, h, device="cuda").bfloat16()
        mid = torch.empty(e * cap, 2 * i, device="cuda", dtype=torch.bfloat16)
        act = torch.empty(e * cap, i, device="cuda", dtype=torch.bfloat16)
        ys = torch.empty(e, cap, h, device="cuda", dtype=torch.bfloat16)
        rests = [rest_problem(c, cap, k, h) for c in counts]
        rest_plans = [plan_for(x, k, weights) for x, _, _ in rests]

        def bulk(xs=xs, mid=mid, act=act, ys=ys, cap=cap):
            torch.bmm(xs, weights.w13, out=mid.view(e, cap, 2 * i))
            activation(mid, cfg, out=act)
            torch.bmm(act.view(e, cap, i), weights.w2, out=ys)

        # one call per routing: the tuned experts on the rows past C
        rest_calls = [functools.partial(fused_experts, x, w, ids, weights, plan=p)
                      for (x, w, ids), p in zip(rests, rest_plans)]

        def bulk_only(bulk=bulk):
            for _ in range(ROTATE):
                bulk()

        def rest_only(rest_calls=rest_calls):
            for call in rest_calls:
                call()

        def serial(bulk=bulk, rest_calls=rest_calls):
            for call in rest_calls:
                call()
                bulk()

        keep.append((xs, mid, act, ys, rests, rest_plans))
        tag = f"C={cap} ({frac:g})"
        graphs[f"bulk {tag}"] = graph_of(bulk_only)
        graphs[f"rest {tag}"] = graph_of(rest_only)
        graphs[f"bulk+rest {tag}"] = graph_of(serial)
        flops[f"bulk {tag}"] = 6 * e * cap * h * i
        rest_rows = sum(int((c - cap).clamp(min=0).sum()) for c in counts) / ROTATE
        print(f"  {tag}: bulk rows {e * cap}, rest rows {rest_rows:.0f} per call, "
              f"padding in bulk {sum(int((cap - c).clamp(min=0).sum()) for c in counts) / ROTATE:.0f}", flush=True)
    for key, g in graphs.items():
        for _ in range(2):
            g.replay()
        if sync_each:  # find which graph fails, if one does
            torch.cuda.synchronize()
            print(f"  replayed {key}", flush=True)
    torch.cuda.synchronize()
    times = {key: [] for key in graphs}
    for _ in range(rounds):
        for key, g in graphs.items():
            times[key].append(replay_us(g, reps))
    base = statistics.median(times["tuned"])
    for key, ts in times.items():
        med = statistics.median(ts)
        rate = f"  {flops[key] / med / 1e6:.0f} TFLOP/s" if key in flops else ""
        print(f"  {key:<28} {med:9.1f} us  {med / base:6.3f}x tuned  (rounds {min(ts):.1f}-{max(ts):.1f}){rate}",
              flush=True)
    print(f"  bound (FLOPs / {BF16_FLOP_PER_S / 1e12:.0f} TFLOP/s): {6 * m * k * h * i / BF16_FLOP_PER_S * 1e6:.1f} us")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=point, nargs="+", default=[("mixtral", 2048)])
    parser.add_argument("--caps", type=float, nargs="+", default=[0.75, 0.875])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sync-each", action="store_true", help="synchronize after each graph's first replays")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        parser.error(f"--rounds and --reps must be >= 1, got {args.rounds} and {args.reps}")
    if not all(f > 0 for f in args.caps):  # above 1 is allowed: experts under C then pad the bulk
        parser.error(f"--caps must be > 0 (fractions of the mean rows per expert), got {args.caps}")
    if not cuda_or_say("probe_capacity"):
        return 2
    for name, m in args.points:
        probe(name, m, args.caps, args.reps, args.rounds, args.sync_each)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
