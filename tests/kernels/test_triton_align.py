"""Expert alignment (count + scatter, no host sync) against the plain-torch grouping."""

import pytest
import torch

CUDA = torch.cuda.is_available()
# Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET, set for the whole
# session by tests/conftest.py before triton is first imported).
pytest.importorskip("triton")

from moe_compile.kernels.triton.align import align, align_reference  # noqa: E402


DEV = "cuda" if CUDA else "cpu"


def _random_ids(tokens, num_experts, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=1).indices.int().to(DEV)


def _check(al, ref, topk_ids, num_local):
    assert torch.equal(al.counts.cpu(), ref.counts.cpu())
    assert torch.equal(al.offsets.cpu(), ref.offsets.cpu())
    total = int(ref.offsets[-1])
    pos, sorted_pair = al.pos.cpu(), al.sorted_pair.cpu()
    valid = ref.pos.cpu() >= 0
    assert torch.equal(pos >= 0, valid)
    # the inverse permutation: pair -> row -> the same pair
    assert torch.equal(sorted_pair[pos[valid].long()], torch.nonzero(valid).squeeze(1).int())
    # within each expert's rows, the same pairs as the stable reference (order may differ)
    start = 0
    for end in ref.offsets.cpu().tolist():
        got = sorted(sorted_pair[start:end].tolist())
        want = sorted(ref.sorted_pair.cpu()[start:end].tolist())
        assert got == want
        start = end
    assert start == total


@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 8, 2), (37, 8, 2), (50, 64, 6), (3, 128, 8)])
def test_align_matches_reference(tokens, num_experts, top_k):
    ids = _random_ids(tokens, num_experts, top_k, seed=tokens)
    al = align(ids, num_experts, block=64)
    _check(al, align_reference(ids, num_experts), ids, num_experts)


def test_align_expert_map_drops_remote_pairs_and_gathers_rows():
    ids = _random_ids(29, 12, 3, seed=3)
    expert_map = torch.full((12,), -1, dtype=torch.int32)
    expert_map[4:8] = torch.arange(4, dtype=torch.int32)
    expert_map = expert_map.to(DEV)
    x = torch.randn(29, 24, device=DEV)
    al = align(ids, 4, expert_map, x=x, block=32)
    ref = align_reference(ids, 4, expert_map, x=x)
    _check(al, ref, ids, 4)
    rows = al.pos >= 0
    token = torch.arange(ids.numel(), device=DEV) // 3
    assert torch.equal(al.x_sorted[al.pos[rows].long()], x[token[rows]])


@pytest.mark.parametrize("hidden", [24, 600, 1100], ids=["one-chunk", "two-chunks", "three-ragged-chunks"])
def test_gathered_rows_split_over_hidden(hidden):
    """The row copy is split over H (about 512 columns per program): every column of every local
    pair's row arrives, whatever H is, also past the last full chunk."""
    ids = _random_ids(70, 16, 4, seed=hidden)
    x = torch.randn(70, hidden, device=DEV)
    al = align(ids, 16, x=x)
    _check(al, align_reference(ids, 16, x=x), ids, 16)
    token = torch.arange(ids.numel(), device=DEV) // 4
    assert torch.equal(al.x_sorted[al.pos.long()], x[token])


def test_align_rejects_bad_ids():
    with pytest.raises(TypeError, match="int32"):
        align(torch.zeros(3, 2, dtype=torch.int64, device=DEV), 4)
    with pytest.raises(ValueError, match="2-D"):
        align(torch.zeros(6, dtype=torch.int32, device=DEV), 4)
    with pytest.raises(ValueError, match="num_local"):
        align(torch.zeros(3, 2, dtype=torch.int32, device=DEV), 0)


@pytest.mark.parametrize("method", ["sort", "blocks", "two_launch"])
@pytest.mark.parametrize("tokens,num_experts,top_k,mapped", [
    (1, 8, 2, False), (37, 8, 2, False), (40, 64, 6, False), (16, 128, 8, False), (29, 12, 3, True),
    (300, 8, 2, False), (70, 256, 8, True)])
def test_every_method_groups_like_the_reference(tokens, num_experts, top_k, mapped, method):
    """Each launch method gives the reference's counts, offsets and grouping; the one-program
    sort and the blocks method (no memset: they write every count) give exactly the stable
    plain-torch order (pairs of one expert in pair order), so their rows come out in the same
    order on every call. The last two cases span several blocks (600 pairs of 8 experts: 3 blocks
    of 256; 560 pairs of 256 experts: 18 blocks of 32)."""
    ids = _random_ids(tokens, num_experts, top_k, seed=tokens + num_experts)
    emap, num_local = None, num_experts
    if mapped:
        emap = torch.full((num_experts,), -1, dtype=torch.int32)
        emap[4:8] = torch.arange(4, dtype=torch.int32)
        emap, num_local = emap.to(DEV), 4
    al = align(ids, num_local, emap, method=method)
    ref = align_reference(ids, num_local, emap)
    _check(al, ref, ids, num_local)
    if method in ("sort", "blocks"):
        n = int(ref.offsets[-1])
        assert torch.equal(al.pos.cpu(), ref.pos.cpu())
        assert torch.equal(al.sorted_pair[:n].cpu(), ref.sorted_pair[:n].cpu())


def test_blocks_method_gathers_rows_in_the_stable_order():
    ids = _random_ids(90, 12, 3, seed=5)  # 270 pairs: two blocks of 256 (E_PAD 16)
    expert_map = torch.full((12,), -1, dtype=torch.int32)
    expert_map[2:9] = torch.arange(7, dtype=torch.int32)
    expert_map = expert_map.to(DEV)
    x = torch.randn(90, 700, device=DEV)  # two column chunks of the row copy, the second ragged
    al = align(ids, 7, expert_map, x=x, method="blocks")
    ref = align_reference(ids, 7, expert_map, x=x)
    _check(al, ref, ids, 7)
    n = int(ref.offsets[-1])
    assert torch.equal(al.pos.cpu(), ref.pos.cpu())
    assert torch.equal(al.sorted_pair[:n].cpu(), ref.sorted_pair[:n].cpu())
    assert torch.equal(al.x_sorted[:n], ref.x_sorted[:n])


def test_align_method_by_size():
    from moe_compile.kernels.triton.align import BLOCKS_MAX_TABLE, SORT_MAX_PAIRS, align_method, blocks_layout

    assert align_method(1, False) == "sort"
    assert align_method(SORT_MAX_PAIRS, False) == "sort"
    assert align_method(SORT_MAX_PAIRS + 1, False, 128) == "blocks"
    assert align_method(1, True, 8) == "two_launch"  # the row gather: its copy split finer there
    # the count table [blocks, experts] bounds the blocks method; past it, two launches
    assert blocks_layout(2048, 128) == (64, 32, 32)
    assert align_method(2048, False, 128) == "blocks"  # Qwen3, 256 tokens: a 32 x 128 table
    assert align_method(2048, False, 256) == "two_launch"  # DeepSeek-V3, 256 tokens: 64 x 256 (slower)
    assert align_method(65536, False, 256) == "two_launch"  # DeepSeek-V3, 8192 tokens
    for pairs, experts in ((600, 8), (16384, 256), (4096, 1)):
        _, _, nb_pad = blocks_layout(pairs, experts)
        fits = nb_pad * (1 << (experts - 1).bit_length()) <= BLOCKS_MAX_TABLE
        assert align_method(pairs, False, experts) == ("blocks" if fits else "two_launch")
    ids = _random_ids(3, 8, 2, seed=1)
    with pytest.raises(ValueError, match="method='sort'"):
        align(ids, 8, x=torch.randn(3, 16, device=DEV), method="sort")
    from moe_compile.kernels.triton import align as align_mod

    try:  # FORCE: one method for every call (bench_moe_layer.py --align-method)
        align_mod.FORCE = "two_launch"
        assert align_method(1, False) == "two_launch"
    finally:
        align_mod.FORCE = None
    with pytest.raises(ValueError, match="method='bogus'"):
        align(ids, 8, method="bogus")
    # the sort's int32 keys (expert * P_PAD + pair) bound the pairs it takes: refused, not wrapped
    with pytest.raises(ValueError, match="method='sort' takes at most 2047 pairs"):
        align(torch.zeros(4096, 1, dtype=torch.int32, device=DEV), 1 << 20, method="sort")
