/*
 * cuda_test_util.h: host/device buffer helpers the CUDA kernel tests share (test_cuda_kda.c,
 * test_cuda_mla.c, test_cuda_ops.c). Header-only; the including file defines CUDA_OK(call)
 * (its Criterion assert on a cudaError_t) before including it.
 */
#ifndef DUET_TESTS_CUDA_TEST_UTIL_H
#define DUET_TESTS_CUDA_TEST_UTIL_H

#include <stdlib.h>

#include <criterion/criterion.h>
#include <cuda_runtime_api.h>

#ifndef CUDA_OK
#error "define CUDA_OK(call) before including cuda_test_util.h"
#endif

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

#endif
