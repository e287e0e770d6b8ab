/*
 * CUDA device discovery: whether a device is visible, and whether this build holds code for it
 * (kernels/kernels.h; kernels/cpu/device.c answers for builds without the CUDA backend).
 *
 * Without a driver cudaGetDeviceCount fails (35, insufficient driver) and leaves its argument
 * untouched, so the count starts at 0 and any error means "no device".
 */
#include <stdio.h>

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

/* Compiled like every kernel of the backend (the same architectures): whether the runtime finds
 * code for the device says whether it finds code for the others. */
__global__ static void duet__probe_kernel(void) {}

extern "C" int duet_cuda_device_usable(char *why, size_t cap)
{
    char sink[8];
    if (why == NULL || cap == 0) {
        why = sink;
        cap = sizeof(sink);
    }
    if (duet_cuda_device_count() <= 0) {
        snprintf(why, cap,
                 "no CUDA device is visible (driver missing, or CUDA_VISIBLE_DEVICES "
                 "hides them)");
        return 0;
    }
    cudaFuncAttributes fa;
    const cudaError_t e = cudaFuncGetAttributes(&fa, duet__probe_kernel);
    if (e == cudaSuccess)
        return 1;
    (void)cudaGetLastError();
    int dev = 0, major = 0, minor = 0;
    (void)cudaGetDevice(&dev);
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(why, cap, "the CUDA kernels cannot run on device %d: %s", dev,
                 cudaGetErrorString(e));
        return 0;
    }
    snprintf(why, cap,
             "this build has no CUDA code for device %d (compute capability %d.%d): %s; rebuild "
             "with -DCMAKE_CUDA_ARCHITECTURES=%d%d (or native)",
             dev, major, minor, cudaGetErrorString(e), major, minor);
    return 0;
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
