"""Every zoo family compiled with ``backend="moe_npu"`` under one setting, against eager.

    python benchmarks/check_zoo.py [--dynamic] [--dtype bfloat16] [--inner inductor] [--tokens 5 11]
                                   [--against-inductor] [--families deepseek_v3 ...] [--device cuda]
                                   [--mode reduce-overhead] [--tol 1e-4] [--export] [--training]

For each family the zoo can build (tiny config, random weights, the transformers default experts
implementation): compile once, run each token count, and print the ``moe_compile`` counters and the
largest output difference relative to eager (with ``--against-inductor`` also to plain Inductor
compiled the same way: in bf16 a router near-tie can flip under either rounding). A family that
the static tests expect rewritten but that is not, that fails the pass or raises, or (with ``--tol``)
whose output is further than ``tol`` (relative to the output's magnitude) from eager and from plain
Inductor, is flagged, and the exit code is 1. The eighteenth session ran ``--dynamic`` (the shipped default: aot_eager, fp32): every
family rewritten, within 1e-4 of eager. ``--device cuda`` runs the models and the fused op's CUDA
(Triton) lowering on the GPU; ``--mode`` is passed to both compiles (``reduce-overhead``: CUDA graphs).
``--export`` checks ``moe_compile.rewrite_exported`` instead: each model through ``torch.export`` (the sequence
length symbolic where the model lets it be, else exported again per token count), the program rewritten and run at
each token count; a model ``torch.export`` cannot export is listed apart, not flagged. ``--training`` runs a forward
and backward recording autograd (the model in eval mode, so dropout and router jitter stay off) and also compares
every parameter's gradient with eager's (``grads``: the worst, relative to each gradient's largest entry, or to
1e-3 of the largest gradient entry of all where that is more); a family whose training graphs the backend leaves
alone with a reason (printed) is not flagged for it.
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
    return spec.rewritten and spec.capture_of(spec.default_impl) in (Capture.ONE_GRAPH, Capture.NEEDS_FLAGS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / (b.abs().max() + 1e-6)).item()


def check(name: str, args) -> tuple[dict, float, float | None, bool]:
    """(counters, worst difference to eager, worst to plain Inductor or None, flagged)."""
    model, _ = zoo.build_model(name, dtype=getattr(torch, args.dtype))
    model = model.to(args.device)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    dynamic = True if args.dynamic else None
    options = {"inner_compiler": args.inner, **({"mode": args.mode} if args.mode else {})}
    ours = torch.compile(model, backend="moe_npu", dynamic=dynamic, options=options)
    plain = (torch.compile(model, backend="inductor", dynamic=dynamic, mode=args.mode)
             if args.against_inductor else None)
    to_eager, to_plain = 0.0, None
    with torch.no_grad():
        for tokens in args.tokens:
            kwargs = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v
                      for k, v in zoo.build_inputs(name, num_tokens=tokens, seed=tokens).items()}
            for _ in range(1 if args.mode is None else 3):  # with CUDA graphs: warm-up, record, replay
                out = zoo.first_tensor(ours(**kwargs)).clone()
            to_eager = max(to_eager, _rel(out, zoo.first_tensor(model(**kwargs))))
            if plain is not None:
                for _ in range(1 if args.mode is None else 3):
                    other = zoo.first_tensor(plain(**kwargs)).clone()
                to_plain = max(to_plain or 0.0, _rel(out, other))
    counters = dict(torch._dynamo.utils.counters["moe_compile"])
    missing = expected_rewritten(name) and counters.get("rewritten", 0) < zoo.expected_moe_layers(name)
    far = args.tol is not None and min(to_eager, to_plain if to_plain is not None else to_eager) > args.tol
    return counters, to_eager, to_plain, missing or far or bool(counters.get("pass_failed"))


class ExportFailed(Exception):
    """torch.export itself could not export the model (not the pass)."""


def check_export(name: str, args) -> tuple[dict, float, None, bool]:
    """``--export``: the model through ``torch.export`` (``Dim.AUTO`` on the sequence length: symbolic where the
    model lets it be, else exported again per token count) and ``rewrite_exported``."""
    model, _ = zoo.build_model(name, dtype=getattr(torch, args.dtype))
    model = model.to(args.device)
    programs, counters, to_eager, failed = {}, {"rewritten": 0, "skipped": 0}, 0.0, False
    with torch.no_grad():
        for tokens in args.tokens:
            kwargs = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v
                      for k, v in zoo.build_inputs(name, num_tokens=tokens, seed=tokens).items()}
            out = None
            for program in programs.values():  # a program whose sequence length stayed symbolic serves this count
                try:
                    out = program.module()(**kwargs)
                    break
                except (AssertionError, RuntimeError, ValueError):
                    continue
            if out is None:
                shapes = {k: ({1: torch.export.Dim.AUTO} if isinstance(v, torch.Tensor) and v.dim() >= 2 else None)
                          for k, v in kwargs.items()}
                try:
                    ep = torch.export.export(model, (), kwargs, dynamic_shapes=shapes)
                except Exception as e:  # noqa: BLE001 -- reported apart: nothing of ours ran
                    raise ExportFailed(f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}") from e
                programs[tokens], report = moe_compile.rewrite_exported(ep)
                counters = {"rewritten": len(report.rewritten), "skipped": len(report.skipped),
                            "exports": len(programs)}
                failed = failed or any(path == "<exported program>" for path, _ in report.skipped)
                out = programs[tokens].module()(**kwargs)
            to_eager = max(to_eager, _rel(zoo.first_tensor(out), zoo.first_tensor(model(**kwargs))))
    missing = expected_rewritten(name) and counters["rewritten"] < zoo.expected_moe_layers(name)
    far = args.tol is not None and to_eager > args.tol
    return counters, to_eager, None, missing or far or failed


def _train_step(model, forward, kwargs) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = zoo.first_tensor(forward(**kwargs))
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device)
    (out.float() * proj).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_training(name: str, args) -> tuple[dict, float, float, bool]:
    """``--training``: a forward and backward that record autograd (``dynamic=False``: a compile per token count;
    with ``--dynamic``, ``dynamic=True``: one compile with symbolic sizes for every count), loss ``sum(out * R)``;
    (counters, worst output difference to eager, worst parameter-gradient difference to eager relative to that
    gradient's largest entry, flagged)."""
    model, _ = zoo.build_model(name, dtype=getattr(torch, args.dtype))
    model = model.to(args.device)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    options = {"inner_compiler": args.inner, **({"mode": args.mode} if args.mode else {})}
    ours = torch.compile(model, backend="moe_npu", dynamic=bool(args.dynamic), options=options)
    from moe_compile.report import collecting

    to_eager, grads, skipped = 0.0, 0.0, []
    for tokens in args.tokens:
        kwargs = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v
                  for k, v in zoo.build_inputs(name, num_tokens=tokens, seed=tokens).items()}
        with collecting() as report:
            out, got = _train_step(model, ours, kwargs)
        skipped += report.skipped  # every compile's (with symbolic sizes, the first count's alone)
        ref, want = _train_step(model, model, kwargs)
        to_eager = max(to_eager, _rel(out, ref))
        # a gradient that is zero in exact arithmetic (a key bias under softmax) is compared at a floor
        floor = 1e-3 * max(float(w.abs().max()) for w in want.values())
        grads = max([grads] + [float((got[n] - w).abs().max()) / max(float(w.abs().max()), floor) if n in got
                               else float("inf") for n, w in want.items()])
    counters = dict(torch._dynamo.utils.counters["moe_compile"])
    refused = [why for path, why in skipped if path == "<graph>"]
    if refused:  # a training graph the backend leaves alone, with its reason: not a miss
        print(f"{name:<20} left alone: {refused[0][:150]}")
    compiles = 1 if args.dynamic else len(args.tokens)  # symbolic sizes: one graph for every token count
    missing = not refused and expected_rewritten(name) and counters.get("rewritten", 0) < zoo.expected_moe_layers(
        name) * compiles
    if missing and skipped:
        print(f"{name:<20} a block skipped: {skipped[0][0]}: {skipped[0][1][:150]}")
    far = args.tol is not None and max(to_eager, grads) > args.tol
    return counters, to_eager, grads, missing or far or bool(counters.get("pass_failed"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dynamic", action="store_true", help="torch.compile(..., dynamic=True)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--inner", choices=["aot_eager", "inductor"], default="aot_eager")
    parser.add_argument("--tokens", type=int, nargs="+", default=[5, 11])
    parser.add_argument("--against-inductor", action="store_true")
    parser.add_argument("--families", nargs="+", default=None, help="default: every family the zoo can build")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--mode", default=None, choices=["reduce-overhead", "max-autotune-no-cudagraphs"],
                        help="the inner compiler's mode (needs --inner inductor)")
    parser.add_argument("--export", action="store_true",
                        help="torch.export each model (symbolic sequence length) and run moe_compile.rewrite_exported")
    parser.add_argument("--training", action="store_true",
                        help="a forward and backward recording autograd; also compares every parameter's gradient")
    parser.add_argument("--tol", type=float, default=None,
                        help="flag a family further than this from eager (and from plain Inductor, if compared)")
    args = parser.parse_args(argv)
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch.cuda.is_available() is False here")
    if args.mode is not None and args.inner != "inductor":
        parser.error(f"--mode {args.mode} needs --inner inductor, got --inner {args.inner}")
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
        try:
            checker = check_export if args.export else check_training if args.training else check
            counters, to_eager, to_plain, bad = checker(name, args)
        except ExportFailed as e:
            print(f"{name:<20} torch.export failed (before the pass): {e}", flush=True)
            continue
        except Exception as e:  # noqa: BLE001 -- one family's crash is reported, the scan goes on
            print(f"{name:<20} FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            flagged.append(name)
            continue
        plain = "" if to_plain is None else f"  {'grads' if args.training else 'vs plain inductor'} {to_plain:.1e}"
        print(f"{name:<20} {counters}  vs eager {to_eager:.1e}{plain}{'  <-- flagged' if bad else ''}",
              flush=True)
        if bad:
            flagged.append(name)
    print(f"{len(flagged)} flagged: {flagged}" if flagged else "none flagged")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
