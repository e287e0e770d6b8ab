/*
 * group.c: rank 0's commands to the followers of a Helix generation group and the followers'
 * loop (contract in group.h).
 *
 * One command is one broadcast of a fixed header (and, for a forward, one of its items and
 * tokens); commands whose outcome rank 0 needs end with an all-gather of each rank's status. A
 * follower's sequences live in a table under rank 0's ids, which match because every rank opens
 * and closes the same sequences in the same order on pools of the same shape.
 */
#include "worker/group.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "engine/shard.h"
#include "transfer/reservation.h"

enum {
    GC_STOP = 1,
    GC_OPEN,
    GC_CLOSE,
    GC_RESERVE,
    GC_RECV_CANCEL,
    GC_FILLED,
    GC_FORWARD,
};

typedef struct {
    int32_t op;
    int32_t seq;       /* rank 0's sequence id */
    int64_t a;         /* OPEN: max_tokens; RESERVE, FILLED: n_tokens; FORWARD: items */
    int64_t b;         /* FORWARD: rows */
    uint64_t rid;      /* RESERVE */
    uint64_t deadline; /* RESERVE, FILLED: unix ms */
    char why[128];     /* RECV_CANCEL */
} gcmd_t;

/* A follower's sequence and its share of a transfer. */
typedef struct {
    duet_seq_t seq;
    int open;
    int xfer; /* 0 none, 1 live, 2 arrived, 3 failed */
    duet_xfer_id_t xid;
    char err[160];
} fseq_t;

struct duet_group {
    duet_comm_t *comm;
    int cp, tp;
    int broken;
    /* follower state */
    duet_model_t *m;
    duet_xfer_ctx_t *x;
    duet_xfer_layout_t layout;
    fseq_t *seqs; /* [max_seqs] by id */
    int64_t n_seqs;
    int64_t *fwd_hdr; /* forward payload scratch */
    size_t fwd_cap;
};

duet_status_t duet_group_create(duet_comm_t *comm, int cp, int tp, duet_group_t **g_p)
{
    if (comm == NULL || cp < 1 || tp < 1 || cp * tp != comm->size)
        return duet_error_set(DUET_ERR_INVALID, "helix: cp %d x tp %d for a group of %d ranks", cp,
                              tp, comm != NULL ? comm->size : 0);
    duet_group_t *g = calloc(1, sizeof(*g));
    if (g == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "helix: out of memory");
    g->comm = comm;
    g->cp = cp;
    g->tp = tp;
    *g_p = g;
    return DUET_OK;
}

int duet_group_rank(const duet_group_t *g)
{
    return g->comm->rank;
}

int duet_group_size(const duet_group_t *g)
{
    return g->comm->size;
}

int duet_group_cp(const duet_group_t *g)
{
    return g->cp;
}

duet_comm_t *duet_group_comm(duet_group_t *g)
{
    return g->comm;
}

int duet_group_broken(const duet_group_t *g)
{
    return g->broken;
}

void duet_group_abort(duet_group_t *g, int code)
{
    g->comm->ops->abort(g->comm, code);
}

/* A collective's status: a failure breaks the group. */
static duet_status_t g_check(duet_group_t *g, duet_status_t st, const char *what)
{
    if (st != DUET_OK && !g->broken) {
        g->broken = 1;
        char detail[512];
        snprintf(detail, sizeof(detail), "%s", duet_error_last());
        duet_error_set(st,
                       "helix group: %s failed on rank %d (a rank died or stopped answering): %s",
                       what, g->comm->rank, detail);
        DUET_LOG_ERROR("%s", duet_error_last());
    }
    return st;
}

static duet_status_t g_send(duet_group_t *g, gcmd_t *c)
{
    if (g->broken)
        return duet_error_set(DUET_ERR_TRANSPORT, "helix group: broken by an earlier failure");
    return g_check(g, g->comm->ops->bcast(g->comm, c, sizeof(*c), 0), "a command");
}

/* Every rank's status: the first failure's rank, or -1 when all are DUET_OK. */
static duet_status_t g_statuses(duet_group_t *g, int32_t mine, int *bad_rank)
{
    int32_t all[DUET_SHARD_MAX_RANKS];
    duet_status_t st = g_check(g, g->comm->ops->allgather(g->comm, &mine, all, sizeof(int32_t)),
                               "a status exchange");
    *bad_rank = -1;
    for (int r = 0; st == DUET_OK && r < g->comm->size; r++)
        if (all[r] != DUET_OK) {
            *bad_rank = r;
            break;
        }
    return st;
}

/* After a call every rank made (rank 0's status `mine`): rank 0's own failure, its message kept
 * across the exchange; else *bad is the first follower that failed (-1: none). */
static duet_status_t g_after(duet_group_t *g, duet_status_t mine, int *bad)
{
    char why[256];
    snprintf(why, sizeof(why), "%s", mine != DUET_OK ? duet_error_last() : "");
    duet_status_t st = g_statuses(g, (int32_t)mine, bad);
    if (st != DUET_OK)
        return st;
    return mine != DUET_OK ? duet_error_set(mine, "%s", why) : DUET_OK;
}

/* Room for a step's payload of `bytes` in g->fwd_hdr. */
static bool g_fwd_room(duet_group_t *g, size_t bytes)
{
    if (bytes <= g->fwd_cap)
        return true;
    int64_t *p = realloc(g->fwd_hdr, bytes);
    if (p == NULL)
        return false;
    g->fwd_hdr = p;
    g->fwd_cap = bytes;
    return true;
}

/*
 * Every rank's byte string (this rank's `len` bytes of `mine`) to every rank: first their sizes
 * (sizes[size]), then the strings padded to the longest, rank r's at *all_p + r * *max_p
 * (malloc'ed; the caller frees it). Every rank calls it; a failure breaks the group.
 */
static duet_status_t g_gather_bytes(duet_group_t *g, const void *mine, uint64_t len,
                                    uint64_t *sizes, uint8_t **all_p, uint64_t *max_p)
{
    *all_p = NULL;
    duet_status_t st =
        g_check(g, g->comm->ops->allgather(g->comm, &len, sizes, sizeof(len)), "byte sizes");
    if (st != DUET_OK)
        return st;
    uint64_t max = 0;
    for (int r = 0; r < g->comm->size; r++)
        max = sizes[r] > max ? sizes[r] : max;
    uint8_t *pad = calloc(1, max > 0 ? max : 1);
    uint8_t *all = malloc((size_t)g->comm->size * (max > 0 ? max : 1));
    if (pad == NULL || all == NULL) { /* the others are in the all-gather: so must we be */
        free(pad);
        free(all);
        g->broken = 1;
        return duet_error_set(DUET_ERR_NOMEM, "helix group: out of memory for %llu bytes a rank",
                              (unsigned long long)max);
    }
    if (len > 0)
        memcpy(pad, mine, len);
    st = g_check(g, g->comm->ops->allgather(g->comm, pad, all, max), "byte strings");
    free(pad);
    if (st != DUET_OK) {
        free(all);
        return st;
    }
    *all_p = all;
    *max_p = max;
    return DUET_OK;
}

void duet_group_destroy(duet_group_t *g)
{
    if (g == NULL)
        return;
    if (g->comm->rank == 0 && !g->broken) {
        gcmd_t c = {.op = GC_STOP};
        (void)g_send(g, &c);
    }
    free(g->seqs);
    free(g->fwd_hdr);
    duet_comm_destroy(g->comm);
    free(g);
}

/* ---- rank 0 ------------------------------------------------------------------------------- */

duet_status_t duet_group_seq_open(duet_group_t *g, duet_model_t *m, int64_t max_tokens,
                                  duet_seq_t *seq)
{
    duet_status_t st = duet_model_seq_open(m, max_tokens, seq);
    if (st != DUET_OK)
        return st; /* rank 0 holds the most pages of any rank: the others would fit it */
    gcmd_t c = {.op = GC_OPEN, .seq = seq->id, .a = max_tokens};
    int bad = -1;
    if ((st = g_send(g, &c)) != DUET_OK || (st = g_statuses(g, DUET_OK, &bad)) != DUET_OK) {
        duet_model_seq_close(m, seq);
        return st;
    }
    if (bad >= 0) {
        duet_group_seq_close(g, m, seq);
        return duet_error_set(DUET_ERR_INTERNAL,
                              "helix group: rank %d could not open the sequence rank 0 opened",
                              bad);
    }
    return DUET_OK;
}

void duet_group_seq_close(duet_group_t *g, duet_model_t *m, duet_seq_t *seq)
{
    if (seq->id >= 0 && !g->broken) {
        gcmd_t c = {.op = GC_CLOSE, .seq = seq->id};
        (void)g_send(g, &c);
    }
    duet_model_seq_close(m, seq);
}

duet_status_t duet_group_seq_filled(duet_group_t *g, duet_model_t *m, duet_seq_t *seq,
                                    int64_t n_tokens, uint64_t deadline_unix_ms)
{
    gcmd_t c = {.op = GC_FILLED, .seq = seq->id, .a = n_tokens, .deadline = deadline_unix_ms};
    duet_status_t st = g_send(g, &c);
    if (st != DUET_OK)
        return st;
    int bad = -1;
    if ((st = g_after(g, duet_model_seq_set_filled(m, seq, n_tokens), &bad)) != DUET_OK)
        return st;
    if (bad >= 0)
        return duet_error_set(DUET_ERR_TRANSPORT,
                              "helix group: rank %d's share of the cache transfer did not arrive",
                              bad);
    return DUET_OK;
}

duet_status_t duet_group_forward(duet_group_t *g, duet_model_t *m, duet_batch_item_t *items,
                                 int64_t n_items)
{
    int64_t rows = 0;
    for (int64_t i = 0; i < n_items; i++)
        rows += items[i].n_tokens;
    /* the payload: (seq id, n_tokens) per item, then the tokens */
    const size_t bytes = (size_t)(2 * n_items) * sizeof(int64_t) + (size_t)rows * sizeof(int32_t);
    if (!g_fwd_room(g, bytes))
        return duet_error_set(DUET_ERR_NOMEM, "helix group: out of memory for a step");
    int32_t *tok = (int32_t *)(g->fwd_hdr + 2 * n_items);
    for (int64_t i = 0; i < n_items; i++) {
        g->fwd_hdr[2 * i] = items[i].seq->id;
        g->fwd_hdr[2 * i + 1] = items[i].n_tokens;
        memcpy(tok, items[i].tokens, sizeof(int32_t) * (size_t)items[i].n_tokens);
        tok += items[i].n_tokens;
    }
    gcmd_t c = {.op = GC_FORWARD, .a = n_items, .b = rows};
    duet_status_t st = g_send(g, &c);
    if (st != DUET_OK || (st = g_check(g, g->comm->ops->bcast(g->comm, g->fwd_hdr, bytes, 0),
                                       "a step's items")) != DUET_OK)
        return st;
    int bad = -1;
    if ((st = g_after(g, duet_model_forward(m, items, n_items), &bad)) != DUET_OK)
        return st;
    if (bad >= 0) { /* the ranks' caches may now differ: nothing they compute can be trusted */
        g->broken = 1;
        return duet_error_set(DUET_ERR_INTERNAL, "helix group: rank %d's step failed", bad);
    }
    return DUET_OK;
}

duet_status_t duet_group_reserve(duet_group_t *g, const duet_seq_t *seq, uint64_t rid,
                                 int64_t n_tokens, uint64_t deadline_unix_ms, uint8_t **out,
                                 size_t *len)
{
    const int n = g->comm->size;
    gcmd_t c = {.op = GC_RESERVE, .seq = seq->id, .a = n_tokens, .rid = rid};
    c.deadline = deadline_unix_ms;
    duet_status_t st = g_send(g, &c);
    if (st != DUET_OK)
        return st;
    /* the followers' packed reservations (rank 0 gives none; reservations are small) */
    uint64_t sizes[DUET_SHARD_MAX_RANKS], max = 0;
    uint8_t *all = NULL;
    if ((st = g_gather_bytes(g, NULL, 0, sizes, &all, &max)) != DUET_OK)
        return st;
    int failed = -1;
    for (int r = 1; r < n; r++) {
        out[r - 1] = NULL;
        len[r - 1] = 0;
        if (sizes[r] == 0) {
            failed = failed < 0 ? r : failed;
            continue;
        }
        out[r - 1] = malloc(sizes[r]);
        if (out[r - 1] == NULL) {
            failed = failed < 0 ? r : failed;
            continue;
        }
        memcpy(out[r - 1], all + (size_t)r * max, sizes[r]);
        len[r - 1] = sizes[r];
    }
    free(all);
    if (failed >= 0) {
        duet_group_free_reservations(g, out);
        duet_group_recv_cancel(g, seq, "another rank of the group could not reserve");
        return duet_error_set(DUET_ERR_NO_SPACE, "helix group: rank %d could not reserve its share",
                              failed);
    }
    return DUET_OK;
}

void duet_group_free_reservations(const duet_group_t *g, uint8_t **out)
{
    for (int r = 1; r < g->comm->size; r++) {
        free(out[r - 1]);
        out[r - 1] = NULL;
    }
}

void duet_group_recv_cancel(duet_group_t *g, const duet_seq_t *seq, const char *why)
{
    gcmd_t c = {.op = GC_RECV_CANCEL, .seq = seq->id};
    snprintf(c.why, sizeof(c.why), "%s", why != NULL ? why : "cancelled");
    (void)g_send(g, &c);
}

/* ---- followers -------------------------------------------------------------------------- */

static void f_progress(void *user)
{
    duet_group_t *g = user;
    (void)duet_xfer_ctx_progress(g->x);
}

static void f_on_xfer(const duet_xfer_outcome_t *o, void *user)
{
    duet_group_t *g = user;
    for (int64_t i = 0; i < g->n_seqs; i++) {
        fseq_t *f = &g->seqs[i];
        if (f->xfer != 1 || f->xid != o->id)
            continue;
        f->xfer = o->kind == DUET_XFER_OUTCOME_DONE ? 2 : 3;
        if (f->xfer == 3)
            snprintf(f->err, sizeof(f->err), "%s: %s", duet_xfer_reason_str(o->reason),
                     o->message != NULL ? o->message : "");
        return;
    }
}

static fseq_t *f_seq(duet_group_t *g, int32_t id)
{
    return id >= 0 && id < g->n_seqs && g->seqs[id].open ? &g->seqs[id] : NULL;
}

static int32_t f_open(duet_group_t *g, const gcmd_t *c)
{
    if (c->seq < 0 || c->seq >= g->n_seqs || g->seqs[c->seq].open)
        return DUET_ERR_INTERNAL;
    duet_seq_t s;
    if (duet_model_seq_open(g->m, c->a, &s) != DUET_OK) {
        DUET_LOG_ERROR("helix follower: open of %lld tokens: %s", (long long)c->a,
                       duet_error_last());
        return DUET_ERR_NO_SPACE;
    }
    if (s.id != c->seq) { /* the tables went apart: a bug, and nothing can go on */
        DUET_LOG_ERROR("helix follower: opened sequence %d where rank 0 has %d", s.id, c->seq);
        duet_model_seq_close(g->m, &s);
        return DUET_ERR_INTERNAL;
    }
    g->seqs[s.id] = (fseq_t){.seq = s, .open = 1};
    return DUET_OK;
}

static void f_cancel(duet_group_t *g, fseq_t *f, const char *why)
{
    if (f->xfer == 1)
        (void)duet_xfer_recv_cancel(g->x, f->xid, why); /* its outcome: f_on_xfer */
    f->xfer = 0;
}

static void f_close(duet_group_t *g, const gcmd_t *c)
{
    fseq_t *f = f_seq(g, c->seq);
    if (f == NULL)
        return;
    f_cancel(g, f, "the request ended");
    duet_model_seq_close(g->m, &f->seq);
    f->open = 0;
}

/* Reserve this rank's share; its packed bytes into *buf (NULL, 0 on failure: logged). */
static void f_reserve(duet_group_t *g, const gcmd_t *c, uint8_t **buf, size_t *len)
{
    *buf = NULL;
    *len = 0;
    fseq_t *f = f_seq(g, c->seq);
    if (f == NULL)
        return;
    const uint32_t pt = g->layout.page_tokens;
    const uint64_t global = pt > 0 ? ((uint64_t)c->a + pt - 1) / pt : 0;
    const uint32_t c_idx = (uint32_t)(g->comm->rank / g->tp);
    duet_xfer_recv_args_t a = {
        .req_id = c->rid,
        .layout = g->layout,
        .pages = f->seq.pages,
        .n_pages = (uint32_t)duet_xfer_kv_shard_pages(global, (uint32_t)g->cp, c_idx),
        .kda_slot = f->seq.kda_slot,
        .n_tokens = (uint64_t)c->a,
        .rank = (uint32_t)g->comm->rank,
        .group_size = (uint32_t)g->comm->size,
        .kv_ranks = (uint32_t)g->cp,
        .deadline_unix_ms = c->deadline,
        .cb = f_on_xfer,
        .user = g,
    };
    if (g->layout.n_mla_layers == 0)
        a.n_pages = 0;
    duet_xfer_reservation_t res;
    if (duet_xfer_recv_reserve(g->x, &a, &res) != DUET_OK) {
        DUET_LOG_ERROR("helix follower: cannot reserve: %s", duet_error_last());
        return;
    }
    size_t cap = duet_xfer_reservation_packed_size(&res);
    uint8_t *b = malloc(cap > 0 ? cap : 1);
    if (b == NULL || duet_xfer_reservation_encode(&res, b, cap, len) != DUET_OK) {
        (void)duet_xfer_recv_cancel(g->x, res.transfer_id, "encoding failed");
        free(b);
        *len = 0;
        return;
    }
    f->xid = res.transfer_id;
    f->xfer = 1;
    f->err[0] = '\0';
    *buf = b;
}

static uint64_t f_now_ms(void)
{
    return duet_xfer_now_unix_ms();
}

/* Wait (bounded) for this rank's share of the transfer, then mark the sequence filled. */
static int32_t f_filled(duet_group_t *g, const gcmd_t *c)
{
    fseq_t *f = f_seq(g, c->seq);
    if (f == NULL)
        return DUET_ERR_INTERNAL;
    const uint64_t bound = f_now_ms() + (uint64_t)g->comm->timeout_ms / 2;
    const uint64_t until = c->deadline > 0 && c->deadline < bound ? c->deadline : bound;
    while (f->xfer == 1 && f_now_ms() < until) {
        if (duet_xfer_ctx_progress(g->x) == 0) {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
        }
    }
    if (f->xfer != 2) {
        DUET_LOG_ERROR("helix follower: sequence %d: its share of the transfer %s%s", c->seq,
                       f->xfer == 1 ? "did not arrive in time" : "failed: ", f->err);
        f_cancel(g, f, "the transfer did not arrive in time");
        return DUET_ERR_TRANSPORT;
    }
    f->xfer = 0;
    if (duet_model_seq_set_filled(g->m, &f->seq, c->a) != DUET_OK) {
        DUET_LOG_ERROR("helix follower: set_filled: %s", duet_error_last());
        return DUET_ERR_INTERNAL;
    }
    return DUET_OK;
}

static int32_t f_forward(duet_group_t *g, const gcmd_t *c)
{
    const int64_t n = c->a, rows = c->b;
    const size_t bytes = (size_t)(2 * n) * sizeof(int64_t) + (size_t)rows * sizeof(int32_t);
    if (n < 0 || rows < 0 || n > g->n_seqs)
        return DUET_ERR_INTERNAL;
    if (!g_fwd_room(g, bytes)) { /* rank 0 waits in this bcast: the group cannot go on */
        g->broken = 1;
        DUET_LOG_ERROR("helix follower: out of memory for a step of %zu bytes", bytes);
        return DUET_ERR_NOMEM;
    }
    if (g_check(g, g->comm->ops->bcast(g->comm, g->fwd_hdr, bytes, 0), "a step's items") != DUET_OK)
        return DUET_ERR_TRANSPORT;
    duet_batch_item_t *it = calloc((size_t)(n > 0 ? n : 1), sizeof(*it));
    if (it == NULL)
        return DUET_ERR_NOMEM;
    const int32_t *tok = (const int32_t *)(g->fwd_hdr + 2 * n);
    int32_t st = DUET_OK;
    for (int64_t i = 0; i < n && st == DUET_OK; i++) {
        fseq_t *f = f_seq(g, (int32_t)g->fwd_hdr[2 * i]);
        if (f == NULL) {
            st = DUET_ERR_INTERNAL;
            break;
        }
        it[i] = (duet_batch_item_t){.seq = &f->seq,
                                    .tokens = (int32_t *)tok,
                                    .n_tokens = g->fwd_hdr[2 * i + 1],
                                    .logits_mode = DUET_LOGITS_NONE};
        tok += g->fwd_hdr[2 * i + 1];
    }
    /* a bad item here would leave rank 0 alone in the forward's collectives: the timeout ends
     * them; a good one runs the collective forward with the others */
    if (st == DUET_OK && (st = duet_model_forward(g->m, it, n)) != DUET_OK)
        DUET_LOG_ERROR("helix follower: step: %s", duet_error_last());
    free(it);
    return st;
}

int duet_group_follow(duet_group_t *g, duet_model_t *m, duet_xfer_ctx_t *x,
                      const duet_xfer_layout_t *layout)
{
    g->m = m;
    g->x = x;
    g->layout = *layout;
    g->n_seqs = duet_model_opts(m)->max_seqs;
    g->seqs = calloc((size_t)g->n_seqs, sizeof(*g->seqs));
    if (g->seqs == NULL) {
        DUET_LOG_ERROR("helix follower: out of memory");
        return 1;
    }
    g->comm->on_wait = f_progress;
    g->comm->on_wait_user = g;
    DUET_LOG_INFO("helix follower: rank %d of %d (cp %d x tp %d) waiting for rank 0", g->comm->rank,
                  g->comm->size, g->cp, g->tp);
    const int64_t timeout = g->comm->timeout_ms;
    for (;;) {
        gcmd_t c;
        memset(&c, 0, sizeof(c));
        g->comm->timeout_ms = 0; /* rank 0 may be idle for as long as it likes */
        duet_status_t st = g->comm->ops->bcast(g->comm, &c, sizeof(c), 0);
        g->comm->timeout_ms = timeout;
        if (g_check(g, st, "waiting for a command") != DUET_OK)
            return 1;
        int32_t mine = DUET_OK;
        int bad = -1;
        switch (c.op) {
        case GC_STOP:
            DUET_LOG_INFO("helix follower: rank 0 stopped the group");
            for (int64_t i = 0; i < g->n_seqs; i++)
                if (g->seqs[i].open) {
                    gcmd_t cl = {.op = GC_CLOSE, .seq = (int32_t)i};
                    f_close(g, &cl);
                }
            return 0;
        case GC_OPEN:
            mine = f_open(g, &c);
            st = g_statuses(g, mine, &bad);
            break;
        case GC_CLOSE:
            f_close(g, &c);
            break;
        case GC_RECV_CANCEL: {
            fseq_t *f = f_seq(g, c.seq);
            if (f != NULL)
                f_cancel(g, f, c.why);
            break;
        }
        case GC_RESERVE: {
            uint8_t *buf;
            size_t len;
            f_reserve(g, &c, &buf, &len);
            uint64_t sizes[DUET_SHARD_MAX_RANKS], max = 0;
            uint8_t *all = NULL;
            st = g_gather_bytes(g, buf, len, sizes, &all, &max);
            free(all);
            free(buf);
            break;
        }
        case GC_FILLED:
            mine = f_filled(g, &c);
            st = g_statuses(g, mine, &bad);
            break;
        case GC_FORWARD:
            mine = f_forward(g, &c);
            if (!g->broken)
                st = g_statuses(g, mine, &bad);
            break;
        default:
            DUET_LOG_ERROR("helix follower: unknown command %d", c.op);
            return 1;
        }
        if (st != DUET_OK || g->broken)
            return 1;
    }
}
