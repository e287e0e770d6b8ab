/*
 * cupti_trace.c: a CUPTI injection library that records every kernel a CUDA process runs (start,
 * end, graph id and node, grid) and writes them as tab-separated lines when the process exits.
 * It needs no change to the traced program: the CUDA driver loads it at the first CUDA call.
 * Built as libduet-cupti-trace.so when the CUDA toolkit has CUPTI (bench/cupti_trace.cmake):
 *
 *   CUDA_INJECTION64_PATH=$PWD/build/bench/libduet-cupti-trace.so DUET_TRACE_OUT=trace.tsv \
 *     PROGRAM ...
 *
 * (bench/gpu_check.sh's `trace` stage runs duet-bench-model-cuda that way.) Tracing costs the
 * step about 8% (2.375 → 2.557 ms at 27 layers, batch 1 × 2K, H200), so its times are for
 * comparing kernels with each other, not for the step's absolute time.
 *
 * Columns: start_ns end_ns graph_id graph_node_id grid_x grid_y grid_z block_threads name.
 * tools/trace_step.py turns a trace of duet-bench-model-cuda into a per-kernel table of the
 * decode step (which kernel the step's time waits on).
 */
#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRACE_BUF (8u << 20)

static FILE *trace_out;

static void CUPTIAPI trace_buffer_requested(uint8_t **buf, size_t *size, size_t *max_records)
{
    *buf = aligned_alloc(8, TRACE_BUF);
    *size = *buf != NULL ? TRACE_BUF : 0;
    *max_records = 0;
}

static void CUPTIAPI trace_buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf,
                                            size_t size, size_t valid)
{
    CUpti_Activity *rec = NULL;
    (void)ctx;
    (void)stream;
    (void)size;
    while (trace_out != NULL && cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL &&
            rec->kind != CUPTI_ACTIVITY_KIND_KERNEL)
            continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
        fprintf(trace_out, "%llu\t%llu\t%u\t%llu\t%d\t%d\t%d\t%d\t%s\n",
                (unsigned long long)k->start, (unsigned long long)k->end, k->graphId,
                (unsigned long long)k->graphNodeId, k->gridX, k->gridY, k->gridZ,
                k->blockX * k->blockY * k->blockZ, k->name != NULL ? k->name : "?");
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(NULL, stream, &dropped) == CUPTI_SUCCESS && dropped > 0)
        fprintf(stderr, "cupti_trace: %zu records dropped\n", dropped);
    free(buf);
}

static void trace_flush(void)
{
    cuptiActivityFlushAll(1);
    if (trace_out != NULL && trace_out != stdout)
        fclose(trace_out);
    trace_out = NULL;
}

int InitializeInjection(void)
{
    const char *path = getenv("DUET_TRACE_OUT");
    trace_out = path != NULL ? fopen(path, "w") : stdout;
    if (trace_out == NULL) {
        fprintf(stderr, "cupti_trace: cannot open %s\n", path);
        return 0;
    }
    if (cuptiActivityRegisterCallbacks(trace_buffer_requested, trace_buffer_completed) !=
            CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "cupti_trace: CUPTI activity setup failed\n");
        return 0;
    }
    atexit(trace_flush);
    return 1;
}
