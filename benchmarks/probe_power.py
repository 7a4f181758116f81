"""Clock and power under sustained load: our layer against cuBLAS's dense and batched GEMMs of its sizes.

    python benchmarks/probe_power.py [--points mixtral:2048 qwen3:8192 deepseek_v3:8192] [--seconds 3] [--out DIR]

``bench_moe_layer.py`` times each column for a second or more. At the compute-bound points the
H200 reaches its power limit within that time and lowers its SM clock, so the time a column gets
depends on how much power its kernels draw per FLOP as well as on how many clocks they take.
This replays each workload's CUDA graph back to back for ``--seconds`` after a second of rest,
ours and cuBLAS alternately, twice each, with ``nvidia-smi`` sampling the SM clock, the power and
the clock-limit reasons every 50 ms. Per window it prints the time per call and TFLOP/s in the
first 0.3 s and in the last second, the mean SM clock and power in each, and TFLOP/s per GHz of SM
clock, which takes the clock out: what the kernels do per clock.

Three workloads per point: ``ours`` (the whole layer), ``cublas_dense`` (the two GEMMs' sizes on
one expert's weights: the bound's FLOPs, one expert's bytes) and ``cublas_bmm`` (``torch.bmm`` over
every expert's weights with the same rows per expert each, ``M * top_k / E``: the bound's FLOPs and
the layer's weight bytes, without routing, padding or a gather). The last separates what reading E
experts' weights costs in power from what our kernels cost.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from gpu_clock import ClockSampler, window_stats  # noqa: E402

def sustained(graph, seconds: float) -> list[tuple[float, float]]:
    """Replays ``graph`` back to back for ``seconds``: ``(unix time at each replay's end, its us)``,
    at most four replays queued ahead of the GPU."""
    events = [torch.cuda.Event(enable_timing=True)]
    torch.cuda.synchronize()
    t0 = time.time()
    events[0].record()
    while time.time() - t0 < seconds:
        graph.replay()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        events.append(ev)
        if len(events) > 5:
            events[-5].synchronize()
    torch.cuda.synchronize()
    out, base = [], events[0]
    for prev, ev in zip(events, events[1:]):
        out.append((t0 + base.elapsed_time(ev) / 1e3, prev.elapsed_time(ev) * 1e3))
    return out


def batched_gemms(block, shape, m: int, gen: torch.Generator):
    """cuBLAS's batched GEMMs over every expert's weights (HF layout, read through their strides as
    the layer reads them), ``M * top_k / E`` rows each, inputs made beforehand."""
    import bench_moe_layer as bench

    rows, rest = divmod(m * shape.top_k, shape.num_experts)
    if rows == 0 or rest:
        raise ValueError(f"M * top_k = {m * shape.top_k} must be a positive multiple of E = {shape.num_experts}")
    w13, w2 = bench.expert_views(block, shape)
    a1 = torch.randn(shape.num_experts, rows, shape.hidden, device=w13.device, generator=gen).to(w13.dtype)
    a2 = torch.randn(shape.num_experts, rows, shape.inter, device=w13.device, generator=gen).to(w13.dtype)

    def gemms(_x):
        return torch.bmm(a1, w13), torch.bmm(a2, w2)
    return gemms


def probe(name: str, m: int, seconds: float, clock: ClockSampler) -> list[dict]:
    import bench_moe_layer as bench

    shape = bench.SHAPES[name]
    block = bench.build_hf_block(shape)
    ours = bench.our_layer(block, shape)
    gen = torch.Generator(device="cuda").manual_seed(m)
    inputs = [torch.randn(m, shape.hidden, device="cuda", generator=gen).bfloat16() for _ in range(bench.ROTATE)]
    flops_per_call = 6 * m * shape.top_k * shape.hidden * shape.inter
    with torch.no_grad():
        graphs = {"ours": bench.capture_graph(ours, inputs)[0],
                  "cublas_dense": bench.capture_graph(bench.dense_gemms(block, shape, m, gen), inputs)[0],
                  "cublas_bmm": bench.capture_graph(batched_gemms(block, shape, m, gen), inputs)[0]}
        for g in graphs.values():  # compile and warm up before the windows
            g.replay()
        torch.cuda.synchronize()
        windows = []
        for rnd in range(2):
            for what, graph in graphs.items():
                time.sleep(1.0)
                replays = sustained(graph, seconds)
                windows.append((what, rnd, replays))
    samples = clock.samples()
    rows = []
    for what, rnd, replays in windows:
        start, end = replays[0][0], replays[-1][0]
        row = {"shape": name, "M": m, "what": what, "round": rnd,
               "first": window_stats(samples, replays, start, start + 0.3),
               "last": window_stats(samples, replays, end - 1.0, end + 0.01)}
        for part in ("first", "last"):
            w = row[part]
            w["tflops"] = flops_per_call * bench.ROTATE / (w["replay_us"] * 1e-6) / 1e12
            w["tflops_per_ghz"] = w["tflops"] / (w["mhz"] / 1e3)
        rows.append(row)
    del graphs, block, ours
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    import bench_moe_layer as bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", type=bench.point,
                        default=[("mixtral", 2048), ("qwen3", 8192), ("deepseek_v3", 8192)])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", default=None, help="write power.json here")
    args = parser.parse_args(argv)
    if not bench.cuda_or_say("probe_power.py"):
        return 0
    rows = []
    with ClockSampler(torch.cuda.current_device()) as clock:
        print(f"{'point':<18}{'what':<14}{'rnd':>4} | {'first 0.3 s: us/call':>20}{'MHz':>6}{'W':>5}{'TF/s':>6}"
              f"{'TF/GHz':>7} | {'last 1 s: us/call':>18}{'MHz':>6}{'W':>5}{'TF/s':>6}{'TF/GHz':>7}  reasons")
        for name, m in args.points:
            for r in probe(name, m, args.seconds, clock):
                rows.append(r)
                f, la = r["first"], r["last"]
                print(f"{name + ':' + str(m):<18}{r['what']:<14}{r['round']:>4} | "
                      f"{f['replay_us'] / bench.ROTATE:20.1f}{f['mhz']:6.0f}{f['watts']:5.0f}{f['tflops']:6.0f}"
                      f"{f['tflops_per_ghz']:7.0f} | {la['replay_us'] / bench.ROTATE:18.1f}{la['mhz']:6.0f}"
                      f"{la['watts']:5.0f}{la['tflops']:6.0f}{la['tflops_per_ghz']:7.0f}  {la['reasons']}", flush=True)
    bench.write_json(args.out, "power.json", {"device": torch.cuda.get_device_name(), "seconds": args.seconds,
                                              "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
