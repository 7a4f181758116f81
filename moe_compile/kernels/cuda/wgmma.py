"""Expert GEMMs on Hopper through a hand-written TMA + WGMMA kernel (``wgmma_gemm.cu``).

Triton 3.6 reaches about 577 TFLOP/s on this H200 for a plain bf16 matmul where cuBLAS reaches
694 (``benchmarks/probe_ws.py``); it has no working warp specialisation on Hopper. This kernel is
the warp-specialised pipeline such libraries use: a producer warpgroup streams A and W tiles by
TMA into a shared-memory ring, two consumer warpgroups run ``wgmma.m64n256k16`` on them.

It runs the sorted path's two GEMMs (``fused_experts``: rows grouped by expert, packed, no
padding rows) for bf16, no bias, plain SiLU-gated or no activation, K a multiple of 64, the
weights K-major (HF's ``[E, N, K]`` storage). ``block_table`` turns the expert counts into the
``[expert, first row, end row]`` of every 128-row block on the device, so nothing is read back.

The source is compiled by NVRTC through ``cuda.bindings`` (the ``cuda`` extra) for ``sm_90a``
at first use and launched on torch's current stream (so CUDA graphs capture it). ``available``
says whether this machine can run it, and why not.

Status (seventh session, H200): correct (``tests/kernels/test_cuda_wgmma.py`` against torch), and
faster than Triton on a plain bf16 matmul (642-669 TFLOP/s against 576-585 for Triton's best tile
and 691-761 for cuBLAS, ``benchmarks/probe_ws.py --quick``), but 2-18 % slower than the tuned
Triton GEMMs inside the MoE layer, and ~5 % slower than Triton's gated GEMM even with one expert
(``benchmarks/sweep_wgmma.py``, ``benchmarks/probe_wgmma.py``). So no tuned plan uses it; the
layer runs the Triton GEMMs.

``cluster=2``/``4`` (eighth session) runs the CTAs in clusters that share the A tile by TMA
multicast. It is correct, but at best level with no clusters: 604-627 against 650 TFLOP/s on a
plain 8192^3 matmul (``benchmarks/probe_cluster.py``), and no faster in the layer's GEMMs. So L2
traffic is not what holds the kernel back.

A ping-pong schedule (thirtieth session: each consumer warpgroup owning a whole 128 x 128 tile,
one issuing its K-loop while the other ran its epilogue, CUTLASS's design) was built, passed the
tests on the H200 and was 15-25 % slower than this kernel everywhere (509 against 646 TFLOP/s on
a plain 8192^3 matmul; ``benchmarks/results/pingpong_run*_s30.log``). It was removed again; the
code is commit 09616bd.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("wgmma_gemm.cu")
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
THREADS = 384
STAGES = 4
GATED_COLS = BLOCK_N // 2  # output columns of one gated tile


def _wgmma_asm() -> str:
    """``wgmma_m64n{N}k16(d, desc_a, desc_b, scale_d)`` for N = 128, 256 (N / 2 accumulator operands)."""
    funcs = []
    for n in (128, 256):
        regs = n // 2
        names = ", ".join(f"%{i}" for i in range(regs))
        outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
        funcs.append(
            f"__device__ __forceinline__ void wgmma_m64n{n}k16(float* d, u64 desc_a, u64 desc_b, u32 scale_d) {{\n"
            f'    asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{regs + 2}, 0; '
            f'wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{names}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, 0; }}"\n'
            f'        : {outs}\n        : "l"(desc_a), "l"(desc_b), "r"(scale_d));\n}}\n')
    return "\n".join(funcs)


def source() -> str:
    return SOURCE.read_text().replace("@WGMMA_ASM@", _wgmma_asm())


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return result[1] if len(result) == 2 else result[1:]


def compile_cubin(stages: int = STAGES, defines: tuple[str, ...] = ()) -> bytes:
    """NVRTC: ``wgmma_gemm.cu`` -> sm_90a cubin (runs without a GPU); ``defines``: ``-D`` names
    (``NO_TAIL``: without the 64-row tail tiles; ``CLUSTER=2``/``4``: CTAs per cluster sharing A)."""
    from cuda.bindings import nvrtc

    prog = _check(nvrtc.nvrtcCreateProgram(source().encode(), b"wgmma_gemm.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", f"-DSTAGES={stages}".encode()]
    opts += [f"-D{d}".encode() for d in defines]
    err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
    if int(err) != 0:
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC could not compile wgmma_gemm.cu: {log.decode(errors='replace')}")
    size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    cubin = b" " * size
    _check((nvrtc.nvrtcGetCUBIN(prog, cubin)[0], None), "nvrtcGetCUBIN")
    return cubin


def smem_bytes(stages: int = STAGES) -> int:
    return stages * (BLOCK_M + BLOCK_N) * BLOCK_K * 2 + (2 * stages + 4) * 8 + 2 * 8 * 4 + 1024


@functools.lru_cache(maxsize=None)
def unavailable_reason(index: int) -> str:
    """``""`` when the kernel can run on CUDA device ``index``; otherwise why not."""
    if os.environ.get("MOE_COMPILE_WGMMA", "1") == "0":
        return "MOE_COMPILE_WGMMA=0"
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability(index)
    if cap != (9, 0):
        return f"compute capability {cap}; the kernel is sm_90a (Hopper) code"
    try:
        import cuda.bindings.driver  # noqa: F401
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError:
        return "cuda.bindings is not installed (pip install 'moe_compile[cuda]')"
    return ""


def available(device: torch.device) -> bool:
    return device.type == "cuda" and not unavailable_reason(device.index or 0)


CLUSTERS = (1, 2, 4)


class _Module:
    def __init__(self, index: int, stages: int, defines: tuple[str, ...]):
        from cuda.bindings import driver

        torch.cuda.init()
        with torch.cuda.device(index):
            torch.empty(1, device=f"cuda:{index}")  # makes torch's primary context current
            self.module = _check(driver.cuModuleLoadData(compile_cubin(stages, defines)), "cuModuleLoadData")
            self.gemm = _check(driver.cuModuleGetFunction(self.module, b"moe_wgmma_gemm"), "cuModuleGetFunction")
            self.table = _check(driver.cuModuleGetFunction(self.module, b"moe_block_table"), "cuModuleGetFunction")
            self.smem = smem_bytes(stages)
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check((driver.cuFuncSetAttribute(self.gemm, attr, self.smem)[0], None), "cuFuncSetAttribute")
            # the dynamic scheduler's ticket counter: zero between launches (the kernel resets it)
            self.counter = torch.zeros(1, dtype=torch.int32, device=f"cuda:{index}")
            self.resident: dict[int, int] = {}  # cluster size -> CTAs that fit on the device at once

    def resident_ctas(self, cluster: int, sm_count: int) -> int:
        """How many CTAs of ``cluster``-CTA clusters run at once (a persistent grid's size)."""
        if cluster == 1:
            return sm_count
        if cluster not in self.resident:
            from cuda.bindings import driver

            config = _config(sm_count, self.smem, cluster, None)
            clusters = _check(driver.cuOccupancyMaxActiveClusters(self.gemm, config), "cuOccupancyMaxActiveClusters")
            self.resident[cluster] = max(1, int(clusters)) * cluster
        return self.resident[cluster]


@functools.lru_cache(maxsize=None)
def _module(index: int, stages: int = STAGES, defines: tuple[str, ...] = ()) -> _Module:
    return _Module(index, stages, defines)


def _config(grid: int, smem: int, cluster: int, stream):
    """A ``CUlaunchConfig`` of ``grid`` x ``THREADS`` with ``cluster``-CTA clusters along x."""
    from cuda.bindings import driver

    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
    config.sharedMemBytes = smem
    if stream is not None:
        config.hStream = stream
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
    config.attrs = [attr]
    config.numAttrs = 1
    return config


def _launch(fn, grid: int, block: int, smem: int, params: list, cluster: int = 1) -> None:
    """``params``: ctypes values, or objects with ``getPtr()`` (tensor maps), in kernel order."""
    from cuda.bindings import driver

    ptrs = (ctypes.c_void_p * len(params))(
        *[p.getPtr() if hasattr(p, "getPtr") else ctypes.addressof(p) for p in params])
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    if cluster == 1:
        err = driver.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, smem, stream, ctypes.addressof(ptrs), 0)[0]
    else:
        err = driver.cuLaunchKernelEx(_config(grid, smem, cluster, stream), fn, ctypes.addressof(ptrs), 0)[0]
    if int(err) != 0:
        raise RuntimeError(f"cuLaunchKernel{'Ex' if cluster > 1 else ''} failed: {err}")


def tensor_map(t: torch.Tensor, box_rows: int):
    """A TMA descriptor of the row-major 2-D bf16 ``t`` with ``[box_rows, 64]`` boxes, 128B swizzle."""
    return _encode(t.data_ptr(), (t.shape[1], t.shape[0]), (t.stride(0) * 2,), (BLOCK_K, box_rows))


def _encode(ptr: int, dims, byte_strides, box):
    """``cuTensorMapEncodeTiled`` for bf16 (innermost dimension first), 128B swizzle."""
    from cuda.bindings import driver

    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    return _check(driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, len(dims), ptr,
        [u64(d) for d in dims], [u64(s) for s in byte_strides], [u32(b) for b in box], [u32(1)] * len(dims),
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")


_W_MAPS: dict = {}


def _weight_map(w: torch.Tensor, gated: bool):
    """The 3-D descriptor of the K-major ``[E, N, K]`` storage behind the ``[E, K, N]`` view ``w``:
    gated, ``(K, I, 2E)`` with ``(64, 64, 2)`` boxes (64 gate rows, then the same 64 up rows);
    plain, ``(K, 128, E N / 128)`` with ``(64, 128, 2)`` boxes (256 rows). Weights are laid out
    once, so the descriptor is made once per tensor (by address and shape)."""
    num_local, k_dim, n_total = w.shape
    key = (w.data_ptr(), tuple(w.shape), gated, w.device.index)
    desc = _W_MAPS.get(key)
    if desc is None:
        if len(_W_MAPS) > 256:
            _W_MAPS.clear()
        row = k_dim * 2
        if gated:
            half = n_total // 2
            desc = _encode(w.data_ptr(), (k_dim, half, 2 * num_local), (row, half * row), (BLOCK_K, 64, 2))
        else:
            desc = _encode(w.data_ptr(), (k_dim, 128, num_local * n_total // 128), (row, 128 * row), (BLOCK_K, 128, 2))
        _W_MAPS[key] = desc
    return desc


def unsupported(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, gated: bool) -> str:
    """``""`` when ``wgmma_gemm`` takes these tensors (``w`` the ``[E, K, N]`` view); else why not."""
    num_local, k_dim, n_total = w.shape
    n_cols = n_total // 2 if gated else n_total
    if a.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        return "not bf16"
    if k_dim % BLOCK_K or a.shape[1] != k_dim:
        return f"K={k_dim} is not a multiple of {BLOCK_K}"
    if n_cols % (GATED_COLS if gated else BLOCK_N):
        return f"N={n_cols} is not a multiple of the tile"
    if not (w.stride(1) == 1 and w.stride(2) == k_dim and w.stride(0) == n_total * k_dim):
        return f"w is not K-major [E, N, K] storage (strides {w.stride()})"
    if a.stride(1) != 1 or (a.stride(0) * 2) % 16 or a.data_ptr() % 16 or w.data_ptr() % 16:
        return "A or W is not 16-byte aligned row-major"
    if out.stride(1) != 1 or out.stride(0) % 8 or out.data_ptr() % 16 or out.shape[1] != n_cols:
        return "out is not [P, N] row-major"
    if num_local > 1024:
        return f"{num_local} local experts (the block table takes at most 1024)"
    return ""


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def max_blocks(pairs: int, num_local: int) -> int:
    return -(-pairs // BLOCK_M) + min(num_local, pairs)


def block_table(counts: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([max_blocks, 4] int32 (expert, first row, end row, 0), [1] int32 live blocks)`` on the device."""
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int32 or counts.dim() != 1:
        raise TypeError(f"block_table: counts must be a 1-D int32 tensor, but got "
                        f"{getattr(counts, 'dtype', type(counts).__name__)} of shape {tuple(getattr(counts, 'shape', ()))}.")
    num_local = counts.shape[0]
    if not 1 <= num_local <= 1024:
        raise ValueError(f"block_table: counts has {num_local} experts; the table kernel takes 1 to 1024.")
    if pairs < 0:
        raise ValueError(f"block_table: pairs={pairs} must be >= 0 (the number of rows counted).")
    counts = counts.contiguous()
    blocks = torch.empty(max_blocks(pairs, num_local), 4, dtype=torch.int32, device=counts.device)
    live = torch.empty(1, dtype=torch.int32, device=counts.device)
    mod = _module(counts.device.index or 0)
    threads = max(32, 1 << (num_local - 1).bit_length())
    _launch(mod.table, 1, threads, 0, [ctypes.c_uint64(counts.data_ptr()), ctypes.c_int32(num_local),
                                       ctypes.c_int32(BLOCK_M), ctypes.c_uint64(blocks.data_ptr()),
                                       ctypes.c_uint64(live.data_ptr())])
    return blocks, live


def wgmma_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: torch.Tensor, live: torch.Tensor,
               *, gated: bool, group_m: int = 8, persistent: int = 2, tail: bool = True, cluster: int = 1,
               defines: tuple[str, ...] = ()) -> torch.Tensor:
    """``out[r] = (silu(a[r] @ Wg[e]) * (a[r] @ Wu[e]) if gated else a[r] @ W[e])`` for each block's
    rows ``r`` of expert ``e`` (``blocks``/``live`` from ``block_table``); ``w`` is the ``[E, K, N]``
    view of K-major storage (the gate half then the up half of N when gated).

    ``persistent``: 0, one CTA per tile of the upper bound; 1, one CTA per SM walks the tiles
    round-robin; 2, one CTA per SM claims the next tile from a counter on the device;
    ``tail``: a block of at most 64 rows runs as a 64-row tile; ``group_m``: M-blocks per N-block
    in the tile order; ``cluster``: 2 or 4 CTAs per cluster take neighbouring N-tiles of one
    M-block, each loading 1 / ``cluster`` of the A tile by TMA multicast into all of them (less L2
    traffic; the N-tiles must divide by it; persistent 0 or 1)."""
    reason = unsupported(a, w, out, gated)
    if reason:
        raise ValueError(f"wgmma_gemm: {reason}.")
    if cluster not in CLUSTERS:
        raise ValueError(f"wgmma_gemm: cluster={cluster!r}; expected one of {CLUSTERS}.")
    if persistent not in (0, 1, 2) or (cluster > 1 and persistent == 2):
        raise ValueError(f"wgmma_gemm: persistent={persistent!r}; expected 0, 1 or 2 (0 or 1 with cluster > 1).")
    if (blocks.dtype != torch.int32 or blocks.dim() != 2 or blocks.shape[1] != 4 or not blocks.is_contiguous()
            or live.dtype != torch.int32 or live.numel() != 1):
        raise TypeError(f"wgmma_gemm: blocks and live must be block_table's [N, 4] and [1] int32 tensors, but got "
                        f"{blocks.dtype} {tuple(blocks.shape)} and {live.dtype} {tuple(live.shape)}.")
    num_local, k_dim, n_total = w.shape
    n_cols = n_total // 2 if gated else n_total
    n_tiles = n_cols // (GATED_COLS if gated else BLOCK_N)
    if n_tiles % cluster:
        raise ValueError(f"wgmma_gemm: cluster={cluster} does not divide the {n_tiles} N-tiles "
                         f"(N={n_cols}); use cluster=1.")
    m_upper = blocks.shape[0]
    if m_upper == 0 or a.shape[0] == 0:
        return out
    index = a.device.index or 0
    mod = _module(index, STAGES, tuple(defines) + ((f"CLUSTER={cluster}",) if cluster > 1 else ()))
    params = [tensor_map(a, BLOCK_M // cluster), _weight_map(w, gated), ctypes.c_uint64(out.data_ptr()),
              ctypes.c_uint64(blocks.data_ptr()), ctypes.c_uint64(live.data_ptr()), ctypes.c_int32(n_tiles),
              ctypes.c_int32(k_dim // BLOCK_K), ctypes.c_int32(n_total), ctypes.c_int32(n_cols if gated else 0),
              ctypes.c_int32(out.stride(0)), ctypes.c_int32(group_m), ctypes.c_int32(int(gated)),
              ctypes.c_int32(64 if tail else 0),
              ctypes.c_uint64(mod.counter.data_ptr() if persistent == 2 else 0)]
    tiles = m_upper * n_tiles
    grid = min(tiles, mod.resident_ctas(cluster, _sm_count(index))) if persistent else tiles
    _launch(mod.gemm, grid, THREADS, mod.smem, params, cluster)
    return out


__all__ = ["available", "block_table", "compile_cubin", "unsupported", "wgmma_gemm"]
