"""``rewrite_exported(ep)``: the MoE pass on a ``torch.export`` program, for deployment without Dynamo at run time.

``torch.export.export(model, args, kwargs)`` gives one aten graph of the whole model, its parameters and buffers
lifted to inputs. The pass runs on that graph as it does on the graphs ``backend="moe_npu"`` is handed: the real
weights come from the program's state dict and the user inputs from its example inputs (or the ones given here), so
every block is matched by the same probes. The pass reads the program as aot_autograd hands graphs to the backend
(functional aten, composite ops such as ``linear`` decomposed: ``ep.run_decompositions({})``). The result is a new
``ExportedProgram`` in that form (the given one is not changed; it is returned as it is when nothing is rewritten)
whose MoE blocks call ``moe_compile::fused_moe`` / ``fused_experts``; it runs with ``.module()``, saves with
``torch.export.save`` (``import moe_compile`` before ``torch.export.load``, to register the ops) and compiles with
AOTInductor (``torch._inductor.aoti_compile_and_package``), which calls the ops through its proxy executor.
"""
from __future__ import annotations

import logging

import torch

from moe_compile.options import parse_options
from moe_compile.report import BlockDecision, collecting, record, record_graphs, take_back, tracking

log = logging.getLogger("moe_compile")


def rewrite_exported(ep, *args, options: dict | None = None, **kwargs):
    """(new program, report): ``ep`` with its MoE blocks rewritten into the fused op, and what was rewritten and
    why not. ``args``/``kwargs``: the user inputs the probes start from; by default the program's own example
    inputs. Options are ``backend="moe_npu"``'s (``exclude``, ``experts_only``, ``lowering``, ...; the compile
    ones do not apply). A pass failure keeps the program as it was and says why in the report. The new program is
    for inference: stacked expert weights are copies made here, which no gradient reaches (training goes through
    ``torch.compile``: ``moe_compile/training.py``)."""
    from torch.export import ExportedProgram

    if not isinstance(ep, ExportedProgram):
        raise TypeError("ep must be a torch.export.ExportedProgram (from torch.export.export), but got %s"
                        % type(ep).__name__)
    config = parse_options(options)
    # functional aten with composite ops decomposed (linear -> mm), as aot_autograd hands graphs to the backend;
    # a new program, sharing the weights
    new = ep.run_decompositions({})
    flat = _flat_inputs(new, args, kwargs)
    with collecting() as report:
        rewritten = _run_pass(new.graph_module, flat, _input_names(new), config)
    if not rewritten:  # nothing rewritten (or the pass failed half-way): the program as it was
        new = ep
    report.output = new
    return new, report


def _flat_inputs(ep, args: tuple, kwargs: dict) -> list:
    if not args and not kwargs:
        if ep.example_inputs is None:
            raise ValueError("ep has no example inputs (a program loaded without them?): pass the user inputs "
                             "to rewrite_exported(ep, *args, **kwargs)")
        args, kwargs = ep.example_inputs
    try:
        return list(ep._graph_module_flat_inputs(args, kwargs))
    except ValueError as exc:
        raise ValueError("args/kwargs must have the structure ep was exported with: %s" % (
            str(exc).splitlines()[0],)) from exc


def _input_names(ep) -> list[str]:
    """Placeholder names the pass reads weights by: ``parameters.<fqn>`` / ``buffers.<fqn>`` for lifted state."""
    kinds = {"PARAMETER": "parameters.", "BUFFER": "buffers.", "CONSTANT_TENSOR": "buffers."}
    names = []
    for i, spec in enumerate(ep.graph_signature.input_specs):
        prefix = kinds.get(spec.kind.name)
        names.append(prefix + spec.target if prefix else "user input %d" % i)
    return names


def _run_pass(gm: torch.fx.GraphModule, flat: list, names: list[str], config) -> int:
    from moe_compile.backend import _op_kwargs
    from moe_compile.passes.moe_pass import MoEFusionPass

    before = gm.print_readable(print_output=False)
    moe_pass = MoEFusionPass(config, flat, names, _op_kwargs(config))
    with tracking() as decisions:
        try:
            with torch.no_grad():  # the pass reads the parameters' values; it records nothing
                moe_pass(gm.graph)
        except Exception as exc:  # noqa: BLE001 - the program as it was, and why
            log.debug("moe_compile: the pass failed on the exported program", exc_info=True)
            why = "the pass failed on the exported program (%s: %s); it is kept as it was" % (
                type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            log.warning("moe_compile: %s", why)
            take_back(decisions, why)
            record(BlockDecision(path="<exported program>", reason=why))
            return 0
    if moe_pass.rewritten:
        _drop_dead_code(gm.graph)
        gm.recompile()
        record_graphs(before, gm.print_readable(print_output=False))
    return moe_pass.rewritten


def _drop_dead_code(graph: torch.fx.Graph) -> None:
    """The replaced experts' nodes, which export's metadata checks (``aten._assert_tensor_metadata``, one per
    ``.to()``: side effects to fx) would keep computing: a check of a tensor nothing else reads goes with it."""
    check = torch.ops.aten._assert_tensor_metadata.default
    while True:
        removed = graph.eliminate_dead_code()
        for node in list(graph.nodes):
            tensor = node.args[0] if node.op == "call_function" and node.target is check and node.args else None
            if isinstance(tensor, torch.fx.Node) and all(u.target is check for u in tensor.users):
                graph.erase_node(node)
                removed = True
        if not removed:
            return


__all__ = ["rewrite_exported"]
