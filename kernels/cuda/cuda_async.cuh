/*
 * cuda_async.cuh: the asynchronous global → shared copies every kernel file uses (CUDA C++
 * only): cp.async and its group markers, the bulk copy engine (sm_90), and the mbarriers that
 * count both. A cp.async with pred false reads nothing and sets its bytes in shared memory to 0,
 * so a tile's rows past the data are zeros, never stale contents. The destination is an address
 * in the shared window (__cvta_generic_to_shared) or a generic pointer into shared memory. Every
 * marker is a compiler memory barrier as well, so no shared access moves across it.
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

/* An arrival on the mbarrier `bar` (duet__mbar_* below) once every copy this thread
 * has started so far has landed; it counts against the barrier's init count (.noinc). sm_80+. */
static __device__ __forceinline__ void duet__cp_async_arrive(unsigned long long *bar)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(
                     (unsigned)__cvta_generic_to_shared(bar))
                 : "memory");
#endif
}

/* The sm_90 instructions below; other targets (not what the build asks for) get code that traps
 * instead of failing to assemble. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define DUET__SM90_ASM(...) __trap()
#else
#define DUET__SM90_ASM(...) asm volatile(__VA_ARGS__)
#endif

/*
 * mbarriers in shared memory, for kernels whose warps hand stages to each other without a
 * block-wide barrier: init (one thread, before a __syncthreads) sets the arrivals that complete
 * a phase; arrive counts one (release: this thread's earlier writes are seen by the waiters);
 * wait spins until the phase of the given parity has completed (acquire). A fresh barrier is in
 * phase 0, and a wait for parity 1 returns at once (the phase before it counts as complete).
 */
static __device__ __forceinline__ void duet__mbar_init(unsigned long long *bar, unsigned count)
{
    DUET__SM90_ASM(
        "mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"((unsigned)__cvta_generic_to_shared(bar)),
        "r"(count)
        : "memory");
}

/* After duet__mbar_init, before the barriers meet the async proxy (bulk copies' complete_tx):
 * makes the initialisation visible to it. */
static __device__ __forceinline__ void duet__mbar_init_fence(void)
{
    DUET__SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

static __device__ __forceinline__ void duet__mbar_arrive(unsigned long long *bar)
{
    DUET__SM90_ASM("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(
                       (unsigned)__cvta_generic_to_shared(bar))
                   : "memory");
}

static __device__ __forceinline__ void duet__mbar_wait(unsigned long long *bar, unsigned parity)
{
    const unsigned a = (unsigned)__cvta_generic_to_shared(bar);
    unsigned done = 1;
    do {
        DUET__SM90_ASM("{\n.reg .pred p;\n"
                       "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
                       "selp.u32 %0, 1, 0, p;\n}\n"
                       : "=r"(done)
                       : "r"(a), "r"(parity)
                       : "memory");
    } while (!done);
}

/* One arrival on bar that also expects `bytes` more transaction bytes (bulk copies' complete_tx)
 * before its current phase completes (release, as duet__mbar_arrive). */
static __device__ __forceinline__ void duet__mbar_arrive_tx(unsigned long long *bar, unsigned bytes)
{
    DUET__SM90_ASM("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                       (unsigned)__cvta_generic_to_shared(bar)),
                   "r"(bytes)
                   : "memory");
}

/* `bytes` (a multiple of 16) from global src to shared dst, both 16-byte aligned, by the bulk
 * copy engine; they count as transaction bytes on the mbarrier bar once they have landed. One
 * instruction for the whole range, whatever its length. */
static __device__ __forceinline__ void duet__bulk_copy(void *dst, const void *src, unsigned bytes,
                                                       unsigned long long *bar)
{
    DUET__SM90_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                   "%2, [%3];\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)),
                   "l"(src), "r"(bytes), "r"((unsigned)__cvta_generic_to_shared(bar))
                   : "memory");
}

/* Orders this thread's earlier generic-proxy accesses to shared memory (cp.async's writes, plain
 * loads and stores) before its later async-proxy ones (wgmma's reads, bulk copies' writes). */
static __device__ __forceinline__ void duet__fence_proxy_async(void)
{
    DUET__SM90_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* Commit the copies not yet in a group and wait for every copy of this thread. */
static __device__ __forceinline__ void duet__cp_async_wait_all(void)
{
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

#endif
