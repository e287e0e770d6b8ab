/*
 * cuda_wgmma.cuh: what the Hopper warpgroup-MMA kernels share (CUDA C++ only): the shared-memory
 * matrix descriptor of the 128-byte swizzled layout, wgmma's fence / commit / wait, and the
 * launches' shared-memory opt-in; the copies that feed them, and the mbarriers, are
 * cuda_async.cuh's. The kernels
 * live in files compiled for sm_90a alone (moe_wgmma.cu, mla_wgmma.cu); the opt-in serves other
 * targets too (moe.cu).
 *
 * The 128-byte swizzled layout: rows of 128 bytes (64 bf16) whose 16-byte chunks are XOR-ed
 * with the row's low 3 bits, 8-row groups of 1024 bytes, a tile starting on 1024 bytes. As a
 * K-major operand (k contiguous) the rows are m or n and a k-slice of 16 starts 32 bytes into
 * the row; as an MN-major one (transposed, 16-bit types only) the rows are k and each row holds
 * 64 consecutive m or n, the next 64 of them `lbo` bytes on.
 */
#ifndef DUET_KERNELS_CUDA_WGMMA_CUH
#define DUET_KERNELS_CUDA_WGMMA_CUH

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_async.cuh"

/* The wgmma instructions exist in sm_90a code alone; another target (not what the build asks
 * for) gets code that traps instead of failing to assemble. */
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DUET__WG_ASM(...) __trap()
#else
#define DUET__WG_ASM(...) asm volatile(__VA_ARGS__)
#endif

/* Eight accumulators d[i .. i + 7] as read-write asm operands. */
#define DUET__WG_R8(i)                                                                             \
    "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),                \
        "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

/* A 64-accumulator wgmma's d operand: the asm text and the outputs d[0 .. 63] (operands 0-63). */
#define DUET__WG_D64                                                                               \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "   \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "   \
    "%56, %57, %58, %59, %60, %61, %62, %63}, "
#define DUET__WG_OUT64                                                                             \
    DUET__WG_R8(0), DUET__WG_R8(8), DUET__WG_R8(16), DUET__WG_R8(24), DUET__WG_R8(32),             \
        DUET__WG_R8(40), DUET__WG_R8(48), DUET__WG_R8(56)

/* A 128-accumulator wgmma's d operand (m64n256 in fp32): the asm text and d[0 .. 127]
 * (operands 0-127). */
#define DUET__WG_D128                                                                              \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "   \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "   \
    "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "   \
    "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "   \
    "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "     \
    "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "   \
    "%123, %124, %125, %126, %127}, "
#define DUET__WG_OUT128                                                                            \
    DUET__WG_OUT64, DUET__WG_R8(64), DUET__WG_R8(72), DUET__WG_R8(80), DUET__WG_R8(88),            \
        DUET__WG_R8(96), DUET__WG_R8(104), DUET__WG_R8(112), DUET__WG_R8(120)

/* Shared-memory matrix descriptor of the 128-byte swizzled layout at shared address saddr:
 * 8-row groups 1024 bytes apart; lbo (MN-major operands) the bytes from one 64-wide column
 * block to the next, unused (16) for K-major ones. */
static __device__ __forceinline__ unsigned long long duet__wg_desc(unsigned saddr,
                                                                   unsigned lbo = 16)
{
    return (unsigned long long)((saddr & 0x3ffffu) >> 4) |
           ((unsigned long long)((lbo & 0x3ffffu) >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

static __device__ __forceinline__ void duet__wg_fence(void)
{
    DUET__WG_ASM("wgmma.fence.sync.aligned;\n" ::: "memory");
}

static __device__ __forceinline__ void duet__wg_commit(void)
{
    DUET__WG_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/* Wait until at most N of this warpgroup's committed wgmma groups are still running. */
template <int N> static __device__ __forceinline__ void duet__wg_wait(void)
{
    DUET__WG_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Named barrier `id` (1..15; __syncthreads is 0) among `n` threads, whole warps. */
static __device__ __forceinline__ void duet__bar_sync(int id, int n)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

/* Ties each of N accumulators to this point in program order: the compiler sees a wgmma
 * writing them when it is issued, the hardware writes them until the wait. */
template <int N> static __device__ __forceinline__ void duet__wg_fence_operands(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

/* Allow a kernel `bytes` of dynamic shared memory, once per kernel and device (the attribute
 * belongs to the device's context). `done` has a bit per device; racing first calls set the
 * same value, and a lost bit only costs a second call. */
template <typename K>
static cudaError_t duet__smem_optin(K kernel, unsigned long long *done, int bytes)
{
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess)
        return e;
    const unsigned long long bit = dev >= 0 && dev < 64 ? 1ull << dev : 0;
    if (bit != 0 && (*done & bit) != 0)
        return cudaSuccess;
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess)
        *done |= bit;
    return e;
}

/* Whether the current device runs `kernel` (of a file built for sm_90a alone: its binary loads
 * on compute capability 9.0 only), asked once per device; asked / usable hold a bit per device. */
template <typename K>
static int duet__wg_usable(K kernel, unsigned long long *asked, unsigned long long *usable)
{
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();
        return 0;
    }
    const unsigned long long bit = 1ull << dev;
    if ((*asked & bit) == 0) {
        cudaFuncAttributes fa;
        if (cudaFuncGetAttributes(&fa, kernel) == cudaSuccess)
            *usable |= bit;
        else
            (void)cudaGetLastError();
        *asked |= bit;
    }
    return (*usable & bit) != 0;
}

#endif
