"""How far each mode's logits are from an fp32 reference, and where the routing is a near tie.

    python benchmarks/check_e2e_accuracy.py [--models mixtral qwen3] [--size decode] [--out DIR]

``bench_e2e.py`` compares every mode with bf16 eager; a random bf16 model's error against bf16
eager mixes the rewrite's own error with bf16 noise that a routing near-tie turns into a different
expert. This script separates them, for the same model and input as ``bench_e2e.py``:

- the fp32 model (the same weights, upcast) run eagerly is the reference;
- each mode (bf16 eager, ``inductor``, ``moe_npu``, and with ``-cg`` the CUDA-graph variants)
  gives its logits' relative error against that reference and against bf16 eager;
- ``moe_npu-cg`` against ``moe_npu`` (the same compiled code with and without graph replay);
- in bf16 eager, each MoE layer's router scores: how many tokens have their k-th and (k+1)-th
  expert within 1 % of the score range (a near tie that bf16 rounding can flip), and whether the
  selected experts equal the fp32 model's.

Writes ``e2e_accuracy.json`` under ``--out``. ``--tiny --device cpu`` is a smoke run.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_e2e import DIMS, SIZES, build  # noqa: E402

NEAR_TIE = 0.01  # of the token's score range (max - min over experts)


def _num_experts(config) -> int:
    return next(getattr(config, a) for a in ("num_local_experts", "num_experts", "n_routed_experts")
                if getattr(config, a, None))


def _router_hooks(model, store: list):
    """Forward hooks on each MoE block's router that record its scores ``[tokens, experts]``."""
    handles = []
    num_experts = _num_experts(model.config)
    for name, module in model.named_modules():
        if name.endswith("mlp.gate") or name.endswith("block_sparse_moe.gate"):
            def hook(_mod, _inp, out, name=name):
                t = out[0] if isinstance(out, tuple) else out
                if isinstance(t, torch.Tensor) and t.shape[-1] == num_experts:
                    store.append((name, t.detach().float().reshape(-1, num_experts)))
            handles.append(module.register_forward_hook(hook))
    return handles


def routing_report(scores_bf16: list, scores_fp32: list, top_k: int) -> list[dict]:
    rows = []
    for (name, s16), (_, s32) in zip(scores_bf16, scores_fp32):
        top = s16.topk(top_k + 1, dim=-1).values
        span = (s16.max(-1).values - s16.min(-1).values).clamp_min(1e-30)
        near = ((top[:, top_k - 1] - top[:, top_k]) / span < NEAR_TIE).sum().item()
        ids16 = s16.topk(top_k, dim=-1).indices.sort(-1).values
        ids32 = s32.topk(top_k, dim=-1).indices.sort(-1).values
        differ = (ids16 != ids32).any(-1).sum().item()
        rows.append({"router": name, "tokens": s16.shape[0], "near_ties": near,
                     "tokens_whose_experts_differ_bf16_vs_fp32": differ})
    return rows


def run(name: str, args) -> dict:
    import moe_compile  # noqa: F401  (registers backend="moe_npu")

    model = build(name, args.layers, args.tiny, args.device)
    top_k = model.config.num_experts_per_tok
    gen = torch.Generator(device=args.device).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, SIZES[args.size], device=args.device, generator=gen)
    with torch.no_grad():
        s16, s32 = [], []
        handles = _router_hooks(model, s16)
        eager = model(input_ids=ids, use_cache=False).logits.float()
        for h in handles:
            h.remove()
        ref_model = copy.deepcopy(model).float()
        handles = _router_hooks(ref_model, s32)
        ref = ref_model(input_ids=ids, use_cache=False).logits.float()
        for h in handles:
            h.remove()
        del ref_model
        if args.device == "cuda":
            torch.cuda.empty_cache()

    def rel(x, y):
        return ((x - y).norm() / y.norm()).item()

    result = {"model": name, "size": args.size, "tokens": ids.numel(),
              "routing": routing_report(s16, s32, top_k),
              "modes": [{"mode": "eager", "rel_err_vs_fp32": rel(eager, ref)}]}
    logits = {"eager": eager}
    for mode in args.modes:
        torch._dynamo.reset()
        graphs = "reduce-overhead" if mode.endswith("-cg") else None
        fn = torch.compile(model, backend="moe_npu" if mode.startswith("moe_npu") else "inductor", mode=graphs)
        with torch.no_grad():
            for _ in range(3):  # the compile, then warm-up calls (graph recording under -cg)
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                out = fn(input_ids=ids, use_cache=False).logits.float().clone()
        logits[mode] = out
        row = {"mode": mode, "rel_err_vs_fp32": rel(out, ref), "rel_err_vs_bf16_eager": rel(out, eager)}
        if mode == "moe_npu-cg" and "moe_npu" in logits:
            row["rel_err_vs_moe_npu"] = rel(out, logits["moe_npu"])
        result["modes"].append(row)
    for row in result["modes"]:
        print(f"{name} {args.size} {row}", flush=True)
    for row in result["routing"]:
        print(f"{name} {args.size} {row}", flush=True)
    del model
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mixtral", "qwen3"], choices=list(DIMS))
    parser.add_argument("--size", default="decode", choices=list(SIZES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["inductor", "moe_npu", "inductor-cg", "moe_npu-cg"],
                        choices=["inductor", "moe_npu", "inductor-cg", "moe_npu-cg"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny dimensions (smoke test)")
    parser.add_argument("--out", default=None, help="directory for e2e_accuracy.json")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_e2e_accuracy needs a CUDA device (or --device cpu --tiny)", file=sys.stderr)
        return 2
    results = [run(name, args) for name in args.models]
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "e2e_accuracy.json", "w") as f:
            json.dump({"argv": sys.argv, "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
