"""Where the time of one fused_experts call goes, kernel by kernel (CUDA, diagnostic).

    python benchmarks/kernel_breakdown.py [--points qwen3:1 qwen3:2048 deepseek_v3:2048] [--layer] [--no-pdl] [--timeline]

For each ``shape:M`` point: the tuned plan, the weights in HF layout (transposed views), routing of
random logits (as ``tune_triton.py`` does), one CUDA graph over ``ROTATE`` calls profiled with
``torch.profiler``; prints each kernel's GPU time per call, the sum, and the layer's lower bound
(bytes of the experts hit / 4.8 TB/s vs FLOPs / 790 TFLOP/s).

With programmatic dependent launch (on by default) a kernel starts while the previous one still
runs and waits for it inside, so its GPU time includes that wait: the kernels then sum to more
than the replay. ``--no-pdl`` launches them one after the other, so each time is its own.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import BF16_FLOP_PER_S, HBM_BYTES_PER_S, ROTATE, ALL_SHAPES, capture_graph, point  # noqa: E402
from tune_triton import hf_layout_weights, problem  # noqa: E402

from moe_compile.kernels.triton.experts import fused_experts, plan_for  # noqa: E402


def _kernel_intervals(prof) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of every GPU kernel or memory op the profiler recorded."""
    out = []
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.time_range.end > evt.time_range.start:
            out.append((float(evt.time_range.start), float(evt.time_range.end), evt.name))
    return out


def idle_gaps(intervals) -> tuple[float, float, list[tuple[float, str, str]]]:
    """``(span, covered, gaps)`` of possibly overlapping ``(start, end, name)`` intervals: the time
    from the first start to the last end, the time some interval covers, and each stretch no interval
    covers as ``(length, name of the interval that ended it, name of the one that starts after)``,
    longest first."""
    if not intervals:
        return 0.0, 0.0, []
    intervals = sorted(intervals)
    covered, gaps = 0.0, []
    cur_start, cur_end, cur_name = intervals[0]
    for start, end, name in intervals[1:]:
        if start > cur_end:
            covered += cur_end - cur_start
            gaps.append((start - cur_end, cur_name, name))
            cur_start, cur_end, cur_name = start, end, name
        elif end > cur_end:
            cur_end, cur_name = end, name
    covered += cur_end - cur_start
    span = cur_end - intervals[0][0]
    return span, covered, sorted(gaps, key=lambda g: -g[0])


def breakdown(name: str, m: int, reps: int = 5, layer: bool = False, timeline: bool = False) -> None:
    shape = ALL_SHAPES[name]
    if layer:  # the whole layer as bench_moe_layer times it: router linear + fused_moe
        from bench_moe_layer import build_hf_block, our_layer

        block = build_hf_block(shape)
        ours = our_layer(block, shape)
        gen = torch.Generator(device="cuda").manual_seed(m)
        inputs = [torch.randn(m, shape.hidden, device="cuda", generator=gen).bfloat16() for _ in range(ROTATE)]
        weights = calls = plan = None

        def run():
            with torch.no_grad():
                for x in inputs:
                    ours(x)
        hits = _hits_of(block, shape, inputs)
    else:
        weights = hf_layout_weights(shape)
        calls = problem(shape, m, weights)
        plan = plan_for(calls[0][0], shape.top_k, weights)
        hits = sum(torch.unique(ids).numel() for _, _, ids in calls) / len(calls)

        def run():
            for x, w, ids in calls:
                fused_experts(x, w, ids, weights, plan=plan)

    graph, _ = capture_graph(lambda _: run(), [None])  # one warm-up pass on a side stream, then capture
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    replay_us = start.elapsed_time(end) * 1e3 / (reps * ROTATE)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    per_call = collections.Counter()
    for evt in prof.key_averages():
        if evt.self_device_time_total > 0:
            per_call[evt.key[:60]] += evt.self_device_time_total / (reps * ROTATE)
    per_expert = 3 * shape.hidden * shape.inter * 2
    mem_us = hits * per_expert / HBM_BYTES_PER_S * 1e6
    flop_us = 6 * m * shape.top_k * shape.hidden * shape.inter / BF16_FLOP_PER_S * 1e6
    total = sum(per_call.values())
    what = "layer (router linear + fused_moe)" if layer else f"plan={plan.path.value} g1={plan.gemm1} g2={plan.gemm2}"
    rest = ("the rest is gaps between kernels" if total <= 1.02 * replay_us else  # 2 %: the profiler's noise
            "kernels overlap (PDL: each one's time includes its wait for the previous; --no-pdl to separate them)")
    print(f"\n{name} M={m} {what}")
    print(f"  bound: memory {mem_us:.1f} us ({hits:.1f} experts hit), compute {flop_us:.1f} us; "
          f"kernels sum {total:.1f} us = {total / max(mem_us, flop_us):.2f}x the bound; graph replay "
          f"{replay_us:.1f} us per call ({rest})")
    for key, us in per_call.most_common():
        print(f"  {us:9.1f} us  {100 * us / total:5.1f}%  {key}")
    if timeline:
        span, covered, gaps = idle_gaps(_kernel_intervals(prof))
        n_calls = reps * ROTATE
        print(f"  timeline of the profiled replays: first kernel start to last kernel end {span / n_calls:.1f} us "
              f"per call, some kernel running {covered / n_calls:.1f} us, none running {(span - covered) / n_calls:.1f} us")
        for gap, before, after in gaps[:5]:
            print(f"    gap {gap:8.1f} us  after {before[:40]}  before {after[:40]}")
    del weights, calls, graph
    torch.cuda.empty_cache()


def _hits_of(block, shape, inputs) -> float:
    from bench_moe_layer import bound_us

    with torch.no_grad():
        return bound_us(block, shape, inputs)[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", type=point, default=[
        ("qwen3", 1), ("qwen3", 256), ("qwen3", 2048), ("mixtral", 256), ("mixtral", 2048), ("deepseek_v3", 2048),
        ("deepseek_v3", 8192)])
    parser.add_argument("--layer", action="store_true",
                        help="profile the whole layer (router linear + fused_moe on an HF block's weights)")
    parser.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    parser.add_argument("--timeline", action="store_true",
                        help="also the profiled replays' timeline: time with no kernel running, and the longest gaps")
    args = parser.parse_args(argv)
    if args.no_pdl:
        from moe_compile.kernels.triton import pdl
        pdl.FORCE = False
    for name, m in args.points:
        breakdown(name, m, layer=args.layer, timeline=args.timeline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
