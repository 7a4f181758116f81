"""selfcheck: the no-NPU exit, and its op checks and model check run on CPU with the emulation as
the "device" (so the comparison machinery and the goldens are exercised; a broken op must FAIL)."""
import types

import torch

from moe_compile.testing import emulated_npu
from moe_compile.tools.selfcheck import check_model, format_table, main, op_cases, run_op_checks

LOWERING_OPS = {"npu_moe_gating_top_k_softmax", "npu_moe_gating_top_k", "npu_moe_init_routing_v2",
                "npu_grouped_matmul", "npu_swiglu", "npu_moe_token_permute", "npu_moe_token_unpermute"}


def test_exits_with_a_clear_message_without_an_npu(capsys):
    assert main(["--device", "npu"]) == 2
    err = capsys.readouterr().err
    assert "needs an Ascend NPU" in err and "torch_npu cannot be imported" in err
    with emulated_npu():
        assert main(["--device", "npu"]) == 2
    assert "emulation" in capsys.readouterr().err


def test_cases_cover_every_op_the_lowering_uses_and_pass_on_the_emulation():
    assert LOWERING_OPS <= {case.op for case in op_cases()}
    with emulated_npu(poison=True):
        import torch_npu

        rows = run_op_checks(torch_npu, "cpu")
    assert rows and all(r.ok for r in rows), format_table(rows)
    assert all(r.err_emulation == 0 for r in rows)  # the device *is* the emulation here
    table = format_table(rows)
    assert table.splitlines()[0].split()[:2] == ["op", "case"] and table.count("PASS") == len(rows)


def test_a_wrong_or_crashing_device_op_fails_its_rows():
    with emulated_npu():
        import torch_npu

        def swapped_swiglu(x, dim=-1):  # gate taken from the second half: the convention mix-up
            a, b = x.chunk(2, dim)
            return b * torch.sigmoid(b) * a

        def broken_gmm(*args, **kwargs):
            raise RuntimeError("aclnnGroupedMatmul failed")

        device = types.SimpleNamespace(**{name: getattr(torch_npu, name) for name in LOWERING_OPS})
        device.npu_moe_finalize_routing = torch_npu.npu_moe_finalize_routing
        device.npu_swiglu, device.npu_grouped_matmul = swapped_swiglu, broken_gmm
        rows = run_op_checks(device, "cpu")
    failed = {r.op for r in rows if not r.ok}
    assert failed == {"npu_swiglu", "npu_grouped_matmul"}
    assert all("aclnnGroupedMatmul failed" in r.note for r in rows if r.op == "npu_grouped_matmul")


def test_model_check_runs_eager_and_compiled():
    with emulated_npu():
        rows = check_model("cpu", {"aot_eager": "aot_eager"})
    assert [r.case for r in rows] == ["eager", "aot_eager"] and all(r.ok for r in rows), format_table(rows)
