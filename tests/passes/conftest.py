"""Every pass test also checks that no compile silently fell back to the original graph (the
backend's ``pass_failed`` counter), unless it is marked ``expects_fallback``."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _no_silent_fallback(request):
    torch._dynamo.utils.counters["moe_compile"].pop("pass_failed", None)
    yield
    if request.node.get_closest_marker("expects_fallback") is None:
        failed = torch._dynamo.utils.counters["moe_compile"].get("pass_failed", 0)
        assert failed == 0, f"{failed} compile(s) fell back to the original graph (see the RuntimeWarning)"
