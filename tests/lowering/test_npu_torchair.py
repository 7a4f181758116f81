"""The GE path: the fused op decomposed into torch_npu ops, every emitted op checked against the
single converter list (npu_converters.py), the decomposed graph run under the emulation, and the
TorchAir wiring (modes, decompositions, the converter pre-pass)."""
import logging
import sys
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from moe_compile import fused_moe
from moe_compile.lowering.npu_converters import (
    ATEN_GE_CONVERTERS,
    TARGET_TORCH_NPU,
    npu_ge_converters,
    parse_version,
)
from moe_compile.lowering.torchair import (
    TorchAirMode,
    check_ge_convertible,
    compile_with_torchair,
    decompose_fused_moe_for_npu,
    make_torchair_backend,
    npu_decompositions,
    op_key,
    unconvertible_nodes,
)
from moe_compile.testing import emulated_npu

E, K, H, I = 16, 2, 16, 8
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

# every routing mode and activation the lowering distinguishes (the fallback routings included)
CONFIGS = {
    "softmax_renorm": dict(renormalize=True),
    "softmax_groups_scaled": dict(group_count=4, k_group=2, routed_scaling_factor=1.5),
    "deepseek_sigmoid_bias_groups": dict(routing_method="sigmoid", group_count=4, k_group=2, group_select_mode=1,
                                         bias_E=True, routed_scaling_factor=2.5),
    "sigmoid_unnormalised_groups": dict(routing_method="sigmoid", normalize_sigmoid=False, group_count=4,
                                        k_group=2, bias_E=True),
    "groups_too_small_fallback": dict(group_count=8, k_group=4),
    "deepseek_v4_sqrtsoftplus_fallback": dict(routing_method="sqrtsoftplus", bias_E=True, routed_scaling_factor=1.5,
                                              activation="silu_clamped"),
    "llama4": dict(routing_method="sigmoid", scoring_after_topk=True, normalize_sigmoid=False,
                   apply_router_weight_on_input=True, top_k=1),
    "gptoss_swigluoai_bias": dict(activation="swigluoai", gate_up_interleaved=True, biases=True, renormalize=True),
    "gelu": dict(activation="gelu"),
    "gelu_tanh_bias": dict(activation="gelu_tanh", biases=True),
    "relu2_no_mul": dict(activation="relu2_no_mul"),
}


def _case(name, dtype, num_tokens=7):
    spec = dict(CONFIGS[name])
    top_k = spec.pop("top_k", K)
    biases, bias_E = spec.pop("biases", False), spec.pop("bias_E", False)
    gated = not spec.get("activation", "silu").endswith("_no_mul")
    width = 2 * I if gated else I
    g = torch.Generator().manual_seed(len(name))
    tensors = [
        torch.randn(num_tokens, H, generator=g).to(dtype),
        torch.randn(num_tokens, E, generator=g).to(dtype),
        (torch.randn(E, width, H, generator=g) / H**0.5).to(dtype).transpose(1, 2),
        (torch.randn(E, I, H, generator=g) / I**0.5).to(dtype),
        (torch.randn(E, width, generator=g) * 0.1).to(dtype) if biases else None,
        (torch.randn(E, H, generator=g) * 0.1).to(dtype) if biases else None,
        torch.randn(E, generator=g) * 0.1 if bias_E else None,
    ]

    def fn(x, logits, w13, w2, b13=None, b2=None, bias=None, lowering="npu"):
        return fused_moe(x, logits, E, top_k, w13, w2, b13, b2, e_score_correction_bias=bias,
                         lowering=lowering, **spec)

    return fn, tensors


def _on_present(fn, tensors):
    """``fn`` as a function of the non-None tensors only, and those tensors."""
    mask = [t is not None for t in tensors]

    def call(*args, **kwargs):
        it = iter(args)
        return fn(*[next(it) if m else None for m in mask], **kwargs)

    return call, [t for t in tensors if t is not None]


def _trace(fn, tensors, **kwargs):
    call, present = _on_present(fn, tensors)
    return make_fx(call, tracing_mode="fake", **kwargs)(*present), present


def _npu_ops(gm):
    return {op_key(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and (op_key(n.target) or "").startswith("npu::")}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decomposed_graph_is_ge_convertible_and_matches_reference(name, dtype):
    fn, tensors = _case(name, dtype)
    gm, present = _trace(fn, tensors)
    assert [key for _, key, _ in unconvertible_nodes(gm)] == ["moe_compile::fused_moe.default"]
    with emulated_npu(poison=True) as npu:
        decompose_fused_moe_for_npu(gm)
        out = gm(*present)
    # every node, aten ones included, is in the converter list of the targeted torch_npu
    assert unconvertible_nodes(gm, strict_aten=True) == []
    emitted = _npu_ops(gm)
    assert emitted and emitted <= set(npu_ge_converters(TARGET_TORCH_NPU))
    assert {"npu::npu_moe_init_routing_v2.default", "npu::npu_grouped_matmul.default"} <= emitted
    assert npu.calls["npu_grouped_matmul"] == 2
    ref = fn(*tensors, lowering="cpu")
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_decomposition_table_gives_the_same_graph_ops():
    fn, tensors = _case("deepseek_sigmoid_bias_groups", torch.float32)
    with emulated_npu():
        gm, present = _trace(fn, tensors, decomposition_table=npu_decompositions())
        inlined, _ = _trace(fn, tensors)
        decompose_fused_moe_for_npu(inlined)
        assert torch.equal(gm(*present), inlined(*present))
    assert _npu_ops(gm) == _npu_ops(inlined) == {
        "npu::npu_moe_gating_top_k.default", "npu::npu_moe_init_routing_v2.default",
        "npu::npu_grouped_matmul.default", "npu::npu_swiglu.default"}


def test_symbolic_token_count_decomposes_and_runs_for_other_sizes():
    fn, present = _on_present(*_case("softmax_renorm", torch.float32))
    gm = make_fx(fn, tracing_mode="symbolic")(*present)
    with emulated_npu(poison=True):
        decompose_fused_moe_for_npu(gm)
        for num_tokens in (3, 11):
            _, other = _on_present(*_case("softmax_renorm", torch.float32, num_tokens=num_tokens))
            torch.testing.assert_close(gm(*other), fn(*other, lowering="cpu"), **TOL[torch.float32])


def test_dynamic_dispatcher_cannot_be_decomposed_for_ge():
    x, logits = torch.randn(4, H), torch.randn(4, E)
    w13, w2 = torch.randn(E, H, 2 * I), torch.randn(E, I, H)

    def fn(x, logits, w13, w2):
        return torch.ops.moe_compile.fused_moe(
            x, logits, w13, w2, None, None, None, num_experts=E, top_k=K, routing_method="softmax",
            renormalize=False, routed_scaling_factor=1.0, k_group=1, group_count=1, group_select_mode=0,
            normalize_sigmoid=True, scoring_after_topk=False, activation="silu", swiglu_alpha=1.702,
            swiglu_limit=7.0, gate_up_interleaved=False, apply_router_weight_on_input=False, tp_group_name=None,
            ep_group_name="ep", dispatcher_type="dynamic", tokens_full=True, reduce_results=True, lowering="npu")

    gm = make_fx(fn, tracing_mode="fake")(x, logits, w13, w2)
    with emulated_npu(), pytest.raises(ValueError, match="dynamic.*host sync"):
        decompose_fused_moe_for_npu(gm)


def test_check_names_ops_without_a_ge_converter():
    def fn(tokens, ids, probs):
        import torch_npu

        permuted, rev = torch_npu.npu_moe_token_permute(tokens, ids)
        out = torch_npu.npu_moe_token_unpermute(permuted, rev, probs=probs)
        return torch.sort(out, stable=True).values

    with emulated_npu():
        gm = make_fx(fn, tracing_mode="fake")(torch.randn(3, 4), torch.zeros(3, 2, dtype=torch.int32), torch.rand(3, 2))
    with pytest.raises(RuntimeError, match=r"npu::npu_moe_token_permute\.default.*\n.*npu_moe_token_unpermute"):
        check_ge_convertible(gm)
    check_ge_convertible(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))  # an empty graph passes
    strict = [key for _, key, _ in unconvertible_nodes(gm, strict_aten=True)]
    assert "aten::sort.stable" in strict  # TorchAir registers it only to raise "not supported"
    assert "aten::sort.stable" not in ATEN_GE_CONVERTERS


def test_version_parsing_and_older_versions_warn():
    assert parse_version("2.14.0.post3+git1a2b") == (2, 14, 0) and parse_version("2.15") == (2, 15, 0)
    with pytest.raises(ValueError, match="cannot parse"):
        parse_version("dev")
    assert npu_ge_converters("2.16.1") is npu_ge_converters((2, 14, 0))
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("moe_compile")  # registered with torch._logging: it does not propagate
    logger.addHandler(handler)
    try:
        npu_ge_converters("2.1.0")
    finally:
        logger.removeHandler(handler)
    assert any("older than every converter list" in r.getMessage() for r in records)


def test_mode_parsing():
    assert TorchAirMode.parse("npugraph_ex") is TorchAirMode.NPUGRAPH_EX
    with pytest.raises(ValueError, match="mode must be one of"):
        TorchAirMode.parse("ge")


def test_compile_with_torchair_needs_the_real_torch_npu():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(ImportError, match="emulated_npu"):
        compile_with_torchair(gm, [torch.randn(2)])
    with emulated_npu(), pytest.raises(RuntimeError, match="real torch_npu"):
        compile_with_torchair(gm, [torch.randn(2)])


class _FakeTorchAir(types.SimpleNamespace):
    """Stands in for torchair: its backend traces like AOT (with or without our decompositions, as a
    TorchAir that ignored them would) and then runs the post-grad pre-pass, as ``_optimize_fx`` does."""

    class CompilerConfig:
        def __init__(self):
            self.mode = "max-autotune"
            self.post_grad_custom_pre_pass = None

    def __init__(self, apply_decompositions=True):
        super().__init__(apply_decompositions=apply_decompositions)

    def get_npu_backend(self, *, compiler_config, custom_decompositions):
        self.config = compiler_config
        table = custom_decompositions if self.apply_decompositions else None

        def backend(fn, example_inputs):
            gm = make_fx(fn, decomposition_table=table, tracing_mode="fake")(*example_inputs)
            self.traced_ops = {op_key(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            compiler_config.post_grad_custom_pre_pass(gm, example_inputs, compiler_config)
            self.graph = gm
            return gm

        return backend


@pytest.mark.parametrize("mode", ["max-autotune", "npugraph_ex"])
@pytest.mark.parametrize("apply_decompositions", [True, False])
def test_backend_wiring_decomposes_and_checks(mode, apply_decompositions):
    fn, present = _on_present(*_case("gptoss_swigluoai_bias", torch.float32))
    torchair = _FakeTorchAir(apply_decompositions)
    seen = []
    with emulated_npu(poison=True):
        compiled = make_torchair_backend(torchair, mode, "2.14.0", moe_pass=seen.append)(fn, present)
        out = compiled(*present)
    assert torchair.config.mode == mode and len(seen) == 1 and isinstance(seen[0], torch.fx.Graph)
    assert ("moe_compile::fused_moe.default" in torchair.traced_ops) != apply_decompositions
    assert "npu::npu_grouped_matmul.default" in _npu_ops(torchair.graph)
    assert unconvertible_nodes(torchair.graph) == []
    torch.testing.assert_close(out, fn(*present, lowering="cpu"), **TOL[torch.float32])


def test_ge_pre_pass_rejects_an_unconvertible_graph_but_aclgraph_takes_it():
    def fn(tokens, ids):
        import torch_npu

        return torch_npu.npu_moe_token_permute(tokens, ids)[0]

    args = [torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.int32)]
    with emulated_npu():
        with pytest.raises(RuntimeError, match="npu_moe_token_permute"):
            make_torchair_backend(_FakeTorchAir(), "max-autotune", "2.14.0")(fn, args)
        make_torchair_backend(_FakeTorchAir(), "npugraph_ex", "2.14.0")(fn, args)
    assert "torch_npu" not in sys.modules


def test_mode_from_the_backend_config():
    from moe_compile.lowering.torchair import _mode_of
    from moe_compile.options import BackendConfig, TorchairMode

    assert _mode_of(BackendConfig(torchair_mode=TorchairMode.REDUCE_OVERHEAD)) is TorchAirMode.REDUCE_OVERHEAD
    assert _mode_of(BackendConfig()) is TorchAirMode.GE and _mode_of("npugraph_ex") is TorchAirMode.NPUGRAPH_EX


def test_inputs_a_pass_inserted_without_values_are_filled_in():
    fn, tensors = _case("softmax_renorm", torch.float32)
    x, logits, w13, w2 = tensors[:4]
    hf_w13 = w13.transpose(1, 2).contiguous()  # [E, 2I, H]

    def model(x, logits, hf_w13, w2):
        return fn(x, logits, hf_w13.transpose(1, 2), w2)

    gm = make_fx(model, tracing_mode="fake")(x, logits, hf_w13, w2)
    for node in gm.graph.nodes:
        if node.op == "call_function" and "transpose" in str(node.target):
            del node.meta["val"]  # as if a pass had inserted the view
    with emulated_npu():
        decompose_fused_moe_for_npu(gm)
        out = gm(x, logits, hf_w13, w2)
    torch.testing.assert_close(out, fn(x, logits, w13, w2, lowering="cpu"), **TOL[torch.float32])


def test_aot_eager_compile_runs_the_npu_lowering_inside_the_op():
    fn, present = _on_present(*_case("deepseek_sigmoid_bias_groups", torch.bfloat16))
    torch._dynamo.reset()
    try:
        with emulated_npu(poison=True) as npu:
            out = torch.compile(fn, backend="aot_eager", fullgraph=True)(*present)
    finally:
        torch._dynamo.reset()
    assert npu.calls["npu_moe_gating_top_k"] == 1 and npu.calls["npu_grouped_matmul"] == 2
    torch.testing.assert_close(out, fn(*present, lowering="cpu"), **TOL[torch.bfloat16])
