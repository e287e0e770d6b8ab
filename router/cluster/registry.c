/*
 * Worker registry (see registry.h). One reg_conn_t per TCP connection, one reg_worker_t per
 * accepted registration, in a fixed table made at start. A connection and its worker point at
 * each other until the worker dies; the connection is then closed and freed in its close
 * callback, while the worker entry stays (state DEAD) for the admin API.
 *
 * Writes are corked: the frames for a connection are encoded into one allocation with its
 * uv_write_t, written from a uv_check callback at the end of the loop turn (one syscall for what
 * a turn sends to a worker, e.g. the Reserve / Prefill / PrefillDone of many requests), and
 * freed by the write callback.
 */
#include "router/cluster/registry.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/log.h"
#include "common/prefix_hash.h"
#include "common/strbuf.h"
#include "proto/envelope.h"

typedef struct reg_worker reg_worker_t;

typedef struct {
    uv_write_t req;
    uv_buf_t buf; /* data, buf.len bytes filled */
    struct reg_conn *conn;
    size_t cap; /* bytes of data */
    uint8_t data[];
} reg_write_t;

typedef struct reg_conn {
    uv_tcp_t tcp;             /* the handle; freed in reg_conn_closed */
    duet_registry_t *reg;     /* not owned */
    duet_frame_decoder_t dec; /* owned */
    reg_worker_t *w;          /* the accepted worker, NULL before Register / after death */
    bool closing;             /* uv_close called */
    bool close_after_write;   /* refused: close once the ack is flushed */
    size_t writes_pending;
    reg_write_t *cork; /* owned: frames not yet handed to uv_write (reg->check sends) */
    uint64_t connected_ms;
    char peer[64];
    struct reg_conn *prev, *next; /* in reg->conns */
} reg_conn_t;

struct reg_worker {
    duet_worker_info_t info; /* info.id == 0: free slot */
    reg_conn_t *conn;        /* NULL once dead */
    bool warned_spec;        /* told once that its heartbeats carry too many draft positions */
    bool warned_prefix;      /* told once that its heartbeats carry a malformed prefix summary */
    uint32_t prefix_page_tokens;               /* its summary's block size (0: no summary) */
    uint32_t n_prefix;                         /* hashes in prefix */
    uint64_t prefix[DUET_PROTO_PREFIX_HASHES]; /* its latest summary, sorted (binary search) */
};

struct duet_registry {
    uv_loop_t *loop;
    uv_tcp_t listener;
    uv_timer_t timer;
    uv_check_t check; /* sends the connections' corks at the end of each loop turn */
    duet_registry_options_t opts;
    char host[64];
    char fingerprint[DUET_REGISTRY_FINGERPRINT_MAX + 1];
    bool adopt;            /* fingerprint comes from the first accepted worker */
    reg_worker_t *workers; /* (max_workers) owned */
    reg_conn_t *conns;     /* open connections */
    uint64_t next_id;
    uint16_t port;
    int open_handles; /* listener + timer + check + connections not yet closed */
    bool closing;
    duet_registry_close_cb close_cb;
    void *close_user;
    duet_strbuf_t *fake_out; /* duet__registry_start_fake: no listener, frames land here */
};

/* ------------------------------------------------------------------------------ names */

const char *duet_worker_state_name(duet_worker_state_t state)
{
    switch (state) {
    case DUET_WORKER_STATE_UP:
        return "up";
    case DUET_WORKER_STATE_DRAINING:
        return "draining";
    case DUET_WORKER_STATE_DEAD:
        return "dead";
    default:
        return "unknown";
    }
}

const char *duet_worker_role_name(duet_worker_role_t role)
{
    return role == DUET_WORKER_ROLE_CTX ? "ctx" : role == DUET_WORKER_ROLE_GEN ? "gen" : "unknown";
}

void duet_registry_options_default(duet_registry_options_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->host = "127.0.0.1";
    opts->heartbeat_timeout_ms = 5000;
}

/* ------------------------------------------------------------------------------ teardown */

static void reg_maybe_freed(duet_registry_t *reg)
{
    if (!reg->closing || reg->open_handles > 0)
        return;
    duet_registry_close_cb cb = reg->close_cb;
    void *user = reg->close_user;
    free(reg->workers);
    free(reg);
    if (cb != NULL)
        cb(user);
}

static void reg_conn_closed(uv_handle_t *h)
{
    reg_conn_t *c = h->data;
    duet_registry_t *reg = c->reg;
    if (c->prev != NULL)
        c->prev->next = c->next;
    else
        reg->conns = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    duet_frame_decoder_free(&c->dec);
    free(c->cork);
    free(c);
    reg->open_handles--;
    reg_maybe_freed(reg);
}

static void reg_conn_close(reg_conn_t *c)
{
    if (c->closing)
        return;
    c->closing = true;
    uv_close((uv_handle_t *)&c->tcp, reg_conn_closed);
}

/* Mark w dead (once), close its connection, tell the router core. */
static void reg_worker_dead(duet_registry_t *reg, reg_worker_t *w, const char *reason)
{
    if (w->info.state == DUET_WORKER_STATE_DEAD)
        return;
    w->info.state = DUET_WORKER_STATE_DEAD;
    w->info.inflight = 0;
    if (w->conn != NULL) {
        w->conn->w = NULL;
        reg_conn_close(w->conn);
        w->conn = NULL;
    }
    DUET_LOG_WARN("registry: worker %llu (%s %s, %s) is dead: %s", (unsigned long long)w->info.id,
                  duet_worker_role_name(w->info.role), w->info.name, w->info.peer, reason);
    if (!reg->closing && reg->opts.on_worker_down != NULL) {
        duet_worker_info_t copy = w->info;
        reg->opts.on_worker_down(&copy, reason, reg->opts.user);
    }
}

/* ------------------------------------------------------------------------------ writing */

static void reg_write_done(uv_write_t *req, int status)
{
    reg_write_t *wr = (reg_write_t *)req;
    reg_conn_t *c = wr->conn;
    free(wr);
    c->writes_pending--;
    if (status < 0 && !c->closing) {
        DUET_LOG_WARN("registry: write to %s failed: %s", c->peer, uv_strerror(status));
        if (c->w != NULL)
            reg_worker_dead(c->reg, c->w, "write to the worker failed");
        else
            reg_conn_close(c);
        return;
    }
    if (c->close_after_write && c->writes_pending == 0)
        reg_conn_close(c);
}

/* Hand c's cork to uv_write; a failed write kills its worker (or closes the connection). */
static void reg_conn_uncork(reg_conn_t *c)
{
    reg_write_t *wr = c->cork;
    if (wr == NULL)
        return;
    c->cork = NULL;
    if (c->closing) {
        free(wr);
        return;
    }
    wr->conn = c;
    int rc = uv_write(&wr->req, (uv_stream_t *)&c->tcp, &wr->buf, 1, reg_write_done);
    if (rc < 0) {
        free(wr);
        DUET_LOG_WARN("registry: write to %s failed: %s", c->peer, uv_strerror(rc));
        if (c->w != NULL)
            reg_worker_dead(c->reg, c->w, "write to the worker failed");
        else
            reg_conn_close(c);
        return;
    }
    c->writes_pending++;
}

static void reg_on_check(uv_check_t *h)
{
    duet_registry_t *reg = h->data;
    uv_check_stop(h);
    for (reg_conn_t *c = reg->conns, *next; c != NULL; c = next) {
        next = c->next; /* a failed write closes c, which stays listed until its close callback */
        reg_conn_uncork(c);
    }
}

/* Encode env into c's cork (sent at the end of the loop turn). */
static duet_status_t reg_conn_send(reg_conn_t *c, Duet__Envelope *env)
{
    if (c->closing)
        return DUET_ERR_NOT_FOUND;
    if (env->version == 0)
        env->version = DUET_PROTO_VERSION;
    if (c->reg->fake_out != NULL) /* the test seam's socket takes everything at once */
        return duet_frame_append(env, c->reg->fake_out);
    const size_t n = duet_frame_size(env);
    const size_t have = c->cork != NULL ? c->cork->buf.len : 0;
    if (c->cork == NULL || have + n > c->cork->cap) {
        size_t cap = c->cork != NULL ? 2 * c->cork->cap : 4096;
        while (cap < have + n)
            cap *= 2;
        /* not handed to libuv yet: its uv_write_t may move */
        reg_write_t *wr = realloc(c->cork, sizeof(*wr) + cap);
        if (wr == NULL)
            return DUET_FAIL(DUET_ERR_NOMEM, "registry: %zu-byte frame", n);
        wr->cap = cap;
        wr->buf = uv_buf_init((char *)wr->data, (unsigned)have);
        c->cork = wr;
    }
    size_t len = 0;
    duet_status_t st = duet_frame_encode(env, c->cork->data + have, n, &len);
    if (st < 0) {
        if (have == 0) {
            free(c->cork);
            c->cork = NULL;
        }
        return st;
    }
    c->cork->buf.len = (unsigned)(have + len);
    if (have == 0)
        uv_check_start(&c->reg->check, reg_on_check);
    return DUET_OK;
}

/* ------------------------------------------------------------------------------ registration */

static reg_worker_t *reg_find(const duet_registry_t *reg, uint64_t id)
{
    if (id == 0)
        return NULL;
    for (size_t i = 0; i < reg->opts.max_workers; i++)
        if (reg->workers[i].info.id == id)
            return &reg->workers[i];
    return NULL;
}

/* A free slot, else the oldest dead entry, else NULL. */
static reg_worker_t *reg_slot(duet_registry_t *reg)
{
    reg_worker_t *oldest = NULL;
    for (size_t i = 0; i < reg->opts.max_workers; i++) {
        reg_worker_t *w = &reg->workers[i];
        if (w->info.id == 0)
            return w;
        if (w->info.state == DUET_WORKER_STATE_DEAD &&
            (oldest == NULL || w->info.id < oldest->info.id))
            oldest = w;
    }
    return oldest;
}

static void reg_refuse(reg_conn_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void reg_refuse(reg_conn_t *c, const char *fmt, ...)
{
    char reason[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof(reason), fmt, ap);
    va_end(ap);
    DUET_LOG_WARN("registry: refused worker at %s: %s", c->peer, reason);
    Duet__RegisterAck ack = DUET__REGISTER_ACK__INIT;
    ack.accepted = false;
    ack.reason = reason;
    Duet__Envelope env = duet_envelope_register_ack(&ack);
    c->close_after_write = true;
    if (reg_conn_send(c, &env) < 0)
        reg_conn_close(c);
    uv_read_stop((uv_stream_t *)&c->tcp);
}

/* A worker's short word (device, dtype) for operators' output: [A-Za-z0-9_.:-] kept, anything
 * else '?', cut to cap - 1 bytes ("" for NULL). */
static void reg_copy_word(char *dst, size_t cap, const char *src)
{
    size_t n = 0;
    for (; src != NULL && src[n] != '\0' && n + 1 < cap; n++) {
        const char ch = src[n];
        const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                        (ch >= '0' && ch <= '9') || strchr("_.:-", ch) != NULL;
        dst[n] = ok ? ch : '?';
    }
    dst[n] = '\0';
}

static void reg_on_register(duet_registry_t *reg, reg_conn_t *c, const Duet__Register *r)
{
    if (r->version != DUET_PROTO_VERSION) {
        reg_refuse(c, "protocol version %u, the router speaks %u", r->version, DUET_PROTO_VERSION);
        return;
    }
    if (r->role != DUET__WORKER_ROLE__WORKER_ROLE_CTX &&
        r->role != DUET__WORKER_ROLE__WORKER_ROLE_GEN) {
        reg_refuse(c, "role %d is neither ctx (1) nor gen (2)", (int)r->role);
        return;
    }
    const char *fp = r->model_fingerprint != NULL ? r->model_fingerprint : "";
    if (fp[0] == '\0' || strlen(fp) > DUET_REGISTRY_FINGERPRINT_MAX) {
        reg_refuse(c, "model fingerprint missing or longer than %d bytes",
                   DUET_REGISTRY_FINGERPRINT_MAX);
        return;
    }
    if (!(reg->adopt && reg->fingerprint[0] == '\0') && strcmp(fp, reg->fingerprint) != 0) {
        reg_refuse(c, "model fingerprint %s differs from the router's %s", fp, reg->fingerprint);
        return;
    }
    reg_worker_t *w = reg_slot(reg);
    if (w == NULL) {
        reg_refuse(c, "worker table full (%zu workers)", reg->opts.max_workers);
        return;
    }
    if (reg->fingerprint[0] == '\0') {
        snprintf(reg->fingerprint, sizeof(reg->fingerprint), "%s", fp);
        DUET_LOG_INFO("registry: adopted model fingerprint %s from the first worker", fp);
    }
    memset(w, 0, sizeof(*w));
    duet_worker_info_t *i = &w->info;
    i->id = reg->next_id++;
    i->role =
        r->role == DUET__WORKER_ROLE__WORKER_ROLE_CTX ? DUET_WORKER_ROLE_CTX : DUET_WORKER_ROLE_GEN;
    i->state = DUET_WORKER_STATE_UP;
    snprintf(i->name, sizeof(i->name), "%s",
             r->worker_name != NULL && r->worker_name[0] != '\0' ? r->worker_name : "unnamed");
    snprintf(i->peer, sizeof(i->peer), "%s", c->peer);
    if (r->capacity != NULL) {
        i->kv_pages = r->capacity->kv_pages;
        i->page_tokens = r->capacity->page_tokens;
        i->max_seqs = r->capacity->max_seqs;
        i->max_batch_tokens = r->capacity->max_batch_tokens;
    }
    i->free_pages = i->kv_pages;
    i->metrics_port = r->metrics_port <= 65535 ? (uint16_t)r->metrics_port : 0;
    reg_copy_word(i->device, sizeof(i->device), r->device);
    reg_copy_word(i->dtype, sizeof(i->dtype), r->dtype);
    i->started_unix_ms = r->started_unix_ms;
    i->registered_ms = uv_now(reg->loop);
    i->last_heartbeat_ms = i->registered_ms;
    w->conn = c;
    c->w = w;

    Duet__RegisterAck ack = DUET__REGISTER_ACK__INIT;
    ack.accepted = true;
    ack.reason = "";
    ack.worker_id = i->id;
    ack.heartbeat_timeout_ms = reg->opts.heartbeat_timeout_ms;
    Duet__Envelope env = duet_envelope_register_ack(&ack);
    if (reg_conn_send(c, &env) < 0) {
        reg_worker_dead(reg, w, "could not send RegisterAck");
        return;
    }
    DUET_LOG_INFO("registry: worker %llu registered: %s %s at %s, %u pages of %u tokens",
                  (unsigned long long)i->id, duet_worker_role_name(i->role), i->name, i->peer,
                  i->kv_pages, i->page_tokens);
    if (reg->opts.on_worker_up != NULL) {
        duet_worker_info_t copy = *i;
        reg->opts.on_worker_up(&copy, reg->opts.user);
    }
}

static void reg_set_state(duet_registry_t *reg, reg_worker_t *w, duet_worker_state_t st)
{
    if (w->info.state == st || w->info.state == DUET_WORKER_STATE_DEAD)
        return;
    w->info.state = st;
    DUET_LOG_INFO("registry: worker %llu (%s) is %s", (unsigned long long)w->info.id, w->info.name,
                  duet_worker_state_name(st));
    if (reg->opts.on_worker_state != NULL) {
        duet_worker_info_t copy = w->info;
        reg->opts.on_worker_state(&copy, reg->opts.user);
    }
}

/* Copy n counters into out[0..cap) (the rest stay 0); false when the heartbeat carried more. */
static bool reg_copy_counters(uint64_t *out, size_t cap, const uint64_t *in, size_t n)
{
    for (size_t i = 0; i < n && i < cap; i++)
        out[i] = in[i];
    return n <= cap;
}

/*
 * A heartbeat's speculation counters into *now. A worker counting more draft positions than this
 * router knows (DUET_PROTO_SPEC_POSITIONS) is a newer build: the positions it knows are kept, the
 * others dropped, and the operator is told once per worker.
 */
static void reg_spec_counters(reg_worker_t *w, const Duet__Heartbeat *hb, duet_worker_stats_t *now)
{
    bool ok = reg_copy_counters(now->spec_step_tokens, DUET_PROTO_SPEC_POSITIONS + 1,
                                hb->spec_step_tokens, hb->n_spec_step_tokens);
    ok &= reg_copy_counters(now->spec_drafted, DUET_PROTO_SPEC_POSITIONS, hb->spec_drafted,
                            hb->n_spec_drafted);
    ok &= reg_copy_counters(now->spec_accepted, DUET_PROTO_SPEC_POSITIONS, hb->spec_accepted,
                            hb->n_spec_accepted);
    if (!ok && !w->warned_spec) {
        w->warned_spec = true;
        DUET_LOG_WARN("registry: worker %llu (%s) reports speculation counters for more than %u "
                      "draft positions (%zu, %zu, %zu entries): the positions past %u are not "
                      "exported",
                      (unsigned long long)w->info.id, w->info.name, DUET_PROTO_SPEC_POSITIONS,
                      hb->n_spec_step_tokens, hb->n_spec_drafted, hb->n_spec_accepted,
                      DUET_PROTO_SPEC_POSITIONS);
    }
}

static int reg_u64_cmp(const void *a, const void *b)
{
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/*
 * A heartbeat's prefix summary (fields 30-31) replaces the worker's. Peer bytes: a list longer
 * than DUET_PROTO_PREFIX_HASHES or with an unusable block size is a worker this router does not
 * understand, so it keeps no summary of it (placement then treats it as holding nothing).
 */
static void reg_prefix_summary(reg_worker_t *w, const Duet__Heartbeat *hb)
{
    w->n_prefix = 0;
    w->prefix_page_tokens = 0;
    if (hb->n_prefix_hashes == 0)
        return;
    if (hb->n_prefix_hashes > DUET_PROTO_PREFIX_HASHES || hb->prefix_page_tokens == 0 ||
        hb->prefix_page_tokens > DUET_REGISTRY_PREFIX_PAGE_TOKENS_MAX) {
        if (!w->warned_prefix) {
            w->warned_prefix = true;
            DUET_LOG_WARN("registry: worker %llu (%s) sent a prefix summary of %zu hashes over "
                          "blocks of %u tokens (at most %u hashes, blocks of 1..%u): placement "
                          "ignores its cache",
                          (unsigned long long)w->info.id, w->info.name, hb->n_prefix_hashes,
                          hb->prefix_page_tokens, DUET_PROTO_PREFIX_HASHES,
                          DUET_REGISTRY_PREFIX_PAGE_TOKENS_MAX);
        }
        return;
    }
    memcpy(w->prefix, hb->prefix_hashes, hb->n_prefix_hashes * sizeof(*w->prefix));
    qsort(w->prefix, hb->n_prefix_hashes, sizeof(*w->prefix), reg_u64_cmp);
    w->n_prefix = (uint32_t)hb->n_prefix_hashes;
    w->prefix_page_tokens = hb->prefix_page_tokens;
}

/* One decoded Envelope from connection c. Returns false when the connection was closed. */
static bool reg_on_envelope(duet_registry_t *reg, reg_conn_t *c, Duet__Envelope *env)
{
    if (env->version != DUET_PROTO_VERSION) {
        if (c->w == NULL && env->body_case == DUET__ENVELOPE__BODY_REGISTER) {
            reg_refuse(c, "envelope version %u, the router speaks %u", env->version,
                       DUET_PROTO_VERSION);
            return false;
        }
        DUET_LOG_WARN("registry: %s sent envelope version %u (want %u): closing", c->peer,
                      env->version, DUET_PROTO_VERSION);
        goto protocol_error;
    }
    if (c->w == NULL) {
        if (env->body_case != DUET__ENVELOPE__BODY_REGISTER) {
            DUET_LOG_WARN("registry: %s sent body %d before Register: closing", c->peer,
                          (int)env->body_case);
            goto protocol_error;
        }
        reg_on_register(reg, c, env->register_);
        return !c->closing && !c->close_after_write;
    }
    reg_worker_t *w = c->w;
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_HEARTBEAT: {
        const Duet__Heartbeat *hb = env->heartbeat;
        w->info.free_pages = hb->free_pages;
        w->info.free_state_slots = hb->free_state_slots;
        w->info.state_slots = hb->state_slots;
        w->info.running = hb->running;
        w->info.queued = hb->queued;
        w->info.queued_tokens = hb->queued_tokens;
        const uint64_t hb_now = uv_now(reg->loop);
        const double busy =
            isfinite(hb->busy_seconds) && hb->busy_seconds >= 0 ? hb->busy_seconds : 0.0;
        if (hb_now > w->info.last_heartbeat_ms && busy >= w->info.busy_seconds) {
            const double u = (busy - w->info.busy_seconds) /
                             ((double)(hb_now - w->info.last_heartbeat_ms) / 1e3);
            w->info.utilisation = u < 0 ? 0 : u > 1 ? 1 : u;
        }
        w->info.busy_seconds = busy;
        w->info.last_heartbeat_ms = hb_now;
        w->info.cache_plan = (duet_worker_cache_plan_t){
            .budget_bytes = hb->cache_budget_bytes,
            .target_pages = hb->cache_target_pages,
            .target_bytes = hb->cache_target_bytes,
            .draft_pages = hb->cache_draft_pages,
            .draft_bytes = hb->cache_draft_bytes,
        };
        w->info.prefix_entries = hb->prefix_entries;
        w->info.prefix_pages = hb->prefix_pages;
        w->info.prefix_pages_evictable = hb->prefix_pages_evictable;
        duet_worker_stats_t now = {
            .decode_steps = hb->decode_steps,
            .decode_seq_steps = hb->decode_seq_steps,
            .decoded_tokens = hb->decoded_tokens,
            .prefill_tokens = hb->prefill_tokens,
            .suspensions = hb->suspensions,
            .resumes = hb->resumes,
            .prefix_lookups = hb->prefix_lookups,
            .prefix_hits = hb->prefix_hits,
            .prefix_tokens_saved = hb->prefix_tokens_saved,
            .prefix_evictions = hb->prefix_evictions,
            .step_seconds =
                isfinite(hb->step_seconds) && hb->step_seconds >= 0 ? hb->step_seconds : 0.0,
        };
        reg_spec_counters(w, hb, &now);
        reg_prefix_summary(w, hb);
        duet_worker_stats_t *old = &w->info.stats, d;
#define REG_DELTA(f) d.f = now.f >= old->f ? now.f - old->f : now.f
        REG_DELTA(decode_steps);
        REG_DELTA(decode_seq_steps);
        REG_DELTA(decoded_tokens);
        REG_DELTA(prefill_tokens);
        REG_DELTA(suspensions);
        REG_DELTA(resumes);
        REG_DELTA(prefix_lookups);
        REG_DELTA(prefix_hits);
        REG_DELTA(prefix_tokens_saved);
        REG_DELTA(prefix_evictions);
        REG_DELTA(step_seconds);
        for (size_t i = 0; i <= DUET_PROTO_SPEC_POSITIONS; i++)
            REG_DELTA(spec_step_tokens[i]);
        for (size_t j = 0; j < DUET_PROTO_SPEC_POSITIONS; j++) {
            REG_DELTA(spec_drafted[j]);
            REG_DELTA(spec_accepted[j]);
        }
#undef REG_DELTA
        *old = now;
        if (reg->opts.on_stats != NULL)
            reg->opts.on_stats(&w->info, &d, reg->opts.user);
        if (hb->draining)
            reg_set_state(reg, w, DUET_WORKER_STATE_DRAINING);
        return true;
    }
    case DUET__ENVELOPE__BODY_DEREGISTER:
        reg_worker_dead(reg, w, "deregistered");
        return false;
    case DUET__ENVELOPE__BODY_MOVE_PAUSED: /* a running request moving: gen workers only */
    case DUET__ENVELOPE__BODY_MOVED:
        if (w->info.role != DUET_WORKER_ROLE_GEN)
            break;
        /* fall through */
    case DUET__ENVELOPE__BODY_RESERVED:
    case DUET__ENVELOPE__BODY_REFUSED:
    case DUET__ENVELOPE__BODY_TOKENS:
        reg->opts.on_message(w->info.id, env, reg->opts.user);
        return !c->closing;
    default:
        break;
    }
    DUET_LOG_WARN("registry: worker %llu (%s) sent body %d, which it may not send: closing",
                  (unsigned long long)w->info.id, w->info.name, (int)env->body_case);
    reg_worker_dead(reg, w, "protocol error (unexpected message)");
    return false;
protocol_error:
    if (c->w != NULL)
        reg_worker_dead(reg, c->w, "protocol error");
    else
        reg_conn_close(c);
    return false;
}

/* ------------------------------------------------------------------------------ reading */

static void reg_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    static char slab[65536]; /* the loop is single-threaded and reads are consumed at once */
    (void)h;
    (void)hint;
    *buf = uv_buf_init(slab, sizeof(slab));
}

static void reg_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    reg_conn_t *c = s->data;
    duet_registry_t *reg = c->reg;
    if (nread == 0 || c->closing)
        return;
    if (nread < 0) {
        const char *why = nread == UV_EOF ? "connection closed" : uv_strerror((int)nread);
        if (c->w != NULL)
            reg_worker_dead(reg, c->w, why);
        else
            reg_conn_close(c);
        return;
    }
    const uint8_t *p = (const uint8_t *)buf->base;
    size_t n = (size_t)nread;
    while (n > 0 && !c->closing && !c->close_after_write) {
        size_t used = 0;
        Duet__Envelope *env = NULL;
        duet_status_t st = duet_frame_decoder_feed(&c->dec, p, n, &used, &env);
        if (st < 0) {
            DUET_LOG_WARN("registry: malformed frame from %s (%s): closing", c->peer,
                          duet_error_last());
            if (c->w != NULL)
                reg_worker_dead(reg, c->w, "malformed frame");
            else
                reg_conn_close(c);
            return;
        }
        p += used;
        n -= used;
        if (env != NULL) {
            bool open = reg_on_envelope(reg, c, env);
            duet_envelope_free(env);
            if (!open)
                return;
        }
    }
}

/* A connection's struct, decoder and handle, linked first in reg->conns; NULL when out of memory.
 */
static reg_conn_t *reg_conn_new(duet_registry_t *reg)
{
    reg_conn_t *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->reg = reg;
    if (duet_frame_decoder_init(&c->dec, reg->opts.max_frame) < 0 ||
        uv_tcp_init(reg->loop, &c->tcp) < 0) {
        duet_frame_decoder_free(&c->dec);
        free(c);
        return NULL;
    }
    c->tcp.data = c;
    reg->open_handles++;
    c->next = reg->conns;
    if (reg->conns != NULL)
        reg->conns->prev = c;
    reg->conns = c;
    c->connected_ms = uv_now(reg->loop);
    return c;
}

static void reg_on_connection(uv_stream_t *server, int status)
{
    duet_registry_t *reg = server->data;
    if (status < 0) {
        DUET_LOG_WARN("registry: accept: %s", uv_strerror(status));
        return;
    }
    reg_conn_t *c = reg_conn_new(reg);
    if (c == NULL)
        return;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0) {
        reg_conn_close(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    struct sockaddr_storage ss;
    int len = sizeof(ss);
    snprintf(c->peer, sizeof(c->peer), "?");
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &len) == 0) {
        char ip[48] = "?";
        int port = 0;
        if (ss.ss_family == AF_INET) {
            uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof(ip));
            port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
            snprintf(c->peer, sizeof(c->peer), "%s:%d", ip, port);
        } else if (ss.ss_family == AF_INET6) {
            uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof(ip));
            port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
            snprintf(c->peer, sizeof(c->peer), "[%s]:%d", ip, port);
        }
    }
    if (uv_read_start((uv_stream_t *)&c->tcp, reg_alloc, reg_read) < 0)
        reg_conn_close(c);
}

/* Heartbeat deadlines of workers and Register deadlines of fresh connections. */
static void reg_tick(uv_timer_t *t)
{
    duet_registry_t *reg = t->data;
    uint64_t now = uv_now(reg->loop);
    uint64_t to = reg->opts.heartbeat_timeout_ms;
    for (size_t i = 0; i < reg->opts.max_workers; i++) {
        reg_worker_t *w = &reg->workers[i];
        if (w->info.id != 0 && w->info.state != DUET_WORKER_STATE_DEAD &&
            now - w->info.last_heartbeat_ms > to) {
            char why[96];
            snprintf(why, sizeof(why), "heartbeat timeout (none for %llu ms)",
                     (unsigned long long)(now - w->info.last_heartbeat_ms));
            reg_worker_dead(reg, w, why);
        }
    }
    for (reg_conn_t *c = reg->conns; c != NULL; c = c->next)
        if (c->w == NULL && !c->closing && now - c->connected_ms > to) {
            DUET_LOG_WARN("registry: %s did not register within %llu ms: closing", c->peer,
                          (unsigned long long)to);
            reg_conn_close(c);
        }
}

/* ------------------------------------------------------------------------------ public */

static void reg_handle_closed(uv_handle_t *h)
{
    duet_registry_t *reg = h->data;
    reg->open_handles--;
    reg_maybe_freed(reg);
}

/* The registry without its listener and timer: options, fingerprint, the worker table. */
static duet_status_t reg_new(uv_loop_t *loop, const duet_registry_options_t *opts,
                             duet_registry_t **reg_p)
{
    if (opts->on_message == NULL || opts->heartbeat_timeout_ms == 0 || opts->host == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "registry: on_message, host and a timeout are required");
    duet_registry_t *reg = calloc(1, sizeof(*reg));
    if (reg == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "registry");
    reg->loop = loop;
    reg->opts = *opts;
    if (reg->opts.max_workers == 0)
        reg->opts.max_workers = 256;
    snprintf(reg->host, sizeof(reg->host), "%s", opts->host);
    reg->opts.host = reg->host;
    reg->adopt = opts->fingerprint == NULL || opts->fingerprint[0] == '\0';
    if (!reg->adopt) {
        if (strlen(opts->fingerprint) > DUET_REGISTRY_FINGERPRINT_MAX) {
            free(reg);
            return DUET_FAIL(DUET_ERR_RANGE, "registry: fingerprint longer than %d bytes",
                             DUET_REGISTRY_FINGERPRINT_MAX);
        }
        snprintf(reg->fingerprint, sizeof(reg->fingerprint), "%s", opts->fingerprint);
    }
    reg->opts.fingerprint = NULL;
    reg->next_id = 1;
    reg->workers = calloc(reg->opts.max_workers, sizeof(*reg->workers));
    if (reg->workers == NULL) {
        free(reg);
        return DUET_FAIL(DUET_ERR_NOMEM, "registry: worker table");
    }
    *reg_p = reg;
    return DUET_OK;
}

duet_status_t duet_registry_start(uv_loop_t *loop, const duet_registry_options_t *opts,
                                  duet_registry_t **reg_p)
{
    duet_registry_t *reg = NULL;
    duet_status_t st = reg_new(loop, opts, &reg);
    if (st < 0)
        return st;
    struct sockaddr_storage addr;
    if (uv_ip4_addr(reg->host, opts->port, (struct sockaddr_in *)&addr) != 0 &&
        uv_ip6_addr(reg->host, opts->port, (struct sockaddr_in6 *)&addr) != 0) {
        free(reg->workers);
        free(reg);
        return DUET_FAIL(DUET_ERR_INVALID, "registry: bad address %s", opts->host);
    }
    uv_tcp_init(loop, &reg->listener);
    reg->listener.data = reg;
    reg->open_handles++;
    int rc = uv_tcp_bind(&reg->listener, (struct sockaddr *)&addr, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&reg->listener, 128, reg_on_connection);
    if (rc < 0) {
        st = DUET_FAIL(DUET_ERR_IO, "registry: cannot listen on %s:%u: %s", reg->host, opts->port,
                       uv_strerror(rc));
        reg->closing = true;
        uv_close((uv_handle_t *)&reg->listener, reg_handle_closed);
        return st;
    }
    struct sockaddr_storage bound;
    int blen = sizeof(bound);
    uv_tcp_getsockname(&reg->listener, (struct sockaddr *)&bound, &blen);
    reg->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                  : ((struct sockaddr_in *)&bound)->sin_port);
    uv_timer_init(loop, &reg->timer);
    reg->timer.data = reg;
    reg->open_handles++;
    uv_check_init(loop, &reg->check);
    reg->check.data = reg;
    reg->open_handles++;
    uint64_t period = opts->heartbeat_timeout_ms / 4;
    if (period < 10)
        period = 10;
    if (period > 250)
        period = 250;
    uv_timer_start(&reg->timer, reg_tick, period, period);
    DUET_LOG_INFO(
        "registry: listening for workers on %s:%u (heartbeat timeout %u ms, fingerprint %s)",
        reg->host, reg->port, opts->heartbeat_timeout_ms,
        reg->adopt ? "adopted from the first worker" : reg->fingerprint);
    *reg_p = reg;
    return DUET_OK;
}

duet_status_t duet__registry_start_fake(uv_loop_t *loop, const duet_registry_options_t *opts,
                                        duet_strbuf_t *out, duet_registry_t **reg_p)
{
    if (out == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "registry: the fake needs an output buffer");
    duet_registry_t *reg = NULL;
    duet_status_t st = reg_new(loop, opts, &reg);
    if (st < 0)
        return st;
    reg->fake_out = out;
    uv_tcp_init(loop, &reg->listener); /* never bound: closed with the registry */
    reg->listener.data = reg;
    uv_timer_init(loop, &reg->timer); /* never started: heartbeats do not time out */
    reg->timer.data = reg;
    uv_check_init(loop, &reg->check); /* never started: the fake writes at once */
    reg->check.data = reg;
    reg->open_handles = 3;
    *reg_p = reg;
    return DUET_OK;
}

bool duet__registry_feed(duet_registry_t *reg, const uint8_t *data, size_t len)
{
    DUET_ASSERT(reg->fake_out != NULL);
    if (reg->closing)
        return false;
    reg_conn_t *c = reg->conns;
    if (c != NULL && !c->closing && c->close_after_write) {
        reg_conn_close(c); /* refused: its ack went out at once, so it closes now */
        return false;
    }
    if (c == NULL || c->closing) {
        if (len == 0)
            return false;
        c = reg_conn_new(reg);
        if (c == NULL)
            return false;
        snprintf(c->peer, sizeof(c->peer), "fake:%d", reg->open_handles);
    }
    uv_buf_t buf = uv_buf_init((char *)data, (unsigned)len);
    reg_read((uv_stream_t *)&c->tcp, len > 0 ? (ssize_t)len : UV_EOF, &buf);
    return true;
}

uint16_t duet_registry_port(const duet_registry_t *reg)
{
    return reg->port;
}

const char *duet_registry_fingerprint(const duet_registry_t *reg)
{
    return reg->fingerprint;
}

void duet_registry_close(duet_registry_t *reg, duet_registry_close_cb cb, void *user)
{
    DUET_ASSERT(!reg->closing);
    reg->closing = true;
    reg->close_cb = cb;
    reg->close_user = user;
    for (size_t i = 0; i < reg->opts.max_workers; i++) {
        reg_worker_t *w = &reg->workers[i];
        if (w->conn != NULL) {
            w->conn->w = NULL;
            w->conn = NULL;
        }
        if (w->info.id != 0)
            w->info.state = DUET_WORKER_STATE_DEAD;
    }
    for (reg_conn_t *c = reg->conns; c != NULL; c = c->next) {
        reg_conn_uncork(c); /* what this turn sent (a Cancel) still goes out */
        reg_conn_close(c);
    }
    uv_timer_stop(&reg->timer);
    uv_close((uv_handle_t *)&reg->timer, reg_handle_closed);
    uv_close((uv_handle_t *)&reg->check, reg_handle_closed);
    uv_close((uv_handle_t *)&reg->listener, reg_handle_closed);
}

duet_status_t duet_registry_send(duet_registry_t *reg, uint64_t worker_id, Duet__Envelope *env)
{
    reg_worker_t *w = reg_find(reg, worker_id);
    if (w == NULL || w->conn == NULL || w->info.state == DUET_WORKER_STATE_DEAD)
        return duet_error_set(DUET_ERR_NOT_FOUND, "worker %llu is not connected",
                              (unsigned long long)worker_id);
    duet_status_t st = reg_conn_send(w->conn, env);
    if (st < 0)
        reg_worker_dead(reg, w, "write to the worker failed");
    return st;
}

duet_status_t duet_registry_set_draining(duet_registry_t *reg, uint64_t worker_id, bool draining)
{
    reg_worker_t *w = reg_find(reg, worker_id);
    if (w == NULL || w->info.state == DUET_WORKER_STATE_DEAD)
        return duet_error_set(DUET_ERR_NOT_FOUND, "worker %llu is not live",
                              (unsigned long long)worker_id);
    Duet__Drain d = DUET__DRAIN__INIT;
    Duet__Undrain u = DUET__UNDRAIN__INIT;
    Duet__Envelope env = draining ? duet_envelope_drain(&d) : duet_envelope_undrain(&u);
    duet_status_t st = duet_registry_send(reg, worker_id, &env);
    if (st < 0)
        return st;
    reg_set_state(reg, w, draining ? DUET_WORKER_STATE_DRAINING : DUET_WORKER_STATE_UP);
    return DUET_OK;
}

void duet_registry_kill(duet_registry_t *reg, uint64_t worker_id, const char *reason)
{
    reg_worker_t *w = reg_find(reg, worker_id);
    if (w != NULL)
        reg_worker_dead(reg, w, reason);
}

void duet_registry_inflight_add(duet_registry_t *reg, uint64_t worker_id, int delta)
{
    reg_worker_t *w = reg_find(reg, worker_id);
    if (w == NULL || w->info.state == DUET_WORKER_STATE_DEAD)
        return;
    if (delta < 0 && w->info.inflight < (uint32_t)-delta)
        w->info.inflight = 0;
    else
        w->info.inflight = (uint32_t)((int64_t)w->info.inflight + delta);
}

duet_status_t duet_registry_get(const duet_registry_t *reg, uint64_t worker_id,
                                duet_worker_info_t *info_p)
{
    const reg_worker_t *w = reg_find(reg, worker_id);
    if (w == NULL)
        return duet_error_set(DUET_ERR_NOT_FOUND, "no worker %llu", (unsigned long long)worker_id);
    *info_p = w->info;
    return DUET_OK;
}

size_t duet_registry_count(const duet_registry_t *reg, int role, duet_worker_state_t state)
{
    size_t n = 0;
    for (size_t i = 0; i < reg->opts.max_workers; i++) {
        const duet_worker_info_t *w = &reg->workers[i].info;
        if (w->id != 0 && w->state == state && (role == 0 || (int)w->role == role))
            n++;
    }
    return n;
}

void duet_registry_foreach(const duet_registry_t *reg, duet_registry_worker_cb cb, void *user)
{
    uint64_t last = 0;
    for (;;) { /* id order without sorting: the smallest id above the last one visited */
        const reg_worker_t *next = NULL;
        for (size_t i = 0; i < reg->opts.max_workers; i++) {
            const reg_worker_t *w = &reg->workers[i];
            if (w->info.id > last && (next == NULL || w->info.id < next->info.id))
                next = w;
        }
        if (next == NULL)
            return;
        duet_worker_info_t copy = next->info;
        last = copy.id;
        cb(&copy, user);
    }
}

size_t duet_registry_candidates(const duet_registry_t *reg, duet_placement_candidate_t *out,
                                size_t cap)
{
    size_t n = 0;
    for (size_t i = 0; i < reg->opts.max_workers && n < cap; i++) {
        const duet_worker_info_t *w = &reg->workers[i].info;
        if (w->id == 0 || w->state == DUET_WORKER_STATE_DEAD)
            continue;
        out[n].id = w->id;
        out[n].role = w->role;
        out[n].state = w->state;
        out[n].free_pages = w->free_pages;
        out[n].queued_tokens = w->queued_tokens;
        out[n].inflight = w->inflight;
        out[n].cached_tokens = 0;
        n++;
    }
    return n;
}

void duet_prefix_prompt_init(duet_prefix_prompt_t *pp, const uint32_t *tokens, size_t n_tokens)
{
    memset(pp, 0, sizeof(*pp));
    pp->tokens = tokens;
    pp->n_tokens = n_tokens;
}

void duet_prefix_prompt_free(duet_prefix_prompt_t *pp)
{
    for (size_t i = 0; i < pp->n_chains; i++)
        free(pp->chain[i].hashes);
    pp->n_chains = 0;
}

/* pp's chain over blocks of page_tokens, computed now when it is the first of that size; NULL
 * when there is no room for another size. */
static const uint64_t *reg_prompt_chain(duet_prefix_prompt_t *pp, uint32_t page_tokens, size_t *n_p)
{
    size_t i = 0;
    while (i < pp->n_chains && pp->chain[i].page_tokens != page_tokens)
        i++;
    if (i == pp->n_chains) {
        if (i == DUET_REGISTRY_PREFIX_CHAINS)
            return NULL;
        pp->n_chains++;
        pp->chain[i].page_tokens = page_tokens;
        pp->chain[i].n = 0;
        /* whole blocks that leave a token after them (duet_prefix_hash_chain) */
        size_t max = pp->n_tokens > 0 ? (pp->n_tokens - 1) / page_tokens : 0;
        pp->chain[i].hashes = max > 0 ? malloc(max * sizeof(uint64_t)) : NULL;
        if (pp->chain[i].hashes != NULL)
            pp->chain[i].n =
                duet_prefix_hash_chain((const int32_t *)pp->tokens, (int64_t)pp->n_tokens,
                                       page_tokens, pp->chain[i].hashes, max);
    }
    *n_p = pp->chain[i].n;
    return pp->chain[i].hashes;
}

/* The longest k whose chain[k - 1] is in w's summary (0: none). */
static size_t reg_prefix_match(const reg_worker_t *w, const uint64_t *chain, size_t n)
{
    for (size_t k = n; k > 0; k--)
        if (bsearch(&chain[k - 1], w->prefix, w->n_prefix, sizeof(*w->prefix), reg_u64_cmp))
            return k;
    return 0;
}

void duet_registry_prefix_cached(const duet_registry_t *reg, duet_worker_role_t role,
                                 duet_prefix_prompt_t *pp, duet_placement_candidate_t *c, size_t n)
{
    size_t at = 0; /* candidates come in table order: each search starts where the last ended */
    for (size_t j = 0; j < n; j++) {
        c[j].cached_tokens = 0;
        if (c[j].role != role || c[j].id == 0)
            continue;
        const reg_worker_t *w = NULL;
        for (size_t s = 0; s < reg->opts.max_workers && w == NULL; s++) {
            const reg_worker_t *x = &reg->workers[(at + s) % reg->opts.max_workers];
            if (x->info.id == c[j].id) {
                w = x;
                at = (at + s) % reg->opts.max_workers;
            }
        }
        if (w == NULL || w->n_prefix == 0)
            continue;
        size_t n_chain = 0;
        const uint64_t *chain = reg_prompt_chain(pp, w->prefix_page_tokens, &n_chain);
        if (chain != NULL)
            c[j].cached_tokens =
                (uint64_t)reg_prefix_match(w, chain, n_chain) * w->prefix_page_tokens;
    }
}
