"""``explain(model, *args, options=None, **kwargs)``: compile, run once, and report what was rewritten."""
from __future__ import annotations

import re

import torch

from moe_compile.report import BlockDecision, Report, collecting

# the class name's ending (Cohere2MoeLayerNorm is a norm, not an MoE layer)
_MOE_CLASS = re.compile(r"(?i)(sparsemoe\w*|moe|moeblock|moelayer|mixtureofexperts|sparsemlp|ffn)$")


def moe_like_modules(model: torch.nn.Module) -> list[str]:
    """Module paths that look like MoE blocks (for reporting blocks no graph captured)."""
    found: list[str] = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        has_experts = isinstance(getattr(module, "experts", None), torch.nn.Module)
        if not name or not (has_experts or _MOE_CLASS.search(cls)):
            continue
        if name.endswith(".experts") or cls.lower().endswith(("experts", "expert", "router", "gate")):
            continue
        if any(name.startswith(prefix + ".") for prefix in found):
            continue
        found.append(name)
    return found


def explain(model: torch.nn.Module, *args, options: dict | None = None, **kwargs) -> Report:
    """Compile ``model`` with ``backend="moe_npu"`` (fresh Dynamo caches), run it on the inputs,
    and return the report: ``.rewritten``, ``.skipped``, ``str(report)``, ``.write_graphs(dir)``."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_npu", options=options)
    with collecting() as report, torch.no_grad():
        report.output = compiled(*args, **kwargs)
    seen = {b.path for b in report.blocks}
    for path in moe_like_modules(model):
        if path not in seen and not any(p.startswith(path + ".") or path.startswith(p + ".") for p in seen if p):
            report.add(BlockDecision(path=path, reason="no top-k router over its experts was captured in a "
                                     "graph (graph break, eager experts loop, or a router the op cannot express)"))
    return report
