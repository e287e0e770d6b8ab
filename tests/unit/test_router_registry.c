/*
 * router/cluster/registry.c over loopback: the registry runs on a libuv loop in a thread, the test
 * plays workers with blocking sockets. Registration accepted and refused (version, role,
 * fingerprint, adopt-the-first), heartbeat loss marks dead and closes, heartbeats keep alive,
 * malformed frames close only their own connection, deregister, drain/undrain sends the messages,
 * messages reach on_message, the prefix summaries heartbeats carry (kept, matched against a
 * prompt, replaced, cleared; malformed ones kept as none, the worker untouched), and the
 * fingerprint hash against NIST vectors.
 */
#include <criterion/criterion.h>

#include "common/fingerprint.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "common/prefix_hash.h"
#include "proto/frame.h"
#include "router/cluster/registry.h"

/* ---------------------------------------------------------------- the loop thread */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char events[64][160]; /* "up 1 gen", "down 1 heartbeat timeout ...", "msg 1 25 rid=7" */
    int n_events;
} ev_log_t;

static uv_loop_t loop;
static uv_async_t wake;
static pthread_t thr;
static duet_registry_t *reg;
static ev_log_t evl;
static int stop_flag;
static void (*job_fn)(void *);
static void *job_arg;
static int job_done;

static void ev_add(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void ev_add(const char *fmt, ...)
{
    pthread_mutex_lock(&evl.mu);
    if (evl.n_events < 64) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(evl.events[evl.n_events++], 160, fmt, ap);
        va_end(ap);
    }
    pthread_cond_broadcast(&evl.cv);
    pthread_mutex_unlock(&evl.mu);
}

static void on_up(const duet_worker_info_t *w, void *u)
{
    ev_add("up %llu %s %s", (unsigned long long)w->id, duet_worker_role_name(w->role), w->name);
}
static void on_down(const duet_worker_info_t *w, const char *reason, void *u)
{
    ev_add("down %llu %s", (unsigned long long)w->id, reason);
}
static void on_state(const duet_worker_info_t *w, void *u)
{
    ev_add("state %llu %s", (unsigned long long)w->id, duet_worker_state_name(w->state));
}
static int log_heartbeats; /* start() with on_stats: "hb ID N" for a worker's Nth heartbeat */
static int n_heartbeats[8];
static void on_stats(const duet_worker_info_t *w, const duet_worker_stats_t *d, void *u)
{
    ev_add("hb %llu %d", (unsigned long long)w->id, ++n_heartbeats[w->id % 8]);
}
static void on_msg(uint64_t id, const Duet__Envelope *env, void *u)
{
    uint64_t rid = env->body_case == DUET__ENVELOPE__BODY_TOKENS ? env->tokens->request_id : 0;
    ev_add("msg %llu %d rid=%llu", (unsigned long long)id, (int)env->body_case,
           (unsigned long long)rid);
}

static void on_wake(uv_async_t *a)
{
    pthread_mutex_lock(&evl.mu);
    void (*fn)(void *) = job_fn;
    void *arg = job_arg;
    job_fn = NULL;
    pthread_mutex_unlock(&evl.mu);
    if (fn != NULL) {
        fn(arg);
        pthread_mutex_lock(&evl.mu);
        job_done = 1;
        pthread_cond_broadcast(&evl.cv);
        pthread_mutex_unlock(&evl.mu);
    }
    if (stop_flag) {
        duet_registry_close(reg, NULL, NULL);
        uv_close((uv_handle_t *)&wake, NULL);
    }
}

/* Run fn(arg) on the loop thread and wait for it. */
static void on_loop(void (*fn)(void *), void *arg)
{
    pthread_mutex_lock(&evl.mu);
    job_fn = fn;
    job_arg = arg;
    job_done = 0;
    pthread_mutex_unlock(&evl.mu);
    uv_async_send(&wake);
    pthread_mutex_lock(&evl.mu);
    while (!job_done)
        pthread_cond_wait(&evl.cv, &evl.mu);
    pthread_mutex_unlock(&evl.mu);
}

static void *loop_main(void *arg)
{
    uv_run(&loop, UV_RUN_DEFAULT);
    return NULL;
}

static uint16_t start(const char *fingerprint, uint32_t timeout_ms)
{
    duet_log_set_level(DUET_LOG_LEVEL_ERROR);
    memset(&evl, 0, sizeof(evl));
    pthread_mutex_init(&evl.mu, NULL);
    pthread_cond_init(&evl.cv, NULL);
    stop_flag = 0;
    uv_loop_init(&loop);
    uv_async_init(&loop, &wake, on_wake);
    duet_registry_options_t o;
    duet_registry_options_default(&o);
    o.fingerprint = fingerprint;
    o.heartbeat_timeout_ms = timeout_ms;
    o.on_worker_up = on_up;
    o.on_worker_down = on_down;
    o.on_worker_state = on_state;
    o.on_message = on_msg;
    o.on_stats = log_heartbeats ? on_stats : NULL;
    memset(n_heartbeats, 0, sizeof(n_heartbeats));
    cr_assert_eq(duet_registry_start(&loop, &o, &reg), DUET_OK, "%s", duet_error_last());
    uint16_t port = duet_registry_port(reg);
    pthread_create(&thr, NULL, loop_main, NULL);
    return port;
}

static void stop(void)
{
    stop_flag = 1;
    uv_async_send(&wake);
    pthread_join(thr, NULL);
    cr_assert_eq(uv_loop_close(&loop), 0, "every handle closed");
}

/* Wait until an event starting with `prefix` exists; returns its text or NULL after ms. */
static const char *wait_event(const char *prefix, int ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&evl.mu);
    const char *hit = NULL;
    for (;;) {
        for (int i = 0; i < evl.n_events && hit == NULL; i++)
            if (strncmp(evl.events[i], prefix, strlen(prefix)) == 0)
                hit = evl.events[i];
        if (hit != NULL || pthread_cond_timedwait(&evl.cv, &evl.mu, &ts) != 0)
            break;
    }
    pthread_mutex_unlock(&evl.mu);
    return hit;
}

/* ---------------------------------------------------------------- a worker on a socket */

static int wconnect(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    return fd;
}

static void wsend(int fd, Duet__Envelope *env)
{
    if (env->version == 0)
        env->version = DUET_PROTO_VERSION;
    uint8_t buf[4096];
    size_t n = 0;
    cr_assert_eq(duet_frame_encode(env, buf, sizeof(buf), &n), DUET_OK);
    cr_assert_eq(write(fd, buf, n), (ssize_t)n);
}

/* Next Envelope, or NULL on EOF / timeout (*closed_p = 1 on EOF). */
static Duet__Envelope *wrecv(int fd, int ms, int *closed_p)
{
    duet_frame_decoder_t d;
    duet_frame_decoder_init(&d, 0);
    Duet__Envelope *env = NULL;
    *closed_p = 0;
    while (env == NULL) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, ms) <= 0)
            break;
        uint8_t b;
        ssize_t r = read(fd, &b, 1); /* one byte at a time: never read past one frame */
        if (r <= 0) {
            *closed_p = 1;
            break;
        }
        size_t used;
        if (duet_frame_decoder_feed(&d, &b, 1, &used, &env) < 0)
            break;
    }
    duet_frame_decoder_free(&d);
    return env;
}

static int wait_closed(int fd, int ms)
{
    int closed = 0;
    Duet__Envelope *e;
    while ((e = wrecv(fd, ms, &closed)) != NULL)
        duet_envelope_free(e);
    return closed;
}

static void send_register(int fd, int role, uint32_t version, const char *fp, const char *name)
{
    Duet__Capacity cap = DUET__CAPACITY__INIT;
    cap.kv_pages = 100;
    cap.page_tokens = 16;
    Duet__Register r = DUET__REGISTER__INIT;
    r.role = role;
    r.version = version;
    r.model_fingerprint = (char *)fp;
    r.worker_name = (char *)name;
    r.capacity = &cap;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case = DUET__ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    wsend(fd, &env);
}

/* Register and return the ack (accepted or not); the caller frees it. */
static Duet__Envelope *do_register(int fd, int role, uint32_t version, const char *fp)
{
    send_register(fd, role, version, fp, "w");
    int closed;
    Duet__Envelope *ack = wrecv(fd, 2000, &closed);
    cr_assert_not_null(ack, "no RegisterAck");
    cr_assert_eq(ack->body_case, DUET__ENVELOPE__BODY_REGISTER_ACK);
    return ack;
}

static void send_heartbeat(int fd, uint32_t free_pages)
{
    Duet__Heartbeat hb = DUET__HEARTBEAT__INIT;
    hb.free_pages = free_pages;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case = DUET__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    wsend(fd, &env);
}

/* ---------------------------------------------------------------- tests */

#define FP "sha256:aaaa"

Test(registry, register_accepted_gets_an_id, .timeout = 20)
{
    uint16_t port = start(FP, 5000);
    int fd = wconnect(port);
    Duet__Envelope *ack =
        do_register(fd, DUET__WORKER_ROLE__WORKER_ROLE_GEN, DUET_PROTO_VERSION, FP);
    cr_assert(ack->register_ack->accepted, "%s", ack->register_ack->reason);
    cr_assert_eq(ack->register_ack->worker_id, 1);
    duet_envelope_free(ack);
    cr_assert_not_null(wait_event("up 1 gen w", 2000));
    close(fd);
    cr_assert_not_null(wait_event("down 1 connection closed", 2000));
    stop();
}

static void refused_case(int role, uint32_t version, const char *fp, const char *want)
{
    uint16_t port = start(FP, 5000);
    int fd = wconnect(port);
    Duet__Envelope *ack = do_register(fd, role, version, fp);
    cr_assert_not(ack->register_ack->accepted);
    cr_assert_eq(ack->register_ack->worker_id, 0);
    cr_assert(strstr(ack->register_ack->reason, want) != NULL, "reason: %s",
              ack->register_ack->reason);
    duet_envelope_free(ack);
    cr_assert(wait_closed(fd, 2000), "a refused worker is closed");
    cr_assert_null(wait_event("up", 100));
    close(fd);
    stop();
}

Test(registry, refused_on_version_mismatch, .timeout = 20)
{
    refused_case(DUET__WORKER_ROLE__WORKER_ROLE_GEN, DUET_PROTO_VERSION + 1, FP, "version");
}

Test(registry, refused_on_fingerprint_mismatch, .timeout = 20)
{
    refused_case(DUET__WORKER_ROLE__WORKER_ROLE_CTX, DUET_PROTO_VERSION, "sha256:bbbb",
                 "fingerprint sha256:bbbb differs");
}

Test(registry, refused_on_bad_role, .timeout = 20)
{
    refused_case(0, DUET_PROTO_VERSION, FP, "role");
}

Test(registry, adopts_the_first_fingerprint, .timeout = 20)
{
    uint16_t port = start(NULL, 5000);
    int a = wconnect(port);
    Duet__Envelope *ack =
        do_register(a, DUET__WORKER_ROLE__WORKER_ROLE_GEN, DUET_PROTO_VERSION, "fp-x");
    cr_assert(ack->register_ack->accepted);
    duet_envelope_free(ack);
    int b = wconnect(port);
    ack = do_register(b, DUET__WORKER_ROLE__WORKER_ROLE_CTX, DUET_PROTO_VERSION, "fp-y");
    cr_assert_not(ack->register_ack->accepted);
    cr_assert(strstr(ack->register_ack->reason, "fp-x") != NULL);
    duet_envelope_free(ack);
    int c = wconnect(port);
    ack = do_register(c, DUET__WORKER_ROLE__WORKER_ROLE_CTX, DUET_PROTO_VERSION, "fp-x");
    cr_assert(ack->register_ack->accepted);
    cr_assert_eq(ack->register_ack->worker_id, 2);
    duet_envelope_free(ack);
    close(a);
    close(b);
    close(c);
    stop();
}

Test(registry, heartbeat_loss_marks_dead_and_closes, .timeout = 20)
{
    uint16_t port = start(FP, 300);
    int a = wconnect(port); /* heartbeats */
    int b = wconnect(port); /* goes silent */
    Duet__Envelope *ack =
        do_register(a, DUET__WORKER_ROLE__WORKER_ROLE_GEN, DUET_PROTO_VERSION, FP);
    duet_envelope_free(ack);
    ack = do_register(b, DUET__WORKER_ROLE__WORKER_ROLE_GEN, DUET_PROTO_VERSION, FP);
    duet_envelope_free(ack);
    for (int i = 0; i < 16; i++) { /* 800 ms, well past the timeout */
        send_heartbeat(a, 50);
        usleep(50000);
    }
    const char *d = wait_event("down 2", 2000);
    cr_assert_not_null(d);
    cr_assert(strstr(d, "heartbeat timeout") != NULL, "%s", d);
    cr_assert(wait_closed(b, 2000), "the silent worker's connection is closed");
    cr_assert_null(wait_event("down 1", 10), "the heartbeating worker stays up");
    close(a);
    close(b);
    stop();
}

Test(registry, unregistered_connection_times_out, .timeout = 20)
{
    uint16_t port = start(FP, 200);
    int fd = wconnect(port);
    cr_assert(wait_closed(fd, 3000));
    close(fd);
    stop();
}

Test(registry, malformed_frames_close_only_that_connection, .timeout = 30)
{
    uint16_t port = start(FP, 5000);
    int good = wconnect(port);
    Duet__Envelope *ack =
        do_register(good, DUET__WORKER_ROLE__WORKER_ROLE_GEN, DUET_PROTO_VERSION, FP);
    duet_envelope_free(ack);
    /* garbage of several kinds, each on its own connection, registered or not */
    static const uint8_t huge[] = {0xff, 0xff, 0xff, 0xff, 1, 2, 3};
    static const uint8_t zero[] = {0, 0, 0, 0};
    static const uint8_t junk[] = {0, 0, 0, 3, 0xff, 0xff, 0xff};
    const uint8_t *bad[] = {huge, zero, junk};
    size_t badn[] = {sizeof(huge), sizeof(zero), sizeof(junk)};
    for (int registered = 0; registered < 2; registered++)
        for (int k = 0; k < 3; k++) {
            int fd = wconnect(port);
            if (registered) {
                ack = do_register(fd, DUET__WORKER_ROLE__WORKER_ROLE_CTX, DUET_PROTO_VERSION, FP);
                cr_assert(ack->register_ack->accepted);
                duet_envelope_free(ack);
            }
            cr_assert_eq(write(fd, bad[k], badn[k]), (ssize_t)badn[k]);
            cr_assert(wait_closed(fd, 2000), "garbage kind %d closes the connection", k);
            close(fd);
        }
    /* a body a worker may not send, and a wrong envelope version, also close */
    int fd = wconnect(port);
    Duet__Envelope *ack2 =
        do_register(fd, DUET__WORKER_ROLE__WORKER_ROLE_CTX, DUET_PROTO_VERSION, FP);
    duet_envelope_free(ack2);
    Duet__Cancel cn = DUET__CANCEL__INIT;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case = DUET__ENVELOPE__BODY_CANCEL;
    env.cancel = &cn;
    wsend(fd, &env);
    cr_assert(wait_closed(fd, 2000));
    close(fd);
    fd = wconnect(port);
    ack2 = do_register(fd, DUET__WORKER_ROLE__WORKER_ROLE_CTX, DUET_PROTO_VERSION, FP);
    duet_envelope_free(ack2);
    send_heartbeat(fd, 1);
    Duet__Heartbeat hb = DUET__HEARTBEAT__INIT;
    Duet__Envelope env2 = DUET__ENVELOPE__INIT;
    env2.version = DUET_PROTO_VERSION + 7;
    env2.body_case = DUET__ENVELOPE__BODY_HEARTBEAT;
    env2.heartbeat = &hb;
    wsend(fd, &env2);
    cr_assert(wait_closed(fd, 2000));
    close(fd);

    /* the good worker still talks: its Tokens reach on_message */
    Duet__Tokens t = DUET__TOKENS__INIT;
    t.request_id = 77;
    Duet__Envelope te = DUET__ENVELOPE__INIT;
    te.body_case = DUET__ENVELOPE__BODY_TOKENS;
    te.tokens = &t;
    wsend(good, &te);
    cr_assert_not_null(wait_event("msg 1 25 rid=77", 2000));
    cr_assert_null(wait_event("down 1 ", 10), "the good worker was not touched");
    close(good);
    stop();
}

static void job_drain(void *arg)
{
    uint64_t id = *(uint64_t *)arg;
    cr_assert_eq(duet_registry_set_draining(reg, id, true), DUET_OK);
    cr_assert_eq(duet_registry_count(reg, DUET_WORKER_ROLE_GEN, DUET_WORKER_STATE_DRAINING), 1);
    duet_placement_candidate_t c[4];
    size_t n = duet_registry_candidates(reg, c, 4);
    cr_assert_eq(n, 1);
    cr_assert_eq(c[0].state, DUET_WORKER_STATE_DRAINING);
}

static void job_undrain(void *arg)
{
    uint64_t id = *(uint64_t *)arg;
    cr_assert_eq(duet_registry_set_draining(reg, id, false), DUET_OK);
    cr_assert_eq(duet_registry_count(reg, DUET_WORKER_ROLE_GEN, DUET_WORKER_STATE_UP), 1);
    cr_assert_eq(duet_registry_set_draining(reg, 99, true), DUET_ERR_NOT_FOUND);
}

Test(registry, drain_undrain_and_deregister, .timeout = 20)
{
    uint16_t port = start(FP, 5000);
    int fd = wconnect(port);
    Duet__Envelope *ack =
        do_register(fd, DUET__WORKER_ROLE__WORKER_ROLE_GEN, DUET_PROTO_VERSION, FP);
    uint64_t id = ack->register_ack->worker_id;
    duet_envelope_free(ack);
    on_loop(job_drain, &id);
    int closed;
    Duet__Envelope *m = wrecv(fd, 2000, &closed);
    cr_assert_not_null(m);
    cr_assert_eq(m->body_case, DUET__ENVELOPE__BODY_DRAIN);
    duet_envelope_free(m);
    cr_assert_not_null(wait_event("state 1 draining", 2000));
    on_loop(job_undrain, &id);
    m = wrecv(fd, 2000, &closed);
    cr_assert_not_null(m);
    cr_assert_eq(m->body_case, DUET__ENVELOPE__BODY_UNDRAIN);
    duet_envelope_free(m);
    cr_assert_not_null(wait_event("state 1 up", 2000));

    Duet__Deregister dr = DUET__DEREGISTER__INIT;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case = DUET__ENVELOPE__BODY_DEREGISTER;
    env.deregister = &dr;
    wsend(fd, &env);
    cr_assert_not_null(wait_event("down 1 deregistered", 2000));
    cr_assert(wait_closed(fd, 2000));
    close(fd);
    stop();
}

/* ---------------------------------------------------------------- prefix summaries */

static void send_summary(int fd, const uint64_t *hashes, size_t n, uint32_t page_tokens)
{
    Duet__Heartbeat hb = DUET__HEARTBEAT__INIT;
    hb.free_pages = 10;
    hb.prefix_hashes = (uint64_t *)hashes;
    hb.n_prefix_hashes = n;
    hb.prefix_page_tokens = page_tokens;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case = DUET__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    wsend(fd, &env);
}

static uint32_t prompt[100]; /* token i = 1000 + i */

typedef struct {
    duet_worker_role_t role;
    size_t n_tokens;
    uint64_t cached[4]; /* by worker id 1..3 (index 0 unused) */
} cached_job_t;

static void job_cached(void *arg)
{
    cached_job_t *j = arg;
    duet_placement_candidate_t c[8];
    size_t n = duet_registry_candidates(reg, c, 8);
    duet_prefix_prompt_t pp;
    duet_prefix_prompt_init(&pp, prompt, j->n_tokens);
    duet_registry_prefix_cached(reg, j->role, &pp, c, n);
    memset(j->cached, 0xff, sizeof(j->cached));
    for (size_t i = 0; i < n; i++)
        if (c[i].id < 4)
            j->cached[c[i].id] = c[i].cached_tokens;
    duet_registry_prefix_cached(reg, j->role, &pp, c, n); /* again: the chains are kept */
    for (size_t i = 0; i < n; i++)
        if (c[i].id < 4)
            cr_assert_eq(j->cached[c[i].id], c[i].cached_tokens);
    cr_assert_leq(pp.n_chains, 2, "one chain per block size");
    duet_prefix_prompt_free(&pp);
}

/* Each worker's cached tokens of the first n_tokens of prompt, as the registry sees them. */
static void expect_cached(duet_worker_role_t role, size_t n_tokens, uint64_t w1, uint64_t w2,
                          uint64_t w3, const char *what)
{
    cached_job_t j = {.role = role, .n_tokens = n_tokens};
    on_loop(job_cached, &j);
    cr_assert(j.cached[1] == w1 && j.cached[2] == w2 && j.cached[3] == w3,
              "%s: cached %llu %llu %llu, want %llu %llu %llu", what,
              (unsigned long long)j.cached[1], (unsigned long long)j.cached[2],
              (unsigned long long)j.cached[3], (unsigned long long)w1, (unsigned long long)w2,
              (unsigned long long)w3);
}

Test(registry, prefix_summaries_kept_matched_and_validated, .timeout = 30)
{
    for (size_t i = 0; i < 100; i++)
        prompt[i] = 1000 + (uint32_t)i;
    uint64_t h16[6], h8[12]; /* the prompt's chains: 99 tokens before its last one */
    cr_assert_eq(duet_prefix_hash_chain((const int32_t *)prompt, 100, 16, h16, 6), 6);
    cr_assert_eq(duet_prefix_hash_chain((const int32_t *)prompt, 100, 8, h8, 12), 12);
    log_heartbeats = 1;
    uint16_t port = start(FP, 5000);
    log_heartbeats = 0;
    int fd[4] = {-1, -1, -1, -1};
    const int roles[4] = {0, DUET__WORKER_ROLE__WORKER_ROLE_CTX, DUET__WORKER_ROLE__WORKER_ROLE_CTX,
                          DUET__WORKER_ROLE__WORKER_ROLE_GEN};
    for (int w = 1; w <= 3; w++) {
        fd[w] = wconnect(port);
        Duet__Envelope *ack = do_register(fd[w], roles[w], DUET_PROTO_VERSION, FP);
        cr_assert_eq(ack->register_ack->worker_id, (uint64_t)w);
        duet_envelope_free(ack);
    }
    const duet_worker_role_t CTX = DUET_WORKER_ROLE_CTX, GEN = DUET_WORKER_ROLE_GEN;
    expect_cached(CTX, 100, 0, 0, 0, "before any summary");

    /* 1 (blocks of 16) holds 3 and 5 blocks of it and an unrelated prefix; 2 (blocks of 8) 7
     * blocks; 3 (gen, 16) the whole chain. The longest match counts, in each one's block size. */
    uint64_t s1[] = {h16[2], 0x1234, h16[4]}, s2[] = {h8[6], h8[0] ^ 1}, s3[] = {h16[5]};
    send_summary(fd[1], s1, 3, 16);
    send_summary(fd[2], s2, 2, 8);
    send_summary(fd[3], s3, 1, 16);
    cr_assert_not_null(wait_event("hb 1 1", 2000));
    cr_assert_not_null(wait_event("hb 2 1", 2000));
    cr_assert_not_null(wait_event("hb 3 1", 2000));
    expect_cached(CTX, 100, 80, 56, 0, "ctx picks");
    expect_cached(GEN, 100, 0, 0, 96, "gen pick");
    /* a shorter prompt: its chain stops before 5 blocks of 16 (a block must leave a token) */
    expect_cached(CTX, 80, 48, 56, 0, "80 tokens");
    expect_cached(CTX, 16, 0, 0, 0, "one block with nothing after it");
    expect_cached(CTX, 0, 0, 0, 0, "empty prompt");

    /* malformed summaries: none kept for that worker, which stays up */
    uint64_t many[DUET_PROTO_PREFIX_HASHES + 1];
    for (size_t i = 0; i <= DUET_PROTO_PREFIX_HASHES; i++)
        many[i] = h16[4] + i; /* holds h16[4] */
    send_summary(fd[1], many, DUET_PROTO_PREFIX_HASHES + 1, 16);
    send_summary(fd[2], s2, 2, 0);
    cr_assert_not_null(wait_event("hb 1 2", 2000));
    cr_assert_not_null(wait_event("hb 2 2", 2000));
    expect_cached(CTX, 100, 0, 0, 0, "too many hashes; block size 0");
    send_summary(fd[1], s1, 3, 16);
    send_summary(fd[2], s2, 2, DUET_REGISTRY_PREFIX_PAGE_TOKENS_MAX + 1);
    cr_assert_not_null(wait_event("hb 1 3", 2000));
    cr_assert_not_null(wait_event("hb 2 3", 2000));
    expect_cached(CTX, 100, 80, 0, 0, "a good summary again; an absurd block size");
    /* exactly the most hashes allowed is fine */
    send_summary(fd[1], many + 1, DUET_PROTO_PREFIX_HASHES, 16);
    cr_assert_not_null(wait_event("hb 1 4", 2000));
    expect_cached(CTX, 100, 0, 0, 0, "256 hashes, none of them the prompt's");
    send_summary(fd[1], many, DUET_PROTO_PREFIX_HASHES, 16);
    cr_assert_not_null(wait_event("hb 1 5", 2000));
    expect_cached(CTX, 100, 80, 0, 0, "256 hashes, one of them the prompt's");
    /* a heartbeat without hashes clears it */
    send_heartbeat(fd[1], 5);
    cr_assert_not_null(wait_event("hb 1 6", 2000));
    expect_cached(CTX, 100, 0, 0, 0, "cleared");
    cr_assert_null(wait_event("down", 10), "no worker was closed");
    for (int w = 1; w <= 3; w++)
        close(fd[w]);
    stop();
}

Test(registry, sha256_nist_vectors_and_model_fingerprint, .timeout = 20)
{
    uint8_t d[32];
    char hex[65];
    duet__sha256("abc", 3, d);
    for (int i = 0; i < 32; i++)
        sprintf(hex + 2 * i, "%02x", d[i]);
    cr_assert_str_eq(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    duet__sha256(two, strlen(two), d);
    for (int i = 0; i < 32; i++)
        sprintf(hex + 2 * i, "%02x", d[i]);
    cr_assert_str_eq(hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");

    char fp1[80], fp2[80];
    cr_assert_eq(
        duet_model_fingerprint(DUET_SOURCE_DIR "/tests/fixtures/kda-first-fp32", fp1, sizeof(fp1)),
        DUET_OK, "%s", duet_error_last());
    cr_assert_eq(strncmp(fp1, "sha256:", 7), 0);
    cr_assert_eq(strlen(fp1), 71);
    cr_assert_eq(duet_model_fingerprint(DUET_SOURCE_DIR
                                        "/tests/fixtures/mla-first-bf16-sharded-hub",
                                        fp2, sizeof(fp2)),
                 DUET_OK);
    cr_assert_str_neq(fp1, fp2);
    cr_assert_eq(duet_model_fingerprint("/nonexistent", fp2, sizeof(fp2)), DUET_ERR_IO);
}
