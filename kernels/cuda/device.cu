/*
 * CUDA device discovery. The CUDA backend's kernels arrive with the CUDA issue; this file is the
 * first CUDA source so the build already compiles and links CUDA code wherever nvcc exists (CI
 * has nvcc but no driver), and the CPU path can ask whether a device is present.
 *
 * Without a driver cudaGetDeviceCount fails (35, insufficient driver) and leaves its argument
 * untouched, so the count starts at 0 and any error means "no device".
 */
#include <cuda_runtime.h>

extern "C" int duet_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); /* clear the sticky error for later calls */
        return 0;
    }
    return n;
}
