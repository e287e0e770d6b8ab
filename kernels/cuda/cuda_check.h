/*
 * cuda_check.h: a CUDA runtime error as a duet status, the one conversion every CUDA source
 * (the .cu files of kernels/cuda, engine/backend_cuda.c) reports through.
 */
#ifndef DUET_KERNELS_CUDA_CHECK_H
#define DUET_KERNELS_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "common/status.h"

/*
 * Clear a non-sticky error (so later calls start clean) and return DUET_ERR_NOMEM for an
 * allocation failure, DUET_ERR_DEVICE otherwise, with the detail "<module>: <what>: <CUDA error
 * name> (<its description>)". DUET_OK for cudaSuccess.
 */
duet_status_t duet_cuda_status(cudaError_t e, const char *module, const char *what);

/* Return from the calling function with duet_cuda_status's result when `call` fails. */
#define DUET_CUDA_TRY(call, module, what)                                                          \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return duet_cuda_status(e_, (module), (what));                                         \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif
