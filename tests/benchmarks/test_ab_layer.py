"""``benchmarks/ab_layer.py``'s parts that need no GPU: the round order, the summary, and the
switch between plan directories."""
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ab_layer  # noqa: E402

from moe_compile.kernels.triton import configs  # noqa: E402


def test_sides_alternate_which_goes_first():
    assert [ab_layer.order(r) for r in range(4)] == [("A", "B"), ("B", "A"), ("A", "B"), ("B", "A")]


def test_summary_pairs_rounds_in_time():
    s = ab_layer.summary({"A": [100.0, 110.0, 90.0], "B": [95.0, 99.0, 90.0]})
    assert s["A_median_us"] == 100.0 and s["B_median_us"] == 95.0
    assert s["B_over_A_median"] == pytest.approx(0.95) and s["B_over_A_min"] == pytest.approx(0.9)
    assert s["B_over_A_max"] == pytest.approx(1.0)


def test_use_plans_switches_the_tuned_files(tmp_path, monkeypatch):
    """Side B's directory shadows the shipped file of the same name; side A (none) reads the
    shipped one again, within one process."""
    monkeypatch.delenv(configs.USER_DIR_ENV, raising=False)
    name = configs.config_file_name(8, 4096, 14336, torch.bfloat16, "NVIDIA_H200")
    shipped = configs._load(name)
    mine = {"_top_k": 2, "2048": json.loads(json.dumps(shipped[2048].to_dict()))}
    mine["2048"]["gemm2"]["split_k"] = 1
    mine["2048"]["gemm2"]["block_m"] = 64
    (tmp_path / name).write_text(json.dumps(mine))
    try:
        ab_layer.use_plans(str(tmp_path))
        assert configs._load(name)[2048].gemm2.block_m == 64
        ab_layer.use_plans(None)
        assert configs._load(name)[2048] == shipped[2048]
    finally:
        monkeypatch.delenv(configs.USER_DIR_ENV, raising=False)
        configs.reload()


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab_layer.main(["--points", "qwen3:8", "--rounds", "0"])
    assert "--rounds and --reps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab_layer.main(["--points", "qwen3:8", "--b-dir", str(tmp_path / "missing")])
    assert "is not a directory" in capsys.readouterr().err


def test_control_side_rotates_and_is_summarised():
    """With the control A2 each side goes first every third round, and A2 / A is reported."""
    sides = ("A", "B", "A2")
    assert [ab_layer.order(r, sides) for r in range(3)] == [("A", "B", "A2"), ("B", "A2", "A"), ("A2", "A", "B")]
    s = ab_layer.summary({"A": [100.0, 110.0], "B": [95.0, 99.0], "A2": [101.0, 110.0]})
    assert s["A2_over_A_median"] == pytest.approx(1.005) and s["A2_over_A_max"] == pytest.approx(1.01)
    assert s["B_over_A_min"] == pytest.approx(0.9)


def test_plan_overrides_write_a_changed_copy(tmp_path):
    """``--b-set``: the point's shipped plan with the named fields changed, in a new directory that
    also keeps the side's own files; other points and shapes untouched."""
    import plan_override as po

    base = tmp_path / "mine"
    base.mkdir()
    (base / "other.json").write_text("{}")
    out = tmp_path / "out"
    said = po.write_overrides(["deepseek_v3:8192:gemm1.expert_order=1,gemm1.group_m=1024,pre_gather=1"],
                              ab_layer.ALL_SHAPES, str(base), out, "NVIDIA_H200")
    name = configs.config_file_name(256, 7168, 2048, torch.bfloat16, "NVIDIA_H200")
    shipped = json.loads((configs.CONFIG_DIR / name).read_text())
    mine = json.loads((out / name).read_text())
    plan = configs.Plan.from_dict(mine["8192"])
    assert plan.gemm1.expert_order == 1 and plan.gemm1.group_m == 1024 and plan.pre_gather
    assert plan.gemm2 == configs.Plan.from_dict(shipped["8192"]).gemm2
    assert mine["2048"] == shipped["2048"] and (out / "other.json").exists()
    assert said == ["deepseek_v3 M=8192: gemm1.expert_order=1,gemm1.group_m=1024,pre_gather=1 (changed)"]


@pytest.mark.parametrize("spec, match", [
    ("deepseek_v3:8192", "expected SHAPE:M:FIELD=VALUE"),
    ("llama:8192:gemm1.block_m=64", "shape 'llama' is not one of"),
    ("qwen3:0:gemm1.block_m=64", "M='0' must be a positive integer"),
    ("qwen3:2048:gemm3.block_m=64", "unknown field 'gemm3.block_m'"),
    ("qwen3:2048:gemm1.block_m=big", "gemm1.block_m='big' must be a non-negative integer"),
    ("qwen3:2048:pre_gather=2", "pre_gather='2' must be 0 or 1"),
    ("qwen3:2048:path=dense", "path='dense' must be one of"),
    ("qwen3:2048:block_m", "'block_m' is not FIELD=VALUE"),
])
def test_bad_plan_overrides_say_what_is_wrong(spec, match):
    import plan_override as po

    with pytest.raises(ValueError, match=match):
        po.parse_override(spec, ab_layer.ALL_SHAPES)


def test_override_of_an_untuned_point_is_refused(tmp_path, capsys):
    import plan_override as po

    with pytest.raises(ValueError, match="has no plan for M=3"):
        po.write_overrides(["qwen3:3:gemm1.block_m=64"], ab_layer.ALL_SHAPES, None, tmp_path, "NVIDIA_H200")
    with pytest.raises(SystemExit):
        ab_layer.main(["--points", "qwen3:8", "--b-set", "qwen3:8:gemm9.x=1"])
    assert "--b-set: plan override" in capsys.readouterr().err


def _row(b_over_a, b_max, control, same=False):
    a_plan = {"path": "sorted", "gemm1": {"block_m": 128}, "gemm2": {"block_m": 128}}
    b_plan = a_plan if same else {"path": "sorted", "gemm1": {"block_m": 64}, "gemm2": {"block_m": 128}}
    row = {"shape": "deepseek_v3", "M": 8192, "sides": {"A": {"plan_dict": a_plan}, "B": {"plan_dict": b_plan}},
           "B_over_A_median": b_over_a, "B_over_A_max": b_max, "B_median_us": 12500.04}
    if control is not None:
        row["A2_over_A_median"] = control
    return row


@pytest.mark.parametrize("row, ok, why", [
    (_row(0.9716, 0.9772, 1.0025), True, "every round faster"),  # run 7's expert order
    (_row(1.0045, 1.0399, 1.0032), False, "not faster in every round"),  # run 7's split-K
    (_row(0.995, 0.999, 1.0), False, "below 1%"),
    (_row(0.98, 0.99, 1.012), False, "twice the control"),
    (_row(0.97, 0.98, None), False, "no control"),
    (_row(0.97, 0.98, 1.0, same=True), False, "same plan"),
])
def test_verdict_needs_every_round_and_a_margin_over_the_control(row, ok, why):
    got, said = ab_layer.verdict(row)
    assert got is ok and why in said


def test_apply_writes_b_plan_only_where_it_won(tmp_path):
    won, lost = _row(0.9716, 0.9772, 1.0025), _row(1.0045, 1.0399, 1.0032)
    lost["shape"], lost["M"] = "mixtral", 2048
    said = ab_layer.apply_rows([won, lost], tmp_path, "NVIDIA_H200")
    name = configs.config_file_name(256, 7168, 2048, torch.bfloat16, "NVIDIA_H200")
    table = json.loads((tmp_path / name).read_text())
    shipped = json.loads((configs.CONFIG_DIR / name).read_text())
    assert table["8192"]["gemm1"] == {"block_m": 64} and table["8192"]["us"] == 12500.0
    assert "ab_layer.py --apply" in table["8192"]["_from"] and table["2048"] == shipped["2048"]
    assert not (tmp_path / configs.config_file_name(8, 4096, 14336, torch.bfloat16, "NVIDIA_H200")).exists()
    assert said[0].startswith("deepseek_v3 M=8192: B's plan written") and said[1].startswith("mixtral M=2048: kept")


def test_apply_needs_the_control(capsys):
    with pytest.raises(SystemExit):
        ab_layer.main(["--points", "qwen3:8", "--apply"])
    assert "--apply needs --control" in capsys.readouterr().err
