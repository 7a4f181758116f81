"""Host-side (Python) cost of one fused_moe call, without a GPU.

    python benchmarks/host_overhead.py
    python benchmarks/host_overhead.py --ab-helpers   # the whole op with triton's helpers vs ours, alternated
    python benchmarks/host_overhead.py --tokens 2048  # the CUDA lowering's Python also at 2048 tokens

These figures, each the mean of many calls on this CPU:

- ``eager fused_moe()``: with the lowering replaced by a clone, i.e. argument validation, config
  parsing and the op's Python body (plain eager calls skip the custom-op dispatch, sixteenth
  session);
- ``custom-op dispatch``: ``torch.ops.moe_compile.fused_moe`` directly (what a compiled graph
  calls), minus the op's Python body; of it, the op's per-call shape checks (nineteenth session);
- ``stacked_weights``: the op that keeps a ``ModuleList`` block's stacked weights in step with the
  model, on a call where no source changed (its version check; nineteenth session);
- ``tuned-plan lookup``: the plan the CUDA experts look up on every call, cached as it runs and with
  the cache bypassed (twelfth session: the cache);
- ``environment read``: ``os.environ.get`` against ``env_value`` (os.environ's own dict), which every launch
  uses twice (interpreter and PDL switches; twenty-sixth session);
- ``host helpers``: one call of ``triton.cdiv`` / ``triton.next_power_of_2`` against the plain
  ``cdiv`` / ``next_pow2`` the kernels' host code now uses (thirteenth session: Triton 3.9 made
  them constexpr functions costing ~2.5 µs a call; the op made about a dozen such calls);
- ``CUDA lowering Python``: the whole op through the CUDA lowering at a Qwen3-30B-A3B decode shape
  (M=1, E=128, top-8, H=2048, I=768) with every Triton launch stubbed out, run in a child process
  under ``TRITON_INTERPRET=1`` so the lowering accepts CPU tensors: our own Python around the
  kernels, not Triton's launcher and not the kernels.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def mean_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def op_kwargs(num_experts: int, top_k: int, lowering: str) -> dict:
    """The scalar arguments of ``torch.ops.moe_compile.fused_moe`` for softmax top-k routing."""
    return dict(num_experts=num_experts, top_k=top_k, routing_method="softmax", renormalize=True,
                routed_scaling_factor=1.0, k_group=1, group_count=1, group_select_mode=0, normalize_sigmoid=True,
                scoring_after_topk=False, activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0,
                gate_up_interleaved=False, apply_router_weight_on_input=False, tp_group_name=None,
                ep_group_name=None, dispatcher_type=None, tokens_full=True, reduce_results=True, lowering=lowering)


def stubbed_decode_inputs(tokens: int = 1):
    """Every Triton launch stubbed out, and a Qwen3-30B-A3B step's tensors (M=``tokens``, default 1, E=128,
    top-8, H=2048, I=768, bf16, HF's transposed weights): ``(x, logits, w13, w2, num_experts, top_k)``."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for cls in (JITFunction, InterpretedFunction):  # every launch does nothing
        cls.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)
    e, h, i, k = 128, 2048, 768, 8
    x, logits = torch.randn(tokens, h).bfloat16(), torch.randn(tokens, e).bfloat16()
    w13 = torch.randn(e, 2 * i, h).bfloat16().transpose(1, 2)
    w2 = torch.randn(e, h, i).bfloat16().transpose(1, 2)
    return x, logits, w13, w2, e, k


def dispatch_figures() -> None:
    import torch

    import moe_compile.ops.custom_op as custom_op
    from moe_compile import fused_moe

    e, h, i, k = 8, 64, 32, 2
    x, logits = torch.randn(1, h), torch.randn(1, e)
    w13, w2 = torch.randn(e, 2 * i, h).transpose(1, 2), torch.randn(e, h, i).transpose(1, 2)
    custom_op._run = lambda cfg, inputs: inputs.hidden_states.clone()  # the lowering, replaced
    kw = op_kwargs(e, k, "auto")
    whole = mean_us(lambda: fused_moe(x, logits, e, k, w13, w2, renormalize=True))
    op = mean_us(lambda: torch.ops.moe_compile.fused_moe(x, logits, w13, w2, None, None, None, **kw))
    body = mean_us(lambda: custom_op.fused_moe_impl(x, logits, w13, w2, None, None, None, **kw))
    print(f"eager fused_moe() (lowering replaced by a clone):    {whole:8.1f} us")
    print(f"  of which validation and argument parsing:           {whole - body:8.1f} us")
    print(f"custom-op dispatch (torch.ops, as a compiled graph):  {op - body:8.1f} us")
    from moe_compile.ops.validation import check_op_shapes

    checks = mean_us(lambda: check_op_shapes(x, logits, w13, w2, e, "silu", expert_parallel=False), 20000)
    print(f"  of which the op's per-call shape checks:            {checks:8.1f} us")
    stacked_figure()


def stacked_figure() -> None:
    """``moe_compile::stacked_weights`` on a hit (no source changed), for an 8-expert ModuleList block
    (24 source tensors: gate, up and down of each expert; w13 and w2 out): the one call per block."""
    import torch

    from moe_compile.ops import weight_cache

    parts = [torch.randn(32, 64) for _ in range(16)] + [torch.randn(64, 32) for _ in range(8)]
    w13 = ("cat", (("stack", tuple(range(8)), True), ("stack", tuple(range(8, 16)), True)), False)
    key, _, _ = weight_cache.register([w13, ("stack", tuple(range(16, 24)), True)], parts)
    us = mean_us(lambda: torch.ops.moe_compile.stacked_weights(parts, key), 20000)
    print(f"stacked_weights, a block's 24 sources unchanged:     {us:8.1f} us")


def plan_lookup_figures() -> None:
    """The tuned-plan lookup the CUDA experts make on every call (Qwen3-30B-A3B at M = 2048 from the
    shipped H200 file), cached per shape and token count as it runs, and with that cache bypassed."""
    import torch

    from moe_compile.kernels.triton import configs

    args = (2048, 8, 128, 2048, 768, torch.bfloat16, ("NVIDIA_H200",))
    cached = mean_us(lambda: configs.plan_and_source(num_tokens=2048, top_k=8, num_local=128, hidden=2048,
                                                     inter=768, dtype=torch.bfloat16, keys=("NVIDIA_H200",)))
    uncached = mean_us(lambda: configs._plan_and_source.__wrapped__(*args))
    print(f"tuned-plan lookup, cached (as it runs):              {cached:8.1f} us")
    print(f"tuned-plan lookup, without its cache:                {uncached:8.1f} us")


def helper_figures() -> None:
    import triton

    from moe_compile.kernels.triton import cdiv, env_value, next_pow2

    plain = mean_us(lambda: os.environ.get("MOE_COMPILE_PDL", "1"), 20000)
    ours = mean_us(lambda: env_value("MOE_COMPILE_PDL", "1"), 20000)
    print(f"environment read: os.environ.get {plain:6.2f} us, env_value {ours:6.2f} us per call")

    for name, theirs, ours, args in (("cdiv", triton.cdiv, cdiv, (1000, 64)),
                                     ("next_power_of_2", triton.next_power_of_2, next_pow2, (1000,))):
        print(f"host helper {name}: triton {mean_us(lambda: theirs(*args), 20000):6.2f} us, "
              f"ours {mean_us(lambda: ours(*args), 20000):6.2f} us per call")


def lowering_figure(tokens: int = 1) -> None:
    x, logits, w13, w2, e, k = stubbed_decode_inputs(tokens)
    from moe_compile import fused_moe

    us = mean_us(lambda: fused_moe(x, logits, e, k, w13, w2, renormalize=True, lowering="cuda"), 500)
    print(f"CUDA lowering Python, Triton launches stubbed (M={tokens}):  {us:8.1f} us")


def helpers_ab(rounds: int = 8) -> None:
    """The op through ``torch.ops`` (launches stubbed, Qwen3-30B-A3B M=1) with the kernels' host code
    calling ``triton.cdiv`` / ``triton.next_power_of_2`` (A) or the plain helpers (B), alternated."""
    import importlib

    import torch
    import triton

    x, logits, w13, w2, e, k = stubbed_decode_inputs()
    import moe_compile  # noqa: F401  (registers the ops)
    from moe_compile.kernels.triton import cdiv, next_pow2

    mods = [importlib.import_module(f"moe_compile.kernels.triton.{m}")
            for m in ("gemm", "align", "combine", "routing", "router", "gemm_layout", "activation", "gemv")]
    kw = op_kwargs(e, k, "cuda")

    def call():
        torch.ops.moe_compile.fused_moe(x, logits, w13, w2, None, None, None, **kw)

    times: dict[str, list[float]] = {"A triton helpers": [], "B plain helpers": []}
    for _ in range(rounds):
        for side, ours in (("A triton helpers", False), ("B plain helpers", True)):
            for m in mods:
                if hasattr(m, "cdiv"):
                    m.cdiv = cdiv if ours else triton.cdiv
                if hasattr(m, "next_pow2"):
                    m.next_pow2 = next_pow2 if ours else triton.next_power_of_2
            times[side].append(mean_us(call, 200))
    for side, t in times.items():
        print(f"{side}: {min(t):7.1f} us (best of {rounds} rounds; all: {[round(v, 1) for v in t]})")


def _tokens_arg() -> int:
    """``--tokens N``: a positive int, else a ValueError naming it."""
    at = sys.argv.index("--tokens") + 1
    value = sys.argv[at] if at < len(sys.argv) else None
    if value is None or not value.isdigit() or int(value) < 1:
        raise ValueError(f"--tokens must be followed by a positive int, but got {value!r}")
    return int(value)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        if "--ab-helpers" in sys.argv:
            helpers_ab()
        else:
            lowering_figure()
            if "--tokens" in sys.argv:  # also at a training or prefill size (host work that grows with M)
                lowering_figure(_tokens_arg())
        return 0
    if "--tokens" in sys.argv:
        _tokens_arg()  # a bad value is refused here, before the figures
    if "--ab-helpers" in sys.argv:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
        return subprocess.run([sys.executable, __file__, "--ab-helpers"], env=env).returncode
    dispatch_figures()
    plan_lookup_figures()
    helper_figures()
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, __file__] + sys.argv[1:], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
