/*
 * isa.h: which instruction-set path the CPU kernels take (internal to kernels/cpu and its tests).
 *
 * A leaf of kernels/cpu: it uses nothing else of the folder, so the instance and pool (pool.c,
 * which picks the path at create) and the matmul (matmul.c, which dispatches on it and runs its
 * jobs on the pool) both depend on it without depending on each other in a circle (pool.c used
 * matmul.c's detection while matmul.c used pool.c's pool).
 */
#ifndef DUET_KERNELS_CPU_ISA_H
#define DUET_KERNELS_CPU_ISA_H

#include <stdbool.h>

/* Instruction-set paths of the matmul, best last. */
typedef enum {
    DUET__ISA_SCALAR = 0,
    DUET__ISA_AVX2 = 1,   /* AVX2 + FMA + F16C */
    DUET__ISA_AVX512 = 2, /* AVX-512 F/BW/VL + FMA + F16C */
} duet__isa_t;

/* The best ISA this CPU supports. */
duet__isa_t duet__isa_detect(void);
/* Whether the CPU converts fp16 in hardware (F16C). */
bool duet__cpu_has_f16c(void);
/* "scalar", "avx2", "avx512". */
const char *duet__isa_name(duet__isa_t isa);

/* Hot loops outside the matmul (the mixers' per-(item, head) loops, kda.c and mla.c) get AVX2/FMA
 * and AVX-512 clones beside the baseline one, picked by the loader, so the library still runs on
 * any x86-64. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DUET__CPU_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define DUET__CPU_CLONES
#endif

#endif
