"""Hand a graph holding the fused MoE op to TorchAir (notes §3): GE mode by default, aclgraph by option.

::

    compiled = compile_with_torchair(gm, example_inputs, mode="max-autotune")   # GE graph mode
    compiled = compile_with_torchair(gm, example_inputs, mode="npugraph_ex")    # aclgraph capture

The fused op has no GE converter, so TorchAir gets ``custom_decompositions`` that trace each
``moe_compile::fused_moe`` / ``fused_experts`` node through the NPU lowering into torch_npu ops
(``npu_decompose.py``), and a ``post_grad_custom_pre_pass`` that runs the MoE pass (when given),
inlines every fused node then present and, in GE mode, checks that every node has a GE converter,
failing with the op's name instead of a GE error deep inside conversion. ``torch_npu`` /
``torchair`` are imported only here, on demand.
"""
from __future__ import annotations

import enum
import logging

import torch
import torch.fx as fx

from moe_compile.lowering.npu_converters import ATEN_GE_CONVERTERS, NO_GE_CONVERTER, npu_ge_converters
from moe_compile.lowering.npu_decompose import decompose_fused_moe_for_npu, npu_decompositions

log = logging.getLogger("moe_compile")

__all__ = [
    "TorchAirMode", "check_ge_convertible", "compile_with_torchair", "decompose_fused_moe_for_npu",
    "make_pre_pass", "make_torchair_backend", "npu_decompositions", "unconvertible_nodes",
]

# Namespaces whose every op must be in our converter lists. Other aten ops are TorchAir's business
# unless strict_aten=True (the MoE graph itself is checked strictly in the tests).
_CHECKED_NAMESPACES = ("npu", "moe_compile", "_c10d_functional")


class TorchAirMode(enum.Enum):
    GE = "max-autotune"  # Ascend IR / GE graph: every node needs a converter
    REDUCE_OVERHEAD = "reduce-overhead"  # aclgraph capture (deprecated name in 2.14)
    NPUGRAPH_EX = "npugraph_ex"  # aclgraph capture

    @classmethod
    def parse(cls, mode) -> "TorchAirMode":
        if isinstance(mode, cls):
            return mode
        for member in cls:
            if member.value == mode:
                return member
        raise ValueError(f"mode must be one of {[m.value for m in cls]}, but got {mode!r}.")


def op_key(target) -> str | None:
    """``"namespace::name.overload"`` for an OpOverload, else None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return f"{target._schema.name}.{target._overloadname}"


def unconvertible_nodes(gm: fx.GraphModule, torch_npu_version=None, *, strict_aten: bool = False):
    """``[(node name, op, why)]`` for the nodes GE mode could not convert."""
    npu_ops = npu_ge_converters(torch_npu_version)
    problems = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        key = op_key(node.target)
        if key is None:
            continue  # operator.getitem and friends: TorchAir handles them
        namespace = key.split("::", 1)[0]
        if namespace == "moe_compile":
            problems.append((node.name, key, "the fused op itself; run decompose_fused_moe_for_npu first"))
        elif namespace == "npu" and key not in npu_ops:
            base = key.rsplit(".", 1)[0]
            why = NO_GE_CONVERTER.get(base, "not in the GE converter list of this torch_npu version")
            problems.append((node.name, key, f"no GE converter: {why}"))
        elif namespace in _CHECKED_NAMESPACES[2:] or (strict_aten and namespace == "aten"):
            if key not in ATEN_GE_CONVERTERS:
                problems.append((node.name, key, "no GE converter known for this overload"))
    return problems


def check_ge_convertible(gm: fx.GraphModule, torch_npu_version=None, *, strict_aten: bool = False) -> None:
    """Raise a RuntimeError naming every op of ``gm`` that TorchAir's GE mode cannot convert."""
    problems = unconvertible_nodes(gm, torch_npu_version, strict_aten=strict_aten)
    if problems:
        lines = "\n".join(f"  {name}: {op} ({why})" for name, op, why in problems)
        raise RuntimeError(f"TorchAir GE mode cannot convert {len(problems)} node(s) of the lowered graph:\n{lines}\n"
                           f"Use mode='npugraph_ex' (aclgraph, no converters needed) or avoid these ops.")


def _mode_of(mode_or_config) -> TorchAirMode:
    """A mode string / TorchAirMode, or the backend's config (anything with ``.torchair_mode``)."""
    mode = getattr(mode_or_config, "torchair_mode", mode_or_config)
    return TorchAirMode.parse(getattr(mode, "value", mode))


def make_pre_pass(mode, torch_npu_version, moe_pass=None):
    """TorchAir's ``post_grad_custom_pre_pass``: MoE rewrite, then decomposition, then (GE) the check."""
    mode = TorchAirMode.parse(mode)

    def pre_pass(gm, example_inputs=None, config=None):
        if moe_pass is not None:
            moe_pass(gm.graph)
            gm.recompile()
        decompose_fused_moe_for_npu(gm)
        if mode is TorchAirMode.GE:
            check_ge_convertible(gm, torch_npu_version)

    return pre_pass


def make_torchair_backend(torchair, mode, torch_npu_version, moe_pass=None):
    """A TorchAir backend for ``mode``: our decompositions and a pre-pass (MoE rewrite, inline, GE check).

    The fused ops present at AOT time are decomposed by ``custom_decompositions``; the ones the MoE
    pass inserts afterwards (it runs on the post-grad graph) are inlined by the pre-pass.
    """
    mode = TorchAirMode.parse(mode)
    config = torchair.CompilerConfig()
    config.mode = mode.value
    if hasattr(config, "post_grad_custom_pre_pass"):
        config.post_grad_custom_pre_pass = make_pre_pass(mode, torch_npu_version, moe_pass)
    elif moe_pass is not None:
        raise RuntimeError("this torchair.CompilerConfig has no post_grad_custom_pre_pass, so the MoE pass "
                           "cannot run before TorchAir converts the graph")
    else:
        log.warning("torchair.CompilerConfig has no post_grad_custom_pre_pass: the GE converter check is skipped")
    return torchair.get_npu_backend(compiler_config=config, custom_decompositions=npu_decompositions())


def real_torch_npu():
    """torch_npu, or the error that TorchAir cannot run here (ImportError without torch_npu; a
    RuntimeError under the CPU emulation). The backend asks first, so a missing prerequisite is
    not reported as a failure of the MoE pass."""
    from moe_compile.lowering.npu_routing import import_torch_npu
    from moe_compile.testing.emulated_npu import is_emulated_torch_npu

    torch_npu = import_torch_npu()
    if is_emulated_torch_npu(torch_npu):
        raise RuntimeError("TorchAir needs the real torch_npu (with CANN); the CPU emulation cannot compile "
                           "through it. Use inner_compiler='aot_eager' under emulated_npu().")
    return torch_npu


def compile_with_torchair(gm: fx.GraphModule, example_inputs, mode="max-autotune", moe_pass=None):
    """Compile a Dynamo graph with TorchAir; returns the compiled callable.

    ``mode``: ``"max-autotune"`` (GE, default), ``"reduce-overhead"`` / ``"npugraph_ex"`` (aclgraph),
    or the backend's config (its ``torchair_mode`` is used). ``moe_pass``: called on the post-grad
    aten graph (``moe_pass(gm.graph)``) before the fused ops are decomposed.
    """
    mode = _mode_of(mode)
    torch_npu = real_torch_npu()
    import torchair  # installed by torch_npu.dynamo as a lazy proxy (notes §3.1)

    log.info("compiling with TorchAir mode=%s (torch_npu %s)", mode.value, torch_npu.__version__)
    return make_torchair_backend(torchair, mode, torch_npu.__version__, moe_pass)(gm, example_inputs)
