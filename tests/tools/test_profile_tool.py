"""``python -m moe_compile.tools.profile`` writes a Chrome trace of one ModularKernel forward."""
from __future__ import annotations

import json
import os
import sys

import pytest

from moe_compile.tools import profile
from moe_compile.tools.profile import main


@pytest.mark.parametrize("pf, ex", [("StandardPrepareAndFinalize", "GroupedExperts"),
                                    ("BatchedPrepareAndFinalize", "BatchedExperts")])
def test_trace_is_written(pf, ex, tmp_path, capsys):
    trace_dir = tmp_path / "traces"
    code = main(["--pf-type", pf, "--experts-type", ex, "--trace-dir", str(trace_dir), "-m", "16", "--topk", "2",
                 "--warmup", "2", "--device", "cpu", "--dtype", "fp32"])
    assert code == 0
    files = os.listdir(trace_dir)
    assert files == [f"m16_topk2_{pf}_{ex}_trace.json"]
    assert str(trace_dir / files[0]) in capsys.readouterr().out
    with open(trace_dir / files[0]) as fh:
        events = json.load(fh)["traceEvents"]
    names = {e.get("name") for e in events}
    assert "ModularKernel.forward" in names  # the profiled range
    gemm = "aten::bmm" if ex == "BatchedExperts" else "aten::_grouped_mm"
    assert gemm in names or "aten::mm" in names
    # exactly one profiled forward
    assert sum(1 for e in events if e.get("name") == "ModularKernel.forward") == 1


def test_incompatible_pair_writes_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--pf-type", "BatchedPrepareAndFinalize", "--experts-type", "ReferenceExperts",
              "--trace-dir", str(tmp_path / "t")])
    assert exit_info.value.code == 2
    assert "incompatible pair" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_trace_dir_is_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--pf-type", "StandardPrepareAndFinalize", "--experts-type", "GroupedExperts"])
    assert exit_info.value.code == 2 and "--trace-dir" in capsys.readouterr().err


@pytest.mark.parametrize("make_bad", [lambda tmp: tmp / "a_file", lambda tmp: tmp / "a_file" / "sub"],
                         ids=["is-a-file", "under-a-file"])
def test_unusable_trace_dir_fails_before_profiling(make_bad, tmp_path, monkeypatch, capsys):
    """Before: the directory was made only after profiling, and failed with a raw OSError."""
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(profile, "profile_case", lambda *a, **k: pytest.fail("profiled despite a bad --trace-dir"))
    bad = make_bad(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--pf-type", "StandardPrepareAndFinalize", "--experts-type", "GroupedExperts",
              "--trace-dir", str(bad), "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--trace-dir {str(bad)!r}" in err and "writable" in err


def test_unavailable_device_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        main(["--pf-type", "StandardPrepareAndFinalize", "--experts-type", "GroupedExperts",
              "--trace-dir", str(tmp_path / "t"), "--device", "npu"])
    assert exit_info.value.code == 2 and "--device 'npu'" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
