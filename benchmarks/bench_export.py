"""``torch.export`` deployment: the exported program as it is vs rewritten by ``moe_compile.rewrite_exported``,
each run through ``.module()`` and compiled by AOTInductor, against the model eager.

    python benchmarks/bench_export.py [--model qwen3] [--hidden 512] [--inter 256] [--experts 32] [--top-k 4]
        [--layers 2] [--sizes decode prefill] [--device cpu] [--dtype float32] [--reps 20] [--out DIR]

The model is an HF ``*ForCausalLM`` (random weights) with the given MoE dimensions and the default
(``grouped_mm``) experts implementation. Sizes: ``decode`` is 8 sequences of one token, ``prefill`` one sequence
of 256. Each export has a symbolic sequence length, so one program serves both sizes. For each mode: the time to
build it (export, rewrite, AOTInductor compile), the median forward time (``bench_cpu_layer.interleaved_ms``: each
rep calls every mode in turn, on fresh inputs) and the logits' largest difference from eager, relative to their
largest magnitude. Prints a table; writes ``export.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

from benchmarks.bench_cpu_layer import interleaved_ms  # noqa: E402

SIZES = {"decode": (8, 1), "prefill": (1, 256)}
MODES = ("eager", "export", "export+moe", "aoti", "aoti+moe")


def make_model(args):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, vocab_size=1024, num_attention_heads=8,
                  num_key_value_heads=2, num_experts_per_tok=args.top_k, max_position_embeddings=1024, use_cache=False)
    if args.model == "mixtral":
        cfg = MixtralConfig(intermediate_size=args.inter, num_local_experts=args.experts, **common)
    else:
        cfg = Qwen3MoeConfig(moe_intermediate_size=args.inter, num_experts=args.experts, norm_topk_prob=True,
                             head_dim=args.hidden // 8, decoder_sparse_step=1, mlp_only_layers=[], **common)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, args.dtype))
    return model.eval()


def build(mode: str, model, example: dict, workdir: Path):
    """(callable, seconds to build it, blocks rewritten)."""
    import moe_compile

    if mode == "eager":
        return model, 0.0, 0
    start = time.perf_counter()
    seq = torch.export.Dim("seq", min=1, max=512)
    batch = torch.export.Dim("batch", min=1, max=64)
    with torch.no_grad():
        try:
            ep = torch.export.export(model, (), example, dynamic_shapes={"input_ids": {0: batch, 1: seq}})
        except torch._dynamo.exc.UserError as e:
            if "Constraints violated" not in str(e):
                raise
            # torch 2.11 cannot prove a guard of the HF model's own code over the ranged dims (the plain model,
            # before our pass): let export choose the dims' ranges itself
            print(f"{mode}: ranged dims refused ({' '.join(str(e).split())[:300]}); exporting with Dim.AUTO")
            auto = torch.export.Dim.AUTO
            ep = torch.export.export(model, (), example, dynamic_shapes={"input_ids": {0: auto, 1: auto}})
    rewritten = 0
    if mode.endswith("+moe"):
        ep, report = moe_compile.rewrite_exported(ep)
        rewritten = len(report.rewritten)
    if mode.startswith("aoti"):
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(workdir / (mode + ".pt2")))
        fn = torch._inductor.aoti_load_package(path)
    else:
        fn = ep.module()
    return fn, time.perf_counter() - start, rewritten


def _caller(fn, device: str):
    def call(ids):
        fn(input_ids=ids)
        if device == "cuda":
            torch.cuda.synchronize()
    return call


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out[0]


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The options ``make_model`` reads (the MoE dimensions; ``--device`` and ``--dtype`` are each script's)."""
    parser.add_argument("--model", choices=["qwen3", "mixtral"], default="qwen3")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inter", type=int, default=256)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["decode", "prefill"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    model = make_model(args)
    gen = torch.Generator(device=args.device).manual_seed(1)
    inputs = {s: torch.randint(0, 1024, SIZES[s], device=args.device, generator=gen) for s in args.sizes}
    with torch.no_grad():
        eager = {s: logits_of(model(input_ids=ids)).float() for s, ids in inputs.items()}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        example = {"input_ids": torch.randint(0, 1024, (2, 16), device=args.device, generator=gen)}
        built = {mode: build(mode, model, example, Path(tmp)) for mode in args.modes}
        for size, ids in inputs.items():
            fresh = [torch.randint(0, 1024, SIZES[size], device=args.device, generator=gen) for _ in range(8)]
            with torch.no_grad():
                outs = {mode: logits_of(fn(input_ids=ids)).float() for mode, (fn, _, _) in built.items()}
                ms = interleaved_ms({mode: _caller(fn, args.device) for mode, (fn, _, _) in built.items()}, fresh,
                                    args.reps)
            for mode, (fn, build_s, rewritten) in built.items():
                diff = ((outs[mode] - eager[size]).abs().max() / eager[size].abs().max()).item()
                rows.append(dict(mode=mode, size=size, ms=ms[mode], build_s=build_s, rewritten=rewritten,
                                 rel_diff=diff))
    base = {r["size"]: r["ms"] for r in rows if r["mode"] == "eager"}
    print("%-11s %-8s %10s %8s %9s %9s %9s" % ("mode", "size", "ms", "x eager", "build s", "rewritten", "rel diff"))
    for r in rows:
        ratio = base[r["size"]] / r["ms"] if r["size"] in base else float("nan")
        print("%-11s %-8s %10.3f %8.2f %9.1f %9d %9.1e" % (r["mode"], r["size"], r["ms"], ratio, r["build_s"],
                                                          r["rewritten"], r["rel_diff"]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = dict(vars(args), torch=torch.__version__)
        (Path(args.out) / "export.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
