"""Eager calls of the op with and without its own CUDA graphs (``moe_compile/lowering/op_graphs.py``).

    python benchmarks/bench_op_graphs.py [--shapes qwen3 mixtral deepseek_v3] [--ms 1 32 256] [--json F]

For each shape and token count, calls of ``torch.ops.moe_compile.fused_moe`` (what a compiled graph
without CUDA graphs calls), with op graphs off ("plain") and on ("graphed") alternately, ``--rounds``
rounds each, in one process:

- *issue µs*: ``--calls`` calls back to back, host time until the last one returns (what the host
  spends per call while the GPU keeps up);
- *step µs*: the same, until the GPU has finished them (synchronised): the time per call of a loop of
  eager calls, whichever of host and GPU is slower;
- *floor µs*: the op's kernels alone: one plain call captured in a CUDA graph by hand, replayed
  back to back (event-timed), i.e. the GPU time a call cannot go below.

The best round of each, the largest relative difference between a graphed and a plain output, and
whether the default settings graph such a call (``max_tokens``, ``max_expert_bytes``; the benchmark
graphs every point it measures).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_eager_call import op_call  # noqa: E402
from bench_moe_layer import SHAPES  # noqa: E402
from probe_launch import make_inputs  # noqa: E402

from moe_compile.lowering import op_graphs  # noqa: E402


def loop_us(fn, calls: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / calls * 1e6, (done - start) / calls * 1e6


def floor_us(fn, replays: int = 200) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def measure(shape, m: int, calls: int, rounds: int) -> dict:
    x, logits, w13, w2 = make_inputs(shape, m)
    fn = lambda: op_call(x, logits, w13, w2, shape)  # noqa: E731
    best = {"plain": [float("inf")] * 2, "graphed": [float("inf")] * 2}
    outs = {}
    for r in range(rounds):
        for mode in (("plain", "graphed") if r % 2 == 0 else ("graphed", "plain")):
            op_graphs.configure(enabled=mode == "graphed")
            for _ in range(5):
                outs[mode] = fn()
            issue, step = loop_us(fn, calls)
            best[mode] = [min(best[mode][0], issue), min(best[mode][1], step)]
    op_graphs.configure(enabled=False)
    floor = floor_us(fn)
    op_graphs.configure(enabled=True)
    ref = outs["plain"].float()
    err = ((outs["graphed"].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return dict(shape=shape.name, m=m, plain_issue_us=best["plain"][0], plain_step_us=best["plain"][1],
                graphed_issue_us=best["graphed"][0], graphed_step_us=best["graphed"][1], floor_us=floor,
                step_speedup=best["plain"][1] / best["graphed"][1], max_rel_diff=err,
                replayed=op_graphs.STATS["replayed"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3", "mixtral", "deepseek_v3"], choices=list(SHAPES))
    parser.add_argument("--ms", nargs="+", type=int, default=[1, 32, 256])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_op_graphs.py needs a CUDA device")
        return 1
    default = op_graphs.Settings()
    op_graphs.configure(max_tokens=max(args.ms), max_expert_bytes=1 << 60)  # graphs at every point measured
    rows = []
    print("shape | M | plain issue us | plain step us | graphed issue us | graphed step us | floor us | "
          "step plain/graphed | graphed/floor | max rel diff | graphed by default")
    for name in args.shapes:
        for m in args.ms:
            row = measure(SHAPES[name], m, args.calls, args.rounds)
            shape = SHAPES[name]
            hit = min(shape.num_experts, m * shape.top_k) * 3 * shape.hidden * shape.inter * 2  # bf16
            row["graphed_by_default"] = m <= default.max_tokens and hit <= default.max_expert_bytes
            rows.append(row)
            print(f"{name} | {m} | {row['plain_issue_us']:.1f} | {row['plain_step_us']:.1f} | "
                  f"{row['graphed_issue_us']:.1f} | {row['graphed_step_us']:.1f} | {row['floor_us']:.1f} | "
                  f"{row['step_speedup']:.2f} | {row['graphed_step_us'] / row['floor_us']:.2f} | "
                  f"{row['max_rel_diff']:.1e} | {'yes' if row['graphed_by_default'] else 'no'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                   rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
