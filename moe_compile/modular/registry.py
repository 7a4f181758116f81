"""Registries of PrepareAndFinalize and experts types, with their capabilities.

Every type is registered under a name (its class name by convention, as in
``python -m moe_compile.tools.check --pf-type StandardPrepareAndFinalize --experts-type GroupedExperts``)
with a factory and what it can do. Adding a type is one call::

    register_experts(
        "TritonExperts", factory=lambda ctx: TritonExperts(ctx.experts_config),
        activation_format=ActivationFormat.STANDARD, dtypes=(torch.bfloat16, torch.float16),
        supports_chunking=True, supports_expert_map=True, device_types=("cuda",),
        requires=triton_available,  # () -> (ok, reason)
    )

or the decorator form on a class whose constructor takes the ``ExpertsConfig``
(``@experts_type(activation_format=..., ...)``). A module that registers types outside this file
adds its import path to ``PLUGIN_MODULES`` so :func:`load_plugins` finds it; such a module imports
optional dependencies (triton, torch_npu) only inside functions, so importing it never fails.

Two questions are kept apart:

- :func:`compatibility` — can the pair be composed at all (formats, a common dtype, a common
  device type)? ``(False, reason)`` for pairs that never work; :func:`compose` raises ``ValueError``
  with that reason.
- :func:`runnable` — can it run *here* (this device, installed packages, enough ranks)?
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from moe_compile.modular.base import ActivationFormat, Capability, PermuteExpertsUnpermute, PrepareAndFinalize
from moe_compile.modular.experts import BatchedExperts, GroupedExperts, ReferenceExperts
from moe_compile.modular.kernel import DEFAULT_CHUNK_SIZE, ModularKernel
from moe_compile.modular.prepare_finalize import BatchedPrepareAndFinalize, StandardPrepareAndFinalize
from moe_compile.ops.config import ExpertsConfig

log = logging.getLogger("moe_compile")

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ANY_DEVICE = ("cpu", "cuda", "npu")

# Modules that register more types when imported (added by the modules' authors).
PLUGIN_MODULES: list[str] = [
    "moe_compile.modular.distributed_pf",
    "moe_compile.kernels.triton.register",
]


@dataclass(frozen=True)
class BuildContext:
    """Everything a factory may need to build one component for one problem."""

    num_experts: int  # global
    num_local_experts: int
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    experts_config: ExpertsConfig = ExpertsConfig()
    max_num_tokens: int | None = None  # batched formats: per-expert capacity (None: the call's M)
    expert_map: torch.Tensor | None = None
    tp_group_name: str | None = None
    ep_group_name: str | None = None


def _always() -> Capability:
    return True, ""


@dataclass(frozen=True)
class PrepareFinalizeInfo:
    name: str
    factory: Callable[[BuildContext], PrepareAndFinalize]
    activation_format: ActivationFormat
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    device_types: tuple[str, ...] = ANY_DEVICE
    min_world_size: int = 1  # > 1 for PFs that need a process group to exist
    supports_apply_router_weight_on_input: bool = True
    requires: Callable[[], Capability] = field(default=_always, compare=False)


@dataclass(frozen=True)
class ExpertsInfo:
    name: str
    factory: Callable[[BuildContext], PermuteExpertsUnpermute]
    activation_format: ActivationFormat
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    supports_chunking: bool = True
    supports_expert_map: bool = True
    device_types: tuple[str, ...] = ANY_DEVICE
    requires: Callable[[], Capability] = field(default=_always, compare=False)


_PREPARE_FINALIZE: dict[str, PrepareFinalizeInfo] = {}
_EXPERTS: dict[str, ExpertsInfo] = {}


def register_prepare_finalize(name: str, *, replace: bool = False, **caps) -> PrepareFinalizeInfo:
    """Register a PrepareAndFinalize type (``caps``: the fields of :class:`PrepareFinalizeInfo`)."""
    return _register(_PREPARE_FINALIZE, PrepareFinalizeInfo(name=name, **caps), replace)


def register_experts(name: str, *, replace: bool = False, **caps) -> ExpertsInfo:
    """Register an experts type (``caps``: the fields of :class:`ExpertsInfo`)."""
    return _register(_EXPERTS, ExpertsInfo(name=name, **caps), replace)


def unregister_prepare_finalize(name: str) -> None:
    _PREPARE_FINALIZE.pop(name, None)


def unregister_experts(name: str) -> None:
    _EXPERTS.pop(name, None)


def experts_type(name: str | None = None, **caps):
    """Class decorator: register ``cls`` built as ``cls(ctx.experts_config)`` unless a factory is given."""
    def wrap(cls):
        caps.setdefault("factory", lambda ctx: cls(ctx.experts_config))
        register_experts(name or cls.__name__, **caps)
        return cls
    return wrap


def prepare_finalize_type(name: str | None = None, **caps):
    """Class decorator: register ``cls`` built as ``cls()`` unless a factory is given."""
    def wrap(cls):
        caps.setdefault("factory", lambda ctx: cls())
        register_prepare_finalize(name or cls.__name__, **caps)
        return cls
    return wrap


def _register(table: dict, info, replace: bool):
    if not isinstance(info.activation_format, ActivationFormat):
        raise TypeError(f"activation_format must be an ActivationFormat, but got {info.activation_format!r}")
    if info.name in table and not replace and table[info.name] != info:
        raise ValueError(f"{info.name!r} is already registered; pass replace=True to override it")
    table[info.name] = info
    return info


def load_plugins() -> None:
    """Import the modules in ``PLUGIN_MODULES`` (the ones not written yet are skipped)."""
    for module in PLUGIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise  # the module exists but imports something missing: a real error
            log.debug("registry: plugin module %s is absent", module)


def prepare_finalize_names() -> list[str]:
    load_plugins()
    return sorted(_PREPARE_FINALIZE)


def experts_names() -> list[str]:
    load_plugins()
    return sorted(_EXPERTS)


def get_prepare_finalize(name: str) -> PrepareFinalizeInfo:
    load_plugins()
    if name not in _PREPARE_FINALIZE:
        raise ValueError(f"unknown PrepareAndFinalize type {name!r}; valid: {sorted(_PREPARE_FINALIZE)}")
    return _PREPARE_FINALIZE[name]


def get_experts(name: str) -> ExpertsInfo:
    load_plugins()
    if name not in _EXPERTS:
        raise ValueError(f"unknown experts type {name!r}; valid: {sorted(_EXPERTS)}")
    return _EXPERTS[name]


def compatibility(pf_name: str, experts_name: str, *, dtype: torch.dtype | None = None,
                  device_type: str | None = None, expert_map: bool = False,
                  apply_router_weight_on_input: bool = False) -> Capability:
    """Whether the pair can be composed (for ``dtype``/``device_type``/options when given)."""
    pf, ex = get_prepare_finalize(pf_name), get_experts(experts_name)
    if pf.activation_format is not ex.activation_format:
        return False, (f"{pf.name} emits {pf.activation_format.value}-format activations but {ex.name} "
                       f"takes {ex.activation_format.value}-format ones")
    common_dtypes = [d for d in pf.dtypes if d in ex.dtypes]
    if not common_dtypes:
        return False, f"{pf.name} and {ex.name} share no dtype ({_names(pf.dtypes)} vs {_names(ex.dtypes)})"
    if dtype is not None and dtype not in common_dtypes:
        return False, f"{pf.name} x {ex.name} supports {_names(common_dtypes)}, not {dtype}"
    common_devices = [d for d in pf.device_types if d in ex.device_types]
    if not common_devices:
        return False, f"{pf.name} runs on {list(pf.device_types)} but {ex.name} on {list(ex.device_types)}"
    if device_type is not None and device_type not in common_devices:
        return False, f"{pf.name} x {ex.name} runs on {common_devices}, not {device_type}"
    if expert_map and not ex.supports_expert_map:
        return False, f"{ex.name} does not support an expert_map"
    if apply_router_weight_on_input and not pf.supports_apply_router_weight_on_input:
        return False, f"{pf.name} does not support apply_router_weight_on_input"
    return True, ""


def runnable(pf_name: str, experts_name: str, *, device: torch.device, world_size: int = 1) -> Capability:
    """Whether the pair can run here: device kind, installed packages, ranks."""
    ok, reason = compatibility(pf_name, experts_name, device_type=device.type)
    if not ok:
        return ok, reason
    pf, ex = get_prepare_finalize(pf_name), get_experts(experts_name)
    if world_size < pf.min_world_size:
        return False, f"{pf.name} needs >= {pf.min_world_size} ranks, but this run has {world_size}"
    for info in (pf, ex):
        ok, reason = info.requires()
        if not ok:
            return False, f"{info.name}: {reason}"
    return True, ""


def compose(pf_name: str, experts_name: str, ctx: BuildContext,
            chunk_size: int = DEFAULT_CHUNK_SIZE) -> ModularKernel:
    """Build the ModularKernel of a registered pair; ``ValueError`` with the reason if incompatible."""
    ok, reason = compatibility(pf_name, experts_name, dtype=ctx.dtype, device_type=ctx.device.type,
                               expert_map=ctx.expert_map is not None,
                               apply_router_weight_on_input=ctx.experts_config.apply_router_weight_on_input)
    if not ok:
        raise ValueError(f"incompatible modular kernel components: {reason}")
    pf = get_prepare_finalize(pf_name).factory(ctx)
    experts = get_experts(experts_name).factory(ctx)
    return ModularKernel(pf, experts, chunk_size=chunk_size)


def _names(dtypes) -> list[str]:
    return [str(d).replace("torch.", "") for d in dtypes]


# -- the built-in single-device types -----------------------------------------------------------
register_prepare_finalize(
    "StandardPrepareAndFinalize", factory=lambda ctx: StandardPrepareAndFinalize(),
    activation_format=ActivationFormat.STANDARD,
)
register_prepare_finalize(
    "BatchedPrepareAndFinalize",
    factory=lambda ctx: BatchedPrepareAndFinalize(ctx.num_local_experts, ctx.max_num_tokens, ctx.expert_map),
    activation_format=ActivationFormat.BATCHED,
)
register_experts(
    "ReferenceExperts", factory=lambda ctx: ReferenceExperts(ctx.experts_config),
    activation_format=ActivationFormat.STANDARD, supports_chunking=True, supports_expert_map=True,
)
register_experts(
    "GroupedExperts", factory=lambda ctx: GroupedExperts(ctx.experts_config),
    activation_format=ActivationFormat.STANDARD, supports_chunking=True, supports_expert_map=True,
)
register_experts(
    "BatchedExperts", factory=lambda ctx: BatchedExperts(ctx.experts_config),
    activation_format=ActivationFormat.BATCHED, supports_chunking=False, supports_expert_map=True,
)
