"""One zoo family over several input seeds: ``backend="moe_npu"`` (Inductor inside) and plain Inductor
against eager, and against each other. Tells a near-tie (either compiled model far from eager at a few
inputs, the other not) from a systematic error (ours far at every input).

    python benchmarks/compare_seeds.py --family glm5_next --dtype bfloat16 --tokens 9 --seeds 1 2 3

The first call uses ``--first-tokens`` tokens (default 1), so the later ones run the recompiled,
dynamic-shape graphs, as ``check_zoo.py --tokens 1 9`` does.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

import moe_compile  # noqa: E402,F401  (registers the backend)
from moe_compile.testing import zoo  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-6)).item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(zoo.MOE_FAMILIES))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--tokens", type=int, default=9)
    parser.add_argument("--first-tokens", type=int, default=1)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 11)))
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.first_tokens < 1:
        parser.error(f"--tokens and --first-tokens must be >= 1, got {args.tokens} and {args.first_tokens}")
    model, _ = zoo.build_model(args.family, dtype=getattr(torch, args.dtype))
    ours = torch.compile(model, backend="moe_npu", options={"inner_compiler": "inductor"})
    plain = torch.compile(model)
    print(f"{'seed':>4} {'tokens':>6} {'ours vs eager':>14} {'plain vs eager':>15} {'ours vs plain':>14}")
    with torch.no_grad():
        for i, seed in enumerate(args.seeds):
            tokens = args.first_tokens if i == 0 else args.tokens
            kwargs = zoo.build_inputs(args.family, num_tokens=tokens, seed=seed)
            ref = zoo.first_tensor(model(**kwargs))
            a, b = zoo.first_tensor(ours(**kwargs)), zoo.first_tensor(plain(**kwargs))
            print(f"{seed:>4} {tokens:>6} {_rel(a, ref):>14.2e} {_rel(b, ref):>15.2e} {_rel(a, b):>14.2e}", flush=True)
    print("moe_compile counters:", dict(torch._dynamo.utils.counters["moe_compile"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
