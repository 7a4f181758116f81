"""The tuner (``moe_compile.tools.tune``, run by ``python -m moe_compile tune`` and
``benchmarks/tune_triton.py``), with a fake timer: which variants it tries around a tuned plan and
that it keeps the fastest plan it timed (the current one included)."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_moe_layer import SHAPES  # noqa: E402

import moe_compile.tools.tune as tt  # noqa: E402

from moe_compile.kernels.triton.configs import ExpertsPath, Plan  # noqa: E402
from moe_compile.kernels.triton.gemm import GemmConfig  # noqa: E402

G = GemmConfig


def _timer(times: dict):
    def time_plan(plan, calls, weights, reps, ref=None):
        times[plan] = times.get(plan, 100.0 + len(times))  # every plan slower than the last, unless set
        return times[plan]
    return time_plan


def test_variants_cover_persistence_pre_gather_and_tails():
    plan = Plan(ExpertsPath.SORTED, G(128, 128, 64, 8, 8, 4, 1), G(128, 256, 64, 8, 8, 4, 1))
    variants = tt.refine_variants(plan, per_expert=128)
    assert len(variants) == len(set(variants))
    assert any(v.pre_gather for v in variants)
    assert {v.gemm1.persistent for v in variants} >= {0, 1, 2} and {v.gemm2.persistent for v in variants} >= {1, 2}
    assert {v.gemm1.tail_m for v in variants} >= {32, 64} and {v.gemm2.tail_m for v in variants} >= {32, 64}
    assert all(v.path is ExpertsPath.SORTED for v in variants)
    assert any(v.gemm1.block_m == 64 and v.gemm1.tail_m == 16 for v in variants)
    assert any(v.gemm1.tail_m and not v.gemm1.persistent for v in variants)
    assert {v.gemm1.merge_m for v in variants} >= {16, 32} and {v.gemm2.merge_m for v in variants} >= {16, 32}
    assert {v.gemm1.merge_launch for v in variants if v.gemm1.merge_m} == {0, 1}
    assert not any(v.gemm1.merge_m or v.gemm2.merge_m for v in tt.refine_variants(plan, per_expert=16))
    assert {v.gemm2.split_k for v in variants} == {1, 2, 3} and all(v.gemm1.split_k == 1 for v in variants)
    assert any(v.gemm1.expert_order and v.gemm2.expert_order and v.gemm1.group_m == tt.ALL_M for v in variants)
    assert not any(v.gemm1.expert_order for v in tt.refine_variants(plan, per_expert=16))
    grouped = tt.refine_variants(Plan(ExpertsPath.GROUPED_MM, plan.gemm1, plan.gemm2), per_expert=128)
    assert all(v.path is ExpertsPath.SORTED and v.gemm1.tma for v in grouped[:1])  # Triton variants to compare
    pairs = tt.refine_variants(Plan(ExpertsPath.PAIRS, G(16, 64, 128, 1, 4, 4), G(16, 64, 128, 1, 4, 4)), 0.06)
    assert all(v.path is ExpertsPath.PAIRS for v in pairs) and any(v.gemm1.tma for v in pairs)


@pytest.mark.parametrize("winner", ["current", "variant"])
def test_refine_keeps_the_fastest_timed_plan(winner, monkeypatch):
    current = Plan(ExpertsPath.GROUPED_MM, G(128, 128, 64, 8, 8, 3), G(128, 256, 64, 8, 8, 3))
    times = {current: 50.0} if winner == "current" else {}
    if winner == "variant":
        fast = tt.refine_variants(current, 128)[3]
        times[fast] = 10.0
    monkeypatch.setattr(tt, "problem", lambda *args: None)
    monkeypatch.setattr(tt, "reference_output", lambda *args: None)
    monkeypatch.setattr(tt, "time_plan", _timer(times))
    log = []
    us, best = tt.refine_point(SHAPES["qwen3"], 2048, None, 1, log, current, session=9)
    assert us == min(times.values()) and times[best] == us
    assert best == (current if winner == "current" else fast)
    assert sum(row["current"] for row in log) == 1 and all(row["session"] == 9 for row in log)
    assert all(Plan.from_dict(row) in times for row in log)


def test_time_plan_skips_a_plan_with_wrong_output(monkeypatch, capsys):
    """A fast plan whose output is off (a miscompiled variant) is never kept: it times as inf."""
    plan = Plan(ExpertsPath.SORTED, G(64, 128, 64, 8, 4, 4, 1), G(64, 128, 64, 8, 4, 4, 1))
    monkeypatch.setattr(tt, "graph_time_us", lambda *args: 1.0)
    monkeypatch.setattr(tt, "plan_error", lambda *args: 0.5)
    assert tt.time_plan(plan, [None], None, 1, ref=object()) == float("inf")
    assert "wrong output" in capsys.readouterr().out
    monkeypatch.setattr(tt, "plan_error", lambda *args: float("nan"))
    assert tt.time_plan(plan, [None], None, 1, ref=object()) == float("inf")
    monkeypatch.setattr(tt, "plan_error", lambda *args: 3e-3)
    assert tt.time_plan(plan, [None], None, 1, ref=object()) == 1.0


def test_custom_shapes_parse_and_reject_bad_sizes():
    import argparse

    shape = tt.custom_shape("128,8,4096,1536")
    assert (shape.num_experts, shape.top_k, shape.hidden, shape.inter) == (128, 8, 4096, 1536)
    assert shape.name == "E128_k8_H4096_I1536" and shape.routing["routing_method"] == "softmax"
    for bad in ("128,8,4096", "a,8,4096,1536", "8,16,4096,1536", "0,1,4096,1536"):
        with pytest.raises(argparse.ArgumentTypeError, match="--shape"):
            tt.custom_shape(bad)


def test_decode_batches_time_the_decode_path(monkeypatch):
    """A decode batch: ``tune_point`` times the decode plans after the pairs path and keeps one
    when it is fastest; ``refine_point`` from a pairs plan times them too, and from a decode plan
    varies its blocks (GEMM1's, then the second product's columns), never mixing it with a GEMM's."""
    fast = tt.decode_candidates()[2]
    times = {fast: 5.0}
    monkeypatch.setattr(tt, "problem", lambda *args: None)
    monkeypatch.setattr(tt, "reference_output", lambda *args: None)
    monkeypatch.setattr(tt, "time_plan", _timer(times))
    log = []
    us, best = tt.tune_point(SHAPES["qwen3"], 1, None, 1, log)
    assert (us, best) == (5.0, fast)
    assert {p.path for p in times} >= {ExpertsPath.PAIRS, ExpertsPath.SORTED, ExpertsPath.DECODE}
    pairs = Plan(ExpertsPath.PAIRS, G(16, 64, 128, 1, 4, 4), G(16, 64, 128, 1, 4, 4))
    times.clear()
    times[fast] = 5.0
    us, best = tt.refine_point(SHAPES["qwen3"], 1, None, 1, [], pairs, session=15)
    assert best == fast
    assert all(p.path is ExpertsPath.PAIRS for p in times if p.path is not ExpertsPath.DECODE)
    times.clear()
    variants = tt.refine_variants(fast, 0.06)
    assert all(v.path is ExpertsPath.DECODE for v in variants) and len(variants) == len(set(variants))
    assert {v.gemm2.block_n for v in variants} == {64, 128, 256}
    better = variants[-1]
    times[better] = 1.0
    us, best = tt.refine_point(SHAPES["qwen3"], 1, None, 1, [], fast, session=15)
    assert all(p.path is ExpertsPath.DECODE for p in times)
    assert best.path is ExpertsPath.DECODE and times[best] == us
    # no decode plans for a batch whose pairs share experts
    times.clear()
    tt.tune_point(SHAPES["qwen3"], 256, None, 1, [])
    assert not any(p.path is ExpertsPath.DECODE for p in times)
