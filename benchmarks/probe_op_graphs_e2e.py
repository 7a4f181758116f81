"""One compiled HF model, its forward timed with the op's own CUDA graphs on and off alternately.

    python benchmarks/probe_op_graphs_e2e.py [--model qwen3] [--size decode1] [--rounds 6] [--reps 30] [--profile]
    python benchmarks/probe_op_graphs_e2e.py --switch dispatch --vs-inductor   # direct dispatch off / on, and inductor
    python benchmarks/probe_op_graphs_e2e.py --switch pack --vs-inductor   # packed op arguments off / on, and inductor

``bench_e2e.py`` compiles a model once per mode, so its ``moe_npu`` and ``moe_npu-plain`` rows come from
two compiles and two stretches of time. Here one ``torch.compile(model, backend="moe_npu")`` serves
both: ``op_graphs.configure(enabled=...)`` switches between rounds (a graph, once captured, stays
cached while off). Per forward: *issue ms* (host time until the call returns, no synchronisation
inside the round) and *latency ms* (CUDA events around one forward, synchronised; ``bench_e2e.py``'s
figure); the median over the round, then the best round. ``--profile`` adds a ``torch.profiler``
table of each mode (top host-time ops of 10 forwards). ``--switch dispatch`` keeps op graphs on and switches
the ops' direct dispatch instead (``moe_compile/ops/registration.py``); ``--switch pack`` compares two
compiles of the model, with ``pack_args`` off and on (``moe_compile/ops/packed.py``); ``--vs-inductor`` adds
a copy of the model compiled with inductor (no CUDA graphs either) to the same rounds.
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
    parser.add_argument("--switch", choices=["op_graphs", "dispatch", "pack"], default="op_graphs",
                        help="what differs between the two moe_npu sides: the op's own CUDA graphs, or (graphs on) "
                             "the ops' direct dispatch (moe_compile.ops.registration.DIRECT), or (graphs on) "
                             "two compiles, options pack_args False / True")
    parser.add_argument("--vs-inductor", action="store_true",
                        help="also time a copy of the model compiled with inductor, in the same rounds")
    args = parser.parse_args(argv)
    import copy

    import moe_compile  # noqa: F401
    from moe_compile.ops import registration

    model = build(args.model, args.layers, False, "cuda")
    ids = torch.randint(0, model.config.vocab_size, SIZES[args.size], device="cuda")
    twin = copy.deepcopy(model) if args.vs_inductor else None
    unpacked = copy.deepcopy(model) if args.switch == "pack" else None
    compiled = torch.compile(model, backend="moe_npu")
    fn = lambda: compiled(input_ids=ids, use_cache=False)  # noqa: E731
    fn_off = fn
    if unpacked is not None:
        compiled_off = torch.compile(unpacked, backend="moe_npu", options={"pack_args": False})
        fn_off = lambda: compiled_off(input_ids=ids, use_cache=False)  # noqa: E731

    def switch(on: bool) -> None:
        if args.switch == "op_graphs":
            op_graphs.configure(enabled=on)
        elif args.switch == "pack":
            op_graphs.configure(enabled=True)
        else:
            op_graphs.configure(enabled=True)
            registration.DIRECT = on

    sides = {False: fn_off, True: fn}
    names = {False: f"{args.switch} off", True: f"{args.switch} on "}
    if twin is not None:
        inductor = torch.compile(twin, backend="inductor")
        sides["inductor"] = lambda: inductor(input_ids=ids, use_cache=False)
        names["inductor"] = "inductor    "
    best = {side: [float("inf")] * 2 for side in sides}
    with torch.no_grad():
        switch(False)
        for _ in range(3):
            ref = fn_off().logits.float()
        switch(True)
        for _ in range(3):  # the second call of each op captures its graph, the third replays it
            out = fn().logits.float()
        print(f"{names[True].strip()} vs off logits, max abs diff: {(out - ref).abs().max().item():.3e}; "
              f"replays so far {op_graphs.STATS['replayed']}, graphs {op_graphs.graphs()}")
        if twin is not None:
            for _ in range(3):
                got = sides["inductor"]().logits.float()
            print(f"inductor vs moe_npu logits, max abs diff: {(got - out).abs().max().item():.3e}")
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                if side != "inductor":
                    switch(side)
                issue, latency = one_round(sides[side], args.reps)
                best[side] = [min(best[side][0], issue), min(best[side][1], latency)]
                print(f"round {r} {names[side]}: issue {issue:.3f} ms, latency {latency:.3f} ms", flush=True)
        switch(True)
        for side in sides:
            print(f"best, {names[side]}: issue {best[side][0]:.3f} ms, latency {best[side][1]:.3f} ms")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for on in (False, True):
                switch(on)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        sides[on]()
                    torch.cuda.synchronize()
                print(f"--- {names[on].strip()}: 10 forwards")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
            switch(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
