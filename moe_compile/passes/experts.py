"""Expert recognition: find the expert weights a routed output depends on and how they are used.

The weights are the graph inputs in the routed output's slice: 3-D tensors ``[E, a, b]``
(HF 5.x ``gate_up_proj``/``down_proj``, gpt-fast, torchtitan), ``[E, n]`` biases, or ``E``
same-named 2-D Linear weights (``experts.<i>.w1.weight``: a ``ModuleList``). Each way of
reading them as the op's ``w13 [E, H, 2I]`` / ``w2 [E, I, H]`` (which tensor is which, transposed
or not, gate and up separate or concatenated, interleaved) and each activation is a candidate;
the structure (which activation ops appear, strided slices) orders the candidates.
"""
from __future__ import annotations

from collections import Counter

import itertools
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from moe_compile.ops.config import Activation, ExpertsConfig
from moe_compile.passes.graph import CAST_OPS, MATMUL_OPS, VIEW_OPS, aten, val

# a numeric component of a parameter name: ``experts.3.w1.weight``, Dynamo's ``..._experts_modules_3_...``
_NAME_NUMBER = re.compile(r"(?<=[._])\d+(?=[._]|$)")


@dataclass(frozen=True)
class WeightSource:
    """How one op-layout weight is made from graph inputs."""

    kind: str  # "node" | "stack" | "cat" | "scale"
    nodes: tuple  # graph nodes ("node"/"stack"), WeightSources ("cat"), (WeightSource, [E] node) ("scale")
    transpose: bool = False  # swap the last two dims (a view for "node")

    def real(self, values: dict) -> torch.Tensor:
        if self.kind == "scale":  # expert e's slice times scale[e] (experts_input.py), rounded once
            inner = self.nodes[0].real(values)
            scale = values[self.nodes[1]].reshape((-1,) + (1,) * (inner.dim() - 1))
            return (inner.float() * scale.float()).to(inner.dtype)
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
    cast: torch.dtype | None = None  # the dtype the graph casts the weights to for the matmuls (autocast)

    def describe(self) -> str:
        act = self.config.activation.value + (" interleaved" if self.config.gate_up_interleaved else "")
        if self.config.activation in (Activation.SWIGLU_OAI, Activation.SILU_CLAMPED):
            act += " (limit %g)" % self.config.swiglu_limit
        if self.w2.kind == "scale":
            act += " (per-expert scale folded into down_proj)"
        return act + (" (weights cast to %s)" % str(self.cast).replace("torch.", "") if self.cast else "")


def matmul_cast(region: set[fx.Node], weight_dtype: torch.dtype) -> torch.dtype | None:
    """The lower-precision floating dtype every expert matmul of the region computes in, when the
    weights are stored wider (``torch.autocast``: fp32 weights cast to bf16 before each matmul), else
    ``None``. The op then computes in that dtype, as the block does."""
    dtypes = set()
    for node in region:
        if is_expert_matmul(node):
            v = val(node)
            if isinstance(v, torch.Tensor):
                dtypes.add(v.dtype)
    if len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    if dtype.is_floating_point and dtype.itemsize < weight_dtype.itemsize:
        return dtype
    return None


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
    """Families of ``E`` same-shaped tensors whose names differ only in one numeric component, the
    expert index, which runs over exactly ``range(E)``. Any numeric component may be the index
    (``experts.3.0.weight`` of a ``Sequential``, ``experts.3.fc_1.weight``, ``layers.0.experts.3.w1``):
    every one is tried, the rightmost that gives a complete family first, and each tensor joins one
    family at most."""
    groups: dict[tuple[str, int], dict[int, fx.Node]] = {}
    for node in nodes:
        name = names.get(node, "")
        numbers = list(_NAME_NUMBER.finditer(name))
        for rank, match in enumerate(reversed(numbers)):  # rank 0: the rightmost number
            template = name[:match.start()] + "#" + name[match.end():]
            groups.setdefault((template, rank), {})[int(match.group())] = node
    complete = []
    for (template, rank), members in groups.items():
        if sorted(members) != list(range(num_experts)):
            continue
        ordered = tuple(members[i] for i in range(num_experts))
        if len({tuple(values[n].shape) for n in ordered}) == 1:
            complete.append((rank, template, ordered))
    out, taken = [], set()
    for _, _, ordered in sorted(complete, key=lambda c: c[:2]):
        if taken.isdisjoint(ordered):
            taken.update(ordered)
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


def is_gated(w13: WeightSource, w2: WeightSource, values: dict) -> bool:
    """Whether a (w13, w2) reading has a gate and an up half (``w13``'s width is twice ``w2``'s input)."""
    return _shape(w13, values)[1] == 2 * _shape(w2, values)[0]


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
        order = [Activation.SILU, Activation.GELU, Activation.GELU_TANH, Activation.SWIGLU_OAI,
                 Activation.SILU_CLAMPED]
        if aten.clamp.default in targets or aten.clamp_max.default in targets or aten.clamp_min.default in targets:
            clamped = [Activation.SWIGLU_OAI, Activation.SILU_CLAMPED]
            if aten.silu.default in targets:  # silu(clamp(g)) * clamp(u): no sigmoid(alpha * g), no u + 1
                clamped.reverse()
            order = clamped + [a for a in order if a not in clamped]
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
            elif act is Activation.SILU_CLAMPED:
                out += [ExpertsConfig(act, swiglu_limit=limit, gate_up_interleaved=inter) for limit in limits]
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


# -- why no reading matched (the skip reason) -------------------------------------------------
_REINDEX_OPS = VIEW_OPS | CAST_OPS | {
    aten.t.default, aten.permute.default, aten.transpose.int, aten.expand.default, aten.select.int,
    aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
}
_EXPERT_MM_OPS = MATMUL_OPS | {getattr(aten, name).default for name in ("_grouped_mm", "baddbmm")
                               if hasattr(aten, name)}


def is_expert_matmul(node: fx.Node) -> bool:
    """A matmul the experts may run: aten's, or transformers' own grouped-GEMM op
    (``transformers.grouped_mm_fallback``, what its fp32 ``grouped_mm`` experts become under Dynamo)."""
    return node.target in _EXPERT_MM_OPS or "grouped_mm" in str(node.target)


_ACTIVATION_NAMES = {
    aten.relu.default: "relu", aten.silu.default: "silu", aten.sigmoid.default: "sigmoid",
    aten.tanh.default: "tanh", aten.erf.default: "erf", aten.clamp.default: "clamp",
    aten.clamp_min.default: "clamp", aten.clamp_max.default: "clamp", aten.square.default: "square",
    aten.pow.Tensor_Scalar: "pow", aten.elu.default: "elu", aten.leaky_relu.default: "leaky_relu",
    aten.hardtanh.default: "hardtanh", aten.hardswish.default: "hardswish", aten.softplus.default: "softplus",
    aten.mish.default: "mish",
}
SUPPORTED_ACTIVATIONS = ("gated: silu, gelu, gelu_tanh, swigluoai, silu_clamped; non-gated: silu, gelu, relu, "
                         "relu2")


# the ops the supported activations show up as (swigluoai: sigmoid and clamps; gelu: erf or tanh; relu2: a square)
_GATED_OPS = {"silu", "gelu", "gelu(approximate='tanh')", "sigmoid", "clamp", "tanh", "erf"}
_NON_GATED_OPS = {"silu", "gelu", "relu", "square", "pow", "sigmoid", "erf"}


def unsupported_activations(names: list[str], gated: bool, non_gated: bool) -> bool:
    """Whether the activations seen fit none of the op's activations for the gated and/or
    non-gated readings of the weights (no activation at all fits none either)."""
    seen = set(names)
    return not seen or not ((gated and seen <= _GATED_OPS) or (non_gated and seen <= _NON_GATED_OPS))


def _in_order(slice_nodes: set[fx.Node]) -> list[fx.Node]:
    if not slice_nodes:
        return []
    graph = next(iter(slice_nodes)).graph
    return [n for n in graph.nodes if n in slice_nodes]


def computed_weights(slice_nodes: set[fx.Node], stop: set[fx.Node], values: dict, hidden: int) -> list[fx.Node]:
    """Tensors the graph computes from its weight inputs alone (``w13 + A @ B``: a LoRA merge) and that
    feed the experts: for each use by the block's computation, the nearest such node that is more
    than a view, cast, index or slice of a weight. ``[]`` when the experts read their weights as stored."""
    depends, weight_only, nearest = set(), set(), {}
    for node in _in_order(slice_nodes):
        inputs = node.all_input_nodes
        if node in stop or any(i in depends for i in inputs):
            depends.add(node)
        elif node.op in ("placeholder", "get_attr"):
            t = values.get(node)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1:
                weight_only.add(node)
        elif node.op == "call_function" and inputs and all(i in weight_only for i in inputs):
            weight_only.add(node)
            t = val(node)
            computed = (node.target not in _REINDEX_OPS and getattr(node.target, "__name__", "") != "getitem"
                        and isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2
                        and t.numel() >= hidden)
            nearest[node] = {node} if computed else set().union(*(nearest.get(i, set()) for i in inputs))
    found = []
    for node in _in_order(weight_only):
        if any(u in depends for u in node.users):
            found += [n for n in _in_order(nearest.get(node, set())) if n not in found]
    return found


def folded_weights(slice_nodes: set[fx.Node], values: dict, num_experts: int, hidden: int,
                   exclude: set[fx.Node]) -> list[fx.Node]:
    """2-D weight inputs that hold every expert in one matrix (``nn.Linear(H, E * 2I)``): one dim is the
    hidden size, the other a multiple of ``E`` larger than it, and no more than two inputs of that shape
    (more are one expert's pieces each, ``ModuleList`` experts, even with one of them missing or tied)."""
    candidates = []
    for node in _in_order(slice_nodes):
        t = values.get(node)
        if node in exclude or node.op not in ("placeholder", "get_attr") or not isinstance(t, torch.Tensor):
            continue
        if t.dim() == 2 and t.is_floating_point() and hidden in t.shape:
            other = t.shape[1] if t.shape[0] == hidden else t.shape[0]
            if other > num_experts and other % num_experts == 0:
                candidates.append(node)
    shapes = Counter(tuple(values[n].shape) for n in candidates)
    return [n for n in candidates if shapes[tuple(values[n].shape)] <= min(2, num_experts - 1)]


def activations_seen(slice_nodes: set[fx.Node], stop: set[fx.Node]) -> list[str]:
    """The activation ops applied after an expert matmul in the slice (not the router's: its matmul is
    a ``stop`` node), as ``relu`` / ``gelu(approximate='tanh')`` ..., in graph order."""
    after, names = set(), []
    for node in _in_order(slice_nodes):
        if node.op != "call_function" or node in stop:
            continue
        if is_expert_matmul(node) or any(i in after for i in node.all_input_nodes):
            after.add(node)
        name = _ACTIVATION_NAMES.get(node.target)
        if node.target is aten.gelu.default:
            approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
            name = "gelu" if approximate == "none" else "gelu(approximate=%r)" % approximate
        if name and node in after and name not in names:
            names.append(name)
    return names


def describe_sources(sources: list[WeightSource], values: dict) -> str:
    """``[8, 96, 32], 8 x [48, 32]`` for 3-D tensors and ``ModuleList`` weight families (one per expert)."""
    parts = []
    order = {n: i for i, n in enumerate(_in_order({s.nodes[0] for s in sources}))}
    for source in sorted(sources, key=lambda s: order[s.nodes[0]]):
        shape = list(values[source.nodes[0]].shape)
        parts.append("%d x %s" % (len(source.nodes), shape) if source.kind == "stack" else str(shape))
    return ", ".join(parts)


__all__ = ["ExpertsChoice", "SUPPORTED_ACTIVATIONS", "WeightSource", "activation_candidates", "activations_seen",
           "bias_layouts", "computed_weights", "describe_sources", "expert_inputs", "experts_form",
           "folded_weights", "is_gated", "region_of", "unsupported_activations", "val",
           "weight_layouts"]
