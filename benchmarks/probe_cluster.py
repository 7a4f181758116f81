"""Why 2- and 4-CTA clusters slow the CUDA expert GEMM down (a diagnostic, not a tuner).

    python benchmarks/probe_cluster.py

On one plain bf16 matmul (8192^3, one expert holding every row) it prints, side by side:
how many CTAs of each cluster size the device keeps resident (``cuOccupancyMaxActiveClusters``);
the kernel without clusters; the same kernel launched in 2-CTA clusters that it ignores (the cost
of cluster scheduling alone); and the multicast kernel with the remote stage release at the
default (``.release.cta``) and at cluster scope (``ARRIVE_RELEASE_CLUSTER``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent.parent))

from moe_compile.kernels.cuda import wgmma  # noqa: E402


def main() -> int:
    if not wgmma.available(torch.device("cuda")):
        print(f"the CUDA kernel cannot run here: {wgmma.unavailable_reason(0)}")
        return 1
    m = n = k = 8192
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ref = a @ b.T
    w = b.unsqueeze(0).transpose(1, 2)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    blocks, live = wgmma.block_table(torch.tensor([m], dtype=torch.int32, device="cuda"), m)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cl in (2, 4):
        mod = wgmma._module(0, wgmma.STAGES, (f"CLUSTER={cl}",))
        print(f"resident CTAs with {cl}-CTA clusters: {mod.resident_ctas(cl, sms)} of {sms} SMs", flush=True)
    t_mm = triton.testing.do_bench(lambda: a @ b.T, warmup=50, rep=300, return_mode="median")
    print(f"torch.mm: {2 * m * n * k / t_mm / 1e9:.0f} TFLOP/s", flush=True)

    plain_launch = wgmma._launch

    def forced(cluster):
        def launch(fn, grid, block, smem, params, _cluster=1):
            plain_launch(fn, grid - grid % cluster, block, smem, params, cluster)
        return launch

    variants = [("no clusters", {}, None), ("no multicast, launched in 2-CTA clusters", dict(persistent=0), 2),
                ("cluster 2, release.cta", dict(persistent=0, cluster=2), None),
                ("cluster 2, release.cluster", dict(persistent=0, cluster=2,
                                                    defines=("ARRIVE_RELEASE_CLUSTER",)), None),
                ("cluster 2 persistent, release.cta", dict(persistent=1, cluster=2), None),
                ("cluster 4, release.cta", dict(persistent=0, cluster=4), None)]
    for name, var, force in variants:
        wgmma._launch = forced(force) if force else plain_launch
        try:
            c.zero_()
            wgmma.wgmma_gemm(a, w, c, blocks, live, gated=False, **var)
            torch.cuda.synchronize()
            err = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
            t = triton.testing.do_bench(lambda: wgmma.wgmma_gemm(a, w, c, blocks, live, gated=False, **var),
                                        warmup=50, rep=300, return_mode="median")
        finally:
            wgmma._launch = plain_launch
        print(f"  {name}: {2 * m * n * k / t / 1e9:.0f} TFLOP/s (rel err {err:.1e})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
