"""When the kernels launch with programmatic dependent launch (the launch itself is checked on the
H200: selfcheck and the GPU kernel tests run with it on; CI compiles every PDL launch for sm_90)."""

import pytest
import torch

pytest.importorskip("triton")

from moe_compile.kernels.triton import pdl  # noqa: E402


@pytest.fixture(autouse=True)
def _no_force(monkeypatch):
    monkeypatch.setattr(pdl, "FORCE", None)


def test_off_on_the_cpu_and_under_the_interpreter():
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.pdl_launch(torch.device("cpu")) == {}


def test_force_overrides_but_never_turns_it_on_off_cuda(monkeypatch):
    monkeypatch.setattr(pdl, "FORCE", True)
    assert not pdl.pdl_enabled(torch.device("cpu"))
    monkeypatch.setattr(pdl, "FORCE", False)
    assert pdl.pdl_launch(torch.device("cuda", 0)) == {}


def test_env_switch_and_capability(monkeypatch):
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(pdl, "_capable", lambda index: index == 0)
    monkeypatch.setattr(pdl.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(pdl, "HAVE_GDC", True)
    monkeypatch.delenv("MOE_COMPILE_PDL", raising=False)
    assert pdl.pdl_enabled(torch.device("cuda", 0))
    assert pdl.pdl_launch(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    assert not pdl.pdl_enabled(torch.device("cuda", 1))  # an older GPU
    monkeypatch.setenv("MOE_COMPILE_PDL", "0")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("MOE_COMPILE_PDL", "1")
    monkeypatch.setattr(pdl, "HAVE_GDC", False)  # a triton without the gdc intrinsics
    assert not pdl.pdl_enabled(torch.device("cuda", 0))


def test_env_value_follows_os_environ(monkeypatch):
    from moe_compile.kernels.triton import env_value, interpreting

    monkeypatch.setenv("MOE_COMPILE_TEST_SWITCH", "on")
    assert env_value("MOE_COMPILE_TEST_SWITCH", "off") == "on"
    monkeypatch.delenv("MOE_COMPILE_TEST_SWITCH")
    assert env_value("MOE_COMPILE_TEST_SWITCH", "off") == "off"
    for value, expected in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert interpreting() is expected
