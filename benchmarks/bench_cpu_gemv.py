"""One row per picked expert on the CPU: how fast each way reads the experts' weights.

    OMP_NUM_THREADS=2 python benchmarks/bench_cpu_gemv.py [--out benchmarks/results]

Eight experts of 64 picked at random per call (a decode step's top-8 at one token), one input row
each, ``[K=1024] x [1024, N=768]`` per expert, the weights far larger than the caches:

- ``mm loop``: one ``torch.mm`` per expert, what the op's CPU path runs at decode sizes (MKL);
- ``gather-GEMV``: ``moe_compile.lowering.cpu_decode.gather_gemv`` compiled by Inductor, what a
  compiled graph with a fixed small token count runs;
- ``read``: ``w[e].sum()`` per picked expert, a plain read of the same bytes (the rate to reach).

Columns alternate within each rep, fresh expert ids per call; GB/s = picked experts' weight bytes
per median call. Both layouts: K-major (``[E, N, K]`` storage, as HF keeps its experts; the op
sees ``[E, K, N]`` views) and N-major (``[E, K, N]`` contiguous).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

E, N, K, PICKED = 64, 768, 1024, 8


def run(dtype: torch.dtype, layout: str, reps: int) -> dict:
    from moe_compile.lowering.cpu_decode import gather_gemv

    gen = torch.Generator().manual_seed(0)
    if layout == "K-major":
        w = torch.randn(E, N, K, generator=gen).to(dtype).transpose(1, 2)
    else:
        w = torch.randn(E, K, N, generator=gen).to(dtype)
    x = torch.randn(PICKED, K, generator=gen).to(dtype)
    compiled = torch.compile(gather_gemv, dynamic=False)

    def mm_loop(ids):
        return [torch.mm(x[j:j + 1], w[e]) for j, e in enumerate(ids.tolist())]

    cols = {"mm loop": mm_loop, "gather-GEMV": lambda ids: compiled(w, ids, x),
            "read": lambda ids: [w[e].sum() for e in ids.tolist()]}
    times = {name: [] for name in cols}
    for rep in range(reps + 3):
        names = list(cols)[rep % 3:] + list(cols)[:rep % 3]
        for name in names:
            ids = torch.randperm(E, generator=gen)[:PICKED]
            start = time.perf_counter()
            cols[name](ids)
            if rep >= 3:
                times[name].append(time.perf_counter() - start)
    nbytes = PICKED * N * K * w.element_size()
    return {name: dict(us=statistics.median(t) * 1e6, gb_s=nbytes / statistics.median(t) / 1e9)
            for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    print(f"{'dtype':>9} {'layout':>8} {'mm loop':>18} {'gather-GEMV':>18} {'read':>18} {'GEMV/mm':>8}")
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            for layout in ("K-major", "N-major"):
                res = run(dtype, layout, args.reps)
                rows.append(dict(dtype=str(dtype), layout=layout, **res))
                cells = "".join(f" {res[n]['us']:8.0f}us {res[n]['gb_s']:5.1f}GB/s" for n in res)
                speedup = res["mm loop"]["us"] / res["gather-GEMV"]["us"]
                print(f"{str(dtype)[6:]:>9} {layout:>8}{cells} {speedup:8.2f}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), shape=dict(E=E, N=N, K=K, picked=PICKED))
        (Path(args.out) / "cpu_gemv.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
