"""The backend's options, parsed once into a frozen config (strings only at this edge)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from moe_compile.ops.config import Lowering, parse_enum


class InnerCompiler(enum.Enum):
    INDUCTOR = "inductor"
    TORCHAIR = "torchair"
    AOT_EAGER = "aot_eager"
    EAGER = "eager"


class TorchairMode(enum.Enum):
    MAX_AUTOTUNE = "max-autotune"  # GE graph mode
    REDUCE_OVERHEAD = "reduce-overhead"  # aclgraph capture (npugraph_ex)


@dataclass(frozen=True)
class BackendConfig:
    inner_compiler: InnerCompiler | None = None  # None: torchair when lowering to NPU, else inductor
    lowering: Lowering = Lowering.AUTO
    exclude_paths: tuple[str, ...] = ()
    exclude_classes: tuple[type, ...] = ()
    verify: bool = False
    experts_only: bool = True  # routers the op cannot express stay; their experts become fused_experts
    cpu_decode: bool = True  # CPU + Inductor, fixed few tokens: the experts as gather-GEMVs in the graph
    pack_args: bool = True  # compiled graphs call the fused ops with their scalars packed (ops/packed.py)
    training: bool = True  # graphs that record autograd are rewritten too (training.py, ops/autograd.py)
    training_backward: str = "auto"  # "auto": traced into the graph where it can be; "op": the opaque backward op
    torchair_mode: TorchairMode = TorchairMode.MAX_AUTOTUNE
    ep_group: Any = field(default=None, compare=False)
    tp_group: Any = field(default=None, compare=False)
    dump_dir: str | None = None
    compile_mode: str | None = None  # torch.compile(mode=...), passed on to Inductor


    def resolved_inner(self, device_type: str) -> InnerCompiler:
        if self.inner_compiler is not None:
            return self.inner_compiler
        if self.lowering is Lowering.NPU or (self.lowering is Lowering.AUTO and device_type == "npu"):
            return InnerCompiler.TORCHAIR
        return InnerCompiler.INDUCTOR


VALID_OPTIONS = {
    "inner_compiler": "one of %s" % [m.value for m in InnerCompiler],
    "lowering": "one of %s" % [m.value for m in Lowering],
    "exclude": "a module-path glob (str), a module class, or a list of them",
    "verify": "a bool",
    "experts_only": "a bool (default True): where the op has no routing for a block's router, keep the router "
                    "as written and rewrite its experts alone into moe_compile::fused_experts",
    "cpu_decode": "a bool (default True): on the CPU under Inductor, a graph whose token count is fixed and whose "
                  "top-k pairs are no more than the experts computes the experts as gather-GEMVs that Inductor "
                  "compiles with the graph, instead of calling the op",
    "pack_args": "a bool (default True): the compiled graph calls the fused ops with their scalar arguments "
                 "packed into one string (moe_compile::fused_moe_packed: 8 arguments for the dispatcher to convert "
                 "per call instead of 28); False keeps the plain call",
    "training": "a bool (default True): graphs that record autograd (training) are rewritten too, the fused "
                "ops' backward recomputing the block in plain torch; False compiles them without the pass",
    "training_backward": "'auto' (default: the fused ops' backward traced into the graph as grouped GEMMs where "
                         "torch can trace them, bf16; else one opaque op) or 'op' (always the opaque op)",
    "torchair_mode": "one of %s" % [m.value for m in TorchairMode],
    "ep_group": "a torch.distributed.ProcessGroup",
    "tp_group": "a torch.distributed.ProcessGroup",
    "dump_dir": "a folder path (str) to write before/after graphs to",
    "mode": "a torch.compile mode for the inner compiler: 'default', 'reduce-overhead' (CUDA graphs), "
            "'max-autotune', 'max-autotune-no-cudagraphs' (torch.compile takes mode= or options=, not both)",
}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _exclude(value) -> tuple[tuple[str, ...], tuple[type, ...]]:
    items = value if isinstance(value, (list, tuple, set, frozenset)) else [value]
    paths, classes = [], []
    for item in items:
        if isinstance(item, str):
            paths.append(item)
        elif isinstance(item, type):
            classes.append(item)
        else:
            raise TypeError("options['exclude'] entries must be module-path globs (str) or module classes, "
                            "but got %s %r" % (type(item).__name__, item))
    return tuple(paths), tuple(classes)


def _group(name: str, value):
    if value is None:
        return None
    import torch.distributed as dist

    if dist.is_available() and value is dist.GroupMember.NON_GROUP_MEMBER:
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise ValueError("options[%r] is GroupMember.NON_GROUP_MEMBER: this rank (global rank %s) is not in "
                         "the group (torch.distributed.new_group returns that value on ranks outside it); "
                         "pass the group only on its member ranks" % (name, rank))
    if not (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        raise TypeError("options[%r] must be a torch.distributed.ProcessGroup, but got %s"
                        % (name, type(value).__name__))
    return value


def parse_options(options: dict | None) -> BackendConfig:
    if options is None:
        return BackendConfig()
    if isinstance(options, BackendConfig):
        return options
    if not isinstance(options, dict):
        raise TypeError("moe_npu options must be a dict, but got %s" % type(options).__name__)
    unknown = sorted(set(options) - set(VALID_OPTIONS))
    if unknown:
        valid = "; ".join("%s: %s" % kv for kv in VALID_OPTIONS.items())
        raise ValueError("unknown moe_npu option(s) %s; valid options are: %s" % (unknown, valid))
    kwargs: dict[str, Any] = {}
    if "inner_compiler" in options:
        kwargs["inner_compiler"] = parse_enum(InnerCompiler, options["inner_compiler"], "options['inner_compiler']")
    if "lowering" in options:
        kwargs["lowering"] = parse_enum(Lowering, options["lowering"], "options['lowering']")
    if "torchair_mode" in options:
        kwargs["torchair_mode"] = parse_enum(TorchairMode, options["torchair_mode"], "options['torchair_mode']")
    if "exclude" in options:
        kwargs["exclude_paths"], kwargs["exclude_classes"] = _exclude(options["exclude"])
    for name in ("verify", "experts_only", "cpu_decode", "pack_args", "training"):
        if name in options:
            if not isinstance(options[name], bool):
                raise TypeError("options[%r] must be a bool, but got %r" % (name, options[name]))
            kwargs[name] = options[name]
    for name in ("ep_group", "tp_group"):
        if name in options:
            kwargs[name] = _group(name, options[name])
    if "training_backward" in options:
        if options["training_backward"] not in ("auto", "op"):
            raise ValueError("options['training_backward'] must be 'auto' or 'op', but got %r"
                             % (options["training_backward"],))
        kwargs["training_backward"] = options["training_backward"]
    if "mode" in options:
        if options["mode"] not in COMPILE_MODES:
            raise ValueError("options['mode'] must be one of %s, but got %r" % (list(COMPILE_MODES), options["mode"]))
        kwargs["compile_mode"] = options["mode"]
    if "dump_dir" in options:
        if not isinstance(options["dump_dir"], str):
            raise TypeError("options['dump_dir'] must be a str, but got %r" % (options["dump_dir"],))
        kwargs["dump_dir"] = options["dump_dir"]
    return BackendConfig(**kwargs)
