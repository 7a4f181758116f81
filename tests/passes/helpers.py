"""Shared checks for the pass tests: compile with moe_npu, compare with eager, count graphs."""
from __future__ import annotations

import torch

import moe_compile
from moe_compile.testing.zoo import first_tensor  # noqa: F401  (re-exported for the pass tests)

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}  # fp16: 3 more mantissa bits


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / (b.abs().max() + 1e-6)).item()


def explain_and_compare(model, kwargs, options=None):
    """(report, max |compiled - eager| relative to max |eager|)."""
    options = {"inner_compiler": "aot_eager", "verify": True, **(options or {})}
    with torch.no_grad():
        ref = first_tensor(model(**kwargs))
    report = moe_compile.explain(model, **kwargs, options=options)
    return report, max_rel_diff(first_tensor(report.output), ref)


def rewrites_under_dynamic(model, inputs: list[dict]) -> int:
    """Compile ``model`` once with ``dynamic=True`` (aot_eager), check it against eager on each kwargs in
    ``inputs`` (fp32 tolerance), and return how many blocks the pass rewrote."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="moe_npu", dynamic=True, options={"inner_compiler": "aot_eager"})
    with torch.no_grad():
        for i, kwargs in enumerate(inputs):
            assert max_rel_diff(compiled(**kwargs), model(**kwargs)) <= TOL[torch.float32], i
    return torch._dynamo.utils.counters["moe_compile"]["rewritten"]


class GraphCounter:
    """A backend that counts the graphs Dynamo hands it and runs them with aot_eager."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(gm, example_inputs)
