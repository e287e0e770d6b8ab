/*
 * Test harness shared by the transfer runtime's tests (test_transfer_*.c), the helper process
 * duet-xfer-peer (tests/integration/transfer_peer.c) and the benchmark: scenarios, a page pool
 * that counts its free pages, deterministic byte patterns (so a receiver can verify every byte it
 * got without seeing the source), the "router pipe" (length-prefixed frames over a pipe standing
 * in for the router), and sender / receiver drivers over the public API of transfer/xfer.h.
 *
 * Everything is static inline so that each user compiles only what it calls without warnings.
 */
#ifndef DUET_TESTS_TRANSFER_UTIL_H
#define DUET_TESTS_TRANSFER_UTIL_H

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

#include "transfer/xfer.h"

/* --- scenario ----------------------------------------------------------------------------- */

typedef struct {
    uint32_t tokens;      /* n_tokens of each transfer */
    uint32_t src_pt;      /* sender page_tokens */
    uint32_t dst_pt;      /* receiver page_tokens */
    uint32_t mla;         /* MLA layers */
    uint32_t tb;          /* token bytes (multiple of 8) */
    uint32_t kda;         /* KDA layers (0 = no KDA state) */
    uint32_t heads;       /* KDA heads on the sender (divisible by group) */
    uint32_t hd;          /* KDA head dim */
    uint32_t conv;        /* conv kernel */
    uint32_t group;       /* receiver ranks */
    uint32_t kvr;         /* KV shards the pages are dealt over (kv_ranks; 0 = group) */
    uint32_t rank;        /* receiver: its rank */
    uint32_t count;       /* transfers */
    uint32_t seed;        /* pattern seed of transfer k is seed + k */
    uint32_t deadline_ms; /* relative deadline */
    uint32_t checksum;    /* sender sends XXH3 */
    int32_t stall_after;  /* sender: after this many MLA layers, report "stalled" and hang */
    uint32_t pool_pages;  /* pages in each side's KV pool (0 = enough for count transfers) */
    uint32_t alloc;  /* receiver: pools from duet_xfer_ctx_alloc instead of malloc + register */
    uint32_t rrows;  /* replay pool rows per (KDA slot, KDA layer) on both sides (0 = no pool) */
    uint32_t replay; /* replay rows sent (a moved running request; needs group 1, rrows >= it) */
} xt_scn_t;

static inline xt_scn_t xt_scn_default(void)
{
    xt_scn_t s = {.tokens = 100,
                  .src_pt = 16,
                  .dst_pt = 32,
                  .mla = 3,
                  .tb = 64,
                  .kda = 2,
                  .heads = 4,
                  .hd = 8,
                  .conv = 4,
                  .group = 1,
                  .rank = 0,
                  .count = 1,
                  .seed = 7,
                  .deadline_ms = 10000,
                  .checksum = 1,
                  .stall_after = -1,
                  .pool_pages = 0};
    return s;
}

/* One field per line: clang-format 14 moves a multi-field line of this list every time it runs. */
#define XT_SCN_FIELDS(X)                                                                           \
    X(tokens)                                                                                      \
    X(src_pt)                                                                                      \
    X(dst_pt)                                                                                      \
    X(mla)                                                                                         \
    X(tb)                                                                                          \
    X(kda)                                                                                         \
    X(heads)                                                                                       \
    X(hd)                                                                                          \
    X(conv)                                                                                        \
    X(group)                                                                                       \
    X(kvr)                                                                                         \
    X(rank)                                                                                        \
    X(count)                                                                                       \
    X(seed)                                                                                        \
    X(deadline_ms)                                                                                 \
    X(checksum)                                                                                    \
    X(stall_after)                                                                                 \
    X(pool_pages)                                                                                  \
    X(alloc)                                                                                       \
    X(rrows)                                                                                       \
    X(replay)

/* Parse "key=value" arguments into s; false on an unknown key. */
static inline bool xt_scn_parse(xt_scn_t *s, int argc, char **argv)
{
    for (int i = 0; i < argc; i++) {
        char *eq = strchr(argv[i], '=');
        if (eq == NULL)
            return false;
        size_t klen = (size_t)(eq - argv[i]);
        long v = strtol(eq + 1, NULL, 0);
        bool ok = false;
#define XT_PARSE(f)                                                                                \
    if (!ok && klen == strlen(#f) && strncmp(argv[i], #f, klen) == 0) {                            \
        s->f = (__typeof__(s->f))v;                                                                \
        ok = true;                                                                                 \
    }
        XT_SCN_FIELDS(XT_PARSE)
#undef XT_PARSE
        if (!ok)
            return false;
    }
    return true;
}

/* Write s as "key=value" strings into buf (n_p = count); argv entries point into buf. */
static inline int xt_scn_argv(const xt_scn_t *s, char buf[][32], char **argv)
{
    int n = 0;
#define XT_FMT(f)                                                                                  \
    snprintf(buf[n], 32, "%s=%ld", #f, (long)s->f);                                                \
    argv[n] = buf[n];                                                                              \
    n++;
    XT_SCN_FIELDS(XT_FMT)
#undef XT_FMT
    return n;
}

static inline duet_xfer_layout_t xt_layout(const xt_scn_t *s, bool sender)
{
    duet_xfer_layout_t l = {
        .page_tokens = sender ? s->src_pt : s->dst_pt,
        .n_mla_layers = s->mla,
        .token_bytes = s->tb,
        .n_kda_layers = s->kda,
        .kda_heads = sender ? s->heads : s->heads / s->group,
        .kda_head_dim = s->hd,
        .conv_kernel = s->conv,
        .state_elem = 4,
        .replay_rows = s->rrows,
    };
    return l;
}

static inline uint64_t xt_pages_for(uint64_t tokens, uint32_t pt)
{
    return (tokens + pt - 1) / pt;
}

/* KV shards of the scenario's group (kvr, or the group for 0). */
static inline uint32_t xt_kv_shards(const xt_scn_t *s)
{
    return s->kvr != 0 ? s->kvr : s->group;
}

/* Pages rank r of the group holds for s->tokens tokens: those of its shard c = r / (group /
 * shards), global pages c, c + shards, ... (written out here, not transfer/plan.h's helpers). */
static inline uint32_t xt_rank_pages(const xt_scn_t *s, uint32_t r)
{
    uint64_t g = xt_pages_for(s->tokens, s->dst_pt);
    uint32_t kv = xt_kv_shards(s), c = r / (s->group / kv);
    return (uint32_t)(g / kv + (c < g % kv));
}

/* --- pattern ------------------------------------------------------------------------------ */

static inline uint64_t xt_mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* 8-byte word w of token t in MLA layer l of the transfer with seed `seed`. */
static inline uint64_t xt_kv_word(uint32_t seed, uint32_t l, uint64_t t, uint32_t w)
{
    return xt_mix(((uint64_t)seed << 48) ^ ((uint64_t)l << 40) ^ (t << 12) ^ w);
}

/* Element g (in the full, unsharded layer block) of KDA layer l. */
static inline uint32_t xt_kda_elem(uint32_t seed, uint32_t l, uint64_t g)
{
    return (uint32_t)xt_mix(0x4bdaull ^ ((uint64_t)seed << 48) ^ ((uint64_t)l << 40) ^ g);
}

static inline uint64_t xt_kv_page_bytes(const xt_scn_t *s, uint32_t pt)
{
    return (uint64_t)pt * s->mla * s->tb;
}

static inline uint64_t xt_kda_slot_bytes(const xt_scn_t *s, uint32_t heads)
{
    uint64_t hk = (uint64_t)heads * s->hd;
    return (uint64_t)s->kda * (hk * s->hd + 3 * hk * (s->conv - 1)) * 4;
}

/* Element g of row `row` of KDA layer l's replay rows. */
static inline uint32_t xt_replay_elem(uint32_t seed, uint32_t l, uint32_t row, uint64_t g)
{
    return (uint32_t)xt_mix(0x7e91aull ^ ((uint64_t)seed << 48) ^ ((uint64_t)l << 40) ^
                            ((uint64_t)row << 32) ^ g);
}

/* A replay row: (6*H*K + H) fp32 values (common/cache_layout.h; one rank holds every head). */
static inline uint64_t xt_replay_row_bytes(const xt_scn_t *s)
{
    return (6ull * s->heads * s->hd + s->heads) * 4;
}

/* A slot's replay rows: every KDA layer's rrows rows. */
static inline uint64_t xt_replay_slot_bytes(const xt_scn_t *s)
{
    return (uint64_t)s->kda * s->rrows * xt_replay_row_bytes(s);
}

/* Fill every replay row of the sender's slot with the pattern of `seed`. */
static inline void xt_fill_replay(const xt_scn_t *s, uint32_t seed, uint8_t *rp, int32_t slot)
{
    const uint64_t rb = xt_replay_row_bytes(s), n = rb / 4;
    for (uint32_t l = 0; l < s->kda; l++)
        for (uint32_t row = 0; row < s->rrows; row++) {
            uint32_t *e = (uint32_t *)(rp + (((uint64_t)slot * s->kda + l) * s->rrows + row) * rb);
            for (uint64_t g = 0; g < n; g++)
                e[g] = xt_replay_elem(seed, l, row, g);
        }
}

/* Count bytes of the destination slot's replay rows that are wrong: rows [0, s->replay) must hold
 * the pattern of `seed`, the rows after them the receiver's background byte `bg` (not sent). */
static inline uint64_t xt_verify_replay(const xt_scn_t *s, uint32_t seed, const uint8_t *rp,
                                        int32_t slot, uint8_t bg)
{
    const uint64_t rb = xt_replay_row_bytes(s), n = rb / 4;
    const uint32_t bgw = 0x01010101u * bg;
    uint64_t bad = 0;
    for (uint32_t l = 0; l < s->kda; l++)
        for (uint32_t row = 0; row < s->rrows; row++) {
            const uint32_t *e =
                (const uint32_t *)(rp + (((uint64_t)slot * s->kda + l) * s->rrows + row) * rb);
            for (uint64_t g = 0; g < n; g++)
                bad += e[g] != (row < s->replay ? xt_replay_elem(seed, l, row, g) : bgw);
        }
    return bad;
}

/* Fill the sender's pages (sequence order) and KDA slot with the pattern of `seed`. */
static inline void xt_fill_src(const xt_scn_t *s, uint32_t seed, uint8_t *kv, const int32_t *pages,
                               uint8_t *kda, int32_t slot)
{
    uint32_t pt = s->src_pt, wpt = s->tb / 8;
    for (uint64_t t = 0; t < s->tokens; t++) {
        int32_t p = pages[t / pt];
        for (uint32_t l = 0; l < s->mla; l++) {
            uint64_t *dst = (uint64_t *)(kv + (((uint64_t)p * s->mla + l) * pt + t % pt) * s->tb);
            for (uint32_t w = 0; w < wpt; w++)
                dst[w] = xt_kv_word(seed, l, t, w);
        }
    }
    if (s->kda > 0 && slot >= 0) {
        uint64_t layer_elems = xt_kda_slot_bytes(s, s->heads) / s->kda / 4;
        uint32_t *b = (uint32_t *)(kda + (uint64_t)slot * xt_kda_slot_bytes(s, s->heads));
        for (uint32_t l = 0; l < s->kda; l++)
            for (uint64_t g = 0; g < layer_elems; g++)
                b[l * layer_elems + g] = xt_kda_elem(seed, l, g);
    }
}

/* Count bytes of rank s->rank's destination that differ from the pattern of `seed`. */
static inline uint64_t xt_verify_dst(const xt_scn_t *s, uint32_t seed, const uint8_t *kv,
                                     const int32_t *pages, uint32_t n_pages, const uint8_t *kda,
                                     int32_t slot)
{
    uint64_t bad = 0;
    uint32_t pt = s->dst_pt, wpt = s->tb / 8, N = s->group, r = s->rank;
    const uint32_t KV = xt_kv_shards(s), shard = r / (N / KV);
    for (uint32_t i = 0; i < n_pages; i++) {
        uint64_t j = (uint64_t)i * KV + shard; /* local page i holds global page j */
        for (uint32_t sl = 0; sl < pt; sl++) {
            uint64_t t = j * pt + sl;
            if (t >= s->tokens)
                break;
            for (uint32_t l = 0; l < s->mla; l++) {
                const uint64_t *w8 =
                    (const uint64_t *)(kv + (((uint64_t)pages[i] * s->mla + l) * pt + sl) * s->tb);
                for (uint32_t w = 0; w < wpt; w++)
                    bad += w8[w] != xt_kv_word(seed, l, t, w);
            }
        }
    }
    if (s->kda > 0 && slot >= 0) {
        uint64_t H = s->heads, Hr = H / N, K = s->hd, W1 = s->conv - 1, h0 = r * Hr;
        uint64_t lay = xt_kda_slot_bytes(s, (uint32_t)Hr) / s->kda / 4;
        const uint32_t *b =
            (const uint32_t *)(kda + (uint64_t)slot * xt_kda_slot_bytes(s, (uint32_t)Hr));
        for (uint32_t l = 0; l < s->kda; l++) {
            const uint32_t *e = b + l * lay;
            for (uint64_t h = 0; h < Hr; h++)
                for (uint64_t kv2 = 0; kv2 < K * K; kv2++)
                    bad += e[h * K * K + kv2] != xt_kda_elem(seed, l, (h0 + h) * K * K + kv2);
            const uint32_t *c = e + Hr * K * K;
            for (uint64_t ci = 0; ci < 3; ci++)
                for (uint64_t ch = 0; ch < Hr * K; ch++)
                    for (uint64_t w = 0; w < W1; w++)
                        bad +=
                            c[(ci * Hr * K + ch) * W1 + w] !=
                            xt_kda_elem(seed, l, H * K * K + (ci * H * K + h0 * K + ch) * W1 + w);
        }
    }
    return bad;
}

/* --- page pool (counts free pages so tests can prove every page came back) ----------------- */

typedef struct {
    int32_t *free_ids;
    uint32_t n_free, n;
    uint64_t rng;
} xt_pool_t;

static inline void xt_pool_init(xt_pool_t *p, uint32_t n, uint64_t seed)
{
    p->free_ids = malloc(sizeof(int32_t) * n);
    p->n = p->n_free = n;
    p->rng = seed | 1;
    for (uint32_t i = 0; i < n; i++)
        p->free_ids[i] = (int32_t)i;
}

/* Take n random pages (all or nothing). */
static inline bool xt_pool_take(xt_pool_t *p, uint32_t n, int32_t *out)
{
    if (n > p->n_free)
        return false;
    for (uint32_t i = 0; i < n; i++) {
        p->rng = xt_mix(p->rng);
        uint32_t k = (uint32_t)(p->rng % p->n_free);
        out[i] = p->free_ids[k];
        p->free_ids[k] = p->free_ids[--p->n_free];
    }
    return true;
}

static inline void xt_pool_give(xt_pool_t *p, const int32_t *pages, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        p->free_ids[p->n_free++] = pages[i];
}

/* --- the router pipe: 4-byte big-endian length + bytes ------------------------------------ */

static inline bool xt_write_all(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

static inline bool xt_frame_write(int fd, const void *buf, uint32_t n)
{
    uint8_t h[4] = {(uint8_t)(n >> 24), (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n};
    return xt_write_all(fd, h, 4) && xt_write_all(fd, buf, n);
}

static inline uint64_t xt_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Read exactly n bytes within the deadline (monotonic ms); while waiting, progress ctx if any. */
static inline bool xt_read_all(int fd, void *buf, size_t n, uint64_t deadline_ms,
                               duet_xfer_ctx_t *ctx)
{
    uint8_t *p = buf;
    while (n > 0) {
        if (ctx != NULL)
            duet_xfer_ctx_progress(ctx);
        uint64_t now = xt_now_ms();
        if (now >= deadline_ms)
            return false;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int t = ctx != NULL ? 1 : (int)(deadline_ms - now);
        int k = poll(&pfd, 1, t);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return false;
        if (k == 0)
            continue;
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            fprintf(stderr, "xt_read_all: read %zd (%m)\n", r);
            return false;
        }
        p += r;
        n -= (size_t)r;
    }
    return true;
}

/* Read one frame into a malloc'ed buffer (NUL-terminated); NULL on timeout / EOF / oversize. */
static inline uint8_t *xt_frame_read(int fd, uint32_t *n_p, uint64_t deadline_ms,
                                     duet_xfer_ctx_t *ctx)
{
    uint8_t h[4];
    if (!xt_read_all(fd, h, 4, deadline_ms, ctx))
        return NULL;
    uint32_t n = ((uint32_t)h[0] << 24) | ((uint32_t)h[1] << 16) | ((uint32_t)h[2] << 8) | h[3];
    if (n > (16u << 20)) {
        fprintf(stderr, "xt_frame_read: frame of %u bytes\n", n);
        return NULL;
    }
    uint8_t *b = malloc(n + 1);
    if (!xt_read_all(fd, b, n, deadline_ms, ctx)) {
        free(b);
        return NULL;
    }
    b[n] = 0;
    *n_p = n;
    return b;
}

/* --- child processes ---------------------------------------------------------------------- */

typedef struct {
    pid_t pid;
    int to;   /* our end of the child's stdin: the router pipe towards it */
    int from; /* our end of the child's stdout: the router pipe from it */
} xt_child_t;

/* Start `path` with the scenario arguments plus `role`; stdin/stdout are the router pipe. */
static inline bool xt_spawn(xt_child_t *c, const char *path, const char *role, const xt_scn_t *s)
{
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0)
        return false;
    char buf[32][32];
    char *argv[40];
    argv[0] = (char *)path;
    argv[1] = (char *)role;
    int n = xt_scn_argv(s, buf, argv + 2);
    argv[2 + n] = NULL;
    pid_t pid = fork();
    if (pid < 0)
        return false;
    if (pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        close(in[0]);
        close(in[1]);
        close(out[0]);
        close(out[1]);
        execv(path, argv);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    c->pid = pid;
    c->to = in[1];
    c->from = out[0];
    return true;
}

/* Wait for the child to exit within timeout_ms, else kill -9 it. Returns the wait status. */
static inline int xt_reap(xt_child_t *c, uint32_t timeout_ms)
{
    int status = -1;
    uint64_t end = xt_now_ms() + timeout_ms;
    for (;;) {
        pid_t r = waitpid(c->pid, &status, WNOHANG);
        if (r == c->pid)
            break;
        if (r < 0)
            break;
        if (xt_now_ms() >= end) {
            kill(c->pid, SIGKILL);
            waitpid(c->pid, &status, 0);
            break;
        }
        usleep(2000);
    }
    close(c->to);
    close(c->from);
    return status;
}

/* --- receiver driver ---------------------------------------------------------------------- */

typedef struct xt_recv xt_recv_t;

typedef struct {
    xt_recv_t *R;
    uint32_t k;     /* transfer index */
    int32_t *pages; /* owned */
    uint32_t n_pages;
    int32_t slot;
    bool ended;
    duet_xfer_outcome_t out; /* copy (message not kept) */
    char msg[160];
    uint64_t bad; /* bytes that differ from the pattern (DONE only) */
    duet_xfer_id_t id;
} xt_rxfer_t;

struct xt_recv {
    xt_scn_t s;
    duet_xfer_ctx_t *ctx;
    uint8_t *kv, *kda, *rp;                /* malloc'ed pools (NULL when the context owns them) */
    uint8_t *kv_view, *kda_view, *rp_view; /* the pools, whoever owns them */
    size_t kv_bytes, kda_bytes, rp_bytes;
    xt_pool_t pool;
    xt_rxfer_t *x; /* [count] */
    uint32_t n_ended, n_done, n_aborted;
    uint64_t bad;
};

static inline void xt_recv_cb(const duet_xfer_outcome_t *o, void *user)
{
    xt_rxfer_t *t = user;
    xt_recv_t *R = t->R;
    t->ended = true;
    t->out = *o;
    snprintf(t->msg, sizeof(t->msg), "%s", o->message);
    if (o->kind == DUET_XFER_OUTCOME_DONE) {
        t->bad = xt_verify_dst(&R->s, R->s.seed + t->k, R->kv_view, t->pages, t->n_pages,
                               R->kda_view, t->slot);
        if (R->rp_view != NULL && t->slot >= 0)
            t->bad += xt_verify_replay(&R->s, R->s.seed + t->k, R->rp_view, t->slot, 0xee);
        R->bad += t->bad;
        R->n_done++;
    } else {
        R->n_aborted++;
    }
    xt_pool_give(&R->pool, t->pages, t->n_pages); /* every page back, whatever happened */
    R->n_ended++;
}

static inline duet_status_t xt_recv_init(xt_recv_t *R, const xt_scn_t *s)
{
    memset(R, 0, sizeof(*R));
    R->s = *s;
    duet_xfer_ctx_opts_t o;
    duet_xfer_ctx_opts_default(&o);
    o.max_transfers = s->count + 8;
    duet_status_t st = duet_xfer_ctx_create(&o, &R->ctx);
    if (st < 0)
        return st;
    uint32_t per = xt_rank_pages(s, s->rank) + 1; /* one spare page: reservations may be larger */
    uint32_t n_pages = s->pool_pages ? s->pool_pages : per * s->count + 8;
    R->kv_bytes = xt_kv_page_bytes(s, s->dst_pt) * n_pages;
    xt_pool_init(&R->pool, n_pages, 0x1234 + s->rank);
    if (s->kda > 0)
        R->kda_bytes = xt_kda_slot_bytes(s, s->heads / s->group) * s->count;
    R->rp_bytes = xt_replay_slot_bytes(s) * s->count;
    if (s->alloc) {
        void *kv, *kda;
        if ((st = duet_xfer_ctx_alloc(R->ctx, DUET_XFER_POOL_KV, R->kv_bytes, DUET_XFER_MEM_HOST,
                                      &kv)) < 0)
            return st;
        R->kv_view = kv;
        memset(kv, 0xee, R->kv_bytes);
        if (s->kda > 0) {
            if ((st = duet_xfer_ctx_alloc(R->ctx, DUET_XFER_POOL_KDA, R->kda_bytes,
                                          DUET_XFER_MEM_HOST, &kda)) < 0)
                return st;
            R->kda_view = kda;
            memset(kda, 0xee, R->kda_bytes);
        }
        if (R->rp_bytes > 0) {
            void *rp;
            if ((st = duet_xfer_ctx_alloc(R->ctx, DUET_XFER_POOL_REPLAY, R->rp_bytes,
                                          DUET_XFER_MEM_HOST, &rp)) < 0)
                return st;
            R->rp_view = rp;
            memset(rp, 0xee, R->rp_bytes);
        }
    } else {
        R->kv = R->kv_view = malloc(R->kv_bytes);
        memset(R->kv, 0xee, R->kv_bytes);
        if ((st = duet_xfer_ctx_register(R->ctx, DUET_XFER_POOL_KV, R->kv, R->kv_bytes,
                                         DUET_XFER_MEM_HOST)) < 0)
            return st;
        if (s->kda > 0) {
            R->kda = R->kda_view = malloc(R->kda_bytes);
            memset(R->kda, 0xee, R->kda_bytes);
            if ((st = duet_xfer_ctx_register(R->ctx, DUET_XFER_POOL_KDA, R->kda, R->kda_bytes,
                                             DUET_XFER_MEM_HOST)) < 0)
                return st;
        }
        if (R->rp_bytes > 0) {
            R->rp = R->rp_view = malloc(R->rp_bytes);
            memset(R->rp, 0xee, R->rp_bytes);
            if ((st = duet_xfer_ctx_register(R->ctx, DUET_XFER_POOL_REPLAY, R->rp, R->rp_bytes,
                                             DUET_XFER_MEM_HOST)) < 0)
                return st;
        }
    }
    R->x = calloc(s->count, sizeof(*R->x));
    return DUET_OK;
}

/* Reserve transfer k; the encoded Reservation goes to buf (cap bytes). */
static inline duet_status_t xt_recv_reserve(xt_recv_t *R, uint32_t k, uint8_t *buf, size_t cap,
                                            size_t *len_p)
{
    const xt_scn_t *s = &R->s;
    xt_rxfer_t *t = &R->x[k];
    t->R = R;
    t->k = k;
    t->n_pages = xt_rank_pages(s, s->rank) + 1;
    t->pages = malloc(sizeof(int32_t) * t->n_pages);
    if (!xt_pool_take(&R->pool, t->n_pages, t->pages))
        return DUET_ERR_NO_SPACE;
    t->slot = s->kda > 0 ? (int32_t)k : -1;
    duet_xfer_recv_args_t a = {
        .req_id = 1000 + k,
        .layout = xt_layout(s, false),
        .pages = t->pages,
        .n_pages = t->n_pages,
        .kda_slot = t->slot,
        .n_tokens = s->tokens,
        .n_replay = s->replay,
        .rank = s->rank,
        .group_size = s->group,
        .kv_ranks = s->kvr,
        .deadline_unix_ms = duet_xfer_now_unix_ms() + s->deadline_ms,
        .cb = xt_recv_cb,
        .user = t,
    };
    duet_xfer_reservation_t res;
    duet_status_t st = duet_xfer_recv_reserve(R->ctx, &a, &res);
    if (st < 0) {
        xt_pool_give(&R->pool, t->pages, t->n_pages);
        return st;
    }
    t->id = res.transfer_id;
    return duet_xfer_reservation_encode(&res, buf, cap, len_p);
}

/* Progress until every reserved transfer ended or timeout_ms passed. */
static inline bool xt_recv_run(xt_recv_t *R, uint32_t n, uint32_t timeout_ms)
{
    uint64_t end = xt_now_ms() + timeout_ms;
    while (R->n_ended < n && xt_now_ms() < end)
        duet_xfer_ctx_wait(R->ctx, 10);
    return R->n_ended >= n;
}

static inline void xt_recv_free(xt_recv_t *R)
{
    duet_xfer_ctx_destroy(R->ctx);
    if (R->x != NULL)
        for (uint32_t k = 0; k < R->s.count; k++)
            free(R->x[k].pages);
    free(R->x);
    free(R->kv);
    free(R->kda);
    free(R->rp);
    free(R->pool.free_ids);
    memset(R, 0, sizeof(*R));
}

/* --- sender driver ------------------------------------------------------------------------ */

typedef struct xt_send xt_send_t;

typedef struct {
    xt_send_t *S;
    int32_t *pages;
    uint32_t n_pages;
    int32_t slot;
    duet_xfer_id_t id;
    bool started, ended;
    duet_xfer_outcome_t out;
    char msg[160];
} xt_sxfer_t;

struct xt_send {
    xt_scn_t s;
    duet_xfer_ctx_t *ctx;
    uint8_t *kv, *kda, *rp;
    size_t kv_bytes, kda_bytes, rp_bytes;
    xt_pool_t pool;
    uint32_t n_slots;
    xt_sxfer_t *x;
    uint32_t n_x, n_ended, n_done, n_aborted;
};

static inline void xt_send_cb(const duet_xfer_outcome_t *o, void *user)
{
    xt_sxfer_t *t = user;
    t->ended = true;
    t->out = *o;
    snprintf(t->msg, sizeof(t->msg), "%s", o->message);
    xt_pool_give(&t->S->pool, t->pages, t->n_pages);
    t->S->n_ended++;
    if (o->kind == DUET_XFER_OUTCOME_DONE)
        t->S->n_done++;
    else
        t->S->n_aborted++;
}

/* A sender with pools for `slots` concurrent transfers of scenario s. */
static inline duet_status_t xt_send_init(xt_send_t *S, const xt_scn_t *s, uint32_t slots,
                                         uint32_t max_x)
{
    memset(S, 0, sizeof(*S));
    S->s = *s;
    S->n_slots = slots;
    duet_xfer_ctx_opts_t o;
    duet_xfer_ctx_opts_default(&o);
    o.max_transfers = max_x + 8;
    duet_status_t st = duet_xfer_ctx_create(&o, &S->ctx);
    if (st < 0)
        return st;
    uint32_t n_pages = (uint32_t)xt_pages_for(s->tokens, s->src_pt) * slots + 8;
    S->kv_bytes = xt_kv_page_bytes(s, s->src_pt) * n_pages;
    S->kv = malloc(S->kv_bytes);
    memset(S->kv, 0, S->kv_bytes);
    xt_pool_init(&S->pool, n_pages, 0x777);
    if ((st = duet_xfer_ctx_register(S->ctx, DUET_XFER_POOL_KV, S->kv, S->kv_bytes,
                                     DUET_XFER_MEM_HOST)) < 0)
        return st;
    if (s->kda > 0) {
        S->kda_bytes = xt_kda_slot_bytes(s, s->heads) * slots;
        S->kda = malloc(S->kda_bytes);
        if ((st = duet_xfer_ctx_register(S->ctx, DUET_XFER_POOL_KDA, S->kda, S->kda_bytes,
                                         DUET_XFER_MEM_HOST)) < 0)
            return st;
    }
    S->rp_bytes = xt_replay_slot_bytes(s) * slots;
    if (S->rp_bytes > 0) {
        S->rp = malloc(S->rp_bytes);
        if ((st = duet_xfer_ctx_register(S->ctx, DUET_XFER_POOL_REPLAY, S->rp, S->rp_bytes,
                                         DUET_XFER_MEM_HOST)) < 0)
            return st;
    }
    S->x = calloc(max_x, sizeof(*S->x));
    S->n_x = max_x;
    return DUET_OK;
}

/* Start transfer k (pattern seed s.seed + k) to the decoded reservations res[0..group). */
static inline duet_status_t xt_send_start(xt_send_t *S, uint32_t k,
                                          const duet_xfer_reservation_t *res)
{
    const xt_scn_t *s = &S->s;
    xt_sxfer_t *t = &S->x[k];
    t->S = S;
    t->n_pages = (uint32_t)xt_pages_for(s->tokens, s->src_pt);
    t->pages = malloc(sizeof(int32_t) * (t->n_pages + 1));
    if (!xt_pool_take(&S->pool, t->n_pages, t->pages))
        return DUET_ERR_NO_SPACE;
    t->slot = s->kda > 0 ? (int32_t)(k % S->n_slots) : -1;
    xt_fill_src(s, s->seed + k, S->kv, t->pages, S->kda, t->slot);
    if (S->rp != NULL && t->slot >= 0)
        xt_fill_replay(s, s->seed + k, S->rp, t->slot);
    duet_xfer_send_args_t a = {
        .req_id = res[0].request_id,
        .reservations = res,
        .n_ranks = s->group,
        .layout = xt_layout(s, true),
        .src = {.pages = t->pages,
                .n_pages = t->n_pages,
                .kda_slot = t->slot,
                .n_tokens = s->tokens,
                .n_replay = s->replay},
        .checksum = s->checksum != 0,
        .cb = xt_send_cb,
        .user = t,
    };
    duet_status_t st = duet_xfer_send_start(S->ctx, &a, &t->id);
    if (st < 0) {
        xt_pool_give(&S->pool, t->pages, t->n_pages);
        return st;
    }
    t->started = true;
    return DUET_OK;
}

/* Stream layer l of every started transfer in [k0, k1); l == mla means the KDA state. */
static inline void xt_send_layer(xt_send_t *S, uint32_t k0, uint32_t k1, uint32_t l)
{
    for (uint32_t k = k0; k < k1; k++) {
        if (!S->x[k].started || S->x[k].ended)
            continue;
        if (l < S->s.mla)
            duet_xfer_send_layer_ready(S->ctx, S->x[k].id, l);
        else
            duet_xfer_send_kda_ready(S->ctx, S->x[k].id);
    }
    duet_xfer_ctx_progress(S->ctx);
}

static inline bool xt_send_run(xt_send_t *S, uint32_t n, uint32_t timeout_ms)
{
    uint64_t end = xt_now_ms() + timeout_ms;
    while (S->n_ended < n && xt_now_ms() < end)
        duet_xfer_ctx_wait(S->ctx, 10);
    return S->n_ended >= n;
}

static inline void xt_send_free(xt_send_t *S)
{
    duet_xfer_ctx_destroy(S->ctx);
    if (S->x != NULL)
        for (uint32_t k = 0; k < S->n_x; k++)
            free(S->x[k].pages);
    free(S->x);
    free(S->kv);
    free(S->kda);
    free(S->rp);
    free(S->pool.free_ids);
    memset(S, 0, sizeof(*S));
}

#endif
