/*
 * bench_launch_floor.cu (duet-bench-launch-floor): the fastest a batch-1 decode step could run
 * as the sequence of kernels the CUDA engine launches for it (engine/backend_cuda.c), if every
 * kernel were nothing but a perfect weight stream.
 *
 * From DIR/config.json it lists the step's kernels in launch order with the bytes each must
 * read at batch 1 and context C (weights at --dtype, the MLA cache at bf16, the KDA state fp32
 * read and written; the experts the token routes to plus the shared one). A kernel whose bytes
 * are negligible (the MLA cache write and split reducer, the act·mul of the dense MLP, the
 * second arg-max pass) is a kernel that only waits and triggers. Each entry
 * then runs as one "stream" kernel: a grid of one wave, each thread summing 16-byte loads of
 * its own region, U loads in flight, nothing else. Regions follow each other in one buffer
 * larger than L2, so a step reads every byte once from HBM, as the engine's does.
 *
 * Forms, each captured once into a CUDA graph and replayed (median of --reps replays, CUDA
 * events; GPU time only, no host copies):
 *   chain        every entry its own kernel, programmatic dependent launch (PDL), the first
 *                loads issued before the PDL wait (as the engine's GEMVs do)
 *   chain_late   the same with every load after the wait (a kernel that prefetches nothing)
 *   chain_nopdl  the same kernels launched without PDL
 *   stages       the chain with every entry that `joins` (see step_entries) merged into the
 *                kernel before it: the fewest kernels the step's data dependencies allow
 *   per_layer    one kernel per layer (its entries' bytes in one stream), plus the head
 *   one          every byte in one kernel
 * and the roofline (bytes ÷ the device-to-device copy rate measured in the same run, read +
 * written). What it tells: chain − one is what the boundaries between the step's kernels cost
 * even with no work in them; a step made of these kernels cannot beat `chain`, and no step that
 * respects the model's data dependencies with a kernel boundary (or an equally costly grid-wide
 * barrier) at each can beat `stages`.
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

extern "C" {
#include "common/config.h"
#include "common/version.h"
#include "engine/model_config.h"
}
#include "kernels/cuda/cuda_pdl.cuh"
#include "kernels/cuda/cuda_util.h"

#define FLOOR_THREADS 256
#define FLOOR_U       8

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "duet-bench-launch-floor: %s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
                    cudaGetErrorString(e_));                                                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

typedef struct {
    const char *what;
    size_t bytes; /* 0: a kernel that only waits and triggers */
    int layer;    /* -1 for the embedding and the head */
    bool joins;   /* needs no grid-wide result of the entry before it (see step_entries) */
} entry_t;

/* The step's kernels at batch 1, in engine/backend_cuda.c's launch order (duet__enqueue).
 * `joins`: the entry needs nothing from the entry before it that only the whole grid of that
 * kernel has, so one fused kernel could do both with no boundary between them: its blocks can
 * form what they need themselves (the chain its own rows of f_b|g_b, q_b's blocks the q_a norm,
 * W_UK's blocks their head's q_b rows, W_UV's blocks their head's split merge, a block of gate|up
 * its rows' act·mul), the work is independent (the kv write), or a last block can finish it (the
 * arg-max passes). Every entry that does not join needs a result that exists only once the whole
 * grid before it is done: a norm over a full row (q|k|v, the router, gate|up of the dense MLP,
 * lm_head), all heads (o_proj), all of q̂ (attend), all splits (the reducer), the routing
 * (gate|up) or the whole gate|up output (down). */
static std::vector<entry_t> step_entries(const duet_model_config_t *c, size_t wb, int64_t ctx)
{
    std::vector<entry_t> v;
    const size_t D = (size_t)c->hidden_size, H = (size_t)c->kda_heads, K = (size_t)c->kda_head_dim;
    const size_t HK = H * K, n = (size_t)c->mla_heads, dn = (size_t)c->qk_nope_head_dim;
    const size_t dr = (size_t)c->qk_rope_head_dim, dv = (size_t)c->v_head_dim;
    const size_t r = (size_t)c->kv_lora_rank, I = (size_t)c->moe_intermediate;
    const size_t slots = (size_t)(c->top_k + c->n_shared_experts);
    v.push_back({"embed", D * wb, -1, false});
    for (int l = 0; l < (int)c->num_layers; l++) {
        if (c->mixer[l] == DUET_MIXER_KDA) {
            v.push_back({"kda norm+q|k|v|f_a|g_a|b", (3 * HK + 2 * K + H) * D * wb, l, l == 0});
            v.push_back({"kda f_b|g_b", 2 * HK * K * wb, l, false});
            v.push_back({"kda chain (state r+w)", 2 * H * K * K * 4, l, true});
            v.push_back({"kda o_proj", D * HK * wb, l, false});
        } else {
            const size_t q = c->q_lora_rank > 0 ? (size_t)c->q_lora_rank : n * (dn + dr);
            v.push_back({"mla norm+q|kv_a", (q + r + dr) * D * wb, l, l == 0});
            if (c->q_lora_rank > 0) {
                v.push_back({"mla q_a norm", 0, l, false});
                v.push_back({"mla q_b", n * (dn + dr) * q * wb, l, true});
            }
            v.push_back({"mla kv write", 0, l, c->q_lora_rank > 0});
            v.push_back({"mla W_UK", n * r * dn * wb, l, true});
            v.push_back({"mla attend (cache)", (size_t)ctx * (r + dr) * 2, l, false});
            v.push_back({"mla split reduce", 0, l, false});
            v.push_back({"mla W_UV", n * dv * r * wb, l, true});
            v.push_back({"mla o_proj", D * n * dv * wb, l, false});
        }
        if (c->ffn[l] == DUET_FFN_MOE) {
            v.push_back({"moe norm+router+route", (size_t)c->n_experts * D * 4, l, false});
            v.push_back({"moe gate/up (+shared)", slots * 2 * I * D * wb, l, false});
            v.push_back({"moe down+combine", slots * D * I * wb, l, false});
        } else {
            const size_t Id = (size_t)c->dense_intermediate;
            v.push_back({"mlp norm+gate|up", 2 * Id * D * wb, l, false});
            v.push_back({"mlp act*mul", 0, l, true});
            v.push_back({"mlp down", D * Id * wb, l, false});
        }
    }
    v.push_back({"final norm+lm_head", (size_t)c->vocab_size * D * wb, -1, false});
    v.push_back({"arg-max pass 1", (size_t)c->vocab_size * 4, -1, true});
    v.push_back({"arg-max pass 2", 0, -1, true});
    return v;
}

/* One wave of blocks, each thread XOR-ing its 16-byte pieces (grid stride), FLOOR_U in flight.
 * EARLY: the first FLOOR_U loads go out before the PDL wait. The store never happens in
 * practice; it keeps the loads. */
template <bool EARLY>
__global__ void __launch_bounds__(FLOOR_THREADS)
    floor_stream(const uint4 *__restrict__ p, size_t n, unsigned *sink)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    uint4 v[FLOOR_U];
    if (EARLY)
#pragma unroll
        for (int u = 0; u < FLOOR_U; u++)
            v[u] = i + u * stride < n ? __ldg(p + i + u * stride) : make_uint4(0, 0, 0, 0);
    duet_pdl_wait();
    duet_pdl_trigger();
    if (!EARLY)
#pragma unroll
        for (int u = 0; u < FLOOR_U; u++)
            v[u] = i + u * stride < n ? __ldg(p + i + u * stride) : make_uint4(0, 0, 0, 0);
    while (i < n) {
#pragma unroll
        for (int u = 0; u < FLOOR_U; u++)
            acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        i += FLOOR_U * stride;
#pragma unroll
        for (int u = 0; u < FLOOR_U; u++)
            v[u] = i + u * stride < n ? __ldg(p + i + u * stride) : make_uint4(0, 0, 0, 0);
    }
    if (acc == 0x9e3779b9u)
        sink[blockIdx.x] = acc;
}

typedef struct {
    size_t off, bytes;
} launch_t;

/* Print "duet-bench-launch-floor: <message>" on stderr; returns rc (the exit status). */
static int fail(int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("duet-bench-launch-floor: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return rc;
}

/* Capture `ls` as one graph (kernel `k`, PDL or not), replay it, return the median ms. */
static double time_graph(const std::vector<launch_t> &ls, bool early, bool pdl, const char *base,
                         unsigned *sink, int wave, int reps, cudaStream_t s)
{
    void (*k)(const uint4 *, size_t, unsigned *) = early ? floor_stream<true> : floor_stream<false>;
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (const launch_t &l : ls) {
        const size_t n16 = l.bytes / 16;
        const size_t need =
            (n16 + (size_t)FLOOR_THREADS * FLOOR_U - 1) / ((size_t)FLOOR_THREADS * FLOOR_U);
        const unsigned blocks = (unsigned)std::max<size_t>(1, std::min<size_t>(need, (size_t)wave));
        const uint4 *p = reinterpret_cast<const uint4 *>(base + l.off);
        if (pdl)
            CK(duet_pdl_launch(k, dim3(blocks), dim3(FLOOR_THREADS), 0, s, p, n16, sink));
        else
            k<<<blocks, FLOOR_THREADS, 0, s>>>(p, n16, sink);
    }
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int i = 0; i < reps + 3; i++) {
        CK(cudaEventRecord(e0, s));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        if (i >= 3)
            ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return ms[ms.size() / 2];
}

int main(int argc, char **argv)
{
    const char *cfg_dir = NULL;
    int64_t ctx = 2048, layers = 0, reps = 30;
    bool list = false;
    size_t wb = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (duet_version_flag(a)) {
            duet_version_print("duet-bench-launch-floor");
            return 0;
        }
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf("usage: duet-bench-launch-floor --config DIR [--layers N] [--context 2048]\n"
                   "       [--reps 30] [--dtype bf16|f32] [--list]\n"
                   "The fastest a batch-1 decode step could run as the CUDA engine's sequence\n"
                   "of kernels if each kernel only streamed the bytes it must read (see the\n"
                   "file comment). JSON lines on stdout; --list: the kernel list on stderr.\n");
            return 0;
        }
        if (strcmp(a, "--list") == 0) {
            list = true;
            continue;
        }
        if (v == NULL)
            return fail(2, "%s needs a value (see --help)", a);
        i++;
        int bad = 0;
        if (strcmp(a, "--config") == 0)
            cfg_dir = v;
        else if (strcmp(a, "--layers") == 0)
            bad = duet_config_parse_int(v, 1, DUET_MAX_LAYERS, &layers) != DUET_OK;
        else if (strcmp(a, "--context") == 0)
            bad = duet_config_parse_int(v, 1, INT32_MAX, &ctx) != DUET_OK;
        else if (strcmp(a, "--reps") == 0)
            bad = duet_config_parse_int(v, 1, 100000, &reps) != DUET_OK;
        else if (strcmp(a, "--dtype") == 0)
            bad = strcmp(v, "bf16") == 0 ? (wb = 2, 0) : strcmp(v, "f32") == 0 ? (wb = 4, 0) : 1;
        else
            return fail(2, "unknown option %s (see --help)", a);
        if (bad)
            return fail(2, "bad value '%s' for %s", v, a);
    }
    duet_model_config_t cfg;
    if (cfg_dir == NULL)
        return fail(2, "--config DIR is required (see --help)");
    if (duet_model_config_load(cfg_dir, &cfg) != DUET_OK)
        return fail(1, "%s", duet_error_last());
    duet_model_config_keep_layers(&cfg, layers); /* as duet-bench-model-cuda --layers */
    const std::vector<entry_t> es = step_entries(&cfg, wb, ctx);
    size_t total = 0;
    for (const entry_t &e : es) {
        total += (e.bytes + 255) & ~(size_t)255;
        if (list)
            fprintf(stderr, "%3d %-28s %12zu%s\n", e.layer, e.what, e.bytes,
                    e.joins ? "  (joins)" : "");
    }
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev <= 0)
        return fail(0, "no CUDA device: nothing to measure");
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    double bw = 0;
    if (duet_cuda_copy_bandwidth((size_t)1 << 30, 20, &bw) != DUET_OK)
        return fail(1, "%s", duet_error_last());
    char *buf;
    unsigned *sink;
    CK(cudaMalloc(&buf, total));
    CK(cudaMemset(buf, 0x5b, total));
    CK(cudaMalloc(&sink, 1 << 20));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, floor_stream<true>, FLOOR_THREADS,
                                                     0));
    const int wave = per_sm * prop.multiProcessorCount;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    std::vector<launch_t> chain, stages, per_layer, one;
    size_t off = 0, bytes = 0;
    for (size_t i = 0; i < es.size(); i++) {
        chain.push_back({off, es[i].bytes});
        if (stages.empty() || !es[i].joins)
            stages.push_back({off, es[i].bytes});
        else
            stages.back().bytes = off + es[i].bytes - stages.back().off;
        const bool new_group =
            per_layer.empty() || es[i].layer != es[i - 1].layer || es[i].layer < 0;
        if (new_group)
            per_layer.push_back({off, es[i].bytes});
        else
            per_layer.back().bytes = off + es[i].bytes - per_layer.back().off;
        off += (es[i].bytes + 255) & ~(size_t)255;
        bytes += es[i].bytes;
    }
    one.push_back({0, off});
    const double roof = (double)bytes / bw * 1e3;
    printf("{\"device\":\"%s\",\"layers\":%lld,\"context\":%lld,\"kernels\":%zu,\"step_GB\":%.4f,"
           "\"d2d_GBps\":%.1f,\"roofline_ms\":%.4f,\"wave_blocks\":%d}\n",
           prop.name, (long long)cfg.num_layers, (long long)ctx, es.size(), bytes / 1e9, bw / 1e9,
           roof, wave);
    const struct {
        const char *name;
        const std::vector<launch_t> *ls;
        bool early, pdl;
    } forms[] = {{"one", &one, true, true},           {"per_layer", &per_layer, true, true},
                 {"stages", &stages, true, true},     {"chain", &chain, true, true},
                 {"chain_late", &chain, false, true}, {"chain_nopdl", &chain, true, false}};
    for (const auto &f : forms) {
        const double ms = time_graph(*f.ls, f.early, f.pdl, buf, sink, wave, (int)reps, s);
        printf("{\"form\":\"%s\",\"kernels\":%zu,\"ms\":%.4f,\"roofline_frac\":%.3f}\n", f.name,
               f.ls->size(), ms, roof / ms);
        fflush(stdout);
    }
    CK(cudaStreamDestroy(s));
    CK(cudaFree(buf));
    CK(cudaFree(sink));
    return 0;
}
