"""Decode floors: what any implementation pays at M = 1, timed as ``bench_moe_layer.py`` times ours.

    python benchmarks/probe_floor.py [--points qwen3:1 mixtral:1 deepseek_v3:1] [--reps 200] [--out DIR]

Per point, in one process, each a CUDA graph of ``ROTATE`` calls on the benchmark's own block and
inputs (so each call hits other experts, and no expert stays in L2 from the call before):

- ``launch``: one empty Triton kernel per call (the graph's floor per call);
- ``router``: our router GEMV and routing kernel only (what must run before any expert is known);
- ``stream``: one kernel that reads every byte of the experts the call's routing hits (their gate/up
  and down slices, routing done beforehand) and sums them, no other arithmetic; the best of a few
  launch shapes, so an optimistic floor;
- ``router+stream``: the two above in one call, the stream kernel reading the router's ids;
- ``ours``: the whole layer.

Each is printed with its ratio to the issue's bound and against the issue's target (1.25x the bound
for M <= 256). A ``stream`` above the target says no kernel that reads the hit experts once can meet
it on this device, whatever it computes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from moe_compile.kernels.triton.pdl import pdl_enter, pdl_launch  # noqa: E402

# CHUNK elements per program (a power of two that divides every shape's expert slices), BLOCK per load
LAUNCHES = [(chunk, block, warps) for chunk in (1 << 13, 1 << 14, 1 << 15, 1 << 16, 1 << 17) for block, warps in
            ((2048, 4), (4096, 8), (8192, 8))]


@triton.jit
def _stream_kernel(ids_ptr, w13_ptr, w2_ptr, out_ptr, n13, n2, chunks13, chunks,
                   CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (pair, c): sums chunk ``c`` of the pair's expert, the gate/up slice then the down one."""
    pdl_enter(PDL)
    pair = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    if c < chunks13:
        base = w13_ptr + e * n13 + c.to(tl.int64) * CHUNK
    else:
        base = w2_ptr + e * n2 + (c - chunks13).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, CHUNK, BLOCK):
        acc += tl.load(base + off + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pair * chunks + c, tl.sum(acc, axis=0))


@triton.jit
def _empty_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 0.0)


def stream_experts(ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, launch=LAUNCHES[0]) -> torch.Tensor:
    """``[pairs, chunks]`` fp32 partial sums of each routed pair's expert (``gate_up [E, ...]`` then
    ``down [E, ...]``, each expert's slice contiguous); ``ids`` int ``[T, k]``, one pair per entry."""
    chunk, block, warps = launch
    n13, n2 = gate_up[0].numel(), down[0].numel()
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("gate_up and down must be contiguous [E, ...] tensors")
    if n13 % chunk or n2 % chunk or chunk % block:
        raise ValueError(f"launch {launch!r}: chunk must divide {n13} and {n2}, and block the chunk")
    pairs = ids.numel()
    chunks13 = n13 // chunk
    chunks = chunks13 + n2 // chunk
    out = torch.empty(pairs, chunks, dtype=torch.float32, device=ids.device)
    _stream_kernel[(pairs, chunks)](ids.reshape(-1), gate_up, down, out, n13, n2, chunks13, chunks,
                                    CHUNK=chunk, BLOCK=block, num_warps=warps, **pdl_launch(ids.device))
    return out


def floors(name: str, m: int, reps: int) -> dict:
    import bench_moe_layer as bench
    from moe_compile.kernels.triton.routing import route

    shape = bench.SHAPES[name]
    block = bench.build_hf_block(shape)
    ours = bench.our_layer(block, shape)
    gate_up, down = block.experts.gate_up_proj.contiguous(), block.experts.down_proj.contiguous()
    gate_w = block.gate.weight
    bias = getattr(block.gate, "e_score_correction_bias", None)
    cfg = bench.routing_config(shape)
    router_logits = torch.ops.moe_compile.router_logits
    out_dtype = torch.float32 if gate_w.dtype == torch.float32 else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(m)
    inputs = [torch.randn(m, shape.hidden, device="cuda", generator=gen).bfloat16() for _ in range(bench.ROTATE)]
    sink = torch.empty(1024, device="cuda")

    def router(x):
        return route(router_logits(x, gate_w, None, out_dtype), cfg, bias)

    with torch.no_grad():
        bound, hits = bench.bound_us(block, shape, inputs)
        ids_of = {id(x): router(x)[1] for x in inputs}
        # the stream reads every byte of each pair's expert: the bound's bytes when no expert repeats
        pairs_distinct = all(torch.unique(ids_of[id(x)]).numel() == ids_of[id(x)].numel() for x in inputs)
        for x in inputs:  # the kernel sums what it read: check it against torch before timing
            ids = ids_of[id(x)].long().reshape(-1)
            got = stream_experts(ids_of[id(x)], gate_up, down).sum(1)
            want = gate_up[ids].float().flatten(1).sum(1) + down[ids].float().flatten(1).sum(1)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-1)
        row = {"shape": name, "M": m, "bound_us": bound, "experts_hit": hits, "target_us": 1.25 * bound,
               "pairs_distinct": pairs_distinct}
        row["launch_us"] = bench.graph_time_us(lambda x: _empty_kernel[(1,)](sink), inputs, reps)
        row["router_us"] = bench.graph_time_us(router, inputs, reps)
        per_launch = {}
        for launch in LAUNCHES:
            per_launch[launch] = bench.graph_time_us(lambda x, la=launch: stream_experts(ids_of[id(x)], gate_up, down, la),
                                           inputs, max(20, reps // 4))
        best = min(per_launch, key=per_launch.get)
        row["stream_launch"] = list(best)
        row["stream_us"] = bench.graph_time_us(lambda x: stream_experts(ids_of[id(x)], gate_up, down, best), inputs, reps)
        row["router_stream_us"] = bench.graph_time_us(lambda x: stream_experts(router(x)[1], gate_up, down, best),
                                            inputs, reps)
        row["ours_us"] = bench.graph_time_us(ours, inputs, reps)
    moved = hits * (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    row["stream_tb_per_s"] = moved / row["stream_us"] / 1e6
    for key in ("launch", "router", "stream", "router_stream", "ours"):
        row[f"{key}_ratio"] = row[f"{key}_us"] / bound
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    import bench_moe_layer as bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", type=bench.point,
                        default=[("qwen3", 1), ("mixtral", 1), ("deepseek_v3", 1)])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", default=None, help="write floors.json here")
    args = parser.parse_args(argv)
    if not bench.cuda_or_say("probe_floor.py"):
        return 0
    rows = []
    print(f"{'point':<16}{'bound':>8}{'target':>8}{'launch':>8}{'router':>8}{'stream':>8}{'TB/s':>6}"
          f"{'rt+str':>8}{'ours':>8}  (us; stream launch)")
    for name, m in args.points:
        r = floors(name, m, args.reps)
        rows.append(r)
        print(f"{name + ':' + str(m):<16}{r['bound_us']:8.1f}{r['target_us']:8.1f}{r['launch_us']:8.1f}"
              f"{r['router_us']:8.1f}{r['stream_us']:8.1f}{r['stream_tb_per_s']:6.2f}{r['router_stream_us']:8.1f}"
              f"{r['ours_us']:8.1f}  {tuple(r['stream_launch'])}"
              f"{'' if r['pairs_distinct'] else ' (experts repeat: the stream over-reads)'}", flush=True)
    bench.write_json(args.out, "floors.json", {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "median_of": statistics.median.__name__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
