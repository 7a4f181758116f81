"""One MoE layer under two sets of tuned plans, A and B, timed in turn in one process (CUDA).

    python benchmarks/ab_layer.py --b-dir my_configs --points mixtral:2048 qwen3:8192 --rounds 6
    python benchmarks/ab_layer.py --a-dir old_configs --points deepseek_v3:8192
    python benchmarks/ab_layer.py --b-set mixtral:2048:gemm2.split_k=1 --points mixtral:2048 --control

``--a-dir`` / ``--b-dir`` name a directory of tuned files read before the shipped ones (as
``$MOE_COMPILE_CONFIG_DIR`` does); left out, that side runs the shipped plans. ``--a-set`` /
``--b-set`` change fields of single points' plans on that side (``plan_override.py``), so one
changed field needs no hand-edited copy of a tuned file. ``--apply`` (with ``--control``) writes
B's plan into the tuned file where ``verdict`` accepts it: faster in every round, by 1 % or more
at the median and by more than twice what the control moved. Each point builds
the layer once, captures one CUDA graph per side (the plan is chosen at capture), checks that both
sides compute the same output, then replays the two graphs alternately, ``--rounds`` times each,
with the side that goes first swapped every round. So both sides see the same weights, inputs,
clocks and temperature, and one call costs one process start instead of four. ``--control``
also captures A's plans a second time, after B's (side ``A2``), and reports A2 / A: the ratio
that capture order and buffer placement give with no change of plan at all.

Twelfth session: the same config's GEMM timing moved by up to 7 % between rounds within one run
on the H200 and single timings by 10-20 % (``results/README.md``), and A B A B runs of
``bench_moe_layer.py`` in separate processes differed by 1-5 % on unchanged code; this is the
cheaper and fairer way to compare plans.

Thirteenth session (first runs on the H200): an A/A run (both sides the shipped plans) gave
B/A 0.9985 at Qwen3 M = 2048 and 0.9987 at Mixtral M = 256. But at Mixtral M = 2048 side B came
out about 1 % slower than A whichever plan it held (split-K on B: 1.0158, 1.0130; split-K on A:
1.0097), so a 1 % difference there says nothing. With ``--control`` (run 7): split-K against
none B/A 1.0045 with A2/A 1.0032 (no difference); DeepSeek-V3 M = 8192's expert order B/A 0.9716
with A2/A 1.0025, and 0.4-3.8 % faster in every one of 18 earlier rounds (on a fresh machine,
run 8: B/A 0.9845, A2/A 0.9991): that plan now uses it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import (  # noqa: E402
    ROTATE, ALL_SHAPES, _event_time, bound_us, build_hf_block, capture_graph, cuda_or_say, our_layer, point,
    write_json,
)

from plan_override import parse_override, tuned_table, write_overrides  # noqa: E402
from tune_triton import write_table  # noqa: E402

from moe_compile.kernels.triton import configs  # noqa: E402

MAX_REL_DIFF = 2e-2  # bf16 outputs of two plans: different tiles sum in other orders (~3e-3 seen)
MIN_GAIN = 0.01  # --apply: B's median gain over A must reach this, and twice what the control moved


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


def order(rnd: int, sides: tuple[str, ...] = ("A", "B")) -> tuple[str, ...]:
    """The sides in round ``rnd``, rotated by one each round: with A and B, A first in even rounds,
    B first in odd ones; with the control A2 too, each side goes first every third round."""
    k = rnd % len(sides)
    return tuple(sides[k:] + sides[:k])


def summary(times: dict[str, list[float]]) -> dict:
    """Medians of each side and of the per-round ratios B / A (rounds pair up in time)."""
    out = {f"{side}_median_us": statistics.median(t) for side, t in times.items()}
    for side in [s for s in times if s != "A"]:
        ratios = [x / a for a, x in zip(times["A"], times[side])]
        out.update({f"{side}_over_A_median": statistics.median(ratios), f"{side}_over_A_min": min(ratios),
                    f"{side}_over_A_max": max(ratios)})
    return out


def verdict(row: dict) -> tuple[bool, str]:
    """Whether side B's plan should replace A's at this point (``--apply``): B faster than A in
    every round, by at least ``MIN_GAIN`` at the median and by more than twice what the control
    (A's plans captured again) moved."""
    if "error" in row:
        return False, row["error"]
    if row["sides"]["B"]["plan_dict"] == row["sides"]["A"]["plan_dict"]:
        return False, "both sides ran the same plan"
    if "A2_over_A_median" not in row:
        return False, "no control was timed (--control)"
    gain, noise = 1 - row["B_over_A_median"], abs(row["A2_over_A_median"] - 1)
    if row["B_over_A_max"] >= 1:
        return False, f"B was not faster in every round (B/A up to {row['B_over_A_max']:.4f})"
    if gain < MIN_GAIN or gain <= 2 * noise:
        return False, f"gain {gain:.2%} below {MIN_GAIN:.0%} or twice the control's {noise:.2%}"
    return True, f"B/A {row['B_over_A_median']:.4f}, every round faster, control A2/A {row['A2_over_A_median']:.4f}"


def apply_rows(rows: list[dict], config_dir: Path, device: str) -> list[str]:
    """Write side B's plan into ``config_dir``'s tuned file at each point ``verdict`` accepts (the
    file copied from the shipped one first if ``config_dir`` has none); returns what it did."""
    said = []
    for row in rows:
        ok, why = verdict(row)
        where = f"{row['shape']} M={row['M']}"
        if not ok:
            said.append(f"{where}: kept ({why})")
            continue
        path, table = tuned_table(ALL_SHAPES[row["shape"]], config_dir, device)
        if str(row["M"]) not in table:
            said.append(f"{where}: kept (not a tuned point of {path.name})")
            continue
        table[str(row["M"])] = dict(row["sides"]["B"]["plan_dict"], us=round(row["B_median_us"], 1),
                                    _from=f"benchmarks/ab_layer.py --apply ({why})")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_table(path, table)
        said.append(f"{where}: B's plan written to {path} ({why})")
    return said


def ab_point(block, shape, m: int, dirs: dict[str, str | None], rounds: int, reps: int) -> dict:
    """``dirs``: side -> plan directory, captured in that order (``A2``, the control, is A's
    plans captured again after B's)."""
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
            row["sides"][side] = {"dir": directory or "(shipped)", "plan": configs.describe_plan(plan),
                                  "plan_dict": plan.to_dict()}
        use_plans(None)
    diff = ((outs["B"] - outs["A"]).norm() / outs["A"].norm()).item()
    row["rel_diff"] = diff
    if not diff <= MAX_REL_DIFF:
        row["error"] = f"A and B differ by {diff:.2e} (relative), more than {MAX_REL_DIFF}: not timed"
        return row
    times = {side: [] for side in dirs}
    for rnd in range(rounds):
        for side in order(rnd, tuple(dirs)):
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
    parser.add_argument("--a-set", nargs="+", default=[], metavar="SHAPE:M:FIELD=VALUE,...",
                        help="change fields of these points' plans on side A (see plan_override.py)")
    parser.add_argument("--b-set", nargs="+", default=[], metavar="SHAPE:M:FIELD=VALUE,...",
                        help="the same for side B")
    parser.add_argument("--apply", action="store_true",
                        help="write B's plan into the tuned file where it wins (see verdict(); needs --control)")
    parser.add_argument("--apply-to", default=None,
                        help="directory of the tuned files --apply writes (default: $MOE_COMPILE_CONFIG_DIR if set, "
                             "else the shipped ones)")
    parser.add_argument("--control", action="store_true",
                        help="also capture A's plans a second time after B's (side A2) and report A2 / A: "
                             "what capture order and buffer placement alone do to the ratio")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        parser.error(f"--rounds and --reps must be >= 1, got {args.rounds} and {args.reps}")
    for side, directory in (("A", args.a_dir), ("B", args.b_dir)):
        if directory and not Path(directory).is_dir():
            parser.error(f"--{side.lower()}-dir {directory!r} is not a directory")
    if args.apply and not args.control:
        parser.error("--apply needs --control: a gain counts only against what the control moved")
    apply_to = args.apply_to or str(configs.config_dirs()[0])
    for flag, specs in (("--a-set", args.a_set), ("--b-set", args.b_set)):
        for spec in specs:
            try:
                parse_override(spec, ALL_SHAPES)
            except ValueError as exc:
                parser.error(f"{flag}: {exc}")
    if not cuda_or_say("ab_layer"):
        return 2
    dirs = {"A": args.a_dir, "B": args.b_dir}
    for side, specs in (("A", args.a_set), ("B", args.b_set)):
        if specs:
            out_dir = Path(tempfile.mkdtemp(prefix=f"ab_layer_{side}_"))
            device_key = configs.device_key(torch.device("cuda"))
            for line in write_overrides(specs, ALL_SHAPES, dirs[side], out_dir, device_key):
                print(f"side {side}: {line}", flush=True)
            dirs[side] = str(out_dir)
    if args.control:
        dirs["A2"] = args.a_dir
    rows = []
    by_shape: dict[str, list[int]] = {}
    for name, m in args.points:
        by_shape.setdefault(name, []).append(m)
    for name, ms in by_shape.items():
        shape = ALL_SHAPES[name]
        block = build_hf_block(shape)
        for m in ms:
            row = ab_point(block, shape, m, dirs, args.rounds, args.reps)
            rows.append(row)
            for side in dirs:
                print(f"{name} M={m} {side} [{row['sides'][side]['dir']}]: {row['sides'][side]['plan']}", flush=True)
            if "error" in row:
                print(f"{name} M={m}: {row['error']}", flush=True)
                continue
            print(f"{name} M={m}: A {row['A_median_us']:.1f} us ({row['A_median_us'] / row['bound_us']:.3f}x), "
                  f"B {row['B_median_us']:.1f} us ({row['B_median_us'] / row['bound_us']:.3f}x); B/A per round "
                  f"median {row['B_over_A_median']:.4f} (min {row['B_over_A_min']:.4f}, max "
                  f"{row['B_over_A_max']:.4f}); rounds A {[round(t, 1) for t in row['times_us']['A']]} "
                  f"B {[round(t, 1) for t in row['times_us']['B']]}", flush=True)
            if "A2" in dirs:
                print(f"{name} M={m}: control A2 (A's plans captured again after B's) {row['A2_median_us']:.1f} us; "
                      f"A2/A per round median {row['A2_over_A_median']:.4f} (min {row['A2_over_A_min']:.4f}, "
                      f"max {row['A2_over_A_max']:.4f}); rounds A2 {[round(t, 1) for t in row['times_us']['A2']]}",
                      flush=True)
            write_json(args.out, "ab_layer.json", {"rows": rows})
        del block
        torch.cuda.empty_cache()
    if args.apply:
        print("\n".join(apply_rows(rows, Path(apply_to), configs.device_key(torch.device("cuda")))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
