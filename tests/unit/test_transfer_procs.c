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
    sscanf((const char *)b, "done=%u aborted=%u bad=%llu free=%u/%u", &r->done, &r->aborted,
           &r->bad, &r->free_pages, &r->n_pages);
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
    cr_assert(xt_send_run(&S, s.count, 30000), "only %u of %u transfers ended", S.n_ended, s.count);
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

/* Running requests moved between two generation workers' processes: KV, KDA state and 5 pending
 * replay rows per KDA layer (of replay pools of 5 rows per slot and layer), over tcp and shm, the
 * receiver checking every row byte against the pattern. */
Test(transfer_procs, moved_requests_with_replay_rows, .timeout = 60)
{
    xt_scn_t s = xt_scn_default();
    s.count = 3;
    s.rrows = 5;
    s.replay = 5;
    send_to_children("tcp,self", s);
    s.alloc = 1; /* receive pools from UCX, as a generation worker's */
    send_to_children("posix,sysv,cma,self", s);
}

Test(transfer_procs, shm_bigger_source_pages, .timeout = 60)
{
    xt_scn_t s = xt_scn_default();
    s.tokens = 777;
    s.src_pt = 64;
    s.dst_pt = 16;
    s.tb = 576;
    s.alloc = 1; /* receiver pools allocated by UCX (the fast shared-memory path) */
    send_to_children("posix,sysv,cma,self", s);
}

Test(transfer_procs, tcp_two_processes_random_pages, .timeout = 60)
{
    xt_scn_t s = xt_scn_default();
    s.tokens = 1000;
    s.mla = 4;
    s.alloc = 1;
    send_to_children("tcp,self", s);
}

Test(transfer_procs, cp_group_one_sender_four_receivers, .timeout = 60)
{
    xt_scn_t s = xt_scn_default();
    s.tokens = 1234;
    s.group = 4;
    s.heads = 8; /* 2 KDA heads per rank */
    s.alloc = 1;
    send_to_children("posix,sysv,cma,self", s);
}

/* Helix groups whose tp ranks share the KV pages: tp 2 (kv_ranks 1: both ranks get every page)
 * and cp 2 x tp 2 (pages of c to ranks 2c and 2c + 1); each receiver checks every byte of its
 * pages and its KDA heads against the pattern, and the byte count its reservation expects. */
Test(transfer_procs, helix_tp_ranks_share_kv_pages, .timeout = 60)
{
    xt_scn_t s = xt_scn_default();
    s.tokens = 1234;
    s.group = 2;
    s.kvr = 1;
    s.alloc = 1;
    send_to_children("posix,sysv,cma,self", s);
    s.group = 4;
    s.kvr = 2;
    s.heads = 8;
    send_to_children("posix,sysv,cma,self", s);
}

Test(transfer_procs, hundred_concurrent_transfers, .timeout = 90)
{
    xt_scn_t s = xt_scn_default();
    s.count = 100;
    s.tokens = 300;
    send_to_children("posix,sysv,cma,self", s);
}

/* --- faults ------------------------------------------------------------------------------- */

/* Receiver here; the sender child puts one layer, says "stalled", and is killed with -9. */
static void kill_sender(const char *tls)
{
    use_transport(tls);
    xt_scn_t s = xt_scn_default();
    s.tokens = 2000;
    s.stall_after = 1;
    s.deadline_ms = 2500;
    xt_recv_t R;
    cr_assert_eq(xt_recv_init(&R, &s), DUET_OK, "%s", duet_error_last());
    static uint8_t buf[1 << 16];
    size_t len;
    uint64_t t_reserve = xt_now_ms();
    cr_assert_eq(xt_recv_reserve(&R, 0, buf, sizeof(buf), &len), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(R.pool.n_free, R.pool.n - R.x[0].n_pages);
    xt_child_t c;
    cr_assert(xt_spawn(&c, DUET_XFER_PEER, "send", &s));
    cr_assert(xt_frame_write(c.to, buf, (uint32_t)len));
    uint32_t n;
    uint8_t *b = xt_frame_read(c.from, &n, xt_now_ms() + 20000, R.ctx);
    cr_assert_not_null(b, "the sender never stalled");
    cr_assert_str_eq((char *)b, "stalled");
    free(b);
    kill(c.pid, SIGKILL);
    xt_reap(&c, 5000);
    cr_assert(xt_recv_run(&R, 1, s.deadline_ms + 3000), "no outcome after the sender died");
    uint64_t took = xt_now_ms() - t_reserve;
    const duet_xfer_outcome_t *o = &R.x[0].out;
    cr_assert_eq(o->kind, DUET_XFER_OUTCOME_ABORTED);
    cr_assert(o->reason == DUET_XFER_REASON_PEER_FAILED || o->reason == DUET_XFER_REASON_DEADLINE,
              "reason %s (%s)", duet_xfer_reason_str(o->reason), R.x[0].msg);
    cr_assert_leq(took, s.deadline_ms + 500, "outcome %llu ms after the reservation",
                  (unsigned long long)took);
    cr_assert_eq(R.pool.n_free, R.pool.n, "%u of %u pages back", R.pool.n_free, R.pool.n);
    cr_assert_eq(duet_xfer_ctx_active(R.ctx, DUET_XFER_ROLE_RECV), 0);
    xt_recv_free(&R);
}

Test(transfer_procs, kill_sender_shm_receiver_reclaims_pages, .timeout = 30)
{
    kill_sender("posix,sysv,cma,self");
}

Test(transfer_procs, kill_sender_tcp_receiver_reclaims_pages, .timeout = 30)
{
    kill_sender("tcp,self");
}

/* Sender here; receiver A is killed with -9 mid-transfer, then receiver B gets a full transfer. */
static void kill_receiver(const char *tls)
{
    use_transport(tls);
    xt_scn_t s = xt_scn_default();
    s.tokens = 2000;
    s.deadline_ms = 3000;
    xt_send_t S;
    cr_assert_eq(xt_send_init(&S, &s, 2, 2), DUET_OK, "%s", duet_error_last());
    xt_child_t a, b;
    cr_assert(xt_spawn(&a, DUET_XFER_PEER, "recv", &s));
    duet_xfer_reservation_t res;
    read_reservations(&a, &res, 1, 1, 0, NULL);
    cr_assert_eq(xt_send_start(&S, 0, &res), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_free(&res);
    xt_send_layer(&S, 0, 1, 0);
    uint64_t end = xt_now_ms() + 50;
    while (xt_now_ms() < end)
        duet_xfer_ctx_wait(S.ctx, 5);
    kill(a.pid, SIGKILL);
    xt_reap(&a, 5000);
    uint64_t t_kill = xt_now_ms();
    for (uint32_t l = 1; l <= s.mla; l++)
        xt_send_layer(&S, 0, 1, l);
    cr_assert(xt_send_run(&S, 1, 15000), "the sender never gave up on the dead receiver");
    cr_assert_eq(S.x[0].out.kind, DUET_XFER_OUTCOME_ABORTED, "transfer to a dead receiver: DONE?");
    cr_log_info("dead receiver over %s: %s after %llu ms (%s)", tls,
                duet_xfer_reason_str(S.x[0].out.reason), (unsigned long long)(xt_now_ms() - t_kill),
                S.x[0].msg);
    cr_assert_eq(duet_xfer_ctx_active(S.ctx, DUET_XFER_ROLE_SEND), 0);
    cr_assert_eq(S.pool.n_free, S.pool.n, "sender pages not returned");
    cr_assert_eq(duet_xfer_send_layer_ready(S.ctx, S.x[0].id, 0), DUET_ERR_NOT_FOUND);

    /* The same sender keeps serving: a full transfer to a live receiver. */
    xt_scn_t sb = s;
    sb.seed = s.seed + 1; /* the sender fills transfer k with seed + k */
    cr_assert(xt_spawn(&b, DUET_XFER_PEER, "recv", &sb));
    read_reservations(&b, &res, 1, 1, 0, S.ctx);
    cr_assert_eq(xt_send_start(&S, 1, &res), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_free(&res);
    for (uint32_t l = 0; l <= s.mla; l++)
        xt_send_layer(&S, 1, 2, l);
    cr_assert(xt_send_run(&S, 2, 15000));
    cr_assert_eq(S.x[1].out.kind, DUET_XFER_OUTCOME_DONE, "%s", S.x[1].msg);
    report_t rep = read_report(&b, S.ctx);
    cr_assert_eq(rep.done, 1);
    cr_assert_eq(rep.bad, 0);
    cr_assert_eq(rep.free_pages, rep.n_pages);
    xt_reap(&b, 10000);
    xt_send_free(&S);
}

Test(transfer_procs, kill_receiver_shm_sender_aborts_and_serves_on, .timeout = 40)
{
    kill_receiver("posix,sysv,cma,self");
}

Test(transfer_procs, kill_receiver_tcp_sender_aborts_and_serves_on, .timeout = 40)
{
    kill_receiver("tcp,self");
}
