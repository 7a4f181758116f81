"""Stacked copies of separate expert weights (``ModuleList`` experts, gpt-fast's w1/w3) follow
the model's weights after compiling: in-place updates, ``load_state_dict``, and several modules
through one compiled graph (regional compilation). Before ``moe_compile::stacked_weights`` the
copy was a constant taken at compile time, and such a model kept computing with the old weights
(0.6-1.05 of the output's magnitude off eager)."""
from __future__ import annotations

import pytest
import torch

import moe_compile
from moe_compile.ops import weight_cache
from moe_compile.testing.blocks import GatherEinsumMoE, MoEBlockConfig, V4MoEBlock
from moe_compile.testing.zoo import redraw_parameters

from .helpers import TOL, max_rel_diff

CFG = MoEBlockConfig(hidden_size=32, intermediate_size=16, num_experts=4, top_k=2)
INNERS = ["aot_eager", "inductor"]


def _block(make, seed=0):
    block = make(CFG)
    redraw_parameters(block, seed=seed)
    return block.eval()


def _x(tokens):
    return torch.randn(1, tokens, CFG.hidden_size)


def _compiled(block, inner):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(block, backend="moe_npu", options={"inner_compiler": inner})


def _v4_called_once():
    """A ModuleList block, 6 tokens, and the block compiled (aot_eager) and called once."""
    torch.manual_seed(0)
    block, x = _block(V4MoEBlock), _x(6)
    fast = _compiled(block, "aot_eager")
    with torch.no_grad():
        fast(x)
    return block, x, fast


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("make", [V4MoEBlock, GatherEinsumMoE], ids=["modulelist", "gpt_fast"])
def test_in_place_updates_are_followed(make, inner):
    torch.manual_seed(0)
    block = _block(make)
    x = _x(7)
    fast = _compiled(block, inner)
    with torch.no_grad():
        fast(x)
        assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == 1
        for p in block.parameters():
            p.mul_(1.5).add_(0.01)
        assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]
        block.load_state_dict(_block(make, seed=1).state_dict())
        assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]


def test_modules_sharing_one_compiled_graph_each_use_their_weights():
    torch.manual_seed(0)
    layers = [_block(V4MoEBlock, seed=i) for i in range(3)]
    x = _x(5)
    torch._dynamo.reset()
    for layer in layers:
        layer.compile(backend="moe_npu", options={"inner_compiler": "aot_eager"})
    with torch.no_grad():
        for _ in range(2):
            for layer in layers:
                assert max_rel_diff(layer(x), layer._orig_mod(x) if hasattr(layer, "_orig_mod")
                                    else layer.forward(x)) <= TOL[torch.float32]


def test_refresh_weights_remakes_stale_copies_in_place():
    block, x, fast = _v4_called_once()
    with torch.no_grad():
        copies = [c for c in weight_cache._COPIES.values() if block.experts[0].w1.weight.data_ptr() in c.ptrs]
        assert len(copies) == 1 and len(copies[0].values) == 2  # w13 and w2, from one call per block
        before = [v.data_ptr() for v in copies[0].values]
        assert moe_compile.refresh_weights() == 0
        block.experts[1].w1.weight.add_(1.0)
        assert moe_compile.refresh_weights() == 1  # only the copy made from w1 (w13), not w2's
        assert [v.data_ptr() for v in copies[0].values] == before  # same memory: CUDA graphs see it
        assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]


def test_the_op_rebuilds_only_when_a_source_changed(monkeypatch):
    parts = [torch.randn(3, 4) for _ in range(2)] + [torch.randn(2, 4)]
    key, held, dims = weight_cache.register([("stack", (0, 1), False), ("leaf", 2, False)], parts)
    assert dims == [3, 2] and held[0].shape == (2, 4, 3) and held[1].shape == (2, 1, 4)
    builds = []
    real = weight_cache._build
    monkeypatch.setattr(weight_cache, "_build", lambda r, p: builds.append(1) or real(r, p))
    out = torch.ops.moe_compile.stacked_weights(parts, key)
    assert all(o is h for o, h in zip(out, held)) and not builds
    parts[1].mul_(2)
    out = torch.ops.moe_compile.stacked_weights(parts, key)
    assert all(o is h for o, h in zip(out, held)) and len(builds) == 2  # the block's copies, re-made in place
    torch.testing.assert_close(out[0], torch.stack(parts[:2]).transpose(-1, -2))
    with pytest.raises(RuntimeError, match="no weights registered under key 'local:-1'"):
        torch.ops.moe_compile.stacked_weights(parts, "local:-1")


def test_a_key_reads_back_without_its_compile():
    """A graph loaded from Inductor's compile cache (another process, or after ``torch._dynamo.reset()``)
    calls the op with a key this process never registered: the key is the recipes' text, so the op
    makes the entry and the copies from it."""
    parts = [torch.randn(3, 4) for _ in range(2)] + [torch.randn(2, 4)]
    key, _, _ = weight_cache.register([("stack", (0, 1), True), ("leaf", 2, False)], parts)
    assert key == "(('stack', (0, 1), True), ('leaf', 2, False))"
    weight_cache.clear()
    out = torch.ops.moe_compile.stacked_weights(parts, key)
    torch.testing.assert_close(out[0], torch.stack(parts[:2]))
    torch.testing.assert_close(out[1], parts[2].unsqueeze(1))
    fake = weight_cache._stacked_weights_fake(parts, key)
    assert [f.shape for f in fake] == [o.shape for o in out]
    with pytest.raises(RuntimeError, match="no weights registered"):
        torch.ops.moe_compile.stacked_weights(parts, "(('nonsense'")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_cuda_copies_follow_updates(mode):
    """On the GPU (the Triton lowering), bf16: in-place updates are followed; under CUDA graphs
    after ``refresh_weights()`` (a replay runs no Python)."""
    torch.manual_seed(0)
    block = _block(V4MoEBlock).to("cuda", torch.bfloat16)
    x = _x(9).to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    options = {"inner_compiler": "inductor", **({"mode": mode} if mode else {})}
    fast = torch.compile(block, backend="moe_npu", options=options)
    with torch.no_grad():
        for _ in range(3):
            fast(x)
        for p in block.parameters():
            p.mul_(-1.0)
        if mode:
            assert moe_compile.refresh_weights() >= 2
        for _ in range(2):
            assert max_rel_diff(fast(x).clone(), block(x)) <= TOL[torch.bfloat16]


def test_dynamo_reset_drops_the_copies():
    block = _block(V4MoEBlock)
    fast = _compiled(block, "aot_eager")
    with torch.no_grad():
        fast(_x(4))
    assert weight_cache._ENTRIES
    torch._dynamo.reset()
    assert not weight_cache._ENTRIES
    x = _x(4)
    with torch.no_grad():  # compiles again, with new copies
        assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]
    assert weight_cache._ENTRIES


@pytest.mark.parametrize("how", ["data", "inference_mode"])
def test_writes_the_version_counters_miss_are_caught_by_refresh_weights(how):
    """``p.data.copy_()`` (RL weight syncs) and inference tensors bypass the per-call version
    check; ``refresh_weights()`` compares values and re-makes the stale copies."""
    torch.manual_seed(0)
    if how == "inference_mode":
        with torch.inference_mode():
            block = _block(V4MoEBlock)
    else:
        block = _block(V4MoEBlock)
    x = _x(6)
    fast = _compiled(block, "aot_eager")
    new = _block(V4MoEBlock, seed=3).state_dict()
    with torch.inference_mode() if how == "inference_mode" else torch.no_grad():
        fast(x)
        for name, p in block.named_parameters():
            (p.data if how == "data" else p).copy_(new[name])
        assert max_rel_diff(fast(x), block(x)) > 0.1  # missed by the version check
        assert moe_compile.refresh_weights() == 2  # w13 and w2 of the one block
        assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]
        assert moe_compile.refresh_weights() == 0


@pytest.mark.parametrize("how", ["assign", "data", "roundtrip"])
def test_replaced_weights_leave_no_copy_behind(how):
    """Weight syncs that replace the tensors (``load_state_dict(assign=True)``, ``p.data = new``, a
    dtype round trip) leave one copy, of the new weights, and the old tensors are freed: each sync
    kept another full copy and the replaced weights alive before (about 100 MB per sync of a 48 MB
    block)."""
    import gc
    import weakref

    block, x, fast = _v4_called_once()
    with torch.no_grad():
        assert len(weight_cache._COPIES) == 1
        for seed in range(1, 4):
            old = weakref.ref(block.experts[0].w1.weight)  # replaced by assign=True, kept by the others
            new = _block(V4MoEBlock, seed=seed).state_dict()
            if how == "assign":
                block.load_state_dict(new, assign=True)
            elif how == "data":
                for name, p in block.named_parameters():
                    p.data = new[name].clone()
            else:
                block.load_state_dict(new)
                block.to(torch.float64).float()
            gc.collect()
            assert (old() is None) == (how == "assign")  # no copy holds the replaced parameters
            assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]
            (copy,) = weight_cache._COPIES.values()  # one copy, of the weights the block has now
            assert block.experts[0].w1.weight.data_ptr() in copy.ptrs
            assert all(isinstance(ref, weakref.ref) for ref in copy.refs)  # old memory is not held


def test_recompiles_share_one_copy():
    """Each recompile of a block (new token counts without ``dynamic``) reads the same copy instead
    of making its own."""
    torch.manual_seed(0)
    block = _block(V4MoEBlock)
    torch._dynamo.reset()
    fast = torch.compile(block, backend="moe_npu", dynamic=False, options={"inner_compiler": "aot_eager"})
    with torch.no_grad():
        for tokens in (5, 1, 6, 7):
            x = _x(tokens)
            assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]
    # four graphs, one recipe text (the key), one copy
    assert len(weight_cache._ENTRIES) == 1 and len(weight_cache._COPIES) == 1
