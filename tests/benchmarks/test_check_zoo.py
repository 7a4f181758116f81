"""``benchmarks/check_zoo.py``: a family under ``dynamic=True`` is rewritten and matches eager; a
pass that fails is flagged with exit code 1; bad options are refused."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import check_zoo  # noqa: E402


def test_a_family_under_dynamic_true_is_rewritten(capsys):
    assert check_zoo.main(["--dynamic", "--families", "qwen3_moe", "--tokens", "5", "7"]) == 0
    out = capsys.readouterr().out
    assert "'rewritten': 2" in out and "none flagged" in out


@pytest.mark.expects_fallback
def test_a_failing_pass_is_flagged(capsys, monkeypatch):
    from moe_compile.passes.moe_pass import MoEFusionPass

    def broken(self, graph):
        raise RuntimeError("broken on purpose")
    monkeypatch.setattr(MoEFusionPass, "__call__", broken)
    assert check_zoo.main(["--families", "qwen3_moe", "--tokens", "5"]) == 1
    assert "1 flagged: ['qwen3_moe']" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [(["--tokens", "0"], "--tokens must be positive"),
                                        (["--families", "nope"], "unknown ['nope']")])
def test_bad_options_are_refused(argv, words, capsys):
    with pytest.raises(SystemExit):
        check_zoo.main(argv)
    assert words in capsys.readouterr().err
