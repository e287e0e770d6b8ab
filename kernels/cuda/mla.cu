/*
 * mla.cu: MLA attention over the paged latent cache (cuda_mla.h has the contract; the CPU
 * reference is kernels/cpu/mla.c).
 *
 * kv_write: one block per row: RMSNorm of c (sum of squares in double, the scale formed exactly
 *   as the CPU's duet_k_rmsnorm forms it), then [c | k_r] rounded to the cache dtype (bf16: RNE)
 *   into the row's page slot.
 *
 * attend. Every head reads the same latent row [c | k_r] of a position, so the unit of work is
 *   not a head but a *block of 32 query slots*: all heads of one row (n = 32), or several rows
 *   of one item times all heads (small n; slot = row_in_block · hb + head_in_block). A block
 *   owns (row block, head group, KV split) and streams its split's positions through shared
 *   memory in tiles (cp.async, multi-buffered, page lookups per token), so each KV byte leaves
 *   global memory once per block and serves 32 query vectors: decode is bandwidth-bound, not
 *   n_heads × the traffic. Per tile: scores of 32 slots × tile tokens, an online softmax per slot
 *   (running max m and sum l in log2 units: q is pre-scaled by scale · log2 e so every
 *   exponential is one ex2), and acc = acc · 2^(m_old − m_new) + P · c.
 *   Two compute paths share that skeleton:
 *   - tensor cores (BF16 cache, r + dr <= 576): mma.sync m16n8k16 bf16 with fp32 accumulation.
 *     The cache values are exact in bf16, but q̂ and the probabilities P are fp32, so each is
 *     split as x = hi + lo (two bf16, |x − hi − lo| <= 2^-16 |x|) and multiplied twice: scores
 *     and outputs keep ~fp32 accuracy, where rounding q̂ to bf16 alone would cost 2^-9 · |score|
 *     (about 1% of a probability at typical score magnitudes). Warp w computes the scores of
 *     m-tile (w & 1) over k-quarter (w >> 1) of the 576 dims with its q fragments held in
 *     registers for the whole block, the four quarters meet in shared memory; for P · c warp w
 *     owns 64 output dims of all 32 slots (V fragments via ldmatrix.trans). Tiles of 64
 *     positions, 2 in shared memory, one in flight while the other is computed. A test hook
 *     launches blocks of 16 slots (one m-tile; warp w then takes half w & 1 of the tile's
 *     n-tiles): each block's fixed chain (q in, one tile, the partial out) halves with its
 *     slots, which paid when the old uniform split count left most SMs idle (batch-1 decode at
 *     2K: bench/RESULTS.md, "MLA decode attention: 16-slot blocks"). The per-request plan aims
 *     at DUET_SPLITKV_WAVES waves of work per SM and its work count lives on the device, so
 *     attend no longer knows when a grid would fit in one wave and keeps 32 slots (re-measure
 *     before choosing 16 again). Another test hook selects tiles of 32, 4 in shared memory, 3
 *     in flight: more instructions per position, and slower.
 *     Memory does not bound this kernel (about half the HBM rate at 32K with every SM busy);
 *     q̂ and P split in two make 34 mma per position. Kimi's rows (r = 512, dr = 64) get an
 *     instance with the dims compiled in, so the per-tile shared-memory addresses and loop
 *     bounds are immediates (fewer instructions per tile than the generic instance, which
 *     other shapes use). Measured: bench/RESULTS.md, "MLA decode attention: tile shape".
 *   - CUDA cores (F32 cache, or dims outside the tensor-core limits): each warp holds the q of 4
 *     slots for the lane's dims in registers and reduces the 8 tokens × 4 slots dot products of
 *     a token group with one 31-shuffle reduce-scatter; for P · c each thread owns 8 slots × 8
 *     dims. Double-buffered tiles of 64 (BF16) or 32 (F32) positions. fp32 FMA throughput, not
 *     memory, bounds this path (several times slower than the tensor cores at Kimi's shape).
 *   Split-KV (kernels/splitkv.h; docs/architecture.md, "Split-KV planning"): duet_cuda_mla_plan
 *   computes the step's per-request plan on the device, one single-block launch per step from
 *   the step's metadata (an item's KV length is its last row's position + 1), with the shared
 *   helpers and formulas of the host's duet_splitkv_plan: blocks of DUET_MLA_PLAN_BT = 64
 *   positions (the default tensor-core tile, two of the 32-position tiles: ranges stay whole
 *   tiles on every path), heads = the grid's head groups (a work item runs once per group),
 *   units = the SMs / DUET_CUDA_MLA_SMS_PER_UNIT (8): one attention block fits per SM (150-200
 *   KiB of shared memory at Kimi's shape), and 8 waves of single SMs cut a batch-1 32K item 512
 *   ways, whose partials cost more than the parallelism gains (bench/RESULTS.md).
 *   Beside the work list it writes one task per (work item, row block of rb rows), in reverse
 *   item order (a prefill's last, longest rows first, so short ones fill the last wave), each
 *   holding all its block needs (one 32-byte load: rows, positions, partial slot), and per row
 *   where the reducer finds its partials. The attention grid is an upper bound from host counts
 *   only (graph capture); blocks past the step's task count exit. A block of an item planned
 *   onto one split writes lat = acc / l itself; a split block writes its partial (m, l, acc), or
 *   the neutral one (m = −inf, l = 0, no accumulator) when its rows see none of its range. The
 *   reducer merges split rows only: its blocks for rows of one-split items return at once, and
 *   it is not launched when no item may split (st->max_split_rows = 0).
 *   Prefill rows of one item share a block only when n < 32 (rb = 32 / n); at n = 32 each row
 *   is its own block and the item's KV is re-read per row, mostly from L2. An item of more than
 *   DUET_SPLITKV_MAX_ROWS rows is never split (the planner's rule), so a prefill's partials never
 *   take rows times the memory.
 *   Graph capture: the first attend per kernel and device opts the kernel into its shared memory
 *   (cudaFuncSetAttribute, not a stream operation); later calls only launch.
 *
 * The expanded form (prefill; cuda_mla.h, duet_cuda_mla_attend_x). The absorbed attend costs
 *   576 + 512 dims per (query, position, head), each twice for the hi / lo splits: it was the
 *   largest share of a long prefill, with its tensor-core issue about half used. Expanded, a
 *   head's own K (128 + the shared 64 rope dims) and V (128) cost 320 dims, the expansion one
 *   GEMM over the item's positions per layer (gather, cuBLASLt, x_pack: bf16 hi + lo rows). Run
 *   first through the 32-slot kernel above (a variant reading dims 256.. as the scores'), those
 *   rows gained far less than halving the products promised: its per-tile scores exchange,
 *   three barriers and softmax over shared memory cost as much as the products.
 *   duet__mla_xattn_kernel keeps each warp's 16 rows whole (scores, softmax and P in registers,
 *   one barrier per tile) and drops the lo · lo products. On sm_90a the same block runs on
 *   Hopper's wgmma instead (mla_wgmma.cu; DUET_CUDA_NO_MLA_WGMMA keeps this kernel): the same
 *   products, bit for bit, and faster. Measured: bench/RESULTS.md, "MLA prefill: the expanded
 *   form".
 *
 * Programmatic dependent launch (cuda_pdl.cuh): kv_write, the planner, the attention kernels and
 *   the reducer are launched with duet_pdl_launch. Before its wait a kernel reads only the
 *   step's metadata (copied in by the host ahead of the step) and weights. The attention kernels
 *   and the reducer read the step's plan, which the planner, a kernel of the same step, wrote,
 *   so they start after the wait: the tensor-core attention no longer copies its first cached
 *   tiles under the W_UK product before it, as it did when a block found its range from the
 *   metadata alone (a trigger does not make the planner's writes visible; only the wait does).
 *
 * Batch-1 decode: a block's fixed chain (launch, setup, q prologue, first load, partial write)
 *   is what a short split costs, so it is kept short. The q prologue's loads are unconditional
 *   (clamped addresses, zero by select) and in flight together: behind a branch each, the SASS
 *   issued them one round trip at a time. q lands by coalesced cp.async in the stage that no
 *   copy uses before the loop, and the accumulators leave through shared memory as whole rows
 *   in float4 stores, not as 32 scattered stores per thread from the fragments, each behind a
 *   destination lookup. Measured (with the old uniform split count): bench/RESULTS.md, "MLA
 *   decode attention: the block's fixed chain".
 *
 * Limits (DUET_ERR_UNSUPPORTED otherwise): r a multiple of 32 with r <= 512, dr a multiple of 8
 * with r + dr <= 640; kv dtype F32 or BF16. The tensor-core path additionally needs r + dr <= 576
 * (Kimi Linear: 512 + 64); larger latent rows fall back to CUDA cores.
 */
#include <math.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_async.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mla.h"
#include "kernels/cuda/cuda_mma.cuh"
#include "kernels/cuda/cuda_norm.cuh"
#include "kernels/cuda/cuda_pdl.cuh"
#include "kernels/cuda/mla_x.cuh"

extern "C" {
#include "kernels/splitkv.h"
}

#define DUET__MODULE          "cuda mla" /* the prefix of this file's error details */
#define DUET__TRY(call, what) DUET_CUDA_TRY(call, DUET__MODULE, what)

#define DUET_MLA_THREADS     256 /* 8 warps per attention block */
#define DUET_MLA_WARPS       (DUET_MLA_THREADS / 32)
#define DUET_MLA_SLOTS       32  /* (row, head) query vectors per block */
#define DUET_MLA_MAX_R       512 /* P · c: 4 slot groups × r / 8 dim groups <= 256 threads */
#define DUET_MLA_MAX_TD      640 /* CUDA-core scores: 5 chunks of 128 dims per lane */
#define DUET_MLA_TC_MAX_TD   576 /* tensor-core scores: 9 k-steps of 16 per warp quarter */
#define DUET_MLA_TC_TK       64  /* tokens per tile, tensor-core path */
#define DUET_MLA_TC_STAGES   2   /* tiles in shared memory, tensor-core path (1 in flight) */
#define DUET_MLA_TC2_TK      32  /* the other tensor-core shape (test hook): 4 tiles of 32 */
#define DUET_MLA_TC2_STAGES  4
#define DUET_MLA_MAX_DEV     16  /* devices whose shared-memory opt-in is remembered */
#define DUET_MLA_KVW_THREADS 128 /* kv_write block */
#ifndef DUET_MLA_PLAN_BT         /* -D for a measurement (bench/RESULTS.md) */
#define DUET_MLA_PLAN_BT 64      /* positions per plan block: the default tensor-core tile */
#endif
#define DUET_MLA_PLAN_NT 512 /* planner threads (one block) */
#define DUET_LOG2E       1.4426950408889634f

/* Test hooks (tests/unit/test_cuda_mla.c): route BF16 caches to the CUDA-core path as well;
 * pick the tensor-core tile (0: the default DUET_MLA_TC_TK, or DUET_MLA_TC2_TK). */
static int duet__mla_simt_only = 0;
static int duet__mla_tc_tile = 0;
static int duet__mla_tc_slots = 0;

extern "C" void duet__cuda_mla_force_simt(int on)
{
    duet__mla_simt_only = on;
}

extern "C" void duet__cuda_mla_tc_tile(int tk)
{
    duet__mla_tc_tile = tk;
}

/* The expanded attention's kernel (test hook): 0 chooses (the wgmma kernel where the device
 * runs it, unless DUET_CUDA_NO_MLA_WGMMA is set), 1 forces the mma.sync kernel, 2 the wgmma one
 * (DUET_ERR_UNSUPPORTED where the device cannot run it). */
static int duet__mla_x_kernel = 0;

extern "C" void duet__cuda_mla_x_kernel(int which)
{
    duet__mla_x_kernel = which;
}

/* For tests: whether the current device runs the wgmma kernel. */
extern "C" int duet__cuda_mla_x_wgmma_usable(void)
{
    return duet__mla_wgmma_usable();
}

/* Slots per tensor-core block (64-position tiles): 16 forces blocks of 16, anything else 32. */
extern "C" void duet__cuda_mla_tc_slots(int n)
{
    duet__mla_tc_slots = n;
}

/* The plan's parallel units (test hook): 0 = the SMs, else this many (other chunk sizes). */
static int duet__mla_plan_units = 0;

extern "C" void duet__cuda_mla_plan_units(int units)
{
    duet__mla_plan_units = units;
}

/* The plan's mode (test and benchmark hook, duet_splitkv_mode_t): the engine always plans per
 * request; uniform and none are there to be measured against it (bench/bench_splitkv_cuda.c). */
static int duet__mla_plan_mode = DUET_SPLITKV_PER_REQUEST;

extern "C" void duet__cuda_mla_plan_mode(int mode)
{
    duet__mla_plan_mode = mode;
}

/* ---- kernel arguments --------------------------------------------------------------------- */

/* One attention block's share of a step, written by the planner: 32 bytes at a 256-byte aligned
 * array, so a block reads it in two 16-byte loads and needs no further lookup but its rows'
 * positions. */
typedef struct {
    int32_t item;       /* the item */
    int32_t row0, row1; /* the block's rows [row0, row1) */
    int32_t first;      /* the item's first row */
    int32_t pos0, pos1; /* the work item's positions [pos0, pos1), cut at the item's length */
    int32_t part;       /* partial slot of row `first` in this split; -1: one split, lat directly */
    int32_t pad;
} duet__mla_task_t;

/* Where a step's plan lives in the scratch (device pointers; duet__mla_layout places them). */
typedef struct {
    int64_t *hdr;              /* [0] work items, [1] tasks, [2] chunk */
    int32_t *splits;           /* [n_items] */
    int32_t *work0, *task0;    /* [n_items + 1] exclusive scans of work items and tasks */
    duet_splitkv_work_t *work; /* [max_work] */
    duet__mla_task_t *tasks;   /* [max_tasks], block x takes tasks[x] */
    int2 *row_red;             /* [n_rows] (partial slot of the row's split 0, its splits) */
    float *part_ml, *part_o;   /* [max_work · prows][n] × 2 (m, l), × r (acc) */
} duet__mla_plan_dev_t;

typedef struct {
    const int32_t *item_pages; /* device [n_items][max_pages] */
    const int32_t *row_pos;    /* device [n_rows] */
    int32_t n_rows, max_pages;
    const void *kv; /* device, the KV pool */
    int64_t kv_n_layers, layer;
    int page_tokens;
    int pt_shift; /* log2(page_tokens) when a power of two, else -1 (no division per token) */
    int n, r, td;
    int hb, rb;        /* heads and rows per block: slot = row_in_block · hb + head */
    const float *qhat; /* device [n_rows][n][r] */
    const float *qr;   /* device, q_r of (row, head) at row · ldqr + head · dqr_stride */
    int64_t ldqr, dqr_stride;
    float qscale;                  /* scale · log2 e */
    float *lat;                    /* device [n_rows][n][r] */
    const duet__mla_task_t *tasks; /* the plan's tasks, and their count */
    const int64_t *n_tasks;
    float *part_o, *part_ml; /* the plan's partials */
    int q_vec; /* q̂ and q_r rows 16-byte aligned: the staged q copy moves 16-byte chunks */
} duet__mla_args_t;

/* What one attention block knows about itself (shared memory). */
typedef struct {
    int item, k0, k1;        /* item; this split's positions [k0, k1) */
    int direct;              /* the item has one split: lat = acc / l, no partial */
    int pbase;               /* partial slot of row `row` = pbase + row (split items) */
    int row[DUET_MLA_SLOTS]; /* row of each slot, -1 for an unused slot */
    int head[DUET_MLA_SLOTS];
    int pos[DUET_MLA_SLOTS];          /* last visible position; -1 (all masked) when unused */
    const float *qp[DUET_MLA_SLOTS];  /* q̂ of the slot (row 0 head 0 for an unused slot) */
    const float *qrp[DUET_MLA_SLOTS]; /* its q_r (likewise; never read when dr = 0) */
    float m[DUET_MLA_SLOTS];          /* running max, log2 units */
    float l[DUET_MLA_SLOTS];          /* running sum of probabilities */
    float alpha[DUET_MLA_SLOTS];      /* this tile's rescale of the accumulators */
    float *outp[DUET_MLA_SLOTS];      /* staged output: where the slot's row goes (NULL: nowhere) */
    float omul[DUET_MLA_SLOTS];       /* ... and its factor (1 / l without splits) */
} duet__mla_block_t;

/* ---- small device helpers ----------------------------------------------------------------- */

/* Columns td .. tdp - 1 (the k-step padding) of `rows` bf16 rows ld apart set to zero: the MMA
 * reads them, and no copy writes them. */
__device__ static inline void duet__mla_zero_pad(__nv_bfloat16 *t, int rows, int ld, int td,
                                                 int tdp)
{
    if (tdp <= td)
        return;
    const int w = tdp - td;
    for (int i = threadIdx.x; i < rows * w; i += DUET_MLA_THREADS)
        t[(i / w) * ld + td + i % w] = __float2bfloat16_rn(0.0f);
}

__device__ static inline float duet__bf16_lo(uint32_t u)
{
    return __uint_as_float(u << 16);
}

__device__ static inline float duet__bf16_hi(uint32_t u)
{
    return __uint_as_float(u & 0xffff0000u);
}

/* Element offset of the row at slot `in` of page `page` for MLA layer `layer` in the KV pool
 * (pages of n_layers × pt rows of td elements): kv_write, attend and gather address it so. */
__device__ static inline int64_t duet__mla_row_off(int64_t page, int in, int64_t n_layers,
                                                   int64_t layer, int pt, int td)
{
    return ((page * n_layers + layer) * pt + in) * td;
}

/* One cache element as fp32. */
__device__ static inline float duet__mla_ld1(const float *p)
{
    return *p;
}

__device__ static inline float duet__mla_ld1(const __nv_bfloat16 *p)
{
    return __bfloat162float(*p);
}

/* 4 consecutive cache elements as fp32 (16- / 8-byte aligned). */
__device__ static inline float4 duet__ld4(const float *p)
{
    return *(const float4 *)p;
}

__device__ static inline float4 duet__ld4(const __nv_bfloat16 *p)
{
    const uint2 u = *(const uint2 *)p;
    return make_float4(duet__bf16_lo(u.x), duet__bf16_hi(u.x), duet__bf16_lo(u.y),
                       duet__bf16_hi(u.y));
}

/* 8 consecutive cache elements as fp32 (32- / 16-byte aligned). */
__device__ static inline void duet__ld8(const float *p, float v[8])
{
    const float4 a = *(const float4 *)p, b = *(const float4 *)(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ static inline void duet__ld8(const __nv_bfloat16 *p, float v[8])
{
    const uint4 u = *(const uint4 *)p;
    v[0] = duet__bf16_lo(u.x), v[1] = duet__bf16_hi(u.x), v[2] = duet__bf16_lo(u.y);
    v[3] = duet__bf16_hi(u.y), v[4] = duet__bf16_lo(u.z), v[5] = duet__bf16_hi(u.z);
    v[6] = duet__bf16_lo(u.w), v[7] = duet__bf16_hi(u.w);
}

template <typename T> __device__ static inline T duet__mla_to(float v);
template <> __device__ inline float duet__mla_to<float>(float v)
{
    return v;
}
template <> __device__ inline __nv_bfloat16 duet__mla_to<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}

/* One butterfly step of a warp reduce-scatter over 2·O values (see the CUDA-core scores). */
template <int O> __device__ static inline void duet__rs_step(float *v, int lane)
{
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < O; i++) {
        const float send = up ? v[i] : v[i + O];
        const float keep = up ? v[i + O] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}

/* ---- kv_write ----------------------------------------------------------------------------- */

/*
 * One block of DUET_MLA_KVW_THREADS per row. Before the PDL wait it reads only what no kernel of
 * the step writes (the step's metadata, copied in by the host ahead of the step, and the norm
 * weights), so the destination and the weights are at hand when ckr becomes readable. The sum
 * of squares is formed in the order the one-thread version used (per thread j = tid, tid + 128,
 * …; a butterfly per warp; warps 0, 1, … added in order), by every thread, so no second barrier
 * broadcasts the scale.
 */
template <typename T>
__global__ static void __launch_bounds__(DUET_MLA_KVW_THREADS)
    duet__mla_kv_write_kernel(const int32_t *row_item, const int32_t *row_pos,
                              const int32_t *item_pages, int max_pages, T *kv, int64_t kv_n_layers,
                              int64_t layer, int pt, int r, int td, const float *ckr,
                              const float *w, float eps)
{
    const int NT = DUET_MLA_KVW_THREADS, NW = NT / 32;
    const int PER = (DUET_MLA_MAX_TD + NT - 1) / NT; /* elements per thread */
    __shared__ double red[NW];
    const int row = blockIdx.x, tid = threadIdx.x;

    const int item = row_item[row], pos = row_pos[row];
    const int64_t page = item_pages[(int64_t)item * max_pages + pos / pt];
    T *dst = kv + duet__mla_row_off(page, pos % pt, kv_n_layers, layer, pt, td);
    float wv[PER];
#pragma unroll
    for (int k = 0; k < PER; k++) {
        const int j = tid + k * NT;
        wv[k] = j < r ? w[j] : 1.0f;
    }

    duet_pdl_wait();
    duet_pdl_trigger();

    const float *x = ckr + (int64_t)row * td;
    float xv[PER];
#pragma unroll
    for (int k = 0; k < PER; k++) {
        const int j = tid + k * NT;
        xv[k] = j < td ? x[j] : 0.0f;
    }
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < PER; k++)
        if (tid + k * NT < r)
            ss += (double)xv[k] * (double)xv[k];
    for (int o = 16; o > 0; o >>= 1)
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((tid & 31) == 0)
        red[tid >> 5] = ss;
    __syncthreads();
    double tot = 0.0;
#pragma unroll
    for (int i = 0; i < NW; i++)
        tot += red[i];
    const float scale = duet_rms_scale(tot, (double)r, eps);

#pragma unroll
    for (int k = 0; k < PER; k++) {
        const int j = tid + k * NT;
        if (j < td)
            dst[j] = duet__mla_to<T>(j < r ? duet_rms_apply(wv[k], xv[k], scale) : xv[k]);
    }
}

/* ---- attention: shared pieces ------------------------------------------------------------- */

/*
 * This block's rows, slots and position range, from its task; false when block x is past the
 * step's tasks (the grid is an upper bound). It reads the plan, so it runs after the PDL wait.
 */
__device__ static bool duet__mla_setup(const duet__mla_args_t &a, duet__mla_block_t *b)
{
    if (threadIdx.x < 32) {
        const unsigned full = 0xffffffffu;
        const int lane = threadIdx.x;
        /* the count and the task in flight together; a task past the count is never used */
        const int64_t nt = *a.n_tasks;
        const int4 *tp = (const int4 *)(a.tasks + blockIdx.x);
        const int4 t0 = tp[0], t1 = tp[1]; /* (item, row0, row1, first), (pos0, pos1, part, -) */
        const bool busy = (int64_t)blockIdx.x < nt;
        int row = -1, head = 0, pos = -1;
        if (busy) {
            const int hl = lane % a.hb, rr = lane / a.hb;
            head = (int)blockIdx.y * a.hb + hl;
            if (rr < a.rb && t0.y + rr < t0.z && head < a.n) {
                row = t0.y + rr;
                pos = a.row_pos[row];
            }
        }
        int mx = pos;
        for (int o = 16; o > 0; o >>= 1)
            mx = max(mx, __shfl_xor_sync(full, mx, o));
        const int L = mx + 1;
        b->row[lane] = row;
        b->head[lane] = head;
        b->pos[lane] = pos;
        b->qp[lane] = row >= 0 ? a.qhat + ((int64_t)row * a.n + head) * a.r : a.qhat;
        b->qrp[lane] = row >= 0 && a.td > a.r
                           ? a.qr + (int64_t)row * a.ldqr + (int64_t)head * a.dqr_stride
                           : a.qr;
        b->m[lane] = -INFINITY;
        b->l[lane] = 0.0f;
        b->alpha[lane] = 1.0f;
        if (lane == 0) {
            b->item = busy ? t0.x : -1;
            /* the rows' last position may end before the split's range, or inside it */
            b->k0 = min(L, t1.x);
            b->k1 = min(L, t1.y);
            b->direct = t1.z < 0;
            b->pbase = t1.z - t0.w;
        }
    }
    __syncthreads();
    return b->item >= 0;
}

/*
 * The query value of a slot at dim d (0 past td or for an unused slot), pre-scaled. The load is
 * unconditional (from a clamped address) and the zero a select: behind a branch each of the
 * ~80 loads per thread waited for its own round trip before the next was issued, which made
 * the q prologue most of a short block's time.
 */
__device__ static inline float duet__mla_q(const duet__mla_args_t &a, const duet__mla_block_t *b,
                                           int slot, int d)
{
    const int dd = min(d, a.td - 1);
    const float *p = dd < a.r ? b->qp[slot] + dd : b->qrp[slot] + (dd - a.r);
    const float v = *p;
    return b->row[slot] >= 0 && d < a.td ? v * a.qscale : 0.0f;
}

/*
 * Element offsets in the pool of the rows of positions t .. t + 63 that lie before k1 (-1 past
 * it): lane l holds positions t + l (lo) and t + 32 + l (hi). Computed one tile ahead, so the
 * page-table reads overlap the current tile's math instead of stalling the next copy.
 */
typedef struct {
    int64_t lo, hi;
} duet__mla_offs_t;

__device__ static inline duet__mla_offs_t
duet__mla_tile_offs(const duet__mla_args_t &a, const int32_t *pages, int t, int k1, int td)
{
    const int lane = threadIdx.x & 31, pt = a.page_tokens;
    duet__mla_offs_t o = {-1, -1};
    const int s0 = t + lane, s1 = t + 32 + lane;
    const int sh = a.pt_shift;
    if (s0 < k1) {
        const int pg = sh >= 0 ? s0 >> sh : s0 / pt, in = sh >= 0 ? s0 & (pt - 1) : s0 % pt;
        o.lo = duet__mla_row_off(pages[pg], in, a.kv_n_layers, a.layer, pt, td);
    }
    if (s1 < k1) {
        const int pg = sh >= 0 ? s1 >> sh : s1 / pt, in = sh >= 0 ? s1 & (pt - 1) : s1 % pt;
        o.hi = duet__mla_row_off(pages[pg], in, a.kv_n_layers, a.layer, pt, td);
    }
    return o;
}

/*
 * Queue the copy of the tile whose offsets are `o` (tk <= 64 positions) into dst (row stride ld
 * elements, rows of td); positions past k1 are zero-filled, so masked keys multiply as 0, never
 * as stale shared memory. One warp per position, lanes over its 16-byte chunks.
 */
template <typename T, int TD = 0>
__device__ static __forceinline__ void
duet__mla_load_tile(T *dst, int ld, const duet__mla_args_t &a, duet__mla_offs_t o, int tk, int td)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int CPR = TD * (int)sizeof(T) / 16, cpr = td * (int)sizeof(T) / 16; /* 16-B chunks */
    const T *kv = (const T *)a.kv;
#pragma unroll
    for (int i = 0; i < tk / DUET_MLA_WARPS; i++) { /* tk: a multiple of the warp count */
        const int t = warp + DUET_MLA_WARPS * i;
        const int64_t off = __shfl_sync(0xffffffffu, i < 32 / DUET_MLA_WARPS ? o.lo : o.hi, t & 31);
        /* a zero fill reads no bytes; its address stays inside the pool's first row */
        const char *src = (const char *)(off >= 0 ? kv + off : kv);
        const bool ok = off >= 0;
        char *d = (char *)(dst + (int64_t)t * ld);
        if (TD > 0) {
#pragma unroll
            for (int k = 0; k < (CPR + 31) / 32; k++) {
                const int c = lane + 32 * k;
                if (CPR % 32 == 0 || c < CPR)
                    duet__cp_async16(d + 16 * c, src + 16 * c, ok);
            }
        } else {
            for (int c = lane; c < cpr; c += 32)
                duet__cp_async16(d + 16 * c, src + 16 * c, ok);
        }
    }
}

/* Softmax output writers: store p for (slot, token), return the value the accumulation uses. */
struct duet__mla_put_f32 {
    float *p; /* [tk][ld], token-major (CUDA-core P · c reads 8 slots of one token) */
    int ld;
    __device__ float operator()(int slot, int tok, float x) const
    {
        p[tok * ld + slot] = x;
        return x;
    }
};

struct duet__mla_put_split {
    __nv_bfloat16 *hi, *lo; /* [32][ld], slot-major (mma A operand) */
    int ld;
    __device__ float operator()(int slot, int tok, float x) const
    {
        __nv_bfloat16 h, l;
        duet_split_bf16(x, &h, &l);
        hi[slot * ld + tok] = h;
        lo[slot * ld + tok] = l;
        return __bfloat162float(h) + __bfloat162float(l);
    }
};

/*
 * Online softmax of one tile: scores (sum of n_part partial buffers [SL][ld], part_stride apart)
 * of positions t0 + tok, masked past the split's end and past each slot's own position. Warp w
 * owns slots SW w .. SW w + SW-1 (SW = SL / 8), processed together (their shuffle chains
 * interleave); updates m, l and writes alpha for the accumulators.
 */
template <int TK, int SL, typename PW>
__device__ static void duet__mla_softmax(duet__mla_block_t *b, const float *s, int ld, int n_part,
                                         int part_stride, int t0, PW put)
{
    const unsigned full = 0xffffffffu;
    const int SW = SL / DUET_MLA_WARPS; /* slots per warp */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int k1 = b->k1;
    float v[SW][TK / 32], mx[SW], base[SW], alpha[SW], m_new[SW], sum[SW];
#pragma unroll
    for (int si = 0; si < SW; si++) {
        const int slot = warp * SW + si, pos = b->pos[slot];
        mx[si] = -INFINITY;
#pragma unroll
        for (int u = 0; u < TK / 32; u++) {
            const int tok = lane + 32 * u;
            float x = 0.0f;
            for (int p = 0; p < n_part; p++)
                x += s[p * part_stride + slot * ld + tok];
            if (t0 + tok >= k1 || t0 + tok > pos)
                x = -INFINITY;
            v[si][u] = x;
            mx[si] = fmaxf(mx[si], x);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int si = 0; si < SW; si++)
            mx[si] = fmaxf(mx[si], __shfl_xor_sync(full, mx[si], o));
#pragma unroll
    for (int si = 0; si < SW; si++) {
        const float m_old = b->m[warp * SW + si];
        m_new[si] = fmaxf(m_old, mx[si]);
        alpha[si] = 1.0f; /* all masked so far: keep zeros, no NaN */
        base[si] = 0.0f;
        if (m_new[si] != -INFINITY) {
            alpha[si] = duet__mla_ex2(m_old - m_new[si]);
            base[si] = m_new[si];
        }
        sum[si] = 0.0f;
#pragma unroll
        for (int u = 0; u < TK / 32; u++)
            sum[si] += put(warp * SW + si, lane + 32 * u, duet__mla_ex2(v[si][u] - base[si]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int si = 0; si < SW; si++)
            sum[si] += __shfl_xor_sync(full, sum[si], o);
    __syncwarp(); /* every lane has read m before lane 0 replaces it */
    if (lane == 0) {
#pragma unroll
        for (int si = 0; si < SW; si++) {
            const int slot = warp * SW + si;
            b->m[slot] = m_new[si];
            b->l[slot] = b->l[slot] * alpha[si] + sum[si];
            b->alpha[slot] = alpha[si];
        }
    }
}

/* (m, l) of every used slot into the split's partial (split items only). */
__device__ static void duet__mla_write_ml(const duet__mla_args_t &a, const duet__mla_block_t *b)
{
    const int slot = threadIdx.x;
    if (!b->direct && slot < DUET_MLA_SLOTS && b->row[slot] >= 0) {
        const int64_t i = (int64_t)(b->pbase + b->row[slot]) * a.n + b->head[slot];
        a.part_ml[2 * i] = b->m[slot];
        a.part_ml[2 * i + 1] = b->l[slot];
    }
}

/*
 * Where the accumulator of (slot, dim) goes: lat (already divided by l) for an item of one
 * split, the split's partial otherwise; NULL when nothing is written (unused slot, or a split
 * that saw none of the slot's positions: the reducer skips it by its m = -inf).
 */
__device__ static inline float *duet__mla_out(const duet__mla_args_t &a, const duet__mla_block_t *b,
                                              int slot, int dim, float *mul)
{
    const int row = b->row[slot];
    if (row < 0)
        return NULL;
    if (b->direct) {
        *mul = 1.0f / b->l[slot];
        return a.lat + ((int64_t)row * a.n + b->head[slot]) * a.r + dim;
    }
    if (b->l[slot] == 0.0f)
        return NULL;
    *mul = 1.0f;
    return a.part_o + ((int64_t)(b->pbase + row) * a.n + b->head[slot]) * a.r + dim;
}

/* ---- attention, CUDA cores ---------------------------------------------------------------- */

/*
 * Shared memory: KV tiles [2][TK][td] (T), scores [32][TK + 4] fp32, P [TK][36] fp32.
 * Scores: warp w, slots 4w .. 4w+3; lane holds q at dims 128 j + 4 lane + e (j < 5) in registers
 * and accumulates partial dot products of 8 tokens × 4 slots; a reduce-scatter (31 shuffles)
 * leaves lane l with the full score of (token l / 4, slot l % 4).
 * P · c: thread (slot group sg of 8, dim group dg of 8 dims) keeps acc[8][8] in registers.
 */
template <typename T, int TK>
__global__ static void __launch_bounds__(DUET_MLA_THREADS, 1)
    duet__mla_attn_simt(const duet__mla_args_t a)
{
    extern __shared__ __align__(16) unsigned char duet__mla_smem[];
    __shared__ duet__mla_block_t blk;
    duet_pdl_wait(); /* the plan, q̂ and this step's cache rows are written by earlier kernels */
    duet_pdl_trigger();
    if (!duet__mla_setup(a, &blk))
        return;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int td = a.td, r = a.r;
    const int sld = TK + 4, pld = DUET_MLA_SLOTS + 4;
    T *kvs = (T *)duet__mla_smem;
    float *ss = (float *)(kvs + 2 * TK * td);
    float *pt = ss + DUET_MLA_SLOTS * sld;

    const int ndg = r / 8, sg = tid / ndg, dg = tid % ndg;
    const bool pv = sg < DUET_MLA_SLOTS / 8;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc[i][j] = 0.0f;

    const int32_t *pages = a.item_pages + (int64_t)blk.item * a.max_pages;
    const int k0 = blk.k0, k1 = blk.k1;
    duet__mla_offs_t next = duet__mla_tile_offs(a, pages, k0, k1, td);
    if (k0 < k1)
        duet__mla_load_tile(kvs, td, a, next, TK, td);
    duet__cp_async_commit();
    next = duet__mla_tile_offs(a, pages, k0 + TK, k1, td);

    /* q of this warp's 4 slots at the lane's dims, loaded while the first tile is in flight */
    const int nj = (td + 127) / 128;
    float q[5][4][4];
#pragma unroll
    for (int j = 0; j < 5; j++)
#pragma unroll
        for (int s = 0; s < 4; s++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                q[j][s][e] = duet__mla_q(a, &blk, warp * 4 + s, 128 * j + 4 * lane + e);

    int buf = 0;
    for (int t0 = k0; t0 < k1; t0 += TK, buf ^= 1) {
        duet__cp_async_wait<0>();
        __syncthreads(); /* tile t0 landed; every warp is done with the other buffer */
        if (t0 + TK < k1)
            duet__mla_load_tile(kvs + (buf ^ 1) * TK * td, td, a, next, TK, td);
        duet__cp_async_commit();
        next = duet__mla_tile_offs(a, pages, t0 + 2 * TK, k1, td);
        const T *kt = kvs + buf * TK * td;

        for (int g = 0; g < TK; g += 8) {
            float sc[32]; /* [token u][slot s] at 4 u + s */
#pragma unroll
            for (int i = 0; i < 32; i++)
                sc[i] = 0.0f;
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const T *kr = kt + (g + u) * td;
#pragma unroll
                for (int j = 0; j < 5; j++) {
                    const int d = 128 * j + 4 * lane;
                    if (j < nj && d < td) {
                        const float4 k4 = duet__ld4(kr + d);
#pragma unroll
                        for (int s = 0; s < 4; s++)
                            sc[4 * u + s] += q[j][s][0] * k4.x + q[j][s][1] * k4.y +
                                             q[j][s][2] * k4.z + q[j][s][3] * k4.w;
                    }
                }
            }
            duet__rs_step<16>(sc, lane);
            duet__rs_step<8>(sc, lane);
            duet__rs_step<4>(sc, lane);
            duet__rs_step<2>(sc, lane);
            duet__rs_step<1>(sc, lane);
            ss[(warp * 4 + (lane & 3)) * sld + g + (lane >> 2)] = sc[0];
        }
        __syncthreads();
        duet__mla_softmax<TK, DUET_MLA_SLOTS>(&blk, ss, sld, 1, 0, t0, duet__mla_put_f32{pt, pld});
        __syncthreads();
        if (pv) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float al = blk.alpha[sg * 8 + i];
#pragma unroll
                for (int j = 0; j < 8; j++)
                    acc[i][j] *= al;
            }
#pragma unroll 2
            for (int tok = 0; tok < TK; tok++) {
                const float4 p0 = *(const float4 *)(pt + tok * pld + sg * 8);
                const float4 p1 = *(const float4 *)(pt + tok * pld + sg * 8 + 4);
                const float p[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
                float v[8];
                duet__ld8(kt + tok * td + dg * 8, v);
#pragma unroll
                for (int i = 0; i < 8; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        acc[i][j] += p[i] * v[j];
            }
        }
    }
    __syncthreads();

    if (pv) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float mul = 1.0f;
            float *o = duet__mla_out(a, &blk, sg * 8 + i, dg * 8, &mul);
            if (o == NULL)
                continue;
            *(float4 *)o =
                make_float4(acc[i][0] * mul, acc[i][1] * mul, acc[i][2] * mul, acc[i][3] * mul);
            *(float4 *)(o + 4) =
                make_float4(acc[i][4] * mul, acc[i][5] * mul, acc[i][6] * mul, acc[i][7] * mul);
        }
    }
    duet__mla_write_ml(a, &blk);
}

/* ---- attention, tensor cores (BF16 cache) ------------------------------------------------- */

/*
 * Copy the block's SL query rows (q̂ then q_r, unscaled fp32) into qs [SL][ld]: slot s's dims
 * 0 .. td-1 at qs + s · ld; an unused slot's row is zero-filled. 16-byte chunks when the rows
 * allow (q_vec; r and td are multiples of 8, so no chunk straddles q̂ and q_r), else 4 bytes.
 * Coalesced, and with the dims compiled in the loop unrolls, so the slot lookups in shared
 * memory overlap instead of each waiting before its copy is issued.
 */
template <int TD, int SL>
__device__ static __forceinline__ void
duet__mla_stage_q(const duet__mla_args_t &a, const duet__mla_block_t *b, float *qs, int ld, int td)
{
    const int tid = threadIdx.x;
    if (a.q_vec) {
        const int cps = (TD > 0 ? TD : td) / 4, n = SL * cps; /* 16-byte chunks */
        constexpr int NC = (SL * TD / 4 + DUET_MLA_THREADS - 1) / DUET_MLA_THREADS;
#pragma unroll
        for (int k = 0; k < (TD > 0 ? NC : (n + DUET_MLA_THREADS - 1) / DUET_MLA_THREADS); k++) {
            const int c = tid + k * DUET_MLA_THREADS;
            if (c < n) {
                const int slot = c / cps, d = (c - slot * cps) * 4;
                const float *src = d < a.r ? b->qp[slot] + d : b->qrp[slot] + (d - a.r);
                duet__cp_async16(qs + slot * ld + d, src, b->row[slot] >= 0);
            }
        }
    } else {
        const int w = TD > 0 ? TD : td;
        for (int c = tid; c < SL * w; c += DUET_MLA_THREADS) {
            const int slot = c / w, d = c - slot * w;
            const float *src = d < a.r ? b->qp[slot] + d : b->qrp[slot] + (d - a.r);
            duet__cp_async4(qs + slot * ld + d, src, b->row[slot] >= 0);
        }
    }
}

/* The staged accumulators os [SL][ld] (dims 0 .. r-1) to each slot's destination, scaled
 * (lat and the partials are 16-byte aligned: attend checks lat, the scratch is laid out so). */
template <int R, int SL>
__device__ static __forceinline__ void
duet__mla_store_rows(const duet__mla_args_t &a, const duet__mla_block_t *b, const float *os, int ld)
{
    const int c4 = (R > 0 ? R : a.r) / 4, n = SL * c4; /* r: a multiple of 32 */
    constexpr int NC = (SL * R / 4 + DUET_MLA_THREADS - 1) / DUET_MLA_THREADS;
#pragma unroll
    for (int k = 0; k < (R > 0 ? NC : (n + DUET_MLA_THREADS - 1) / DUET_MLA_THREADS); k++) {
        const int c = threadIdx.x + k * DUET_MLA_THREADS;
        if (c >= n)
            break;
        const int slot = c / c4, d = (c - slot * c4) * 4;
        float *out = b->outp[slot];
        if (out == NULL)
            continue;
        const float mul = b->omul[slot];
        const float4 v = *(const float4 *)(os + slot * ld + d);
        *(float4 *)(out + d) = make_float4(v.x * mul, v.y * mul, v.z * mul, v.w * mul);
    }
}

/*
 * Shared memory: KV tiles [STAGES][TK][ld] bf16 (ld = td rounded up to 16, + 8: an odd 16-byte
 * row stride, so the 8 rows of an ldmatrix hit distinct banks; the columns td .. round16(td) are
 * zeroed once), partial scores [4 quarters][32][TK + 8] fp32, P hi and lo [32][TK + 8] bf16.
 * STAGES - 1 tiles are in flight while one is computed: a decode block is otherwise idle while
 * its next tile crosses the memory system, and one tile per SM is too little to cover HBM
 * latency at full bandwidth.
 * Scores: warp w = (m-tile w & 1: slots 16 (w & 1) ..+15, quarter w >> 1 of the k-steps), q̂
 * fragments (hi and lo) in registers for the whole block, TK / 8 n-tiles of 8 tokens. P · c:
 * warp w owns the 16-dim column pairs w, w + 8, w + 16, w + 24 (r <= 512) for both m-tiles.
 */
template <int TK, int STAGES, int TD, int R, int SL>
__global__ static void __launch_bounds__(DUET_MLA_THREADS, 1)
    duet__mla_attn_tc(const duet__mla_args_t a)
{
    const int NT = TK / 8, NP = TK / 16;        /* n-tiles of scores, k-steps of P · c */
    constexpr int MT = SL / 16;                 /* m-tiles of slots */
    constexpr int NTW = SL == 32 ? NT : NT / 2; /* n-tiles of scores per warp */
    extern __shared__ __align__(16) unsigned char duet__mla_smem[];
    __shared__ duet__mla_block_t blk;
    duet_pdl_wait(); /* the plan, q̂ and this step's cache rows are written by earlier kernels */
    duet_pdl_trigger();
    if (!duet__mla_setup(a, &blk))
        return;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tg = lane & 3;
    const int td = TD > 0 ? TD : a.td, tdp = (td + 15) & ~15, ld = tdp + 8;
    const int n_ks = tdp / 16, n_kq = (n_ks + 3) / 4, n_pair = (R > 0 ? R : a.r) / 16;
    const int sld = TK + 8, pst = SL * sld, pld = TK + 8;
    __nv_bfloat16 *kvs = (__nv_bfloat16 *)duet__mla_smem;
    float *sp = (float *)(kvs + STAGES * TK * ld);
    __nv_bfloat16 *ph = (__nv_bfloat16 *)(sp + 4 * pst);
    __nv_bfloat16 *pl = ph + SL * pld;
    /* q staged through stage 1, which no copy fills before the loop (one tile in flight): fp32
     * [SL][ld] takes 4 · SL · ld bytes, a stage of 64 positions 128 · ld */
    constexpr bool QS = TK >= 2 * SL && STAGES == 2;
    __nv_bfloat16 *qsb = kvs + TK * ld;
    float *qs = (float *)qsb;

    duet__mla_zero_pad(kvs, STAGES * TK, ld, td, tdp);

    /* scores: warp w takes k-quarter w >> 1 and, of 32 slots, m-tile w & 1; of 16 slots, the
     * one m-tile and half w & 1 of the n-tiles */
    const int mt = SL == 32 ? warp & 1 : 0, nh = SL == 32 ? 0 : warp & 1, kq = warp >> 1;
    float o[MT][8][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                o[m][nt][c] = 0.0f;

    /* queue tiles 0 .. STAGES-2, one copy group each, in order; `next` then holds tile
     * STAGES-1 */
    const int32_t *pages = a.item_pages + (int64_t)blk.item * a.max_pages;
    const int k0 = blk.k0, k1 = blk.k1;
    duet__mla_offs_t next = duet__mla_tile_offs(a, pages, k0, k1, td);
    for (int st = 0; st < STAGES - 1; st++) {
        const int t = k0 + st * TK;
        if (t < k1)
            duet__mla_load_tile<__nv_bfloat16, TD>(kvs + st * TK * ld, ld, a, next, TK, td);
        duet__cp_async_commit();
        next = duet__mla_tile_offs(a, pages, t + TK, k1, td);
    }

    /*
     * q fragments (hi and lo) of this warp's m-tile and k-quarter. With one tile in flight
     * (QS), the block first copies its 32 query rows into stage 1 (coalesced, all in flight),
     * and each thread reads its 72 values from there. The 32-position tiles have every stage
     * but one queued here, so there each thread loads its values from global memory: all 72
     * loads first (independent, so they are in flight together), then the splits.
     */
    float qv[9][4][2];
    if constexpr (QS) {
        duet__mla_stage_q<TD, SL>(a, &blk, qs, ld, td);
        duet__cp_async_commit();
        duet__cp_async_wait<0>(); /* (tile 0's copies too: the loop needs it next anyway) */
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 9; i++) {
        const int ks = kq * n_kq + i;
#pragma unroll
        for (int x = 0; x < 4; x++) {
            /* a0a1: (g, 2tg), a2a3: (g + 8, 2tg), a4a5: (g, 2tg + 8), a6a7: (g + 8, 2tg + 8) */
            const int slot = mt * 16 + g + (x & 1) * 8, d = ks * 16 + 2 * tg + (x >> 1) * 8;
            if constexpr (QS) {
                /* k-steps past the quarter's share and the padding dims (d >= td: td is a
                 * multiple of 8, d even) read dim 0 and become zero */
                const bool ok = i < n_kq && ks < n_ks && d < td;
                const float2 v = *(const float2 *)(qs + slot * ld + (ok ? d : 0));
                qv[i][x][0] = ok ? v.x * a.qscale : 0.0f;
                qv[i][x][1] = ok ? v.y * a.qscale : 0.0f;
            } else {
                /* k-steps past this quarter's share read dim td (clamped, then zeroed) */
                const int dq = i < n_kq && ks < n_ks ? d : a.td;
                qv[i][x][0] = duet__mla_q(a, &blk, slot, dq);
                qv[i][x][1] = duet__mla_q(a, &blk, slot, dq + 1);
            }
        }
    }
    if (QS && tdp > td) {
        /* the staged q covered stage 1's zeroed padding columns: zero them again once every
         * warp has read its values (the loop's first barrier orders the stores) */
        __syncthreads();
        duet__mla_zero_pad(qsb, TK, ld, td, tdp);
    }
    uint32_t qh[9][4], ql[9][4];
#pragma unroll
    for (int i = 0; i < 9; i++)
#pragma unroll
        for (int x = 0; x < 4; x++)
            duet_split_bf16x2(qv[i][x][0], qv[i][x][1], &qh[i][x], &ql[i][x]);

    /* per-thread ldmatrix offsets (elements) into a stage: K for the scores (this warp's
     * k-quarter), V for P · c (column pair `warp`), and into P */
    const int kb_off =
        ((lane & 7) + ((lane >> 4) << 3)) * ld + ((lane >> 3) & 1) * 8 + kq * n_kq * 16;
    const int vb_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + warp * 16 + (lane >> 4) * 8;
    const int pa_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * pld + (lane >> 4) * 8;

    int stage = 0;
    for (int t0 = k0; t0 < k1; t0 += TK) {
        duet__cp_async_wait<STAGES - 2>(); /* tile t0's group has landed (this thread's part) */
        __syncthreads(); /* ... everyone's part; and every warp is done with the previous tile */
        {
            /* refill the stage the previous tile used with tile t0 + (STAGES-1) TK */
            const int tn = t0 + (STAGES - 1) * TK;
            const int sn = stage == 0 ? STAGES - 1 : stage - 1;
            if (tn < k1)
                duet__mla_load_tile<__nv_bfloat16, TD>(kvs + sn * TK * ld, ld, a, next, TK, td);
            duet__cp_async_commit();
            next = duet__mla_tile_offs(a, pages, tn + TK, k1, td);
        }
        const __nv_bfloat16 *kt = kvs + stage * TK * ld;
        stage = stage + 1 == STAGES ? 0 : stage + 1;

        /* scores of this warp's m-tile over its k-quarter */
        float sacc[NTW][4];
#pragma unroll
        for (int nt = 0; nt < NTW; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                sacc[nt][c] = 0.0f;
        const __nv_bfloat16 *kb = kt + kb_off + nh * NTW * 8 * ld;
#pragma unroll
        for (int i = 0; i < 9; i++) {
            /* (kq <= 3: when the quarters tile the k-steps exactly, every i < n_kq is in range) */
            if (i < n_kq && (4 * n_kq <= n_ks || kq * n_kq + i < n_ks)) {
#pragma unroll
                for (int np = 0; np < NTW / 2; np++) {
                    /* matrices: (tokens 16np +0..7 | +8..15) × (dims 16ks +0..7 | +8..15) */
                    uint32_t bf[4];
                    duet_ldsm_x4(kb + 16 * np * ld + 16 * i, bf);
                    duet_mma_bf16(sacc[2 * np], qh[i], bf[0], bf[1]);
                    duet_mma_bf16(sacc[2 * np], ql[i], bf[0], bf[1]);
                    duet_mma_bf16(sacc[2 * np + 1], qh[i], bf[2], bf[3]);
                    duet_mma_bf16(sacc[2 * np + 1], ql[i], bf[2], bf[3]);
                }
            }
        }
        float *spw = sp + kq * pst + (mt * 16 + g) * sld + nh * NTW * 8 + 2 * tg;
#pragma unroll
        for (int nt = 0; nt < NTW; nt++) {
            *(float2 *)(spw + nt * 8) = make_float2(sacc[nt][0], sacc[nt][1]);
            *(float2 *)(spw + 8 * sld + nt * 8) = make_float2(sacc[nt][2], sacc[nt][3]);
        }
        __syncthreads();
        duet__mla_softmax<TK, SL>(&blk, sp, sld, 4, pst, t0, duet__mla_put_split{ph, pl, pld});
        __syncthreads();

        /* o = o · alpha + P · c */
#pragma unroll
        for (int m = 0; m < MT; m++) {
            const float a0 = blk.alpha[m * 16 + g], a1 = blk.alpha[m * 16 + g + 8];
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                o[m][nt][0] *= a0;
                o[m][nt][1] *= a0;
                o[m][nt][2] *= a1;
                o[m][nt][3] *= a1;
            }
        }
#pragma unroll
        for (int ks = 0; ks < NP; ks++) {
            uint32_t ah[MT][4], al[MT][4];
#pragma unroll
            for (int m = 0; m < MT; m++) {
                /* matrices: (slots +0..7 | +8..15) × (tokens 16ks +0..7), then tokens +8..15 */
                const int off = pa_off + m * 16 * pld + ks * 16;
                duet_ldsm_x4(ph + off, ah[m]);
                duet_ldsm_x4(pl + off, al[m]);
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                /* column pair p = warp + 8 i (warp <= 7) */
                if (8 * i + 8 <= n_pair || warp + 8 * i < n_pair) {
                    /* transposed: (tokens +0..7 | +8..15) × (dims 16p +0..7), then dims +8..15 */
                    uint32_t v[4];
                    duet_ldsm_x4_t(kt + vb_off + 16 * ks * ld + 128 * i, v);
#pragma unroll
                    for (int m = 0; m < MT; m++) {
                        duet_mma_bf16(o[m][2 * i], ah[m], v[0], v[1]);
                        duet_mma_bf16(o[m][2 * i], al[m], v[0], v[1]);
                        duet_mma_bf16(o[m][2 * i + 1], ah[m], v[2], v[3]);
                        duet_mma_bf16(o[m][2 * i + 1], al[m], v[2], v[3]);
                    }
                }
            }
        }
    }
    duet__cp_async_wait<0>(); /* no copy may land in shared memory after the block exits */
    __syncthreads();

    /*
     * The accumulators leave through shared memory (the KV stages, all consumed): fragments
     * into os [SL][ld] fp32, then whole rows out in coalesced 16-byte stores from a short
     * loop. Stored straight from the fragments, each thread had 32 scattered stores, each
     * behind its own destination lookup, in a body run once per block from a cold
     * instruction cache: most of a one-tile block's time.
     */
    float *os = (float *)kvs; /* 4 · SL · ld bytes <= STAGES · TK · ld · 2 */
    if (tid < SL) {
        float mul = 1.0f;
        blk.outp[tid] = duet__mla_out(a, &blk, tid, 0, &mul);
        blk.omul[tid] = mul;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int p = warp + 8 * i;
        if (!(8 * i + 8 <= n_pair || p < n_pair))
            continue;
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int half = 0; half < 2; half++)
#pragma unroll
                for (int rh = 0; rh < 2; rh++)
                    *(float2 *)(os + (m * 16 + g + 8 * rh) * ld + p * 16 + half * 8 + 2 * tg) =
                        make_float2(o[m][2 * i + half][2 * rh], o[m][2 * i + half][2 * rh + 1]);
    }
    __syncthreads();
    duet__mla_store_rows<R, SL>(a, &blk, os, ld);
    duet__mla_write_ml(a, &blk);
}

/* ---- the planner ------------------------------------------------------------------------- */

/* Rows of item i, its first row, and its KV length (its last row's position + 1; 0 without
 * rows): the splitkv.h length of an item whose rows attend over every earlier position. */
__device__ static inline void duet__mla_item(const int32_t *item_row0, const int32_t *row_pos,
                                             int i, int *r0, int *rows, int64_t *len)
{
    *r0 = item_row0[i];
    const int r1 = item_row0[i + 1];
    *rows = r1 - *r0;
    *len = *rows > 0 ? (int64_t)row_pos[r1 - 1] + 1 : 0;
}

/* Exclusive prefix sums of (x, y) over the block's threads in order, and their totals. */
__device__ static void duet__mla_scan2(int64_t x, int64_t y, int64_t *ex, int64_t *ey, int64_t *tx,
                                       int64_t *ty)
{
    const int NW = DUET_MLA_PLAN_NT / 32;
    __shared__ long long s_x[NW], s_y[NW];
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    long long ix = x, iy = y;
    for (int o = 1; o < 32; o <<= 1) {
        const long long ux = __shfl_up_sync(full, ix, o), uy = __shfl_up_sync(full, iy, o);
        if (lane >= o) {
            ix += ux;
            iy += uy;
        }
    }
    if (lane == 31) {
        s_x[warp] = ix;
        s_y[warp] = iy;
    }
    __syncthreads();
    long long px = 0, py = 0, sx = 0, sy = 0;
    for (int w = 0; w < NW; w++) {
        if (w < warp) {
            px += s_x[w];
            py += s_y[w];
        }
        sx += s_x[w];
        sy += s_y[w];
    }
    __syncthreads(); /* the next call reuses s_x, s_y */
    *ex = px + ix - x;
    *ey = py + iy - y;
    *tx = sx;
    *ty = sy;
}

/* The last i < n with a[i] <= v (a non-decreasing, a[0] <= v): for a scan of per-item counts,
 * the item that holds entry v (items with none share their successor's value and lose). */
__device__ static int duet__mla_find(const int32_t *a, int n, int64_t v)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (a[mid] <= v)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/*
 * The step's plan (file comment), one block: the total cost, each item's split count
 * (duet_splitkv_splits of its blocks, rows and the chunk; unsplit when it has more rows than
 * prows, which only a step breaking its max_split_rows contract has), then, from the scans of
 * work items and tasks, every entry of the work list, the tasks and the rows' reducer info in
 * parallel (each thread finds its entry's item by a binary search over the scan). It writes
 * nothing before the PDL wait: the kernels before it (a previous step's, or a test's) may
 * still read the plan it replaces.
 */
__global__ static void __launch_bounds__(DUET_MLA_PLAN_NT)
    duet__mla_plan_kernel(const int32_t *item_row0, const int32_t *row_item, const int32_t *row_pos,
                          int n_items, int n_rows, int64_t heads, int64_t units, int prows, int rb,
                          int mode, duet__mla_plan_dev_t p)
{
    const int NT = DUET_MLA_PLAN_NT, BT = DUET_MLA_PLAN_BT, tid = threadIdx.x;
    __shared__ unsigned long long s_max_blocks; /* the uniform mode's longest item */
    if (tid == 0)
        s_max_blocks = 0;
    duet_pdl_wait();
    duet_pdl_trigger();
    __syncthreads();

    int64_t total = 0, unused;
    for (int i = tid; i < n_items; i += NT) {
        int r0, rows;
        int64_t len;
        duet__mla_item(item_row0, row_pos, i, &r0, &rows, &len);
        const int64_t blocks = duet_splitkv_blocks(len, BT);
        total += duet_splitkv_cost(blocks, rows);
        atomicMax(&s_max_blocks, (unsigned long long)blocks);
    }
    duet__mla_scan2(total, 0, &unused, &unused, &total, &unused); /* synchronises the block */
    const int64_t chunk = duet_splitkv_chunk(total, heads, units);
    const int32_t uni = duet_splitkv_uniform(n_items, (int64_t)s_max_blocks, heads, units);

    int64_t n_work = 0, n_tasks = 0;
    for (int i0 = 0; i0 < n_items; i0 += NT) {
        const int i = i0 + tid;
        int32_t s = 1;
        int64_t nw = 0, nt = 0;
        if (i < n_items) {
            int r0, rows;
            int64_t len;
            duet__mla_item(item_row0, row_pos, i, &r0, &rows, &len);
            const int64_t blocks = duet_splitkv_blocks(len, BT);
            if (rows <= prows && mode == DUET_SPLITKV_PER_REQUEST)
                s = duet_splitkv_splits(blocks, rows, chunk);
            else if (rows <= prows && mode == DUET_SPLITKV_UNIFORM) /* splitkv.c's rule */
                s = (int32_t)(uni < blocks ? uni : (blocks > 1 ? blocks : 1));
            nw = blocks > 0 ? s : 0;
            nt = nw * ((rows + rb - 1) / rb);
        }
        int64_t ew, et, sw, st;
        duet__mla_scan2(nw, nt, &ew, &et, &sw, &st);
        if (i < n_items) {
            p.splits[i] = s;
            p.work0[i] = (int32_t)(n_work + ew);
            p.task0[i] = (int32_t)(n_tasks + et);
        }
        n_work += sw;
        n_tasks += st;
    }
    if (tid == 0) {
        p.work0[n_items] = (int32_t)n_work;
        p.task0[n_items] = (int32_t)n_tasks;
        p.hdr[0] = n_work;
        p.hdr[1] = n_tasks;
        p.hdr[2] = chunk;
    }
    __syncthreads(); /* the scans are read back below */

    for (int64_t w = tid; w < n_work; w += NT) {
        const int i = duet__mla_find(p.work0, n_items, w);
        int r0, rows;
        int64_t len, b0, b1;
        duet__mla_item(item_row0, row_pos, i, &r0, &rows, &len);
        const int32_t k = (int32_t)(w - p.work0[i]);
        duet_splitkv_range(duet_splitkv_blocks(len, BT), p.splits[i], k, &b0, &b1);
        p.work[w] = duet_splitkv_work_t{i, k, (int32_t)b0, (int32_t)b1};
    }
    for (int64_t t = tid; t < n_tasks; t += NT) {
        const int i = duet__mla_find(p.task0, n_items, t);
        int r0, rows;
        int64_t len, b0, b1;
        duet__mla_item(item_row0, row_pos, i, &r0, &rows, &len);
        const int nrb = (rows + rb - 1) / rb, q = (int)(t - p.task0[i]), k = q / nrb;
        const int32_t s = p.splits[i];
        duet_splitkv_range(duet_splitkv_blocks(len, BT), s, k, &b0, &b1);
        duet__mla_task_t x;
        x.item = i;
        x.row0 = r0 + (q % nrb) * rb;
        x.row1 = min(r0 + rows, x.row0 + rb);
        x.first = r0;
        x.pos0 = (int32_t)min(len, b0 * BT);
        x.pos1 = (int32_t)min(len, b1 * BT);
        x.part = s > 1 ? (p.work0[i] + k) * prows : -1;
        x.pad = 0;
        p.tasks[n_tasks - 1 - t] = x; /* reversed: the file comment */
    }
    for (int row = tid; row < n_rows; row += NT) {
        const int i = row_item[row];
        const int32_t s = p.splits[i];
        p.row_red[row] = make_int2(s > 1 ? p.work0[i] * prows + row - item_row0[i] : -1, s);
    }
}

/* ---- split reducer ------------------------------------------------------------------------ */

/*
 * lat = Σ_s 2^(m_s − M) acc_s / Σ_s 2^(m_s − M) l_s over the splits of one (row, head) of a
 * split item; a row of a one-split item returns at once (its block wrote lat). Block
 * (row · n + head, slice of 4 · cols dims), 256 threads: `cols` float4 columns × 256 / cols
 * split groups accumulate and meet in shared memory. The host picks narrow slices when there
 * are few (row, head) pairs (a lone decode item split 64 ways still spreads over hundreds of
 * blocks) and whole rows when there are many. Split s of the row's partials is vector
 * (slot + s · prows) · n + head, slot the row's split-0 slot (row_red, from the planner).
 * Latency: everything here waits on the attention kernel, so the loads are issued together
 * right after the PDL wait and the row's reducer info: each thread's first DUET_MLA_RED_PF
 * accumulators (all of them for the usual split counts) with the (m, l) pairs, and only the
 * weighting waits for the max.
 * A neutral partial (m = −inf) has no accumulator written: its weight is 0 and the garbage
 * read in its place is dropped by a select, never multiplied.
 */
#define DUET_MLA_RED_PF 4

__global__ static void __launch_bounds__(256)
    duet__mla_reduce_kernel(const int2 *row_red, const float *part_o, const float *part_ml,
                            float *lat, int n, int r, int prows, int cols)
{
    __shared__ float s_w[DUET_SPLITKV_MAX_SPLITS]; /* m_s, then the weight 2^(m_s − M) */
    __shared__ float s_l[DUET_SPLITKV_MAX_SPLITS];
    __shared__ float s_red[8];
    __shared__ float4 s_acc[256];
    const int64_t rh = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int groups = 256 / cols, col = tid % cols, grp = tid / cols;
    const int dim = (blockIdx.y * cols + col) * 4;
    const bool act = grp < groups && dim < r;

    duet_pdl_wait();
    duet_pdl_trigger();
    const int2 red = row_red[rh / n]; /* (written by the planner) */
    const int n_splits = red.y;
    if (n_splits <= 1)
        return;
    const int64_t v0 = (int64_t)red.x * n + rh % n, vs = (int64_t)prows * n; /* split 0, stride */

    float4 pf[DUET_MLA_RED_PF];
#pragma unroll
    for (int k = 0; k < DUET_MLA_RED_PF; k++) {
        const int s = grp + k * groups;
        const int sc = act && s < n_splits ? s : 0, dc = act ? dim : 0; /* clamped, always valid */
        pf[k] = *(const float4 *)(part_o + (v0 + sc * vs) * r + dc);
    }
    float mx = -INFINITY;
    for (int s = tid; s < n_splits; s += 256) {
        const float2 ml = *(const float2 *)(part_ml + 2 * (v0 + s * vs));
        s_w[s] = ml.x;
        s_l[s] = ml.y;
        mx = fmaxf(mx, ml.x);
    }
    for (int o = 16; o > 0; o >>= 1)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0)
        s_red[warp] = mx;
    __syncthreads();
    float M = s_red[0];
    for (int w = 1; w < 8; w++)
        M = fmaxf(M, s_red[w]);
    __syncthreads();

    float lsum = 0.0f;
    for (int s = tid; s < n_splits; s += 256) {
        const float m = s_w[s];
        const float w = m == -INFINITY ? 0.0f : exp2f(m - M);
        s_w[s] = w;
        lsum += w * s_l[s];
    }
    for (int o = 16; o > 0; o >>= 1)
        lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
    if (lane == 0)
        s_red[warp] = lsum;
    __syncthreads();
    float L = 0.0f;
    for (int w = 0; w < 8; w++)
        L += s_red[w];

    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (act) {
#pragma unroll
        for (int k = 0; k < DUET_MLA_RED_PF; k++) {
            const int s = grp + k * groups;
            const float w = s < n_splits ? s_w[s] : 0.0f;
            acc.x += w != 0.0f ? w * pf[k].x : 0.0f;
            acc.y += w != 0.0f ? w * pf[k].y : 0.0f;
            acc.z += w != 0.0f ? w * pf[k].z : 0.0f;
            acc.w += w != 0.0f ? w * pf[k].w : 0.0f;
        }
#pragma unroll 4
        for (int s = grp + DUET_MLA_RED_PF * groups; s < n_splits; s += groups) {
            const float4 v = *(const float4 *)(part_o + (v0 + s * vs) * r + dim);
            const float w = s_w[s];
            acc.x += w != 0.0f ? w * v.x : 0.0f;
            acc.y += w != 0.0f ? w * v.y : 0.0f;
            acc.z += w != 0.0f ? w * v.z : 0.0f;
            acc.w += w != 0.0f ? w * v.w : 0.0f;
        }
    }
    s_acc[tid] = acc;
    __syncthreads();
    if (grp == 0 && dim < r) {
        for (int g = 1; g < groups; g++) {
            const float4 v = s_acc[g * cols + col];
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        const float inv = 1.0f / L;
        *(float4 *)(lat + rh * r + dim) =
            make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    }
}

/* ---- host entry points -------------------------------------------------------------------- */

static duet_status_t duet__mla_check(const duet_cuda_step_t *st, const duet_cuda_mla_layer_t *ly,
                                     const char *what)
{
    if (st == NULL || ly == NULL || ly->kv_base == NULL || ly->n_heads < 1 || ly->page_tokens < 1 ||
        ly->page_tokens > (1 << 20) || ly->kv_n_layers < 1 || ly->layer < 0 ||
        ly->layer >= ly->kv_n_layers || st->n_rows < 0 || st->n_items < 0 || st->max_pages < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda mla %s: bad layer or step description", what);
    if (ly->kv_dtype != DUET_DTYPE_F32 && ly->kv_dtype != DUET_DTYPE_BF16)
        return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda mla %s: kv dtype %d (F32 or BF16)", what,
                              (int)ly->kv_dtype);
    if (ly->r < 32 || ly->r > DUET_MLA_MAX_R || ly->r % 32 != 0 || ly->dr < 0 || ly->dr % 8 != 0 ||
        ly->r + ly->dr > DUET_MLA_MAX_TD || ly->n_heads > (1 << 20))
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "cuda mla %s: r = %lld, dr = %lld (supported: r a multiple of 32 "
                              "<= %d, dr a multiple of 8, r + dr <= %d)",
                              what, (long long)ly->r, (long long)ly->dr, DUET_MLA_MAX_R,
                              DUET_MLA_MAX_TD);
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_mla_kv_write(cudaStream_t stream, const duet_cuda_step_t *st,
                                                const duet_cuda_mla_layer_t *ly, const float *ckr,
                                                const float *norm_w, float eps)
{
    duet_status_t s = duet__mla_check(st, ly, "kv_write");
    if (s != DUET_OK)
        return s;
    if (st->n_rows == 0)
        return DUET_OK;
    if (ckr == NULL || norm_w == NULL)
        return duet_error_set(DUET_ERR_INVALID, "cuda mla kv_write: NULL input");
    const int r = (int)ly->r, td = (int)(ly->r + ly->dr), pt = (int)ly->page_tokens;
    const dim3 grid((unsigned)st->n_rows), block(DUET_MLA_KVW_THREADS);
    if (ly->kv_dtype == DUET_DTYPE_BF16)
        DUET__TRY(duet_pdl_launch(duet__mla_kv_write_kernel<__nv_bfloat16>, grid, block, 0, stream,
                                  st->row_item, st->row_pos, st->item_pages, (int)st->max_pages,
                                  (__nv_bfloat16 *)ly->kv_base, ly->kv_n_layers, ly->layer, pt, r,
                                  td, ckr, norm_w, eps),
                  "kv_write launch");
    else
        DUET__TRY(duet_pdl_launch(duet__mla_kv_write_kernel<float>, grid, block, 0, stream,
                                  st->row_item, st->row_pos, st->item_pages, (int)st->max_pages,
                                  (float *)ly->kv_base, ly->kv_n_layers, ly->layer, pt, r, td, ckr,
                                  norm_w, eps),
                  "kv_write launch");
    return DUET_OK;
}

/*
 * Launch attention kernel `which` (blocks of `block` threads) with `smem` dynamic bytes. Above
 * 48 KiB a kernel must be opted in (cudaFuncSetAttribute); that is done once per kernel and
 * device and remembered, so steady calls (and calls inside a stream capture) are launches only.
 * Concurrent first calls may both set the attribute, which is harmless. Kernels 0 .. 7 are
 * attend's, 8 and 9 attend_x's (split and one-term products).
 */
static int duet__mla_smem_set[10][DUET_MLA_MAX_DEV];

template <typename... KArgs, typename... Args>
static duet_status_t duet__mla_launch_as(void (*kernel)(KArgs...), int which, dim3 grid, dim3 block,
                                         size_t smem, cudaStream_t stream, Args... args)
{
    int dev = 0;
    DUET__TRY(cudaGetDevice(&dev), "attend cudaGetDevice");
    if (dev < 0 || dev >= DUET_MLA_MAX_DEV || duet__mla_smem_set[which][dev] < (int)smem) {
        DUET__TRY(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
            "attend shared memory opt-in");
        if (dev >= 0 && dev < DUET_MLA_MAX_DEV)
            duet__mla_smem_set[which][dev] = (int)smem;
    }
    DUET__TRY(duet_pdl_launch(kernel, grid, block, smem, stream, args...), "attend launch");
    return DUET_OK;
}

/* attend's kernels: blocks of DUET_MLA_THREADS, the arguments in one struct */
template <typename K>
static duet_status_t duet__mla_launch(K kernel, int which, dim3 grid, size_t smem,
                                      cudaStream_t stream, const duet__mla_args_t &a)
{
    return duet__mla_launch_as(kernel, which, grid, dim3(DUET_MLA_THREADS), smem, stream, a);
}

/* Row blocks of rb rows for a step's items: the sum over items of ceil(rows_i / rb), bounded by
 * (n_rows + n_items (rb - 1)) / rb and by n_rows (the grid is sized from host counts only). */
static int64_t duet__mla_row_blocks(int64_t n_rows, int64_t n_items, int rb)
{
    const int64_t nrb = (n_rows + n_items * (rb - 1)) / rb;
    return nrb < n_rows ? nrb : n_rows;
}

static size_t duet__align256(size_t n)
{
    return (n + 255) & ~(size_t)255;
}

/* The tensor-core path's tile (positions), and whether a layer's attention runs on it. */
static int duet__mla_tk(void)
{
    return duet__mla_tc_tile == DUET_MLA_TC2_TK ? DUET_MLA_TC2_TK : DUET_MLA_TC_TK;
}

static bool duet__mla_tc(const duet_cuda_mla_layer_t *ly)
{
    const int64_t tdp = (ly->r + ly->dr + 15) & ~(int64_t)15;
    return ly->kv_dtype == DUET_DTYPE_BF16 && tdp <= DUET_MLA_TC_MAX_TD && !duet__mla_simt_only;
}

/* What the plan and attend of a step share: the attention grid's shape and where the plan's
 * parts lie in the scratch. */
typedef struct {
    int sl, hb, rb, hg; /* slots, heads and rows per block, head groups */
    int64_t units;      /* the plan's parallel units */
    int64_t prows;      /* partial rows per work item: the most rows a split item has */
    int64_t max_work, max_tasks;
    size_t o_hdr, o_splits, o_work0, o_task0, o_work, o_tasks, o_red, o_ml, o_o, total;
} duet__mla_layout_t;

/*
 * The layout for a step of n_items items, n_rows rows and items of at most split_rows rows
 * split (clamped to 0 .. DUET_SPLITKV_MAX_ROWS), from host values only, so the planner, attend
 * and duet_cuda_mla_scratch_bytes agree, and a graph captured for a bucket keeps it. Every part
 * grows with each count, so the bytes for the largest step cover every smaller one.
 * Task bound: one per row block of every item, plus, per split beyond an item's first (at most
 * duet_splitkv_want_work of them over the step: each costs more than a chunk), the row blocks
 * of an item of at most prows rows.
 */
static void duet__mla_layout(const duet_cuda_mla_layer_t *ly, int64_t n_items, int64_t n_rows,
                             int64_t split_rows, duet__mla_layout_t *p)
{
    p->sl = duet__mla_tc(ly) && duet__mla_tk() == DUET_MLA_TC_TK && duet__mla_tc_slots == 16
                ? 16
                : DUET_MLA_SLOTS;
    p->hb = ly->n_heads < p->sl ? (int)ly->n_heads : p->sl;
    p->rb = p->sl / p->hb;
    p->hg = (int)((ly->n_heads + p->hb - 1) / p->hb);
    /* DUET_CUDA_MLA_SMS_PER_UNIT SMs to a unit (file comment) */
    const int sms = duet_cuda_sm_count();
    const int su = sms / DUET_CUDA_MLA_SMS_PER_UNIT;
    p->units = duet__mla_plan_units > 0 ? duet__mla_plan_units : (su > 0 ? su : 1);
    p->prows = split_rows < 0                       ? 0
               : split_rows > DUET_SPLITKV_MAX_ROWS ? DUET_SPLITKV_MAX_ROWS
                                                    : split_rows;
    p->max_work = duet_splitkv_max_work(n_items, p->hg, p->units);
    p->max_tasks = duet__mla_row_blocks(n_rows, n_items, p->rb) +
                   duet_splitkv_want_work(p->hg, p->units) * ((p->prows + p->rb - 1) / p->rb);
    const size_t I = (size_t)n_items, W = (size_t)p->max_work, V = W * (size_t)p->prows;
    size_t at = 0;
    p->o_hdr = at;
    at += duet__align256(3 * sizeof(int64_t));
    p->o_splits = at;
    at += duet__align256(I * sizeof(int32_t));
    p->o_work0 = at;
    at += duet__align256((I + 1) * sizeof(int32_t));
    p->o_task0 = at;
    at += duet__align256((I + 1) * sizeof(int32_t));
    p->o_work = at;
    at += duet__align256(W * sizeof(duet_splitkv_work_t));
    p->o_tasks = at;
    at += duet__align256((size_t)p->max_tasks * sizeof(duet__mla_task_t));
    p->o_red = at;
    at += duet__align256((size_t)n_rows * sizeof(int2));
    p->o_ml = at;
    at += duet__align256(V * (size_t)ly->n_heads * 2 * sizeof(float));
    p->o_o = at;
    at += V * (size_t)ly->n_heads * (size_t)ly->r * sizeof(float);
    p->total = at;
}

/* The layout of st's step and the plan's device pointers in `scratch`, after checking that the
 * scratch holds it; `what` names the caller in errors. */
static duet_status_t duet__mla_plan_at(const duet_cuda_step_t *st, const duet_cuda_mla_layer_t *ly,
                                       void *scratch, size_t bytes, const char *what,
                                       duet__mla_layout_t *p, duet__mla_plan_dev_t *d)
{
    if (st->max_split_rows < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda mla %s: max_split_rows = %d", what,
                              (int)st->max_split_rows);
    duet__mla_layout(ly, st->n_items, st->n_rows, st->max_split_rows, p);
    if (p->max_tasks > INT32_MAX || p->max_work * p->prows > INT32_MAX || p->hg > 65535)
        return duet_error_set(DUET_ERR_RANGE, "cuda mla %s: %d items and %d rows: too many to plan",
                              what, (int)st->n_items, (int)st->n_rows);
    if (scratch == NULL || (uintptr_t)scratch % 16 != 0 || bytes < p->total)
        return duet_error_set(DUET_ERR_RANGE,
                              "cuda mla %s: the scratch (%zu bytes at %p) must be 16-byte aligned "
                              "and hold %zu (duet_cuda_mla_scratch_bytes)",
                              what, bytes, scratch, p->total);
    char *b = (char *)scratch;
    d->hdr = (int64_t *)(b + p->o_hdr);
    d->splits = (int32_t *)(b + p->o_splits);
    d->work0 = (int32_t *)(b + p->o_work0);
    d->task0 = (int32_t *)(b + p->o_task0);
    d->work = (duet_splitkv_work_t *)(b + p->o_work);
    d->tasks = (duet__mla_task_t *)(b + p->o_tasks);
    d->row_red = (int2 *)(b + p->o_red);
    d->part_ml = (float *)(b + p->o_ml);
    d->part_o = (float *)(b + p->o_o);
    return DUET_OK;
}

extern "C" size_t duet_cuda_mla_scratch_bytes(const duet_cuda_mla_layer_t *ly, int64_t max_items,
                                              int64_t max_rows, int64_t max_split_rows)
{
    if (ly == NULL || ly->n_heads < 1 || ly->r < 1 || max_items < 0 || max_rows < 0 ||
        max_items > INT32_MAX || max_rows > INT32_MAX)
        return 0;
    duet__mla_layout_t p;
    duet__mla_layout(ly, max_items, max_rows, max_split_rows, &p);
    return p.total;
}

extern "C" duet_status_t duet_cuda_mla_plan(cudaStream_t stream, const duet_cuda_step_t *st,
                                            const duet_cuda_mla_layer_t *ly, void *scratch,
                                            size_t scratch_bytes)
{
    duet_status_t s = duet__mla_check(st, ly, "plan");
    if (s != DUET_OK)
        return s;
    if (st->n_items == 0)
        return DUET_OK;
    duet__mla_layout_t p;
    duet__mla_plan_dev_t d;
    s = duet__mla_plan_at(st, ly, scratch, scratch_bytes, "plan", &p, &d);
    if (s != DUET_OK)
        return s;
    DUET__TRY(duet_pdl_launch(duet__mla_plan_kernel, dim3(1), dim3(DUET_MLA_PLAN_NT), 0, stream,
                              st->item_row0, st->row_item, st->row_pos, (int)st->n_items,
                              (int)st->n_rows, (int64_t)p.hg, p.units, (int)p.prows, p.rb,
                              duet__mla_plan_mode, d),
              "plan launch");
    return DUET_OK;
}

/* Test hook: the parameters a step of st's shape is planned with (heads, units, block
 * positions, work list and task capacity) and where its plan lies in `scratch` (device
 * pointers: header [n_work, n_tasks, chunk], splits, work0, work). */
extern "C" duet_status_t duet__cuda_mla_plan_where(const duet_cuda_step_t *st,
                                                   const duet_cuda_mla_layer_t *ly, void *scratch,
                                                   size_t scratch_bytes, int64_t shape[5],
                                                   void *where[4])
{
    duet_status_t s = duet__mla_check(st, ly, "plan_where");
    if (s != DUET_OK)
        return s;
    duet__mla_layout_t p;
    duet__mla_plan_dev_t d;
    s = duet__mla_plan_at(st, ly, scratch, scratch_bytes, "plan_where", &p, &d);
    if (s != DUET_OK)
        return s;
    shape[0] = p.hg;
    shape[1] = p.units;
    shape[2] = DUET_MLA_PLAN_BT;
    shape[3] = p.max_work;
    shape[4] = p.max_tasks;
    where[0] = d.hdr;
    where[1] = d.splits;
    where[2] = d.work0;
    where[3] = d.work;
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_mla_attend(cudaStream_t stream, const duet_cuda_step_t *st,
                                              const duet_cuda_mla_layer_t *ly, const float *qhat,
                                              const float *qr, int64_t ldqr, int64_t dqr_stride,
                                              float scale, float *lat, void *scratch,
                                              size_t scratch_bytes)
{
    duet_status_t s = duet__mla_check(st, ly, "attend");
    if (s != DUET_OK)
        return s;
    if (st->n_rows == 0 || st->n_items == 0)
        return DUET_OK;
    if (qhat == NULL || lat == NULL || (ly->dr > 0 && qr == NULL))
        return duet_error_set(DUET_ERR_INVALID, "cuda mla attend: NULL input or output");
    if ((uintptr_t)lat % 16 != 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda mla attend: lat not 16-byte aligned");
    duet__mla_layout_t p;
    duet__mla_plan_dev_t d;
    s = duet__mla_plan_at(st, ly, scratch, scratch_bytes, "attend", &p, &d);
    if (s != DUET_OK)
        return s;

    duet__mla_args_t a;
    a.item_pages = st->item_pages;
    a.row_pos = st->row_pos;
    a.n_rows = st->n_rows;
    a.max_pages = st->max_pages;
    a.kv = ly->kv_base;
    a.kv_n_layers = ly->kv_n_layers;
    a.layer = ly->layer;
    a.page_tokens = (int)ly->page_tokens;
    a.pt_shift = -1;
    for (int k = 0; k < 21; k++)
        if (ly->page_tokens == ((int64_t)1 << k))
            a.pt_shift = k;
    a.n = (int)ly->n_heads;
    a.r = (int)ly->r;
    a.td = (int)(ly->r + ly->dr);
    a.qhat = qhat;
    a.qr = qr;
    a.ldqr = ldqr;
    a.dqr_stride = dqr_stride;
    a.qscale = scale * DUET_LOG2E;
    a.lat = lat;
    a.tasks = d.tasks;
    a.n_tasks = d.hdr + 1;
    a.part_o = d.part_o;
    a.part_ml = d.part_ml;
    a.q_vec = (uintptr_t)qhat % 16 == 0 &&
              (ly->dr == 0 || ((uintptr_t)qr % 16 == 0 && ldqr % 4 == 0 && dqr_stride % 4 == 0));
    a.hb = p.hb;
    a.rb = p.rb;

    const int tdp = (a.td + 15) & ~15;
    const int sl = p.sl;
    const dim3 grid((unsigned)p.max_tasks, (unsigned)p.hg);

    if (duet__mla_tc(ly)) {
        const int tk = duet__mla_tk();
        const int stages = tk == DUET_MLA_TC_TK ? DUET_MLA_TC_STAGES : DUET_MLA_TC2_STAGES;
        const size_t smem = (size_t)stages * tk * (tdp + 8) * 2 + (size_t)4 * sl * (tk + 8) * 4 +
                            (size_t)2 * sl * (tk + 8) * 2;
        /* Kimi Linear's rows (512 + 64) get a kernel with the dims compiled in: its shared-
         * memory addresses fold into immediates instead of being recomputed every tile */
        const bool kimi = a.r == 512 && a.td == 576;
        if (tk == DUET_MLA_TC_TK && kimi && sl == 16)
            s = duet__mla_launch(
                duet__mla_attn_tc<DUET_MLA_TC_TK, DUET_MLA_TC_STAGES, 576, 512, 16>, 6, grid, smem,
                stream, a);
        else if (tk == DUET_MLA_TC_TK && sl == 16)
            s = duet__mla_launch(duet__mla_attn_tc<DUET_MLA_TC_TK, DUET_MLA_TC_STAGES, 0, 0, 16>, 7,
                                 grid, smem, stream, a);
        else if (tk == DUET_MLA_TC_TK && kimi)
            s = duet__mla_launch(
                duet__mla_attn_tc<DUET_MLA_TC_TK, DUET_MLA_TC_STAGES, 576, 512, DUET_MLA_SLOTS>, 4,
                grid, smem, stream, a);
        else if (tk == DUET_MLA_TC_TK)
            s = duet__mla_launch(
                duet__mla_attn_tc<DUET_MLA_TC_TK, DUET_MLA_TC_STAGES, 0, 0, DUET_MLA_SLOTS>, 0,
                grid, smem, stream, a);
        else if (kimi)
            s = duet__mla_launch(
                duet__mla_attn_tc<DUET_MLA_TC2_TK, DUET_MLA_TC2_STAGES, 576, 512, DUET_MLA_SLOTS>,
                5, grid, smem, stream, a);
        else
            s = duet__mla_launch(
                duet__mla_attn_tc<DUET_MLA_TC2_TK, DUET_MLA_TC2_STAGES, 0, 0, DUET_MLA_SLOTS>, 3,
                grid, smem, stream, a);
    } else if (ly->kv_dtype == DUET_DTYPE_BF16) {
        const int tk = 64;
        const size_t smem = (size_t)2 * tk * a.td * 2 + (size_t)DUET_MLA_SLOTS * (tk + 4) * 4 +
                            (size_t)tk * (DUET_MLA_SLOTS + 4) * 4;
        s = duet__mla_launch(duet__mla_attn_simt<__nv_bfloat16, 64>, 1, grid, smem, stream, a);
    } else {
        const int tk = 32;
        const size_t smem = (size_t)2 * tk * a.td * 4 + (size_t)DUET_MLA_SLOTS * (tk + 4) * 4 +
                            (size_t)tk * (DUET_MLA_SLOTS + 4) * 4;
        s = duet__mla_launch(duet__mla_attn_simt<float, 32>, 2, grid, smem, stream, a);
    }
    if (s != DUET_OK)
        return s;

    if (p.prows > 0) { /* some item may be split: merge its rows */
        /* widest slice (<= 128 float4 columns, the whole row at r = 512) that still gives >= 512
         * blocks, at least 16 columns */
        const int64_t n_rh = (int64_t)a.n_rows * a.n;
        int cols = a.r / 4 < 128 ? a.r / 4 : 128;
        while (cols > 16 && n_rh * ((a.r / 4 + cols - 1) / cols) < 512)
            cols /= 2;
        const dim3 rgrid((unsigned)n_rh, (unsigned)((a.r / 4 + cols - 1) / cols));
        DUET__TRY(duet_pdl_launch(duet__mla_reduce_kernel, rgrid, dim3(256), 0, stream,
                                  (const int2 *)d.row_red, (const float *)a.part_o,
                                  (const float *)a.part_ml, lat, a.n, a.r, (int)p.prows, cols),
                  "attend reduce launch");
    }
    return DUET_OK;
}

/* ---- the expanded form (prefill) ---------------------------------------------------------- */

/* Cache rows of an item (its page row `pages`) at positions p0 .. p0 + np - 1 as fp32 [np][td]:
 * one block per row. */
template <typename T>
__global__ static void __launch_bounds__(128)
    duet__mla_gather_kernel(const int32_t *item_pages, const T *kv, int64_t kv_n_layers,
                            int64_t layer, int pt, int td, int p0, float *out)
{
    const int i = blockIdx.x, p = p0 + i;
    const int64_t base = duet__mla_row_off(item_pages[p / pt], p % pt, kv_n_layers, layer, pt, td);
    for (int j = threadIdx.x; j < td; j += blockDim.x)
        out[(int64_t)i * td + j] = duet__mla_ld1(kv + base + j);
}

/*
 * Expanded rows of positions p0 + i (block x = i, head blockIdx.y): v = kv[i][n dn + h dv ..],
 * k = kv[i][h dn ..] (fp32), k_r = ckr[i][r ..] (gathered cache values, exact in bf16), into
 * [v_hi | v_lo | k_hi | k_r | k_lo] at xkv + (h · xstride + p0 + i) · 576.
 */
__global__ static void __launch_bounds__(DUET_MLA_X_DN)
    duet__mla_pack_kernel(const float *kv, int64_t ldkv, const float *ckr, int td, int r, int n,
                          int p0, __nv_bfloat16 *xkv, int64_t xstride)
{
    const int i = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const int DN = DUET_MLA_X_DN;
    const float *row = kv + (int64_t)i * ldkv;
    __nv_bfloat16 *x = xkv + ((int64_t)h * xstride + p0 + i) * DUET_MLA_X_TD;
    __nv_bfloat16 vh, vl, kh, kl;
    duet_split_bf16(row[(int64_t)n * DN + (int64_t)h * DN + j], &vh, &vl);
    duet_split_bf16(row[(int64_t)h * DN + j], &kh, &kl);
    x[j] = vh;
    x[DN + j] = vl;
    x[2 * DN + j] = kh;
    x[3 * DN + DUET_MLA_X_DR + j] = kl;
    if (j < DUET_MLA_X_DR)
        x[3 * DN + j] = __float2bfloat16_rn(ckr[(int64_t)i * td + r + j]);
}

/* wkv rows: W_UK[h] (dn × r, from wuk_t [n][r][dn]) for every head, then wuv [n][dv][r]. */
template <typename T>
__global__ static void duet__mla_x_weights_kernel(const T *wuk_t, const T *wuv, T *wkv, int n,
                                                  int r)
{
    const int DN = DUET_MLA_X_DN;
    const int64_t total = (int64_t)2 * n * DN * r;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = e / r, c = e % r;
        if (row < (int64_t)n * DN) {
            const int64_t h = row / DN, d = row % DN;
            wkv[e] = wuk_t[(h * r + c) * DN + d];
        } else
            wkv[e] = wuv[e - (int64_t)n * DN * r];
    }
}

/*
 * Attention over the expanded rows, flash-attention style: block (64 query rows, head), 4 warps
 * of 16 rows each, tiles of 32 positions through DUET_MLA_XA_STAGES shared-memory stages (2
 * blocks per SM). A warp holds its rows' q fragments (hi and lo, 12 k-steps of 16 over the 192
 * query dims, pre-scaled by scale · log2 e) in registers, its scores and the online softmax in
 * registers (a row's 8 values per thread, reduced over the quad), and P · V accumulates into
 * 16 n-tiles of 8 value dims: no scores cross warps, one barrier per tile. TERMS = 3, the split
 * products: q · k = qh · kh + ql · kh + qh · kl over the nope dims (kh, kl the row's k_hi, k_lo),
 * qh · kr + ql · kr over the rope dims (k_r is exact in bf16), P · v = Ph · vh + Pl · vh + Ph · vl;
 * the dropped lo · lo terms are < 2^-18 of the product. TERMS = 1: qh · kh, qh · kr and Ph · vh
 * alone, a third of the products, each operand rounded to bf16 once, and the stage holds only
 * the chunks those read (duet__mla_xa_cols). An item's rows must be consecutive
 * positions (row t at item_pos0 + t), as every step's are: a block reads its item's positions 0
 * .. its last row's.
 */
#define DUET_MLA_XA_STAGES  3
#define DUET_MLA_XA_THREADS 128

/* A stage row of the TERMS-term kernel: the chunks it reads (duet__mla_xa_cols) and 8 dims more,
 * an odd number of 16-byte chunks per row; the kernel's shared memory. */
template <int TERMS> struct duet__mla_xa_shape {
    static constexpr int LD = duet__mla_xa_cols<TERMS>::N * 8 + 8;
    static constexpr int SMEM = DUET_MLA_XA_STAGES * DUET_MLA_XA_TK * LD * 2;
};

/* Queue the copy of positions t0 .. t0 + TK - 1 of a head's rows into a stage (rows of LD
 * elements). */
template <int TERMS>
__device__ static __forceinline__ void duet__mla_xa_load(__nv_bfloat16 *dst,
                                                         const __nv_bfloat16 *src, int t0, int L)
{
    constexpr int LD = duet__mla_xa_shape<TERMS>::LD;
    duet__mla_xa_copy<DUET_MLA_XA_THREADS, TERMS>(
        src, t0, L, [dst](int row, int c) { return dst + row * LD + c * 8; });
}

template <int TERMS>
__global__ static void __launch_bounds__(DUET_MLA_XA_THREADS, 2)
    duet__mla_xattn_kernel(const __nv_bfloat16 *xkv, int64_t xstride, const int32_t *item_row0,
                           int n_items, const int32_t *row_pos, const float *q, int64_t ldq,
                           int64_t dq_stride, float qscale, int n, float *out)
{
    extern __shared__ __align__(16) unsigned char duet__mla_smem[];
    __shared__ int s_blk[3]; /* first row, end of the item's rows, item's first expanded row */
    __nv_bfloat16 *kvs = (__nv_bfloat16 *)duet__mla_smem;
    constexpr int LD = duet__mla_xa_shape<TERMS>::LD, KO = duet__mla_xa_cols<TERMS>::K;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, tg = lane & 3;
    const int head = blockIdx.y, TK = DUET_MLA_XA_TK;
    duet__mla_xa_rows_t b; /* which item and rows (mla_x.cuh); blocks without rows exit */
    if (!duet__mla_xa_begin(xkv, xstride, item_row0, n_items, row_pos, s_blk, &b))
        return;
    const int L = b.L, r0 = b.r0, r1 = b.r1, n_rows = b.n_rows, p0 = b.p0, p1 = b.p1;
    const int wr = b.row0 + 16 * warp; /* warp's rows */
    const int wmax = wr < n_rows ? row_pos[min(wr + 15, n_rows - 1)] : -1;
    const __nv_bfloat16 *src = b.src;
    const int n_tiles = (L + TK - 1) / TK;
#pragma unroll
    for (int st = 0; st < DUET_MLA_XA_STAGES - 1; st++) {
        if (st < n_tiles)
            duet__mla_xa_load<TERMS>(kvs + st * TK * LD, src, st * TK, L);
        duet__cp_async_commit();
    }

    uint32_t qh[12][4], ql[12][4];
    duet__mla_xa_q(q, ldq, dq_stride, head, qscale, r0, r1, n_rows, tg, qh, ql);

    float o[64], m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; i++)
        o[i] = 0.0f;
    /* ldmatrix lane offsets: K (tokens × dims, non-transposed) and V (transposed) */
    const int kb_off = ((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8;
    const int vb_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;

    for (int t = 0; t < n_tiles; t++) {
        duet__cp_async_wait<DUET_MLA_XA_STAGES - 2>();
        __syncthreads(); /* tile t landed; every warp is done with tile t - 1's stage */
        {
            const int tn = t + DUET_MLA_XA_STAGES - 1;
            if (tn < n_tiles)
                duet__mla_xa_load<TERMS>(kvs + (tn % DUET_MLA_XA_STAGES) * TK * LD, src, tn * TK,
                                         L);
            duet__cp_async_commit();
        }
        const int t0 = t * TK;
        if (t0 > wmax)
            continue; /* every row of this warp is before the tile */
        const __nv_bfloat16 *kt = kvs + (t % DUET_MLA_XA_STAGES) * TK * LD;

        float s[16];
#pragma unroll
        for (int i = 0; i < 16; i++)
            s[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < 12; j++) {
#pragma unroll
            for (int np = 0; np < 2; np++) {
                /* k_hi (j < 8) or k_r (j >= 8): stage dims KO + 16 j; k_lo: KO + 192 + 16 j */
                uint32_t b[4];
                duet_ldsm_x4(kt + kb_off + 16 * np * LD + KO + 16 * j, b);
                duet_mma_bf16(s + 8 * np, qh[j], b[0], b[1]);
                duet_mma_bf16(s + 8 * np + 4, qh[j], b[2], b[3]);
                if (TERMS == 3) {
                    duet_mma_bf16(s + 8 * np, ql[j], b[0], b[1]);
                    duet_mma_bf16(s + 8 * np + 4, ql[j], b[2], b[3]);
                }
                if (TERMS == 3 && j < 8) {
                    duet_ldsm_x4(kt + kb_off + 16 * np * LD + KO + DUET_MLA_X_DN + DUET_MLA_X_DR +
                                     16 * j,
                                 b);
                    duet_mma_bf16(s + 8 * np, qh[j], b[0], b[1]);
                    duet_mma_bf16(s + 8 * np + 4, qh[j], b[2], b[3]);
                }
            }
        }

        float a0, a1;
        duet__mla_xa_softmax(s, t0, tg, p0, p1, m0, m1, l0, l1, a0, a1);
        duet__mla_xa_rescale(o, a0, a1);

        /* o += P · (v_hi + v_lo) (TERMS = 1: P · v_hi), k-steps of 16 positions; P's fragments
         * are s's registers */
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            uint32_t ph[4], pl[4];
            duet__mla_xa_p(s, kk, ph, pl);
            const __nv_bfloat16 *vt = kt + vb_off + 16 * kk * LD;
#pragma unroll
            for (int jp = 0; jp < 8; jp++) {
                uint32_t v[4];
                duet_ldsm_x4_t(vt + 16 * jp, v);
                duet_mma_bf16(o + 8 * jp, ph, v[0], v[1]);
                duet_mma_bf16(o + 8 * jp + 4, ph, v[2], v[3]);
                if (TERMS == 3) {
                    duet_mma_bf16(o + 8 * jp, pl, v[0], v[1]);
                    duet_mma_bf16(o + 8 * jp + 4, pl, v[2], v[3]);
                    duet_ldsm_x4_t(vt + DUET_MLA_X_DN + 16 * jp, v);
                    duet_mma_bf16(o + 8 * jp, ph, v[0], v[1]);
                    duet_mma_bf16(o + 8 * jp + 4, ph, v[2], v[3]);
                }
            }
        }
    }
    duet__cp_async_wait<0>(); /* no copy may land in shared memory after the block exits */
    duet__mla_xa_store(o, l0, l1, r0, r1, n_rows, n, head, tg, out);
}

extern "C" int duet_cuda_mla_x_shape(const duet_cuda_mla_layer_t *ly, int64_t dn, int64_t dv)
{
    return ly != NULL && ly->kv_dtype == DUET_DTYPE_BF16 && dn == DUET_MLA_X_DN &&
           dv == DUET_MLA_X_DN && ly->dr == DUET_MLA_X_DR && ly->r >= 32 &&
           ly->r <= DUET_MLA_MAX_R && ly->r % 32 == 0;
}

extern "C" size_t duet_cuda_mla_x_bytes(int64_t positions, int64_t n_heads)
{
    if (positions < 1 || n_heads < 1)
        return 0;
    return (size_t)positions * (size_t)n_heads * DUET_MLA_X_TD * sizeof(__nv_bfloat16);
}

extern "C" duet_status_t duet_cuda_mla_x_weights(cudaStream_t stream, duet_dtype_t dtype,
                                                 const void *wuk_t, const void *wuv, int64_t n,
                                                 int64_t r, void *wkv)
{
    if (wuk_t == NULL || wuv == NULL || wkv == NULL || n < 1 || n > (1 << 20) || r < 1 ||
        r > DUET_MLA_MAX_R)
        return duet_error_set(DUET_ERR_INVALID, "cuda mla x_weights: bad arguments");
    const dim3 grid(1024), block(256);
    if (dtype == DUET_DTYPE_BF16)
        duet__mla_x_weights_kernel<<<grid, block, 0, stream>>>(
            (const __nv_bfloat16 *)wuk_t, (const __nv_bfloat16 *)wuv, (__nv_bfloat16 *)wkv, (int)n,
            (int)r);
    else if (dtype == DUET_DTYPE_F32)
        duet__mla_x_weights_kernel<<<grid, block, 0, stream>>>(
            (const float *)wuk_t, (const float *)wuv, (float *)wkv, (int)n, (int)r);
    else
        return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda mla x_weights: dtype %d", (int)dtype);
    DUET__TRY(cudaGetLastError(), "x_weights launch");
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_mla_gather(cudaStream_t stream, const duet_cuda_step_t *st,
                                              const duet_cuda_mla_layer_t *ly, int64_t item,
                                              int64_t p0, int64_t np, float *out)
{
    duet_status_t s = duet__mla_check(st, ly, "gather");
    if (s != DUET_OK)
        return s;
    if (np == 0)
        return DUET_OK;
    if (item < 0 || item >= st->n_items)
        return duet_error_set(DUET_ERR_INVALID, "cuda mla gather: item %lld of %d", (long long)item,
                              (int)st->n_items);
    if (out == NULL || p0 < 0 || np < 0 || p0 + np > st->max_pages * ly->page_tokens ||
        p0 + np > INT32_MAX)
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda mla gather: positions %lld .. %lld outside item %lld's pages",
                              (long long)p0, (long long)(p0 + np), (long long)item);
    const int32_t *pages = st->item_pages + item * st->max_pages;
    const int td = (int)(ly->r + ly->dr), pt = (int)ly->page_tokens;
    if (ly->kv_dtype == DUET_DTYPE_BF16)
        duet__mla_gather_kernel<<<(unsigned)np, 128, 0, stream>>>(
            pages, (const __nv_bfloat16 *)ly->kv_base, ly->kv_n_layers, ly->layer, pt, td, (int)p0,
            out);
    else
        duet__mla_gather_kernel<<<(unsigned)np, 128, 0, stream>>>(
            pages, (const float *)ly->kv_base, ly->kv_n_layers, ly->layer, pt, td, (int)p0, out);
    DUET__TRY(cudaGetLastError(), "gather launch");
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_mla_x_pack(cudaStream_t stream, const duet_cuda_mla_layer_t *ly,
                                              const float *kv, int64_t ldkv, const float *ckr,
                                              int64_t p0, int64_t np, void *xkv, int64_t xstride)
{
    if (!duet_cuda_mla_x_shape(ly, DUET_MLA_X_DN, DUET_MLA_X_DN))
        return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda mla x_pack: not the expanded shape");
    if (np == 0)
        return DUET_OK;
    const int64_t n = ly->n_heads;
    if (kv == NULL || ckr == NULL || xkv == NULL || p0 < 0 || np < 0 || p0 + np > xstride ||
        ldkv < 2 * n * DUET_MLA_X_DN || np > INT32_MAX || n > 65535)
        return duet_error_set(DUET_ERR_INVALID, "cuda mla x_pack: bad arguments");
    duet__mla_pack_kernel<<<dim3((unsigned)np, (unsigned)n), DUET_MLA_X_DN, 0, stream>>>(
        kv, ldkv, ckr, (int)(ly->r + ly->dr), (int)ly->r, (int)n, (int)p0, (__nv_bfloat16 *)xkv,
        xstride);
    DUET__TRY(cudaGetLastError(), "x_pack launch");
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_mla_attend_x(cudaStream_t stream, const duet_cuda_step_t *st,
                                                const duet_cuda_mla_layer_t *ly, const void *xkv,
                                                int64_t xstride, const float *q, int64_t ldq,
                                                int64_t dq_stride, float scale, duet_dtype_t prec,
                                                float *o)
{
    duet_status_t s = duet__mla_check(st, ly, "attend_x");
    if (s != DUET_OK)
        return s;
    if (!duet_cuda_mla_x_shape(ly, DUET_MLA_X_DN, DUET_MLA_X_DN))
        return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda mla attend_x: not the expanded shape");
    if (st->n_rows == 0)
        return DUET_OK;
    if (xkv == NULL || q == NULL || o == NULL || xstride < 1 || (uintptr_t)o % 16 != 0 ||
        (uintptr_t)xkv % 16 != 0 || ly->n_heads > 65535)
        return duet_error_set(DUET_ERR_INVALID, "cuda mla attend_x: bad arguments");

    if ((uintptr_t)q % 8 != 0 || ldq % 2 != 0 || dq_stride % 2 != 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda mla attend_x: q not 8-byte aligned");
    if (prec != DUET_DTYPE_F32 && prec != DUET_DTYPE_BF16)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "cuda mla attend_x: products in dtype %d, not F32 or BF16",
                              (int)prec);
    const int terms = prec == DUET_DTYPE_BF16 ? 1 : 3;
    /* 2^x units, as attend: scores come out multiplied by log2 e */
    const float qscale = scale * DUET_LOG2E;
    const int n = (int)ly->n_heads;
    const int64_t nrb = duet__mla_row_blocks(st->n_rows, st->n_items, DUET_MLA_XA_ROWS);
    static int no_wgmma = -1;
    const int which = duet__mla_x_kernel, usable = duet__mla_wgmma_usable();
    if (which == 2 && !usable)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "cuda mla attend_x: the wgmma kernel needs an sm_90a device");
    if (which == 2 ||
        (which == 0 && usable && !duet_cuda_env_flag(&no_wgmma, "DUET_CUDA_NO_MLA_WGMMA")))
        return duet__mla_xattn_wg(stream, dim3((unsigned)nrb, (unsigned)n), terms,
                                  (const __nv_bfloat16 *)xkv, xstride, st->item_row0,
                                  (int)st->n_items, st->row_pos, q, ldq, dq_stride, qscale, n, o);
    return terms == 1
               ? duet__mla_launch_as(duet__mla_xattn_kernel<1>, 9, dim3((unsigned)nrb, (unsigned)n),
                                     dim3(DUET_MLA_XA_THREADS), duet__mla_xa_shape<1>::SMEM, stream,
                                     (const __nv_bfloat16 *)xkv, xstride, st->item_row0,
                                     (int)st->n_items, st->row_pos, q, ldq, dq_stride, qscale, n, o)
               : duet__mla_launch_as(duet__mla_xattn_kernel<3>, 8, dim3((unsigned)nrb, (unsigned)n),
                                     dim3(DUET_MLA_XA_THREADS), duet__mla_xa_shape<3>::SMEM, stream,
                                     (const __nv_bfloat16 *)xkv, xstride, st->item_row0,
                                     (int)st->n_items, st->row_pos, q, ldq, dq_stride, qscale, n,
                                     o);
}
