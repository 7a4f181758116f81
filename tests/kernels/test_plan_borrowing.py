"""Plans for shapes without tuned files of their own (``kernels/triton/configs.py``): borrowed from
the same device's files by rows per expert, sm_90 devices reading the H200's files, and the
default heuristic when nothing can be borrowed."""
import json
import logging

import pytest
import torch

pytest.importorskip("triton")

from moe_compile.kernels.triton import configs  # noqa: E402
from moe_compile.kernels.triton.configs import ExpertsPath, Plan  # noqa: E402
from moe_compile.kernels.triton.gemm import GemmConfig  # noqa: E402
from moe_compile.testing.logs import captured_logs  # noqa: E402

CPU = torch.device("cpu")


def _plan(path: str, block_m: int, block_n: int) -> dict:
    g = GemmConfig(block_m=block_m, block_n=block_n, block_k=64, tma=1)
    return Plan(ExpertsPath(path), g, g).to_dict()


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    """Three files for the CPU device key: top-2 over 8 experts (decode, 64 and 2048 rows per
    expert, the last on grouped_mm), top-8 over 128 (2 and 128 rows per expert) and one without
    ``_top_k`` whose 8192-token entry would match 512 rows per expert exactly."""
    files = {
        "E8_H4096_I14336_bf16_cpu.json": {"_top_k": 2, "1": _plan("pairs", 16, 64), "256": _plan("sorted", 64, 64),
                                          "8192": _plan("grouped_mm", 128, 128)},
        "E128_H2048_I768_bf16_cpu.json": {"_top_k": 8, "32": _plan("sorted", 16, 32),
                                          "2048": _plan("sorted", 128, 256)},
        "E16_H1024_I512_bf16_cpu.json": {"1024": _plan("sorted", 32, 32)},
    }
    for name, table in files.items():
        (tmp_path / name).write_text(json.dumps(table))
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.reload()
    configs._SAID.clear()
    yield tmp_path
    configs.reload()


def _choose(num_tokens, top_k=8, num_local=64, hidden=2048, inter=1024):
    return configs.choose_plan(num_tokens=num_tokens, top_k=top_k, num_local=num_local, hidden=hidden, inter=inter,
                               dtype=torch.bfloat16, device=CPU)


def test_an_untuned_shape_borrows_the_nearest_rows_per_expert(tuned_dir):
    with captured_logs(logging.INFO) as messages:
        plan = _choose(1024)  # 8192 pairs over 64 experts: 128 rows per expert
        assert plan == Plan.from_dict(_plan("sorted", 128, 256))
        assert _choose(1024) == plan
    said = [m for m in messages if "no tuned plans" in m]
    assert len(said) == 1 and "E64_H2048_I1024_bf16_cpu.json" in said[0]
    assert "python -m moe_compile tune --shape 64,8,2048,1024" in said[0]
    assert _choose(256) == Plan.from_dict(_plan("sorted", 64, 64))  # 32 rows per expert: 64 is nearer than 128
    assert _choose(64) == Plan.from_dict(_plan("sorted", 16, 32))  # 8 rows per expert: 2 is nearer than 64
    assert _choose(16) == Plan.from_dict(_plan("sorted", 16, 32))  # 2 rows per expert


def test_decode_borrows_a_decode_entry_and_batches_never_do(tuned_dir):
    decode = _choose(1)  # 8 pairs over 64 experts: pairs-eligible
    assert decode.path is ExpertsPath.PAIRS
    for m in (16, 64, 1024, 65536):
        assert _choose(m).path is ExpertsPath.SORTED


def test_a_decode_path_entry_is_borrowed_like_a_pairs_one(tuned_dir):
    """A tuned ``decode`` entry is a decode plan: a decode batch of an untuned shape borrows it,
    a batch whose pairs share experts does not, and its own shape's larger batches fall back."""
    name = "E8_H4096_I14336_bf16_cpu.json"
    table = json.loads((tuned_dir / name).read_text())
    table["1"] = configs.decode_plan(32, 256, 256, 8, 3, 1).to_dict()
    (tuned_dir / name).write_text(json.dumps(table))
    configs.reload()
    assert _choose(1) == configs.decode_plan(32, 256, 256, 8, 3, 1)  # 8 pairs over 64 experts
    assert _choose(16).path is ExpertsPath.SORTED
    own = configs.choose_plan(num_tokens=8, top_k=2, num_local=8, hidden=4096, inter=14336, dtype=torch.bfloat16,
                              device=CPU)  # 16 pairs over 8 experts share them: not the decode entry
    assert own.path is not ExpertsPath.DECODE


def test_grouped_mm_entries_and_files_without_top_k_are_not_borrowed(tuned_dir):
    # 512 rows per expert: the top-k-less file's entry would fit exactly, the grouped_mm one nearly
    plan = _choose(4096)
    assert plan == Plan.from_dict(_plan("sorted", 128, 256))
    found = configs.borrowed_plan(num_tokens=4096, top_k=8, num_local=64, hidden=2048, dtype=torch.bfloat16,
                                  device="cpu", exclude="E128_H2048_I768_bf16_cpu.json")
    assert found[0] == Plan.from_dict(_plan("sorted", 64, 64)) and found[1] == "E8_H4096_I14336_bf16_cpu.json M=256"


def test_a_shape_with_its_own_file_uses_it(tuned_dir):
    assert _choose(2048, num_local=128, hidden=2048, inter=768) == Plan.from_dict(_plan("sorted", 128, 256))
    assert _choose(32, num_local=128, hidden=2048, inter=768) == Plan.from_dict(_plan("sorted", 16, 32))


def test_nothing_to_borrow_gives_the_default_heuristic(tmp_path, monkeypatch):
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.reload()
    try:
        assert _choose(1024) == configs.default_plan(1024, 8, 64, 2048, 1024)
    finally:
        configs.reload()


def test_sm90_devices_read_the_h200_files():
    assert configs.tuned_device_keys("NVIDIA_H100_80GB_HBM3", (9, 0)) == ["NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"]
    assert configs.tuned_device_keys("NVIDIA_H200", (9, 0)) == ["NVIDIA_H200"]
    assert configs.tuned_device_keys("NVIDIA_A100-SXM4-80GB", (8, 0)) == ["NVIDIA_A100-SXM4-80GB"]


def test_the_shipped_files_record_their_top_k():
    shipped = {path.name: json.loads(path.read_text()) for path in configs.CONFIG_DIR.glob("*.json")}
    assert shipped and all(isinstance(t.get("_top_k"), int) for t in shipped.values())


def test_an_own_file_tuned_for_other_batch_sizes_only_is_passed_over(tuned_dir):
    """A partial tuning run (only M = 2048 for this shape): decode borrows a decode plan instead of
    running 2048 tokens' tiles; batches within 8x of 2048 use the file."""
    own = {"_top_k": 8, "2048": _plan("sorted", 128, 128)}
    (tuned_dir / "E64_H2048_I1024_bf16_cpu.json").write_text(json.dumps(own))
    with captured_logs(logging.INFO) as messages:
        assert _choose(1).path is ExpertsPath.PAIRS
        assert _choose(2).path is ExpertsPath.PAIRS
    said = [m for m in messages if "has no entry within 8x" in m]
    assert len(said) == 1 and "of 1 tokens" in said[0], messages  # once per file, not per batch size
    assert _choose(256) == Plan.from_dict(own["2048"])
    assert _choose(16384) == Plan.from_dict(own["2048"])
    assert _choose(32) == Plan.from_dict(_plan("sorted", 16, 32))  # 4 rows per expert: nearest is 2


def test_the_shipped_files_cover_their_range_without_borrowing():
    """Every M from 1 to 65536 finds an entry of the shape's own shipped file within FAR_OCTAVES."""
    import math

    for path in configs.CONFIG_DIR.glob("*.json"):
        ms = [int(m) for m in json.loads(path.read_text()) if not m.startswith("_")]
        for m in (2 ** i for i in range(17)):
            assert min(abs(math.log2(e) - math.log2(m)) for e in ms) <= configs.FAR_OCTAVES, (path.name, m)


def test_your_own_config_dir_is_searched_first(tuned_dir, tmp_path_factory, monkeypatch):
    """``$MOE_COMPILE_CONFIG_DIR``: a file there serves its shape, shadows a shipped file of the same
    name, and lends its plans to other shapes like the shipped ones."""
    user = tmp_path_factory.mktemp("user_configs")
    (user / "E64_H2048_I1024_bf16_cpu.json").write_text(json.dumps({"_top_k": 8, "512": _plan("sorted", 64, 128)}))
    (user / "E128_H2048_I768_bf16_cpu.json").write_text(json.dumps({"_top_k": 8, "2048": _plan("sorted", 32, 64)}))
    monkeypatch.setenv(configs.USER_DIR_ENV, str(user))
    configs.reload()
    assert configs.config_dirs() == [user, tuned_dir]
    assert _choose(1024) == Plan.from_dict(_plan("sorted", 64, 128))
    assert _choose(2048, num_local=128, hidden=2048, inter=768) == Plan.from_dict(_plan("sorted", 32, 64))
    # another shape at 128 rows per expert borrows the user's E128 entry, not the shadowed shipped one
    assert _choose(2048, num_local=128, hidden=4096, inter=1536) == Plan.from_dict(_plan("sorted", 32, 64))
    # without the directory, after configs.reload(), the shipped file is read again
    monkeypatch.delenv(configs.USER_DIR_ENV)
    configs.reload()
    assert _choose(2048, num_local=128, hidden=2048, inter=768) == Plan.from_dict(_plan("sorted", 128, 256))
    configs.reload()


def test_your_own_file_is_merged_over_the_shipped_one_entry_by_entry(tuned_dir, tmp_path_factory, monkeypatch):
    """Tuning one batch size into ``$MOE_COMPILE_CONFIG_DIR`` replaces the shipped plan at that M only:
    the shipped entries at other M stay in use (before, the partial file hid them and M = 2048 fell
    back to a borrowed plan), and the source names the directory an entry came from."""
    user = tmp_path_factory.mktemp("user_configs")
    name = "E128_H2048_I768_bf16_cpu.json"
    (user / name).write_text(json.dumps({"_top_k": 8, "32": _plan("sorted", 32, 64)}))
    monkeypatch.setenv(configs.USER_DIR_ENV, str(user))
    configs.reload()
    try:
        def source(m):
            return configs.plan_and_source(num_tokens=m, top_k=8, num_local=128, hidden=2048, inter=768,
                                           dtype=torch.bfloat16, keys=("cpu",))
        plan, where = source(32)
        assert plan == Plan.from_dict(_plan("sorted", 32, 64)) and where == f"tuned: {name} M=32 in {user}"
        plan, where = source(2048)
        assert plan == Plan.from_dict(_plan("sorted", 128, 256)) and where == f"tuned: {name} M=2048"
        merged, origin = configs.merged_raw(name)
        assert sorted(merged) == ["2048", "32", "_top_k"]
        assert origin["32"] == user / name and origin["2048"] == tuned_dir / name
        # shapes that borrow see the merged entries too: 128 rows per expert finds the shipped M = 2048
        assert _choose(2048, num_local=128, hidden=4096, inter=1536) == Plan.from_dict(_plan("sorted", 128, 256))
    finally:
        monkeypatch.delenv(configs.USER_DIR_ENV)
        configs.reload()
    assert configs.merged_raw("E1_H1_I1_bf16_cpu.json") is None


def test_a_decode_entry_for_a_larger_batch_falls_back_and_says_why(tuned_dir):
    (tuned_dir / "E64_H2048_I1024_bf16_cpu.json").write_text(json.dumps({"_top_k": 8, "1": _plan("pairs", 16, 64)}))
    with captured_logs(logging.INFO) as messages:
        plan, source = configs.plan_and_source(num_tokens=6, top_k=8, num_local=64, hidden=2048, inter=1024,
                                               dtype=torch.bfloat16, keys=("cpu",))
        configs.plan_and_source(num_tokens=7, top_k=8, num_local=64, hidden=2048, inter=1024,
                                dtype=torch.bfloat16, keys=("cpu",))
    assert plan == configs.default_plan(6, 8, 64, 2048, 1024) and source.startswith("default heuristic (")
    said = [m for m in messages if "is a decode plan" in m]
    assert len(said) == 1 and "E64_H2048_I1024_bf16_cpu.json M=1" in said[0]


def test_parse_shape_names_the_shape():
    assert configs.parse_shape("128,8,4096,1536") == (128, 8, 4096, 1536)
    for bad in ("128,8,4096", "x,8,4096,1536", "8,16,4096,1536", "0,1,2,3"):
        with pytest.raises(ValueError, match="shape"):
            configs.parse_shape(bad)


def test_a_borrowed_plan_runs_its_second_gemm_unsplit(tuned_dir):
    """Split-K is tuned for one shape's tile count and K: another shape borrowing that entry gets
    the same plan with ``split_k = 1``, while the shape that owns the file keeps its split."""
    g = GemmConfig(block_m=128, block_n=256, block_k=128, num_warps=8, tma=1)  # no other file's tile
    split = Plan(ExpertsPath.SORTED, g, GemmConfig(block_m=128, block_n=256, block_k=128, num_warps=8, tma=1,
                                                   split_k=3))
    (tuned_dir / "E32_H4096_I14336_bf16_cpu.json").write_text(json.dumps({"_top_k": 2, "8192": split.to_dict()}))
    configs.reload()
    own = _choose(8192, top_k=2, num_local=32, hidden=4096, inter=14336)
    assert own.gemm2.split_k == 3
    borrowed = _choose(8192, top_k=2, num_local=32, hidden=4096, inter=8192)  # 512 rows per expert, like the entry
    assert borrowed.gemm1 == split.gemm1 and borrowed.gemm2 == GemmConfig(128, 256, 128, num_warps=8, tma=1)
    _, source = configs.plan_and_source(num_tokens=8192, top_k=2, num_local=32, hidden=4096, inter=8192,
                                        dtype=torch.bfloat16, keys=("cpu",))
    assert "E32_H4096_I14336" in source and "second GEMM unsplit" in source
