"""The portable grouped GEMM on the CPU: torch._grouped_mm, or the loop over experts with rows
for a batch with fewer rows than experts; both against a per-row reference."""
import pytest
import torch

from moe_compile.kernels import grouped_mm as gmm
from moe_compile.modular.slots import batched_slots, sorted_pairs


def _case(rows: int, experts: int, seed: int, tail: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (rows - tail,), generator=gen).sort().values
    counts = torch.bincount(ids, minlength=experts)
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(rows, 32, generator=gen)
    w = torch.randn(experts, 32, 24, generator=gen)
    want = torch.zeros(rows, 24)
    for r, e in enumerate(ids.tolist()):
        want[r] = x[r] @ w[e]
    return x, w, offsets, want


@pytest.mark.parametrize("rows, experts, tail", [(3, 16, 0), (5, 16, 2), (1, 4, 0), (40, 8, 0), (40, 8, 7)])
def test_grouped_mm_matches_per_row_products(rows, experts, tail):
    x, w, offsets, want = _case(rows, experts, seed=rows + experts, tail=tail)
    got = gmm.grouped_mm(x, w, offsets)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert bool((got[rows - tail:] == 0).all())  # rows past the last offset are zero


def test_few_rows_take_the_loop_and_many_rows_the_grouped_kernel(monkeypatch):
    calls = []
    real = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    x, w, offsets, want = _case(3, 16, seed=1)
    torch.testing.assert_close(gmm.grouped_mm(x, w, offsets), want, rtol=1e-5, atol=1e-5)
    assert calls == []
    x, w, offsets, want = _case(40, 8, seed=2)
    torch.testing.assert_close(gmm.grouped_mm(x, w, offsets), want, rtol=1e-5, atol=1e-5)
    assert calls == [40]


def test_loop_visits_only_experts_with_rows(monkeypatch):
    seen = []
    real_mm = torch.mm

    def counting_mm(a, b, *, out=None):
        seen.append(a.shape[0])
        return real_mm(a, b, out=out)

    monkeypatch.setattr(torch, "mm", counting_mm)
    x, w, offsets, want = _case(4, 64, seed=3)
    torch.testing.assert_close(gmm.grouped_mm(x, w, offsets), want, rtol=1e-5, atol=1e-5)
    nonempty = int((torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0).sum())
    assert len(seen) == nonempty and sum(seen) == 4


@pytest.mark.parametrize("with_map", [False, True])
def test_sorted_pairs_and_batched_slots_against_a_per_pair_reference(with_map):
    gen = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(10)]).int()
    emap = [-1, 0, -1, 1, 2, -1, 3, -1] if with_map else None
    num_local = 4 if with_map else 8
    local = [emap[i] if emap else i for i in ids.view(-1).tolist()]
    key = [e if 0 <= e < num_local else num_local for e in local]
    order = sorted(range(len(key)), key=lambda p: (key[p], p))
    counts = [key.count(e) for e in range(num_local)]
    offsets = [sum(counts[:e + 1]) for e in range(num_local)]
    slot = [sum(1 for q in range(p) if key[q] == key[p]) for p in range(len(key))]
    expert_map = torch.tensor(emap, dtype=torch.int32) if with_map else None
    pairs = sorted_pairs(ids, num_local, expert_map)
    assert pairs.key.tolist() == key and pairs.order.tolist() == order and pairs.offsets.tolist() == offsets
    assert pairs.counts.tolist() == counts + [key.count(num_local)]
    slots = batched_slots(ids, num_local, expert_map)
    assert slots.order.tolist() == order and slots.offsets.tolist() == offsets
    assert slots.expert_num_tokens.tolist() == counts
    assert slots.valid.tolist() == [k < num_local for k in key]
    assert slots.local_expert.tolist() == [k if k < num_local else -1 for k in key]
    assert slots.slot.tolist() == slot
    # ids past the local experts without a map are not local either
    pairs = sorted_pairs(torch.tensor([[0, 5]], dtype=torch.int32), 4)
    assert pairs.key.tolist() == [0, 4] and pairs.offsets.tolist() == [1, 1, 1, 1]


def test_without_free_host_reads_no_shortcut_reads_the_host(monkeypatch):
    """What a GPU runs (and what the host-sync audit checks): no loop, no bincount, no tolist."""
    x, w, offsets, want = _case(3, 16, seed=5)
    monkeypatch.setattr(gmm, "host_reads_are_free", lambda device: False)
    read = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: read.append("tolist"))
    monkeypatch.setattr(torch, "bincount", lambda *a, **k: read.append("bincount"))
    torch.testing.assert_close(gmm.grouped_mm(x, w, offsets), want, rtol=1e-5, atol=1e-5)
    pairs = sorted_pairs(torch.tensor([[3, 1], [1, 0]], dtype=torch.int32), 4)
    assert read == []
    assert pairs.offsets.numpy().tolist() == [1, 3, 3, 4]


_VIEWS = {
    "every other column": lambda w: torch.cat([w, w], -1)[:, :, ::2],
    "expert dim last": lambda w: w.permute(1, 2, 0).contiguous().permute(2, 0, 1),
    "rows padded to an odd stride": lambda w: torch.nn.functional.pad(w, (0, 1))[:, :, :w.shape[-1]],
    "column-major": lambda w: w.transpose(1, 2).contiguous().transpose(1, 2),
    "one expert expanded": lambda w: w[:1].expand_as(w),
}


@pytest.mark.parametrize("view", list(_VIEWS), ids=list(_VIEWS))
def test_weight_views_take_a_path_that_reads_them(view):
    """Views that torch._grouped_mm cannot read (no unit stride in the last two dims, or a stride
    that is not a multiple of 16 bytes) take the loop; before, they raised deep in torch."""
    x, w, offsets, _ = _case(40, 8, seed=3)
    w_view = _VIEWS[view](w)
    want = gmm.grouped_mm_loop(x, w_view.contiguous(), offsets)
    torch.testing.assert_close(gmm.grouped_mm(x, w_view, offsets), want, rtol=1e-5, atol=1e-5)
