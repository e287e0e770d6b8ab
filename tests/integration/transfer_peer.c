/*
 * duet-xfer-peer: the other process of the transfer runtime's tests (built for tests only).
 *
 *   duet-xfer-peer recv key=value...  reserve `count` transfers, write each encoded Reservation
 *                                     as a frame on stdout (the router pipe), wait for every
 *                                     outcome, verify DONE bytes against the pattern, return
 *                                     every page, and write one report frame:
 *                                     "done=D aborted=A bad=B free=F/N reasons=r1,r2,..."
 *   duet-xfer-peer send key=value...  read count x group Reservation frames from stdin, stream
 *                                     the layers, report "done=D aborted=A reasons=...". With
 *                                     stall_after=L it stops after L MLA layers, writes "stalled"
 *                                     and hangs (to be killed with -9).
 *
 * The scenario keys are those of tests/unit/test_transfer_util.h. A 120 s alarm makes sure a
 * peer that lost its partner never outlives the test.
 */
#include "common/version.h"
#include "tests/unit/test_transfer_util.h"

/* Our end of the router pipe: the original stdout. fd 1 itself is pointed at stderr, because
 * UCX writes its log lines to stdout and they must not land in the pipe. */
static int g_router = 1;

static void report_reasons(char *buf, size_t cap, const duet_xfer_outcome_t *outs, size_t stride,
                           const bool *ended, size_t n)
{
    size_t at = 0;
    buf[0] = 0;
    for (size_t i = 0; i < n; i++) {
        const duet_xfer_outcome_t *o =
            (const duet_xfer_outcome_t *)((const char *)outs + i * stride);
        const bool *e = (const bool *)((const char *)ended + i * stride);
        if (!*e || o->kind == DUET_XFER_OUTCOME_DONE)
            continue;
        at += (size_t)snprintf(buf + at, at < cap ? cap - at : 0, "%s%s", at ? "," : "",
                               duet_xfer_reason_str(o->reason));
        if (at >= cap)
            break;
    }
}

static int run_recv(const xt_scn_t *s)
{
    xt_recv_t R;
    if (xt_recv_init(&R, s) < 0) {
        fprintf(stderr, "peer recv: init: %s\n", duet_error_last());
        return 2;
    }
    static uint8_t buf[1 << 20];
    for (uint32_t k = 0; k < s->count; k++) {
        size_t len;
        if (xt_recv_reserve(&R, k, buf, sizeof(buf), &len) < 0) {
            fprintf(stderr, "peer recv: reserve %u: %s\n", k, duet_error_last());
            return 2;
        }
        if (!xt_frame_write(g_router, buf, (uint32_t)len))
            return 3;
    }
    xt_recv_run(&R, s->count, s->deadline_ms + 10000);
    char reasons[4096];
    report_reasons(reasons, sizeof(reasons), &R.x[0].out, sizeof(R.x[0]), &R.x[0].ended, s->count);
    char msg[8192];
    int n =
        snprintf(msg, sizeof(msg), "done=%u aborted=%u bad=%llu free=%u/%u reasons=%s", R.n_done,
                 R.n_aborted, (unsigned long long)R.bad, R.pool.n_free, R.pool.n, reasons);
    xt_frame_write(g_router, msg, (uint32_t)n);
    xt_recv_free(&R);
    return 0;
}

static int run_send(const xt_scn_t *s)
{
    xt_send_t S;
    if (xt_send_init(&S, s, s->count, s->count) < 0) {
        fprintf(stderr, "peer send: init: %s\n", duet_error_last());
        return 2;
    }
    uint32_t n = s->count * s->group;
    duet_xfer_reservation_t *res = calloc(n, sizeof(*res));
    for (uint32_t i = 0; i < n; i++) {
        uint32_t len;
        uint8_t *b = xt_frame_read(0, &len, xt_now_ms() + 30000, NULL);
        if (b == NULL || duet_xfer_reservation_decode(b, len, 0, &res[i]) < 0) {
            fprintf(stderr, "peer send: reservation %u: %s\n", i, duet_error_last());
            return 2;
        }
        free(b);
    }
    for (uint32_t k = 0; k < s->count; k++)
        if (xt_send_start(&S, k, &res[k * s->group]) < 0) {
            fprintf(stderr, "peer send: start %u: %s\n", k, duet_error_last());
            return 2;
        }
    for (uint32_t l = 0; l <= s->mla; l++) {
        if (s->stall_after >= 0 && l == (uint32_t)s->stall_after) {
            uint64_t end = xt_now_ms() + 100;
            while (xt_now_ms() < end)
                duet_xfer_ctx_wait(S.ctx, 5);
            xt_frame_write(g_router, "stalled", 7);
            for (;;)
                pause(); /* killed here */
        }
        xt_send_layer(&S, 0, s->count, l);
    }
    xt_send_run(&S, s->count, s->deadline_ms + 10000);
    char reasons[4096];
    report_reasons(reasons, sizeof(reasons), &S.x[0].out, sizeof(S.x[0]), &S.x[0].ended, s->count);
    char msg[8192];
    int m =
        snprintf(msg, sizeof(msg), "done=%u aborted=%u reasons=%s", S.n_done, S.n_aborted, reasons);
    xt_frame_write(g_router, msg, (uint32_t)m);
    for (uint32_t i = 0; i < n; i++)
        duet_xfer_reservation_free(&res[i]);
    free(res);
    xt_send_free(&S);
    return 0;
}

int main(int argc, char **argv)
{
    alarm(120);
    g_router = dup(1);
    dup2(2, 1);
    signal(SIGPIPE, SIG_IGN);
    xt_scn_t s = xt_scn_default();
    if (argc >= 2 && duet_version_flag(argv[1])) {
        dprintf(g_router, "duet-xfer-peer %s\n", duet_version_string()); /* stdout is fd 2 now */
        return 0;
    }
    if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        dprintf(g_router, "usage: duet-xfer-peer recv|send key=value...\n"
                          "The other process of the transfer runtime's tests (tests only): recv\n"
                          "reserves transfers and reports their outcomes, send streams the\n"
                          "layers into them; frames go over stdin / stdout. The keys are the\n"
                          "scenario's (tests/unit/test_transfer_util.h).\n");
        return 0;
    }
    if (argc < 2 || !xt_scn_parse(&s, argc - 2, argv + 2)) {
        fprintf(stderr, "usage: duet-xfer-peer recv|send key=value...\n");
        return 64;
    }
    if (strcmp(argv[1], "recv") == 0)
        return run_recv(&s);
    if (strcmp(argv[1], "send") == 0)
        return run_send(&s);
    fprintf(stderr, "duet-xfer-peer: unknown role %s\n", argv[1]);
    return 64;
}
