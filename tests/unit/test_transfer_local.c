/*
 * The transfer runtime's state machines and refusals with both sides in this process: a sender
 * context and a receiver context (two UCX workers over shared memory), so every test is fast and
 * deterministic. Multi-process transfers and kill -9 faults are in test_transfer_procs.c.
 */
#include <criterion/criterion.h>

#include "common/metrics.h"
#include "tests/unit/test_transfer_util.h"
#include "transfer/xfer_impl.h"

static xt_scn_t g_s;
static xt_recv_t g_R;
static xt_send_t g_S;

/* The scenario of these tests: 4 transfers, 5 s deadlines. */
static xt_scn_t local_scn(void)
{
    xt_scn_t s = xt_scn_default();
    s.count = 4;
    s.deadline_ms = 5000;
    return s;
}

/* A receiver and a sender context for scenario s over the transports `tls` (UCX_TLS). */
static void harness_scn(const char *tls, xt_scn_t s)
{
    setenv("UCX_TLS", tls, 1);
    setenv("UCX_NET_DEVICES", "lo", 1);
    g_s = s;
    cr_assert_eq(xt_recv_init(&g_R, &g_s), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(xt_send_init(&g_S, &g_s, 4, 4), DUET_OK, "%s", duet_error_last());
}

static void harness(const char *tls)
{
    harness_scn(tls, local_scn());
}

static void setup(void)
{
    harness("posix,sysv,cma,self");
}

static void teardown(void)
{
    xt_send_free(&g_S);
    xt_recv_free(&g_R);
}

/* Reserve transfer k on the receiver and decode it as the sender would. */
static void reserve(uint32_t k, duet_xfer_reservation_t *res)
{
    static uint8_t buf[1 << 16];
    size_t len;
    cr_assert_eq(xt_recv_reserve(&g_R, k, buf, sizeof(buf), &len), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(duet_xfer_reservation_decode(buf, len, 0, res), DUET_OK, "%s", duet_error_last());
}

/* Progress both contexts until `cond` or timeout. */
#define PUMP_UNTIL(cond, ms)                                                                       \
    do {                                                                                           \
        uint64_t end_ = xt_now_ms() + (ms);                                                        \
        while (!(cond) && xt_now_ms() < end_) {                                                    \
            duet_xfer_ctx_progress(g_S.ctx);                                                       \
            duet_xfer_ctx_wait(g_R.ctx, 1);                                                        \
        }                                                                                          \
    } while (0)

TestSuite(transfer_local, .init = setup, .fini = teardown, .timeout = 30);

/* Transfer 0 with every layer ready at once, pumped until both sides ended: both DONE. */
static void transfer_0_done(void)
{
    duet_xfer_reservation_t res;
    reserve(0, &res);
    cr_assert_eq(xt_send_start(&g_S, 0, &res), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_free(&res);
    for (uint32_t l = 0; l <= g_s.mla; l++)
        xt_send_layer(&g_S, 0, 1, l);
    PUMP_UNTIL(g_R.n_ended == 1 && g_S.n_ended == 1, 10000);
    cr_assert_eq(g_S.x[0].out.kind, DUET_XFER_OUTCOME_DONE, "%s", g_S.x[0].msg);
    cr_assert_eq(g_R.x[0].out.kind, DUET_XFER_OUTCOME_DONE, "%s", g_R.x[0].msg);
}

Test(transfer_local, one_transfer_done_and_verified)
{
    transfer_0_done();
    cr_assert(g_R.x[0].out.has_checksum);
    cr_assert_eq(g_R.x[0].out.checksum, g_S.x[0].out.checksum);
    cr_assert_eq(g_R.x[0].bad, 0);
    cr_assert_eq(g_R.x[0].out.bytes, g_S.x[0].out.bytes);
    cr_assert_eq(g_R.pool.n_free, g_R.pool.n);
}

Test(transfer_local, layers_out_of_order_and_repeated)
{
    duet_xfer_reservation_t res;
    reserve(0, &res);
    cr_assert_eq(xt_send_start(&g_S, 0, &res), DUET_OK);
    duet_xfer_reservation_free(&res);
    duet_xfer_id_t id = g_S.x[0].id;
    cr_assert_eq(duet_xfer_send_kda_ready(g_S.ctx, id), DUET_OK);
    cr_assert_eq(duet_xfer_send_layer_ready(g_S.ctx, id, 2), DUET_OK);
    cr_assert_eq(duet_xfer_send_layer_ready(g_S.ctx, id, 2), DUET_OK);
    cr_assert_eq(duet_xfer_send_layer_ready(g_S.ctx, id, g_s.mla), DUET_ERR_RANGE);
    PUMP_UNTIL(false, 50);
    cr_assert_eq(g_R.n_ended, 0, "done before every layer was ready");
    cr_assert_eq(duet_xfer_send_layer_ready(g_S.ctx, id, 0), DUET_OK);
    cr_assert_eq(duet_xfer_send_layer_ready(g_S.ctx, id, 1), DUET_OK);
    PUMP_UNTIL(g_R.n_ended == 1 && g_S.n_ended == 1, 10000);
    cr_assert_eq(g_R.x[0].out.kind, DUET_XFER_OUTCOME_DONE, "%s", g_R.x[0].msg);
    cr_assert_eq(g_R.x[0].bad, 0);
    cr_assert_eq(duet_xfer_send_layer_ready(g_S.ctx, id, 0), DUET_ERR_NOT_FOUND);
}

Test(transfer_local, receiver_cancel_aborts_the_sender)
{
    duet_xfer_reservation_t res;
    reserve(0, &res);
    cr_assert_eq(xt_send_start(&g_S, 0, &res), DUET_OK);
    duet_xfer_reservation_free(&res);
    xt_send_layer(&g_S, 0, 1, 0);
    PUMP_UNTIL(false, 50); /* hello delivered: the receiver knows the sender */
    cr_assert_eq(duet_xfer_recv_cancel(g_R.ctx, g_R.x[0].id, "client went away"), DUET_OK);
    cr_assert_eq(g_R.n_ended, 1, "cancel reports at once");
    cr_assert_eq(g_R.x[0].out.reason, DUET_XFER_REASON_CANCELLED);
    cr_assert_str_eq(g_R.x[0].msg, "client went away");
    cr_assert_eq(g_R.pool.n_free, g_R.pool.n);
    cr_assert_eq(duet_xfer_recv_cancel(g_R.ctx, g_R.x[0].id, NULL), DUET_ERR_NOT_FOUND);
    PUMP_UNTIL(g_S.n_ended == 1, 5000);
    cr_assert_eq(g_S.x[0].out.kind, DUET_XFER_OUTCOME_ABORTED);
    cr_assert_eq(g_S.x[0].out.reason, DUET_XFER_REASON_PEER_ABORTED, "%s", g_S.x[0].msg);
    cr_assert(strstr(g_S.x[0].msg, "client went away") != NULL, "%s", g_S.x[0].msg);
    cr_assert_eq(g_S.pool.n_free, g_S.pool.n);
}

Test(transfer_local, sender_cancel_aborts_the_receiver)
{
    duet_xfer_reservation_t res;
    reserve(0, &res);
    cr_assert_eq(xt_send_start(&g_S, 0, &res), DUET_OK);
    duet_xfer_reservation_free(&res);
    xt_send_layer(&g_S, 0, 1, 0);
    cr_assert_eq(duet_xfer_send_cancel(g_S.ctx, g_S.x[0].id, "drain"), DUET_OK);
    PUMP_UNTIL(g_S.n_ended == 1 && g_R.n_ended == 1, 5000);
    cr_assert_eq(g_S.x[0].out.reason, DUET_XFER_REASON_CANCELLED);
    cr_assert_eq(g_R.x[0].out.kind, DUET_XFER_OUTCOME_ABORTED);
    cr_assert_eq(g_R.x[0].out.reason, DUET_XFER_REASON_PEER_ABORTED, "%s", g_R.x[0].msg);
    cr_assert(strstr(g_R.x[0].msg, "drain") != NULL, "%s", g_R.x[0].msg);
    cr_assert_eq(g_R.pool.n_free, g_R.pool.n);
}

Test(transfer_local, hello_for_an_ended_reservation_is_refused)
{
    duet_xfer_reservation_t res;
    reserve(0, &res);
    cr_assert_eq(duet_xfer_recv_cancel(g_R.ctx, g_R.x[0].id, "gone"), DUET_OK);
    cr_assert_eq(xt_send_start(&g_S, 0, &res), DUET_OK);
    duet_xfer_reservation_free(&res);
    PUMP_UNTIL(g_S.n_ended == 1, 5000);
    cr_assert_eq(g_S.x[0].out.reason, DUET_XFER_REASON_PEER_ABORTED, "%s", g_S.x[0].msg);
    cr_assert(strstr(g_S.x[0].msg, "no such reservation") != NULL, "%s", g_S.x[0].msg);
}

Test(transfer_local, receiver_deadline_returns_pages)
{
    xt_recv_free(&g_R);
    g_s.deadline_ms = 300;
    cr_assert_eq(xt_recv_init(&g_R, &g_s), DUET_OK);
    duet_xfer_reservation_t res;
    uint64_t t0 = xt_now_ms();
    reserve(0, &res);
    duet_xfer_reservation_free(&res);
    cr_assert(duet_xfer_ctx_timeout_ms(g_R.ctx) <= 300);
    cr_assert(xt_recv_run(&g_R, 1, 2000));
    uint64_t took = xt_now_ms() - t0;
    cr_assert_eq(g_R.x[0].out.reason, DUET_XFER_REASON_DEADLINE);
    cr_assert(took >= 299 && took < 600, "deadline after %llu ms", (unsigned long long)took);
    cr_assert_eq(g_R.pool.n_free, g_R.pool.n);
}

/* --- refusals at start -------------------------------------------------------------------- */

static unsigned g_cb_calls;
static void count_cb(const duet_xfer_outcome_t *o, void *user)
{
    (void)o;
    (void)user;
    g_cb_calls++;
}

/* Start with `res` (n ranks) and expect `want`, with `phrase` in the error detail. */
static void refuse(const duet_xfer_reservation_t *res, uint32_t n, uint64_t n_tokens,
                   duet_status_t want, const char *phrase)
{
    static int32_t src_pages[64];
    for (int i = 0; i < 64; i++)
        src_pages[i] = i;
    duet_xfer_send_args_t a = {
        .reservations = res,
        .n_ranks = n,
        .layout = xt_layout(&g_s, true),
        .src = {.pages = src_pages, .n_pages = 64, .kda_slot = 0, .n_tokens = n_tokens},
        .cb = count_cb,
    };
    duet_xfer_id_t id;
    duet_error_clear();
    duet_status_t st = duet_xfer_send_start(g_S.ctx, &a, &id);
    cr_expect_eq(st, want, "%s: got %s (%s)", phrase, duet_status_name(st), duet_error_last());
    cr_expect(strstr(duet_error_last(), phrase) != NULL, "detail \"%s\" lacks \"%s\"",
              duet_error_last(), phrase);
    cr_expect_eq(duet_xfer_ctx_active(g_S.ctx, DUET_XFER_ROLE_SEND), 0);
}

Test(transfer_local, malformed_oversized_stale_reservations_refused)
{
    duet_xfer_reservation_t res, r;
    reserve(0, &res);
    uint64_t T = g_s.tokens;

    r = res;
    r.deadline_unix_ms = duet_xfer_now_unix_ms() - 1;
    refuse(&r, 1, T, DUET_ERR_TIMEOUT, "stale");

    r = res;
    r.version = 99;
    refuse(&r, 1, T, DUET_ERR_UNSUPPORTED, "version");

    r = res;
    r.worker_address.len = 0;
    refuse(&r, 1, T, DUET_ERR_FORMAT, "worker_address");

    r = res;
    r.kv_bytes = 100; /* pages no longer fit the advertised region */
    refuse(&r, 1, T, DUET_ERR_RANGE, "kv");

    r = res;
    r.group_size = 2;
    refuse(&r, 1, T, DUET_ERR_INVALID, "expected rank 0 of 1");

    refuse(&res, 1, T + 1, DUET_ERR_INVALID, "tokens");

    r = res;
    r.kda_slot = -1;
    r.kda_rkey.len = 0;
    refuse(&r, 1, T, DUET_ERR_INVALID, "KDA");

    duet_xfer_reservation_t two[2] = {res, res};
    two[0].group_size = two[1].group_size = 2;
    two[1].rank = 1;
    refuse(two, 2, T, DUET_ERR_INVALID, "share transfer id");

    /* Oversized: more pages than this context accepts. */
    static int32_t many[5000];
    for (int i = 0; i < 5000; i++)
        many[i] = i;
    r = res;
    r.pages = many;
    r.n_pages = 5000;
    r.kv_bytes = (uint64_t)5000 * xt_kv_page_bytes(&g_s, g_s.dst_pt);
    refuse(&r, 1, T, DUET_ERR_RANGE, "max_pages");

    /* A destination range past the advertised KV pool cannot slip through the plan. */
    r = res;
    int32_t far[8];
    for (int i = 0; i < 8; i++)
        far[i] = 1000000 + i;
    r.pages = far;
    r.n_pages = 8;
    refuse(&r, 1, T, DUET_ERR_RANGE, "page");

    cr_assert_eq(g_cb_calls, 0, "a refused start ran a callback");

    /* Malformed bytes never become a reservation (the decoder's job; checked end to end). */
    duet_xfer_reservation_t bad;
    static const uint8_t noise[] = {0x0a, 0xff, 0xff, 0xff, 0x0f, 0x01, 0x02};
    cr_assert_lt(duet_xfer_reservation_decode(noise, sizeof(noise), 0, &bad), 0);
    duet_xfer_reservation_free(&res);
}

Test(transfer_local, reserve_refusals_and_full_table)
{
    int32_t pages[64];
    for (int i = 0; i < 64; i++)
        pages[i] = i;
    duet_xfer_recv_args_t a = {
        .layout = xt_layout(&g_s, false),
        .pages = pages,
        .n_pages = 8,
        .kda_slot = 0,
        .n_tokens = g_s.tokens,
        .group_size = 1,
        .deadline_unix_ms = duet_xfer_now_unix_ms() + 1000,
        .cb = count_cb,
    };
    duet_xfer_reservation_t res;
    duet_xfer_recv_args_t b = a;
    b.deadline_unix_ms = duet_xfer_now_unix_ms() - 5;
    cr_assert_eq(duet_xfer_recv_reserve(g_R.ctx, &b, &res), DUET_ERR_TIMEOUT);
    b = a;
    b.n_pages = 2; /* 100 tokens need 4 pages of 32 */
    cr_assert_eq(duet_xfer_recv_reserve(g_R.ctx, &b, &res), DUET_ERR_RANGE);
    b = a;
    pages[3] = 1 << 30;
    cr_assert_eq(duet_xfer_recv_reserve(g_R.ctx, &b, &res), DUET_ERR_RANGE);
    pages[3] = 3;
    b.kda_slot = 1000;
    cr_assert_eq(duet_xfer_recv_reserve(g_R.ctx, &b, &res), DUET_ERR_RANGE);
    b = a;
    b.rank = 1;
    cr_assert_eq(duet_xfer_recv_reserve(g_R.ctx, &b, &res), DUET_ERR_RANGE);

    /* Fill the table (count + 8 entries), then one more is BUSY. */
    unsigned n = 0;
    while (duet_xfer_recv_reserve(g_R.ctx, &a, &res) == DUET_OK)
        n++;
    cr_assert_eq(n, g_s.count + 8);
    cr_assert_eq(duet_xfer_recv_reserve(g_R.ctx, &a, &res), DUET_ERR_BUSY);
    cr_assert_eq(g_cb_calls, 0);
}

Test(transfer_local, metrics_count_outcomes)
{
    xt_send_free(&g_S);
    xt_recv_free(&g_R);
    duet_metrics_t *ms, *mr;
    cr_assert_eq(duet_metrics_create(&ms), DUET_OK);
    cr_assert_eq(duet_metrics_create(&mr), DUET_OK);
    /* Contexts with a registry: build them by hand around the harness. */
    cr_assert_eq(xt_recv_init(&g_R, &g_s), DUET_OK);
    cr_assert_eq(xt_send_init(&g_S, &g_s, 4, 4), DUET_OK);
    duet_xfer_ctx_destroy(g_S.ctx);
    duet_xfer_ctx_destroy(g_R.ctx);
    duet_xfer_ctx_opts_t o;
    duet_xfer_ctx_opts_default(&o);
    o.metrics = ms;
    cr_assert_eq(duet_xfer_ctx_create(&o, &g_S.ctx), DUET_OK, "%s", duet_error_last());
    o.metrics = mr;
    cr_assert_eq(duet_xfer_ctx_create(&o, &g_R.ctx), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_xfer_ctx_create(&o, &(duet_xfer_ctx_t *){NULL}), DUET_ERR_INVALID,
                 "metrics registered twice");
    duet_xfer_ctx_register(g_S.ctx, DUET_XFER_POOL_KV, g_S.kv, g_S.kv_bytes, DUET_XFER_MEM_HOST);
    duet_xfer_ctx_register(g_S.ctx, DUET_XFER_POOL_KDA, g_S.kda, g_S.kda_bytes, DUET_XFER_MEM_HOST);
    duet_xfer_ctx_register(g_R.ctx, DUET_XFER_POOL_KV, g_R.kv, g_R.kv_bytes, DUET_XFER_MEM_HOST);
    duet_xfer_ctx_register(g_R.ctx, DUET_XFER_POOL_KDA, g_R.kda, g_R.kda_bytes, DUET_XFER_MEM_HOST);
    cr_assert_eq(duet_xfer_ctx_register(g_R.ctx, DUET_XFER_POOL_KV, g_R.kv, g_R.kv_bytes,
                                        DUET_XFER_MEM_HOST),
                 DUET_ERR_INVALID);
    if (!duet_xfer_ctx_mem_supported(g_R.ctx, DUET_XFER_MEM_CUDA)) /* Debian's UCX */
        cr_assert_eq(
            duet_xfer_ctx_register(g_R.ctx, DUET_XFER_POOL_KDA, g_R.kda, 8, DUET_XFER_MEM_CUDA),
            DUET_ERR_UNSUPPORTED);

    duet_xfer_reservation_t res;
    reserve(0, &res);
    cr_assert_eq(xt_send_start(&g_S, 0, &res), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_free(&res);
    for (uint32_t l = 0; l <= g_s.mla; l++)
        xt_send_layer(&g_S, 0, 1, l);
    PUMP_UNTIL(g_R.n_ended == 1 && g_S.n_ended == 1, 10000);
    reserve(1, &res);
    duet_xfer_reservation_free(&res);
    duet_xfer_recv_cancel(g_R.ctx, g_R.x[1].id, NULL);

    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_metrics_render(mr, &sb), DUET_OK);
    cr_assert(strstr(sb.data, "duet_xfer_transfers_total{role=\"recv\",outcome=\"done\"} 1") !=
                  NULL,
              "%s", sb.data);
    cr_assert(strstr(sb.data, "duet_xfer_aborts_total{reason=\"cancelled\"} 1") != NULL, "%s",
              sb.data);
    cr_assert(strstr(sb.data, "duet_xfer_transfer_seconds_count{role=\"recv\"} 2") != NULL, "%s",
              sb.data);
    char want[128];
    snprintf(want, sizeof(want), "duet_xfer_bytes_total{role=\"recv\"} %llu",
             (unsigned long long)g_R.x[0].out.bytes);
    cr_assert(strstr(sb.data, want) != NULL, "%s", sb.data);
    duet_strbuf_free(&sb);
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_metrics_render(ms, &sb), DUET_OK);
    cr_assert(strstr(sb.data, "duet_xfer_transfers_total{role=\"send\",outcome=\"done\"} 1") !=
                  NULL,
              "%s", sb.data);
    duet_strbuf_free(&sb);
    xt_send_free(&g_S);
    xt_recv_free(&g_R);
    duet_metrics_destroy(ms);
    duet_metrics_destroy(mr);
    setup(); /* teardown frees a harness */
}

/* With a shared-memory-only UCX_TLS (this suite's) no transport can detect a dead peer: the
 * contexts know it from their creation and never ask UCX for error handling, which UCX would
 * refuse with an ERROR line on the first endpoint. A transfer still completes. */
Test(transfer_local, shm_only_tls_skips_peer_error_handling)
{
    cr_assert(g_S.ctx->no_peer_err && g_R.ctx->no_peer_err,
              "UCX_TLS=%s: the contexts should start without peer error handling",
              getenv("UCX_TLS"));
    transfer_0_done();
    cr_assert(g_S.ctx->no_peer_err, "the sender asked for error handling after all");
}

/* Which UCX_TLS values may give UCX a transport that detects a dead peer. */
Test(transfer_tls, peer_failure_detection_by_ucx_tls)
{
    static const struct {
        const char *tls;
        bool may;
    } cases[] = {
        {NULL, true},
        {"", true},
        {"all", true},
        {"tcp", true},
        {"sm,self,tcp", true},
        {"rc_mlx5,sm", true},
        {"ud_verbs", true},
        {"dc_x,self", true},
        {"ib", true},
        {"^tcp", true}, /* an exclusion list leaves the rest, InfiniBand included */
        {"sm,self", false},
        {"posix,sysv,cma,self", false},
        {"sm,self,cuda_copy,cuda_ipc", false},
        {"shm", false},
        {"tcpx", false},
        {"self,", false},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        cr_assert_eq(duet__tls_may_detect_peer_failure(cases[i].tls), cases[i].may, "UCX_TLS=%s",
                     cases[i].tls ? cases[i].tls : "(unset)");
}

/* The harness over tcp, whose endpoints need a handshake (request, reply) before use. */
static void setup_tcp(void)
{
    harness("tcp,self");
}

/* duet_xfer_send_connecting: true for a transfer whose new endpoint has not finished its
 * handshake (no progress yet), false once it has (the transfer still live), after the end and
 * for an unknown id. duet-ctx waits on it before a prompt's first step. */
Test(transfer_tcp, sender_reports_its_handshake, .init = setup_tcp, .fini = teardown, .timeout = 30)
{
    duet_xfer_reservation_t res;
    reserve(0, &res);
    cr_assert_eq(xt_send_start(&g_S, 0, &res), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_free(&res);
    const duet_xfer_id_t id = g_S.x[0].id;
    cr_assert(duet_xfer_send_connecting(g_S.ctx, id),
              "a new tcp endpoint cannot be connected before any progress");
    /* the receiver's rkeys wait for the endpoint: unpacking a dead receiver's crashed UCX 1.13
     * (bench/soak), whose endpoint fails its first flush instead */
    const duet__xfer_t *xs = duet__xfer_find(g_S.ctx, DUET_XFER_ROLE_SEND, id);
    cr_assert_not_null(xs);
    for (int k = 0; k < DUET_XFER_N_POOLS; k++)
        cr_assert_null(xs->ranks[0].rkey[k],
                       "the %d-th rkey was unpacked before the endpoint was up", k);
    PUMP_UNTIL(!duet_xfer_send_connecting(g_S.ctx, id), 10000);
    cr_assert_not(duet_xfer_send_connecting(g_S.ctx, id), "the handshake did not finish");
    cr_assert_eq(g_S.n_ended + g_R.n_ended, 0, "the transfer ended before any layer was ready");
    for (uint32_t l = 0; l <= g_s.mla; l++)
        xt_send_layer(&g_S, 0, 1, l);
    PUMP_UNTIL(g_R.n_ended == 1 && g_S.n_ended == 1, 10000);
    cr_assert_eq(g_S.x[0].out.kind, DUET_XFER_OUTCOME_DONE, "%s", g_S.x[0].msg);
    cr_assert_eq(g_R.x[0].out.kind, DUET_XFER_OUTCOME_DONE, "%s", g_R.x[0].msg);
    cr_assert_not(duet_xfer_send_connecting(g_S.ctx, id), "an ended transfer");
    cr_assert_not(duet_xfer_send_connecting(g_S.ctx, id ^ 0x5a5a5a5aull), "an unknown id");
}

/* ---- replay rows: a running request moved between generation workers ------------------------ */

/* Both sides with replay pools of 5 rows per (slot, layer); each transfer moves 3 of them. */
static void setup_replay(void)
{
    xt_scn_t s = local_scn();
    s.rrows = 5;
    s.replay = 3;
    harness_scn("posix,sysv,cma,self", s);
}

TestSuite(transfer_replay, .init = setup_replay, .fini = teardown, .timeout = 30);

/* The pending rows arrive byte for byte (pattern-filled on the sender, every byte compared on the
 * receiver: rows 0..2 of each KDA layer of the slot hold the sender's, rows 3..4 still hold the
 * receiver's background), and both sides count them: tokens x MLA layers x token bytes + the KDA
 * slot + KDA layers x 3 rows of (6 H K + H) fp32, computed here from the scenario. */
Test(transfer_replay, replay_rows_moved_byte_for_byte)
{
    transfer_0_done();
    cr_assert_eq(g_R.x[0].bad, 0, "%llu bytes differ", (unsigned long long)g_R.x[0].bad);
    cr_assert(g_R.x[0].out.has_checksum);
    cr_assert_eq(g_R.x[0].out.checksum, g_S.x[0].out.checksum);
    const uint64_t H = g_s.heads, K = g_s.hd, W = g_s.conv;
    const uint64_t kv = (uint64_t)g_s.tokens * g_s.mla * g_s.tb;
    const uint64_t kda = g_s.kda * (H * K * K + 3 * H * K * (W - 1)) * 4;
    const uint64_t replay = (uint64_t)g_s.kda * 3 * (6 * H * K + H) * 4;
    cr_assert_eq(g_R.x[0].out.bytes, kv + kda + replay, "receiver counted %llu, want %llu",
                 (unsigned long long)g_R.x[0].out.bytes, (unsigned long long)(kv + kda + replay));
    cr_assert_eq(g_S.x[0].out.bytes, kv + kda + replay);
    /* a second transfer into another slot: its rows are its own pattern, slot 0 unchanged */
    duet_xfer_reservation_t res;
    reserve(1, &res);
    cr_assert_eq(res.n_replay, 3u);
    cr_assert_gt(res.replay_rkey.len, 0);
    cr_assert_eq(xt_send_start(&g_S, 1, &res), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_free(&res);
    for (uint32_t l = 0; l <= g_s.mla; l++)
        xt_send_layer(&g_S, 1, 2, l);
    PUMP_UNTIL(g_R.n_ended == 2 && g_S.n_ended == 2, 10000);
    cr_assert_eq(g_R.x[1].out.kind, DUET_XFER_OUTCOME_DONE, "%s", g_R.x[1].msg);
    cr_assert_eq(g_R.x[1].bad, 0);
    cr_assert_eq(xt_verify_replay(&g_s, g_s.seed + 0, g_R.rp_view, g_R.x[0].slot, 0xee), 0);
}

/* The receiver expects 3 rows; a sender that sends 2 (its reservation altered to match) is
 * refused by XferDone's byte count, and the pages come back. */
Test(transfer_replay, receiver_expecting_other_rows_refuses)
{
    duet_xfer_reservation_t res;
    reserve(0, &res);
    res.n_replay = 2;
    g_S.s.replay = 2;
    cr_assert_eq(xt_send_start(&g_S, 0, &res), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_free(&res);
    for (uint32_t l = 0; l <= g_s.mla; l++)
        xt_send_layer(&g_S, 0, 1, l);
    PUMP_UNTIL(g_R.n_ended == 1 && g_S.n_ended == 1, 10000);
    cr_assert_eq(g_R.x[0].out.kind, DUET_XFER_OUTCOME_ABORTED);
    cr_assert_eq(g_R.x[0].out.reason, DUET_XFER_REASON_REFUSED, "%s", g_R.x[0].msg);
    const uint64_t row = (6ull * g_s.heads * g_s.hd + g_s.heads) * 4;
    char want[160];
    snprintf(want, sizeof(want), "sender reported %llu bytes, the reservation expects %llu",
             (unsigned long long)(g_S.x[0].out.bytes),
             (unsigned long long)(g_S.x[0].out.bytes + g_s.kda * row));
    cr_assert(strstr(g_R.x[0].msg, want) != NULL, "\"%s\" lacks \"%s\"", g_R.x[0].msg, want);
    cr_assert_eq(g_R.pool.n_free, g_R.pool.n);
}

/* The sender checks the reservation's n_replay against its own before anything moves. */
Test(transfer_replay, sender_refuses_other_rows)
{
    duet_xfer_reservation_t res, r;
    reserve(0, &res);
    r = res;
    r.n_replay = 3;
    static int32_t src_pages[64];
    for (int i = 0; i < 64; i++)
        src_pages[i] = i;
    duet_xfer_send_args_t a = {
        .reservations = &r,
        .n_ranks = 1,
        .layout = xt_layout(&g_s, true),
        .src = {.pages = src_pages,
                .n_pages = 64,
                .kda_slot = 0,
                .n_tokens = g_s.tokens,
                .n_replay = 2},
        .cb = count_cb,
    };
    duet_xfer_id_t id;
    cr_assert_eq(duet_xfer_send_start(g_S.ctx, &a, &id), DUET_ERR_INVALID);
    cr_assert(strstr(duet_error_last(), "reserved for 3 replay rows, the source has 2") != NULL,
              "%s", duet_error_last());
    /* a replay region that no longer holds the slot's rows */
    a.src.n_replay = 3;
    r.replay_bytes = 16;
    cr_assert_eq(duet_xfer_send_start(g_S.ctx, &a, &id), DUET_ERR_RANGE);
    cr_assert(strstr(duet_error_last(), "replay_bytes") != NULL, "%s", duet_error_last());
    /* no replay rkey */
    r = res;
    r.replay_rkey.len = 0;
    cr_assert_eq(duet_xfer_send_start(g_S.ctx, &a, &id), DUET_ERR_FORMAT);
    cr_assert(strstr(duet_error_last(), "replay_rkey") != NULL, "%s", duet_error_last());
    cr_assert_eq(duet_xfer_ctx_active(g_S.ctx, DUET_XFER_ROLE_SEND), 0);
    cr_assert_eq(g_cb_calls, 0);
    duet_xfer_reservation_free(&res);
}

/* Reserving rows the pools cannot take is refused; without rows the reservation carries no
 * replay fields (what a context worker sends, and a reservation from before them). */
Test(transfer_replay, reserve_refusals)
{
    int32_t pages[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    duet_xfer_recv_args_t a = {
        .layout = xt_layout(&g_s, false),
        .pages = pages,
        .n_pages = 8,
        .kda_slot = 0,
        .n_tokens = g_s.tokens,
        .n_replay = 3,
        .group_size = 1,
        .deadline_unix_ms = duet_xfer_now_unix_ms() + 1000,
        .cb = count_cb,
    };
    duet_xfer_reservation_t res;
    duet_xfer_recv_args_t b = a;
    b.n_replay = 6; /* 5 rows per (slot, layer) */
    cr_assert_eq(duet_xfer_recv_reserve(g_R.ctx, &b, &res), DUET_ERR_RANGE);
    cr_assert(strstr(duet_error_last(), "replay") != NULL, "%s", duet_error_last());
    b = a;
    b.kda_slot = (int32_t)g_s.count; /* the replay pool holds count slots */
    cr_assert_neq(duet_xfer_recv_reserve(g_R.ctx, &b, &res), DUET_OK);
    b = a;
    b.kda_slot = -1;
    cr_assert_eq(duet_xfer_recv_reserve(g_R.ctx, &b, &res), DUET_ERR_INVALID);
    cr_assert(strstr(duet_error_last(), "no KDA slot") != NULL, "%s", duet_error_last());
    b = a;
    b.n_replay = 0;
    cr_assert_eq(duet_xfer_recv_reserve(g_R.ctx, &b, &res), DUET_OK, "%s", duet_error_last());
    cr_assert(res.n_replay == 0 && res.replay_rkey.len == 0 && res.replay_base == 0 &&
              res.replay_bytes == 0);
    cr_assert_eq(duet_xfer_recv_reserve(g_R.ctx, &a, &res), DUET_OK, "%s", duet_error_last());
    cr_assert(res.n_replay == 3 && res.replay_rkey.len > 0 && res.replay_bytes == g_R.rp_bytes);
    cr_assert_eq(g_cb_calls, 0);
}

/* A receiver without a replay pool cannot take replay rows. */
Test(transfer_local, reserve_replay_without_a_replay_pool)
{
    int32_t pages[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    duet_xfer_layout_t l = xt_layout(&g_s, false);
    l.replay_rows = 5;
    duet_xfer_recv_args_t a = {
        .layout = l,
        .pages = pages,
        .n_pages = 8,
        .kda_slot = 0,
        .n_tokens = g_s.tokens,
        .n_replay = 2,
        .group_size = 1,
        .deadline_unix_ms = duet_xfer_now_unix_ms() + 1000,
        .cb = count_cb,
    };
    duet_xfer_reservation_t res;
    cr_assert_eq(duet_xfer_recv_reserve(g_R.ctx, &a, &res), DUET_ERR_INVALID);
    cr_assert(strstr(duet_error_last(), "no replay pool registered") != NULL, "%s",
              duet_error_last());
}

/* ---- a peer that no transport with error handling reaches ---------------------------------- */

/* The receiver runs without tcp, the sender with tcp and shared memory (UCX's own choice on one
 * host, as the cluster runs): the sender's endpoint to it cannot have error handling, as for a
 * receiver that is gone (its tcp listener refuses) while its shared memory is still mapped. */
static void setup_no_tcp_peer(void)
{
    setenv("UCX_NET_DEVICES", "lo", 1);
    g_s = local_scn();
    setenv("UCX_TLS", "posix,sysv,cma,self", 1);
    cr_assert_eq(xt_recv_init(&g_R, &g_s), DUET_OK, "%s", duet_error_last());
    setenv("UCX_TLS", "tcp,posix,sysv,cma,self", 1);
    cr_assert_eq(xt_send_init(&g_S, &g_s, 4, 4), DUET_OK, "%s", duet_error_last());
}

/*
 * The fallback to an endpoint without error handling is that endpoint's alone and it is closed
 * when its transfer ends: it once turned error handling off for every later endpoint and was
 * kept, so a context worker never noticed generation workers that died and kept their pools'
 * shared memory mapped (bench/soak: its RSS grew with every restarted generation worker).
 */
Test(transfer_peer_err, a_peer_without_error_handling_leaves_it_on_for_the_next,
     .init = setup_no_tcp_peer, .fini = teardown, .timeout = 30)
{
    transfer_0_done();
    cr_assert_not(g_S.ctx->no_peer_err, "one peer turned error handling off for every peer");
    PUMP_UNTIL(false, 100); /* the close completes */
    for (uint32_t i = 0; i < g_S.ctx->max_peers; i++)
        cr_assert(g_S.ctx->peers[i].state == DUET__PEER_FREE ||
                      g_S.ctx->peers[i].state == DUET__PEER_CLOSING,
                  "endpoint %u (state %d, no error handling %d) was kept", i,
                  (int)g_S.ctx->peers[i].state, (int)g_S.ctx->peers[i].no_err);
    /* a receiver with tcp: its endpoint has error handling again, and the transfer completes */
    xt_recv_t R2;
    cr_assert_eq(xt_recv_init(&R2, &g_s), DUET_OK, "%s", duet_error_last());
    static uint8_t buf[1 << 16];
    size_t len;
    duet_xfer_reservation_t res;
    cr_assert_eq(xt_recv_reserve(&R2, 1, buf, sizeof(buf), &len), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_xfer_reservation_decode(buf, len, 0, &res), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(xt_send_start(&g_S, 1, &res), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_free(&res);
    int in_use = 0;
    for (uint32_t i = 0; i < g_S.ctx->max_peers; i++)
        if (g_S.ctx->peers[i].refs > 0) {
            in_use++;
            cr_assert_not(g_S.ctx->peers[i].no_err, "the tcp receiver's endpoint");
        }
    cr_assert_eq(in_use, 1);
    for (uint32_t l = 0; l <= g_s.mla; l++)
        xt_send_layer(&g_S, 1, 2, l);
    uint64_t end = xt_now_ms() + 10000;
    while ((R2.n_ended < 1 || g_S.n_ended < 2) && xt_now_ms() < end) {
        duet_xfer_ctx_progress(g_S.ctx);
        duet_xfer_ctx_wait(R2.ctx, 1);
    }
    cr_assert_eq(g_S.x[1].out.kind, DUET_XFER_OUTCOME_DONE, "%s", g_S.x[1].msg);
    cr_assert_eq(R2.x[1].out.kind, DUET_XFER_OUTCOME_DONE, "%s", R2.x[1].msg);
    xt_recv_free(&R2);
}
