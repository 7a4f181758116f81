"""One MoE layer across ranks: single device vs EP static vs EP dynamic vs EP batched vs TP (issue 7).

    # two H200s, NCCL (leave NVLink multicast off: NCCL_NVLS_ENABLE=0)
    python benchmarks/bench_distributed.py --world-size 2 --out benchmarks/results
    # smoke test on CPU with gloo
    python benchmarks/bench_distributed.py --device cpu --backend gloo --tiny --sizes 1 8

Every rank gets the same ``M`` tokens (``tokens_full=True``), so "M per rank" is the batch each
rank serves. Times are the median of CUDA-event (or wall-clock) timed calls; "graphs" says whether
the call could be captured in a CUDA graph (the dynamic dispatcher needs a host sync, so it never
is). ``comm %`` is the share of the profiled time spent in collective kernels (NCCL) or calls
(gloo). Outputs are checked against the single-device result on every rank.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import timed  # noqa: E402  (median ms, CUDA events or wall clock)

SHAPES = {  # hidden, moe intermediate, experts, top-k, routing kwargs
    "qwen3": (2048, 768, 128, 8, dict(renormalize=True)),
    "deepseek_v3": (7168, 2048, 256, 8, dict(routing_method="sigmoid", group_count=8, k_group=4,
                                              group_select_mode=1, routed_scaling_factor=2.5)),
}
COMM_WORDS = ("nccl", "gloo", "c10d::", "all_reduce", "all_to_all", "all_gather", "reduce_scatter", "allreduce",
              "alltoall", "allgather")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(name, tiny, device, dtype):
    hidden, inter, experts, top_k, routing = SHAPES[name]
    if tiny:
        hidden, inter, experts = 64, 32, 16
        routing = dict(routing, group_count=4, k_group=2) if "group_count" in routing else routing
    gen = torch.Generator(device).manual_seed(0)  # on the device: the same values on every rank, fast

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * 0.02

    w13, w2 = rnd(experts, 2 * inter, hidden).transpose(1, 2), rnd(experts, hidden, inter).transpose(1, 2)
    bias = rnd(experts).float() if routing.get("routing_method") == "sigmoid" else None
    return hidden, experts, top_k, routing, w13, w2, bias


def _graphed(fn, device):
    if device != "cuda":
        return None
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception:  # dynamic dispatch (host sync) or a collective that cannot be captured
        torch.cuda.synchronize()
        return None


def _comm_share(fn, device) -> float:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    total = comm = 0.0
    for evt in prof.key_averages():
        t = evt.self_device_time_total if device == "cuda" else evt.self_cpu_time_total
        total += t
        if any(w in evt.key.lower() for w in COMM_WORDS):
            comm += t
    return 100.0 * comm / total if total else 0.0


def _modes(rank, world, w13, w2):
    from moe_compile.distributed import shard_experts_for_ep, shard_for_tp

    ep = shard_experts_for_ep(w13, w2, rank=rank, world_size=world)
    tp = shard_for_tp(w13, w2, rank=rank, world_size=world)
    group = dist.group.WORLD
    return {
        "ep_static": (ep.w13, ep.w2, dict(ep_group=group, dispatcher_type="static")),
        "ep_dynamic": (ep.w13, ep.w2, dict(ep_group=group, dispatcher_type="dynamic")),
        "ep_batched": (ep.w13, ep.w2, dict(ep_group=group, dispatcher_type="batched")),
        "tp": (tp.w13, tp.w2, dict(tp_group=group, dispatcher_type="static")),
    }


def _worker(rank, world, port, args, rows_dir):
    from moe_compile import fused_moe

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for name in args.models:
        hidden, experts, top_k, routing, w13, w2, bias = _weights(name, args.tiny, device, dtype)
        extra = dict(routing, e_score_correction_bias=bias) if bias is not None else dict(routing)
        modes = _modes(rank, world, w13, w2)
        for tokens in args.sizes:
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
            logits = torch.randn(tokens, experts, generator=gen).to(dtype).to(device)
            single = lambda: fused_moe(x, logits, experts, top_k, w13, w2, **extra)  # noqa: E731
            ref = single()
            calls = {"single": single}
            for mode, (a, b, kw) in modes.items():
                calls[mode] = (lambda a=a, b=b, kw=kw: fused_moe(x, logits, experts, top_k, a, b, **extra, **kw))
            for mode, fn in calls.items():
                out = fn()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                replay = _graphed(fn, device) if mode != "ep_dynamic" else None  # dynamic syncs on the host
                ms = timed(replay or fn, args.reps, device)
                ms_eager = timed(fn, args.reps, device) if replay is not None else ms
                share = _comm_share(fn, device) if mode != "single" else 0.0
                row = dict(model=name, tokens=tokens, mode=mode, ms=ms, ms_eager=ms_eager, graphs=replay is not None,
                           comm_pct=share, rel_err_vs_single=err, rank=rank)
                with open(os.path.join(rows_dir, "rank%d.jsonl" % rank), "a") as f:  # kept if a later row hangs
                    f.write(json.dumps(row) + "\n")
                print("rank %d %s M=%d %s: %.3f ms (eager %.3f) graphs=%s comm %.1f%% err %.1e" % (
                    rank, name, tokens, mode, ms, ms_eager, replay is not None, share, err), file=sys.stderr,
                    flush=True)
                dist.barrier()
    dist.destroy_process_group()


LINE = re.compile(r"rank (\d+) (\S+) M=(\d+) (\S+): ([\d.]+) ms(?: \(eager ([\d.]+)\))? graphs=(\w+) "
                  r"comm ([\d.]+)% err ([\d.e+-]+)")


def rows_from_log(path: str) -> list[list[dict]]:
    """The per-rank rows of a run's stderr log (the lines every rank prints as it goes)."""
    by_rank: dict[int, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        m = LINE.match(line.strip())
        if m:
            rank, model, tokens, mode, ms, eager, graphs, comm, err = m.groups()
            by_rank.setdefault(int(rank), []).append(dict(
                model=model, tokens=int(tokens), mode=mode, ms=float(ms), ms_eager=float(eager or ms),
                graphs=graphs == "True", comm_pct=float(comm), rel_err_vs_single=float(err), rank=int(rank)))
    return [by_rank[r] for r in sorted(by_rank)]


def rows_from_dir(path: str, world: int) -> list[list[dict]]:
    out = []
    for rank in range(world):
        f = Path(path) / ("rank%d.jsonl" % rank)
        out.append([json.loads(line) for line in f.read_text().splitlines()] if f.exists() else [])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 32, 256, 2048])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--backend", default=None, help="nccl on cuda, gloo on cpu by default")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--deadline-s", type=float, default=3600.0, help="kill ranks still running after this")
    parser.add_argument("--from-log", default=None, help="only print the table of an earlier run's stderr log")
    args = parser.parse_args(argv)
    if args.from_log:
        return report(rows_from_log(args.from_log), args, source=args.from_log)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        print("needs %d GPUs, found %d" % (args.world_size, torch.cuda.device_count()), file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    rows_dir = tempfile.mkdtemp(prefix="bench_dist_")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world_size, port, args, rows_dir))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    end = time.monotonic() + args.deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
    return report(rows_from_dir(rows_dir, args.world_size), args, source="this run")


def report(results: list[list[dict]], args, source: str) -> int:
    if not results or not results[0]:
        print("no rows (%s)" % source, file=sys.stderr)
        return 1
    def across(r, key, fn):
        return fn(o[key] for rr in results for o in rr
                  if (o["model"], o["tokens"], o["mode"]) == (r["model"], r["tokens"], r["mode"]))

    rows = [dict(r, ms=across(r, "ms", max), ms_eager=across(r, "ms_eager", max), comm_pct_min=across(r, "comm_pct", min),
                 comm_pct_max=across(r, "comm_pct", max), rel_err_vs_single=across(r, "rel_err_vs_single", max))
            for r in results[0]]
    worst = max((r["rel_err_vs_single"] for r in rows), default=0.0)
    print("ms / eager ms: the slowest rank's median with / without CUDA-graph replay; comm%: share of the "
          "profiled GPU time in collectives, lowest and highest rank (a rank that waits for its peer counts the "
          "wait); err: worst rank vs the single device")
    print("%-12s %6s %-11s %9s %9s %7s %11s %9s" % ("model", "M", "mode", "ms", "eager ms", "graphs", "comm%",
                                                    "err"))
    for r in rows:
        comm = "%.0f-%.0f" % (r["comm_pct_min"], r["comm_pct_max"]) if r["mode"] != "single" else "-"
        print("%-12s %6d %-11s %9.3f %9.3f %7s %11s %9.1e" % (r["model"], r["tokens"], r["mode"], r["ms"],
                                                              r["ms_eager"], "yes" if r["graphs"] else "no", comm,
                                                              r["rel_err_vs_single"]))
    print("worst relative error vs single device on any rank: %.2e" % worst)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "distributed.json", "w") as f:
            json.dump({"argv": sys.argv, "source": source, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
