// Expert GEMMs on Hopper tensor cores (sm_90a): TMA loads, a warp-specialised pipeline, WGMMA.
//
// One CTA computes one [128, 256] accumulator tile of one expert's M-block:
//   warpgroup 0 (producer): one thread streams A and W tiles into a STAGES-deep shared-memory ring
//                           by TMA, each stage guarded by a "full" and an "empty" mbarrier;
//   warpgroups 1 and 2 (consumers): 64 rows each, wgmma.m64n256k16 on the staged tiles, a
//                           stage handed back as soon as the MMAs that read it have retired.
// Gated (SwiGLU) first GEMM: the 256 accumulator columns are the gate and the up rows of 128 output
// columns (64 gate, their 64 up, the next 64 gate, their 64 up), so silu(gate) * up is formed in
// registers and [rows, 128] is stored.
// Rows past the block's expert (its end row) are computed from whatever TMA brought (the next
// expert's rows, or zeros past the end of A) and never stored.
// CLUSTER = 2 or 4 (a -D define; launched with that cluster size): the cluster's CTAs take
// neighbouring N-tiles of one M-block; each loads 1 / CLUSTER of the A tile and multicasts it to
// all of them, so a stage is free only once the consumers of every CTA have released it.
//
// Compiled at run time by NVRTC (moe_compile/kernels/cuda/wgmma.py writes the wgmma_m64n{128,256}k16 asm).

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short bf16_bits;

struct __align__(64) TmaDesc { u64 v[16]; };
struct __align__(16) Block { int expert, row0, row_end, pad; };

#ifndef STAGES
#define STAGES 4
#endif
#ifndef CLUSTER
#define CLUSTER 1  // CTAs per cluster along N: they share the A tile, each loads 1 / CLUSTER of it
#endif
#define BM 128
#define BN 256
#define BK 64
#define A_BOX (BM / CLUSTER)  // A rows one CTA loads (and multicasts to the cluster)
#define A_TILE (BM * BK)
#define B_TILE (BN * BK)
#define STAGE_BYTES ((A_TILE + B_TILE) * 2)

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}

// arrive on the barrier at the same shared-memory offset in cluster CTA ``cta`` (possibly this one)
__device__ __forceinline__ void mbar_arrive_cta(u64* bar, u32 cta) {
#ifdef ARRIVE_RELEASE_CLUSTER
    asm volatile("{ .reg .b32 ra; mapa.shared::cluster.u32 ra, %0, %1; "
                 "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra]; }"
                 :: "r"(smem_addr(bar)), "r"(cta) : "memory");
#else
    asm volatile("{ .reg .b32 ra; mapa.shared::cluster.u32 ra, %0, %1; "
                 "mbarrier.arrive.shared::cluster.b64 _, [ra]; }"
                 :: "r"(smem_addr(bar)), "r"(cta) : "memory");
#endif
}

// a consumer warp hands a stage back: lane 0 to this CTA's barrier; CLUSTER > 1: lane r to CTA r's
__device__ __forceinline__ void release(u64* bar, int lane) {
#if CLUSTER > 1
    mbar_arrive_cta(bar, (u32)lane);
#else
    mbar_arrive(bar);
#endif
}

__device__ __forceinline__ void cluster_sync() {
    __syncwarp();
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 addr = smem_addr(bar), done = 0;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(addr), "r"(parity) : "memory");
    } while (!done);
}

__device__ __forceinline__ void tma_load3(void* dst, const TmaDesc* desc, u64* bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
        :: "r"(smem_addr(dst)), "l"((u64)desc), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}

__device__ __forceinline__ void tma_load(void* dst, const TmaDesc* desc, u64* bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
        :: "r"(smem_addr(dst)), "l"((u64)desc), "r"(smem_addr(bar)), "r"(c0), "r"(c1) : "memory");
}

// the same box into every CTA of the cluster (same offset, each CTA's own barrier at bar's offset)
__device__ __forceinline__ void tma_load_mc(void* dst, const TmaDesc* desc, u64* bar, int c0, int c1, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%3, %4}], [%2], %5;"
        :: "r"(smem_addr(dst)), "l"((u64)desc), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(mask) : "memory");
}

// Shared-memory matrix descriptor of a K-major tile with 128-byte rows in the 128B swizzle
// (what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B): 8-row groups 1024 bytes apart.
__device__ __forceinline__ u64 smem_desc(u32 saddr) {
    return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// d[N/2] (= d[0..N/2)) += A(64x16, smem) * B(16xN, smem); both K-major; scale_d = 0 overwrites d.
@WGMMA_ASM@

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// 16 output columns of one row from a quad (4 lanes, same row): lane q holds columns 2q, 2q + 1 of
// chunk i in lo and of chunk i + 1 in hi; after the shuffles lane q stores columns 4q .. 4q + 3,
// so the quad writes one whole 32-byte sector with one instruction.
__device__ __forceinline__ void store16(bf16_bits* p, u32 lo, u32 hi, int q, bool ok) {
    int src = (q & 1) * 2;
    u32 a0 = __shfl_sync(0xffffffffu, lo, src, 4), a1 = __shfl_sync(0xffffffffu, lo, src + 1, 4);
    u32 b0 = __shfl_sync(0xffffffffu, hi, src, 4), b1 = __shfl_sync(0xffffffffu, hi, src + 1, 4);
    u64 v = q < 2 ? ((u64)a1 << 32) | a0 : ((u64)b1 << 32) | b0;
    if (ok) *(u64*)(p + 4 * q) = v;
}

// blocks[b] for the M-blocks of the expert-ordered rows: expert e's counts[e] rows follow the
// rows of experts 0..e-1, cut into ceil(count / block_m) blocks. One CTA, blockDim >= E.
extern "C" __global__ void moe_block_table(const int* __restrict__ counts, int num_experts, int block_m,
                                           Block* __restrict__ blocks, int* __restrict__ num_live) {
    __shared__ int s_nb[1024];
    __shared__ int s_rows[1024];
    int t = threadIdx.x;
    int c = t < num_experts ? counts[t] : 0;
    int nb = (c + block_m - 1) / block_m;
    s_nb[t] = nb;
    s_rows[t] = c;
    __syncthreads();
    for (int off = 1; off < blockDim.x; off <<= 1) {
        int a = t >= off ? s_nb[t - off] : 0;
        int b = t >= off ? s_rows[t - off] : 0;
        __syncthreads();
        s_nb[t] += a;
        s_rows[t] += b;
        __syncthreads();
    }
    int blk0 = s_nb[t] - nb, row0 = s_rows[t] - c;
    for (int j = 0; j < nb; ++j) {
        Block b;
        b.expert = t;
        b.row0 = row0 + j * block_m;
        b.row_end = row0 + c;
        b.pad = 0;
        blocks[blk0 + j] = b;
    }
    if (t == blockDim.x - 1) *num_live = s_nb[t];
}

__device__ __forceinline__ void tile_of(int tile, int live_m, int n_tiles, int group_m, int& pid_m, int& pid_n) {
    int in_group = group_m * n_tiles;
    int first_m = (tile / in_group) * group_m;
    int group_rows = min(live_m - first_m, group_m);
    pid_m = first_m + (tile % in_group) % group_rows;
    pid_n = (tile % in_group) / group_rows;
}

// Persistent: each CTA walks tiles blockIdx.x, blockIdx.x + gridDim.x, ... of the live blocks x
// n_tiles (grouped group_m M-blocks per N-block), or, with tile_counter, claims the next unclaimed
// tile from that global counter (so the tiles in flight stay a contiguous window, as with one CTA
// per tile; the CTA that draws the last ticket of all resets it to 0). The producer runs ahead
// into the next tile while the consumers store the last one; the ring's stage/phase counter runs
// across tiles.
//
// out[rows of block, cols of tile] = (gated ? silu(A W_gate^T) * (A W_up^T) : A W^T) for the block's
// expert. a_desc: A [rows, K] (box 64 x 128); w_desc: W (see the producer), 3-D boxes.
// A tile: 128 rows, consumer c takes rows 64c..; a tail block (at most 64 rows) is 64 rows, both
// consumers on them, consumer c on B rows 128c.. (half the columns; gated: 64 output columns).
extern "C" __global__ void __launch_bounds__(384, 1)
moe_wgmma_gemm(const __grid_constant__ TmaDesc a_desc, const __grid_constant__ TmaDesc w_desc,
               bf16_bits* __restrict__ out, const Block* __restrict__ blocks, const int* __restrict__ num_live,
               int n_tiles, int k_tiles, int n_total, int up_off, int ld_out, int group_m, int gated,
               int tail_rows, int* __restrict__ tile_counter) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    bf16_bits* sA = (bf16_bits*)smem;
    bf16_bits* sB = sA + STAGES * A_TILE;
    u64* full = (u64*)(sB + STAGES * B_TILE);
    u64* empty = full + STAGES;
    u64* tile_full = empty + STAGES;  // the producer hands each tile (and its block) to the consumers
    u64* tile_empty = tile_full + 2;
    int* tile_info = (int*)(tile_empty + 2);  // two slots of 8 ints: tile, pid_n, expert, row0, row_end

    int live_m = *num_live;
    // CLUSTER > 1: the cluster's CTAs take N-tiles CLUSTER n' .. CLUSTER n' + CLUSTER - 1 of one
    // M-block; "tiles" below count those groups, and every CTA of a cluster walks the same ones.
    int n_groups = n_tiles / CLUSTER;
    int total = live_m * n_groups;
    int rank = (int)(blockIdx.x % CLUSTER), first = (int)(blockIdx.x / CLUSTER), stride = (int)(gridDim.x / CLUSTER);
    int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8 * CLUSTER);  // lane 0 of each consumer warp of every CTA in the cluster
        }
        for (int j = 0; j < 2; ++j) {
            mbar_init(&tile_full[j], 1);
            mbar_init(&tile_empty[j], 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#if CLUSTER > 1
    cluster_sync();  // no CTA multicasts into (or arrives on) a peer's barriers before they exist
#else
    __syncthreads();
#endif

    int wg = tid / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            int it = 0;
            for (int tile = first, tickets = 0;; tile += stride, ++tickets) {
                if (tile_counter) {  // dynamic: the next unclaimed tile (CLUSTER == 1 only)
                    tile = atomicAdd(tile_counter, 1);
                    if (tile == total + (int)gridDim.x - 1) atomicExch(tile_counter, 0);  // the last ticket of all
                }
                int pid_m = 0, pid_n = 0;
                Block blk = {0, 0, 0, 0};
                if (tile < total) {
                    tile_of(tile, live_m, n_groups, group_m, pid_m, pid_n);
                    pid_n = pid_n * CLUSTER + rank;
                    blk = blocks[pid_m];
                }
                int j = tickets & 1;
                if (tickets >= 2) mbar_wait(&tile_empty[j], ((tickets >> 1) - 1) & 1);
                int* info = tile_info + 8 * j;
                info[0] = tile;
                info[1] = pid_n;
                info[2] = blk.expert;
                info[3] = blk.row0;
                info[4] = blk.row_end;
                mbar_arrive(&tile_full[j]);
                if (tile >= total) break;
                // the 256 B rows in shared memory: plain, W rows n0 .. n0 + 255; gated, gate rows
                // g0 .. g0 + 63, up rows g0 .., gate rows g0 + 64 .., up rows g0 + 64 ..
                // w_desc is 3-D: gated (K, I, 2E), box (64, 64, 2): dim 2 is 2e (gate) or 2e + 1 (up);
                // plain (K, 128, E * N / 128), box (64, 128, 2).
                int w_r = gated ? pid_n * 128 : 0;
                int w_z = gated ? 2 * blk.expert : blk.expert * (n_total / 128) + 2 * pid_n;
                for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                    int s = it % STAGES;
                    // CLUSTER > 1: stage s of every CTA is free (our slice of A lands in all of them)
                    if (it >= STAGES) mbar_wait(&empty[s], ((it / STAGES) - 1) & 1);
                    mbar_expect_tx(&full[s], STAGE_BYTES);  // all of A (CLUSTER slices) and our B
#if CLUSTER > 1
                    tma_load_mc(sA + s * A_TILE + rank * A_BOX * BK, &a_desc, &full[s], kt * BK, blk.row0 + rank * A_BOX,
                                (unsigned short)((1 << CLUSTER) - 1));
#else
                    tma_load(sA + s * A_TILE, &a_desc, &full[s], kt * BK, blk.row0);
#endif
                    tma_load3(sB + s * B_TILE, &w_desc, &full[s], kt * BK, w_r, w_z);
                    if (gated) tma_load3(sB + s * B_TILE + 128 * BK, &w_desc, &full[s], kt * BK, w_r + 64, w_z);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int c = wg - 1;
        int lane = tid & 31, warp = (tid & 127) >> 5, q = lane & 3;
        int it = 0;
        float d[128];  // the first k-step's MMAs overwrite it (scale_d = 0)
        for (int tickets = 0;; ++tickets) {
            int j = tickets & 1;
            mbar_wait(&tile_full[j], (tickets >> 1) & 1);
            const int* info = tile_info + 8 * j;
            int tile = info[0], pid_n = info[1], row0 = info[3], row_end = info[4];
            __syncwarp();
            if (lane == 0) mbar_arrive(&tile_empty[j]);
            if (tile >= total) break;
#ifdef NO_TAIL
            const bool tail = false;
#else
            bool tail = row_end - row0 <= tail_rows;  // tail_rows: 0 or 64
#endif
            for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                int s = it % STAGES;
                mbar_wait(&full[s], (it / STAGES) & 1);
                u32 b_base = smem_addr(sB + s * B_TILE);
                u32 keep = kt != 0;
                wgmma_fence();
                if (!tail) {
                    u32 a_base = smem_addr(sA + s * A_TILE + c * 64 * BK);
#pragma unroll
                    for (int kk = 0; kk < BK / 16; ++kk)
                        wgmma_m64n256k16(d, smem_desc(a_base + kk * 32), smem_desc(b_base + kk * 32), keep | kk);
                }
#ifndef NO_TAIL
                else {  // B rows 128c .. 128c + 127: half the plain columns, or 64 gate and their 64 up rows
                    u32 a_base = smem_addr(sA + s * A_TILE);
                    u32 h_base = b_base + c * 128 * 128;
#pragma unroll
                    for (int kk = 0; kk < BK / 16; ++kk)
                        wgmma_m64n128k16(d, smem_desc(a_base + kk * 32), smem_desc(h_base + kk * 32), keep | kk);
                }
#endif
                wgmma_commit();
                wgmma_wait<1>();
                if (kt > 0 && lane < CLUSTER) release(&empty[(it - 1) % STAGES], lane);
            }
            wgmma_wait<0>();
            if (lane < CLUSTER) release(&empty[(it - 1) % STAGES], lane);

            // accumulator chunk i (8 columns): this thread holds columns 8i + 2q, 8i + 2q + 1 of rows
            // r and r + 8; store16 writes chunks i, i + 1 of a row as four 8-byte stores of the quad
            int r_base = row0 + (tail ? 0 : c * 64) + warp * 16 + (lane >> 2);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                int row = r_base + h * 8;
                bool ok = row < row_end;
                bf16_bits* orow = out + (long long)row * ld_out;
                if (!tail && gated) {
                    orow += pid_n * 128;
#pragma unroll
                    for (int i = 0; i < 16; i += 2) {  // output chunk i: gate chunk g, up chunk g + 8
                        int g0 = i < 8 ? i : i + 8, g1 = g0 + 1;
                        u32 lo = pack_bf16(silu(d[g0 * 4 + h * 2]) * d[(g0 + 8) * 4 + h * 2],
                                           silu(d[g0 * 4 + h * 2 + 1]) * d[(g0 + 8) * 4 + h * 2 + 1]);
                        u32 hi = pack_bf16(silu(d[g1 * 4 + h * 2]) * d[(g1 + 8) * 4 + h * 2],
                                           silu(d[g1 * 4 + h * 2 + 1]) * d[(g1 + 8) * 4 + h * 2 + 1]);
                        store16(orow + i * 8, lo, hi, q, ok);
                    }
                } else if (!tail) {
                    orow += pid_n * 256;
#pragma unroll
                    for (int i = 0; i < 32; i += 2)
                        store16(orow + i * 8, pack_bf16(d[i * 4 + h * 2], d[i * 4 + h * 2 + 1]),
                                pack_bf16(d[(i + 1) * 4 + h * 2], d[(i + 1) * 4 + h * 2 + 1]), q, ok);
                } else if (gated) {
                    orow += pid_n * 128 + c * 64;
#pragma unroll
                    for (int i = 0; i < 8; i += 2) {
                        u32 lo = pack_bf16(silu(d[i * 4 + h * 2]) * d[(i + 8) * 4 + h * 2],
                                           silu(d[i * 4 + h * 2 + 1]) * d[(i + 8) * 4 + h * 2 + 1]);
                        u32 hi = pack_bf16(silu(d[(i + 1) * 4 + h * 2]) * d[(i + 9) * 4 + h * 2],
                                           silu(d[(i + 1) * 4 + h * 2 + 1]) * d[(i + 9) * 4 + h * 2 + 1]);
                        store16(orow + i * 8, lo, hi, q, ok);
                    }
                } else {
                    orow += pid_n * 256 + c * 128;
#pragma unroll
                    for (int i = 0; i < 16; i += 2)
                        store16(orow + i * 8, pack_bf16(d[i * 4 + h * 2], d[i * 4 + h * 2 + 1]),
                                pack_bf16(d[(i + 1) * 4 + h * 2], d[(i + 1) * 4 + h * 2 + 1]), q, ok);
                }
            }
        }
    }
#if CLUSTER > 1
    cluster_sync();  // peers may still arrive on our "empty" barriers until they are done
#endif
}
