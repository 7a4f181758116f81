"""Under torch.compile the op with its process groups stays one node; a tiny Mixtral runs
expert-parallel over 2 gloo ranks and matches eager. Run inside 2 spawned ranks:

- ``fullgraph=True`` traces of ``fused_moe(..., ep_group=g)`` / ``tp_group=g`` with the group as a
  function argument (and, for EP, as a closure): one graph, one ``moe_compile::fused_moe`` node, eager numerics;
- a tiny random ``MixtralForCausalLM`` whose MoE blocks are replaced by EP blocks holding only
  this rank's experts (``shard_experts_for_ep``), compiled with ``fullgraph=True``: logits match the
  unsharded eager model (fp32, rtol 1e-4, atol 1e-5) for the dynamic dispatcher (compiled) and
  the static and batched dispatchers (eager);
- the same model through ``backend="moe_npu"`` with ``options={"ep_group": g}``;
- a hash-routed block (experts-only rewrite) through ``backend="moe_npu"`` with ``ep_group`` and ``tp_group``.
"""
from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_harness import device

TOL = dict(rtol=1e-4, atol=1e-5)
BACKEND_CASE = "mixtral-moe_npu-ep_group"


def _graph_recorder():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def _op_nodes(gm) -> int:
    op = torch.ops.moe_compile.fused_moe
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in (op, op.default))


def _one_node_trace(kind: str) -> None:
    from moe_compile import fused_moe
    from moe_compile.distributed import shard_experts_for_ep, shard_for_tp

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group([0, 1])  # not WORLD: a group whose name is not "0"
    gen = torch.Generator().manual_seed(7)
    x, logits = torch.randn(6, 16, generator=gen).to(device()), torch.randn(6, 8, generator=gen).to(device())
    w13_full = (torch.randn(8, 16, 16, generator=gen) * 0.25).to(device())
    w2_full = (torch.randn(8, 8, 16, generator=gen) * 0.35).to(device())
    ref = fused_moe(x, logits, 8, 2, w13_full, w2_full, renormalize=True)
    if kind == "tp":
        w = shard_for_tp(w13_full, w2_full, rank=rank, world_size=world)
        extra = {}
    else:
        w = shard_experts_for_ep(w13_full, w2_full, rank=rank, world_size=world)
        extra = {"dispatcher_type": "dynamic"}

    def as_argument(x, logits, g):
        return fused_moe(x, logits, 8, 2, w.w13, w.w2, renormalize=True, **{f"{kind}_group": g}, **extra) * 2

    def as_closure(x, logits):
        return fused_moe(x, logits, 8, 2, w.w13, w.w2, renormalize=True, **{f"{kind}_group": group}, **extra) * 2

    variants = [(as_argument, (x, logits, group))] + ([(as_closure, (x, logits))] if kind == "ep" else [])
    for fn, args in variants:
        graphs, backend = _graph_recorder()
        torch._dynamo.reset()
        out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
        assert len(graphs) == 1 and _op_nodes(graphs[0]) == 1, [g.graph for g in graphs]
        torch.testing.assert_close(out, ref * 2, **TOL)


class EPMoEBlock(torch.nn.Module):
    """A MixtralSparseMoeBlock as the backend rewrites it under ``ep_group``: router + fused_moe
    with only this rank's experts (the full expert weights are not kept)."""

    def __init__(self, block, group, dispatcher: str | None):
        super().__init__()
        from moe_compile.distributed import shard_experts_for_ep

        self.group, self.dispatcher = group, dispatcher
        self.top_k, self.num_experts = block.top_k, block.experts.num_experts
        self.router_weight = block.gate.weight
        w = shard_experts_for_ep(block.experts.gate_up_proj.transpose(1, 2), block.experts.down_proj.transpose(1, 2),
                                 rank=dist.get_rank(group), world_size=dist.get_world_size(group))
        self.register_buffer("w13", w.w13)
        self.register_buffer("w2", w.w2)

    def forward(self, hidden_states):
        from moe_compile import fused_moe

        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = F.linear(x, self.router_weight)
        out = fused_moe(x, logits, self.num_experts, self.top_k, self.w13, self.w2, renormalize=True,
                        ep_group=self.group, dispatcher_type=self.dispatcher)
        return out.view(shape)


def _tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)  # the same random weights on every rank
    model = MixtralForCausalLM(cfg).eval().to(device())
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1)).to(device())
    return model, ids


def _mixtral_ep() -> None:
    model, ids = _tiny_mixtral()
    with torch.no_grad():
        ref = model(ids).logits
        for dispatcher, compiled in (("dynamic", True), ("static", False), ("batched", False)):
            ep_model, _ = _tiny_mixtral()
            for layer in ep_model.model.layers:
                layer.mlp = EPMoEBlock(layer.mlp, dist.group.WORLD, dispatcher)
                assert layer.mlp.w13.shape == (2, 32, 32) and layer.mlp.w2.shape == (2, 16, 32)
            run = ep_model
            graphs, backend = _graph_recorder()
            if compiled:
                torch._dynamo.reset()
                run = torch.compile(ep_model, fullgraph=True, backend=backend)
            out = run(ids).logits
            if compiled:
                assert len(graphs) == 1 and _op_nodes(graphs[0]) == 2, [_op_nodes(g) for g in graphs]
            torch.testing.assert_close(out, ref, **TOL, msg=lambda m, d=dispatcher: f"{d}: {m}")


def _mixtral_backend() -> None:
    import moe_compile  # noqa: F401  (registers backend="moe_npu")

    model, ids = _tiny_mixtral()
    with torch.no_grad():
        ref = model(ids).logits
        # and through Inductor, the default inner compiler (it lowers the sharded weights the graph owns)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        for inner, group in (("aot_eager", "ep_group"), ("inductor", "ep_group"), ("aot_eager", "tp_group")):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            options = {group: dist.group.WORLD, "inner_compiler": inner}
            compiled = torch.compile(model, backend="moe_npu", options=options)
            torch.testing.assert_close(compiled(ids).logits, ref, **TOL, msg=lambda m, i=inner: f"{i}: {m}")
            counters = torch._dynamo.utils.counters["moe_compile"]
            assert counters["pass_failed"] == 0, "%s: the compile fell back to the original graph" % inner
            assert counters["rewritten"] == len(model.model.layers), "%s: %s" % (inner, dict(counters))
            # the shards are made from the model's weights and follow in-place updates
            for name, p in model.named_parameters():
                if ".experts." in name:
                    p.mul_(1.5)
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, **TOL,
                                       msg=lambda m, i=inner, g=group: f"{i} {g} after an in-place update: {m}")
            model.load_state_dict(saved)


class HashRoutedBlock(torch.nn.Module):
    """A hash-routed block (DeepSeek-V4's hash layers, hand-written): ids from a table by token id, weights the
    router's softmax at those ids; gpt-fast's gather + einsum experts. The op has no routing for it, so the
    backend rewrites the experts alone (``moe_compile::fused_experts``) and keeps the router."""

    def __init__(self, hidden: int = 32, inter: int = 16, experts: int = 8, top_k: int = 2, vocab: int = 40):
        super().__init__()
        from moe_compile.testing.blocks import GatherEinsumExperts, MoEBlockConfig

        gen = torch.Generator().manual_seed(3)  # the same weights and table on every rank
        self.hidden = hidden
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = GatherEinsumExperts(MoEBlockConfig(hidden_size=hidden, intermediate_size=inter,
                                                          num_experts=experts, top_k=top_k))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        self.register_buffer("table", torch.rand(vocab, experts, generator=gen).argsort(dim=1)[:, :top_k])

    def forward(self, x, token_ids):
        x_td = x.reshape(-1, self.hidden)
        ids = self.table[token_ids.reshape(-1)]
        weights = self.gate(x_td).softmax(dim=-1).gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return torch.einsum("tkd,tk -> td", self.experts(x_td, ids), weights).view_as(x)


def _experts_only_backend() -> None:
    """The experts-only rewrite under ``ep_group`` / ``tp_group``: this rank's share of the experts, the hash
    router global; matches the block eager, and the shards follow in-place weight updates."""
    import moe_compile  # noqa: F401  (registers backend="moe_npu")

    block = HashRoutedBlock().to(device())
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 32, generator=gen).to(device())
    ids = torch.randint(0, 40, (2, 5), generator=gen).to(device())
    saved = {k: v.clone() for k, v in block.state_dict().items()}
    with torch.no_grad():
        ref = block(x, ids)
        for inner, group in (("aot_eager", "ep_group"), ("aot_eager", "tp_group"), ("inductor", "ep_group")):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            options = {group: dist.group.WORLD, "inner_compiler": inner}
            compiled = torch.compile(block, backend="moe_npu", options=options)
            torch.testing.assert_close(compiled(x, ids), ref, **TOL, msg=lambda m, g=group: f"{inner} {g}: {m}")
            counters = torch._dynamo.utils.counters["moe_compile"]
            assert counters["pass_failed"] == 0 and counters["rewritten"] == 1, (inner, group, dict(counters))
            block.experts.w2_EDF.mul_(1.5)
            torch.testing.assert_close(compiled(x, ids), block(x, ids), **TOL,
                                       msg=lambda m, g=group: f"{inner} {g} after an in-place update: {m}")
            block.load_state_dict(saved)


def compile_report(rank: int) -> dict:
    report = {}
    for name, fn in (("trace-ep", lambda: _one_node_trace("ep")), ("trace-tp", lambda: _one_node_trace("tp")),
                     ("mixtral-ep", _mixtral_ep), (BACKEND_CASE, _mixtral_backend),
                     ("experts-only-ep-tp", _experts_only_backend)):
        try:
            fn()
            report[name] = None
        except Exception:  # noqa: BLE001
            report[name] = traceback.format_exc(limit=8)
    return report
