"""Every zoo family compiled with ``backend="moe_npu"`` under one setting, against eager.

    python benchmarks/check_zoo.py [--dynamic] [--dtype bfloat16] [--inner inductor] [--tokens 5 11]
                                   [--against-inductor] [--families deepseek_v3 ...]

For each family the zoo can build (tiny config, random weights, the transformers default experts
implementation): compile once, run each token count, and print the ``moe_compile`` counters and the
largest output difference relative to eager (with ``--against-inductor`` also to plain Inductor
compiled the same way: in bf16 a router near-tie can flip under either rounding). A family that
the static tests expect rewritten but that is not, or that fails the pass, is flagged, and the exit
code is 1. The eighteenth session ran ``--dynamic`` (the shipped default: aot_eager, fp32): every
family rewritten, within 1e-4 of eager.
"""
from __future__ import annotations

import argparse
import sys
import warnings

import torch

import moe_compile  # noqa: F401  (registers the backend)
from moe_compile.testing import zoo
from moe_compile.testing.zoo_spec import Capture


def expected_rewritten(name: str) -> bool:
    spec = zoo.get_family(name)
    return spec.expressible and spec.capture_of(spec.default_impl) in (Capture.ONE_GRAPH, Capture.NEEDS_FLAGS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / (b.abs().max() + 1e-6)).item()


def check(name: str, args) -> tuple[dict, float, float | None, bool]:
    """(counters, worst difference to eager, worst to plain Inductor or None, flagged)."""
    model, _ = zoo.build_model(name, dtype=getattr(torch, args.dtype))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    dynamic = True if args.dynamic else None
    ours = torch.compile(model, backend="moe_npu", dynamic=dynamic, options={"inner_compiler": args.inner})
    plain = torch.compile(model, backend="inductor", dynamic=dynamic) if args.against_inductor else None
    to_eager, to_plain = 0.0, None
    with torch.no_grad():
        for tokens in args.tokens:
            kwargs = zoo.build_inputs(name, num_tokens=tokens, seed=tokens)
            out = zoo.first_tensor(ours(**kwargs))
            to_eager = max(to_eager, _rel(out, zoo.first_tensor(model(**kwargs))))
            if plain is not None:
                to_plain = max(to_plain or 0.0, _rel(out, zoo.first_tensor(plain(**kwargs))))
    counters = dict(torch._dynamo.utils.counters["moe_compile"])
    missing = expected_rewritten(name) and counters.get("rewritten", 0) < zoo.expected_moe_layers(name)
    return counters, to_eager, to_plain, missing or bool(counters.get("pass_failed"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dynamic", action="store_true", help="torch.compile(..., dynamic=True)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--inner", choices=["aot_eager", "inductor"], default="aot_eager")
    parser.add_argument("--tokens", type=int, nargs="+", default=[5, 11])
    parser.add_argument("--against-inductor", action="store_true")
    parser.add_argument("--families", nargs="+", default=None, help="default: every family the zoo can build")
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        parser.error(f"--tokens must be positive, got {args.tokens}")
    names = args.families or list(zoo.MOE_FAMILIES)
    unknown = [n for n in names if n not in zoo.MOE_FAMILIES]
    if unknown:
        parser.error(f"--families: unknown {unknown}; known: {sorted(zoo.MOE_FAMILIES)}")
    warnings.filterwarnings("ignore")
    flagged = []
    for name in names:
        available, why = zoo.is_available(name, None)
        if not available:
            print(f"{name:<20} not available here: {why}")
            continue
        counters, to_eager, to_plain, bad = check(name, args)
        plain = "" if to_plain is None else f"  vs plain inductor {to_plain:.1e}"
        print(f"{name:<20} {counters}  vs eager {to_eager:.1e}{plain}{'  <-- not rewritten' if bad else ''}",
              flush=True)
        if bad:
            flagged.append(name)
    print(f"{len(flagged)} flagged: {flagged}" if flagged else "none flagged")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
