"""Does Triton's warp specialisation pay for a plain TMA matmul on this GPU? (a probe, not a product)

    python benchmarks/probe_ws.py [--quick]

Times ``C = A @ B.T`` (bf16, TMA descriptors for both operands) for a few tiles with and without
``tl.range(..., warp_specialize=True)`` beside ``torch.mm``, checks each against ``torch.mm``, and
says whether the compiler actually split the warps (``setmaxnreg`` in the PTX); and our hand-written
warp-specialised CUDA kernel (``moe_compile/kernels/cuda``) on the same product. Prints one line
per variant: the compiled warps, TFLOP/s and the relative error.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mm(a_desc, b_desc, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in tl.range(0, K, BK, warp_specialize=WS):
        a = a_desc.load([pid_m * BM, k])
        b = b_desc.load([pid_n * BN, k])
        acc = tl.dot(a, b.T, acc)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(tl.bfloat16))


def run_wgmma(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> None:
    """The same product through our CUDA expert GEMM (``kernels/cuda``), as one expert holding every row."""
    from moe_compile.kernels.cuda import wgmma

    if not wgmma.available(a.device):
        print(f"  wgmma (ours): unavailable: {wgmma.unavailable_reason(a.device.index or 0)}", flush=True)
        return
    (m, k), n = a.shape, b.shape[0]
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    blocks, live = wgmma.block_table(torch.tensor([m], dtype=torch.int32, device="cuda"), m)
    w = b.unsqueeze(0).transpose(1, 2)  # [1, K, N] view of the K-major [1, N, K]
    for var in (dict(), dict(persistent=0, cluster=2), dict(persistent=1, cluster=2), dict(persistent=0, cluster=4)):
        c.zero_()
        wgmma.wgmma_gemm(a, w, c, blocks, live, gated=False, **var)
        torch.cuda.synchronize()
        err = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
        t = triton.testing.do_bench(lambda: wgmma.wgmma_gemm(a, w, c, blocks, live, gated=False, **var), warmup=50,
                                    rep=300, return_mode="median")
        print(f"  wgmma (ours, 128x256x64, 3 warpgroups) {var}: {2 * m * n * k / t / 1e9:.0f} TFLOP/s "
              f"rel err {err:.1e}", flush=True)


VARIANTS = [(128, 256, 64, 8, 3, False), (128, 128, 64, 8, 4, False), (64, 128, 64, 4, 4, False),
            (64, 128, 64, 4, 4, True), (64, 256, 64, 4, 3, True), (128, 128, 64, 4, 3, True),
            (128, 256, 64, 4, 3, True), (128, 128, 64, 8, 4, True), (128, 256, 64, 8, 3, True)]


def run(m: int, n: int, k: int, variants=VARIANTS) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ref = a @ b.T
    t = triton.testing.do_bench(lambda: a @ b.T, warmup=50, rep=300, return_mode="median")
    print(f"M={m} N={n} K={k}: torch.mm {2 * m * n * k / t / 1e9:.0f} TFLOP/s", flush=True)
    run_wgmma(a, b, ref)
    for bm, bn, bk, nw, ns, ws in variants:
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ad = TensorDescriptor.from_tensor(a, [bm, bk])
        bd = TensorDescriptor.from_tensor(b, [bn, bk])
        grid = (m // bm, n // bn)
        name = f"  {bm}x{bn}x{bk} w{nw} s{ns} ws={int(ws)}"
        try:
            kern = _mm[grid](ad, bd, c, m, n, k, BM=bm, BN=bn, BK=bk, WS=ws, num_warps=nw, num_stages=ns)
            torch.cuda.synchronize()
            err = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
            t = triton.testing.do_bench(
                lambda: _mm[grid](ad, bd, c, m, n, k, BM=bm, BN=bn, BK=bk, WS=ws, num_warps=nw, num_stages=ns),
                warmup=50, rep=300, return_mode="median")
            split = "setmaxnreg" in kern.asm["ptx"]
            print(f"{name}: warps {kern.metadata.num_warps} split={split} {2 * m * n * k / t / 1e9:.0f} TFLOP/s "
                  f"rel err {err:.1e}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported
            print(f"{name}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}", flush=True)


if __name__ == "__main__":
    import sys

    quick = "--quick" in sys.argv  # torch.mm, the best plain Triton tile and ours only
    print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
    run(8192, 8192, 8192, VARIANTS[:1] if quick else VARIANTS)
    run(2048, 4096, 7168, VARIANTS[:1] if quick else VARIANTS)
