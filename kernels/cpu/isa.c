/*
 * isa.c: CPU feature detection for the instruction-set paths (isa.h says why it is a file of its
 * own).
 */
#include "kernels/cpu/isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

bool duet__cpu_has_f16c(void)
{
#if defined(__x86_64__) || defined(__i386__)
    /* CPUID leaf 1, ECX bit 29: clang 14's __builtin_cpu_supports has no "f16c". */
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
#else
    return false;
#endif
}

duet__isa_t duet__isa_detect(void)
{
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    int avx2 =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && duet__cpu_has_f16c();
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return DUET__ISA_AVX512;
    if (avx2)
        return DUET__ISA_AVX2;
#endif
    return DUET__ISA_SCALAR;
}

const char *duet__isa_name(duet__isa_t isa)
{
    switch (isa) {
    case DUET__ISA_SCALAR:
        return "scalar";
    case DUET__ISA_AVX2:
        return "avx2";
    case DUET__ISA_AVX512:
        return "avx512";
    }
    return "?";
}
