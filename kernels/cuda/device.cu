/*
 * CUDA device discovery. The CUDA backend's kernels arrive with the CUDA issue; this file is the
 * first CUDA source so the build already compiles and links CUDA code wherever nvcc exists (CI
 * has nvcc but no driver), and the CPU path can ask whether a device is present.
 *
 * Without a driver cudaGetDeviceCount fails (35, insufficient driver) and leaves its argument
 * untouched, so the count starts at 0 and any error means "no device".
 */
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"

extern "C" int duet_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); /* clear the sticky error for later calls */
        return 0;
    }
    return n;
}

extern "C" duet_status_t duet_cuda_status(cudaError_t e, const char *module, const char *what)
{
    if (e == cudaSuccess)
        return DUET_OK;
    (void)cudaGetLastError();
    return duet_error_set(e == cudaErrorMemoryAllocation ? DUET_ERR_NOMEM : DUET_ERR_DEVICE,
                          "%s: %s: %s (%s)", module, what, cudaGetErrorName(e),
                          cudaGetErrorString(e));
}
