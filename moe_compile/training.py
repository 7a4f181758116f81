"""Training graphs: the pass on a graph that records autograd.

AOTAutograd hands Inductor's post-grad passes a forward and a backward graph already partitioned, where
a block's forward has been differentiated op by op: too late to put one op in its place. So a graph that
records autograd is first traced here to a functional aten graph of its forward alone (``make_fx`` of the
functionalised Dynamo graph: the ops as they reach autograd, which records nothing that is kept), the pass
rewrites that, and the rewritten aten graph goes to the inner compiler as Dynamo's graph would have:
AOTAutograd differentiates it again, now through the fused ops' registered backward
(``ops/autograd.py``). Expert weights that the inference rewrite would stack into a cached copy are
stacked in the graph instead (``passes/rewrite.py``), so their gradients reach the model's parameters.

Symbolic shapes (``dynamic=True``, or Dynamo's recompile with a symbolic length when the length changes) are traced
at Dynamo's own fake inputs, in its shape environment, as AOTAutograd traces, so the guards the trace adds are the
compiled graph's and one compile serves every length; Python floats Dynamo made inputs are turned back into tensor
arithmetic as AOTAutograd does (and a float it must specialise restarts Dynamo's analysis, as it would without us).
A graph with a data-dependent size (an unbacked symbol: boolean-mask indexing, ``nonzero``) is traced the same way
at static shapes too, its unbacked symbols rebound to Dynamo's and the Python dispatcher on, as AOTAutograd traces.

Activation checkpointing (``torch.utils.checkpoint``, non-reentrant: Dynamo's ``tag_activation_checkpoint``) is
run by the trace as AOTAutograd runs it, so the region's ops carry their ``recompute`` tags, and the nodes the pass
makes inherit the replaced block's (``passes/rewrite.py``). Saved-tensor hooks the step runs under are not traced
(as AOTAutograd does not trace them); they run around the compiled graph.

Left alone, with the reason: graphs that enter inference mode or forward-mode AD, graphs holding other
higher-order ops or functorch transforms (``vmap`` in a mask function, a Mamba scan: the trace's own
functionalization is a functorch transform and does not nest with them), and expert- or tensor-parallel
blocks; on NPU (TorchAir) training graphs are compiled without the pass.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import PropagateUnbackedSymInts

# grad-mode changes other than Dynamo's _set_grad_enabled nodes (which the trace keeps: _GradModeKeeper)
_OTHER_GRAD_MODES = ("inference_mode", "_enter_inference_mode", "_set_fwd_grad_enabled", "_enter_dual_level")


def refusal(gm: fx.GraphModule, example_inputs, config, torchair: bool) -> str | None:
    """Why this training graph is compiled without the pass, or None."""
    if torchair:
        return "autograd is recording: on NPU (TorchAir) training graphs are compiled without the pass"
    if config.ep_group is not None or config.tp_group is not None:
        return "autograd is recording: the fused op's backward runs on one device (no ep_group/tp_group)"
    for t in example_inputs:
        if isinstance(t, (torch.SymFloat, torch.SymBool)):
            return ("autograd is recording with a symbolic %s input (%s): compiled without the pass"
                    % (type(t).__name__, t))
    if _dynamo_fakes(gm) is None and _symbolic(gm, example_inputs):
        return ("autograd is recording with symbolic shapes and the graph's inputs carry no fake values of "
                "Dynamo's to trace them at: compiled without the pass")
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = getattr(node.target, "__name__", node.target)
        if name in _OTHER_GRAD_MODES:
            return ("autograd is recording and the graph enters %s (%s): compiled without the pass"
                    % (name, node.format_node()[:100]))
        module = getattr(node.target, "__module__", None) or ""
        if name == "tag_activation_checkpoint":  # traced as AOTAutograd traces it (its ops tagged for recompute)
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator) or "_functorch" in module:
            return ("autograd is recording and the graph holds %s (a higher-order op or a functorch transform, e.g. "
                    "vmap): training graphs with them are compiled without the pass" % name)
    return None


def trace_to_aten(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    """Dynamo's graph as a functional aten graph at the example inputs' shapes, taking the same flat inputs and
    giving the same outputs. No decompositions: every op it holds is one that reached autograd, so autograd can
    go through it again (Inductor decomposes when it compiles). Traced with grad mode on, as the training step
    runs: composite ops that choose their kernel by ``requires_grad`` (``scaled_dot_product_attention`` with a
    mask that requires grad takes the math path) choose as they will when the graph is differentiated."""
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    # saved-tensor hooks the step runs under (``save_on_cpu``, a memory probe) are not traced, as AOTAutograd
    # does not trace them: they would be handed fake tensors; they run around the compiled graph instead
    no_hooks = getattr(torch._dynamo.utils, "_disable_saved_tensors_hooks_during_tracing", contextlib.nullcontext)
    with no_hooks():
        if _symbolic(gm, example_inputs) or (_dynamo_fakes(gm) is not None and _unbacked(gm)):
            traced = _symbolic_trace(gm)
        else:
            # node by node, so each new node keeps its source node's metadata (the module path the report names);
            # outside Dynamo's tracing context: make_fx would take its fake mode, and the guards our trace adds to
            # Dynamo's shape environment (on symbols no source of Dynamo's names) would break its guard building
            with fx_traceback.preserve_node_meta(), torch._guards.tracing(None), torch.enable_grad():
                traced = make_fx(_functional(_GradModeKeeper(gm).run), tracing_mode="fake")(*example_inputs)
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced


def _symbolic_trace(gm: fx.GraphModule) -> fx.GraphModule:
    """The symbolic-shape trace: at Dynamo's own fake inputs, in its shape environment, as AOTAutograd traces, so the
    guards it adds are on Dynamo's symbols and become the compiled graph's (the inputs as they are: a float input's
    fake keeps the value its ``.item()`` gives). Two passes: ``torch.func.functionalize`` reads the sizes of the
    composite ops it runs as ints (``F.linear`` with a bias on a 3-D input), which would specialise every length,
    so the graph is first traced to aten ops as it is, then that graph is functionalised."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes._tensorify_python_scalars import tensorify_python_scalars

    fakes = _dynamo_fakes(gm)
    fake_mode = next(t.fake_mode for t in fakes if isinstance(t, torch._subclasses.FakeTensor))
    # the Python dispatcher, as Dynamo and AOTAutograd trace: ops whose C++ meta takes only concrete sizes
    # (``constant_pad_nd`` padding by a symbolic amount) run their Python meta
    with fx_traceback.preserve_node_meta(), torch._guards.tracing(None), fake_mode, torch.enable_grad(), \
            enable_python_dispatcher():
        unfunctional = make_fx(_GradModeKeeper(gm).run, tracing_mode="real")(*fakes)
        # replayed node by node (an Interpreter), so each node keeps its metadata; a node that made a data-dependent
        # size (an unbacked symbol) has the new run's symbol bound to the first one (as AOTAutograd's retrace does)
        traced = make_fx(_functional(PropagateUnbackedSymInts(unfunctional).run), tracing_mode="real")(*fakes)
        # Python floats Dynamo made inputs (dynamic=True) are read by .item(): their arithmetic back on the 0-d
        # tensors, as AOTAutograd does, so the pass sees a routing scale as it does in inference
        tensorify_python_scalars(traced, fake_mode.shape_env, fake_mode)
    return traced


def _functional(run):
    """``run`` functionalised, mutations of its inputs copied back at the end. Those copies carry no gradient (a
    parameter is a leaf; autograd refuses an in-place copy into one that requires grad), so grad mode is off for
    them."""
    def run_then_no_grad(*args):
        out = run(*args)
        torch._C._set_grad_enabled(False)
        return out

    return torch.func.functionalize(run_then_no_grad, remove="mutations")


def _symbolic(gm: fx.GraphModule, example_inputs) -> bool:
    """Whether the graph has symbolic sizes: SymInt inputs, or an input Dynamo traced with a symbolic size."""
    if any(isinstance(t, torch.SymInt) for t in example_inputs):
        return True
    fakes = _dynamo_fakes(gm) or []
    return any(isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape) for v in fakes)


def _unbacked(gm: fx.GraphModule) -> bool:
    """Whether a value Dynamo traced has a data-dependent size (an unbacked symbol: boolean-mask indexing,
    ``nonzero``), which only Dynamo's shape environment can trace again, also in a graph of static input sizes."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, (torch.Tensor, torch.SymInt)) and free_unbacked_symbols(value):
            return True
    return False


def _dynamo_fakes(gm: fx.GraphModule):
    """The graph's inputs as Dynamo traced them (fake tensors with its symbolic sizes, its SymInts), or None."""
    values = [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"]
    return None if any(v is None for v in values) else values


class _GradModeKeeper(PropagateUnbackedSymInts):
    """Runs Dynamo's graph node by node (rebinding unbacked symbols, as its base does); a value computed while
    the graph has grad mode off (its ``_set_grad_enabled(False)`` nodes run here as they do in the model) is
    detached, so the aten graph, which keeps no grad mode, keeps its meaning: autograd does not go through that
    value (``aten.detach`` is a view, and functionalization keeps it)."""

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module") and not torch.is_grad_enabled():
            result = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, result)
        return result


def differentiable(gm: fx.GraphModule) -> int:
    """Give the rewritten graph's ops that autograd cannot go through a spelling it can; how many were:

    - ``prims.convert_element_type(x, dtype)`` (the pass's casts) -> ``aten._to_copy(x, dtype=dtype)``;
    - ``aten.copy(dst, src)`` (functionalization's form of an in-place copy) -> ``src`` cast to ``dst``'s
      dtype, expanded to its shape and cloned: the values ``dst`` is overwritten with, so ``dst`` gets no
      gradient, as through the in-place copy."""
    aten, count = torch.ops.aten, 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.prims.convert_element_type.default:
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(aten._to_copy.default, (node.args[0],), {"dtype": node.args[1]})
        elif node.target is aten.copy.default:
            dst, src = node.args[0], node.args[1]
            dst_val = dst.meta["val"]
            with gm.graph.inserting_before(node):
                cast = gm.graph.call_function(aten._to_copy.default, (src,), {"dtype": dst_val.dtype})
                # a symbolic size is read off dst in the graph (no raw SymInt in a node's arguments)
                shape = [gm.graph.call_function(aten.sym_size.int, (dst, i)) if isinstance(d, torch.SymInt) else d
                         for i, d in enumerate(dst_val.shape)]
                wide = gm.graph.call_function(aten.expand.default, (cast, shape))
                new = gm.graph.call_function(aten.clone.default, (wide,))
        else:
            continue
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


__all__ = ["differentiable", "refusal", "trace_to_aten"]
