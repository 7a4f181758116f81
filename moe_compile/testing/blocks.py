"""Hand-written MoE blocks, written the ways users write them, as test subjects for the pass.

Four source forms (each block's docstring holds the form it stands for):

* :class:`V4MoEBlock` -- transformers-4.x Mixtral style: ``nn.ModuleList`` of w1/w2/w3 expert MLPs,
  ``softmax(fp32) -> topk -> renorm -> .to(dtype)``, ``one_hot(...).permute(2, 1, 0)`` and a loop over
  ``range(num_experts)`` with ``torch.where`` and ``index_add_``;
* :class:`GatherEinsumMoE` -- gpt-fast's mixtral-moe style: ``w1[expert_indices]`` gathers and einsums;
* :class:`TitanMoE` -- torchtitan style: token-choice router (softmax/sigmoid), ``tokens_per_expert``
  by ``histc``, argsort permutation, ``torch._grouped_mm`` (or a loop over the groups), ``scatter_add``;
* :class:`V4GroupedSigmoidMoE` -- the 4.x loop behind a DeepSeek-V3-like sigmoid grouped router with
  ``e_score_correction_bias``, ``routed_scaling_factor`` and an ungated shared expert.

Shape suffixes: B batch, S sequence, T tokens (B*S), D hidden, F expert intermediate, E experts,
K top-k, G expert groups, N routed (token, expert) pairs (T*K).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class ScoreFunc(enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, but got {name!r}.")
    return _ACTIVATIONS[name]


@dataclass(frozen=True)
class MoEBlockConfig:
    """Sizes and routing of one hand-written block; each block reads the fields that apply to it."""

    hidden_size: int = 64
    intermediate_size: int = 32
    num_experts: int = 8
    top_k: int = 2
    renormalize: bool = True
    activation: str = "silu"
    # torchtitan router / experts
    score_func: ScoreFunc = ScoreFunc.SOFTMAX
    route_scale: float = 1.0
    score_before_experts: bool = False  # torchtitan's option: weight the expert INPUT, not its output
    use_grouped_mm: bool = True  # False: torchtitan's for-loop over num_tokens_per_expert.tolist()
    # DeepSeek-V3-like grouped sigmoid router
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    n_shared_experts: int = 1
    router_bias: bool = False  # a bias in the fp32 router GEMM (an addmm in the captured graph)
    group_mask_fill: float = float("-inf")  # what the dropped groups' scores become (AXK2: 0.0)

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, but got {value!r}.")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must be <= num_experts={self.num_experts}, but got {self.top_k!r}.")
        if not isinstance(self.score_func, ScoreFunc):
            raise TypeError(f"score_func must be a ScoreFunc, but got {self.score_func!r}.")
        _activation(self.activation)


class ExpertMLP(nn.Module):
    """One 4.x-style expert: ``w2(act(w1(x)) * w3(x))``."""

    def __init__(self, cfg: MoEBlockConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.act_fn = _activation(cfg.activation)

    def forward(self, hidden_states):
        return self.w2(self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states))


def _loop_experts(experts: nn.ModuleList, hidden_TD, routing_weights_TK, selected_experts_TK):
    """The 4.x dispatch: one-hot mask, ``torch.where`` per expert, ``index_add_`` back."""
    num_experts = len(experts)
    final_hidden_states = torch.zeros_like(hidden_TD)
    expert_mask_EKT = F.one_hot(selected_experts_TK, num_classes=num_experts).permute(2, 1, 0)
    for expert_idx in range(num_experts):
        expert_layer = experts[expert_idx]
        idx, top_x = torch.where(expert_mask_EKT[expert_idx])
        current_state = hidden_TD[None, top_x].reshape(-1, hidden_TD.shape[-1])
        current_hidden_states = expert_layer(current_state) * routing_weights_TK[top_x, idx, None]
        final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_TD.dtype))
    return final_hidden_states


class V4MoEBlock(nn.Module):
    """transformers-4.x Mixtral style::

        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        expert_mask = F.one_hot(selected_experts, num_classes=E).permute(2, 1, 0)
        for expert_idx in range(E):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, D)
            out.index_add_(0, top_x, experts[expert_idx](current_state) * routing_weights[top_x, idx, None])
    """

    def __init__(self, cfg: MoEBlockConfig):
        super().__init__()
        self.cfg = cfg
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList([ExpertMLP(cfg) for _ in range(cfg.num_experts)])

    def forward(self, hidden_states_BSD):
        batch, seq, dim = hidden_states_BSD.shape
        hidden_states = hidden_states_BSD.view(-1, dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.cfg.renormalize:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        out = _loop_experts(self.experts, hidden_states, routing_weights, selected_experts)
        return out.reshape(batch, seq, dim)


class GatherEinsumExperts(nn.Module):
    """gpt-fast's ConditionalFeedForward: gather each token's k expert matrices, then einsum."""

    def __init__(self, cfg: MoEBlockConfig):
        super().__init__()
        e, f, d = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
        self.w1_EFD = nn.Parameter(torch.empty(e, f, d))
        self.w2_EDF = nn.Parameter(torch.empty(e, d, f))
        self.w3_EFD = nn.Parameter(torch.empty(e, f, d))
        self.act_fn = _activation(cfg.activation)

    def forward(self, x_TD, expert_indices_TK):
        w1_TKFD = self.w1_EFD[expert_indices_TK]
        w3_TKFD = self.w3_EFD[expert_indices_TK]
        w2_TKDF = self.w2_EDF[expert_indices_TK]
        gate_TKF = self.act_fn(torch.einsum("td,tkfd -> tkf", x_TD, w1_TKFD))
        up_TKF = torch.einsum("td,tkfd -> tkf", x_TD, w3_TKFD)
        return torch.einsum("tkf,tkdf -> tkd", gate_TKF * up_TKF, w2_TKDF)


class GatherEinsumMoE(nn.Module):
    """gpt-fast mixtral-moe style::

        scores = self.gate(x)                       # [T, E]
        expert_weights = F.softmax(scores, dim=-1)
        expert_weights, expert_indices = torch.topk(expert_weights, k, dim=-1)
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True)
        expert_outs = self.cond_ffn(x, expert_indices)   # w[expert_indices] + einsum
        return torch.einsum("tkd,tk -> td", expert_outs, expert_weights)
    """

    def __init__(self, cfg: MoEBlockConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.cond_ffn = GatherEinsumExperts(cfg)

    def forward(self, x_BSD):
        x_TD = x_BSD.view(-1, self.cfg.hidden_size)
        scores_TE = self.gate(x_TD)
        expert_weights_TE = F.softmax(scores_TE, dim=-1)
        expert_weights_TK, expert_indices_TK = torch.topk(expert_weights_TE, self.cfg.top_k, dim=-1)
        if self.cfg.renormalize:
            expert_weights_TK /= expert_weights_TK.sum(dim=-1, keepdim=True)
        expert_outs_TKD = self.cond_ffn(x_TD, expert_indices_TK)
        return torch.einsum("tkd,tk -> td", expert_outs_TKD, expert_weights_TK).view_as(x_BSD)


class TokenChoiceRouter(nn.Module):
    """torchtitan-style router: score, top-k, optional renorm and scale, tokens per expert."""

    def __init__(self, cfg: MoEBlockConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)

    def forward(self, x_TD):
        cfg = self.cfg
        scores_TE = self.gate(x_TD)
        if cfg.score_func is ScoreFunc.SOFTMAX:
            scores_TE = F.softmax(scores_TE.to(torch.float32), dim=1)
        else:
            scores_TE = torch.sigmoid(scores_TE.to(torch.float32))
        top_scores_TK, selected_experts_TK = torch.topk(scores_TE, k=cfg.top_k, dim=1)
        if cfg.renormalize:
            top_scores_TK = top_scores_TK / (top_scores_TK.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores_TK = top_scores_TK * cfg.route_scale
        # histc has no integer kernel on CPU, hence the float ids.
        tokens_per_expert_E = torch.histc(
            selected_experts_TK.view(-1).float(), bins=cfg.num_experts, min=0, max=cfg.num_experts
        )
        return top_scores_TK, selected_experts_TK, tokens_per_expert_E


class GroupedExperts(nn.Module):
    """torchtitan GroupedExperts: w1/w3 ``[E, F, D]``, w2 ``[E, D, F]``, rows grouped by expert."""

    def __init__(self, cfg: MoEBlockConfig):
        super().__init__()
        e, f, d = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
        self.w1 = nn.Parameter(torch.empty(e, f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))
        self.w3 = nn.Parameter(torch.empty(e, f, d))
        self.use_grouped_mm = cfg.use_grouped_mm
        self.act_fn = _activation(cfg.activation)

    def forward(self, x_ND, tokens_per_expert_E):
        if self.use_grouped_mm:
            offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
            h_NF = self.act_fn(torch._grouped_mm(x_ND, self.w1.transpose(-2, -1), offs=offsets_E))
            h_NF = h_NF * torch._grouped_mm(x_ND, self.w3.transpose(-2, -1), offs=offsets_E)
            return torch._grouped_mm(h_NF, self.w2.transpose(-2, -1), offs=offsets_E)
        sizes = tokens_per_expert_E.long().tolist()
        outs = []
        for expert_idx, x_chunk in enumerate(torch.split(x_ND, sizes, dim=0)):
            h = self.act_fn(torch.matmul(x_chunk, self.w1[expert_idx].transpose(-2, -1)))
            h = h * torch.matmul(x_chunk, self.w3[expert_idx].transpose(-2, -1))
            outs.append(torch.matmul(h, self.w2[expert_idx].transpose(-2, -1)))
        return torch.cat(outs, dim=0)


class TitanMoE(nn.Module):
    """torchtitan style::

        top_scores, selected_experts, tokens_per_expert = self.router(x)      # histc counts
        order = torch.argsort(selected_experts.view(-1), stable=True)
        top_scores_sorted = top_scores.view(-1)[order]
        token_idx = order // top_k
        routed_input = x[token_idx]
        routed_output = self.experts(routed_input, tokens_per_expert)          # _grouped_mm / loop
        routed_output = routed_output * top_scores_sorted[:, None]
        out = zeros_like(x).scatter_add(0, token_idx[:, None].expand(-1, D), routed_output)
    """

    def __init__(self, cfg: MoEBlockConfig):
        super().__init__()
        self.cfg = cfg
        self.router = TokenChoiceRouter(cfg)
        self.experts = GroupedExperts(cfg)

    def forward(self, x_BSD):
        cfg = self.cfg
        x_TD = x_BSD.view(-1, cfg.hidden_size)
        top_scores_TK, selected_experts_TK, tokens_per_expert_E = self.router(x_TD)
        order_N = torch.argsort(selected_experts_TK.view(-1), stable=True)
        top_scores_sorted_N = top_scores_TK.view(-1)[order_N]
        token_idx_N = order_N // cfg.top_k
        routed_input_ND = x_TD[token_idx_N]
        if cfg.score_before_experts:
            routed_input_ND = (routed_input_ND.float() * top_scores_sorted_N.reshape(-1, 1)).to(x_TD.dtype)
        routed_output_ND = self.experts(routed_input_ND, tokens_per_expert_E)
        if not cfg.score_before_experts:
            routed_output_ND = (routed_output_ND.float() * top_scores_sorted_N.reshape(-1, 1)).to(x_TD.dtype)
        out_TD = torch.zeros_like(x_TD)
        out_TD = out_TD.scatter_add(0, token_idx_N.reshape(-1, 1).expand(-1, cfg.hidden_size), routed_output_ND)
        return out_TD.view_as(x_BSD)


class GroupedSigmoidGate(nn.Module):
    """DeepSeek-V3-like router: sigmoid, selection-only bias, group top-2 sum, topk_group, top-k."""

    def __init__(self, cfg: MoEBlockConfig):
        super().__init__()
        if cfg.num_experts % cfg.n_group or cfg.topk_group > cfg.n_group:
            raise ValueError(
                f"n_group must divide num_experts={cfg.num_experts} and topk_group <= n_group, but got "
                f"n_group={cfg.n_group!r}, topk_group={cfg.topk_group!r}."
            )
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router_bias else None
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def forward(self, hidden_TD):
        cfg = self.cfg
        num_tokens = hidden_TD.shape[0]
        bias = None if self.bias is None else self.bias.type(torch.float32)
        logits_TE = F.linear(hidden_TD.type(torch.float32), self.weight.type(torch.float32), bias)
        scores_TE = logits_TE.sigmoid()
        scores_for_choice_TE = scores_TE + self.e_score_correction_bias.unsqueeze(0)
        group_scores_TG = scores_for_choice_TE.view(num_tokens, cfg.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores_TG, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask_TG = torch.zeros_like(group_scores_TG)
        group_mask_TG.scatter_(1, group_idx, 1)
        score_mask_TE = (
            group_mask_TG.unsqueeze(-1)
            .expand(num_tokens, cfg.n_group, cfg.num_experts // cfg.n_group)
            .reshape(num_tokens, -1)
        )
        tmp_scores_TE = scores_for_choice_TE.masked_fill(~score_mask_TE.bool(), cfg.group_mask_fill)
        topk_idx_TK = torch.topk(tmp_scores_TE, k=cfg.top_k, dim=-1, sorted=False)[1]
        topk_weight_TK = scores_TE.gather(1, topk_idx_TK)
        if cfg.renormalize:
            topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx_TK, topk_weight_TK * cfg.routed_scaling_factor


class V4GroupedSigmoidMoE(nn.Module):
    """The 4.x ModuleList loop behind a DeepSeek-V3-like router, plus an ungated shared expert::

        topk_idx, topk_weight = self.gate(hidden_states)          # sigmoid grouped, x scale
        out = <V4MoEBlock loop>(hidden_states, topk_weight.to(dtype), topk_idx)
        out = out + self.shared_experts(hidden_states)
    """

    def __init__(self, cfg: MoEBlockConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = GroupedSigmoidGate(cfg)
        self.experts = nn.ModuleList([ExpertMLP(cfg) for _ in range(cfg.num_experts)])
        self.shared_experts = None
        if cfg.n_shared_experts:
            shared_cfg = MoEBlockConfig(
                hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size * cfg.n_shared_experts,
                activation=cfg.activation,
            )
            self.shared_experts = ExpertMLP(shared_cfg)

    def forward(self, hidden_states_BSD):
        batch, seq, dim = hidden_states_BSD.shape
        hidden_TD = hidden_states_BSD.view(-1, dim)
        topk_idx_TK, topk_weight_TK = self.gate(hidden_TD)
        out_TD = _loop_experts(self.experts, hidden_TD, topk_weight_TK.to(hidden_TD.dtype), topk_idx_TK)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(hidden_TD)
        return out_TD.view(batch, seq, dim)
