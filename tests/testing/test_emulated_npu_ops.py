"""The emulated torch_npu ops against the worked examples and formulas of the op docs (notes §2).

Each op is called as code calls it on a device (``torch_npu.npu_*`` inside ``emulated_npu()``) and
compared with hand-worked examples and with the row-by-row goldens of ``npu_goldens``.
"""
import math

import pytest
import torch

from moe_compile.testing import emulated_npu, npu_goldens

FP32 = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture
def npu():
    with emulated_npu() as state:
        import torch_npu

        state.torch_npu = torch_npu
        yield state


@pytest.fixture
def poisoned():
    with emulated_npu(poison=True) as state:
        import torch_npu

        state.torch_npu = torch_npu
        yield state


def test_gating_top_k_softmax_row_idx_is_k_major_and_no_renorm(npu):
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0], [2.0, 2.0, 1.0, 1.0]])
    y, idx, row_idx = npu.torch_npu.npu_moe_gating_top_k_softmax(x, None, k=2)
    # row_idx = arange(N*k).reshape(k, N).T (notes §2.1)
    assert row_idx.tolist() == [[0, 3], [1, 4], [2, 5]]
    assert idx.dtype == torch.int32 and row_idx.dtype == torch.int32 and y.dtype == x.dtype
    assert idx.tolist() == [[1, 2], [2, 3], [0, 1]]  # row 3: a tie, the lower index first
    torch.testing.assert_close(y, torch.softmax(x, -1).gather(1, idx.long()), **FP32)  # not renormalised
    gy, gidx, grow = npu_goldens.gating_top_k_softmax(x, 2)
    torch.testing.assert_close(y, gy.float(), **FP32)
    assert torch.equal(idx, gidx) and torch.equal(row_idx, grow)


def test_gating_top_k_softmax_3d_and_bf16(npu):
    x = torch.randn(2, 3, 6, dtype=torch.bfloat16)
    y, idx, row_idx = npu.torch_npu.npu_moe_gating_top_k_softmax(x, k=3)
    assert y.shape == idx.shape == row_idx.shape == (2, 3, 3) and y.dtype == torch.bfloat16
    gy, gidx, grow = npu_goldens.gating_top_k_softmax(x.reshape(6, 6), 3)
    assert torch.equal(idx.reshape(6, 3), gidx) and torch.equal(row_idx.reshape(6, 3), grow)


def test_gating_top_k_softmax_finished_rows(poisoned):
    x = torch.randn(3, 5)
    finished = torch.tensor([False, True, False])
    y, idx, _ = poisoned.torch_npu.npu_moe_gating_top_k_softmax(x, finished, k=2)
    assert idx[1].tolist() == [5, 5]  # [src] max(idx, finished*E): the out-of-range id E
    assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any()


@pytest.mark.parametrize("norm_type", [0, 1])
@pytest.mark.parametrize("groups", [(1, 1, 0), (4, 2, 0), (4, 2, 1), (2, 1, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gating_top_k_matches_golden(npu, norm_type, groups, with_bias):
    group_count, k_group, mode = groups
    torch.manual_seed(norm_type * 7 + group_count + mode)
    x = torch.randn(9, 12)
    bias = torch.randn(12) * 0.3 if with_bias else None
    y, idx, _ = npu.torch_npu.npu_moe_gating_top_k(
        x, 3, bias=bias, k_group=k_group, group_count=group_count, group_select_mode=mode,
        norm_type=norm_type, routed_scaling_factor=2.5, eps=1e-20)
    gy, gidx = npu_goldens.gating_top_k(x, 3, bias=bias, k_group=k_group, group_count=group_count,
                                        group_select_mode=mode, norm_type=norm_type, routed_scaling_factor=2.5)
    assert torch.equal(idx, gidx)
    torch.testing.assert_close(y, gy.float(), **FP32)


def test_gating_top_k_worked_example_bias_only_selects_and_sigmoid_renormalises(npu):
    x = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    y, idx, norm_out = npu.torch_npu.npu_moe_gating_top_k(x, 2, bias=bias, norm_type=1, out_flag=True)
    assert idx.tolist() == [[2, 3]]  # the bias promotes expert 2 ...
    s = torch.sigmoid(x[0])
    expected = torch.stack([s[2], s[3]]) / (s[2] + s[3] + 1e-20)  # ... but the weights are unbiased
    torch.testing.assert_close(y[0], expected, **FP32)
    torch.testing.assert_close(norm_out, torch.sigmoid(x), **FP32)


def test_gating_top_k_norm_out_undefined_without_out_flag(poisoned):
    _, _, norm_out = poisoned.torch_npu.npu_moe_gating_top_k(torch.randn(3, 8), 2)
    assert norm_out.shape == (3, 8) and norm_out.dtype == torch.float32 and torch.isnan(norm_out).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(group_count=4, k_group=2), "experts per group must be > 2"),  # 8 experts / 4 groups = 2
    (dict(norm_type=0, renorm=1), "renorm must be 0"),
    (dict(norm_type=2), "norm_type must be 0 or 1"),
])
def test_gating_top_k_rejects_what_the_214_doc_rejects(npu, kwargs, match):
    with pytest.raises(ValueError, match=match):
        npu.torch_npu.npu_moe_gating_top_k(torch.randn(2, 8), 2, **kwargs)


def test_init_routing_v2_worked_example(poisoned):
    x = torch.arange(4.0).unsqueeze(1).repeat(1, 3)  # token t's row is all t
    ids = torch.tensor([[1, 3], [0, 1], [3, 2], [1, 0]], dtype=torch.int32)
    ex, row_idx, counts, scale = poisoned.torch_npu.npu_moe_init_routing_v2(
        x, ids, active_num=8, expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[1, 3])
    # flat = [1,3,0,1,3,2,1,0]; in-range [1,3): pairs 0,3,6 (expert 1) then 5 (expert 2)
    assert ex.shape == (8, 3) and ex.dtype == x.dtype
    assert ex[:4, 0].tolist() == [0.0, 1.0, 3.0, 2.0]
    assert torch.isnan(ex[4:]).all()  # rows past the valid count are undefined
    assert row_idx.tolist() == [0, -1, -1, 1, -1, 3, 2, -1] and row_idx.dtype == torch.int32
    assert counts.tolist() == [3, 1] and counts.dtype == torch.int64
    assert scale.shape == (8,) and torch.isnan(scale).all()  # no scale given: undefined


def test_init_routing_v2_scatter_index_and_cumsum(poisoned):
    ids = torch.tensor([[1, 3], [0, 1], [3, 2], [1, 0]], dtype=torch.int32)
    _, row_idx, counts, _ = poisoned.torch_npu.npu_moe_init_routing_v2(
        torch.randn(4, 2), ids, expert_num=4, expert_tokens_num_type=0, expert_tokens_num_flag=True,
        active_expert_range=[1, 3], row_idx_type=1)
    assert row_idx[:4].tolist() == [0, 3, 6, 5]
    assert (row_idx[4:] < -1000).all()  # undefined scatter entries: poisoned out of range
    assert counts.tolist() == [3, 4]  # type 0: cumsum


def test_init_routing_v2_key_value_counts_and_placeholder(npu):
    ids = torch.tensor([[2, 0], [2, 3]], dtype=torch.int32)
    _, _, pairs, _ = npu.torch_npu.npu_moe_init_routing_v2(
        torch.randn(2, 2), ids, expert_num=5, expert_tokens_num_type=2, expert_tokens_num_flag=True)
    assert pairs.shape == (5, 2) and pairs[:4].tolist() == [[0, 1], [2, 2], [3, 1], [0, 0]]
    _, _, none, _ = npu.torch_npu.npu_moe_init_routing_v2(torch.randn(2, 2), ids, expert_num=5)
    assert none.shape == ()  # expert_tokens_num_flag=False: a 0-dim placeholder


@pytest.mark.parametrize("span", [(0, 8), (2, 5), (6, 8)])
def test_init_routing_v2_matches_golden(npu, span):
    torch.manual_seed(span[0])
    x = torch.randn(11, 5)
    ids = torch.stack([torch.randperm(8)[:3] for _ in range(11)]).to(torch.int32)
    ex, row_idx, counts, _ = npu.torch_npu.npu_moe_init_routing_v2(
        x, ids, active_num=33, expert_num=8, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=list(span))
    gx, grow, gcounts = npu_goldens.init_routing_v2(x, ids, *span, active_num=33)
    assert torch.equal(ex[: gx.shape[0]], gx) and torch.equal(row_idx, grow) and torch.equal(counts, gcounts)


def test_init_routing_v2_active_num_caps_rows(npu):
    ids = torch.tensor([[0, 1], [1, 2], [0, 2]], dtype=torch.int32)
    ex, row_idx, _, _ = npu.torch_npu.npu_moe_init_routing_v2(torch.randn(3, 2), ids, active_num=4, expert_num=3)
    assert ex.shape == (4, 2)
    assert sorted(row_idx.tolist()) == list(range(6))  # the index still numbers every valid pair


def test_init_routing_v2_rejects_int64_ids(npu):
    with pytest.raises(TypeError, match="int32"):
        npu.torch_npu.npu_moe_init_routing_v2(torch.randn(2, 2), torch.zeros(2, 1, dtype=torch.int64), expert_num=2)


@pytest.mark.parametrize("group_list_type", [0, 1])
def test_grouped_matmul_groups_bias_and_undefined_tail(poisoned, group_list_type):
    torch.manual_seed(group_list_type)
    x = torch.randn(9, 4)
    w = torch.randn(3, 6, 4).transpose(1, 2)  # a transposed [E, N, K] view, as the pass hands it
    bias = torch.randn(3, 6)
    counts = [2, 0, 4]  # 6 of 9 rows covered
    group_list = torch.tensor(counts if group_list_type == 1 else [2, 2, 6], dtype=torch.int64)
    (y,) = poisoned.torch_npu.npu_grouped_matmul([x], [w], bias=[bias], group_list=group_list, split_item=2,
                                                 group_type=0, group_list_type=group_list_type)
    assert y.shape == (9, 6)
    torch.testing.assert_close(y[:6], npu_goldens.grouped_matmul(x, w, counts, bias).float(), **FP32)
    assert torch.isnan(y[6:]).all()


def test_grouped_matmul_bf16_needs_fp32_bias(npu):
    x, w = torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(2, 4, 3, dtype=torch.bfloat16)
    gl = torch.tensor([1, 3], dtype=torch.int64)
    with pytest.raises(TypeError, match="bias must be torch.float32"):
        npu.torch_npu.npu_grouped_matmul([x], [w], bias=[torch.zeros(2, 3, dtype=torch.bfloat16)], group_list=gl,
                                         split_item=2, group_type=0, group_list_type=1)
    (y,) = npu.torch_npu.npu_grouped_matmul([x], [w], bias=[torch.zeros(2, 3)], group_list=gl, split_item=2,
                                            group_type=0, group_list_type=1)
    assert y.dtype == torch.bfloat16


def test_grouped_matmul_refuses_quantised_args(npu):
    with pytest.raises(NotImplementedError, match="per_token_scale"):
        npu.torch_npu.npu_grouped_matmul([torch.randn(2, 2)], [torch.randn(1, 2, 2)], per_token_scale=[torch.ones(2)],
                                         group_list=torch.tensor([2]), split_item=2, group_type=0)


def test_swiglu_first_half_is_the_gate(npu):
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])  # A = [1, -2], B = [3, 0.5]
    out = npu.torch_npu.npu_swiglu(x, dim=-1)
    a, b = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.5])
    torch.testing.assert_close(out[0], a * torch.sigmoid(a) * b, **FP32)
    torch.testing.assert_close(out, npu_goldens.swiglu(x).float(), **FP32)


def test_token_permute_worked_example(npu):
    tokens = torch.tensor([[10.0], [20.0]])
    indices = torch.tensor([[1, 0], [0, 2]], dtype=torch.int32)  # flat [1, 0, 0, 2]
    permuted, sorted_indices = npu.torch_npu.npu_moe_token_permute(tokens, indices, num_out_tokens=4)
    # order = stable argsort = [1, 2, 0, 3]; sorted_indices = its inverse = destination rows
    assert sorted_indices.tolist() == [2, 0, 1, 3] and sorted_indices.dtype == torch.int32
    assert permuted.flatten().tolist() == [10.0, 20.0, 10.0, 20.0]
    gp, gs = npu_goldens.token_permute(tokens, indices)
    assert torch.equal(permuted, gp) and torch.equal(sorted_indices, gs)


def test_token_permute_unpermute_round_trip(npu):
    torch.manual_seed(3)
    tokens = torch.randn(6, 4)
    indices = torch.randint(0, 5, (6, 3), dtype=torch.int32)
    probs = torch.rand(6, 3)
    permuted, sorted_indices = npu.torch_npu.npu_moe_token_permute(tokens, indices)
    out = npu.torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs)
    torch.testing.assert_close(out, tokens * probs.sum(1, keepdim=True), **FP32)
    torch.testing.assert_close(out, npu_goldens.token_unpermute(permuted, sorted_indices, probs).float(), **FP32)
    one_d, inverse = npu.torch_npu.npu_moe_token_permute(tokens, indices[:, 0].contiguous())
    torch.testing.assert_close(npu.torch_npu.npu_moe_token_unpermute(one_d, inverse), tokens, **FP32)


def test_unpermute_skips_minus_one_but_abs_trick_reads_an_undefined_row(poisoned):
    """The trap of notes §1.5/§5: abs(-1) = row 1, weight 0, and 0 * NaN = NaN."""
    x = torch.tensor([[1.0], [2.0]])
    ids = torch.tensor([[0, 3], [3, 3]], dtype=torch.int32)  # only pair (0, 0) is in range [0, 2)
    ex, row_idx, _, _ = poisoned.torch_npu.npu_moe_init_routing_v2(x, ids, active_num=4, expert_num=4,
                                                                    active_expert_range=[0, 2])
    assert row_idx.tolist() == [0, -1, -1, -1] and torch.isnan(ex[1:]).all()
    weights = torch.tensor([[0.5, 0.0], [0.0, 0.0]])  # non-local pairs carry weight 0 (MindIE masks them)
    skipped = poisoned.torch_npu.npu_moe_token_unpermute(ex, row_idx, probs=weights)
    assert skipped.tolist() == [[0.5], [0.0]]
    trapped = poisoned.torch_npu.npu_moe_token_unpermute(ex, row_idx.abs(), probs=weights)
    assert math.isnan(trapped[0, 0]) and math.isnan(trapped[1, 0])


def test_finalize_routing_is_k_major_with_bias_and_skips(npu):
    torch.manual_seed(5)
    rows, skip1, skip2 = torch.randn(6, 3), torch.randn(3, 3), torch.randn(3, 3)
    bias = torch.randn(4, 3)
    scales = torch.rand(3, 2)
    src2dst = torch.tensor([4, 0, 2, -1, 5, 1], dtype=torch.int32)  # k-major: [k=0 rows..., k=1 rows...]
    experts = torch.randint(0, 4, (3, 2), dtype=torch.int32)
    out = npu.torch_npu.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, src2dst, experts)
    expected = npu_goldens.finalize_routing(rows, skip1, skip2, bias, scales, src2dst, experts).float()
    torch.testing.assert_close(out, expected, **FP32)
    # token 0 uses rows 4 (k=0) and -1 (k=1, skipped)
    manual = skip1[0] + skip2[0] + scales[0, 0] * (rows[4] + bias[experts[0, 0]])
    torch.testing.assert_close(out[0], manual, **FP32)
