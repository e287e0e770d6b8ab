/*
 * cuda_test_util.h: what the CUDA kernel tests share (test_cuda_kda.c, test_cuda_mla.c,
 * test_cuda_mla_x.c, test_cuda_ops.c, test_kernels_cuda.c). Header-only: Criterion checks on
 * conditions, CUDA errors and duet statuses; test_rng.h's generator (each file picks its seed
 * with DUET_TEST_RNG_SEED before including this); host / device buffer helpers; the skip when no
 * device is visible.
 */
#ifndef DUET_TESTS_CUDA_TEST_UTIL_H
#define DUET_TESTS_CUDA_TEST_UTIL_H

#include <stdint.h>
#include <stdlib.h>

#include <criterion/criterion.h>
#include <cuda_runtime_api.h>

#include "common/status.h"
#include "kernels/kernels.h"
#include "test_rng.h"

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            cr_assert(0, "check failed: " #cond " " __VA_ARGS__);                                  \
    } while (0)

#define CUDA_OK(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                         \
    } while (0)

#define DUET_OK_OR_FAIL(call)                                                                      \
    do {                                                                                           \
        duet_status_t s_ = (call);                                                                 \
        CHECK(s_ == DUET_OK, "%s: %s: %s", #call, duet_status_name(s_), duet_error_last());        \
    } while (0)

static inline void *xmalloc(size_t n)
{
    void *p = malloc(n > 0 ? n : 1);
    cr_assert_not_null(p);
    return p;
}

static inline void *dev_alloc(size_t n)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, n > 0 ? n : 1));
    return p;
}

static inline void *dev_copy(const void *h, size_t n)
{
    void *d = dev_alloc(n);
    CUDA_OK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
    return d;
}

/* Skip the calling test when no device is visible, saying what is only compiled here
 * (`what`, e.g. "the MLA kernels are"). */
static inline void skip_without_device_for(const char *what)
{
    if (duet_cuda_device_count() == 0)
        cr_skip_test(
            "no CUDA device visible (duet_cuda_device_count() == 0): %s only compiled here", what);
}

#endif
