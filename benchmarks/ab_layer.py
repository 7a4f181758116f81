"""One MoE layer under two sets of tuned plans, A and B, timed in turn in one process (CUDA).

    python benchmarks/ab_layer.py --b-dir my_configs --points mixtral:2048 qwen3:8192 --rounds 6
    python benchmarks/ab_layer.py --a-dir old_configs --points deepseek_v3:8192

``--a-dir`` / ``--b-dir`` name a directory of tuned files read before the shipped ones (as
``$MOE_COMPILE_CONFIG_DIR`` does); left out, that side runs the shipped plans. Each point builds
the layer once, captures one CUDA graph per side (the plan is chosen at capture), checks that both
sides compute the same output, then replays the two graphs alternately, ``--rounds`` times each,
with the side that goes first swapped every round. So both sides see the same weights, inputs,
clocks and temperature, and one call costs one process start instead of four.

Twelfth session: the same config's GEMM timing moved by up to 7 % between rounds within one run
on the H200 and single timings by 10-20 % (``results/README.md``), and A B A B runs of
``bench_moe_layer.py`` in separate processes differed by 1-5 % on unchanged code; this is the
cheaper and fairer way to compare plans.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import (  # noqa: E402
    ROTATE, SHAPES, _event_time, bound_us, build_hf_block, capture_graph, cuda_or_say, our_layer, point,
    write_json,
)

from moe_compile.kernels.triton import configs  # noqa: E402

MAX_REL_DIFF = 2e-2  # bf16 outputs of two plans: different tiles sum in other orders (~3e-3 seen)


def use_plans(directory: str | None) -> None:
    """Look plans up in ``directory`` first (``None``: the shipped plans only), from now on."""
    if directory:
        os.environ[configs.USER_DIR_ENV] = str(Path(directory).resolve())
    else:
        os.environ.pop(configs.USER_DIR_ENV, None)
    configs.reload()


def capture(fn, inputs):
    """A CUDA graph calling ``fn`` on each input in turn, and the first call's output after a replay."""
    graph, outs = capture_graph(fn, inputs)
    graph.replay()
    torch.cuda.synchronize()
    return graph, outs[0].float().clone()


def order(rnd: int) -> tuple[str, str]:
    """The sides in round ``rnd``: A first in even rounds, B first in odd ones."""
    return ("A", "B") if rnd % 2 == 0 else ("B", "A")


def summary(times: dict[str, list[float]]) -> dict:
    """Medians of each side and of the per-round ratios B / A (rounds pair up in time)."""
    ratios = [b / a for a, b in zip(times["A"], times["B"])]
    return {"A_median_us": statistics.median(times["A"]), "B_median_us": statistics.median(times["B"]),
            "B_over_A_median": statistics.median(ratios), "B_over_A_min": min(ratios),
            "B_over_A_max": max(ratios)}


def ab_point(block, shape, m: int, dirs: dict[str, str | None], rounds: int, reps: int) -> dict:
    ours = our_layer(block, shape)
    gen = torch.Generator(device="cuda").manual_seed(m)
    inputs = [torch.randn(m, shape.hidden, device="cuda", generator=gen).bfloat16() for _ in range(ROTATE)]
    row = {"shape": shape.name, "M": m, "sides": {}}
    with torch.no_grad():
        row["bound_us"], _ = bound_us(block, shape, inputs)
        graphs, outs = {}, {}
        for side, directory in dirs.items():
            use_plans(directory)
            plan = configs.choose_plan(num_tokens=m, top_k=shape.top_k, num_local=shape.num_experts,
                                       hidden=shape.hidden, inter=shape.inter, dtype=torch.bfloat16,
                                       device=inputs[0].device)
            graphs[side], outs[side] = capture(ours, inputs)
            row["sides"][side] = {"dir": directory or "(shipped)", "plan": configs.describe_plan(plan)}
        use_plans(None)
    diff = ((outs["B"] - outs["A"]).norm() / outs["A"].norm()).item()
    row["rel_diff"] = diff
    if not diff <= MAX_REL_DIFF:
        row["error"] = f"A and B differ by {diff:.2e} (relative), more than {MAX_REL_DIFF}: not timed"
        return row
    times = {"A": [], "B": []}
    for rnd in range(rounds):
        for side in order(rnd):
            times[side].append(_event_time(graphs[side].replay, reps) / len(inputs))
    row["times_us"] = times
    row.update(summary(times))
    del graphs
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", type=point, required=True)
    parser.add_argument("--a-dir", default=None, help="tuned files read before the shipped ones on side A")
    parser.add_argument("--b-dir", default=None, help="the same for side B")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None, help="directory for ab_layer.json")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        parser.error(f"--rounds and --reps must be >= 1, got {args.rounds} and {args.reps}")
    for side, directory in (("A", args.a_dir), ("B", args.b_dir)):
        if directory and not Path(directory).is_dir():
            parser.error(f"--{side.lower()}-dir {directory!r} is not a directory")
    if not cuda_or_say("ab_layer"):
        return 2
    dirs = {"A": args.a_dir, "B": args.b_dir}
    rows = []
    by_shape: dict[str, list[int]] = {}
    for name, m in args.points:
        by_shape.setdefault(name, []).append(m)
    for name, ms in by_shape.items():
        shape = SHAPES[name]
        block = build_hf_block(shape)
        for m in ms:
            row = ab_point(block, shape, m, dirs, args.rounds, args.reps)
            rows.append(row)
            for side in ("A", "B"):
                print(f"{name} M={m} {side} [{row['sides'][side]['dir']}]: {row['sides'][side]['plan']}", flush=True)
            if "error" in row:
                print(f"{name} M={m}: {row['error']}", flush=True)
                continue
            print(f"{name} M={m}: A {row['A_median_us']:.1f} us ({row['A_median_us'] / row['bound_us']:.3f}x), "
                  f"B {row['B_median_us']:.1f} us ({row['B_median_us'] / row['bound_us']:.3f}x); B/A per round "
                  f"median {row['B_over_A_median']:.4f} (min {row['B_over_A_min']:.4f}, max "
                  f"{row['B_over_A_max']:.4f}); rounds A {[round(t, 1) for t in row['times_us']['A']]} "
                  f"B {[round(t, 1) for t in row['times_us']['B']]}", flush=True)
            write_json(args.out, "ab_layer.json", {"rows": rows})
        del block
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
