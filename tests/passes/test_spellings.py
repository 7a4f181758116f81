"""Hand-written block spellings: expert names with more than one number, a Llama-4 router transposed
before its sigmoid, a top-k over ``[B, S, E]`` scores, the reasons for experts (and expert-choice routing) the op
cannot take, and the model that is itself the block."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_compile
from moe_compile.explain import moe_like_modules

from .helpers import explain_and_compare, max_rel_diff

H, I, E, K = 32, 48, 8, 2


def _loop(experts, x, weights, ids):
    """The 4.x loop: ``torch.where`` per expert, ``index_add_`` of the weighted outputs."""
    out = torch.zeros_like(x)
    for e in range(len(experts)):
        tok, slot = torch.where(ids == e)
        out.index_add_(0, tok, experts[e](x[tok]) * weights[tok, slot, None])
    return out


class _FcExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_1, self.fc_2 = nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, x):
        return self.fc_2(F.gelu(self.fc_1(x)))


class LoopMoE(nn.Module):
    """``ModuleList`` experts whose parameter names hold a second number: ``experts.3.0.weight``
    (``nn.Sequential``) or ``experts.3.fc_1.weight``."""

    def __init__(self, expert: str):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        make = {"sequential": lambda: nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Linear(I, H)),
                "fc_1": _FcExpert}[expert]
        self.experts = nn.ModuleList([make() for _ in range(E)])

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.gate(x), dim=-1), K, dim=-1)
        return _loop(self.experts, x, weights, ids)


@pytest.mark.parametrize("expert", ["sequential", "fc_1"])
def test_expert_index_is_any_number_in_the_name(expert):
    torch.manual_seed(0)
    report, diff = explain_and_compare(LoopMoE(expert).eval(), {"x": torch.randn(12, H)})
    assert report.rewritten == [""], str(report)
    assert diff <= 1e-4, (diff, str(report))


class Llama4TransposedMoE(nn.Module):
    """Llama 4's router with the scattered scores transposed to ``[E, T]`` before the sigmoid."""

    def __init__(self, repeat: bool):
        super().__init__()
        self.repeat = repeat
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * I) * 0.1)
        self.down = nn.Parameter(torch.randn(E, I, H) * 0.1)

    def forward(self, x):
        logits = self.router(x)
        values, ids = torch.topk(logits, 1, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, ids, values).transpose(0, 1).sigmoid()
        if self.repeat:
            routed = (x.repeat(E, 1) * scores.reshape(-1, 1)).view(E, -1, H)
        else:
            routed = x.unsqueeze(0).expand(E, x.shape[0], H) * scores.unsqueeze(-1)
        gate, up = torch.bmm(routed, self.gate_up).chunk(2, -1)
        return torch.bmm(up * F.silu(gate), self.down).sum(0)


@pytest.mark.parametrize("repeat", [False, True], ids=["expand", "repeat"])
def test_llama4_router_transposed_before_the_sigmoid(repeat):
    torch.manual_seed(0)
    report, diff = explain_and_compare(Llama4TransposedMoE(repeat).eval(), {"x": torch.randn(12, H)})
    assert report.rewritten == [""], str(report)
    assert "topk→sigmoid" in str(report)
    assert diff <= 1e-4, (diff, str(report))


class Scores3DMoE(nn.Module):
    """Never flattens its tokens: ``[B, S, E]`` router scores, top-k over them, 3-D gathers."""

    def __init__(self):
        super().__init__()
        self.router = nn.Parameter(torch.randn(H, E) * 0.2)
        self.w1 = nn.Parameter(torch.randn(E, H, I) * 0.1)
        self.w3 = nn.Parameter(torch.randn(E, H, I) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, I, H) * 0.1)

    def forward(self, x):
        weights, ids = torch.topk((x @ self.router).softmax(dim=-1), K, dim=-1)    # [B, S, K]
        weights = weights / weights.sum(-1, keepdim=True)
        h = F.silu(torch.einsum("bsh,bskhi->bski", x, self.w1[ids])) * torch.einsum(
            "bsh,bskhi->bski", x, self.w3[ids])
        return (torch.einsum("bski,bskih->bskh", h, self.w2[ids]) * weights[..., None]).sum(-2)


class Wrapped(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.proj, self.mlp = nn.Linear(H, H), block

    def forward(self, x):
        return self.mlp(self.proj(x))


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["root", "wrapped"])
def test_top_k_over_3d_scores_is_rewritten(wrapped, inner):
    torch.manual_seed(0)
    model = (Wrapped(Scores3DMoE()) if wrapped else Scores3DMoE()).eval()
    report, diff = explain_and_compare(model, {"x": torch.randn(2, 6, H)}, {"inner_compiler": inner})
    assert report.rewritten == (["mlp"] if wrapped else [""]), str(report)
    assert diff <= 1e-4, (diff, str(report))


class Experts3D(nn.Module):
    def __init__(self, act, gated=True, computed=False, normed=False):
        super().__init__()
        self.act, self.gated, self.normed = act, gated, normed
        self.w13 = nn.Parameter(torch.randn(E, (2 if gated else 1) * I, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * 0.1)
        if computed:  # LoRA factors merged into w13 at run time
            self.lora_a = nn.Parameter(torch.randn(E, self.w13.shape[1], 4) * 0.1)
            self.lora_b = nn.Parameter(torch.randn(E, 4, H) * 0.1)

    def mlp(self, e, x, w13):
        h = F.linear(x, w13[e])
        if self.gated:
            gate, up = h.chunk(2, -1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        out = F.linear(h, self.w2[e])
        return F.normalize(out, dim=-1) if self.normed else out


class UnsupportedMoE(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.gate = nn.Linear(H, E, bias=False)
        acts = {"relu_gated": (F.relu, True), "gelu_tanh": (lambda t: F.gelu(t, approximate="tanh"), False),
                "computed": (F.silu, True), "normed": (F.silu, True)}
        if kind in acts:
            self.experts = Experts3D(*acts[kind], computed=kind == "computed", normed=kind == "normed")
        elif kind == "expert_choice":
            self.experts = Experts3D(F.silu, True)
        elif kind == "one_linear":
            self.up = nn.Linear(H, E * 2 * I, bias=False)
            self.down = nn.Parameter(torch.randn(E, I, H) * 0.1)

    def forward(self, x):
        if self.kind == "expert_choice":  # each expert picks its 4 tokens: a top-k over the tokens
            weights_EC, tokens_EC = self.gate(x).softmax(-1).t().topk(4, dim=-1)
            out = torch.zeros_like(x)
            for e in range(E):
                y = self.experts.mlp(e, x[tokens_EC[e]], self.experts.w13) * weights_EC[e, :, None]
                out.index_add_(0, tokens_EC[e], y)
            return out
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        if self.kind == "no_weights":
            return x * (weights * (ids + 1)).sum(-1, keepdim=True)  # no expert weights at all
        if self.kind == "one_linear":
            gate, up = self.up(x).view(x.shape[0], E, 2 * I).chunk(2, -1)
            y = torch.einsum("tei,eih->teh", F.silu(gate) * up, self.down)
            return (y * torch.zeros(x.shape[0], E).scatter_add(1, ids, weights)[..., None]).sum(1)
        ex = self.experts
        w13 = ex.w13 + ex.lora_a @ ex.lora_b if self.kind == "computed" else ex.w13
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, ex.mlp(e, x[tok], w13) * weights[tok, slot, None])
        return out


@pytest.mark.parametrize("kind,words", [
    ("relu_gated", ["expert weights [8, 96, 32], [8, 32, 48] found", "gated", "relu;", "no activation"]),
    ("gelu_tanh", ["expert weights [8, 48, 32], [8, 32, 48] found", "non-gated", "gelu(approximate='tanh')"]),
    ("computed", ["computed in the graph from parameters", "[8, 96, 32] by add"]),
    ("one_linear", ["[8, 48, 32] found", "weight [768, 32] that holds all 8 experts in one matrix"]),
    ("expert_choice", ["the top-k picks 4 of the 12 tokens for each of the 8 experts (expert-choice routing"]),
    ("normed", ["[8, 96, 32], [8, 32, 48] found (read as gated experts, activations silu", "computes something"]),
])
def test_reason_says_what_the_experts_were(kind, words):
    reason = _only_reason(kind)
    assert all(w in reason for w in words) and "experts not captured" not in reason, reason


def test_reason_keeps_not_captured_only_without_expert_weights():
    assert _only_reason("no_weights") == (
        "no node of the block equals the routed experts' weighted sum (experts not captured in this graph?)")
    assert "not captured" not in _only_reason("relu_gated")


def _only_reason(kind: str) -> str:
    torch.manual_seed(0)
    report, diff = explain_and_compare(UnsupportedMoE(kind).eval(), {"x": torch.randn(12, H)})
    assert diff == 0.0 and not report.rewritten, str(report)
    [(path, reason)] = report.skipped
    assert path == "", str(report)
    return reason


@torch._dynamo.disable
def _eager_router(gate, x):
    return torch.topk(F.softmax(gate(x), dim=-1), K, dim=-1)


class EagerRouterMoE(LoopMoE):
    """The router runs outside every graph (``torch._dynamo.disable``): no graph holds a top-k."""

    def __init__(self):
        super().__init__("fc_1")

    def forward(self, x):
        weights, ids = _eager_router(self.gate, x)
        return _loop(self.experts, x, weights, ids)


def test_the_model_that_is_the_block_is_reported_when_no_graph_captures_it():
    torch.manual_seed(0)
    report, diff = explain_and_compare(EagerRouterMoE().eval(), {"x": torch.randn(12, H)})
    assert diff <= 1e-5
    assert [path for path, _ in report.skipped] == [""], str(report)
    assert "no top-k router over its experts was captured" in report.skipped[0][1]


def test_moe_like_modules_includes_the_root_only_when_it_is_the_block():
    assert moe_like_modules(LoopMoE("fc_1")) == [""]              # holds experts
    assert moe_like_modules(Wrapped(LoopMoE("fc_1"))) == ["mlp"]
    root = type("TinyMoE", (nn.Module,), {})()                   # named like a block, holds none
    assert moe_like_modules(root) == [""]
    root.layer = type("InnerSparseMoeBlock", (nn.Module,), {})()  # a model named ...MoE holding blocks
    assert moe_like_modules(root) == ["layer"]


class Fp32SumMoE(nn.Module):
    """bf16 experts whose weighted outputs are summed in fp32 and returned in fp32 (hy_v3 with its
    bf16 round trip removed, as Inductor 2.11's joint-graph passes do): the output's dtype is fp32,
    but it carries the bf16 experts' rounding."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * 0.1)

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).float().softmax(-1), K, dim=-1)   # fp32 weights
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            gate, up = F.linear(x[tok], self.w13[e]).chunk(2, -1)
            y = F.linear(F.silu(gate) * up, self.w2[e])              # bf16
            out.index_add_(0, tok, y * weights[tok, slot, None])       # bf16 x fp32 -> fp32
        return out


def test_bf16_experts_summed_in_fp32_are_rewritten():
    # On the H200 host (torch 2.11) seed 0 draws other numbers than here and gave one token two equal bf16
    # logits for its 2nd and 3rd expert: torch.topk took the higher index, our router the lower (the NPU
    # ops' rule, select_experts), and the test failed on a tie, not on the rewrite (neartie_run3_s23.log).
    # Seed 9's smallest margin is 5 % here and 3 % there; the assert below catches a tie on any machine.
    torch.manual_seed(9)
    model = Fp32SumMoE().to(torch.bfloat16).eval()
    x = torch.randn(12, H, dtype=torch.bfloat16)
    with torch.no_grad():
        top = model.gate(x).float().softmax(-1).topk(K + 1, dim=-1).values
    assert ((top[:, K - 1] - top[:, K]) / top[:, K - 1]).min() > 0.02, "the routing has a near-tie"
    report, diff = explain_and_compare(model, {"x": x})
    assert report.rewritten == [""], str(report)
    assert report.output.dtype == torch.float32
    assert diff <= 2e-2, (diff, str(report))


@pytest.mark.parametrize("make", ["experts3d", "v4_mixtral"])
def test_autocast_block_is_rewritten_with_weights_cast_like_the_block(make):
    """fp32 weights under ``torch.autocast(bfloat16)``: the graph casts the expert weights to bf16 before
    each matmul, so the op computes in bf16 too (it was left alone: the fp32 reading missed the bf16
    output by more than fp32's tolerance, and computing in fp32 would be slower than the block).
    Later in-place weight updates are followed through the per-call cast. (HF 5.x ``grouped_mm``
    experts on the CPU run transformers' own fallback op, which autocast leaves in fp32: those stay
    fp32, and the block, whose routing weights autocast rounds to bf16, is left as it was.)"""
    from moe_compile.testing import zoo
    from moe_compile.testing.zoo_blocks import build_block_model

    torch.manual_seed(0)
    if make == "experts3d":
        model, kwargs = Fp32SumMoE().eval(), {"x": torch.randn(12, H)}
    else:
        model, kwargs = build_block_model("v4_mixtral", num_layers=1)
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = zoo.first_tensor(model(**kwargs))
        report = moe_compile.explain(model, **kwargs, options={"inner_compiler": "aot_eager"})
        assert len(report.rewritten) == 1 and "weights cast to bfloat16" in str(report), str(report)
        assert max_rel_diff(zoo.first_tensor(report.output), ref) <= 2e-2
        torch._dynamo.reset()
        fast = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})
        fast(**kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.5)
    # a new autocast region: autocast caches its weight casts until the region ends
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert max_rel_diff(zoo.first_tensor(fast(**kwargs)), zoo.first_tensor(model(**kwargs))) <= 2e-2


class ExplicitCastMoE(nn.Module):
    """fp32 weights and router; the experts cast their inputs and weights to bf16 in the user's own
    code (no autocast), so only the expert matmuls are narrower than the weights."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * I) / H ** 0.5)
        self.down = nn.Parameter(torch.randn(E, I, H) / I ** 0.5)

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            gate, up = (x[tok].to(torch.bfloat16) @ self.gate_up[e].to(torch.bfloat16)).chunk(2, -1)
            y = ((F.silu(gate) * up) @ self.down[e].to(torch.bfloat16)).float()
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return out


def test_experts_cast_narrower_than_an_fp32_router_are_rewritten():
    """The fp32 router matmul is not one of the experts' (it is where the probes start): the op is
    given the bf16 casts of the weights."""
    torch.manual_seed(0)
    report, diff = explain_and_compare(ExplicitCastMoE().eval(), {"x": torch.randn(7, H)})
    assert report.rewritten == [""] and "weights cast to bfloat16" in str(report), str(report)
    assert diff <= 2e-2, (diff, str(report))
