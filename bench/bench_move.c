/*
 * duet-bench-move: the time to move a running request between two generation workers on the CPU
 * (issue 37): its KV pages, its KDA state and its pending KDA replay rows, through the real
 * transfer layer (transfer/xfer.h) from one process to another, against memcpy of the same bytes.
 *
 * For each transport (shared memory, tcp on loopback; UCX_TLS as duet-bench-xfer sets them) the
 * benchmark forks a receiver process, a pipe pair standing in for the router
 * (tests/unit/test_transfer_util.h's frames), and both processes load the same model as a
 * generation worker loads it: pools from UCX (duet_worker_pool_alloc, the replay pool too), the
 * layout from duet_worker_layout, spec_rows 5. The sender holds a sequence of `context` tokens
 * right after a verify of k = 4 drafts whose k + 1 = 5 rows were all accepted: KV pages, KDA slot
 * and 5 rows per KDA layer not yet folded in (duet_model_seq_set_received over a byte pattern; no
 * prefill: a move copies bytes whatever their values). Each run: the receiver opens a fresh
 * sequence and reserves it (Reservation with n_replay 5), the sender fills the bytes the plan
 * moves with that run's pattern, then times duet_xfer_send_start, every layer ready at once,
 * until its DONE (puts flushed, XferDone sent); the receiver stamps its own DONE (byte count
 * checked) on the same monotonic clock, checks every moved byte against the pattern through the
 * plan, and takes the sequence over (duet_model_seq_set_received, 5 rows). The reference, timed in
 * the same run by the sender: memcpy of the same source ranges (the plan's entries) into a warm
 * buffer; and, beside it, memcpy of pieces of the same sizes from a warm private buffer, because
 * memcpy reads the pools (UCX-allocated shared-memory segments) markedly more slowly than
 * anonymous memory on the machine of bench/RESULTS.md.
 *
 * Models: the demo model (models/duet-demo) and one with Kimi-Linear-48B's cache dimensions
 * (bench/configs/kimi-linear-48b; bench/cache_bench.h). Medians of --reps runs.
 *
 *   duet-bench-move [--quick] [--reps N] [--contexts 1024,8192,32768] [--transport shm|tcp|both]
 *                   [--demo DIR] [--big DIR]
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/cache_bench.h"
#include "common/log.h"
#include "common/version.h"
#include "engine/cache.h"
#include "engine/model.h"
#include "tests/unit/test_transfer_util.h"
#include "transfer/plan.h"
#include "transfer/xfer.h"
#include "worker/worker.h"

#define PROG     "duet-bench-move"
#define N_REPLAY 5         /* k + 1 rows of a verify of k = 4 drafts, all accepted */
#define WAIT_MS  120000ull /* any one exchange on the pipe */
#define DEADLINE 120000ull /* reservations */
#define MIB      1048576.0

static const char *g_dirs[2]; /* model folders: the demo model, the small 48B-cache model */

/* The u32 at byte offset `off` of pool `kind` (plan entry kind) of the run with seed `seed`: every
 * word of every pool differs, and from one run to the next, so stale bytes show up. */
static inline uint32_t pattern(uint32_t kind, uint64_t off, uint32_t seed)
{
    return (uint32_t)(off >> 2) * 2654435761u ^ (kind + 1) * 0x9e3779b9u ^ seed * 0x85ebca6bu;
}

/* A generation worker's model and transfer context. */
typedef struct {
    duet_xfer_ctx_t *x;
    duet_model_t *m;
    duet_xfer_layout_t layout;
    uint8_t *base[DUET_XFER_N_POOLS]; /* the pools, by plan entry kind */
} side_t;

/* The model options of both sides: one sequence of up to max_ctx tokens, speculation of k = 4. */
static void model_opts(duet_model_opts_t *o, int64_t max_ctx)
{
    duet_model_opts_default(o);
    o->n_threads = 1; /* the forward pass never runs */
    o->max_seqs = 1;
    o->max_seq_len = max_ctx;
    o->max_batch_tokens = 16;
    o->spec_rows = N_REPLAY;
}

static int side_load(side_t *s, const char *dir, int64_t max_ctx)
{
    memset(s, 0, sizeof(*s));
    duet_xfer_ctx_opts_t xo;
    duet_xfer_ctx_opts_default(&xo);
    if (duet_xfer_ctx_create(&xo, &s->x) != DUET_OK) {
        fprintf(stderr, PROG ": UCX: %s\n", duet_error_last());
        return -1;
    }
    duet_model_opts_t o;
    model_opts(&o, max_ctx);
    o.pool_alloc = duet_worker_pool_alloc;
    o.pool_alloc_user = s->x;
    if (duet_model_load(dir, &o, &s->m) != DUET_OK) {
        fprintf(stderr, PROG ": %s: %s\n", dir, duet_error_last());
        return -1;
    }
    duet_worker_layout(s->m, &s->layout);
    s->base[DUET_XFER_SEG_KV] = duet_kv_pool_base(duet_model_kv_pool(s->m));
    s->base[DUET_XFER_SEG_KDA] = duet_kda_pool_base(duet_model_kda_pool(s->m));
    s->base[DUET_XFER_SEG_REPLAY] = duet_replay_pool_base(duet_model_replay_pool(s->m));
    return 0;
}

static void side_free(side_t *s)
{
    duet_model_free(s->m); /* its pools are the context's: the model goes first */
    duet_xfer_ctx_destroy(s->x);
    memset(s, 0, sizeof(*s));
}

/* What the sender tells the receiver before a run: the run's seed and context, and its layout,
 * slot and pages (so that the receiver can rebuild the plan and check every byte it got). */
typedef struct {
    uint32_t seed;
    uint32_t n_pages;
    int64_t n_tokens;
    int32_t kda_slot;
    duet_xfer_layout_t layout;
} run_req_t;

/* The sender's side of a transfer outcome. */
typedef struct {
    int ended;
    duet_xfer_outcome_kind_t kind;
    uint64_t bytes;
    double t_done;
    char msg[160];
} outcome_t;

static void on_outcome(const duet_xfer_outcome_t *o, void *user)
{
    outcome_t *r = user;
    r->t_done = cache_bench_now_s();
    r->ended = 1;
    r->kind = o->kind;
    r->bytes = o->bytes;
    snprintf(r->msg, sizeof(r->msg), "%s: %s", duet_xfer_reason_str(o->reason), o->message);
}

/* --- receiver process ------------------------------------------------------------------------ */

/* Words of the plan's destination ranges that differ from the sender's pattern. */
static uint64_t verify_moved(const side_t *s, const duet_xfer_plan_t *plan, uint32_t seed)
{
    uint64_t bad = 0;
    for (size_t i = 0; i < plan->n_entries; i++) {
        const duet_xfer_entry_t *e = &plan->entries[i];
        const uint32_t *d = (const uint32_t *)(s->base[e->kind] + e->dst_off);
        for (uint64_t w = 0; w < e->len / 4; w++)
            bad += d[w] != pattern(e->kind, e->src_off + 4 * w, seed);
    }
    return bad;
}

/* One run on the receiver: reserve, wait for the outcome, check, take the sequence over. */
static int recv_run(side_t *s, const uint8_t *msg, uint32_t len, int out)
{
    run_req_t rq;
    if (len < sizeof(rq))
        return -1;
    memcpy(&rq, msg, sizeof(rq));
    if (len != sizeof(rq) + rq.n_pages * sizeof(int32_t))
        return -1;
    int32_t *src_pages = malloc(sizeof(int32_t) * (rq.n_pages + 1));
    memcpy(src_pages, msg + sizeof(rq), sizeof(int32_t) * rq.n_pages);
    duet_seq_t b = {.id = -1};
    duet_xfer_plan_t plan = {0};
    outcome_t r = {0};
    char reply[256];
    int rc = -1;
    if (duet_model_seq_open(s->m, rq.n_tokens, &b) != DUET_OK)
        goto fail;
    duet_xfer_recv_args_t a = {.req_id = 1,
                               .layout = s->layout,
                               .pages = b.pages,
                               .n_pages = (uint32_t)b.n_pages,
                               .kda_slot = b.kda_slot,
                               .n_tokens = (uint64_t)rq.n_tokens,
                               .n_replay = N_REPLAY,
                               .group_size = 1,
                               .deadline_unix_ms = duet_xfer_now_unix_ms() + DEADLINE,
                               .cb = on_outcome,
                               .user = &r};
    duet_xfer_reservation_t res;
    static uint8_t buf[1 << 16];
    size_t n;
    if (duet_xfer_recv_reserve(s->x, &a, &res) != DUET_OK ||
        duet_xfer_reservation_encode(&res, buf, sizeof(buf), &n) != DUET_OK)
        goto fail;
    if (!xt_frame_write(out, buf, (uint32_t)n))
        goto done;
    const double end = cache_bench_now_s() + DEADLINE / 1000.0;
    while (!r.ended && cache_bench_now_s() < end)
        duet_xfer_ctx_progress(s->x);
    if (!r.ended || r.kind != DUET_XFER_OUTCOME_DONE) {
        snprintf(reply, sizeof(reply), "D 0 0 0 receiver: %s", r.ended ? r.msg : "no outcome");
        xt_frame_write(out, reply, (uint32_t)strlen(reply));
        goto done;
    }
    /* every moved byte, where the plan says it went */
    duet_xfer_src_t src = {.pages = src_pages,
                           .n_pages = rq.n_pages,
                           .kda_slot = rq.kda_slot,
                           .n_tokens = (uint64_t)rq.n_tokens,
                           .n_replay = N_REPLAY};
    duet_xfer_dest_t dst = {
        .pages = b.pages, .n_pages = (uint32_t)b.n_pages, .kda_slot = b.kda_slot};
    if (duet_xfer_plan_build(&rq.layout, &src, &s->layout, &dst, 1, 0, &plan) != DUET_OK)
        goto fail;
    const uint64_t bad = verify_moved(s, &plan, rq.seed);
    if (plan.total_bytes != r.bytes) {
        snprintf(reply, sizeof(reply), "D 0 0 0 receiver counted %llu bytes, the plan %llu",
                 (unsigned long long)r.bytes, (unsigned long long)plan.total_bytes);
        xt_frame_write(out, reply, (uint32_t)strlen(reply));
        goto done;
    }
    if (duet_model_seq_set_received(s->m, &b, rq.n_tokens, N_REPLAY) != DUET_OK ||
        b.n_replay != N_REPLAY)
        goto fail;
    snprintf(reply, sizeof(reply), "D %.9f %llu %llu ok", r.t_done, (unsigned long long)bad,
             (unsigned long long)r.bytes);
    xt_frame_write(out, reply, (uint32_t)strlen(reply));
    rc = 0;
    goto done;
fail:
    snprintf(reply, sizeof(reply), "D 0 0 0 receiver: %s", duet_error_last());
    xt_frame_write(out, reply, (uint32_t)strlen(reply));
done:
    if (b.id >= 0)
        duet_model_seq_close(s->m, &b);
    duet_xfer_plan_free(&plan);
    free(src_pages);
    return rc;
}

/* Commands on the pipe: "L <model> <max_ctx>" load (reply "ok" / an error), "R"+run_req_t+pages
 * one run, "Q" quit. */
static int run_receiver(int in, int out)
{
    side_t s = {0};
    int rc = 0;
    for (;;) {
        uint32_t n;
        uint8_t *cmd = xt_frame_read(in, &n, xt_now_ms() + 10 * WAIT_MS, s.x);
        if (cmd == NULL || cmd[0] == 'Q') {
            free(cmd);
            break;
        }
        if (cmd[0] == 'L') {
            unsigned which = 0;
            long long max_ctx = 0;
            sscanf((char *)cmd + 2, "%u %lld", &which, &max_ctx);
            if (s.m != NULL)
                side_free(&s);
            const char *ok = which < 2 && side_load(&s, g_dirs[which], max_ctx) == 0 ? "ok" : "err";
            xt_frame_write(out, ok, (uint32_t)strlen(ok));
        } else if (cmd[0] == 'R' && s.m != NULL) {
            if (recv_run(&s, cmd + 1, n - 1, out) != 0)
                rc = 1;
        } else {
            rc = 1;
        }
        free(cmd);
    }
    if (s.m != NULL)
        side_free(&s);
    return rc;
}

/* --- sender (this process) ------------------------------------------------------------------- */

typedef struct {
    xt_child_t c; /* the receiver (pid, pipe ends) */
    side_t s;
    uint8_t *scratch; /* the memcpy references' destination, warm */
    uint8_t *priv;    /* their private source (anonymous memory), warm */
    size_t scratch_bytes;
} sender_t;

static int send_cmd(sender_t *S, const char *what, char *reply, size_t cap)
{
    if (!xt_frame_write(S->c.to, what, (uint32_t)strlen(what)))
        return -1;
    uint32_t n;
    uint8_t *b = xt_frame_read(S->c.from, &n, xt_now_ms() + 10 * WAIT_MS, S->s.x);
    if (b == NULL)
        return -1;
    snprintf(reply, cap, "%s", (char *)b);
    free(b);
    return 0;
}

typedef struct {
    double send, recv, cpy, cpy_priv; /* seconds */
    uint64_t bytes;
    size_t puts;
} run_t;

/* One timed move of seq (see the file comment). */
static int send_run(sender_t *S, const duet_seq_t *seq, uint32_t seed, run_t *out)
{
    side_t *s = &S->s;
    size_t len = sizeof(run_req_t) + sizeof(int32_t) * (size_t)seq->n_pages;
    uint8_t *msg = malloc(1 + len);
    run_req_t rq = {.seed = seed,
                    .n_pages = (uint32_t)seq->n_pages,
                    .n_tokens = seq->n_tokens,
                    .kda_slot = seq->kda_slot,
                    .layout = s->layout};
    msg[0] = 'R';
    memcpy(msg + 1, &rq, sizeof(rq));
    memcpy(msg + 1 + sizeof(rq), seq->pages, sizeof(int32_t) * (size_t)seq->n_pages);
    duet_xfer_reservation_t res = {0};
    duet_xfer_plan_t plan = {0};
    int rc = -1;
    uint32_t n;
    uint8_t *b = NULL;
    if (!xt_frame_write(S->c.to, msg, (uint32_t)(1 + len)) ||
        (b = xt_frame_read(S->c.from, &n, xt_now_ms() + WAIT_MS, s->x)) == NULL) {
        fprintf(stderr, PROG ": no reservation from the receiver\n");
        goto done;
    }
    if (duet_xfer_reservation_decode(b, n, 0, &res) != DUET_OK) {
        fprintf(stderr, PROG ": reservation: %s (%.*s)\n", duet_error_last(), (int)n, (char *)b);
        goto done;
    }
    free(b);
    b = NULL;
    /* the plan, for this run's pattern and the reference copy (send_start builds its own) */
    const duet_xfer_src_t src = {.pages = seq->pages,
                                 .n_pages = (uint32_t)seq->n_pages,
                                 .kda_slot = seq->kda_slot,
                                 .n_tokens = (uint64_t)seq->n_tokens,
                                 .n_replay = (uint32_t)seq->n_replay};
    duet_xfer_dest_t dst;
    duet_xfer_reservation_dest(&res, &dst);
    if (duet_xfer_plan_build(&s->layout, &src, &res.layout, &dst, 1, 0, &plan) != DUET_OK) {
        fprintf(stderr, PROG ": plan: %s\n", duet_error_last());
        goto done;
    }
    for (size_t i = 0; i < plan.n_entries; i++) {
        const duet_xfer_entry_t *e = &plan.entries[i];
        uint32_t *w = (uint32_t *)(s->base[e->kind] + e->src_off);
        for (uint64_t k = 0; k < e->len / 4; k++)
            w[k] = pattern(e->kind, e->src_off + 4 * k, seed);
    }
    if (plan.total_bytes > S->scratch_bytes) {
        free(S->scratch);
        free(S->priv);
        S->scratch = malloc(plan.total_bytes);
        S->priv = malloc(plan.total_bytes);
        if (S->scratch == NULL || S->priv == NULL) {
            fprintf(stderr, PROG ": no memory for the memcpy buffers\n");
            S->scratch_bytes = 0;
            goto done;
        }
        S->scratch_bytes = plan.total_bytes;
        memset(S->scratch, 1, plan.total_bytes); /* warm: no first touch while timing */
        memset(S->priv, 2, plan.total_bytes);
    }

    outcome_t o = {0};
    duet_xfer_send_args_t a = {.req_id = 1,
                               .reservations = &res,
                               .n_ranks = 1,
                               .layout = s->layout,
                               .src = src,
                               .cb = on_outcome,
                               .user = &o};
    duet_xfer_id_t id;
    const double t0 = cache_bench_now_s();
    if (duet_xfer_send_start(s->x, &a, &id) != DUET_OK) {
        fprintf(stderr, PROG ": start: %s\n", duet_error_last());
        goto done;
    }
    for (uint32_t l = 0; l < s->layout.n_mla_layers; l++)
        duet_xfer_send_layer_ready(s->x, id, l);
    duet_xfer_send_kda_ready(s->x, id);
    while (!o.ended)
        duet_xfer_ctx_progress(s->x);
    const double t1 = o.t_done;
    if (o.kind != DUET_XFER_OUTCOME_DONE) {
        fprintf(stderr, PROG ": transfer aborted: %s\n", o.msg);
        goto done;
    }
    if ((b = xt_frame_read(S->c.from, &n, xt_now_ms() + WAIT_MS, s->x)) == NULL) {
        fprintf(stderr, PROG ": no report from the receiver\n");
        goto done;
    }
    double t_recv = 0;
    unsigned long long bad = 0, bytes = 0;
    char word[8] = "";
    if (sscanf((char *)b, "D %lf %llu %llu %7s", &t_recv, &bad, &bytes, word) != 4 ||
        strcmp(word, "ok") != 0 || bad != 0 || bytes != plan.total_bytes ||
        o.bytes != plan.total_bytes) {
        fprintf(stderr, PROG ": the receiver reports: %s (%llu words differ; sender %llu bytes)\n",
                (char *)b, bad, (unsigned long long)o.bytes);
        goto done;
    }
    /* the references: memcpy of the same source ranges, then of the same pieces from private
     * memory (the pools are UCX's shared-memory segments, which memcpy reads more slowly) */
    const double tm0 = cache_bench_now_s();
    uint64_t at = 0;
    for (size_t i = 0; i < plan.n_entries; i++) {
        const duet_xfer_entry_t *e = &plan.entries[i];
        memcpy(S->scratch + at, s->base[e->kind] + e->src_off, e->len);
        at += e->len;
    }
    const double tm1 = cache_bench_now_s();
    at = 0;
    for (size_t i = 0; i < plan.n_entries; i++) {
        memcpy(S->scratch + at, S->priv + at, plan.entries[i].len);
        at += plan.entries[i].len;
    }
    const double tm2 = cache_bench_now_s();
    *out = (run_t){.send = t1 - t0,
                   .recv = t_recv - t0,
                   .cpy = tm1 - tm0,
                   .cpy_priv = tm2 - tm1,
                   .bytes = plan.total_bytes,
                   .puts = plan.n_entries};
    rc = 0;
done:
    free(b);
    free(msg);
    duet_xfer_plan_free(&plan);
    duet_xfer_reservation_free(&res);
    return rc;
}

/* Every context of one model over one transport: the sender's sequence, `reps` runs, a row. */
static int bench_model(sender_t *S, int which, const char *label, const char *transport,
                       const int64_t *ctx, int n_ctx, int64_t max_ctx, int reps)
{
    char cmd[64], reply[256];
    snprintf(cmd, sizeof(cmd), "L %d %lld", which, (long long)max_ctx);
    if (side_load(&S->s, g_dirs[which], max_ctx) != 0)
        return -1;
    if (send_cmd(S, cmd, reply, sizeof(reply)) != 0 || strcmp(reply, "ok") != 0) {
        fprintf(stderr, PROG ": the receiver cannot load %s\n", g_dirs[which]);
        side_free(&S->s);
        return -1;
    }
    int rc = 0;
    for (int i = 0; i < n_ctx && rc == 0; i++) {
        duet_seq_t seq = {.id = -1};
        /* a sequence right after an accepted verify: ctx tokens, the last 5 still to replay */
        if (duet_model_seq_open(S->s.m, ctx[i], &seq) != DUET_OK ||
            duet_model_seq_set_received(S->s.m, &seq, ctx[i], N_REPLAY) != DUET_OK) {
            fprintf(stderr, PROG ": %s at %lld tokens: %s\n", label, (long long)ctx[i],
                    duet_error_last());
            rc = -1;
            break;
        }
        double ts[CACHE_BENCH_MAX_REPS], tr[CACHE_BENCH_MAX_REPS], tc[CACHE_BENCH_MAX_REPS],
            tp[CACHE_BENCH_MAX_REPS];
        run_t r = {0};
        for (int k = 0; k < reps && rc == 0; k++) {
            rc = send_run(S, &seq, (uint32_t)(1000 * i + k + 1), &r);
            ts[k] = r.send;
            tr[k] = r.recv;
            tc[k] = r.cpy;
            tp[k] = r.cpy_priv;
        }
        duet_model_seq_close(S->s.m, &seq);
        if (rc != 0)
            break;
        const double gb = (double)r.bytes / 1e9, send = cache_bench_median(ts, reps),
                     recv = cache_bench_median(tr, reps), cpy = cache_bench_median(tc, reps),
                     cpy_priv = cache_bench_median(tp, reps);
        printf("| %s | %lld | %s | %.1f | %zu | %.2f (%.1f) | %.2f (%.1f) | %.2f (%.1f) | %.2f "
               "(%.1f) | %.2f |\n",
               label, (long long)ctx[i], transport, (double)r.bytes / MIB, r.puts, send * 1e3,
               gb / send, recv * 1e3, gb / recv, cpy * 1e3, gb / cpy, cpy_priv * 1e3, gb / cpy_priv,
               send / cpy);
        fflush(stdout);
    }
    side_free(&S->s);
    return rc;
}

static int bench_transport(const char *name, const char *tls, const int64_t *ctx, int n_ctx,
                           int reps)
{
    setenv("UCX_TLS", tls, 1);
    int p2c[2], c2p[2];
    if (pipe(p2c) != 0 || pipe(c2p) != 0)
        return -1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        close(p2c[1]);
        close(c2p[0]);
        _exit(run_receiver(p2c[0], c2p[1]));
    }
    close(p2c[0]);
    close(c2p[1]);
    sender_t S = {.c = {.pid = pid, .to = p2c[1], .from = c2p[0]}};
    int64_t max_ctx = 0;
    for (int i = 0; i < n_ctx; i++)
        max_ctx = ctx[i] > max_ctx ? ctx[i] : max_ctx;
    int rc = bench_model(&S, 0, "demo", name, ctx, n_ctx, max_ctx, reps);
    if (rc == 0)
        rc = bench_model(&S, 1, "48B cache", name, ctx, n_ctx, max_ctx, reps);
    xt_frame_write(S.c.to, "Q", 1);
    int st = xt_reap(&S.c, 30000);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, PROG ": the receiver exited with status %d\n", st);
        rc = -1;
    }
    free(S.scratch);
    free(S.priv);
    return rc;
}

int main(int argc, char **argv)
{
    const char *which = "both";
    cache_bench_args_t A;
    cache_bench_args_init(&A, DUET_SOURCE_DIR, 5);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (duet_version_flag(a)) {
            duet_version_print(PROG);
            return 0;
        }
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf("usage: duet-bench-move [--quick] [--reps N] [--contexts 1024,8192,32768]\n"
                   "                       [--transport shm|tcp|both] [--demo DIR] [--big DIR]\n"
                   "Time to move a running request (KV pages, KDA state and 5 pending replay\n"
                   "rows) from one process to another through the transfer layer, at each\n"
                   "context length, for the demo model (--demo, default models/duet-demo) and\n"
                   "a model with the cache dimensions of --big's config.json (default\n"
                   "bench/configs/kimi-linear-48b) and tiny weights, over shared memory and\n"
                   "tcp on loopback (--transport, default both), against memcpy of the same\n"
                   "bytes; medians of --reps runs (5). Prints a markdown table. --quick: 1024\n"
                   "tokens, 3 runs.\n");
            return 0;
        }
        const int used = cache_bench_arg(PROG, &A, argc, argv, i);
        if (used < 0)
            return 2;
        if (used > 0) {
            i += used - 1;
        } else if (strcmp(a, "--transport") == 0 && v != NULL) {
            which = v;
            if (strcmp(which, "shm") != 0 && strcmp(which, "tcp") != 0 &&
                strcmp(which, "both") != 0) {
                fprintf(stderr, PROG ": --transport %s: want shm, tcp or both\n", which);
                return 2;
            }
            i++;
        } else {
            fprintf(stderr, PROG ": unknown option or missing value: %s (see --help)\n", a);
            return 2;
        }
    }
    cache_bench_args_finish(&A);
    const char *demo_dir = A.demo_dir, *big_dir = A.big_dir;
    const int64_t *ctx = A.ctx;
    const int n_ctx = A.n_ctx, reps = A.reps;
    for (int i = 0; i < n_ctx; i++)
        if (ctx[i] < N_REPLAY) {
            fprintf(stderr, PROG ": a context of %lld tokens cannot hold %d accepted rows\n",
                    (long long)ctx[i], N_REPLAY);
            return 2;
        }
    if (getenv("DUET_LOG_LEVEL") == NULL)
        duet_log_set_level(DUET_LOG_LEVEL_WARN);
    setenv("UCX_NET_DEVICES", "lo", 0);
    signal(SIGPIPE, SIG_IGN);

    /* the small checkpoint first: the receivers are forked with it in place */
    duet_model_config_t big;
    char tmp[256];
    if (cache_bench_small_checkpoint(PROG, big_dir, &big, tmp, sizeof(tmp)) != 0)
        return 1;
    g_dirs[0] = demo_dir;
    g_dirs[1] = tmp;
    int rc = 0;
    { /* the small model's pools must be the 48B config's (checked without UCX: none may
       * exist in this process before the receivers are forked) */
        duet_model_opts_t o;
        model_opts(&o, N_REPLAY);
        duet_model_t *m = NULL;
        if (duet_model_load(tmp, &o, &m) != DUET_OK || !cache_bench_same_cache_dims(m, &big)) {
            fprintf(stderr, PROG ": the small model's cache differs from %s's (%s)\n", big_dir,
                    duet_error_last());
            rc = 1;
        }
        duet_model_free(m);
    }
    if (rc == 0) {
        printf("Medians of %d runs; times in ms from duet_xfer_send_start, (GB/s) = moved bytes / "
               "time; send = the sender's DONE (puts flushed, XferDone sent), receiver = its DONE "
               "(byte count checked); memcpy = the same source ranges (the plan's entries) into a "
               "warm buffer, from the pools, and the same pieces from a private buffer; send / "
               "memcpy = the ratio of the times (memcpy from the pools).\n\n",
               reps);
        printf(
            "| model | context | transport | MiB moved | puts | send ms (GB/s) | receiver DONE ms "
            "(GB/s) | memcpy ms (GB/s) | memcpy, private src ms (GB/s) | send / memcpy |\n");
        printf("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
        if (strcmp(which, "tcp") != 0)
            rc |= bench_transport("shm", "posix,sysv,cma,self", ctx, n_ctx, reps) != 0;
        if (rc == 0 && strcmp(which, "shm") != 0)
            rc |= bench_transport("tcp (lo)", "tcp,self", ctx, n_ctx, reps) != 0;
    }
    cache_bench_small_checkpoint_remove(tmp);
    return rc;
}
