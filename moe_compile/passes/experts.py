"""Expert recognition: find the expert weights a routed output depends on and how they are used.

The weights are the graph inputs in the routed output's slice: 3-D tensors ``[E, a, b]``
(HF 5.x ``gate_up_proj``/``down_proj``, gpt-fast, torchtitan), ``[E, n]`` biases, or ``E``
same-named 2-D Linear weights (``experts.<i>.w1.weight``: a ``ModuleList``). Each way of
reading them as the op's ``w13 [E, H, 2I]`` / ``w2 [E, I, H]`` (which tensor is which, transposed
or not, gate and up separate or concatenated, interleaved) and each activation is a candidate;
the structure (which activation ops appear, strided slices) orders the candidates.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from moe_compile.ops.config import Activation, ExpertsConfig
from moe_compile.passes.graph import aten, val

_INDEXED_NAME = re.compile(r"^(.*)[._](\d+)[._](.*)$")


@dataclass(frozen=True)
class WeightSource:
    """How one op-layout weight is made from graph inputs."""

    kind: str  # "node" | "stack" | "cat"
    nodes: tuple  # graph nodes ("node"/"stack") or WeightSources ("cat")
    transpose: bool = False  # swap the last two dims (a view for "node")

    def real(self, values: dict) -> torch.Tensor:
        if self.kind == "cat":
            return torch.cat([part.real(values) for part in self.nodes], dim=-1)
        if self.kind == "stack":
            t = torch.stack([values[n] for n in self.nodes])
        else:
            t = values[self.nodes[0]]
        return t.transpose(-2, -1) if self.transpose else t

    @property
    def copies(self) -> bool:
        return self.kind != "node"


@dataclass(frozen=True)
class ExpertsChoice:
    w13: WeightSource
    w2: WeightSource
    b13: WeightSource | None
    b2: WeightSource | None
    config: ExpertsConfig
    form: str

    def describe(self) -> str:
        return self.config.activation.value + (" interleaved" if self.config.gate_up_interleaved else "")


def expert_inputs(slice_nodes: set[fx.Node], values: dict, num_experts: int, names: dict,
                  exclude: set[fx.Node]) -> tuple[list[WeightSource], list[WeightSource]]:
    """(3-D weight sources, 2-D bias sources) among the graph inputs of a slice."""
    mats, biases, flat = [], [], []
    for node in slice_nodes:
        if node.op not in ("placeholder", "get_attr") or node in exclude:
            continue
        t = values.get(node)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        if t.dim() == 3 and t.shape[0] == num_experts:
            mats.append(WeightSource("node", (node,)))
        elif t.dim() == 2 and t.shape[0] == num_experts:
            biases.append(WeightSource("node", (node,)))
        elif t.dim() in (1, 2):
            flat.append(node)
    for stacked in _stacked_families(flat, values, num_experts, names):
        (mats if values[stacked.nodes[0]].dim() == 2 else biases).append(stacked)
    return mats, biases


def _stacked_families(nodes: list[fx.Node], values: dict, num_experts: int, names: dict) -> list[WeightSource]:
    groups: dict[tuple[str, str], dict[int, fx.Node]] = {}
    for node in nodes:
        match = _INDEXED_NAME.match(names.get(node, ""))
        if match:
            prefix, index, suffix = match.groups()
            groups.setdefault((prefix, suffix), {})[int(index)] = node
    out = []
    for members in groups.values():
        if sorted(members) != list(range(num_experts)):
            continue
        ordered = tuple(members[i] for i in range(num_experts))
        shapes = {tuple(values[n].shape) for n in ordered}
        if len(shapes) == 1:
            out.append(WeightSource("stack", ordered))
    return sorted(out, key=lambda s: names.get(s.nodes[0], ""))


def _shape(source: WeightSource, values: dict) -> tuple[int, int]:
    """(in, out) of a weight source as the op would read it."""
    first = source.nodes[0]
    t = values[first] if source.kind != "cat" else None
    if source.kind == "cat":
        parts = [_shape(p, values) for p in source.nodes]
        return parts[0][0], sum(p[1] for p in parts)
    a, b = t.shape[-2:]
    return (b, a) if source.transpose else (a, b)


def _orientations(source: WeightSource) -> list[WeightSource]:
    return [WeightSource(source.kind, source.nodes, False), WeightSource(source.kind, source.nodes, True)]


def weight_layouts(mats: list[WeightSource], values: dict, hidden: int) -> list[tuple[WeightSource, WeightSource]]:
    """Every consistent (w13, w2) reading of the expert matrices."""
    out = []
    if len(mats) == 2:
        for first, second in itertools.permutations(mats):
            for w13, w2 in itertools.product(_orientations(first), _orientations(second)):
                (i13, n13), (i2, n2) = _shape(w13, values), _shape(w2, values)
                if i13 == hidden and n2 == hidden and n13 in (i2, 2 * i2):
                    out.append((w13, w2))
    elif len(mats) == 3:
        for gate, up, down in itertools.permutations(mats):
            for g, u, d in itertools.product(_orientations(gate), _orientations(up), _orientations(down)):
                (ig, ng), (iu, nu), (i2, n2) = (_shape(s, values) for s in (g, u, d))
                if ig == iu == hidden and n2 == hidden and ng == nu == i2:
                    out.append((WeightSource("cat", (g, u)), d))
    return out


def bias_layouts(biases: list[WeightSource], values: dict, n13: int, hidden: int):
    """Candidate (b13, b2) pairs from [E, n] tensors; a gate and an up bias of half the width
    (separate ``Linear(bias=True)`` gate and up projections) are concatenated like their weights."""
    widths = {b: values[b.nodes[0]].shape[-1] for b in biases}
    halves = [b for b in biases if 2 * widths[b] == n13]
    b13s = [b for b in biases if widths[b] == n13]
    b13s += [WeightSource("cat", (g, u)) for g, u in itertools.permutations(halves, 2)] + [None]
    b2s = [b for b in biases if widths[b] == hidden] + [None]
    pairs = [(a, b) for a in b13s for b in b2s if a is None or b is None or (a != b and b not in a.nodes)]
    pairs.sort(key=lambda p: -(p[0] is not None) - (p[1] is not None))
    return pairs


def activation_candidates(region: set[fx.Node], gated: bool) -> list[ExpertsConfig]:
    targets = {n.target for n in region}
    strided = any(n.target is aten.slice.Tensor and len(n.args) > 4 and n.args[4] == 2 for n in region)
    if gated:
        order = [Activation.SILU, Activation.GELU, Activation.GELU_TANH, Activation.SWIGLU_OAI]
        if aten.clamp.default in targets or aten.clamp_max.default in targets or aten.clamp_min.default in targets:
            order.remove(Activation.SWIGLU_OAI)
            order.insert(0, Activation.SWIGLU_OAI)
        elif aten.gelu.default in targets or aten.erf.default in targets or aten.tanh.default in targets:
            tanh = aten.tanh.default in targets or any(n.kwargs.get("approximate") == "tanh" for n in region
                                                       if n.target is aten.gelu.default)
            first = [Activation.GELU_TANH, Activation.GELU] if tanh else [Activation.GELU, Activation.GELU_TANH]
            order = first + [a for a in order if a not in first]
    else:
        order = [Activation.SILU_NO_MUL, Activation.GELU_NO_MUL, Activation.RELU_NO_MUL, Activation.RELU2_NO_MUL]
        if aten.relu.default in targets:
            order = [Activation.RELU2_NO_MUL, Activation.RELU_NO_MUL] if (
                aten.pow.Tensor_Scalar in targets or aten.square.default in targets or aten.mul.Tensor in targets
            ) else [Activation.RELU_NO_MUL, Activation.RELU2_NO_MUL]
            order += [Activation.SILU_NO_MUL, Activation.GELU_NO_MUL]
    limits = _clamp_limits(region)
    alphas = _mul_constants(region)
    out = []
    for act in order:
        interleaves = ((True, False) if strided else (False, True)) if act.is_gated else (False,)
        for inter in interleaves:
            if act is Activation.SWIGLU_OAI:
                for limit in limits or [7.0]:
                    for alpha in alphas or [1.702]:
                        out.append(ExpertsConfig(act, alpha, limit, inter))
            else:
                out.append(ExpertsConfig(act, gate_up_interleaved=inter))
    return out


def _clamp_limits(region: set[fx.Node]) -> list[float]:
    found = []
    for node in region:
        if node.target in (aten.clamp.default, aten.clamp_max.default, aten.clamp_min.default):
            for arg in node.args[1:]:
                if isinstance(arg, (int, float)) and arg != 0:
                    found.append(abs(float(arg)))
    return list(dict.fromkeys(found))


def _mul_constants(region: set[fx.Node]) -> list[float]:
    found = []
    for node in region:
        if node.target in (aten.mul.Tensor, aten.mul.Scalar):
            for arg in node.args[1:]:
                if isinstance(arg, float) and arg not in (0.0, 1.0):
                    found.append(arg)
    return list(dict.fromkeys(found))


def experts_form(region: set[fx.Node]) -> str:
    names = {str(n.target) for n in region if n.op == "call_function"}
    if any("grouped_mm" in t for t in names):
        return "grouped_mm"
    if "aten.index_add.default" in names:
        return "loop (index_add)"
    if "aten.bmm.default" in names:
        return "batched_mm"
    if "aten.scatter_add.default" in names:
        return "loop (scatter_add)"
    return "other"


def region_of(nodes: set[fx.Node]) -> set[fx.Node]:
    return {n for n in nodes if n.op == "call_function"}


__all__ = ["ExpertsChoice", "WeightSource", "activation_candidates", "bias_layouts", "expert_inputs",
           "experts_form", "region_of", "val", "weight_layouts"]
