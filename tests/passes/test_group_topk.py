"""A grouped router's group choice (a top-k over ``[T, groups]`` whose mask feeds the expert top-k)
is not an MoE block of its own: the anchor finder says so, and the pass neither logs nor counts it
as a block left alone. One block's top-k reaching the next block's through matmuls is not such a
step."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from moe_compile.passes.router import find_anchors


def _grouped_router(x, w):
    scores = (x @ w).sigmoid()                                   # [T, 8]
    group_scores = scores.view(-1, 4, 2).amax(-1)                # [T, 4]
    group_idx = torch.topk(group_scores, k=2, dim=-1)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, 4, 2).reshape(-1, 8)
    return torch.topk(scores.masked_fill(mask == 0, 0.0), k=2, dim=-1)


def _two_blocks(x, w1, w2, we):
    ids1 = torch.topk((x @ w1).softmax(-1), k=2, dim=-1)[1]
    h = x + (x @ we) * ids1.float().sum(-1, keepdim=True)        # the "experts" of block 1: a matmul
    return torch.topk((h @ w2).softmax(-1), k=2, dim=-1)


def _reasons(fn, *shapes):
    graph = make_fx(fn)(*[torch.randn(*s) for s in shapes]).graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = {n: ("x" if i == 0 else "L_self_._parameters_w%d" % i) for i, n in enumerate(placeholders)}
    return [a if isinstance(a, str) else "anchor E=%d" % a.num_experts for _, a in find_anchors(graph, names)]


def test_the_group_choice_is_a_group_selection_step():
    reasons = _reasons(_grouped_router, (5, 16), (16, 8))
    assert len(reasons) == 2 and "group-selection" in reasons[0] and reasons[1] == "anchor E=8", reasons


def test_a_top_k_reaching_the_next_block_through_matmuls_is_an_anchor():
    assert _reasons(_two_blocks, (5, 16), (16, 8), (16, 8), (16, 16)) == ["anchor E=8", "anchor E=8"]


@pytest.mark.parametrize("dtype,inner", [(torch.float32, "aot_eager"), (torch.bfloat16, "inductor")],
                         ids=["fp32-aot_eager", "bf16-inductor"])
def test_grouped_routers_are_not_counted_as_skipped_blocks(dtype, inner):
    """Inductor's bf16 graphs cast the group mask with ``prims.convert_element_type`` on its way."""
    from moe_compile.testing import zoo
    from moe_compile.testing.logs import captured_logs

    model, kwargs = zoo.build_model("deepseek_v3", dtype=dtype)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with captured_logs() as messages, torch.no_grad():
        torch.compile(model, backend="moe_npu", options={"inner_compiler": inner})(**kwargs)
    counters = torch._dynamo.utils.counters["moe_compile"]
    assert counters["rewritten"] == 2 and counters["skipped"] == 0, dict(counters)
    assert not [m for m in messages if "as it was" in m], messages
