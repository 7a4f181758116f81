"""``python -m moe_compile {demo, inspect, selfcheck, plan, tune}``."""
from __future__ import annotations

import pytest

from moe_compile.__main__ import main


def test_inspect_prints_the_report_table(capsys):
    assert main(["inspect", "qwen3_moe"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp" in out and "rewritten" in out and "softmax→topk" in out


def test_inspect_unknown_type_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["inspect", "no_such_model"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "'no_such_model'" in err and "mixtral" in err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--model", "bogus"], "--model: model_type must be one of ["),
    (["demo", "--tokens", "0"], "argument --tokens: expected an int >= 1, got 0"),
    (["demo", "--tokens", "-1"], "argument --tokens: expected an int >= 1, got -1"),
    (["demo", "--batch", "0"], "argument --batch: expected an int >= 1, got 0"),
    (["demo", "--repeats", "0"], "argument --repeats: expected an int >= 1, got 0"),
    (["demo", "--tokens", "abc"], "argument --tokens: expected an int >= 1, got 'abc'"),
    (["inspect", "mixtral", "--experts-implementation", "bogus"],
     "experts_implementation for 'mixtral' must be one of ['grouped_mm', 'batched_mm', 'eager'] (or None), "
     "but got 'bogus'"),
    (["plan", "--shape", "8,2,64,32", "--tokens", "0"], "argument --tokens: expected an int >= 1, got 0"),
    (["plan", "--shape", "8,2,64,32", "--tokens", "32", "-5"], "argument --tokens: expected an int >= 1, got -5"),
], ids=["model", "tokens0", "tokens-1", "batch0", "repeats0", "tokens_abc", "experts_impl", "plan_tokens0",
        "plan_tokens-5"])
def test_bad_arguments_are_refused_up_front(argv, message, capsys, monkeypatch):
    """rc 2 and argparse's usage + message, before any model is built (no traceback after a compile)."""
    from moe_compile.testing import zoo

    monkeypatch.setattr(zoo, "build_model", lambda *a, **k: pytest.fail("built a model for bad arguments"))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"python -m moe_compile {argv[0]}: error: " in err and message in err, err


@pytest.mark.parametrize("command", [["demo", "--inner-compiler", "eager"], ["inspect", "mixtral"]])
def test_an_unwritable_dump_dir_is_refused_before_compiling(command, capsys, monkeypatch, tmp_path):
    from moe_compile.testing import zoo

    monkeypatch.setattr(zoo, "build_model", lambda *a, **k: pytest.fail("built a model for an unusable --dump-dir"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(command + ["--dump-dir", str(blocker / "graphs")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "cannot write graph files to --dump-dir" in err and "a_file" in err


def test_bad_argument_exit_status_from_the_command_line():
    """``python -m moe_compile demo --repeats 0`` (was a ZeroDivisionError after compiling)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "moe_compile", "demo", "--repeats", "0"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --repeats: expected an int >= 1, got 0" in done.stderr


def test_demo_reports_rewrite_difference_and_times(capsys):
    assert main(["demo", "--tokens", "4", "--batch", "1", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 MoE block(s) rewritten" in out
    assert "max |compiled - eager| =" in out and "eager" in out and "compiled" in out
    diff = float(out.split("max |compiled - eager| = ")[1].split()[0])
    assert diff <= 1e-4
    assert "CPU decode: 2 fused MoE node(s)" in out  # 4 tokens x top-2 of 8 experts: the gather-GEMV path


def test_selfcheck_without_an_npu_says_why(capsys):
    assert main(["selfcheck", "--device", "npu"]) == 2
    captured = capsys.readouterr()
    assert "npu" in (captured.out + captured.err).lower()


def test_plan_shows_tuned_borrowed_and_default_plans(capsys):
    """``plan``: for each token count the plan the CUDA experts would run and where it comes from."""
    pytest.importorskip("triton")
    from moe_compile.__main__ import main as cli

    assert cli(["plan", "--shape", "128,8,2048,768", "--device-key", "NVIDIA_H200", "--sm90", "--tokens", "1",
                "2048"]) == 0
    out = capsys.readouterr().out
    assert "M=1 " in out and "pairs |" in out and "from tuned: E128_H2048_I768_bf16_NVIDIA_H200.json M=1" in out
    assert "from tuned: E128_H2048_I768_bf16_NVIDIA_H200.json M=2048" in out
    # another model's sizes on an H100 read the H200's files and borrow by rows per expert
    assert cli(["plan", "--shape", "64,8,2048,1024", "--device-key", "NVIDIA_H100_80GB_HBM3", "--sm90",
                "--tokens", "1024"]) == 0
    out = capsys.readouterr().out
    assert "from borrowed: E128_H2048_I768_bf16_NVIDIA_H200.json M=2048" in out  # 128 rows per expert
    assert "no tuned plans E64_H2048_I1024_bf16_NVIDIA_H100_80GB_HBM3.json" in out
    assert cli(["plan", "--shape", "128,8,2048,768", "--device-key", "NVIDIA_H100_80GB_HBM3", "--sm90",
                "--tokens", "2048"]) == 0
    assert "from tuned: E128_H2048_I768_bf16_NVIDIA_H200.json M=2048" in capsys.readouterr().out
    # a device without any files: the default heuristic, said
    assert cli(["plan", "--shape", "64,8,2048,1024", "--device-key", "SOME_GPU", "--tokens", "1024"]) == 0
    assert "from default heuristic (no tuned plans" in capsys.readouterr().out
    for bad in ("64,8,2048", "8,16,2048,1024"):
        assert cli(["plan", "--shape", bad]) == 2
        assert "--shape" in capsys.readouterr().err


def test_tune_checks_its_options_and_needs_cuda(capsys):
    """``tune``: a shape is required and checked; without CUDA it says so instead of failing in a kernel."""
    pytest.importorskip("triton")
    import torch

    with pytest.raises(SystemExit) as exc:
        main(["tune"])
    assert exc.value.code == 2 and "give at least one --shape" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--shape", "8,2,64"])
    assert "--shape" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--shape", "8,2,64,32", "--ms", "0"])
    assert "--ms must be token counts >= 1" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["tune", "--shape", "8,2,64,32"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


def test_tune_refuses_an_out_dir_it_cannot_write(capsys, tmp_path):
    """Found before any GPU time is spent: a --out under a file cannot be created."""
    pytest.importorskip("triton")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["tune", "--shape", "8,2,64,32", "--out", str(blocker / "configs")]) == 2
    err = capsys.readouterr().err
    assert "cannot write tuned files to --out" in err and "MOE_COMPILE_CONFIG_DIR" in err


def test_tune_writes_a_file_the_backend_reads(monkeypatch, tmp_path):
    """``tune_shapes`` (with the GPU timing faked): one entry per token count, ``_top_k`` for shapes
    that borrow, written where ``configs`` then finds it, and ``--refine`` starts from the file's plan."""
    pytest.importorskip("triton")
    import torch

    import moe_compile.tools.tune as tt
    from moe_compile.kernels.triton import configs
    from moe_compile.kernels.triton.configs import ExpertsPath, Plan

    G = tt.GemmConfig
    fast = Plan(ExpertsPath.SORTED, G(64, 128, 64, 8, 4, 4, 1), G(64, 128, 64, 8, 4, 4, 1))
    seen = []
    monkeypatch.setattr(tt, "hf_layout_weights", lambda shape: None)
    monkeypatch.setattr(tt, "device_key", lambda device: "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a test device")
    monkeypatch.setattr(tt, "tune_point", lambda shape, m, w, reps, log: (9.0, fast))

    def refine(shape, m, w, reps, log, current, session):
        seen.append((m, current))
        return 7.5 + m, current
    monkeypatch.setattr(tt, "refine_point", refine)
    shape = tt.custom_shape("8,2,64,32")
    tt.tune_shapes([shape], [4, 64], tmp_path)
    path = tmp_path / configs.config_file_name(8, 64, 32, torch.bfloat16, "cpu")
    table = __import__("json").loads(path.read_text())
    assert list(table) == ["4", "64", "_note", "_top_k"] and table["_top_k"] == 2
    assert Plan.from_dict(table["64"]) == fast and table["64"]["us"] == 71.5
    assert "python -m moe_compile tune" in table["_note"] and "a test device" in table["_note"]
    monkeypatch.setenv(configs.USER_DIR_ENV, str(tmp_path))
    assert configs.choose_plan(num_tokens=64, top_k=2, num_local=8, hidden=64, inter=32, dtype=torch.bfloat16,
                               device=torch.device("cpu")) == fast
    seen.clear()
    monkeypatch.setattr(tt, "tune_point", lambda *a: pytest.fail("--refine must not search again"))
    tt.tune_shapes([shape], [64], tmp_path, refine=True)
    assert seen == [(64, fast)]
    # --refine into another --out starts from the plan the backend reads now (the merged files)
    seen.clear()
    elsewhere = tmp_path / "elsewhere"
    tt.tune_shapes([shape], [64], elsewhere, refine=True)
    assert seen == [(64, fast)] and (elsewhere / path.name).exists()


def test_inspect_export_reports_the_exported_programs_rewrite(capsys, tmp_path):
    assert main(["inspect", "mixtral", "--export", "--dump-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.mlp" in out and "2 MoE block(s) rewritten, 0 skipped" in out
    after = [p for p in tmp_path.iterdir() if "after" in p.name]
    assert after and "moe_compile.fused_moe" in after[0].read_text()
