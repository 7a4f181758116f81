"""DeepSeek-V4's MoE block, hash-routed and top-k routed: eager vs ``torch.compile`` (inductor) vs
``backend="moe_npu"``.

    python benchmarks/bench_hash_layer.py [--ms 1 32 256 2048 8192] [--types hash_moe moe] [--out DIR]

The block is transformers' ``DeepseekV4SparseMoeBlock`` at its config's defaults (E = 256, top-6,
H = 4096, I = 2048, clamped SwiGLU with limit 10, one shared expert), bf16 on CUDA,
``experts_implementation="grouped_mm"``, random weights; a hash layer's ``tid2eid`` table gets 6 distinct
experts per token id. In a hash layer the pass keeps the router (the table lookup and the gathered
sqrt-softplus scores) and rewrites the experts alone into ``moe_compile::fused_experts``; in a top-k layer
it rewrites the whole block into ``fused_moe``. Each compiled mode is compiled once with the token count
dynamic, then each M is timed as a median of ``--reps`` forwards (CUDA events, as ``bench_e2e.py``); the
``-cg`` modes compile with ``mode="reduce-overhead"`` (CUDA graphs), the others run without graphs, where
the host's launch work shows (an eager ``fused_moe`` call costs ~400 us of host time on the H200).
``bound`` is the routed experts' lower bound as in ``bench_moe_layer.py`` (max(bytes of the experts hit /
4.8 TB/s, FLOPs / 790 TFLOP/s)), the shared expert left out. Prints a table;
writes ``hash_layer.json`` under ``--out``. ``--tiny --device cpu``: a smoke run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import timed  # noqa: E402


HBM_BYTES_PER_S = 4.8e12
BF16_FLOP_PER_S = 790e12
DIMS = dict(hidden_size=4096, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=6)
TINY = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4)
VOCAB = 1024
MODES = ("eager", "inductor", "moe_npu", "inductor-cg", "moe_npu-cg")  # -cg: mode="reduce-overhead" (CUDA graphs)


def build(layer_type: str, tiny: bool, device: str):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    cfg = DeepseekV4Config(**(TINY if tiny else DIMS), routed_scaling_factor=1.5, swiglu_limit=10.0,
                           mlp_layer_types=[layer_type], num_hidden_layers=1, vocab_size=VOCAB)
    cfg._experts_implementation = "grouped_mm"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the weights in their dtype directly (no fp32 copy)
    try:
        with torch.device(device):
            block = DeepseekV4SparseMoeBlock(cfg, layer_idx=0)
    finally:
        torch.set_default_dtype(default_dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for _, p in block.named_parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        gate = block.gate
        if hasattr(gate, "tid2eid"):
            experts, k = gate.num_experts, gate.top_k
            rows = torch.rand(VOCAB, experts, generator=gen, device=device).argsort(dim=1)[:, :k]
            gate.tid2eid.copy_(rows)
        if hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.normal_(0.0, 0.05, generator=gen)
    return block.eval(), cfg


def bound_us(block, ids: torch.Tensor) -> float:
    """The routed experts' lower bound, from the experts this batch hits."""
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    hit = torch.unique(ids).numel()
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    flops = 2 * ids.numel() * (gate_up[0].numel() + down[0].numel())
    return max(hit * per_expert / HBM_BYTES_PER_S, flops / BF16_FLOP_PER_S) * 1e6


def routed_ids(block, x, input_ids) -> torch.Tensor:
    gate = block.gate
    with torch.no_grad():
        out = gate(x, input_ids) if hasattr(gate, "tid2eid") else gate(x)
    return out[2]


def run_type(layer_type: str, args) -> list[dict]:
    import moe_compile  # noqa: F401,F811  (registers backend="moe_npu")

    block, cfg = build(layer_type, args.tiny, args.device)
    gen = torch.Generator(device=args.device).manual_seed(1)
    dtype = next(block.parameters()).dtype
    inputs = {m: (torch.randn(1, m, cfg.hidden_size, device=args.device, generator=gen).to(dtype),
                  torch.randint(0, VOCAB, (1, m), device=args.device, generator=gen)) for m in args.ms}
    rows, eager_out = [], {}
    for mode in args.modes:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        graphs = "reduce-overhead" if mode.endswith("-cg") else None
        if mode == "eager":
            fn = block
        elif mode.startswith("inductor"):
            fn = torch.compile(block, dynamic=True, mode=graphs)
        else:
            fn = torch.compile(block, backend="moe_npu", dynamic=True, mode=graphs)
        if graphs:  # a replay overwrites the last output: mark each step and copy the output out
            compiled = fn

            def fn(*args):
                torch.compiler.cudagraph_mark_step_begin()
                return compiled(*args).clone()
        for m in args.ms:
            x, input_ids = inputs[m]
            call = (lambda: fn(x, input_ids)) if layer_type == "hash_moe" else (lambda: fn(x))
            with torch.no_grad():
                sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
                sync()
                t0 = time.perf_counter()
                out = call()
                sync()
                first_s = time.perf_counter() - t0
                call()
                ms = timed(call, args.reps, args.device)
            row = {"layer_type": layer_type, "m": m, "mode": mode, "us": ms * 1e3, "first_call_s": first_s}
            if mode == "eager":
                eager_out[m] = out.float()
                row["bound_us"] = bound_us(block, routed_ids(block, x.reshape(m, -1), input_ids))
            else:
                ref = eager_out.get(m)
                if ref is not None:
                    row["rel_err_vs_eager"] = ((out.float() - ref).norm() / ref.norm()).item()
            if mode.startswith("moe_npu"):
                counters = torch._dynamo.utils.counters["moe_compile"]
                row["rewritten"] = int(counters["rewritten"])
            rows.append(row)
            print(format_row(row, rows), flush=True)
    del block
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def format_row(row: dict, rows: list[dict]) -> str:
    same = {r["mode"]: r for r in rows if r["layer_type"] == row["layer_type"] and r["m"] == row["m"]}
    eager = same.get("eager")
    bound = eager.get("bound_us") if eager else None
    parts = ["%-9s" % row["layer_type"], "%6d" % row["m"], "%-9s" % row["mode"], "%10.1f us" % row["us"],
             "x%.2f vs eager" % (eager["us"] / row["us"]) if eager else "", "first %.1f s" % row["first_call_s"]]
    if bound:
        parts.append("%.2fx bound (%.1f us)" % (row["us"] / bound, bound))
    if "rel_err_vs_eager" in row:
        parts.append("err %.1e" % row["rel_err_vs_eager"])
    if "rewritten" in row:
        parts.append("rewritten %d" % row["rewritten"])
    return "  ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 32, 256, 2048, 8192])
    parser.add_argument("--types", nargs="+", default=["hash_moe", "moe"], choices=["hash_moe", "moe"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)  # eager first: it sets the bound
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny dimensions (a CPU smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_hash_layer: no CUDA device here; run with --tiny --device cpu for a smoke run")
        return 0
    rows = [row for layer_type in args.types for row in run_type(layer_type, args)]
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "hash_layer.json", "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
