"""Training graphs with activation checkpointing and saved-tensor hooks.

``torch.utils.checkpoint`` (non-reentrant) around a layer reaches the backend as Dynamo's
``tag_activation_checkpoint`` higher-order op; the training trace runs it as AOTAutograd does (its ops tagged
``recompute`` / ``ac_graph_id``), the pass rewrites the block inside, and the nodes it makes carry the block's tags,
so the partitioner recomputes the stacked weights and the fused op's inputs in the backward instead of saving them.
A step run under saved-tensor hooks (``save_on_cpu``, a memory probe) is traced without them, as AOTAutograd does.
Each case checks the blocks rewritten, the output and every gradient against eager (fp32, 1e-4 relative to each
gradient's largest entry), and where it matters the bytes held for the backward.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moe_compile.report import collecting
from moe_compile.testing.memory import SavedBytes
from moe_compile.testing.zoo_blocks import build_block_model

from .helpers import TOL, max_rel_diff


class _Checkpointed(torch.nn.Module):
    """The block model's layers, each under ``torch.utils.checkpoint`` (or not, ``use=False``)."""

    def __init__(self, model: torch.nn.Module, use: bool = True, reentrant: bool = False, context_fn=None):
        super().__init__()
        self.model, self.use, self.reentrant = model, use, reentrant
        self.extra = {} if context_fn is None else {"context_fn": context_fn}

    def forward(self, hidden_states):
        for layer in self.model.layers:
            hidden_states = (checkpoint(layer, hidden_states, use_reentrant=self.reentrant, **self.extra) if self.use
                             else layer(hidden_states))
        return self.model.norm(hidden_states)


def _step(model, wrapper, kwargs, hooks=None):
    """(output, gradients, bytes held for the backward beyond the parameters); ``hooks``: other saved-tensor hooks
    to run the step under instead of the counting ones."""
    model.zero_grad(set_to_none=True)
    with SavedBytes(model) if hooks is None else hooks as held:
        out = wrapper(**kwargs)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, getattr(held, "bytes", None)


def _compiled_step(model, wrapper, kwargs, backend="moe_npu", inner="aot_eager", hooks=None):
    torch._dynamo.reset()
    options = {"options": {"inner_compiler": inner}} if backend == "moe_npu" else {}
    compiled = torch.compile(wrapper, backend=backend, **options)
    with collecting() as report:
        result = _step(model, compiled, kwargs, hooks)
    return report, result


def _assert_matches(result, ref):
    out, grads, _ = result
    assert max_rel_diff(out, ref[0]) <= TOL[torch.float32]
    assert max(max_rel_diff(grads[n], ref[1][n]) for n in ref[1]) <= TOL[torch.float32]


@pytest.mark.parametrize("style", ["v4_mixtral", "titan_loop"])
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_checkpointed_layers_are_rewritten_and_their_tags_kept(style, inner):
    model, kwargs = build_block_model(style, num_layers=2, num_tokens=32, batch=2)
    model.train()
    ref = _step(model, _Checkpointed(model), kwargs)
    report, result = _compiled_step(model, _Checkpointed(model), kwargs, inner=inner)
    assert len(report.rewritten) == 2 and not report.skipped, str(report)
    _assert_matches(result, ref)
    _, plain = _compiled_step(model, _Checkpointed(model), kwargs, backend="aot_eager" if inner == "aot_eager"
                              else "inductor")
    _, unchecked = _compiled_step(model, _Checkpointed(model, use=False), kwargs, inner=inner)
    # the rewritten blocks' stacked weights and op inputs recomputed, not saved: less held than with the block
    # checkpointed without us, and less than the rewritten model without checkpointing
    assert result[2] < plain[2] and result[2] < unchecked[2], (result[2], plain[2], unchecked[2])


def test_the_new_nodes_carry_the_checkpoint_tags(monkeypatch):
    from moe_compile import training

    model, kwargs = build_block_model("v4_mixtral", num_layers=1, num_tokens=8, batch=2)
    model.train()
    seen = []
    real = training.differentiable
    monkeypatch.setattr(training, "differentiable", lambda gm: seen.append(gm) or real(gm))
    report, _ = _compiled_step(model, _Checkpointed(model), kwargs)
    assert report.rewritten == ["model.layers.0.moe"], str(report)
    fused = [n for n in seen[0].graph.nodes if n.target is torch.ops.moe_compile.fused_moe.default]
    stacks = [n for n in seen[0].graph.nodes if n.target is torch.ops.aten.stack.default]
    assert len(fused) == 1 and stacks
    for node in fused + stacks:
        assert node.meta.get("ac_graph_id") is not None and node.meta.get("recompute") is not None, node


def test_selective_checkpointing_with_a_policy():
    """Selective activation checkpointing (a ``context_fn`` policy that saves matmul outputs, as torchtitan's does):
    the blocks are rewritten and the gradients are eager's."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    model, kwargs = build_block_model("v4_mixtral", num_layers=2, num_tokens=16, batch=2)
    model.train()
    ref = _step(model, _Checkpointed(model, context_fn=context_fn), kwargs)
    report, result = _compiled_step(model, _Checkpointed(model, context_fn=context_fn), kwargs)
    assert len(report.rewritten) == 2 and not report.skipped, str(report)
    _assert_matches(result, ref)


def test_reentrant_checkpoint_trains_through_the_rewritten_blocks():
    """``use_reentrant=True``: Dynamo breaks the graph at the checkpoint; the layers' forward runs under no_grad and
    is rewritten as inference graphs are; their recompute runs in the backward, outside the compiled call (eagerly,
    as without us); the gradients are eager's."""
    model, kwargs = build_block_model("v4_mixtral", num_layers=2, num_tokens=8, batch=2)
    model.train()
    hidden = kwargs["hidden_states"].clone().requires_grad_()  # reentrant checkpoint needs an input that does
    ref = _step(model, _Checkpointed(model, reentrant=True), {"hidden_states": hidden})
    report, result = _compiled_step(model, _Checkpointed(model, reentrant=True), {"hidden_states": hidden})
    assert report.rewritten == ["model.layers.0.moe", "model.layers.1.moe"], str(report)
    _assert_matches(result, ref)


def test_a_step_under_saved_tensor_hooks_is_rewritten():
    """The compiling step runs under ``save_on_cpu`` (pack hooks): the trace does not hand them fake tensors
    (before, the graph was left alone: "could not be traced to aten"); they run around the compiled graph."""
    model, kwargs = build_block_model("v4_mixtral", num_layers=2, num_tokens=8, batch=2)
    model.train()
    ref = _step(model, model, kwargs)
    report, result = _compiled_step(model, model, kwargs, hooks=torch.autograd.graph.save_on_cpu())
    assert len(report.rewritten) == 2 and not report.skipped, str(report)
    _assert_matches(result, ref)
