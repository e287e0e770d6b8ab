/*
 * nccl_sum.h: the ordered device reduction of the nccl transport (comm_nccl_sum.cu), declared for
 * comm_nccl.c. Internal to group/.
 */
#ifndef DUET_GROUP_NCCL_SUM_H
#define DUET_GROUP_NCCL_SUM_H

#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dst[i] = src[i] + src[n + i] + ... + src[(parts - 1) * n + i], added in part order (the order
 * of duet_comm_sum_parts_f32, so every rank gets the same bits), enqueued on `stream`. dst may
 * be src. Returns the launch's error. */
cudaError_t duet__nccl_sum_parts_f32(float *dst, const float *src, int parts, int64_t n,
                                     cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* DUET_GROUP_NCCL_SUM_H */
