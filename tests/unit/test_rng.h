/*
 * test_rng.h: the xorshift generator the kernel tests draw their inputs from (test_kernels_cpu.c
 * and, through cuda_test_util.h, the CUDA tests). Header-only; each file has its own stream,
 * seeded with DUET_TEST_RNG_SEED when it defines one before including this, so a test's inputs
 * do not depend on what other files draw.
 */
#ifndef DUET_TESTS_TEST_RNG_H
#define DUET_TESTS_TEST_RNG_H

#include <stdint.h>

#ifndef DUET_TEST_RNG_SEED
#define DUET_TEST_RNG_SEED 0x9e3779b97f4a7c15ull
#endif

static uint64_t rng_state = DUET_TEST_RNG_SEED;

static inline uint32_t rng_u32(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    rng_state = x;
    return (uint32_t)(x >> 16);
}

/* Uniform in [-1, 1). */
static inline float rng_f(void)
{
    return (float)(rng_u32() & 0xffffff) / 8388608.0f - 1.0f;
}

#endif
