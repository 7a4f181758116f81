"""Whole tiny transformers models under ``backend="moe_npu"`` with ``mode="reduce-overhead"`` and
``dynamic=True``, the way a user would deploy them: on the GPU (skipped without CUDA; CUDA graphs,
one per shape) and, for one model, on the CPU (no graphs there), which also checks the test itself.

``dynamic=True`` makes Dynamo trace the token count symbolically from the start, which sends
AOTAutograd's restart request (``TensorifyScalarRestartAnalysis``) through the backend and turns
Python floats into graph inputs.

On the GPU in bf16, at the bf16 tolerance (2e-2 of the output's magnitude), against eager *or*
against the same model compiled the same way without our backend (plain Inductor). On these tiny random models a
router logit one bf16 ulp from the next expert's flips the expert choice under one rounding and
not the other: on the H200 (eighteenth session) the 17-token input of ``qwen3_moe`` differed from
eager by 0.2155 both with our backend and with plain Inductor (its first layer's k-th and
(k+1)-th router logits are 2^-10 apart); on the CPU the 9-token input of ``deepseek_v3`` is 1.3e-2
from eager with our backend and 0.40 from plain Inductor (``python benchmarks/check_zoo.py --dynamic
--dtype bfloat16 --inner inductor --against-inductor --families deepseek_v3 --tokens 9``). A wrong
rewrite is far from both.

On the CPU the case runs in fp32 (within 1e-4 of eager): in bf16 a third rounding can flip a
near-tie too. On the H200 machine's CPU (torch 2.11, nineteenth session) that bf16 input was 0.42
from eager and 0.40 from plain Inductor with our backend under Inductor, while our rewrite under
aot_eager equalled eager exactly (0.0) and the fp32 compile was 6.3e-07 from eager.
"""
from __future__ import annotations

import pytest
import torch

from moe_compile.testing import zoo

from .helpers import TOL, first_tensor, max_rel_diff

CUDA = torch.cuda.is_available()
CASES = [("cpu", "deepseek_v3"), ("cuda", "qwen3_moe"), ("cuda", "deepseek_v3"), ("cuda", "deepseek_v4"),
         ("cuda", "deepseek_v4_hash")]  # the hash layers: experts-only rewrites


@pytest.mark.parametrize("device,name", CASES, ids=["%s-%s" % c for c in CASES])
def test_reduce_overhead_with_dynamic_shapes(device, name):
    if device == "cuda" and not CUDA:
        pytest.skip("needs a CUDA device")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, _ = zoo.build_model(name, dtype=dtype)
    model = model.to(device)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ours = torch.compile(model, backend="moe_npu", mode="reduce-overhead", dynamic=True)
    plain = torch.compile(model, backend="inductor", mode="reduce-overhead", dynamic=True)
    with torch.no_grad():
        for tokens in (5, 9, 17, 9):
            kwargs = {k: v.to(device) for k, v in zoo.build_inputs(name, num_tokens=tokens, seed=tokens).items()}
            outs = []
            for compiled in (ours, plain):
                for _ in range(3):  # warm-up, record, replay
                    out = first_tensor(compiled(**kwargs)).float().clone()
                outs.append(out)
            eager = first_tensor(model(**kwargs)).float()
            to_eager, to_plain = max_rel_diff(outs[0], eager), max_rel_diff(outs[0], outs[1])
            assert min(to_eager, to_plain) <= TOL[dtype], (tokens, to_eager, to_plain)
            if dtype == torch.float32:
                assert to_eager <= TOL[dtype], (tokens, to_eager)
    counters = torch._dynamo.utils.counters["moe_compile"]
    assert counters["pass_failed"] == 0 and counters["skipped"] == 0, dict(counters)
    assert counters["rewritten"] >= zoo.expected_moe_layers(name), dict(counters)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_reduce_overhead_with_a_block_left_data_dependent():
    """jetmoe: its MLP experts are rewritten, its attention experts stay as they were, captured
    with data-dependent shapes (``.tolist()`` splits). With CUDA graphs such a graph crashed in
    torch 2.11's graph partitions; it is now compiled without them (backend.py)."""
    model, _ = zoo.build_model("jetmoe", dtype=torch.bfloat16)
    model = model.cuda()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ours = torch.compile(model, backend="moe_npu", mode="reduce-overhead")
    plain = torch.compile(model, backend="inductor", mode="reduce-overhead")
    with torch.no_grad():
        for tokens in (5, 17):
            kwargs = {k: v.cuda() for k, v in zoo.build_inputs("jetmoe", num_tokens=tokens, seed=tokens).items()}
            outs = []
            for compiled in (ours, plain):
                for _ in range(3):
                    out = first_tensor(compiled(**kwargs)).float().clone()
                outs.append(out)
            eager = first_tensor(model(**kwargs)).float()
            assert min(max_rel_diff(outs[0], eager), max_rel_diff(outs[0], outs[1])) <= TOL[torch.bfloat16]
    counters = torch._dynamo.utils.counters["moe_compile"]
    assert counters["pass_failed"] == 0 and counters["rewritten"] >= 2, dict(counters)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["v4_mixtral", "gptfast"])
def test_cuda_autocast_runs_the_op_in_bf16(name):
    """fp32 weights under ``torch.autocast("cuda", bfloat16)``: the block is rewritten with its weights
    cast to bf16 per call (the op's bf16 Triton path), within bf16's tolerance of eager autocast or of
    plain Inductor under the same autocast (router near-ties, as above)."""
    import moe_compile
    from moe_compile.testing.zoo_blocks import build_block_model

    model, kwargs = build_block_model(name, num_layers=2)
    model = model.cuda()
    kwargs = {k: v.cuda() for k, v in kwargs.items()}
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ref = first_tensor(model(**kwargs))
        report = moe_compile.explain(model, **kwargs, options={"inner_compiler": "inductor"})
        assert len(report.rewritten) == 2, str(report)  # one block per layer
        assert "weights cast to bfloat16" in str(report), str(report)
        torch._dynamo.reset()
        plain = first_tensor(torch.compile(model, backend="inductor")(**kwargs))
    got = first_tensor(report.output)
    assert min(max_rel_diff(got, ref), max_rel_diff(got, plain)) <= TOL[torch.bfloat16]
