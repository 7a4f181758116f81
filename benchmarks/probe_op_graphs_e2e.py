"""One compiled HF model, its forward timed with the op's own CUDA graphs on and off alternately.

    python benchmarks/probe_op_graphs_e2e.py [--model qwen3] [--size decode1] [--rounds 6] [--reps 30] [--profile]

``bench_e2e.py`` compiles a model once per mode, so its ``moe_npu`` and ``moe_npu-plain`` rows come from
two compiles and two stretches of time. Here one ``torch.compile(model, backend="moe_npu")`` serves
both: ``op_graphs.configure(enabled=...)`` switches between rounds (a graph, once captured, stays
cached while off). Per forward: *issue ms* (host time until the call returns, no synchronisation
inside the round) and *latency ms* (CUDA events around one forward, synchronised; ``bench_e2e.py``'s
figure); the median over the round, then the best round. ``--profile`` adds a ``torch.profiler``
table of each mode (top host-time ops of 10 forwards).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import SIZES, build  # noqa: E402

from moe_compile.lowering import op_graphs  # noqa: E402


def one_round(fn, reps: int) -> tuple[float, float]:
    issue, latency = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        issue.append((time.perf_counter() - t0) * 1e3)
        end.synchronize()
        latency.append(start.elapsed_time(end))
    return statistics.median(issue), statistics.median(latency)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3")
    parser.add_argument("--size", default="decode1", choices=list(SIZES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    import moe_compile  # noqa: F401

    model = build(args.model, args.layers, False, "cuda")
    ids = torch.randint(0, model.config.vocab_size, SIZES[args.size], device="cuda")
    compiled = torch.compile(model, backend="moe_npu")
    fn = lambda: compiled(input_ids=ids, use_cache=False)  # noqa: E731
    best = {True: [float("inf")] * 2, False: [float("inf")] * 2}
    with torch.no_grad():
        op_graphs.configure(enabled=False)
        ref = fn().logits.float()
        op_graphs.configure(enabled=True)
        for _ in range(3):  # the second call of each op captures its graph, the third replays it
            out = fn().logits.float()
        print(f"graphed vs plain logits, max abs diff: {(out - ref).abs().max().item():.3e}; "
              f"replays so far {op_graphs.STATS['replayed']}, graphs {op_graphs.graphs()}")
        for r in range(args.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                op_graphs.configure(enabled=on)
                issue, latency = one_round(fn, args.reps)
                best[on] = [min(best[on][0], issue), min(best[on][1], latency)]
                print(f"round {r} op graphs {'on ' if on else 'off'}: issue {issue:.3f} ms, latency {latency:.3f} ms",
                      flush=True)
        for on in (False, True):
            print(f"best, op graphs {'on ' if on else 'off'}: issue {best[on][0]:.3f} ms, latency {best[on][1]:.3f} ms")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for on in (False, True):
                op_graphs.configure(enabled=on)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        fn()
                    torch.cuda.synchronize()
                print(f"--- op graphs {'on' if on else 'off'}: 10 forwards")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
