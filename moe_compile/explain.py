"""``explain(model, *args, options=None, **kwargs)``: compile, run once, and report what was rewritten."""
from __future__ import annotations

import dataclasses
import re

import torch

from moe_compile.report import BlockDecision, Report, collecting

# the class name's ending (Cohere2MoeLayerNorm is a norm, not an MoE layer)
_MOE_CLASS = re.compile(r"(?i)(sparsemoe\w*|moe|moeblock|moelayer|mixtureofexperts|sparsemlp|ffn)$")


def moe_like_modules(model: torch.nn.Module) -> list[str]:
    """Module paths that look like MoE blocks (for reporting blocks no graph captured). The model itself
    (path ``""``) is one when it is the block: it holds ``experts``, or its class name says MoE and no
    module inside it looks like a block of its own."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not name or not _looks_like_block(name, module):
            continue
        if any(name.startswith(prefix + ".") for prefix in found):
            continue
        found.append(name)
    if _looks_like_block("", model) and (isinstance(getattr(model, "experts", None), torch.nn.Module) or not found):
        return [""]
    return found


def _looks_like_block(name: str, module: torch.nn.Module) -> bool:
    cls = type(module).__name__
    has_experts = isinstance(getattr(module, "experts", None), torch.nn.Module)
    if not (has_experts or _MOE_CLASS.search(cls)):
        return False
    return not (name.endswith(".experts") or name == "experts"
                or cls.lower().endswith(("experts", "expert", "router", "gate")))


def full_path(path: str, owner: str) -> str:
    """``path`` (relative to the module Dynamo compiled) as a path in the whole model, given the
    full path ``owner`` of a module inside the block (its router): ``layers.0.mlp`` inside
    ``model.layers.0.mlp.gate`` is ``model.layers.0.mlp``. Unchanged when ``owner`` is not inside it."""
    if not path:
        return owner.rsplit(".", 1)[0] if "." in owner else path
    at = ("." + owner + ".").rfind("." + path + ".")
    return owner[:at] + path if at >= 0 else path


def _resolve_paths(model: torch.nn.Module, report: Report) -> None:
    """Name every block by its path in ``model``: after a graph break at the top of a model (HF's
    ``output_router_logits=True``), Dynamo compiles the inner module's frame on its own and the paths
    it records start there (``layers.0.mlp`` for ``model.layers.0.mlp``)."""
    owners = {id(p): name.rsplit(".", 1)[0] for name, p in model.named_parameters(remove_duplicate=False)}
    modules = dict(model.named_modules())
    blocks, report.blocks = report.blocks, []
    for block in blocks:
        owner = owners.get(block.router_weight_id) if block.router_weight_id is not None else None
        if owner is not None and not block.path:  # the block's own frame: its router's module is inside it
            owner = _router_module(owner, modules)
        if owner is not None and "." in owner:
            block = dataclasses.replace(block, path=full_path(block.path, owner))
        report.add(block)


def _router_module(owner: str, modules: dict) -> str:
    """The outermost router-like module around ``owner`` (dbrx's ``ffn.router`` for ``ffn.router.layer``),
    whose parent is the block."""
    from moe_compile.passes.match import looks_like_router

    while "." in owner:
        parent = owner.rsplit(".", 1)[0]
        module = modules.get(parent)
        if module is None or not looks_like_router(type(module)):
            break
        owner = parent
    return owner


def explain(model: torch.nn.Module, *args, options: dict | None = None, training: bool = False, **kwargs) -> Report:
    """Compile ``model`` with ``backend="moe_npu"`` (fresh Dynamo caches), run it on the inputs,
    and return the report: ``.rewritten``, ``.skipped``, ``str(report)``, ``.write_graphs(dir)``.
    The forward runs under ``no_grad`` (an inference graph); ``training=True`` runs it recording autograd
    (the training graph, ``moe_compile/training.py``), and ``report.output`` can then be backpropagated."""
    if not isinstance(training, bool):
        raise TypeError("explain: training must be a bool, but got %r" % (training,))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_npu", options=options)
    with collecting() as report, torch.set_grad_enabled(training):
        report.output = compiled(*args, **kwargs)
    _resolve_paths(model, report)
    seen = {b.path for b in report.blocks if not b.not_moe}
    for path in moe_like_modules(model):
        # the model itself as the block: any decision (its own, its router's, its frame's) covers it
        covered = bool(seen) if not path else any(
            p.startswith(path + ".") or path.startswith(p + ".") for p in seen if p)
        if path not in seen and not covered:
            report.add(BlockDecision(path=path, reason="no top-k router over its experts was captured in a "
                                     "graph (graph break, eager experts loop, or a router the op cannot express)"))
    return report
