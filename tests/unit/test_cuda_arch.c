/*
 * test_cuda_arch.c: duet_cuda_device_usable on a device the build has no code for.
 *
 * This test compiles kernels/cuda/device.cu for sm_80 SASS only
 * (tests/unit/kernels_cuda_arch.cmake), whatever CMAKE_CUDA_ARCHITECTURES the rest of the build
 * uses. SASS for 8.0 runs on every 8.x device and on no other, so the probe's answer is known from
 * the device's compute capability alone: usable on 8.x, refused elsewhere (an H100/H200 is 9.0)
 * with the capability and the CMake flag to rebuild with, and the CUDA runtime still usable after
 * the refusal (the engine's
 * --device auto goes on to the CPU and later calls must not see a sticky error).
 */
#include <stdio.h>
#include <string.h>

#include <criterion/criterion.h>
#include <cuda_runtime_api.h>

#include "device_probe.h"
#include "kernels/kernels.h"

Test(cuda_arch, sm80_only_build_is_refused_off_8x_with_the_rebuild_flag)
{
    char why[512] = "";
    int n = 0;
    const int ok = probe_device(why, sizeof(why), &n);
    if (n == 0)
        cr_skip_test("no CUDA device: the refusal of a device without code needs one");
    int dev = -1, major = 0, minor = 0;
    cr_assert_eq(cudaGetDevice(&dev), cudaSuccess);
    cr_assert_eq(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
                 cudaSuccess);
    cr_assert_eq(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev),
                 cudaSuccess);
    if (major == 8) {
        cr_assert_eq(ok, 1, "an sm_80 build refused a %d.%d device: %s", major, minor, why);
        return;
    }
    cr_assert_eq(ok, 0, "an sm_80-only build claimed a %d.%d device usable", major, minor);
    char want[96];
    snprintf(want, sizeof(want), "compute capability %d.%d", major, minor);
    cr_assert_not_null(strstr(why, want), "the reason does not name %s: %s", want, why);
    snprintf(want, sizeof(want), "-DCMAKE_CUDA_ARCHITECTURES=%d%d", major, minor);
    cr_assert_not_null(strstr(why, want), "the reason does not name %s: %s", want, why);
    /* The same answer again, and without a buffer: the failed probe left no sticky error. */
    cr_assert_eq(duet_cuda_device_usable(NULL, 0), 0);
    cr_assert_eq(cudaGetLastError(), cudaSuccess, "the refusal left an error behind");
    void *p = NULL;
    cr_assert_eq(cudaMalloc(&p, 4096), cudaSuccess, "the runtime is unusable after the refusal");
    cr_assert_eq(cudaMemset(p, 0, 4096), cudaSuccess);
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    cr_assert_eq(cudaFree(p), cudaSuccess);
}
