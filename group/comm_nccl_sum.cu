/*
 * comm_nccl_sum.cu: the ordered sum behind the nccl transport's allreduce_sum_f32: NCCL's own
 * allreduce may add the ranks' parts in a different order on each rank (ring and tree
 * algorithms), so the transport allgathers the parts and adds them here in rank order, one thread
 * per element, like duet_comm_sum_parts_f32 on the host.
 */
#include "group/nccl_sum.h"

__global__ void duet__nccl_sum_parts_kernel(float *dst, const float *src, int parts, int64_t n)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float acc = src[i];
        for (int p = 1; p < parts; p++)
            acc = __fadd_rn(acc, src[(int64_t)p * n + i]); /* never contracted or reordered */
        dst[i] = acc;
    }
}

extern "C" cudaError_t duet__nccl_sum_parts_f32(float *dst, const float *src, int parts, int64_t n,
                                                cudaStream_t stream)
{
    if (n <= 0 || parts <= 0)
        return cudaSuccess;
    const int threads = 256;
    int64_t blocks = (n + threads - 1) / threads;
    if (blocks > 4096)
        blocks = 4096;
    duet__nccl_sum_parts_kernel<<<(unsigned)blocks, threads, 0, stream>>>(dst, src, parts, n);
    return cudaGetLastError();
}
