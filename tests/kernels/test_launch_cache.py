"""``launch``: our cached Triton launches. On the CPU: a real ``JITFunction`` and Triton's own binder, with
the compile-and-launch and the compiled kernel's C launcher replaced by recorders (no GPU here). On the
H200: every CUDA path with the cache on against off, bit for bit, misaligned inputs after aligned ones,
and a CUDA graph captured through the cached launches."""
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from moe_compile.kernels.triton import launch as launch_mod  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def no_op_graphs(monkeypatch):
    """Every call here launches its kernels (a replay of the op's own CUDA graph would launch none)."""
    from moe_compile.lowering import op_graphs

    monkeypatch.setattr(op_graphs.SETTINGS, "enabled", False)


def _toy_fn(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


_toy = JITFunction(_toy_fn)  # a compiled-mode kernel object even under the interpreter the CPU tests use


class _Compiled:
    function, packed_metadata = "fn-handle", "packed"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args))


@pytest.fixture
def fake_gpu(monkeypatch):
    """``launch`` as on a GPU, with ``_toy``'s compile-and-launch and its C launcher recorded."""
    log = []
    launch_mod.clear()
    monkeypatch.setattr(launch_mod, "ENABLED", True)
    monkeypatch.setattr(launch_mod.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_mod.torch._C, "_cuda_getCurrentRawStream", lambda device: 777, raising=False)

    def run(*args, grid, warmup, **kwargs):
        log.append(("jit", grid, args, kwargs))
        return _Compiled(log)

    monkeypatch.setattr(_toy, "run", run)
    yield log
    launch_mod.clear()


def _kinds(log):
    return [entry[0] for entry in log]


def test_a_repeat_launch_takes_the_compiled_kernel_with_every_parameter_in_order(fake_gpu):
    x, out = torch.zeros(64), torch.zeros(64)
    launch_mod.launch(_toy, (3,), x, out, 64, 0.5, BLOCK=32, num_warps=4)
    launch_mod.launch(_toy, (5, 2), x, out, 64, 0.5, BLOCK=32, num_warps=4)
    assert _kinds(fake_gpu) == ["jit", "direct"]
    assert fake_gpu[0][1] == (3,) and fake_gpu[0][3] == dict(BLOCK=32, num_warps=4)
    # grid padded to 3-D, the stream, the handles, no launch metadata or hooks, then the kernel's
    # parameters in order with the constexprs (FLAG from its default)
    assert fake_gpu[1][1] == (5, 2, 1, 777, "fn-handle", "packed", None, None, None, x, out, 64, 0.5, 32, False)


@pytest.mark.parametrize("change", ["alignment", "int_divisibility", "int_one", "int_range", "dtype", "constexpr",
                                    "option", "type"])
def test_a_new_specialisation_is_launched_through_triton(fake_gpu, change):
    base = torch.zeros(80)
    x, out, n, kw = base[:64], torch.zeros(64), 64, dict(BLOCK=32, num_warps=4)
    launch_mod.launch(_toy, (1,), x, out, n, 0.5, **kw)
    if change == "alignment":
        x = base[1:65]  # 4 bytes past a 16-byte boundary
    elif change == "int_divisibility":
        n = 63
    elif change == "int_one":
        n = 1  # Triton makes an int of 1 a constant
    elif change == "int_range":
        n = 2 ** 32  # an i64
    elif change == "dtype":
        x = torch.zeros(64, dtype=torch.float16)
    elif change == "constexpr":
        kw = dict(BLOCK=32, FLAG=True, num_warps=4)
    elif change == "option":
        kw = dict(BLOCK=32, num_warps=8)
    else:
        out = None  # a constexpr None
    launch_mod.launch(_toy, (1,), x, out, n, 0.5, **kw)
    launch_mod.launch(_toy, (1,), x, out, n, 0.5, **kw)
    assert _kinds(fake_gpu) == ["jit", "jit", "direct"]


def test_values_that_triton_does_not_specialise_on_reuse_the_kernel(fake_gpu):
    a, b = torch.zeros(64), torch.zeros(128)
    launch_mod.launch(_toy, (1,), a, a, 64, 0.5, BLOCK=32)
    launch_mod.launch(_toy, (1,), b, b, 128, 2.0, BLOCK=32)  # other pointers, another multiple of 16, a float
    assert _kinds(fake_gpu) == ["jit", "direct"]
    assert fake_gpu[1][1][9:13] == (b, b, 128, 2.0)


def _values():
    t = torch.zeros(96, dtype=torch.float32)
    ints = [0, 1, 2, 15, 16, 17, 32, 48, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -16, -1, -(2 ** 31),
            -(2 ** 31) - 16, 2 ** 63 - 16, 2 ** 63, 2 ** 63 + 16]
    tensors = [t, t[1:], t[4:], t[8:], t.half(), t.half()[8:], t.bfloat16()[1:], t.int()]
    return ints + tensors + [0.0, 0.5, 1.0, -1.0, 16.0, 1e300, True, False, None]


@pytest.mark.parametrize("a", range(len(_values())))
def test_one_key_never_spans_two_triton_specialisations(a):
    """Our key of an argument decides Triton's own specialisation of it (``native_specialize_impl``, what the
    binder calls): equal keys, equal specialisations."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    values = _values()
    x = values[a]
    key_x = launch_mod._keyer((type(x),))(x)
    for y in values:
        if type(y) is type(x) and launch_mod._keyer((type(y),))(y) == key_x:
            assert (native_specialize_impl(BaseBackend, y, False, True, True)
                    == native_specialize_impl(BaseBackend, x, False, True, True)), (x, y)


def test_launch_hooks_disabled_switch_interpreted_kernels_and_unkeyed_types_take_triton(fake_gpu, monkeypatch):
    from triton import knobs

    x = torch.zeros(64)
    calls = []
    monkeypatch.setattr(type(_toy), "__getitem__", lambda self, grid: lambda *a, **k: calls.append(grid))
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # a HookChain (triton >= 3.5)
        hook.add(print)
        try:
            launch_mod.launch(_toy, (1,), x, x, 64, 0.5, BLOCK=32)
            launch_mod.launch(_toy, (1,), x, x, 64, 0.5, BLOCK=32)
        finally:
            hook.remove(print)
        assert calls == [(1,), (1,)]
    monkeypatch.setattr(launch_mod, "ENABLED", False)
    launch_mod.launch(_toy, (2,), x, x, 64, 0.5, BLOCK=32)
    monkeypatch.setattr(launch_mod, "ENABLED", True)
    launch_mod.launch(_toy, (3,), x, x, [64], 0.5, BLOCK=32)  # a list: no key for it
    launch_mod.launch(_toy, (3,), x, x, [64], 0.5, BLOCK=32)
    assert calls[-3:] == [(2,), (3,), (3,)] and "direct" not in _kinds(fake_gpu)

    class Interpreted:  # what triton.jit gives under TRITON_INTERPRET: no device caches
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(("interpreted", grid))

    launch_mod.launch(Interpreted(), (4,), x)
    launch_mod.launch(Interpreted(), (4,), x)
    assert calls[-2:] == [("interpreted", (4,))] * 2


def test_a_full_cache_is_cleared_not_grown(fake_gpu, monkeypatch):
    monkeypatch.setattr(launch_mod, "MAX_ENTRIES", 2)
    x = torch.zeros(64)
    for block in (16, 32, 64):
        launch_mod.launch(_toy, (1,), x, x, 64, 0.5, BLOCK=block)
    assert len(launch_mod._CACHE) == 1
    launch_mod.launch(_toy, (1,), x, x, 64, 0.5, BLOCK=64)
    assert _kinds(fake_gpu) == ["jit", "jit", "jit", "direct"]


# ----------------------------------------------------------------------------------------------- H200


def _layer(tokens, num_experts, hidden, inter, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(tokens, num_experts, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5).bfloat16()
    return x, logits, w13.transpose(1, 2), w2.transpose(1, 2)


def _both_ways(fn, monkeypatch):
    direct = []
    orig = launch_mod._direct
    monkeypatch.setattr(launch_mod, "_direct", lambda *a: (direct.append(1), orig(*a)))
    monkeypatch.setattr(launch_mod, "ENABLED", False)
    want = fn()
    monkeypatch.setattr(launch_mod, "ENABLED", True)
    fn()  # a miss per specialisation
    got = fn()
    torch.cuda.synchronize()
    return want, got, len(direct)


@gpu
@pytest.mark.parametrize("tokens", [1, 7, 64, 600])
@pytest.mark.parametrize("routing", ["softmax", "grouped_sigmoid"])
def test_cached_launches_give_the_same_bits_on_every_path(tokens, routing, monkeypatch):
    from moe_compile import fused_moe

    x, logits, w13, w2 = _layer(tokens, 64, 512, 256)
    kw = dict(routing_method="softmax", renormalize=True) if routing == "softmax" else dict(
        routing_method="sigmoid", renormalize=True, routed_scaling_factor=2.5, k_group=2, group_count=4,
        group_select_mode=1, e_score_correction_bias=torch.randn(64, device="cuda") * 0.05)
    want, got, hits = _both_ways(lambda: fused_moe(x, logits, 64, 6, w13, w2, **kw), monkeypatch)
    assert hits >= 3  # routing, both GEMMs (or the GEMVs) and the combine, from the cache
    assert torch.equal(got, want)


@gpu
@pytest.mark.parametrize("path", ["pairs", "sorted", "grouped_mm", "decode", "gemv"])
def test_each_experts_path_through_the_cache(path, monkeypatch):
    from moe_compile.kernels.triton.configs import ExpertsPath, GemmConfig, Plan, decode_plan
    from moe_compile.kernels.triton.experts import fused_experts
    from moe_compile.modular import ExpertWeights
    from moe_compile.ops.config import ExpertsConfig

    tokens, top_k = (2, 4) if path in ("decode", "gemv") else (300, 4)
    x, logits, w13, w2 = _layer(tokens, 32, 512, 256, seed=1)
    weights, ids = torch.topk(logits.float().softmax(-1), top_k)
    plans = {"pairs": Plan(ExpertsPath.PAIRS, GemmConfig(block_m=16), GemmConfig(block_m=16)),
             "sorted": Plan(ExpertsPath.SORTED, GemmConfig(), GemmConfig()),
             "grouped_mm": Plan(ExpertsPath.GROUPED_MM, GemmConfig(), GemmConfig(), pre_gather=True),
             "decode": decode_plan(32, 128, 256),
             "gemv": Plan(ExpertsPath.GEMV, GemmConfig(block_n=16, block_k=256, num_warps=4),
                          GemmConfig(block_n=16, block_k=256, num_warps=4))}
    run = lambda: fused_experts(x, weights, ids.int(), ExpertWeights(w13, w2), ExpertsConfig(),  # noqa: E731
                                plan=plans[path])
    want, got, hits = _both_ways(run, monkeypatch)
    assert hits >= (1 if path == "decode" else 2)  # the decode path is one launch
    if path == "decode":  # its rows are summed by fp32 atomics, in no fixed order
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)
    else:
        assert torch.equal(got, want)


@gpu
def test_a_misaligned_input_after_an_aligned_one(monkeypatch):
    """The kernel specialised for 16-byte aligned pointers must not run on a pointer 2 bytes past one."""
    from moe_compile import fused_moe

    monkeypatch.setattr(launch_mod, "ENABLED", True)
    x, logits, w13, w2 = _layer(33, 16, 256, 128, seed=2)
    wide = torch.zeros(33, 264, device="cuda", dtype=torch.bfloat16)
    wide[:, 1:257] = x
    aligned = fused_moe(x, logits, 16, 2, w13, w2, renormalize=True)
    again = fused_moe(x, logits, 16, 2, w13, w2, renormalize=True)
    shifted = fused_moe(wide[:, 1:257], logits, 16, 2, w13, w2, renormalize=True)
    assert wide[:, 1:257].data_ptr() % 16 == 2
    assert torch.equal(again, aligned)
    torch.testing.assert_close(shifted, aligned, rtol=1.6e-2, atol=1e-3)  # bf16: another load width may round


@gpu
def test_a_cuda_graph_captured_through_cached_launches_replays_new_inputs(monkeypatch):
    from moe_compile import fused_moe

    monkeypatch.setattr(launch_mod, "ENABLED", True)
    x, logits, w13, w2 = _layer(5, 32, 512, 256, seed=3)
    call = lambda: fused_moe(x, logits, 32, 4, w13, w2, renormalize=True)  # noqa: E731
    call(), call()  # compiled and cached
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    new_x, new_logits, _, _ = _layer(5, 32, 512, 256, seed=4)
    x.copy_(new_x), logits.copy_(new_logits)
    graph.replay()
    monkeypatch.setattr(launch_mod, "ENABLED", False)
    torch.testing.assert_close(out, call(), rtol=0, atol=0)
