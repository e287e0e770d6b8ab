/*
 * cuda_pdl.cuh: programmatic dependent launch (PDL) for the kernels of a step (CUDA C++ only).
 *
 * At batch 1 a decode step is hundreds of kernels that each run a few microseconds, so the gap
 * between one kernel's last block and the next kernel's first load is a large part of the step.
 * A kernel launched with duet_pdl_launch may start while its predecessor in the stream still
 * runs. Its contract:
 *   - before it reads anything an earlier kernel wrote, or writes anything an earlier kernel
 *     reads, it calls duet_pdl_wait(), which returns once the predecessor grid has completed
 *     and its writes are visible;
 *   - every block reaches duet_pdl_wait() before it exits (no early return ahead of it), so the
 *     grid cannot complete before its predecessor did: completion stays ordered down the chain
 *     even when a kernel needs nothing from its direct predecessor;
 *   - it calls duet_pdl_trigger() after its wait, which lets its successor start its prologue.
 * What may come before the wait: reading weights and other inputs no kernel of the step writes
 * (the GEMV streams its first weight pieces there). Both calls are no-ops for a normal launch
 * and before sm_90; a kernel without them (cuBLASLt, cub) simply triggers at its end.
 */
#ifndef DUET_KERNELS_CUDA_PDL_CUH
#define DUET_KERNELS_CUDA_PDL_CUH

#include <cuda_runtime.h>
#include <string.h>

#include "kernels/cuda/cuda_util.h"

static __device__ __forceinline__ void duet_pdl_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

static __device__ __forceinline__ void duet_pdl_trigger(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/* duet_pdl_launch with one more launch attribute, `extra` (e.g. a thread-block cluster shape;
 * NULL for none), set ahead of the PDL one. */
template <typename... KArgs, typename... Args>
static inline cudaError_t duet_pdl_launch_attr(void (*k)(KArgs...), dim3 grid, dim3 block,
                                               size_t smem, cudaStream_t stream,
                                               const cudaLaunchAttribute *extra, Args... args)
{
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[2];
    unsigned n = 0;
    memset(&cfg, 0, sizeof(cfg));
    memset(attr, 0, sizeof(attr));
    if (extra != NULL)
        attr[n++] = *extra;
    if (duet_cuda_pdl_enabled()) {
        attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n].val.programmaticStreamSerializationAllowed = 1;
        n++;
    }
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = n;
    return cudaLaunchKernelEx(&cfg, k, static_cast<KArgs>(args)...);
}

/* Launch k<<<grid, block, smem, stream>>>(args...) with programmatic stream serialisation when
 * duet_cuda_pdl_enabled() says so (the kernel must follow the contract above). */
template <typename... KArgs, typename... Args>
static inline cudaError_t duet_pdl_launch(void (*k)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                          cudaStream_t stream, Args... args)
{
    return duet_pdl_launch_attr(k, grid, block, smem, stream,
                                static_cast<const cudaLaunchAttribute *>(NULL), args...);
}

#endif
