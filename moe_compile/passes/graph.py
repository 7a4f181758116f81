"""FX graph helpers for the MoE pass: module paths, slices, concrete shapes and a partial evaluator.

The pass works on the aten-level, functionalised inference graph (what AOTAutograd hands a
forward compiler, or Inductor's post-grad graph). Placeholders map 1:1 onto the real example
inputs Dynamo gave the backend, so a slice of the graph can be evaluated on real weights.
"""
from __future__ import annotations

import operator
import re
import sys

import sympy
import torch
import torch.fx as fx

aten = torch.ops.aten

VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.squeeze.dim, aten.unsqueeze.default,
    aten.squeeze.default, aten.flatten.using_ints,
}
CAST_OPS = {torch.ops.prims.convert_element_type.default, aten._to_copy.default}
MATMUL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default, aten.linear.default}
if hasattr(aten.mm, "dtype"):  # torch.mm(a, b, out_dtype=torch.float32): a bf16 router with fp32 logits (CUDA only)
    MATMUL_OPS.add(aten.mm.dtype)
SIDE_EFFECT_OPS = {aten._assert_scalar.default, aten._assert_async.msg, aten._assert_async.default,
                   aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default}


def module_path(node: fx.Node) -> str:
    """The innermost module path of a node, normalised to ``a.b.0.c`` (``""`` when unknown)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    raw = list(stack.values())[-1][0]
    return normalise_path(raw)


def module_class(node: fx.Node) -> type | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    cls = list(stack.values())[-1][1]
    return resolve_class(cls) if isinstance(cls, str) else cls


def module_stack(node: fx.Node) -> list[tuple[str, type | None]]:
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for raw, cls in stack.values():
        if isinstance(cls, str):
            cls = resolve_class(cls)
        out.append((normalise_path(raw), cls))
    return out


def resolve_class(qualified: str) -> type | None:
    """The class a ``torch.export`` module stack names (``"pkg.mod.Class"``) when its module is imported, else
    ``None`` (nothing is imported here)."""
    module_name, _, name = qualified.rpartition(".")
    obj = sys.modules.get(module_name)
    for part in name.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def normalise_path(raw: str) -> str:
    path = re.sub(r"^L\['[^']*'\]\.?", "", str(raw))
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.strip(".")


def parent_path(path: str) -> str | None:
    if not path:
        return None
    return path.rsplit(".", 1)[0] if "." in path else ""


def in_scope(node: fx.Node, scope: str) -> bool:
    path = module_path(node) or _inherited_path(node)
    return scope == "" or path == scope or path.startswith(scope + ".")


def _inherited_path(node: fx.Node, depth: int = 3) -> str:
    """A node some pass added without module metadata (AOTAutograd's tensorified scalars under
    ``dynamic=True``: ``weights * scale`` on a 0-d tensor input) belongs where its inputs do: the
    first input path found, breadth first, ``depth`` steps up at most."""
    frontier = [node]
    for _ in range(depth):
        frontier = [i for n in frontier for i in node_inputs(n) if i.op == "call_function"]
        for inp in frontier:
            path = module_path(inp)
            if path:
                return path
    return ""


def node_inputs(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def backward_slice(outputs: list[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
    """Every node ``outputs`` depend on, not crossing the ``stop`` nodes (which are included)."""
    seen: set[fx.Node] = set()
    todo = list(outputs)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in stop:
            continue
        todo.extend(node_inputs(node))
    return seen


def forward_slice(root: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [root]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(node.users)
    return seen


def val(node: fx.Node):
    return node.meta.get("val", node.meta.get("example_value"))


def is_float_tensor_node(node: fx.Node) -> bool:
    v = val(node)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


class Concretizer:
    """Substitutes Dynamo's example values for the graph's symbolic sizes."""

    def __init__(self, placeholders: list[fx.Node], real_inputs: list):
        self.subs: dict[sympy.Symbol, int] = {}
        for node, real in zip(placeholders, real_inputs):
            v = val(node)
            if isinstance(v, torch.SymInt) and isinstance(real, int):
                self._bind(v, real)
            elif isinstance(v, torch.Tensor) and isinstance(real, torch.Tensor) and v.dim() == real.dim():
                for sym, size in zip(v.shape, real.shape):
                    if isinstance(sym, torch.SymInt):
                        self._bind(sym, int(size))

    def _bind(self, sym: torch.SymInt, value: int) -> None:
        expr = sym.node.expr
        if isinstance(expr, sympy.Symbol):
            self.subs[expr] = value

    def int(self, size) -> int | None:
        if isinstance(size, int):
            return size
        expr = size.node.expr if isinstance(size, torch.SymInt) else size
        out = sympy.sympify(expr).subs(self.subs)
        return int(out) if out.is_number else None

    def shape(self, node: fx.Node) -> tuple[int, ...] | None:
        v = val(node)
        if not isinstance(v, torch.Tensor):
            return None
        dims = [self.int(s) for s in v.shape]
        return None if any(d is None for d in dims) else tuple(dims)


class SliceEvaluator:
    """Evaluates the nodes of a slice in graph order with some values overridden (the probe)."""

    def __init__(self, graph: fx.Graph, placeholders: list[fx.Node], real_inputs: list,
                 owning_module: torch.nn.Module | None, conc: "Concretizer | None" = None):
        self.order = {node: i for i, node in enumerate(graph.nodes)}
        self.base = dict(zip(placeholders, real_inputs))
        self.module = owning_module
        self.conc = conc or Concretizer(placeholders, real_inputs)

    def _concrete(self, value):
        """Symbolic sizes baked into args become the example's ints, without guarding on them
        (evaluating a SymInt against a real tensor would specialise the compiled graph)."""
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            out = sympy.sympify(value.node.expr).subs(self.conc.subs)
            if isinstance(value, torch.SymInt):
                return int(out)
            return float(out) if isinstance(value, torch.SymFloat) else bool(out)
        return value

    def run(self, needed: set[fx.Node], overrides: dict[fx.Node, object], wanted: list[fx.Node]) -> list:
        env = dict(self.base)
        env.update(overrides)
        for node in sorted(needed, key=self.order.__getitem__):
            if node in env:
                continue
            if node.op == "get_attr":
                env[node] = _fetch_attr(self.module, node.target)
            elif node.op == "call_function":
                args = fx.node.map_aggregate(fx.node.map_arg(node.args, env.__getitem__), self._concrete)
                kwargs = fx.node.map_aggregate(fx.node.map_arg(node.kwargs, env.__getitem__), self._concrete)
                env[node] = node.target(*args, **kwargs)
            elif node.op == "placeholder":
                raise KeyError(f"placeholder {node.name} has no value")
            else:
                raise NotImplementedError(f"cannot evaluate {node.op} node {node.name}")
        return [env[w] for w in wanted]


def _fetch_attr(module, target: str):
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def is_getitem(node: fx.Node, index: int | None = None) -> bool:
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    return index is None or node.args[1] == index
