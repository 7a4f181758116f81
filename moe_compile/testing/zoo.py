"""Test subjects for the ``moe_npu`` pass: tiny random Hugging Face MoE models, nothing downloaded.

Usage::

    model, kwargs = build_model("mixtral", experts_implementation="batched_mm", dtype=torch.bfloat16)
    model(**kwargs)
    moe_block_paths(model)  # ['model.layers.0.mlp', 'model.layers.1.mlp']

``MOE_FAMILIES`` maps a name to its :class:`FamilySpec` (config, model class, MoE block classes,
MoE layer count, experts implementations, router kind, and whether the fused op can express it).
transformers is imported inside the functions that need it.
"""
from __future__ import annotations

import dataclasses
import logging
import types

import torch

from moe_compile.testing.zoo_extra import EXTRA_FAMILIES
from moe_compile.testing.zoo_families import CORE_FAMILIES
from moe_compile.testing.zoo_more import MORE_FAMILIES
from moe_compile.testing.zoo_recent import DEEPSEEK_LIKE_FAMILIES, MULTIMODAL_FAMILIES, RECENT_FAMILIES
from moe_compile.testing.zoo_spec import ExpertsImpl, FamilySpec, capture_map

logger = logging.getLogger("moe_compile")

MOE_FAMILIES: types.MappingProxyType = types.MappingProxyType(
    {spec.name: spec for spec in CORE_FAMILIES + MORE_FAMILIES + EXTRA_FAMILIES + MULTIMODAL_FAMILIES
     + RECENT_FAMILIES + DEEPSEEK_LIKE_FAMILIES}
)
# The families issue 3 names explicitly.
CORE_FAMILY_NAMES = tuple(spec.name for spec in CORE_FAMILIES)

PARAM_STD = 0.1  # N(0, 0.1^2): router logits spread ~0.8 at hidden 64, so routing is non-degenerate
SELECTION_BIAS_STD = 0.02  # correction biases only steer selection; larger would route by bias alone
_SELECTION_BIAS_NAMES = ("e_score_correction_bias", "expert_bias")


def get_family(name: str) -> FamilySpec:
    """The family's spec, as the installed transformers builds it: a family whose experts class a newer
    transformers decorated with ``@use_experts_implementation`` (step3p7 and longcat_flash in 5.25) takes the
    decorated families' implementations and captures (``grouped_mm`` first, one graph)."""
    if name not in MOE_FAMILIES:
        raise ValueError(f"model_type must be one of {sorted(MOE_FAMILIES)}, but got {name!r}.")
    return _as_installed(MOE_FAMILIES[name])


_INSTALLED: dict[str, FamilySpec] = {}


def _as_installed(spec: FamilySpec) -> FamilySpec:
    if spec.name not in _INSTALLED:
        switched = not spec.decorated and _can_set_experts(spec) is True
        _INSTALLED[spec.name] = dataclasses.replace(
            spec, experts_impls=(ExpertsImpl.GROUPED_MM, ExpertsImpl.BATCHED_MM, ExpertsImpl.EAGER),
            capture=capture_map(decorated=True)) if switched else spec
    return _INSTALLED[spec.name]


def _can_set_experts(spec: FamilySpec) -> bool | None:
    """What the installed transformers' model class says (``None``: it has no such method, or no such class)."""
    try:
        import transformers

        model_cls = getattr(transformers, spec.model_class, None)
    except ImportError:
        return None
    can_set = getattr(model_cls, "_can_set_experts_implementation", None)
    return bool(can_set()) if callable(can_set) else None


def is_available(model_type: str, experts_implementation=None) -> tuple[bool, str]:
    """Whether the installed transformers has the family's classes (and can switch its experts to
    ``experts_implementation``, when one other than ``"native"`` is given), and why not.

    The zoo targets transformers 5.24; older installs (the GPU machine has 5.17) lack a few
    families (bailing_hybrid, flint, lara_mini, kolibri1, beam in 5.17), and some of their
    families' experts take no implementation switch yet (aria_text in 5.17).
    """
    spec = get_family(model_type)
    try:
        import transformers
    except ImportError:
        return False, "transformers is not installed"
    missing = [name for name in (spec.config_class, spec.model_class) if not hasattr(transformers, name)]
    if missing:
        return False, "transformers %s has no %s" % (transformers.__version__, ", ".join(missing))
    impl = _parse_impl(spec, experts_implementation)
    if impl is not None and impl is not ExpertsImpl.NATIVE and not experts_switchable(model_type):
        return False, "transformers %s's %s does not take an experts implementation" % (
            transformers.__version__, spec.model_class)
    return True, ""


def experts_switchable(model_type: str) -> bool:
    """Whether the installed transformers lets the family's model switch its experts implementation
    (its modeling code uses ``@use_experts_implementation``)."""
    spec = get_family(model_type)
    can_set = _can_set_experts(spec)
    return spec.decorated if can_set is None else can_set


def _parse_impl(spec: FamilySpec, experts_implementation) -> ExpertsImpl | None:
    if experts_implementation is None:
        return None
    valid = [impl.value for impl in spec.experts_impls]
    value = experts_implementation.value if isinstance(experts_implementation, ExpertsImpl) else experts_implementation
    if value not in valid:
        raise ValueError(
            f"experts_implementation for {spec.name!r} must be one of {valid} (or None), "
            f"but got {experts_implementation!r}."
        )
    return ExpertsImpl(value)


def _cycled(values, count: int) -> list:
    return [values[i % len(values)] for i in range(count)]


def build_config(model_type: str, *, num_layers: int | None = None):
    """The tiny transformers config of ``model_type`` (a registry name), with ``num_layers`` layers."""
    import transformers

    spec = get_family(model_type)
    kwargs = dict(spec.config_kwargs)
    if spec.layers_key != "num_hidden_layers":
        # An alias (or, in LongCat, a setter halving it) of layers_key there: it must not override it.
        kwargs.pop("num_hidden_layers", None)
    if num_layers is not None:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, but got {num_layers!r}.")
        kwargs[spec.layers_key] = num_layers
        if spec.seq2seq:
            _scale_seq2seq_layers(kwargs, num_layers)
    for key in spec.per_layer_keys:
        kwargs[key] = _cycled(kwargs[key], kwargs[spec.layers_key])
    return getattr(transformers, spec.config_class)(**kwargs)


def _scale_seq2seq_layers(kwargs: dict, num_layers: int) -> None:
    """Encoder-decoder families: ``num_layers`` applies to the encoder and the decoder alike."""
    for key in ("num_decoder_layers", "num_sparse_encoder_layers", "num_sparse_decoder_layers",
                "encoder_layers", "decoder_layers"):
        if key in kwargs:
            kwargs[key] = num_layers


def expected_moe_layers(model_type: str, num_layers: int | None = None) -> int:
    """How many blocks of the family's block classes the tiny build with ``num_layers`` holds."""
    spec = get_family(model_type)
    layers = spec.default_layers if num_layers is None else num_layers
    return spec.num_moe_layers * layers // spec.default_layers


@torch.no_grad()
def redraw_parameters(model: torch.nn.Module, *, seed: int = 0) -> None:
    """Re-draw the weights so routing is non-degenerate: N(0, 0.1^2) everywhere except norms.

    Norm weights keep their init (ones, or zeros for zero-centred ``1 + w`` norms) so activations
    keep their scale; correction biases (``e_score_correction_bias``, ``expert_bias``, parameters
    or buffers) get N(0, 0.02^2); a hash layer's token-to-expert table (``tid2eid [vocab, k]``,
    zeros until a checkpoint fills it) gets k distinct experts per token, as a trained table has.
    Other buffers (rotary frequencies, masks) are left alone. Draws are made in fp32 from one seeded
    generator in registration order, so every dtype gets the same weights.
    """
    gen = torch.Generator().manual_seed(seed)
    for module_name, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if name == "tid2eid" and tensor is not None and tensor.dim() == 2:
                num_experts = getattr(module, "num_experts", tensor.shape[1])
                rows = torch.rand(tensor.shape[0], num_experts, generator=gen).argsort(dim=1)[:, :tensor.shape[1]]
                tensor.copy_(rows.to(tensor.dtype))
                continue
            if tensor is None or not tensor.is_floating_point():
                continue
            if name in _SELECTION_BIAS_NAMES:
                std = SELECTION_BIAS_STD
            elif isinstance(tensor, torch.nn.Parameter) and not is_norm and "norm" not in name:
                std = PARAM_STD
            else:
                continue
            draw = torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * std
            tensor.copy_(draw.to(tensor.dtype))


def first_tensor(out):
    """The main tensor of a model's output: ``logits`` / ``last_hidden_state``, else the first element."""
    for attr in ("logits", "last_hidden_state"):
        value = getattr(out, attr, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)):
        return first_tensor(out[0])
    return out


def build_inputs(model_type: str, num_tokens: int = 5, batch: int = 1, *, seed: int = 0) -> dict:
    """Example forward kwargs: ``input_ids`` LongTensor [batch, num_tokens] avoiding special ids 0-2."""
    spec = get_family(model_type)
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int, but got {num_tokens!r}.")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, but got {batch!r}.")
    vocab = spec.config_kwargs["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, num_tokens), generator=gen)
    if spec.seq2seq:
        return {"input_ids": ids, "decoder_input_ids": ids.flip(-1).contiguous()}
    return {"input_ids": ids}


def build_model(
    model_type: str,
    *,
    experts_implementation=None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_layers: int | None = None,
    num_tokens: int = 5,
) -> tuple[torch.nn.Module, dict]:
    """A tiny eval-mode model of ``model_type`` with re-drawn weights, and example forward kwargs.

    ``experts_implementation`` is one of the family's ``experts_impls`` values (``"grouped_mm"``,
    ``"batched_mm"``, ``"eager"`` for decorated families, ``"native"`` otherwise) or None for the
    transformers default. ``num_layers`` None keeps the family's default (2; LongCat 1).
    """
    import transformers

    spec = get_family(model_type)
    impl = _parse_impl(spec, experts_implementation)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, but got {dtype!r}.")
    available, why = is_available(model_type, impl)
    if not available:
        raise RuntimeError(f"cannot build {model_type!r}: {why}")
    config = build_config(model_type, num_layers=num_layers)
    model_cls = getattr(transformers, spec.model_class)
    model = model_cls._from_config(config, dtype=dtype)
    redraw_parameters(model, seed=seed)
    model.eval()
    if impl is not None and impl is not ExpertsImpl.NATIVE:
        model.set_experts_implementation(impl.value)
    logger.debug("built %s (%s) impl=%s dtype=%s", spec.name, spec.model_class, impl, dtype)
    return model, build_inputs(model_type, num_tokens=num_tokens, seed=seed)


def moe_block_paths(model: torch.nn.Module, model_type: str | None = None) -> list[str]:
    """Module paths of the MoE blocks, by the registry's block class names.

    ``model_type`` is a family name or a hand-written block style of ``zoo_blocks.BLOCK_STYLES``;
    with None every registered block class counts (any zoo model works).
    """
    from moe_compile.testing.zoo_blocks import BLOCK_STYLES

    if model_type is None:
        classes = {name for spec in MOE_FAMILIES.values() for name in spec.block_classes}
        classes |= {style.block_class.__name__ for style in BLOCK_STYLES.values()}
    elif model_type in BLOCK_STYLES:
        classes = {BLOCK_STYLES[model_type].block_class.__name__}
    else:
        classes = set(get_family(model_type).block_classes)
    return [path for path, module in model.named_modules() if type(module).__name__ in classes]


def families(*, expressible: bool | None = None, impl=None, core_only: bool = False) -> list[str]:
    """Registry names, filtered by expressibility, by an experts implementation, or to the core list."""
    names = CORE_FAMILY_NAMES if core_only else tuple(MOE_FAMILIES)
    out = []
    for name in names:
        spec = get_family(name)
        if expressible is not None and spec.expressible != expressible:
            continue
        if impl is not None and ExpertsImpl(impl) not in spec.experts_impls:
            continue
        out.append(name)
    return out


def family_impl_pairs(*, core_only: bool = False) -> list[tuple[str, str]]:
    """Every (family, experts implementation) the zoo can build."""
    names = CORE_FAMILY_NAMES if core_only else tuple(MOE_FAMILIES)
    return [(name, impl.value) for name in names for impl in get_family(name).experts_impls]
