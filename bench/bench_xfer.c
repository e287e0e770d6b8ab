/*
 * duet-bench-xfer: bandwidth and latency of the UCX transfer runtime (transfer/xfer.h) between
 * two processes on this machine, over shared memory and over tcp on loopback.
 *
 * For each transport the benchmark forks a receiver process (a pipe pair stands in for the
 * router), then, as the sender, moves MLA KV pages laid out like Kimi-Linear-48B's (7 MLA layers,
 * 1152 bytes per token per layer, 128-token pages: ~1 MiB per page, one put per page and layer):
 *
 *   bandwidth: transfers of 1, 4, 16, 64, 256 MiB, all layers ready at once; time from
 *              duet_xfer_send_start to the sender's DONE (every put flushed, XferDone sent);
 *              best of a few runs, and the ratio to a plain memcpy of the same source pages into
 *              a warm buffer measured in the same run;
 *   latency:   many back-to-back one-page transfers (a full 1 MiB page and a small 9 KiB page:
 *              16 tokens x 1 layer x 576 B), p50 / p99 of the same start-to-DONE time.
 *
 * The receiver's pool comes from duet_xfer_ctx_alloc (a UCX-allocated shared segment); --malloc
 * registers a malloc'ed buffer instead, to show what UCX 1.13 does with those over shm.
 * --transport cuda (builds with CUDA, a CUDA-built UCX: tools/build_ucx_cuda.sh) puts between
 * device pools (cudaMalloc, UCX_TLS=sm,self,cuda_copy,cuda_ipc); its reference is cudaMemcpy of
 * the same pieces device to device.
 *
 * Usage: duet-bench-xfer [--quick] [--malloc] [--transport shm|tcp|both|cuda]. UCX_NET_DEVICES
 * defaults to lo.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/version.h"
#include "transfer/xfer.h"

#ifdef DUET_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define MIB (1024.0 * 1024.0)

typedef struct {
    uint32_t page_tokens, layers, token_bytes;
} lay_t;

static const lay_t LAY_BIG = {128, 7, 1152}; /* ~1 MiB pages (Kimi-Linear-48B MLA) */
static const lay_t LAY_SMALL = {16, 1, 576}; /* a 9 KiB page */
#define POOL_BYTES ((size_t)270 << 20)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static duet_xfer_layout_t layout_of(lay_t l)
{
    duet_xfer_layout_t x = {.page_tokens = l.page_tokens,
                            .n_mla_layers = l.layers,
                            .token_bytes = l.token_bytes,
                            .state_elem = 4};
    return x;
}

/* --- the router pipe ---------------------------------------------------------------------- */

static int write_all(int fd, const void *b, size_t n)
{
    const uint8_t *p = b;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int frame_write(int fd, const void *b, uint32_t n)
{
    uint8_t h[4] = {(uint8_t)(n >> 24), (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n};
    return write_all(fd, h, 4) == 0 && write_all(fd, b, n) == 0 ? 0 : -1;
}

/* Read exactly n bytes, progressing ctx while waiting (a tcp target must keep progressing). */
static int read_all(int fd, void *b, size_t n, duet_xfer_ctx_t *ctx)
{
    uint8_t *p = b;
    double end = now_s() + 60;
    while (n > 0) {
        if (ctx != NULL)
            duet_xfer_ctx_progress(ctx);
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int k = poll(&pfd, 1, ctx != NULL ? 0 : 1000);
        if (now_s() > end)
            return -1;
        if (k <= 0)
            continue;
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static uint8_t *frame_read(int fd, uint32_t *n_p, duet_xfer_ctx_t *ctx)
{
    uint8_t h[4];
    if (read_all(fd, h, 4, ctx) < 0)
        return NULL;
    uint32_t n = ((uint32_t)h[0] << 24) | ((uint32_t)h[1] << 16) | ((uint32_t)h[2] << 8) | h[3];
    uint8_t *b = malloc(n + 1);
    if (b == NULL || read_all(fd, b, n, ctx) < 0) {
        free(b);
        return NULL;
    }
    b[n] = 0;
    *n_p = n;
    return b;
}

/* --- receiver process --------------------------------------------------------------------- */

static unsigned g_ended;
static void count_cb(const duet_xfer_outcome_t *o, void *user)
{
    if (o->kind != DUET_XFER_OUTCOME_DONE)
        fprintf(stderr, "bench: transfer aborted: %s: %s\n", duet_xfer_reason_str(o->reason),
                o->message);
    g_ended++;
}

static bool g_alloc = true; /* receiver pools from duet_xfer_ctx_alloc (--malloc: register) */
static bool g_device;       /* --transport cuda: both pools in device memory */

/* POOL_BYTES of device memory filled with `fill` (exits when this build or machine has none). */
static uint8_t *device_buffer(int fill)
{
#ifdef DUET_HAVE_CUDA
    void *p = NULL;
    if (cudaMalloc(&p, POOL_BYTES) != cudaSuccess ||
        cudaMemset(p, fill, POOL_BYTES) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
        fprintf(stderr, "bench: no CUDA device memory: %s\n",
                cudaGetErrorString(cudaGetLastError()));
        exit(2);
    }
    return p;
#else
    (void)fill;
    fprintf(stderr, "bench: --transport cuda needs a build with CUDA\n");
    exit(2);
#endif
}

/* A device pool, registered with ctx (exits when UCX cannot move device memory). */
static uint8_t *device_pool(duet_xfer_ctx_t *ctx, int fill)
{
    uint8_t *p = device_buffer(fill);
    if (duet_xfer_ctx_register(ctx, DUET_XFER_POOL_KV, p, POOL_BYTES, DUET_XFER_MEM_CUDA) < 0) {
        fprintf(stderr, "bench: %s\n", duet_error_last());
        exit(2);
    }
    return p;
}

static void pool_free(uint8_t *p)
{
#ifdef DUET_HAVE_CUDA
    if (g_device) {
        cudaFree(p);
        return;
    }
#endif
    free(p);
}

static duet_xfer_ctx_t *ctx_with_pool(uint8_t **pool_p, uint32_t max_x, bool receiver)
{
    duet_xfer_ctx_opts_t o;
    duet_xfer_ctx_opts_default(&o);
    o.max_transfers = max_x;
    o.max_pages = 4096;
    duet_xfer_ctx_t *ctx;
    if (duet_xfer_ctx_create(&o, &ctx) < 0) {
        fprintf(stderr, "bench: %s\n", duet_error_last());
        exit(2);
    }
    uint8_t *pool = NULL;
    duet_status_t st;
    if (g_device) {
        *pool_p = device_pool(ctx, 1);
        return ctx;
    }
    if (receiver && g_alloc) {
        void *base;
        st = duet_xfer_ctx_alloc(ctx, DUET_XFER_POOL_KV, POOL_BYTES, DUET_XFER_MEM_HOST, &base);
        *pool_p = NULL; /* owned by the context */
        memset(base, 1, POOL_BYTES);
    } else {
        pool = malloc(POOL_BYTES);
        memset(pool, 1, POOL_BYTES); /* fault every page in before timing */
        st = duet_xfer_ctx_register(ctx, DUET_XFER_POOL_KV, pool, POOL_BYTES, DUET_XFER_MEM_HOST);
        *pool_p = pool;
    }
    if (st < 0) {
        fprintf(stderr, "bench: %s\n", duet_error_last());
        exit(2);
    }
    return ctx;
}

/* Commands: "B <tokens> <count> <big?>": reserve count transfers, send them, wait, reply "ok". */
static int run_receiver(int in, int out)
{
    uint8_t *pool;
    duet_xfer_ctx_t *ctx = ctx_with_pool(&pool, 1100, true);
    static uint8_t buf[1 << 16];
    int32_t *pages = malloc(sizeof(int32_t) * 4096);
    for (;;) {
        uint32_t n;
        uint8_t *cmd = frame_read(in, &n, ctx);
        if (cmd == NULL || cmd[0] == 'Q')
            break;
        unsigned long long tokens;
        unsigned count, big;
        sscanf((char *)cmd + 2, "%llu %u %u", &tokens, &count, &big);
        free(cmd);
        lay_t l = big ? LAY_BIG : LAY_SMALL;
        uint64_t page_bytes = (uint64_t)l.page_tokens * l.layers * l.token_bytes;
        uint32_t per = (uint32_t)((tokens + l.page_tokens - 1) / l.page_tokens);
        g_ended = 0;
        for (unsigned k = 0; k < count; k++) {
            for (uint32_t i = 0; i < per; i++)
                pages[i] = (int32_t)((k * per + i) % (POOL_BYTES / page_bytes));
            duet_xfer_recv_args_t a = {.layout = layout_of(l),
                                       .pages = pages,
                                       .n_pages = per,
                                       .kda_slot = -1,
                                       .n_tokens = tokens,
                                       .group_size = 1,
                                       .deadline_unix_ms = duet_xfer_now_unix_ms() + 120000,
                                       .cb = count_cb};
            duet_xfer_reservation_t res;
            size_t len;
            if (duet_xfer_recv_reserve(ctx, &a, &res) < 0 ||
                duet_xfer_reservation_encode(&res, buf, sizeof(buf), &len) < 0) {
                fprintf(stderr, "bench: reserve: %s\n", duet_error_last());
                return 2;
            }
            frame_write(out, buf, (uint32_t)len);
        }
        double end = now_s() + 120;
        while (g_ended < count && now_s() < end)
            duet_xfer_ctx_progress(ctx);
        frame_write(out, "ok", 2);
    }
    duet_xfer_ctx_destroy(ctx);
    pool_free(pool);
    free(pages);
    return 0;
}

/* --- sender (this process) ---------------------------------------------------------------- */

typedef struct {
    duet_xfer_ctx_t *ctx;
    uint8_t *pool, *scratch;
    int to, from;
    int32_t *pages;
} sender_t;

static unsigned g_sent;
static bool g_ok;
static void send_cb(const duet_xfer_outcome_t *o, void *user)
{
    g_sent++;
    g_ok = o->kind == DUET_XFER_OUTCOME_DONE;
    if (!g_ok)
        fprintf(stderr, "bench: send aborted: %s: %s\n", duet_xfer_reason_str(o->reason),
                o->message);
}

/* Ask for `count` reservations of `tokens`; then time each transfer alone. times[] gets s. */
static int run_batch(sender_t *S, lay_t l, uint64_t tokens, unsigned count, double *times)
{
    char cmd[64];
    int n = snprintf(cmd, sizeof(cmd), "B %llu %u %u", (unsigned long long)tokens, count,
                     l.layers == LAY_BIG.layers);
    frame_write(S->to, cmd, (uint32_t)n);
    duet_xfer_reservation_t *res = calloc(count, sizeof(*res));
    for (unsigned k = 0; k < count; k++) {
        uint32_t len;
        uint8_t *b = frame_read(S->from, &len, S->ctx);
        if (b == NULL || duet_xfer_reservation_decode(b, len, 0, &res[k]) < 0) {
            fprintf(stderr, "bench: reservation: %s\n", duet_error_last());
            return -1;
        }
        free(b);
    }
    uint32_t per = (uint32_t)((tokens + l.page_tokens - 1) / l.page_tokens);
    for (uint32_t i = 0; i < per; i++)
        S->pages[i] = (int32_t)i;
    for (unsigned k = 0; k < count; k++) {
        duet_xfer_send_args_t a = {
            .reservations = &res[k],
            .n_ranks = 1,
            .layout = layout_of(l),
            .src = {.pages = S->pages, .n_pages = per, .kda_slot = -1, .n_tokens = tokens},
            .cb = send_cb};
        duet_xfer_id_t id;
        g_sent = 0;
        double t0 = now_s();
        if (duet_xfer_send_start(S->ctx, &a, &id) < 0) {
            fprintf(stderr, "bench: start: %s\n", duet_error_last());
            return -1;
        }
        for (uint32_t layer = 0; layer < l.layers; layer++)
            duet_xfer_send_layer_ready(S->ctx, id, layer);
        while (g_sent == 0)
            duet_xfer_ctx_progress(S->ctx);
        times[k] = now_s() - t0;
        if (!g_ok)
            return -1;
        duet_xfer_reservation_free(&res[k]);
    }
    free(res);
    uint32_t len;
    uint8_t *ok = frame_read(S->from, &len, S->ctx);
    if (ok == NULL)
        return -1;
    free(ok);
    return 0;
}

/* One piece of the reference copy: memcpy, or cudaMemcpyAsync device to device. */
static void copy_piece(void *dst, const void *src, size_t n)
{
#ifdef DUET_HAVE_CUDA
    if (g_device) {
        cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, 0);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* memcpy of the same source bytes (page by page, layer by layer) into a warm buffer. */
static double time_memcpy(sender_t *S, lay_t l, uint64_t tokens, int reps)
{
    uint64_t page_bytes = (uint64_t)l.page_tokens * l.layers * l.token_bytes;
    uint64_t full = tokens / l.page_tokens, rest = tokens % l.page_tokens;
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        uint8_t *dst = S->scratch;
        for (uint64_t p = 0; p <= full; p++) {
            uint64_t t = p < full ? l.page_tokens : rest;
            if (t == 0)
                break;
            for (uint32_t layer = 0; layer < l.layers; layer++) {
                uint64_t n = t * l.token_bytes;
                copy_piece(
                    dst, S->pool + p * page_bytes + (uint64_t)layer * l.page_tokens * l.token_bytes,
                    n);
                dst += n;
            }
        }
#ifdef DUET_HAVE_CUDA
        if (g_device)
            cudaDeviceSynchronize();
#endif
        double dt = now_s() - t0;
        if (dt < best)
            best = dt;
    }
    return best;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int bench_transport(const char *name, const char *tls, bool quick)
{
    setenv("UCX_TLS", tls, !g_device); /* device pools: an operator's UCX_TLS is kept */
    int p2c[2], c2p[2];
    if (pipe(p2c) != 0 || pipe(c2p) != 0)
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(p2c[1]);
        close(c2p[0]);
        _exit(run_receiver(p2c[0], c2p[1]));
    }
    close(p2c[0]);
    close(c2p[1]);
    sender_t S = {.to = p2c[1], .from = c2p[0]};
    S.ctx = ctx_with_pool(&S.pool, 1100, false);
    if (g_device) {
        S.scratch = device_buffer(2); /* the reference copy's destination */
    } else {
        S.scratch = malloc(POOL_BYTES);
        memset(S.scratch, 2, POOL_BYTES);
    }
    S.pages = malloc(sizeof(int32_t) * 4096);
    uint64_t token_bytes = (uint64_t)LAY_BIG.layers * LAY_BIG.token_bytes;

    printf("\n%s (UCX_TLS=%s)\n", name, tls);
    printf("%10s %10s %12s %12s %12s %8s\n", "size", "puts", "xfer ms", "xfer GB/s", "memcpy GB/s",
           "ratio");
    const unsigned sizes_mib[] = {1, 4, 16, 64, 256};
    int rc = 0;
    for (size_t i = 0; i < sizeof(sizes_mib) / sizeof(sizes_mib[0]) && rc == 0; i++) {
        uint64_t tokens = ((uint64_t)sizes_mib[i] << 20) / token_bytes;
        uint64_t bytes = tokens * token_bytes;
        int reps = quick ? 2 : (sizes_mib[i] >= 64 ? 3 : 5);
        double t[8], best = 1e9;
        for (int r = 0; r < reps && rc == 0; r++) {
            rc = run_batch(&S, LAY_BIG, tokens, 1, t);
            if (t[0] < best)
                best = t[0];
        }
        double mc = time_memcpy(&S, LAY_BIG, tokens, reps);
        uint64_t puts = ((tokens + LAY_BIG.page_tokens - 1) / LAY_BIG.page_tokens) * LAY_BIG.layers;
        printf("%7u MiB %10llu %12.3f %12.2f %12.2f %8.3f\n", sizes_mib[i],
               (unsigned long long)puts, best * 1e3, bytes / best / 1e9, bytes / mc / 1e9,
               mc / best);
    }
    const struct {
        const char *what;
        lay_t l;
        unsigned n;
    } lat[] = {{"1 page, 7 layers x 128 tok x 1152 B (1008 KiB)", LAY_BIG, quick ? 100 : 400},
               {"1 page, 1 layer x 16 tok x 576 B (9 KiB)", LAY_SMALL, quick ? 200 : 1000}};
    printf("%-50s %8s %10s %10s\n", "latency (start -> DONE)", "n", "p50 us", "p99 us");
    for (size_t i = 0; i < 2 && rc == 0; i++) {
        unsigned n = lat[i].n;
        double *t = malloc(sizeof(double) * n);
        for (unsigned done = 0; done < n && rc == 0; done += 100)
            rc = run_batch(&S, lat[i].l, lat[i].l.page_tokens, 100, t + done);
        qsort(t, n, sizeof(double), cmp_double);
        if (rc == 0)
            printf("%-50s %8u %10.1f %10.1f\n", lat[i].what, n, t[n / 2] * 1e6,
                   t[(size_t)(n * 0.99)] * 1e6);
        free(t);
    }
    frame_write(S.to, "Q", 1);
    int st;
    waitpid(pid, &st, 0);
    duet_xfer_ctx_destroy(S.ctx);
    close(S.to);
    close(S.from);
    pool_free(S.pool);
    pool_free(S.scratch);
    free(S.pages);
    return rc;
}

int main(int argc, char **argv)
{
    bool quick = false;
    const char *which = "both";
    for (int i = 1; i < argc; i++) {
        if (duet_version_flag(argv[i])) {
            duet_version_print("duet-bench-xfer");
            return 0;
        }
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: duet-bench-xfer [--quick] [--malloc] [--transport shm|tcp|both|cuda]\n"
                   "Bandwidth (1 .. 256 MiB transfers) and latency (one-page transfers, p50 /\n"
                   "p99) of the UCX transfer runtime between this process and a forked receiver,\n"
                   "moving MLA KV pages laid out like Kimi-Linear-48B's, against memcpy of the\n"
                   "same pages. --transport: shared memory, tcp on loopback, both (default), or\n"
                   "device pools through a CUDA-built UCX; --malloc: a malloc'ed receive pool\n"
                   "instead of a UCX-allocated one; --quick: fewer sizes and runs.\n");
            return 0;
        }
        if (strcmp(argv[i], "--quick") == 0)
            quick = true;
        else if (strcmp(argv[i], "--malloc") == 0)
            g_alloc = false;
        else if (strcmp(argv[i], "--transport") == 0 && i + 1 < argc) {
            which = argv[++i];
            if (strcmp(which, "shm") != 0 && strcmp(which, "tcp") != 0 &&
                strcmp(which, "both") != 0 && strcmp(which, "cuda") != 0) {
                fprintf(stderr,
                        "duet-bench-xfer: bad value '%s' for --transport "
                        "(shm, tcp, both or cuda)\n",
                        which);
                return 64;
            }
        } else {
            fprintf(stderr, "duet-bench-xfer: unknown option %s (see --help)\n", argv[i]);
            return 64;
        }
    }
    if (strcmp(which, "cuda") == 0) {
        g_device = true;
        return bench_transport("device pools (CUDA-built UCX)", "sm,self,cuda_copy,cuda_ipc",
                               quick) != 0;
    }
    setenv("UCX_NET_DEVICES", "lo", 0);
    signal(SIGPIPE, SIG_IGN);
    printf("duet-bench-xfer: sender and receiver processes, MLA KV pages of 7 layers x 128 "
           "tokens x 1152 B; bandwidth = best of runs, start -> sender DONE (puts flushed, "
           "XferDone sent)\n");
    int rc = 0;
    if (strcmp(which, "tcp") != 0)
        rc |= bench_transport("shared memory", "posix,sysv,cma,self", quick);
    if (strcmp(which, "shm") != 0)
        rc |= bench_transport("tcp (lo)", "tcp,self", quick);
    return rc != 0;
}
