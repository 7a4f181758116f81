"""Whole HF models: eager vs ``torch.compile`` (inductor) vs ``torch.compile(backend="moe_npu")``.

    python benchmarks/bench_e2e.py [--models mixtral qwen3 deepseek_v3 gemma4] [--layers 2]
        [--sizes prefill decode] [--modes eager inductor moe_npu] [--out benchmarks/results]

Each model is its HF ``*ForCausalLM`` with the layer dimensions of the real model (hidden size,
experts, top-k, expert intermediate size; ``--layers`` decoder layers, every one an MoE layer),
random weights, bf16 on CUDA, ``experts_implementation="grouped_mm"``. Sizes: ``prefill`` is one
sequence of 2048 tokens, ``decode`` is 32 sequences of one token (a forward without KV cache:
M = 32 tokens through each MoE layer), ``decode1`` (not run by default) one sequence of one token. For each mode: the compile time (first call, which
compiles) and the median time of a steady-state forward (CUDA events; no CUDA graphs in any mode).
The moe_npu rows also give the number of MoE blocks the pass rewrote, how many calls replayed the
op's own CUDA graphs (``moe_compile/lowering/op_graphs.py``; mode ``moe_npu-plain`` turns them off) and the
logits' error against eager. Prints a table; writes ``e2e.json`` under ``--out``. ``--tiny`` shrinks every
dimension (a CPU smoke run: ``--tiny --device cpu``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

SIZES = {"prefill": (1, 2048), "decode": (32, 1), "decode1": (1, 1)}
DEFAULT_SIZES = ("prefill", "decode")
DIMS = {  # hidden, moe intermediate, experts, top-k
    "mixtral": (4096, 14336, 8, 2),
    "qwen3": (2048, 768, 128, 8),
    "deepseek_v3": (7168, 2048, 256, 8),
    # Gemma 4 26B-A4B as publicly described (its config is not read here): dense MLP 2112 beside the
    # MoE block in every layer, 16 heads of 256 (8 KV), global layers' heads 512; needs transformers with gemma4
    "gemma4": (2816, 704, 128, 8),
}
ISSUE_MODELS = ("mixtral", "qwen3", "deepseek_v3")  # the default: the issue's three


def make_config(name: str, layers: int, tiny: bool):
    hidden, inter, experts, top_k = DIMS[name]
    if tiny:
        hidden, inter, experts = 64, 32, min(experts, 16)
        top_k = min(top_k, 4)
    common = dict(hidden_size=hidden, num_hidden_layers=layers, vocab_size=32000 if not tiny else 512,
                  max_position_embeddings=4096, num_experts_per_tok=top_k)
    if name == "mixtral":
        from transformers import MixtralConfig
        cfg = MixtralConfig(intermediate_size=inter, num_local_experts=experts, num_attention_heads=32 if not tiny else 4,
                            num_key_value_heads=8 if not tiny else 2, **common)
    elif name == "qwen3":
        from transformers import Qwen3MoeConfig
        cfg = Qwen3MoeConfig(moe_intermediate_size=inter, num_experts=experts, norm_topk_prob=True,
                             num_attention_heads=32 if not tiny else 4, num_key_value_heads=4 if not tiny else 2,
                             head_dim=128 if not tiny else 16, decoder_sparse_step=1, mlp_only_layers=[], **common)
    elif name == "gemma4":
        from transformers import Gemma4TextConfig
        common["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2)
        cfg = Gemma4TextConfig(enable_moe_block=True, num_experts=experts, top_k_experts=top_k,
                               moe_intermediate_size=inter, intermediate_size=2112 if not tiny else 48,
                               num_attention_heads=16 if not tiny else 4, num_key_value_heads=8 if not tiny else 2,
                               head_dim=256 if not tiny else 16, global_head_dim=512 if not tiny else 32,
                               sliding_window=1024 if not tiny else 16, hidden_size_per_layer_input=0,
                               **{k: v for k, v in common.items() if k != "num_experts_per_tok"})
    else:
        from transformers import DeepseekV3Config
        groups = 8 if not tiny else 4
        cfg = DeepseekV3Config(moe_intermediate_size=inter, n_routed_experts=experts, n_group=groups,
                               topk_group=groups // 2, routed_scaling_factor=2.5, norm_topk_prob=True,
                               n_shared_experts=1, first_k_dense_replace=0,
                               num_attention_heads=128 if not tiny else 4, num_key_value_heads=128 if not tiny else 4,
                               **({} if not tiny else dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                                           qk_nope_head_dim=8, v_head_dim=8)), **common)
    cfg._experts_implementation = "grouped_mm"
    return cfg


def build(name: str, layers: int, tiny: bool, device: str):
    from transformers import AutoModelForCausalLM

    cfg = make_config(name, layers, tiny)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(0)  # the same random model on every run, and in check_e2e_accuracy.py
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for module in model.modules():  # router bias buffers start at zero; make selection non-trivial
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, 0.05, generator=gen)
    return model.eval()


def timed(fn, reps: int, device: str) -> float:
    """Median milliseconds of ``fn()``."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_model(name: str, args) -> list[dict]:
    import moe_compile  # noqa: F401  (registers backend="moe_npu")
    from moe_compile.lowering import op_graphs

    model = build(name, args.layers, args.tiny, args.device)
    rows = []
    gen = torch.Generator(device=args.device).manual_seed(1)
    inputs = {size: torch.randint(0, model.config.vocab_size, SIZES[size], device=args.device, generator=gen)
              for size in args.sizes}
    eager_logits = {}
    for mode in args.modes:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        graphs = "reduce-overhead" if mode.endswith("-cg") else None  # CUDA graphs
        op_graphs.clear()
        op_graphs.configure(enabled=mode != "moe_npu-plain")
        if mode == "eager":
            fn = model
        elif mode.startswith("inductor"):
            fn = torch.compile(model, mode=graphs)
        else:
            fn = torch.compile(model, backend="moe_npu", mode=graphs)
        if graphs:  # CUDA-graph outputs are overwritten by the next replay: mark steps, copy out
            compiled = fn

            def fn(**kw):
                torch.compiler.cudagraph_mark_step_begin()
                out = compiled(**kw)
                out.logits = out.logits.clone()
                return out

        for size in args.sizes:
            ids = inputs[size]
            with torch.no_grad():
                sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
                sync()
                t0 = time.perf_counter()
                logits = fn(input_ids=ids, use_cache=False).logits
                sync()
                first_s = time.perf_counter() - t0
                fn(input_ids=ids, use_cache=False)  # a second warm-up call
                ms = timed(lambda: fn(input_ids=ids, use_cache=False), args.reps, args.device)
            row = {"model": name, "size": size, "tokens": ids.numel(), "mode": mode, "ms": ms,
                   "first_call_s": first_s}
            if mode == "eager":
                eager_logits[size] = logits.float()
            elif size in eager_logits:
                ref = eager_logits[size]
                row["rel_err_vs_eager"] = ((logits.float() - ref).norm() / ref.norm()).item()
            if mode.startswith("moe_npu"):
                row["moe_blocks_rewritten"] = int(torch._dynamo.utils.counters["moe_compile"]["rewritten"])
                row["op_graph_replays"] = op_graphs.STATS["replayed"]
            rows.append(row)
            print(format_row(row, rows), flush=True)
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


HEADER = (f"{'model':<12}{'size':<9}{'tokens':>7} {'mode':<12}{'ms':>10}{'vs eager':>9}{'first call s':>13}"
          f"{'rewritten':>10}{'err':>9}")


def format_row(row: dict, rows: list[dict]) -> str:
    eager = [r for r in rows if r["model"] == row["model"] and r["size"] == row["size"] and r["mode"] == "eager"]
    speed = f"{eager[0]['ms'] / row['ms']:.2f}x" if eager else "-"
    err = f"{row['rel_err_vs_eager']:.1e}" if "rel_err_vs_eager" in row else "-"
    return (f"{row['model']:<12}{row['size']:<9}{row['tokens']:>7} {row['mode']:<12}{row['ms']:>10.2f}{speed:>9}"
            f"{row['first_call_s']:>13.1f}{str(row.get('moe_blocks_rewritten', '-')):>10}{err:>9}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(ISSUE_MODELS), choices=list(DIMS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), choices=list(SIZES))
    parser.add_argument("--modes", nargs="+", default=["eager", "inductor", "moe_npu"],
                        choices=["eager", "inductor", "moe_npu", "inductor-cg", "moe_npu-cg", "moe_npu-plain"],
                        help="-cg: torch.compile(mode='reduce-overhead'), i.e. CUDA graphs; -plain: moe_npu "
                             "with the op's own CUDA graphs off (MOE_COMPILE_OP_GRAPHS=0)")
    parser.add_argument("--json-name", default="e2e.json")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny dimensions (smoke test)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_e2e needs a CUDA device (or --device cpu --tiny)", file=sys.stderr)
        return 2
    if args.tiny and "prefill" in args.sizes:
        SIZES["prefill"] = (1, 64)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    rows = []
    for name in args.models:
        rows += run_model(name, args)
        with open(out / args.json_name, "w") as f:
            json.dump({"argv": sys.argv, "torch": torch.__version__, "rows": rows}, f, indent=1)
    print("\n" + HEADER)
    for r in rows:
        print(format_row(r, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
