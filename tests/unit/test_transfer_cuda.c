/*
 * The transfer runtime on CUDA device pools (transfer/xfer.h, duet_xfer_mem_kind_t).
 *
 * Without CUDA transports in this process's UCX (Debian's has none), registering device memory
 * must be refused with DUET_ERR_UNSUPPORTED and a message saying why; that part needs no device
 * (the refusal comes before UCX sees the pointer) and runs everywhere. With them (a UCX built
 * with CUDA, e.g. through LD_LIBRARY_PATH) and a device: real transfers between two contexts of
 * this process, device → device, host → device and device → host pools, with every byte of the
 * destination copied back and checked against the pattern the source was filled with
 * (tests/unit/test_transfer_util.h). Without a device or without such a UCX those cases skip and
 * say which.
 */
#include <criterion/criterion.h>
#include <cuda_runtime.h>

#include "tests/unit/test_transfer_util.h"
#include "transfer/xfer_impl.h"

static int device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

/* One side's pools: host pools, or device pools with a host image to fill / check them. */
typedef struct {
    duet_xfer_ctx_t *ctx;
    uint8_t *kv_h, *kda_h; /* the host pools, or the device pools' host images */
    void *kv_d, *kda_d;    /* device pools (NULL: host pools) */
    size_t kv_bytes, kda_bytes;
} side_t;

static void side_init(side_t *sd, size_t kv_bytes, size_t kda_bytes, bool device, int fill)
{
    memset(sd, 0, sizeof(*sd));
    duet_xfer_ctx_opts_t o;
    duet_xfer_ctx_opts_default(&o);
    o.max_transfers = 16;
    cr_assert_eq(duet_xfer_ctx_create(&o, &sd->ctx), DUET_OK, "%s", duet_error_last());
    sd->kv_bytes = kv_bytes;
    sd->kda_bytes = kda_bytes;
    sd->kv_h = malloc(kv_bytes);
    sd->kda_h = malloc(kda_bytes);
    memset(sd->kv_h, fill, kv_bytes);
    memset(sd->kda_h, fill, kda_bytes);
    const duet_xfer_mem_kind_t kind = device ? DUET_XFER_MEM_CUDA : DUET_XFER_MEM_HOST;
    void *kv = sd->kv_h, *kda = sd->kda_h;
    if (device) {
        cr_assert_eq(cudaMalloc(&sd->kv_d, kv_bytes), cudaSuccess);
        cr_assert_eq(cudaMalloc(&sd->kda_d, kda_bytes), cudaSuccess);
        cr_assert_eq(cudaMemcpy(sd->kv_d, sd->kv_h, kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
        cr_assert_eq(cudaMemcpy(sd->kda_d, sd->kda_h, kda_bytes, cudaMemcpyHostToDevice),
                     cudaSuccess);
        kv = sd->kv_d, kda = sd->kda_d;
    }
    cr_assert_eq(duet_xfer_ctx_register(sd->ctx, DUET_XFER_POOL_KV, kv, kv_bytes, kind), DUET_OK,
                 "%s", duet_error_last());
    cr_assert_eq(duet_xfer_ctx_register(sd->ctx, DUET_XFER_POOL_KDA, kda, kda_bytes, kind), DUET_OK,
                 "%s", duet_error_last());
}

/* Host image → device pools (after filling the image), or device pools → image (to check). */
static void side_sync(side_t *sd, enum cudaMemcpyKind dir)
{
    if (sd->kv_d == NULL)
        return;
    const bool up = dir == cudaMemcpyHostToDevice;
    cr_assert_eq(cudaMemcpy(up ? sd->kv_d : (void *)sd->kv_h, up ? (void *)sd->kv_h : sd->kv_d,
                            sd->kv_bytes, dir),
                 cudaSuccess);
    cr_assert_eq(cudaMemcpy(up ? sd->kda_d : (void *)sd->kda_h, up ? (void *)sd->kda_h : sd->kda_d,
                            sd->kda_bytes, dir),
                 cudaSuccess);
}

static void side_free(side_t *sd)
{
    duet_xfer_ctx_destroy(sd->ctx); /* before the memory it registered */
    cudaFree(sd->kv_d);
    cudaFree(sd->kda_d);
    free(sd->kv_h);
    free(sd->kda_h);
}

typedef struct {
    bool ended;
    duet_xfer_outcome_t out;
    char msg[160];
} ended_t;

static void on_outcome(const duet_xfer_outcome_t *o, void *user)
{
    ended_t *e = user;
    e->ended = true;
    e->out = *o;
    snprintf(e->msg, sizeof(e->msg), "%s", o->message);
}

/* A context (default options) of a UCX restricted to the transports `tls` (UCX_TLS). */
static duet_xfer_ctx_t *ctx_with_tls(const char *tls)
{
    setenv("UCX_TLS", tls, 1);
    setenv("UCX_NET_DEVICES", "lo", 1);
    duet_xfer_ctx_opts_t o;
    duet_xfer_ctx_opts_default(&o);
    duet_xfer_ctx_t *ctx = NULL;
    cr_assert_eq(duet_xfer_ctx_create(&o, &ctx), DUET_OK, "%s", duet_error_last());
    return ctx;
}

/* Skip (saying why) unless a device and a UCX with CUDA transports are here. */
static void need_cuda_ucx(void)
{
    if (device_count() == 0)
        cr_skip_test("no CUDA device");
    duet_xfer_ctx_t *ctx = ctx_with_tls("posix,sysv,cma,self,cuda_copy,cuda_ipc");
    const bool ok = duet_xfer_ctx_mem_supported(ctx, DUET_XFER_MEM_CUDA);
    duet_xfer_ctx_destroy(ctx);
    if (!ok)
        cr_skip_test("this UCX has no CUDA transports (Debian's UCX is built without them)");
}

/* One transfer of the default scenario (3 MLA layers, 2 KDA layers, 100 tokens, 16 → 32 tokens
 * per page) from src pools to dst pools, each on the device or not; every byte checked. */
static void one_transfer(bool src_dev, bool dst_dev)
{
    xt_scn_t s = xt_scn_default();
    s.count = 1;
    const uint32_t seed = s.seed + (src_dev ? 2 : 0) + (dst_dev ? 1 : 0);
    const uint32_t n_src = (uint32_t)xt_pages_for(s.tokens, s.src_pt),
                   n_dst = xt_rank_pages(&s, 0) + 1;
    side_t S, R;
    side_init(&S, xt_kv_page_bytes(&s, s.src_pt) * (n_src + 3), xt_kda_slot_bytes(&s, s.heads) * 2,
              src_dev, 0);
    side_init(&R, xt_kv_page_bytes(&s, s.dst_pt) * (n_dst + 3), xt_kda_slot_bytes(&s, s.heads) * 2,
              dst_dev, 0xee);
    int32_t src_pages[16], dst_pages[16];
    for (uint32_t i = 0; i < n_src; i++)
        src_pages[i] = (int32_t)(n_src + 2 - i); /* out of order, none at 0 */
    for (uint32_t i = 0; i < n_dst; i++)
        dst_pages[i] = (int32_t)(n_dst + 2 - i);
    xt_fill_src(&s, seed, S.kv_h, src_pages, S.kda_h, 1);
    side_sync(&S, cudaMemcpyHostToDevice);

    ended_t re = {0}, se = {0};
    duet_xfer_recv_args_t ra = {
        .req_id = 7,
        .layout = xt_layout(&s, false),
        .pages = dst_pages,
        .n_pages = n_dst,
        .kda_slot = 1,
        .n_tokens = s.tokens,
        .rank = 0,
        .group_size = 1,
        .deadline_unix_ms = duet_xfer_now_unix_ms() + 10000,
        .cb = on_outcome,
        .user = &re,
    };
    duet_xfer_reservation_t res, dec;
    cr_assert_eq(duet_xfer_recv_reserve(R.ctx, &ra, &res), DUET_OK, "%s", duet_error_last());
    static uint8_t buf[1 << 16];
    size_t len = 0;
    cr_assert_eq(duet_xfer_reservation_encode(&res, buf, sizeof(buf), &len), DUET_OK);
    cr_assert_eq(duet_xfer_reservation_decode(buf, len, 0, &dec), DUET_OK, "%s", duet_error_last());
    duet_xfer_send_args_t sa = {
        .reservations = &dec,
        .n_ranks = 1,
        .layout = xt_layout(&s, true),
        .src = {.pages = src_pages, .n_pages = n_src, .kda_slot = 1, .n_tokens = s.tokens},
        .checksum = true,
        .cb = on_outcome,
        .user = &se,
    };
    duet_xfer_id_t id;
    cr_assert_eq(duet_xfer_send_start(S.ctx, &sa, &id), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_free(&dec);
    for (uint32_t l = 0; l < s.mla; l++)
        cr_assert_eq(duet_xfer_send_layer_ready(S.ctx, id, l), DUET_OK);
    cr_assert_eq(duet_xfer_send_kda_ready(S.ctx, id), DUET_OK);
    const uint64_t end = xt_now_ms() + 15000;
    while (!(re.ended && se.ended) && xt_now_ms() < end) {
        duet_xfer_ctx_progress(S.ctx);
        duet_xfer_ctx_progress(R.ctx);
    }
    const char *what = src_dev ? (dst_dev ? "device → device" : "device → host")
                               : (dst_dev ? "host → device" : "host → host");
    cr_assert(re.ended && se.ended, "%s: no outcome within 15 s", what);
    cr_assert_eq(se.out.kind, DUET_XFER_OUTCOME_DONE, "%s: sender: %s", what, se.msg);
    cr_assert_eq(re.out.kind, DUET_XFER_OUTCOME_DONE, "%s: receiver: %s", what, re.msg);
    cr_assert_eq(re.out.bytes, se.out.bytes, "%s", what);
    /* a device pool on either side: no checksum the CPU could verify (xfer.h) */
    cr_assert_eq(re.out.has_checksum, !src_dev && !dst_dev, "%s", what);
    side_sync(&R, cudaMemcpyDeviceToHost);
    const uint64_t bad = xt_verify_dst(&s, seed, R.kv_h, dst_pages, n_dst, R.kda_h, 1);
    cr_assert_eq(bad, 0, "%s: %llu words differ from the source pattern", what,
                 (unsigned long long)bad);
    printf("transfer_cuda %s: %llu bytes, every word equal to the source\n", what,
           (unsigned long long)re.out.bytes);
    side_free(&S);
    side_free(&R);
}

/* No CUDA transport in UCX_TLS (and none built into Debian's UCX): device memory is refused,
 * saying why, before UCX sees it; the pool stays free for host memory. Runs everywhere. */
Test(transfer_cuda, device_pools_refused_without_cuda_transports)
{
    duet_xfer_ctx_t *ctx = ctx_with_tls("posix,sysv,cma,self");
    cr_assert(duet_xfer_ctx_mem_supported(ctx, DUET_XFER_MEM_HOST));
    cr_assert(!duet_xfer_ctx_mem_supported(ctx, DUET_XFER_MEM_CUDA));
    cr_assert(!duet_xfer_ctx_mem_supported(ctx, (duet_xfer_mem_kind_t)7));
    static uint8_t pool[4096];
    cr_assert_eq(
        duet_xfer_ctx_register(ctx, DUET_XFER_POOL_KV, pool, sizeof(pool), (duet_xfer_mem_kind_t)7),
        DUET_ERR_INVALID);
    void *base = NULL;
    cr_assert_eq(duet_xfer_ctx_alloc(ctx, DUET_XFER_POOL_KV, 4096, DUET_XFER_MEM_CUDA, &base),
                 DUET_ERR_UNSUPPORTED);
    cr_assert_null(base);
    cr_assert_eq(
        duet_xfer_ctx_register(ctx, DUET_XFER_POOL_KV, pool, sizeof(pool), DUET_XFER_MEM_CUDA),
        DUET_ERR_UNSUPPORTED);
    cr_assert(strstr(duet_error_last(), "no CUDA transports") != NULL, "%s", duet_error_last());
    cr_assert_eq(
        duet_xfer_ctx_register(ctx, DUET_XFER_POOL_KV, pool, sizeof(pool), DUET_XFER_MEM_HOST),
        DUET_OK, "%s", duet_error_last());
    duet_xfer_ctx_destroy(ctx);
}

Test(transfer_cuda, device_to_device, .timeout = 60)
{
    need_cuda_ucx();
    one_transfer(true, true);
}

Test(transfer_cuda, host_to_device, .timeout = 60)
{
    need_cuda_ucx();
    one_transfer(false, true);
}

Test(transfer_cuda, device_to_host, .timeout = 60)
{
    need_cuda_ucx();
    one_transfer(true, false);
}

/* UCX_TLS values that let UCX use tcp keep device memory off (xfer_ctx.c); no device needed. */
Test(transfer_cuda, ucx_tls_parsing_for_tcp)
{
    const struct {
        const char *tls;
        bool tcp;
    } cases[] = {{NULL, true},       {"", true},         {"all", true},
                 {"tcp", true},      {"sm,self", false}, {"sm,tcp,self", true},
                 {"^tcp", false},    {"^sm", true},      {"tcpx,sm", false},
                 {"^tcp,sm", false}, {"self,all", true}, {"cuda_copy,cuda_ipc,sm", false}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        cr_assert_eq(duet__tls_may_use_tcp(cases[i].tls), cases[i].tcp, "UCX_TLS=%s",
                     cases[i].tls != NULL ? cases[i].tls : "(unset)");
}

/* With CUDA transports but tcp allowed, device memory stays off (and registering it is refused). */
Test(transfer_cuda, tcp_in_ucx_tls_keeps_device_memory_off, .timeout = 60)
{
    need_cuda_ucx();
    duet_xfer_ctx_t *ctx = ctx_with_tls("tcp,self,sm,cuda_copy,cuda_ipc");
    cr_assert(!duet_xfer_ctx_mem_supported(ctx, DUET_XFER_MEM_CUDA));
    void *d = NULL;
    cr_assert_eq(cudaMalloc(&d, 4096), cudaSuccess);
    cr_assert_eq(duet_xfer_ctx_register(ctx, DUET_XFER_POOL_KV, d, 4096, DUET_XFER_MEM_CUDA),
                 DUET_ERR_UNSUPPORTED);
    duet_xfer_ctx_destroy(ctx);
    cudaFree(d);
}
