/*
 * duet-ctx and duet-gen against bad input from their peer. The test plays the router: it listens,
 * accepts the worker's Register, and sends it malformed, out-of-range and out-of-order messages,
 * checking that each gets the clear answer the protocol defines (Refused, Tokens ERROR with a
 * reason, or nothing for a harmless stray) and that the worker keeps serving, then that a frame
 * that is not a frame makes it leave cleanly (exit status, never a signal); the same for the
 * messages that move a running request. Bad command lines end
 * at start-up with status 2 and a message naming the problem.
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proto/frame.h"
#include "tests/unit/test_run.h"
#include "transfer/reservation.h"

#define MODEL DUET_SOURCE_DIR "/models/duet-demo"

/* the workers under test: DUET_TEST_BIN_DIR may name another build's (test_run.h) */
#define CTX   test_bin("ctx_worker/duet-ctx")
#define GEN   test_bin("gen_worker/duet-gen")
#define VOCAB 258

static int lfd = -1, cfd = -1;
static pid_t wpid;
static uint32_t ack_timeout_ms; /* RegisterAck.heartbeat_timeout_ms (0: not said) */
static duet_frame_decoder_t dec;

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void send_env(Duet__Envelope *env)
{
    env->version = DUET_PROTO_VERSION;
    uint8_t buf[65536];
    size_t len = 0;
    cr_assert_eq(duet_frame_encode(env, buf, sizeof(buf), &len), DUET_OK);
    cr_assert_eq(write(cfd, buf, len), (ssize_t)len);
}

/* Next Envelope from the worker that is not a Heartbeat (NULL after ms). Caller frees. */
static Duet__Envelope *recv_env(int ms)
{
    uint64_t end = now_ms() + (uint64_t)ms;
    for (;;) {
        uint8_t b;
        size_t used = 0;
        Duet__Envelope *env = NULL;
        int left = (int)(end - now_ms());
        if (left <= 0)
            return NULL;
        struct pollfd p = {.fd = cfd, .events = POLLIN};
        if (poll(&p, 1, left) <= 0)
            return NULL;
        if (read(cfd, &b, 1) != 1)
            return NULL;
        cr_assert_geq(duet_frame_decoder_feed(&dec, &b, 1, &used, &env), 0, "worker sent junk");
        if (env == NULL)
            continue;
        if (env->body_case == DUET__ENVELOPE__BODY_HEARTBEAT) {
            duet_envelope_free(env);
            continue;
        }
        return env;
    }
}

/* Start bin as a worker of this test's router with one or two extra flags (extra2 may be NULL). */
static void start_with(const char *bin, const char *extra, const char *extra2)
{
    lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    cr_assert_eq(bind(lfd, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(listen(lfd, 4), 0);
    socklen_t l = sizeof(a);
    getsockname(lfd, (struct sockaddr *)&a, &l);
    char rt[64];
    snprintf(rt, sizeof(rt), "127.0.0.1:%d", ntohs(a.sin_port));
    wpid = fork();
    cr_assert_geq(wpid, 0);
    if (wpid == 0) {
        int nul = open("/dev/null", O_WRONLY);
        dup2(nul, 1);
        if (getenv("DUET_TEST_VERBOSE") == NULL)
            dup2(nul, 2);
        setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
        execl(bin, bin, "--router", rt, "--model", MODEL, "--threads", "1", "--heartbeat_ms", "100",
              "--cache.page_tokens", "16", "--cache.kv_pages", "64", "--cache.max_seq_len", "512",
              extra, extra2, (char *)NULL);
        _exit(127);
    }
    struct pollfd p = {.fd = lfd, .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 20000), 1, "the worker did not connect");
    cfd = accept(lfd, NULL, NULL);
    cr_assert_geq(cfd, 0);
    duet_frame_decoder_init(&dec, 0);
    Duet__Envelope *reg = recv_env(10000);
    cr_assert_not_null(reg);
    cr_assert_eq(reg->body_case, DUET__ENVELOPE__BODY_REGISTER);
    cr_assert(strncmp(reg->register_->model_fingerprint, "sha256:", 7) == 0);
    duet_envelope_free(reg);
    Duet__RegisterAck ack = DUET__REGISTER_ACK__INIT;
    ack.accepted = true;
    ack.worker_id = 1;
    ack.heartbeat_timeout_ms = ack_timeout_ms;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case = DUET__ENVELOPE__BODY_REGISTER_ACK;
    env.register_ack = &ack;
    send_env(&env);
}

static void start(const char *bin, const char *extra)
{
    start_with(bin, extra, NULL);
}

/* Send bytes that are not a frame; the worker must leave by itself, without a signal. */
static void finish_with_garbage(void)
{
    uint8_t junk[8] = {0x7f, 0xff, 0xff, 0xff, 1, 2, 3, 4}; /* a 2 GiB frame header */
    cr_assert_eq(write(cfd, junk, sizeof(junk)), (ssize_t)sizeof(junk));
    int st = 0;
    for (int i = 0; i < 200 && waitpid(wpid, &st, WNOHANG) == 0; i++)
        usleep(25000);
    if (waitpid(wpid, &st, WNOHANG) == 0) {
        kill(wpid, SIGKILL);
        waitpid(wpid, &st, 0);
        cr_assert(0, "the worker did not leave after a malformed frame");
    }
    cr_expect(WIFEXITED(st), "the worker died of signal %d", WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    close(cfd);
    close(lfd);
    duet_frame_decoder_free(&dec);
}

static void expect_refused(uint64_t rid, const char *why_part)
{
    Duet__Envelope *e = recv_env(5000);
    cr_assert_not_null(e, "no answer for request %llu", (unsigned long long)rid);
    cr_expect_eq(e->body_case, DUET__ENVELOPE__BODY_REFUSED, "request %llu: body %d",
                 (unsigned long long)rid, (int)e->body_case);
    if (e->body_case == DUET__ENVELOPE__BODY_REFUSED) {
        cr_expect_eq(e->refused->request_id, rid);
        cr_expect(strstr(e->refused->reason, why_part) != NULL, "reason '%s' lacks '%s'",
                  e->refused->reason, why_part);
    }
    duet_envelope_free(e);
}

static void expect_tokens(uint64_t rid, int finish, const char *err_part)
{
    Duet__Envelope *e = recv_env(5000);
    cr_assert_not_null(e, "no answer for request %llu", (unsigned long long)rid);
    cr_assert_eq(e->body_case, DUET__ENVELOPE__BODY_TOKENS, "request %llu: body %d",
                 (unsigned long long)rid, (int)e->body_case);
    cr_expect_eq(e->tokens->request_id, rid);
    cr_expect_eq((int)e->tokens->finish_reason, finish, "request %llu: finish %d (%s)",
                 (unsigned long long)rid, (int)e->tokens->finish_reason, e->tokens->error);
    if (err_part != NULL)
        cr_expect(strstr(e->tokens->error, err_part) != NULL, "error '%s' lacks '%s'",
                  e->tokens->error, err_part);
    duet_envelope_free(e);
}

/* Reserve for rid (a running request moving in when ms is set). */
static void send_reserve_move(uint64_t rid, uint32_t prompt, uint32_t *toks, size_t n, uint32_t max,
                              const Duet__MoveState *ms)
{
    Duet__Reserve r = DUET__RESERVE__INIT;
    r.request_id = rid;
    r.prompt_tokens = prompt;
    r.tokens = toks;
    r.n_tokens = n;
    r.max_tokens = max;
    r.deadline_unix_ms = duet_xfer_now_unix_ms() + 60000;
    r.move = (Duet__MoveState *)ms;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case = DUET__ENVELOPE__BODY_RESERVE;
    env.reserve = &r;
    send_env(&env);
}

static void send_reserve(uint64_t rid, uint32_t prompt, uint32_t *toks, size_t n, uint32_t max)
{
    send_reserve_move(rid, prompt, toks, n, max, NULL);
}

Test(worker_protocol, gen_answers_bad_input_and_keeps_serving, .timeout = 120)
{
    start(GEN, "--cache.quarantine_ms=100");
    uint32_t toks[8] = {256, 72, 101, 108, 108, 111, 32, 87};

    send_reserve(1, 0, NULL, 0, 4);
    expect_refused(1, "empty prompt");
    send_reserve(2, 8, toks, 8, 100000);
    expect_refused(2, "tokens"); /* 8 + 100000 tokens > max_seq_len 512 */
    send_reserve(3, 8, toks, 5, 4);
    expect_refused(3, "differ");

    Duet__PrefillDone pd = DUET__PREFILL_DONE__INIT;
    pd.request_id = 99;
    pd.first_token = 5;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case = DUET__ENVELOPE__BODY_PREFILL_DONE;
    env.prefill_done = &pd;
    send_env(&env);
    expect_tokens(99, DUET__TOKENS__FINISH_REASON__ERROR, "no reservation");

    uint32_t bad[2] = {72, VOCAB + 40};
    Duet__Generate g = DUET__GENERATE__INIT;
    g.request_id = 4;
    g.tokens = bad;
    g.n_tokens = 2;
    g.max_tokens = 3;
    env.body_case = DUET__ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    send_env(&env);
    expect_tokens(4, DUET__TOKENS__FINISH_REASON__ERROR, "vocabulary");

    /* a stray Cancel and a body workers never get: ignored */
    Duet__Cancel c = DUET__CANCEL__INIT;
    c.request_id = 12345;
    c.reason = "nothing to cancel";
    env.body_case = DUET__ENVELOPE__BODY_CANCEL;
    env.cancel = &c;
    send_env(&env);
    Duet__Heartbeat hb = DUET__HEARTBEAT__INIT;
    env.body_case = DUET__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    send_env(&env);

    /* a valid reservation: its bytes decode, the same id twice is refused, cancel frees it */
    send_reserve(6, 8, toks, 8, 20);
    Duet__Envelope *e = recv_env(5000);
    cr_assert_not_null(e);
    cr_assert_eq(e->body_case, DUET__ENVELOPE__BODY_RESERVED);
    duet_xfer_reservation_t res;
    cr_expect_eq(duet_xfer_reservation_decode(e->reserved->reservation.data,
                                              e->reserved->reservation.len, 0, &res),
                 DUET_OK, "%s", duet_error_last());
    cr_expect_eq(res.n_pages, 1u, "an 8-token prompt fills one 16-token page");
    cr_expect_eq(res.n_tokens, 8u);
    duet_xfer_reservation_free(&res);
    duet_envelope_free(e);
    send_reserve(6, 8, toks, 8, 20);
    expect_refused(6, "already");
    c.request_id = 6;
    c.reason = "test";
    env.body_case = DUET__ENVELOPE__BODY_CANCEL;
    env.cancel = &c;
    send_env(&env);
    expect_tokens(6, DUET__TOKENS__FINISH_REASON__CANCELLED, NULL);

    /* and it still serves: a local prompt gives 3 tokens, the last one LENGTH */
    g.request_id = 5;
    g.tokens = toks;
    g.n_tokens = 8;
    g.max_tokens = 3;
    env.body_case = DUET__ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    send_env(&env);
    expect_tokens(5, DUET__TOKENS__FINISH_REASON__NONE, NULL);
    expect_tokens(5, DUET__TOKENS__FINISH_REASON__NONE, NULL);
    expect_tokens(5, DUET__TOKENS__FINISH_REASON__LENGTH, NULL);

    /* every page is free again once the cancelled reservation's quarantine ended */
    uint64_t end = now_ms() + 5000;
    uint32_t free_pages = 0;
    while (now_ms() < end && free_pages != 64) {
        uint8_t b;
        size_t used = 0;
        Duet__Envelope *h = NULL;
        struct pollfd p = {.fd = cfd, .events = POLLIN};
        if (poll(&p, 1, 500) <= 0 || read(cfd, &b, 1) != 1)
            continue;
        cr_assert_geq(duet_frame_decoder_feed(&dec, &b, 1, &used, &h), 0);
        if (h != NULL && h->body_case == DUET__ENVELOPE__BODY_HEARTBEAT)
            free_pages = h->heartbeat->free_pages;
        duet_envelope_free(h);
    }
    cr_expect_eq(free_pages, 64u, "pages back after cancel + quarantine");
    finish_with_garbage();
}

/* The next body of `kind` (NULL after ms); Tokens of request `rid` are counted into *n_tok and
 * their last id kept in *last; other bodies are dropped. Caller frees. */
static Duet__Envelope *recv_kind(int kind, uint64_t rid, uint32_t *n_tok, uint32_t *last, int ms)
{
    uint64_t end = now_ms() + (uint64_t)ms;
    while (now_ms() < end) {
        Duet__Envelope *e = recv_env((int)(end - now_ms()));
        if (e == NULL)
            return NULL;
        if ((int)e->body_case == kind)
            return e;
        if (e->body_case == DUET__ENVELOPE__BODY_TOKENS && e->tokens->request_id == rid) {
            *n_tok += (uint32_t)e->tokens->n_ids;
            if (e->tokens->n_ids > 0)
                *last = e->tokens->ids[e->tokens->n_ids - 1];
        }
        duet_envelope_free(e);
    }
    return NULL;
}

static void send_move_reserve(uint64_t rid, uint32_t *toks, size_t n, uint32_t max,
                              const Duet__MoveState *ms)
{
    send_reserve_move(rid, (uint32_t)n, toks, n, max, ms);
}

/*
 * Moving a running request, the generation worker's side (docs/architecture.md, "Moving a running
 * request"): a Reserve whose MoveState contradicts itself is refused naming what is wrong; a
 * MovePause of a request that is not decoding says so; a decoding request pauses with a state
 * that matches the Tokens it sent, a MoveOut with a reservation that does not decode fails the
 * move (Moved, not ok) and the request decodes on; a valid move-in reserves the KV it holds.
 */
Test(worker_protocol, gen_answers_bad_move_messages, .timeout = 120)
{
    start(GEN, "--cache.quarantine_ms=100");
    uint32_t toks[8] = {256, 72, 101, 108, 108, 111, 32, 87};
    uint32_t gen[4] = {72, 105, 33, 10};
    uint64_t rng[4] = {1, 2, 3, 4};
    Duet__MoveState ms = DUET__MOVE_STATE__INIT;
    ms.kv_tokens = 8 + 4 - 1;
    ms.produced = 4;
    ms.next_token = 10;
    ms.rng = rng;
    ms.n_rng = 4;
    ms.generated = gen;
    ms.n_generated = 4;

    ms.n_rng = 3;
    send_move_reserve(20, toks, 8, 50, &ms);
    expect_refused(20, "RNG");
    ms.n_rng = 4;
    ms.n_generated = 3;
    send_move_reserve(21, toks, 8, 50, &ms);
    expect_refused(21, "generated ids");
    ms.n_generated = 4;
    ms.next_token = 11;
    send_move_reserve(22, toks, 8, 50, &ms);
    expect_refused(22, "generated ids");
    ms.next_token = 10;
    send_move_reserve(23, toks, 8, 4, &ms); /* produced == max_tokens: nothing left to move */
    expect_refused(23, "generated ids");
    ms.kv_tokens = 12;
    send_move_reserve(24, toks, 8, 50, &ms);
    expect_refused(24, "KV length");
    ms.kv_tokens = 11;
    ms.replay_rows = 12;
    send_move_reserve(25, toks, 8, 50, &ms);
    expect_refused(25, "replay rows");
    ms.replay_rows = 0;
    gen[1] = VOCAB + 7;
    send_move_reserve(26, toks, 8, 50, &ms);
    expect_refused(26, "vocabulary");
    gen[1] = 105;

    /* a valid move-in: the reservation is for the 11 tokens of KV it holds */
    send_move_reserve(27, toks, 8, 50, &ms);
    Duet__Envelope *e = recv_env(5000);
    cr_assert_not_null(e);
    cr_assert_eq(e->body_case, DUET__ENVELOPE__BODY_RESERVED, "body %d", (int)e->body_case);
    duet_xfer_reservation_t res;
    cr_assert_eq(duet_xfer_reservation_decode(e->reserved->reservation.data,
                                              e->reserved->reservation.len, 0, &res),
                 DUET_OK, "%s", duet_error_last());
    cr_expect_eq(res.n_tokens, 11u);
    cr_expect_eq(res.n_pages, 1u, "11 tokens fill one 16-token page");
    duet_xfer_reservation_free(&res);
    duet_envelope_free(e);

    /* pausing: unknown, and not decoding yet (27 is receiving) */
    Duet__MovePause mp = DUET__MOVE_PAUSE__INIT;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case = DUET__ENVELOPE__BODY_MOVE_PAUSE;
    env.move_pause = &mp;
    const uint64_t ask[2] = {999, 27};
    const char *const why[2] = {"no such request", "not decoding"};
    for (int i = 0; i < 2; i++) {
        mp.request_id = ask[i];
        send_env(&env);
        e = recv_env(5000);
        cr_assert_not_null(e);
        cr_assert_eq(e->body_case, DUET__ENVELOPE__BODY_MOVE_PAUSED);
        cr_expect(!e->move_paused->ok);
        cr_expect(strstr(e->move_paused->reason, why[i]) != NULL, "%s", e->move_paused->reason);
        duet_envelope_free(e);
    }
    /* MoveOut for a request that is not paused */
    Duet__MoveOut mo = DUET__MOVE_OUT__INIT;
    mo.request_id = 27;
    env.body_case = DUET__ENVELOPE__BODY_MOVE_OUT;
    env.move_out = &mo;
    send_env(&env);
    e = recv_env(5000);
    cr_assert_not_null(e);
    cr_assert_eq(e->body_case, DUET__ENVELOPE__BODY_MOVED);
    cr_expect(!e->moved->ok);
    cr_expect(strstr(e->moved->reason, "not paused") != NULL, "%s", e->moved->reason);
    duet_envelope_free(e);

    /* a decoding request pauses with the state its Tokens show */
    Duet__Generate g = DUET__GENERATE__INIT;
    g.request_id = 30;
    g.tokens = toks;
    g.n_tokens = 8;
    g.max_tokens = 400;
    Duet__Sampling sp = DUET__SAMPLING__INIT;
    sp.ignore_eos = true;
    g.sampling = &sp;
    env.body_case = DUET__ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    send_env(&env);
    uint32_t n_tok = 0, last = 0;
    while (n_tok < 3) {
        e = recv_kind(DUET__ENVELOPE__BODY_TOKENS, 30, &n_tok, &last, 5000);
        cr_assert_not_null(e, "request 30 does not decode");
        n_tok += (uint32_t)e->tokens->n_ids;
        last = e->tokens->ids[e->tokens->n_ids - 1];
        duet_envelope_free(e);
    }
    mp.request_id = 30;
    env.body_case = DUET__ENVELOPE__BODY_MOVE_PAUSE;
    env.move_pause = &mp;
    send_env(&env);
    e = recv_kind(DUET__ENVELOPE__BODY_MOVE_PAUSED, 30, &n_tok, &last, 5000);
    cr_assert_not_null(e);
    cr_assert(e->move_paused->ok, "%s", e->move_paused->reason);
    const Duet__MoveState *st = e->move_paused->state;
    cr_assert_not_null(st);
    cr_expect_eq(st->produced, n_tok, "produced %u, %u tokens streamed", st->produced, n_tok);
    cr_expect_eq(st->next_token, last);
    cr_expect_eq(st->kv_tokens, 8u + n_tok - 1);
    cr_expect_eq(st->n_rng, 4u);
    duet_envelope_free(e);
    /* paused: no Tokens for it now */
    e = recv_env(500);
    cr_expect(e == NULL || e->body_case != DUET__ENVELOPE__BODY_TOKENS,
              "a paused request decoded on");
    duet_envelope_free(e);
    /* a reservation that does not decode: the move fails, the request decodes on */
    uint8_t junk[5] = {0xff, 0xff, 0xff, 0xff, 0x0f};
    mo.request_id = 30;
    mo.reservation.data = junk;
    mo.reservation.len = sizeof(junk);
    env.body_case = DUET__ENVELOPE__BODY_MOVE_OUT;
    env.move_out = &mo;
    send_env(&env);
    e = recv_env(5000);
    cr_assert_not_null(e);
    cr_assert_eq(e->body_case, DUET__ENVELOPE__BODY_MOVED, "body %d", (int)e->body_case);
    cr_expect(!e->moved->ok);
    cr_expect(strstr(e->moved->reason, "cannot start sending") != NULL, "%s", e->moved->reason);
    duet_envelope_free(e);
    e = recv_env(5000);
    cr_assert_not_null(e);
    cr_expect_eq(e->body_case, DUET__ENVELOPE__BODY_TOKENS, "it decodes on");
    duet_envelope_free(e);

    Duet__Cancel c = DUET__CANCEL__INIT;
    c.reason = "test";
    env.body_case = DUET__ENVELOPE__BODY_CANCEL;
    env.cancel = &c;
    c.request_id = 30;
    send_env(&env);
    c.request_id = 27;
    send_env(&env);
    finish_with_garbage();
}

/* The next Heartbeat (NULL after ms); other bodies are dropped. Caller frees. */
static Duet__Envelope *recv_heartbeat(int ms)
{
    uint64_t end = now_ms() + (uint64_t)ms;
    while (now_ms() < end) {
        uint8_t b;
        size_t used = 0;
        Duet__Envelope *h = NULL;
        struct pollfd p = {.fd = cfd, .events = POLLIN};
        if (poll(&p, 1, 200) <= 0 || read(cfd, &b, 1) != 1)
            continue;
        cr_assert_geq(duet_frame_decoder_feed(&dec, &b, 1, &used, &h), 0);
        if (h != NULL && h->body_case == DUET__ENVELOPE__BODY_HEARTBEAT)
            return h;
        duet_envelope_free(h);
    }
    return NULL;
}

/*
 * A worker that did not run for longer than the router's heartbeat timeout (its RegisterAck) has
 * been dropped: when it runs again it leaves at once with status 0, before it touches UCX, where
 * a put to acknowledge on an endpoint its peer had failed meanwhile made UCX 1.13 abort it
 * (bench/soak stops workers past the timeout). A shorter stop changes nothing.
 */
Test(worker_protocol, a_worker_stopped_past_the_heartbeat_timeout_leaves, .timeout = 60)
{
    ack_timeout_ms = 1000;
    start(GEN, NULL);
    ack_timeout_ms = 0;
    Duet__Envelope *h = recv_heartbeat(5000);
    cr_assert_not_null(h, "no heartbeat");
    duet_envelope_free(h);
    kill(wpid, SIGSTOP);
    usleep(400000);
    kill(wpid, SIGCONT);
    usleep(300000);
    h = recv_heartbeat(3000);
    cr_assert_not_null(h, "a 0.4 s stop ended the worker");
    duet_envelope_free(h);
    cr_assert_eq(waitpid(wpid, NULL, WNOHANG), 0, "the worker left after a 0.4 s stop");
    kill(wpid, SIGSTOP);
    usleep(1600000);
    kill(wpid, SIGCONT);
    int st = 0;
    for (int i = 0; i < 120 && waitpid(wpid, &st, WNOHANG) == 0; i++)
        usleep(25000);
    if (waitpid(wpid, &st, WNOHANG) == 0) {
        kill(wpid, SIGKILL);
        waitpid(wpid, &st, 0);
        cr_assert(0, "the worker kept running 3 s after a 1.6 s stop past a 1 s timeout");
    }
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d (signal %d)",
              WIFEXITED(st) ? WEXITSTATUS(st) : -1, WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    close(cfd);
    close(lfd);
    duet_frame_decoder_free(&dec);
}

/*
 * A speculating generation worker drafts from the prompt, so a Reserve must carry its ids, inside
 * the vocabulary (a draft outside it would fail the whole batch's forward); a local prompt still
 * gives exactly max_tokens tokens, several per Tokens message allowed, the last one LENGTH; its
 * heartbeats carry the speculation counters of spec.k (3) draft positions.
 */
Test(worker_protocol, gen_speculating_checks_reserved_prompts, .timeout = 120)
{
    start_with(GEN, "--spec.method=ngram", "--spec.k=3");
    send_reserve(1, 8, NULL, 0, 4);
    expect_refused(1, "prompt ids");
    uint32_t bad[2] = {72, VOCAB + 40};
    send_reserve(2, 2, bad, 2, 4);
    expect_refused(2, "vocabulary");
    /* "And": the demo model goes on " the son of Ammihud, and the son of Ammishaddai.", whose
     * repeats prompt lookup drafts (duet-generate --tokens 256,65,110,100 --max-tokens 60
     * --spec.method ngram --spec.k 3 takes 44 steps for 59 tokens) */
    uint32_t and_ids[4] = {256, 65, 110, 100};
    Duet__Generate g = DUET__GENERATE__INIT;
    g.request_id = 3;
    g.tokens = and_ids;
    g.n_tokens = 4;
    g.max_tokens = 60;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case = DUET__ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    send_env(&env);
    size_t got = 0;
    int msgs = 0, finish = DUET__TOKENS__FINISH_REASON__NONE;
    while (finish == DUET__TOKENS__FINISH_REASON__NONE) {
        Duet__Envelope *e = recv_env(10000);
        cr_assert_not_null(e, "request 3 stopped after %zu tokens", got);
        cr_assert_eq(e->body_case, DUET__ENVELOPE__BODY_TOKENS);
        cr_assert_eq(e->tokens->request_id, 3u);
        for (size_t i = 0; i < e->tokens->n_ids; i++)
            cr_expect_lt(e->tokens->ids[i], (uint32_t)VOCAB);
        got += e->tokens->n_ids;
        finish = (int)e->tokens->finish_reason;
        msgs++;
        duet_envelope_free(e);
    }
    cr_expect_eq(finish, DUET__TOKENS__FINISH_REASON__LENGTH);
    cr_expect_eq(got, 60u, "max_tokens cuts the last verify's tokens");
    Duet__Envelope *h = recv_heartbeat(3000);
    cr_assert_not_null(h, "no heartbeat");
    cr_expect_eq(h->heartbeat->n_spec_step_tokens, 4u);
    cr_expect_eq(h->heartbeat->n_spec_drafted, 3u);
    cr_expect_eq(h->heartbeat->n_spec_accepted, 3u);
    uint64_t steps = 0, emitted = 0;
    for (size_t i = 0; i < h->heartbeat->n_spec_step_tokens; i++) {
        steps += h->heartbeat->spec_step_tokens[i];
        emitted += (i + 1) * h->heartbeat->spec_step_tokens[i];
    }
    cr_expect_gt(steps, 0u, "verify steps ran");
    cr_expect_eq(h->heartbeat->spec_drafted[0], steps, "every verify step drafts position 1");
    cr_expect_eq(h->heartbeat->decoded_tokens, 59u, "tokens after the prefill's first");
    cr_expect_lt(h->heartbeat->decode_seq_steps, 59u, "several tokens per step (%d messages)",
                 msgs);
    cr_expect_lt(msgs, 60, "several tokens per Tokens message");
    cr_expect_leq(emitted, 59u);
    duet_envelope_free(h);
    finish_with_garbage();
}

/* A Prefill with rank 0's reservation res and n_more more (a Helix group's). */
static void send_prefill_group(uint64_t rid, uint32_t *toks, size_t n, const uint8_t *res,
                               size_t rlen, ProtobufCBinaryData *more, size_t n_more)
{
    Duet__Prefill p = DUET__PREFILL__INIT;
    p.request_id = rid;
    p.tokens = toks;
    p.n_tokens = n;
    p.max_tokens = 4;
    p.reservation.data = (uint8_t *)res;
    p.reservation.len = rlen;
    p.more_reservations = more;
    p.n_more_reservations = n_more;
    p.deadline_unix_ms = duet_xfer_now_unix_ms() + 60000;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case = DUET__ENVELOPE__BODY_PREFILL;
    env.prefill = &p;
    send_env(&env);
}

static void send_prefill(uint64_t rid, uint32_t *toks, size_t n, const uint8_t *res, size_t rlen)
{
    send_prefill_group(rid, toks, n, res, rlen, NULL, 0);
}

Test(worker_protocol, ctx_answers_bad_input_and_keeps_serving, .timeout = 120)
{
    start(CTX, "--batch.max_queue=4");
    uint32_t toks[8] = {256, 72, 101, 108, 108, 111, 32, 87};
    uint8_t junk[40];
    for (size_t i = 0; i < sizeof(junk); i++)
        junk[i] = (uint8_t)(i * 37 + 11);

    send_prefill(1, toks, 8, junk, sizeof(junk));
    expect_tokens(1, DUET__TOKENS__FINISH_REASON__ERROR, "unusable reservation");
    send_prefill(2, toks, 0, junk, sizeof(junk));
    expect_tokens(2, DUET__TOKENS__FINISH_REASON__ERROR, "empty prompt");
    uint32_t bad[2] = {72, VOCAB};
    send_prefill(3, bad, 2, junk, sizeof(junk));
    expect_tokens(3, DUET__TOKENS__FINISH_REASON__ERROR, "vocabulary");
    static uint32_t long_prompt[600];
    for (int i = 0; i < 600; i++)
        long_prompt[i] = 65;
    send_prefill(4, long_prompt, 600, junk, sizeof(junk));
    expect_tokens(4, DUET__TOKENS__FINISH_REASON__ERROR, "max_seq_len");

    /* well-formed reservations that cannot be used: stale, then a layout that does not match */
    int32_t pages[1] = {0};
    uint8_t addr[16] = {1, 2, 3}, rkey[16] = {4, 5, 6};
    duet_xfer_reservation_t r = {.version = DUET_XFER_RESERVATION_VERSION,
                                 .transfer_id = 7,
                                 .request_id = 5,
                                 .rank = 0,
                                 .group_size = 1,
                                 .worker_address = {addr, sizeof(addr)},
                                 .kv_rkey = {rkey, sizeof(rkey)},
                                 .kv_base = 1 << 20,
                                 .kv_bytes = 64 << 20,
                                 .kda_rkey = {rkey, sizeof(rkey)},
                                 .kda_base = 1 << 30,
                                 .kda_bytes = 64 << 20,
                                 .layout = {.page_tokens = 16,
                                            .n_mla_layers = 2,
                                            .token_bytes = 640,
                                            .n_kda_layers = 6,
                                            .kda_heads = 4,
                                            .kda_head_dim = 64,
                                            .conv_kernel = 4,
                                            .state_elem = 4},
                                 .pages = pages,
                                 .n_pages = 1,
                                 .kda_slot = 0,
                                 .n_tokens = 8,
                                 .deadline_unix_ms = duet_xfer_now_unix_ms() - 1000};
    uint8_t buf[4096];
    size_t len = 0;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK, "%s",
                 duet_error_last());
    send_prefill(5, toks, 8, buf, len);
    expect_tokens(5, DUET__TOKENS__FINISH_REASON__ERROR, "stale");
    r.deadline_unix_ms = duet_xfer_now_unix_ms() + 60000;
    r.layout.token_bytes = 1000; /* the demo model's is (128 + 32) * 4 = 640 */
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK);
    send_prefill(6, toks, 8, buf, len);
    expect_tokens(6, DUET__TOKENS__FINISH_REASON__ERROR, "transfer");
    r.layout.token_bytes = 640; /* matching layout, but rkey and address are not UCX's */
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK);
    send_prefill(7, toks, 8, buf, len);
    expect_tokens(7, DUET__TOKENS__FINISH_REASON__ERROR, "transfer");

    /* a Helix group's set that is not one whole group: two reservations that claim a group of
     * 3, then rank 0 twice; a whole group of 2 (any order) gets as far as the transfer */
    uint8_t buf1[4096];
    size_t len1 = 0;
    r.group_size = 3;
    r.rank = 0;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK, "%s",
                 duet_error_last());
    r.rank = 1;
    r.transfer_id = 8;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf1, sizeof(buf1), &len1), DUET_OK, "%s",
                 duet_error_last());
    ProtobufCBinaryData more = {.len = len1, .data = buf1};
    send_prefill_group(9, toks, 8, buf, len, &more, 1);
    expect_tokens(9, DUET__TOKENS__FINISH_REASON__ERROR,
                  "claims a group of 3, 2 reservations came");
    r.group_size = 2;
    r.rank = 0;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK);
    more = (ProtobufCBinaryData){.len = len, .data = buf};
    send_prefill_group(10, toks, 8, buf, len, &more, 1);
    expect_tokens(10, DUET__TOKENS__FINISH_REASON__ERROR, "rank 0 appears twice");
    r.request_id = 11;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK);
    r.rank = 1;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf1, sizeof(buf1), &len1), DUET_OK);
    more = (ProtobufCBinaryData){.len = len, .data = buf}; /* rank 0's as the extra one */
    send_prefill_group(11, toks, 8, buf1, len1, &more, 1);
    expect_tokens(11, DUET__TOKENS__FINISH_REASON__ERROR, "cannot start the KV cache transfer");

    /* Cancel for a request it does not have: nothing; Drain: it refuses new prompts */
    Duet__Cancel c = DUET__CANCEL__INIT;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    c.request_id = 4242;
    c.reason = "none";
    env.body_case = DUET__ENVELOPE__BODY_CANCEL;
    env.cancel = &c;
    send_env(&env);
    Duet__Drain d = DUET__DRAIN__INIT;
    env.body_case = DUET__ENVELOPE__BODY_DRAIN;
    env.drain = &d;
    send_env(&env);
    send_prefill(8, toks, 8, junk, sizeof(junk));
    expect_tokens(8, DUET__TOKENS__FINISH_REASON__ERROR, "draining");
    finish_with_garbage();
}

/* Run bin with args; exit status and stderr in err. */
static int run_capture(char *const argv[], char *err, size_t cap)
{
    int p[2];
    cr_assert_eq(pipe(p), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        dup2(p[1], 2);
        int nul = open("/dev/null", O_WRONLY);
        dup2(nul, 1);
        close(p[0]);
        execv(argv[0], argv);
        _exit(127);
    }
    close(p[1]);
    size_t at = 0;
    ssize_t n;
    while (at + 1 < cap && (n = read(p[0], err + at, cap - 1 - at)) > 0)
        at += (size_t)n;
    err[at] = '\0';
    close(p[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Bad command lines end at start-up with status 2 and a message naming the problem. */
Test(worker_protocol, bad_command_lines_are_refused, .timeout = 60)
{
    static char err[1 << 16];
    char *unknown[] = {CTX, "--model", MODEL, "--bogus", NULL};
    cr_expect_eq(run_capture(unknown, err, sizeof(err)), 2);
    cr_expect(strstr(err, "--bogus") != NULL, "%s", err);
    char *positional[] = {GEN, "--model", MODEL, "stray", NULL};
    cr_expect_eq(run_capture(positional, err, sizeof(err)), 2);
    cr_expect(strstr(err, "unexpected argument 'stray'") != NULL, "%s", err);
    char *chunk[] = {CTX,   "--model", MODEL, "--batch.prefill_chunk", "1024", "--batch.max_tokens",
                     "512", NULL};
    cr_expect_eq(run_capture(chunk, err, sizeof(err)), 2);
    cr_expect(strstr(err, "must not exceed batch.max_tokens") != NULL, "%s", err);
    char *range[] = {GEN, "--model", MODEL, "--batch.max_seqs", "0", NULL};
    cr_expect_eq(run_capture(range, err, sizeof(err)), 2);
    cr_expect(strstr(err, "batch.max_seqs") != NULL, "%s", err);
    char *nomodel[] = {GEN, "--router", "127.0.0.1:1", NULL};
    cr_expect_eq(run_capture(nomodel, err, sizeof(err)), 2);
    cr_expect(strstr(err, "model.dir") != NULL, "%s", err);
    /* a generation group: started without mpirun, or asked to speculate */
    char *group[] = {GEN, "--model", MODEL, "--helix.cp", "2", NULL};
    cr_expect_eq(run_capture(group, err, sizeof(err)), 2);
    cr_expect(strstr(err, "start it with mpirun -n 2") != NULL, "%s", err);
    char *gspec[] = {GEN, "--model", MODEL, "--helix.tp", "2", "--spec.method", "ngram", NULL};
    cr_expect_eq(run_capture(gspec, err, sizeof(err)), 2);
    cr_expect(strstr(err, "speculative decoding in a generation group is not built") != NULL, "%s",
              err);
    char *grange[] = {GEN, "--model", MODEL, "--helix.cp", "65", NULL};
    cr_expect_eq(run_capture(grange, err, sizeof(err)), 2);
    cr_expect(strstr(err, "helix.cp") != NULL, "%s", err);
}

/*
 * duet-gen's speculation keys: a bad value or combination ends the start with a message naming
 * the key (status 2 for the keys themselves, 1 for a draft model that cannot serve).
 */
Test(worker_protocol, bad_spec_keys_are_refused, .timeout = 60)
{
    static char err[1 << 16];
    static const struct {
        const char *a, *b, *c;
        int status;
        const char *want, *want2;
    } cases[] = {
        {"--spec.method=ngram", "--spec.k=9", NULL, 2, "spec.k", NULL},
        {"--spec.method=ngram", "--spec.k=0", NULL, 2, "spec.k", NULL},
        {"--spec.method=guess", NULL, NULL, 2, "spec.method", NULL},
        {"--spec.method=ngram", "--spec.ngram_min=3", "--spec.ngram_max=2", 2, "spec.ngram", NULL},
        {"--spec.method=draft", NULL, NULL, 2, "spec.draft_model", NULL},
        {"--spec.method=draft", "--spec.draft_model=" DUET_SOURCE_DIR "/no/such/model", NULL, 1,
         "spec.draft_model", "no/such/model"},
        /* the demo model itself has KDA layers: a rejected draft could not be rolled back */
        {"--spec.method=draft", "--spec.draft_model=" MODEL, NULL, 1, "spec.draft_model", "KDA"},
        /* a fixture of another vocabulary (300 ids, the demo's 258) */
        {"--spec.method=draft",
         "--spec.draft_model=" DUET_SOURCE_DIR "/tests/fixtures/kda-first-fp32", NULL, 1,
         "spec.draft_model", "vocabulary"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char *argv[] = {GEN,
                        "--router",
                        "127.0.0.1:1",
                        "--router_connect_timeout_ms",
                        "0",
                        "--model",
                        MODEL,
                        "--threads",
                        "1",
                        (char *)cases[i].a,
                        (char *)cases[i].b,
                        (char *)cases[i].c,
                        NULL};
        const int status = run_capture(argv, err, sizeof(err));
        cr_expect_eq(status, cases[i].status, "%s %s: exit %d: %s", cases[i].a,
                     cases[i].b != NULL ? cases[i].b : "", status, err);
        cr_expect(strstr(err, cases[i].want) != NULL, "%s %s: '%s' lacks '%s'", cases[i].a,
                  cases[i].b != NULL ? cases[i].b : "", err, cases[i].want);
        if (cases[i].want2 != NULL)
            cr_expect(strstr(err, cases[i].want2) != NULL, "%s %s: '%s' lacks '%s'", cases[i].a,
                      cases[i].b != NULL ? cases[i].b : "", err, cases[i].want2);
    }
}
