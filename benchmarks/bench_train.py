"""A training step (forward, cross-entropy, backward) of an HF MoE model: eager vs Inductor vs ``backend="moe_npu"``.

    python benchmarks/bench_train.py [--model qwen3] [--hidden 512] [--inter 256] [--experts 32] [--top-k 4]
        [--layers 2] [--batch 4] [--seq 128] [--device cpu] [--dtype float32] [--reps 10] [--inner inductor]
        [--modes eager inductor moe_npu [moe_npu_opaque moe_npu_loop]] [--profile N] [--host-profile N]
        [--compile-profile N] [--out DIR]

For each mode: the first step's time (the compile), the median step time (``bench_cpu_layer.interleaved_ms``:
each rep runs every mode in turn), the bytes autograd holds for the backward after the forward (tensors saved
for backward, parameters not counted, each storage once; ``torch.autograd.graph.saved_tensors_hooks``), and the
largest difference of the loss and of every parameter's gradient from eager (relative to its largest entry).
``moe_npu``'s backward recomputes each rewritten block (``moe_compile/ops/autograd.py``; grouped GEMMs where
``torch._grouped_mm`` takes them, traced into the graph in bf16), so it saves only the blocks' inputs. Modes
``moe_npu_opaque`` (``training_backward='op'``: the opaque backward op) and ``moe_npu_loop`` (that op looping over
the experts) compare the forms in one run; ``inductor_graphs`` and ``moe_npu_graphs`` compile with
``mode="reduce-overhead"`` (CUDA graphs of the forward and the backward), ``inductor_dynamic`` and
``moe_npu_dynamic`` with ``dynamic=True`` (symbolic shapes); ``--profile N`` prints each mode's N ops of most
device time, ``--host-profile N`` its N Python functions of most own time (cProfile), ``--compile-profile N`` the N
of most cumulative time in its first step (the compile; that step is then timed under cProfile). Prints a table;
writes ``train.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed

from benchmarks.bench_cpu_layer import interleaved_ms  # noqa: E402
from benchmarks.bench_export import add_model_args, make_model  # noqa: E402

MODES = ("eager", "inductor", "moe_npu", "moe_npu_opaque", "moe_npu_loop", "inductor_graphs", "moe_npu_graphs",
         "inductor_dynamic", "moe_npu_dynamic")


@contextlib.contextmanager
def backward_path(mode: str):
    """``moe_npu_loop``: the opaque backward op (``compiled`` asks for it) loops over the experts instead of running
    grouped GEMMs, to compare the two in one run."""
    if mode != "moe_npu_loop":
        yield
        return
    from moe_compile.ops import experts_grad

    real = experts_grad.usable
    experts_grad.usable = lambda *a: False
    try:
        yield
    finally:
        experts_grad.usable = real


def compiled(mode: str, model, inner: str = "inductor"):
    import moe_compile  # noqa: F401  (registers the backend)

    if mode == "eager":
        return model
    graphs = {"mode": "reduce-overhead"} if mode.endswith("_graphs") else {}  # CUDA graphs of forward and backward
    dynamic = mode.endswith("_dynamic")  # symbolic shapes: one graph for every batch and length
    if mode.startswith("inductor"):
        return torch.compile(model, dynamic=dynamic, **graphs)
    # moe_npu: the backward as ops/autograd.py chooses (bf16: grouped GEMMs traced into the graph); the others: in
    # the opaque fused_moe_backward op (options differ, so Dynamo compiles them apart)
    backward = "op" if mode in ("moe_npu_opaque", "moe_npu_loop") else "auto"
    return torch.compile(model, backend="moe_npu", dynamic=dynamic,
                         options={"inner_compiler": inner, "training_backward": backward, **graphs})


def step(model, fn, batch: dict, mode: str = "eager") -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    if mode.endswith("_graphs"):
        torch.compiler.cudagraph_mark_step_begin()  # a new step: the graphs may overwrite the last step's outputs
    with backward_path(mode):
        logits = fn(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        value = loss.item()
    return value, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def saved_bytes(model, fn, batch: dict) -> int:
    """Bytes of the tensors saved for backward by one forward (parameters left out, each storage once)."""
    from moe_compile.testing.memory import SavedBytes

    model.zero_grad(set_to_none=True)
    with SavedBytes(model) as held:
        logits = fn(input_ids=batch["input_ids"]).logits
    F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten()).backward()
    return held.bytes


def profile_table(run, batches: list, rows: int) -> str:
    """torch.profiler's table of the ``rows`` ops of most device (else host) time over 3 calls of ``run``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for b in batches[:3]:
            run(b)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def host_profile(run, batches: list, rows: int, sort: str = "tottime") -> str:
    """cProfile's ``rows`` Python functions of most own time (``sort="cumulative"``: of most time inside them) over
    a call of ``run`` per batch (where the host's time goes; three batches at most)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for b in batches[:3]:
        run(b)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(rows)
    return out.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES[:3]),
                        help="moe_npu_opaque / moe_npu_loop: moe_npu with the backward in one opaque op, with grouped "
                        "GEMMs / a loop over the experts (backward_path)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"],
                        help="moe_npu's inner compiler (aot_eager: quick, for tests)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, profile 3 steps of each mode and print its N kernels of most device time")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="after timing, cProfile 3 steps of each mode and print its N functions of most own time")
    parser.add_argument("--compile-profile", type=int, default=0, metavar="N",
                        help="cProfile each mode's first step (its compile) and print its N functions of most "
                        "cumulative time")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    model = make_model(args)
    gen = torch.Generator(device=args.device).manual_seed(1)

    def batch():
        ids = torch.randint(0, 1024, (args.batch, args.seq + 1), device=args.device, generator=gen)
        return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}

    first = batch()
    ref_loss, ref_grads = step(model, model, first)
    ref_grads = {n: g.clone() for n, g in ref_grads.items()}
    fns, rows = {}, {}
    for mode in args.modes:
        fns[mode] = compiled(mode, model, args.inner)
        start = time.perf_counter()
        if args.compile_profile:
            result = []
            table = host_profile(lambda b: result.append(step(model, fns[mode], b, mode)), [first],
                                 args.compile_profile, sort="cumulative")
            print(f"\n{mode}: the {args.compile_profile} functions of most cumulative time in the first step\n{table}")
            loss, grads = result[0]
        else:
            loss, grads = step(model, fns[mode], first, mode)
        worst = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in ref_grads.items())
        first_s = time.perf_counter() - start
        with backward_path(mode):
            saved = saved_bytes(model, fns[mode], first)
        rows[mode] = dict(mode=mode, first_step_s=first_s, loss_diff=abs(loss - ref_loss), grad_rel_diff=worst,
                          saved_mb=saved / 2**20)
    batches = [batch() for _ in range(4)]
    ms = interleaved_ms({mode: (lambda b, fn=fn, mode=mode: step(model, fn, b, mode)) for mode, fn in fns.items()},
                        batches, args.reps)
    print("%-12s %9s %8s %13s %9s %10s %13s" % ("mode", "step ms", "x eager", "first step s", "saved MB", "loss diff",
                                               "grad rel diff"))
    for mode, row in rows.items():
        row["ms"] = ms[mode]
        print("%-12s %9.1f %8.2f %13.1f %9.1f %10.1e %13.1e" % (mode, row["ms"], ms["eager"] / row["ms"]
                                                               if "eager" in ms else float("nan"), row["first_step_s"],
                                                               row["saved_mb"], row["loss_diff"], row["grad_rel_diff"]))
    for mode, fn in fns.items() if args.profile else ():
        print(f"\n{mode}: the {args.profile} kernels of most device time over 3 steps")
        print(profile_table(lambda b, fn=fn, mode=mode: step(model, fn, b, mode), batches, args.profile))
    for mode, fn in fns.items() if args.host_profile else ():
        print(f"\n{mode}: the {args.host_profile} Python functions of most own time over 3 steps")
        print(host_profile(lambda b, fn=fn, mode=mode: step(model, fn, b, mode), batches, args.host_profile))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        text = json.dumps(dict(args=vars(args), rows=list(rows.values())), indent=1)
        (Path(args.out) / "train.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
