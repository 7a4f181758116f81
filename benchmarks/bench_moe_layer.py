"""One MoE layer on the GPU: ours (CUDA-graph timing) vs the HF block under inductor vs the bound.

    python benchmarks/bench_moe_layer.py [--shapes mixtral qwen3 deepseek_v3] [--ms 1 32 256 2048 8192]
        [--no-hf] [--out benchmarks/results]

For each shape an HF block is built from a config with the model's dimensions (bf16, random
weights, ``experts_implementation="grouped_mm"``). *Ours* is the same layer through our op: the
router GEMM as the backend runs it on CUDA (``moe_compile::router_logits``) + ``moe_compile.fused_moe``
on transposed views of the block's own weights (no copies), captured in a CUDA graph and replayed.
DeepSeek-V3's router is fp32 over the bf16 input (``F.linear(x.float(), w.float())`` in HF): the op
gives the same fp32 result without an fp32 copy of the input. Mixtral's and Qwen3's are bf16: the
op's GEMV kernel up to 16 tokens, cuBLAS's ``F.linear`` above. *HF* is the block under
``torch.compile`` (inductor, dynamic shapes, no graphs), timed with CUDA events. DeepSeek-V3's
block also runs a shared-expert MLP; both sides time the routed part only (gate + experts).

Every timed call takes one of ``ROTATE`` different inputs in turn, so the experts it hits change
from call to call and the weights are read from HBM, not from L2. The bound is
``max(bytes of the experts hit / 4.8 TB/s, 6 * M * k * H * I / 790 TFLOP/s)``, averaged over the
rotated inputs. Prints a table, writes ``moe_layer.json`` and ``moe_layer.png`` under ``--out``.

Where FLOPs set the bound, a *dense* column times cuBLAS doing the experts' two GEMMs as plain
dense GEMMs of the same sizes (``[M*k, H] @ [H, 2I]`` and ``[M*k, I] @ [I, H]``, nothing else):
what the bound's 790 TFLOP/s looks like in practice for these shapes, measured in the same run.

``MHz``: the mean SM clock while ours was timed (``nvidia-smi`` every 50 ms; the JSON also has the
power and the clock-limit reasons, for the dense column too). At the compute-bound points the H200
reaches its 700 W limit and clocks down (``probe_power.py``), so these columns drift with how long
the GPU has been under load.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_clock import ClockSampler  # noqa: E402

from moe_compile.tools.cuda_timing import ROTATE, capture_graph, graph_time_us  # noqa: E402,F401
from moe_compile.tools.cuda_timing import event_time_us as _event_time  # noqa: E402
from moe_compile.tools.tune import MS, Shape, routing_config  # noqa: E402,F401

HBM_BYTES_PER_S = 4.8e12
BF16_FLOP_PER_S = 790e12

# ratio to the bound at M = 1 / 32 / 256 / 2048 / 8192 (issue 5, H200, CUDA graphs / inductor)
VLLM_TRITON = {"mixtral": [1.29, 1.26, 1.48, 1.81, 1.63], "qwen3": [2.36, 1.57, 1.62, 2.58, 2.32],
               "deepseek_v3": [1.35, 1.09, 1.17, 1.48, 2.39]}
HF_ISSUE = {"mixtral": [4.02, 1.86, 1.76, 1.59, 1.28], "qwen3": [20.5, 2.15, 2.78, 3.29, 2.46],
            "deepseek_v3": [7.06, 1.56, 1.56, 1.70, 2.28]}


SHAPES = {
    "mixtral": Shape("mixtral", 8, 2, 4096, 14336, dict(routing_method="softmax", renormalize=True)),
    "qwen3": Shape("qwen3", 128, 8, 2048, 768, dict(routing_method="softmax", renormalize=True)),
    "deepseek_v3": Shape("deepseek_v3", 256, 8, 7168, 2048, dict(
        routing_method="sigmoid", renormalize=True, routed_scaling_factor=2.5, k_group=4, group_count=8,
        group_select_mode=1)),
}
# beyond the issue's three (not run by default): DeepSeek-V4's routed experts, sqrt(softplus) routing and the
# clamped SwiGLU (transformers' DeepseekV4Config defaults: E = 256, top-6, H = 4096, I = 2048, limit 10)
EXTRA_SHAPES = {
    "deepseek_v4": Shape("deepseek_v4", 256, 6, 4096, 2048, dict(
        routing_method="sqrtsoftplus", renormalize=False, routed_scaling_factor=1.5, activation="silu_clamped",
        swiglu_limit=10.0)),
}
ALL_SHAPES = {**SHAPES, **EXTRA_SHAPES}


def build_hf_block(shape: Shape):
    """The HF MoE block with this shape's dimensions, bf16 on CUDA, random weights."""
    if shape.name == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        cfg = MixtralConfig(hidden_size=shape.hidden, intermediate_size=shape.inter,
                            num_local_experts=shape.num_experts, num_experts_per_tok=shape.top_k)
    elif shape.name == "qwen3":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        cfg = Qwen3MoeConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.inter,
                             num_experts=shape.num_experts, num_experts_per_tok=shape.top_k, norm_topk_prob=True)
    elif shape.name == "deepseek_v4":
        from transformers import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

        cfg = DeepseekV4Config(hidden_size=shape.hidden, moe_intermediate_size=shape.inter,
                               n_routed_experts=shape.num_experts, num_experts_per_tok=shape.top_k,
                               routed_scaling_factor=shape.routing["routed_scaling_factor"],
                               swiglu_limit=shape.routing["swiglu_limit"], mlp_layer_types=["moe"], num_hidden_layers=1)
        Block = lambda c: DeepseekV4SparseMoeBlock(c, layer_idx=0)  # noqa: E731
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
        cfg = DeepseekV3Config(hidden_size=shape.hidden, moe_intermediate_size=shape.inter,
                               n_routed_experts=shape.num_experts, num_experts_per_tok=shape.top_k, n_group=8,
                               topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1)
    cfg._experts_implementation = "grouped_mm"
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build the weights in bf16 directly (no fp32 copy)
    try:
        with torch.device("cuda"):
            block = Block(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            fan_in = p.shape[-1]
            p.normal_(0.0, fan_in ** -0.5, generator=gen)
        router = block.gate
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0.0, 0.05, generator=gen)
        if shape.name == "deepseek_v3":
            router.float()  # HF keeps the DeepSeek router in fp32
    return block.eval()


def expert_views(block, shape: Shape):
    """Our op's w13 [E, H, 2I] / w2 [E, I, H]: transposed views of HF's [E, 2I, H] / [E, H, I]."""
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    w13 = gate_up.transpose(1, 2) if gate_up.shape[1] == 2 * shape.inter else gate_up
    w2 = down.transpose(1, 2) if down.shape[1] == shape.hidden else down
    assert w13.shape == (shape.num_experts, shape.hidden, 2 * shape.inter), w13.shape
    assert w2.shape == (shape.num_experts, shape.inter, shape.hidden), w2.shape
    return w13, w2


def hf_routed(block, shape: Shape):
    """The block's forward minus DeepSeek's shared experts (gate + experts), flattened tokens."""
    if shape.name not in ("deepseek_v3", "deepseek_v4"):
        return lambda x: block(x.unsqueeze(0)).squeeze(0)

    def routed(x):
        _, weights, ids = block.gate(x)
        return block.experts(x, ids, weights)
    return routed


def our_layer(block, shape: Shape, router: str = "ours"):
    """``router``: ``ours`` runs the router GEMM as the backend does on CUDA, through
    ``moe_compile::router_logits`` (DeepSeek-V3's fp32 router over the bf16 input: fp32 logits;
    the bf16 routers: bf16 logits); ``cublas``: ``F.linear`` as HF writes it."""
    import moe_compile.ops.custom_op  # noqa: F401  (registers torch.ops.moe_compile.*)
    from moe_compile.ops.fused_moe import fused_moe

    router_logits = torch.ops.moe_compile.router_logits

    w13, w2 = expert_views(block, shape)
    gate = block.gate
    bias = getattr(gate, "e_score_correction_bias", None)
    gate_w = gate.weight
    fp32_router = gate_w.dtype == torch.float32

    def layer(x):
        if router == "ours":
            logits = router_logits(x, gate_w, None, torch.float32 if fp32_router else x.dtype)
        else:
            logits = F.linear(x.float(), gate_w) if fp32_router else F.linear(x, gate_w)
        return fused_moe(x, logits, shape.num_experts, shape.top_k, w13, w2, e_score_correction_bias=bias,
                         **shape.routing)
    return layer


def point(text: str) -> tuple[str, int]:
    """The ``shape:M`` points of the GEMM benchmarks (an argparse ``type``): ``("qwen3", 2048)``."""
    name, _, m = text.partition(":")
    if name not in ALL_SHAPES or not m.isdigit() or int(m) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not shape:M with shape one of {sorted(ALL_SHAPES)} and M >= 1")
    return name, int(m)


def cuda_or_say(script: str) -> bool:
    """Whether a CUDA device is here; without one, says that ``script`` needs it (on stderr), so the
    script can return 2 instead of failing in its first kernel; with one, prints the device and torch."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA device", file=sys.stderr)
        return False
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    return True


def write_json(out_dir: str | Path | None, name: str, result) -> None:
    """``result`` as ``out_dir/name`` (indented JSON); nothing without an ``out_dir``."""
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / name).write_text(json.dumps(result, indent=1))


def loop_time_us(fn, inputs, reps: int) -> float:
    def run():
        for x in inputs:
            fn(x)
    run()
    return _event_time(run, reps) / len(inputs)


def bound_us(block, shape: Shape, inputs) -> tuple[float, float]:
    """(bound in us, experts hit on average) over the rotated inputs."""
    from moe_compile.ops.routing import select_experts

    cfg = routing_config(shape)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    per_expert = 3 * shape.hidden * shape.inter * 2
    bounds, hits = [], []
    for x in inputs:
        logits = F.linear(x.float(), block.gate.weight.float())
        _, ids = select_experts(logits, cfg, bias)
        hit = torch.unique(ids).numel()
        flops = 6 * ids.numel() * shape.hidden * shape.inter
        bounds.append(max(hit * per_expert / HBM_BYTES_PER_S, flops / BF16_FLOP_PER_S) * 1e6)
        hits.append(hit)
    return statistics.mean(bounds), statistics.mean(hits)


def dense_gemms(block, shape: Shape, m: int, gen: torch.Generator):
    """cuBLAS doing the experts' two GEMMs as dense GEMMs of the same sizes: ``[M*k, H] @ [H, 2I]``
    and ``[M*k, I] @ [I, H]`` on one expert's weights, inputs made beforehand (nothing else is
    timed). What the bound's 790 TFLOP/s looks like in practice for these GEMM shapes, measured in
    the same run; only where FLOPs, not weight bytes, set the bound."""
    w13, w2 = expert_views(block, shape)
    w13_0, w2_0 = w13[0], w2[0]
    rows = m * shape.top_k
    a1 = torch.randn(rows, shape.hidden, device="cuda", generator=gen).bfloat16()
    a2 = torch.randn(rows, shape.inter, device="cuda", generator=gen).bfloat16()

    def gemms(_x):
        return a1 @ w13_0, a2 @ w2_0
    return gemms


def compute_bound(shape: Shape, m: int) -> bool:
    flops = 6 * m * shape.top_k * shape.hidden * shape.inter
    weight_bytes = shape.num_experts * 3 * shape.hidden * shape.inter * 2
    return flops / BF16_FLOP_PER_S > weight_bytes / HBM_BYTES_PER_S


def _timed(row: dict, key: str, clock, fn, *args) -> None:
    """``row[key] = fn(*args)``, and ``row[key + "_clock"]`` the SM clock / power it ran at (``clock``
    a ``gpu_clock.ClockSampler``; nothing when it has no samples)."""
    t0 = time.time()
    row[key] = fn(*args)
    stats = clock.window(t0, time.time()) if clock is not None else None
    if stats is not None:
        row[key + "_clock"] = {k: stats[k] for k in ("mhz", "watts", "reasons", "samples")}


def run_shape(shape: Shape, ms, with_hf: bool, reps: int, dense: bool = True, clock=None) -> list[dict]:
    block = build_hf_block(shape)
    ours = our_layer(block, shape)
    hf = torch.compile(hf_routed(block, shape), dynamic=True) if with_hf else None
    rows = []
    for m in ms:
        gen = torch.Generator(device="cuda").manual_seed(m)
        inputs = [torch.randn(m, shape.hidden, device="cuda", generator=gen).bfloat16() for _ in range(ROTATE)]
        with torch.no_grad():
            row = {"shape": shape.name, "M": m}
            row["bound_us"], row["experts_hit"] = bound_us(block, shape, inputs)
            out = ours(inputs[0])
            _timed(row, "ours_us", clock, graph_time_us, ours, inputs, reps)
            if dense and compute_bound(shape, m):
                _timed(row, "dense_us", clock, graph_time_us, dense_gemms(block, shape, m, gen), inputs, reps)
            if hf is not None:
                t0 = time.perf_counter()
                ref = hf(inputs[0])
                row["hf_first_call_s"] = time.perf_counter() - t0
                row["hf_us"] = loop_time_us(hf, inputs, reps)
                row["rel_err_vs_hf"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        idx = MS.index(m) if m in MS else None
        row["ours_ratio"] = row["ours_us"] / row["bound_us"]
        if "dense_us" in row:
            row["dense_ratio"] = row["dense_us"] / row["bound_us"]
        if "hf_us" in row:
            row["hf_ratio"] = row["hf_us"] / row["bound_us"]
        if idx is not None and shape.name in VLLM_TRITON:
            row["vllm_ratio_issue"] = VLLM_TRITON[shape.name][idx]
            row["hf_ratio_issue"] = HF_ISSUE[shape.name][idx]
        row["target"] = 1.25 if m <= 256 else 1.35
        rows.append(row)
        print(format_row(row), flush=True)
    del block, ours, hf
    torch.cuda.empty_cache()
    return rows


HEADER = (f"{'shape':<12}{'M':>6}{'hit':>6}{'bound us':>10}{'ours us':>10}{'ours/bd':>9}{'hf us':>10}"
          f"{'hf/bd':>8}{'vllm/bd':>9}{'dense/bd':>9}{'target':>8}{'err':>9}{'MHz':>6}")


def format_row(r: dict) -> str:
    def f(key, fmt):
        return format(r[key], fmt) if key in r else "-"
    return (f"{r['shape']:<12}{r['M']:>6}{r['experts_hit']:>6.1f}{r['bound_us']:>10.1f}{r['ours_us']:>10.1f}"
            f"{r['ours_ratio']:>9.2f}{f('hf_us', '.1f'):>10}{f('hf_ratio', '.2f'):>8}"
            f"{f('vllm_ratio_issue', '.2f'):>9}{f('dense_ratio', '.2f'):>9}{r['target']:>8.2f}"
            f"{f('rel_err_vs_hf', '.1e'):>9}{format(r['ours_us_clock']['mhz'], '.0f') if 'ours_us_clock' in r else '-':>6}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["shape"] for r in rows}, key=list(ALL_SHAPES).index)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        rs = [r for r in rows if r["shape"] == name]
        ms = [r["M"] for r in rs]
        ax.plot(ms, [r["ours_ratio"] for r in rs], "o-", label="ours (CUDA graph)")
        if all("hf_ratio" in r for r in rs):
            ax.plot(ms, [r["hf_ratio"] for r in rs], "s-", label="HF grouped_mm + inductor")
        if all("vllm_ratio_issue" in r for r in rs):
            ax.plot(ms, [r["vllm_ratio_issue"] for r in rs], "^--", label="vLLM Triton (issue 5)")
        dense = [(r["M"], r["dense_ratio"]) for r in rs if "dense_ratio" in r]
        if dense:
            ax.plot(*zip(*dense), "x", color="grey", label="cuBLAS dense GEMMs, same sizes")
        ax.plot(ms, [r["target"] for r in rs], "k:", label="target")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("tokens M")
        ax.set_ylabel("time / bound")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(ALL_SHAPES),
                        help="default: the issue's three; deepseek_v4 (sqrt-softplus routing, clamped SwiGLU) "
                             "on request")
    parser.add_argument("--name", default="moe_layer", help="stem of the JSON and PNG files written under --out")
    parser.add_argument("--ms", nargs="+", type=int, default=list(MS))
    parser.add_argument("--no-hf", action="store_true", help="skip the HF/inductor column")
    parser.add_argument("--no-dense", action="store_true", help="skip the cuBLAS dense-GEMM column")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--align-method", default=None, choices=["sort", "blocks", "two_launch"],
                        help="group the pairs by expert with this method at every point (kernels/triton/align.py)")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch our kernels without programmatic dependent launch (kernels/triton/pdl.py)")
    args = parser.parse_args(argv)
    from moe_compile.kernels.triton import align, pdl
    if args.no_pdl:
        pdl.FORCE = False
    align.FORCE = args.align_method
    if not cuda_or_say("bench_moe_layer"):
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rotate": ROTATE,
            "hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flop_per_s": BF16_FLOP_PER_S, "argv": sys.argv,
            "pdl": pdl.pdl_enabled(torch.device("cuda")), "align_method": args.align_method or "default"}
    rows = []
    with ClockSampler(torch.cuda.current_device()) as clock:
        if not clock.available:
            print("no MHz column: nvidia-smi is not on PATH, so the SM clock is not sampled", flush=True)
        for name in args.shapes:
            rows += run_shape(ALL_SHAPES[name], args.ms, not args.no_hf, args.reps, not args.no_dense, clock)
            with open(out / f"{args.name}.json", "w") as f:  # after each shape, so a cut-short run keeps its rows
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("\n" + HEADER)
    for r in rows:
        print(format_row(r))
    try:
        plot(rows, out / f"{args.name}.png")
    except ImportError as exc:
        print("no plot:", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
