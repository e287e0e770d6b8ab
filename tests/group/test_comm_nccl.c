/*
 * test_comm_nccl.c: the "nccl" transport of common/comm.h (group/comm_nccl.c) checked across real
 * ranks on device buffers, one GPU per rank. A plain C program, not a Criterion suite: it runs as
 * N ranks under mpirun (ctest starts 2, tests/group/group.cmake) and runs the checks every
 * transport shares (group_checks.h) with its buffers in device memory, plus: the allreduce gives
 * the same bits as the mpi transport on the same numbers, and bootstrapping refuses a
 * communicator that is not "mpi". With fewer CUDA devices visible than 2 (every rank needs its
 * own) it prints SKIP and exits 77 before touching MPI, which ctest reports as skipped.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>
#include <mpi.h>

#include "common/comm.h"
#include "group/comm_mpi.h"
#include "group/comm_nccl.h"
#include "tests/group/group_checks.h"

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    return cudaMalloc(&p, bytes) == cudaSuccess ? p : NULL;
}

static void dev_put(void *dst, const void *host, size_t bytes)
{
    const cudaError_t e = cudaMemcpy(dst, host, bytes, cudaMemcpyHostToDevice);
    CHECK(e == cudaSuccess, "cudaMemcpy to the device: %s", cudaGetErrorString(e));
}

static void dev_get(void *host, const void *src, size_t bytes)
{
    const cudaError_t e = cudaMemcpy(host, src, bytes, cudaMemcpyDeviceToHost);
    CHECK(e == cudaSuccess, "cudaMemcpy from the device: %s", cudaGetErrorString(e));
}

static void dev_release(void *p)
{
    cudaFree(p);
}

static const gt_mem_t dev_mem = {dev_alloc, dev_put, dev_get, dev_release};

/* The device reduction and the mpi transport's host reduction give the same bits. */
static void check_same_as_mpi(duet_comm_t *nccl, duet_comm_t *mpi)
{
    const int64_t len = 96;
    float *host = malloc(sizeof(float) * len), *dev_result = malloc(sizeof(float) * len);
    for (int64_t i = 0; i < len; i++)
        host[i] = reduce_value(nccl->rank, i);
    float *dbuf = gt_upload(&dev_mem, host, sizeof(float) * len);
    float *dscratch = dev_mem.alloc(sizeof(float) * len * nccl->size);
    CHECK_ST(nccl->ops->allreduce_sum_f32(nccl, dbuf, len, dscratch), DUET_OK, "nccl allreduce");
    dev_get(dev_result, dbuf, sizeof(float) * len);
    CHECK_ST(mpi->ops->allreduce_sum_f32(mpi, host, len, NULL), DUET_OK, "mpi allreduce");
    for (int64_t i = 0; i < len; i++)
        CHECK(memcmp(&host[i], &dev_result[i], sizeof(float)) == 0,
              "element %lld: nccl gives %.9g, mpi %.9g", (long long)i, dev_result[i], host[i]);
    dev_release(dbuf), dev_release(dscratch), free(host), free(dev_result);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_prog = "test_comm_nccl";
    int ndev = 0; /* left untouched when no driver is loaded */
    if (cudaGetDeviceCount(&ndev) != cudaSuccess)
        ndev = 0;
    if (ndev < 2) {
        printf("test_comm_nccl: SKIP: %d CUDA devices visible; the test needs 2, one per rank\n",
               ndev);
        return 77;
    }
    int size = 0;
    if (duet_group_mpi_init(&argc, &argv, &g_rank, &size) != DUET_OK) {
        fprintf(stderr, "test_comm_nccl: FAIL: init: %s\n", duet_error_last());
        return 1;
    }
    CHECK(size >= 2 && size <= ndev, "%d ranks on %d devices: run 2 to %d ranks", size, ndev, ndev);
    cudaStream_t stream = NULL;
    CHECK(cudaSetDevice(g_rank % ndev) == cudaSuccess && cudaStreamCreate(&stream) == cudaSuccess,
          "device %d: no stream", g_rank % ndev);

    duet_comm_t *mpi = NULL, *c = NULL, *self = NULL;
    CHECK_ST(duet_comm_mpi_create(20000, &mpi), DUET_OK, "mpi create");
    CHECK_ST(duet_comm_self_create(&self), DUET_OK, "self create");
    CHECK_ST(duet_comm_nccl_create(self, g_rank % ndev, stream, 20000, &c), DUET_ERR_INVALID,
             "nccl create over a self communicator");
    duet_comm_destroy(self);
    duet_status_t st = duet_comm_nccl_create(mpi, g_rank % ndev, stream, 20000, &c);
    CHECK_ST(st, DUET_OK, "nccl create");
    if (st == DUET_OK) {
        CHECK(c->rank == g_rank && c->size == size && strcmp(c->ops->name, "nccl") == 0 &&
                  c->ops->on_device == 1,
              "create: rank %d of %d, \"%s\", on_device %d", c->rank, c->size, c->ops->name,
              c->ops->on_device);
        check_allgather(c, &dev_mem);
        check_allreduce(c, &dev_mem);
        check_same_as_mpi(c, mpi);
        check_alltoallv(c, &dev_mem);
        check_bcast(c, &dev_mem);
        check_barrier(c);
        duet_comm_destroy(c);
    }
    /* made with a generous timeout (NCCL's initialisation may take longer than the check's),
     * then lowered: ops read timeout_ms when they start */
    c = NULL;
    st = duet_comm_nccl_create(mpi, g_rank % ndev, stream, 20000, &c);
    CHECK_ST(st, DUET_OK, "nccl create for the timeout");
    if (st == DUET_OK) {
        c->timeout_ms = GT_TIMEOUT_MS;
        check_timeout(c, &dev_mem, 0);
        duet_comm_destroy(c);
    }

    int any = 0;
    MPI_Allreduce(&g_fail, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (g_rank == 0)
        printf("test_comm_nccl: %d ranks: %s\n", size,
               any == 0 ? "all checks passed" : "FAILED (see the FAIL lines)");
    duet_comm_destroy(mpi);
    duet_group_mpi_finalize();
    return g_fail != 0;
}
