/*
 * backend_cuda.h: what the CUDA backend (engine/backend_cuda.c, one implementation of
 * engine/backend.h's table) offers beyond the table: test hooks of its own choices. Everything
 * else reaches it through duet_backend_cuda_ops. Defined only in a build with the CUDA backend.
 */
#ifndef DUET_ENGINE_BACKEND_CUDA_H
#define DUET_ENGINE_BACKEND_CUDA_H

#include <stdint.h>

/*
 * Test hooks for the expanded MLA prefill form (kernels/cuda/cuda_mla.h; backend_cuda.c
 * duet__mla_x_step): set(1) uses it where the shapes allow, set(0) never, set(-1) returns to the
 * default (on unless the environment has DUET_CUDA_NO_MLA_X=1); read when a model is created.
 * steps() counts the steps, over all models of the process, whose MLA layers took it.
 */
void duet_backend_cuda_mla_x_set(int on);
int64_t duet_backend_cuda_mla_x_steps(void);

/* Test hooks: steps, over all models of the process, that ran as a captured verify graph (verify
 * items and one-row plain items: backend_cuda.c duet__cuda_forward); of those, the mixed ones
 * (plain items, or verify items of different lengths, padded to the longest). */
int64_t duet_backend_cuda_verify_graph_steps(void);
int64_t duet_backend_cuda_mixed_graph_steps(void);

/* Test hook: verify items of different lengths join a verify graph padded to the longest (1),
 * run kernel by kernel (0), or as the cost rule decides (-1, backend_cuda.c duet__pad_pays),
 * overriding DUET_CUDA_VERIFY_PAD (docs/switches.md). */
void duet_backend_cuda_verify_pad_set(int on);

#endif
