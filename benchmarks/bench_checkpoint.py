"""Activation checkpointing with ``backend="moe_npu"``: bytes held for the backward and step time, with and without
``torch.utils.checkpoint`` around each layer, against the inner compiler alone.

    python benchmarks/bench_checkpoint.py [--style v4_mixtral] [--layers 2] [--batch 4] [--tokens 64]
        [--inner aot_eager] [--reps 5] [--out DIR]

A stacked model of the test zoo's hand-written MoE layers (``zoo_blocks.build_block_model``: the 4.x ``ModuleList``
loop, torchtitan, gpt-fast, ...), in training mode, fp32 on the CPU. Four rows: {no checkpointing, each layer under
non-reentrant checkpointing} x {the inner compiler alone, ``moe_npu`` over it}. Per row: the blocks rewritten, the
bytes autograd holds after the forward (saved tensors, parameters left out, each storage once), the median step
time (forward, ``sum(out * R)``, backward; the rows interleaved per rep) and the largest gradient difference to eager
relative to each gradient's largest entry. transformers' own ``gradient_checkpointing_enable`` is not used: Dynamo
does not capture its layers (they run eagerly, with or without us; a contextvar the ``kernels`` hub layer sets
inside the checkpointed forward is a side effect the checkpoint's higher-order op refuses). Writes
``checkpoint.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

from benchmarks.bench_cpu_layer import interleaved_ms  # noqa: E402
from moe_compile.testing.memory import SavedBytes  # noqa: E402


class Checkpointed(torch.nn.Module):
    """The block model's layers, each under non-reentrant ``torch.utils.checkpoint`` when ``use``."""

    def __init__(self, model: torch.nn.Module, use: bool):
        super().__init__()
        self.model, self.use = model, use

    def forward(self, hidden_states):
        for layer in self.model.layers:
            hidden_states = checkpoint(layer, hidden_states, use_reentrant=False) if self.use else layer(hidden_states)
        return self.model.norm(hidden_states)


def step(model, fn, x: torch.Tensor) -> tuple[dict, int]:
    """One training step: (the parameters' gradients, bytes held for the backward)."""
    model.zero_grad(set_to_none=True)
    with SavedBytes(model) as held:
        out = fn(hidden_states=x)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, held.bytes


def main(argv=None) -> int:
    from moe_compile.report import collecting
    from moe_compile.testing.zoo_blocks import build_block_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--style", default="v4_mixtral")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--inner", default="aot_eager", choices=["aot_eager", "inductor"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    for name in ("layers", "batch", "tokens", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")

    model, kwargs = build_block_model(args.style, num_layers=args.layers, num_tokens=args.tokens, batch=args.batch)
    model.train()
    x = kwargs["hidden_states"]
    ref, _ = step(model, model, x)
    rows, fns = [], {}
    for use in (False, True):
        for backend in (args.inner, "moe_npu"):
            torch._dynamo.reset()
            options = {"options": {"inner_compiler": args.inner}} if backend == "moe_npu" else {}
            fn = torch.compile(Checkpointed(model, use), backend=backend, **options)
            with collecting() as report:
                grads, held = step(model, fn, x)
            name = f"{backend}{' + checkpoint' if use else ''}"
            worst = max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in ref.items())
            rows.append(dict(row=name, rewritten=len(report.rewritten), held_kib=held / 2**10,
                             grad_rel_diff=worst))
            fns[name] = fn
    ms = interleaved_ms({name: (lambda b, fn=fn: step(model, fn, b)) for name, fn in fns.items()}, [x], args.reps)
    print("%-26s %9s %12s %9s %13s" % ("row", "rewritten", "held KiB", "step ms", "grad rel diff"))
    for row in rows:
        row["ms"] = ms[row["row"]]
        print("%-26s %9d %12.1f %9.1f %13.1e" % (row["row"], row["rewritten"], row["held_kib"], row["ms"],
                                                row["grad_rel_diff"]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "checkpoint.json").write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
