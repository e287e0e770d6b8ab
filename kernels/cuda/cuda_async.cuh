/*
 * cuda_async.cuh: the asynchronous global → shared copies (cp.async) every kernel file uses
 * (CUDA C++ only), and their group markers. A copy with pred false reads nothing and sets its
 * bytes in shared memory to 0, so a tile's rows past the data are zeros, never stale contents.
 * The destination is an address in the shared window (__cvta_generic_to_shared) or a generic
 * pointer into shared memory. Every marker is a compiler memory barrier as well, so no shared
 * access moves across it.
 */
#ifndef DUET_KERNELS_CUDA_ASYNC_CUH
#define DUET_KERNELS_CUDA_ASYNC_CUH

#include <cuda_runtime.h>

/* 16 bytes, around L1 (.cg). */
static __device__ __forceinline__ void duet__cp_async16(unsigned dst, const void *src, bool pred)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(pred ? 16 : 0)
                 : "memory");
}

static __device__ __forceinline__ void duet__cp_async16(void *dst, const void *src, bool pred)
{
    duet__cp_async16((unsigned)__cvta_generic_to_shared(dst), src, pred);
}

/* 4 bytes, through L1 (.ca: the 4-byte form has no .cg). */
static __device__ __forceinline__ void duet__cp_async4(void *dst, const void *src, bool pred)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                     (unsigned)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(pred ? 4 : 0)
                 : "memory");
}

static __device__ __forceinline__ void duet__cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Wait until at most N of this thread's committed copy groups are still in flight. */
template <int N> static __device__ __forceinline__ void duet__cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* An arrival on the mbarrier `bar` (cuda_wgmma.cuh's duet__mbar_*) once every copy this thread
 * has started so far has landed; it counts against the barrier's init count (.noinc). sm_80+. */
static __device__ __forceinline__ void duet__cp_async_arrive(unsigned long long *bar)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(
                     (unsigned)__cvta_generic_to_shared(bar))
                 : "memory");
#endif
}

/* Commit the copies not yet in a group and wait for every copy of this thread. */
static __device__ __forceinline__ void duet__cp_async_wait_all(void)
{
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

#endif
