/*
 * The transfer runtime between real processes (transfer/xfer.h): this test process is one side,
 * duet-xfer-peer children are the others, and a pipe per child stands in for the router (it
 * carries the encoded Reservations one way and a report line back).
 *
 * Every transfer moves a deterministic pattern (tests/unit/test_transfer_util.h) into random
 * destination pages with a partial last page, several MLA layers and KDA state + conv windows;
 * the receiver verifies every byte against the pattern and the runtime verifies the sender's
 * XXH3 checksum. Receivers count their pages back into the pool after every outcome.
 */
#include <criterion/criterion.h>
#include <inttypes.h>

#include "tests/unit/test_transfer_util.h"

typedef struct {
    unsigned done, aborted, free_pages, n_pages;
    unsigned long long bad;
    char reasons[512];
} report_t;

static bool parse_report(const uint8_t *b, report_t *r)
{
    memset(r, 0, sizeof(*r));
    if (strncmp((const char *)b, "done=", 5) != 0)
        return false;
    sscanf((const char *)b, "done=%u aborted=%u bad=%llu free=%u/%u", &r->done, &r->aborted, &r->bad,
           &r->free_pages, &r->n_pages);
    const char *rs = strstr((const char *)b, "reasons=");
    if (rs != NULL)
        snprintf(r->reasons, sizeof(r->reasons), "%s", rs + 8);
    return true;
}

static void use_transport(const char *tls)
{
    setenv("UCX_TLS", tls, 1);
    setenv("UCX_NET_DEVICES", "lo", 1);
    setenv("UCX_KEEPALIVE_INTERVAL", "200ms", 1);
}

/* Receive `n` reservations from a receiver child, decoded into res[k * stride + rank]. */
static void read_reservations(xt_child_t *c, duet_xfer_reservation_t *res, uint32_t n,
                              uint32_t stride, uint32_t rank, duet_xfer_ctx_t *progress)
{
    for (uint32_t k = 0; k < n; k++) {
        uint32_t len;
        uint8_t *b = xt_frame_read(c->from, &len, xt_now_ms() + 20000, progress);
        cr_assert_not_null(b, "no reservation %u from the receiver (rank %u)", k, rank);
        duet_status_t st = duet_xfer_reservation_decode(b, len, 0, &res[k * stride + rank]);
        cr_assert_eq(st, DUET_OK, "decode: %s", duet_error_last());
        free(b);
    }
}

static report_t read_report(xt_child_t *c, duet_xfer_ctx_t *progress)
{
    uint32_t len;
    uint8_t *b = xt_frame_read(c->from, &len, xt_now_ms() + 30000, progress);
    if (b == NULL) {
        int st = xt_reap(c, 1000);
        cr_assert_fail("no report from the peer (exit status %d, signal %d)",
                       WIFEXITED(st) ? WEXITSTATUS(st) : -1, WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    }
    report_t r;
    cr_assert(parse_report(b, &r), "bad report: %s", b);
    free(b);
    return r;
}

/* Sender here, `group` receiver children (one rank each), `count` transfers. */
static void send_to_children(const char *tls, xt_scn_t s)
{
    use_transport(tls);
    xt_child_t c[DUET_XFER_MAX_RANKS];
    for (uint32_t r = 0; r < s.group; r++) {
        xt_scn_t rs = s;
        rs.rank = r;
        cr_assert(xt_spawn(&c[r], DUET_XFER_PEER, "recv", &rs));
    }
    xt_send_t S;
    cr_assert_eq(xt_send_init(&S, &s, s.count, s.count), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_t *res = calloc((size_t)s.count * s.group, sizeof(*res));
    for (uint32_t r = 0; r < s.group; r++)
        read_reservations(&c[r], res, s.count, s.group, r, NULL);
    for (uint32_t k = 0; k < s.count; k++)
        cr_assert_eq(xt_send_start(&S, k, &res[k * s.group]), DUET_OK, "start %u: %s", k,
                     duet_error_last());
    for (uint32_t i = 0; i < (size_t)s.count * s.group; i++)
        duet_xfer_reservation_free(&res[i]);
    free(res);
    /* Layer-wise: every transfer gets layer 0, then layer 1, ..., then the KDA state. */
    for (uint32_t l = 0; l <= s.mla; l++)
        xt_send_layer(&S, 0, s.count, l);
    cr_assert(xt_send_run(&S, s.count, 30000), "only %u of %u transfers ended", S.n_ended,
              s.count);
    for (uint32_t k = 0; k < s.count; k++)
        cr_assert_eq(S.x[k].out.kind, DUET_XFER_OUTCOME_DONE, "transfer %u: %s: %s", k,
                     duet_xfer_reason_str(S.x[k].out.reason), S.x[k].msg);
    cr_assert_eq(S.pool.n_free, S.pool.n, "sender pages leaked");
    cr_assert_eq(duet_xfer_ctx_active(S.ctx, DUET_XFER_ROLE_SEND), 0);
    for (uint32_t r = 0; r < s.group; r++) {
        report_t rep = read_report(&c[r], S.ctx);
        cr_assert_eq(rep.done, s.count, "rank %u: %u done, %u aborted (%s)", r, rep.done,
                     rep.aborted, rep.reasons);
        cr_assert_eq(rep.bad, 0, "rank %u: %llu words differ from the pattern", r, rep.bad);
        cr_assert_eq(rep.free_pages, rep.n_pages, "rank %u: pages leaked", r);
        int st = xt_reap(&c[r], 10000);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank %u exit status %d", r, st);
    }
    xt_send_free(&S);
}

Test(transfer_procs, shm_two_processes_random_pages, .timeout = 60)
{
    xt_scn_t s = xt_scn_default();
    s.tokens = 1000; /* 63 source pages of 16, 32 destination pages of 32, last one partial */
    s.mla = 4;
    send_to_children("posix,sysv,cma,self", s);
}

Test(transfer_procs, shm_bigger_source_pages, .timeout = 60)
{
    xt_scn_t s = xt_scn_default();
    s.tokens = 777;
    s.src_pt = 64;
    s.dst_pt = 16;
    s.tb = 576;
    send_to_children("posix,sysv,cma,self", s);
}

Test(transfer_procs, tcp_two_processes_random_pages, .timeout = 60)
{
    xt_scn_t s = xt_scn_default();
    s.tokens = 1000;
    s.mla = 4;
    send_to_children("tcp,self", s);
}

Test(transfer_procs, cp_group_one_sender_four_receivers, .timeout = 60)
{
    xt_scn_t s = xt_scn_default();
    s.tokens = 1234;
    s.group = 4;
    s.heads = 8; /* 2 KDA heads per rank */
    send_to_children("posix,sysv,cma,self", s);
}

Test(transfer_procs, hundred_concurrent_transfers, .timeout = 90)
{
    xt_scn_t s = xt_scn_default();
    s.count = 100;
    s.tokens = 300;
    send_to_children("posix,sysv,cma,self", s);
}
