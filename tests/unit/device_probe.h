/*
 * device_probe.h: duet_cuda_device_usable as the GPU tests query it (test_engine_cuda.c,
 * test_cuda_arch.c). Header-only; the includer uses Criterion.
 */
#ifndef DUET_TESTS_DEVICE_PROBE_H
#define DUET_TESTS_DEVICE_PROBE_H

#include <stddef.h>
#include <stdio.h>

#include <criterion/criterion.h>

#include "kernels/kernels.h"

/* The probe's answer (its reason in why), printed with the device count (*n_p). Without a
 * device it must say no and give a reason; checked here for every caller. */
static inline int probe_device(char *why, size_t cap, int *n_p)
{
    const int n = duet_cuda_device_count(), ok = duet_cuda_device_usable(why, cap);
    printf("devices %d, usable %d%s%s\n", n, ok, ok ? "" : ": ", why);
    if (n == 0) {
        cr_assert_eq(ok, 0, "usable without a device");
        cr_assert(why[0] != '\0', "no reason given");
    }
    *n_p = n;
    return ok;
}

#endif
