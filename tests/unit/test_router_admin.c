/*
 * The admin API (router/cluster/admin.h) over real HTTP on loopback, with a FAKE ops table in place
 * of the router's registry (tests/unit/router_admin_fake.h): start-up refusal without a token,
 * authentication (missing, wrong, right), every endpoint, bad JSON and values, unknown workers
 * and paths, wrong methods, drain with wait completing when the fake reports the worker idle,
 * timing out, cut short by the client or by shutdown, and a deterministic fuzz of request
 * bodies. Each test ends by closing the admin API and proving the loop closed clean.
 */
#include "router_admin_fake.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ a tiny blocking client */

typedef struct {
    int status;
    char head[4096]; /* status line and headers */
    char body[65536];
    json_t *json; /* parsed body, NULL when not JSON */
} reply_t;

static int connect_admin(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(AH.port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0, "connect: %s", strerror(errno));
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

static void send_all(int fd, const char *s, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, s, n, MSG_NOSIGNAL);
        cr_assert_gt(w, 0, "send: %s", strerror(errno));
        s += w;
        n -= (size_t)w;
    }
}

/* Read until the server closes (we always send Connection: close) and split the reply. */
static void read_reply(int fd, reply_t *r)
{
    static char buf[1 << 17];
    size_t len = 0;
    for (;;) {
        ssize_t n = recv(fd, buf + len, sizeof(buf) - 1 - len, 0);
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    close(fd);
    memset(r, 0, sizeof(*r));
    cr_assert(len > 12, "no reply");
    r->status = atoi(buf + 9);
    char *sep = strstr(buf, "\r\n\r\n");
    cr_assert_not_null(sep);
    size_t hl = (size_t)(sep - buf);
    cr_assert_lt(hl, sizeof(r->head));
    memcpy(r->head, buf, hl);
    snprintf(r->body, sizeof(r->body), "%s", sep + 4);
    r->json = json_loads(r->body, 0, NULL);
}

static void reply_free(reply_t *r)
{
    json_decref(r->json);
    r->json = NULL;
}

/* Send a request; auth NULL = no Authorization header; body may be NULL. */
static int request_fd(const char *method, const char *target, const char *auth, const char *body,
                      size_t body_len)
{
    int fd = connect_admin();
    char head[2048];
    int n = snprintf(head, sizeof(head),
                     "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%s%s%sContent-Length: "
                     "%zu\r\n\r\n",
                     method, target, auth != NULL ? "Authorization: " : "",
                     auth != NULL ? auth : "", auth != NULL ? "\r\n" : "", body_len);
    send_all(fd, head, (size_t)n);
    if (body_len > 0)
        send_all(fd, body, body_len);
    return fd;
}

static void do_request(const char *method, const char *target, const char *auth, const char *body,
                       reply_t *r)
{
    int fd = request_fd(method, target, auth, body, body != NULL ? strlen(body) : 0);
    read_reply(fd, r);
}

#define AUTH "Bearer " TEST_TOKEN

static void call(const char *method, const char *target, const char *body, reply_t *r)
{
    do_request(method, target, AUTH, body, r);
}

static const char *error_message(const reply_t *r)
{
    json_t *m = json_object_get(json_object_get(r->json, "error"), "message");
    return json_is_string(m) ? json_string_value(m) : "";
}

static void expect_error(const reply_t *r, int status, const char *fragment)
{
    cr_expect_eq(r->status, status, "status %d, want %d: %s", r->status, status, r->body);
    cr_expect_not_null(r->json, "error body is not JSON: %s", r->body);
    json_t *code = json_object_get(json_object_get(r->json, "error"), "code");
    cr_expect_eq(json_integer_value(code), status, "%s", r->body);
    cr_expect(strstr(error_message(r), fragment) != NULL, "message \"%s\" lacks \"%s\"",
              error_message(r), fragment);
}

static double mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------------ start-up */

Test(admin, refuses_to_start_without_a_token, .timeout = 20)
{
    uv_loop_t loop;
    cr_assert_eq(uv_loop_init(&loop), 0);
    duet_admission_options_t ao;
    duet_admission_options_default(&ao);
    duet_admission_t *adm = NULL;
    cr_assert_eq(duet_admission_create(&ao, &adm), DUET_OK);
    duet_admin_options_t o;
    duet_admin_options_default(&o);
    o.port = 0;
    o.ops = &fake_ops;
    o.admission = adm;
    duet_admin_t *admin = NULL;
    duet_log_set_level(DUET_LOG_LEVEL_ERROR + 0);
    o.token = "";
    cr_expect_eq(duet_admin_start(&loop, &o, &admin), DUET_ERR_INVALID);
    cr_expect(strstr(duet_error_last(), "--admin.insecure-no-token") != NULL, "%s",
              duet_error_last());
    cr_expect(strstr(duet_error_last(), "admin.token") != NULL, "%s", duet_error_last());
    o.token = NULL;
    cr_expect_eq(duet_admin_start(&loop, &o, &admin), DUET_ERR_INVALID);
    o.token = "t";
    o.admission = NULL;
    cr_expect_eq(duet_admin_start(&loop, &o, &admin), DUET_ERR_INVALID);
    o.admission = adm;
    duet_admin_ops_t partial = fake_ops;
    partial.drain_forget = NULL;
    o.ops = &partial;
    cr_expect_eq(duet_admin_start(&loop, &o, &admin), DUET_ERR_INVALID);
    cr_expect(strstr(duet_error_last(), "ops") != NULL, "%s", duet_error_last());
    cr_expect_null(admin);
    cr_assert_eq(uv_loop_close(&loop), 0);
    duet_admission_destroy(adm);
}

Test(admin, insecure_no_token_serves_without_auth, .timeout = 20)
{
    ah_start_with("", true);
    reply_t r;
    do_request("GET", "/admin/workers", NULL, NULL, &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    reply_free(&r);
    ah_stop();
}

Test(admin, config_keys_fill_the_options, .timeout = 20)
{
    static const duet_config_key_t keys[] = {DUET_ADMIN_CONFIG_KEYS};
    duet_config_t *cfg = NULL;
    cr_assert_eq(duet_config_create(keys, sizeof(keys) / sizeof(keys[0]), &cfg), DUET_OK);
    char *envp[] = {"DUET_ADMIN_TOKEN=from-env", NULL};
    cr_assert_eq(duet_config_load_env(cfg, envp, NULL), DUET_OK);
    char *argv[] = {"prog", "--admin.insecure-no-token", "--admin.port", "9999", NULL};
    int npos = 0;
    cr_assert_eq(duet_config_parse_args(cfg, 4, argv, &npos), DUET_OK, "%s", duet_error_last());
    duet_admin_options_t o;
    duet_admin_options_default(&o);
    duet_admin_options_from_config(&o, cfg);
    cr_expect_str_eq(o.host, "127.0.0.1");
    cr_expect_eq(o.port, 9999);
    cr_expect_str_eq(o.token, "from-env");
    cr_expect(o.insecure_no_token);
    cr_expect_eq(o.drain_wait_timeout_ms, 60000);
    char *dump = NULL;
    cr_assert_eq(duet_config_dump(cfg, &dump), DUET_OK);
    cr_expect(strstr(dump, "from-env") == NULL, "the token is redacted in dumps");
    free(dump);
    duet_config_destroy(cfg);
}

/* ------------------------------------------------------------------ auth */

Test(admin, auth_missing_wrong_and_right_token, .timeout = 30)
{
    ah_start();
    reply_t r;
    do_request("GET", "/admin/workers", NULL, NULL, &r);
    expect_error(&r, 401, "missing Authorization");
    cr_expect(strstr(r.head, "WWW-Authenticate: Bearer") != NULL, "%s", r.head);
    reply_free(&r);

    const char *bad[] = {"Bearer wrong",     "Bearer " TEST_TOKEN "x", "Bearer s3cret",
                         "Bearer ",          "Basic " TEST_TOKEN,      TEST_TOKEN,
                         "Bearer" TEST_TOKEN};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        do_request("GET", "/admin/workers", bad[i], NULL, &r);
        expect_error(&r, 401, "invalid admin token");
        reply_free(&r);
    }
    /* Auth is checked before routing: unknown paths also need the token. */
    do_request("GET", "/admin/nope", "Bearer wrong", NULL, &r);
    cr_expect_eq(r.status, 401);
    reply_free(&r);

    do_request("GET", "/admin/workers", AUTH, NULL, &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    reply_free(&r);
    do_request("GET", "/admin/workers", "bearer   " TEST_TOKEN "  ", NULL, &r);
    cr_expect_eq(r.status, 200, "scheme is case-insensitive, spaces are trimmed: %s", r.body);
    reply_free(&r);
    ah_stop();
}

/* ------------------------------------------------------------------ endpoints */

Test(admin, lists_workers_with_state_and_load, .timeout = 30)
{
    ah_start();
    reply_t r;
    call("GET", "/admin/workers", NULL, &r);
    cr_assert_eq(r.status, 200, "%s", r.body);
    cr_expect(strstr(r.head, "Content-Type: application/json") != NULL, "%s", r.head);
    json_t *ws = json_object_get(r.json, "workers");
    cr_assert_eq(json_array_size(ws), 3, "%s", r.body);
    json_t *w0 = json_array_get(ws, 0);
    cr_expect_eq(json_integer_value(json_object_get(w0, "id")), 1);
    cr_expect_str_eq(json_string_value(json_object_get(w0, "name")), "gen-0");
    cr_expect_str_eq(json_string_value(json_object_get(w0, "role")), "gen");
    cr_expect_str_eq(json_string_value(json_object_get(w0, "state")), "live");
    json_t *load = json_object_get(w0, "load");
    cr_expect_eq(json_integer_value(json_object_get(load, "free_pages")), 1024);
    cr_expect_eq(json_integer_value(json_object_get(load, "kv_pages")), 4096);
    cr_expect_eq(json_integer_value(json_object_get(load, "free_state_slots")), 14);
    cr_expect_eq(json_integer_value(json_object_get(load, "state_slots")), 16);
    cr_expect_eq(json_integer_value(json_object_get(load, "running")), 2);
    cr_expect_eq(json_integer_value(json_object_get(load, "queued")), 1);
    cr_expect_eq(json_integer_value(json_object_get(load, "prefix_pages")), 0);
    json_t *load1 = json_object_get(json_array_get(ws, 1), "load");
    cr_expect_eq(json_integer_value(json_object_get(load1, "prefix_pages")), 7);
    cr_expect_eq(json_integer_value(json_object_get(load1, "prefix_entries")), 2);
    cr_expect_str_eq(json_string_value(json_object_get(json_array_get(ws, 2), "state")), "dead");
    reply_free(&r);
    ah_stop();
}

Test(admin, workers_carry_the_operators_figures, .timeout = 30)
{
    ah_start();
    reply_t r;
    call("GET", "/admin/workers", NULL, &r);
    cr_assert_eq(r.status, 200, "%s", r.body);
    json_t *w1 = json_array_get(json_object_get(r.json, "workers"), 1);
    cr_expect_str_eq(json_string_value(json_object_get(w1, "address")), "127.0.0.1:40002");
    cr_expect_str_eq(json_string_value(json_object_get(w1, "device")), "cpu");
    cr_expect_str_eq(json_string_value(json_object_get(w1, "dtype")), "f32");
    cr_expect_eq(json_integer_value(json_object_get(w1, "uptime_s")), 3726);
    cr_expect_eq(json_integer_value(json_object_get(w1, "heartbeat_age_ms")), 300);
    cr_expect_eq(json_real_value(json_object_get(w1, "utilisation")), 0.5);
    cr_expect_eq(json_integer_value(json_object_get(w1, "metrics_port")), 9101);
    reply_free(&r);
    ah_stop();
}

/* GET and POST /admin/log-level: the process's level, set at once; bad bodies are a 400 that
 * changes nothing and tells no worker. */
Test(admin, log_level_get_set_and_refusals, .timeout = 30)
{
    ah_start(); /* at warn */
    reply_t r;
    call("GET", "/admin/log-level", NULL, &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect_str_eq(json_string_value(json_object_get(r.json, "level")), "warn");
    reply_free(&r);
    static const struct {
        const char *body, *fragment;
    } bad[] = {
        {"{\"level\": \"loud\"}", "error|warn|info|debug|trace"},
        {"{\"level\": 3}", "error|warn|info|debug|trace"},
        {"{\"level\": \"info\", \"x\": 1}", "no other field"},
        {"[\"info\"]", "error|warn|info|debug|trace"},
        {"{\"level\": ", "bad JSON"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        call("POST", "/admin/log-level", bad[i].body, &r);
        expect_error(&r, 400, bad[i].fragment);
        reply_free(&r);
    }
    cr_expect_eq(duet_log_level(), DUET_LOG_LEVEL_WARN, "refused bodies change nothing");
    cr_expect_eq(atomic_load(&AH.fake.log_levels), 0);
    call("POST", "/admin/log-level", "{\"level\": \"ERROR\"}", &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect_str_eq(json_string_value(json_object_get(r.json, "level")), "error");
    cr_expect_str_eq(json_string_value(json_object_get(r.json, "previous")), "warn");
    cr_expect_eq(json_integer_value(json_object_get(r.json, "workers")), 2);
    reply_free(&r);
    cr_expect_eq(duet_log_level(), DUET_LOG_LEVEL_ERROR);
    cr_expect_eq(atomic_load(&AH.fake.log_levels), 1);
    call("DELETE", "/admin/log-level", NULL, &r);
    cr_expect_eq(r.status, 405, "%s", r.body);
    reply_free(&r);
    duet_log_set_level(DUET_LOG_LEVEL_WARN);
    ah_stop();
}

Test(admin, drain_and_undrain_without_wait, .timeout = 30)
{
    ah_start();
    reply_t r;
    call("POST", "/admin/workers/gen-0/drain", NULL, &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect_str_eq(json_string_value(json_object_get(r.json, "state")), "draining");
    cr_expect_str_eq(json_string_value(json_object_get(r.json, "worker")), "gen-0");
    cr_expect(json_is_false(json_object_get(r.json, "idle")), "gen-0 runs 2: %s", r.body);
    reply_free(&r);
    call("GET", "/admin/workers", NULL, &r);
    cr_expect_str_eq(json_string_value(json_object_get(
                         json_array_get(json_object_get(r.json, "workers"), 0), "state")),
                     "draining");
    reply_free(&r);
    call("POST", "/admin/workers/gen-1/drain?wait=0", NULL, &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect(json_is_true(json_object_get(r.json, "idle")), "%s", r.body);
    reply_free(&r);
    call("POST", "/admin/workers/gen%2D0/undrain", NULL, &r);
    cr_expect_eq(r.status, 200, "percent-encoded names are decoded: %s", r.body);
    cr_expect_str_eq(json_string_value(json_object_get(r.json, "state")), "live");
    reply_free(&r);
    cr_expect_eq(atomic_load(&AH.fake.drains), 2);
    cr_expect_eq(atomic_load(&AH.fake.undrains), 1);
    cr_expect_eq(atomic_load(&AH.fake.migrates), 0, "no drain asked to migrate");
    ah_stop();
}

Test(admin, drain_with_migrate_reaches_the_router, .timeout = 30)
{
    ah_start();
    reply_t r;
    call("POST", "/admin/workers/gen-0/drain?migrate=1", NULL, &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect(json_is_true(json_object_get(r.json, "migrate")), "%s", r.body);
    reply_free(&r);
    call("POST", "/admin/workers/gen-1/drain?migrate=false", NULL, &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect(json_is_false(json_object_get(r.json, "migrate")), "%s", r.body);
    reply_free(&r);
    call("POST", "/admin/workers/gen-0/drain?migrate=sure", NULL, &r);
    expect_error(&r, 400, "migrate");
    reply_free(&r);
    cr_expect_eq(atomic_load(&AH.fake.drains), 2, "the bad value reached no op");
    cr_expect_eq(atomic_load(&AH.fake.migrates), 1);
    ah_stop();
}

Test(admin, unknown_worker_dead_worker_and_bad_names, .timeout = 30)
{
    ah_start();
    reply_t r;
    call("POST", "/admin/workers/gen-9/drain", NULL, &r);
    expect_error(&r, 404, "unknown worker \"gen-9\"");
    reply_free(&r);
    call("POST", "/admin/workers/gen-9/drain?wait=1", NULL, &r);
    expect_error(&r, 404, "unknown worker");
    reply_free(&r);
    call("POST", "/admin/workers/gen-9/undrain", NULL, &r);
    expect_error(&r, 404, "unknown worker");
    reply_free(&r);
    call("POST", "/admin/workers/ctx-0/drain", NULL, &r);
    expect_error(&r, 409, "worker ctx-0 is dead");
    reply_free(&r);
    call("POST", "/admin/workers/ctx-0/drain?wait=1", NULL, &r);
    expect_error(&r, 409, "dead");
    reply_free(&r);
    call("POST", "/admin/workers/ctx-0/undrain", NULL, &r);
    expect_error(&r, 409, "dead");
    reply_free(&r);
    call("POST", "/admin/workers/gen%zz/drain", NULL, &r);
    expect_error(&r, 400, "bad worker name");
    reply_free(&r);
    call("POST", "/admin/workers/gen%0a/drain", NULL, &r);
    expect_error(&r, 400, "bad worker name");
    reply_free(&r);
    call("POST", "/admin/workers//drain", NULL, &r);
    expect_error(&r, 400, "bad worker name");
    reply_free(&r);
    call("POST", "/admin/workers/gen-0/explode", NULL, &r);
    expect_error(&r, 404, "no such admin endpoint");
    reply_free(&r);
    call("POST", "/admin/workers/gen-0", NULL, &r);
    expect_error(&r, 404, "no such admin endpoint");
    reply_free(&r);
    call("POST", "/admin/workers/gen-0/drain?wait=maybe", NULL, &r);
    expect_error(&r, 400, "wait");
    reply_free(&r);
    call("POST", "/admin/workers/gen-0/drain?wait=1&timeout_s=-3", NULL, &r);
    expect_error(&r, 400, "timeout_s");
    reply_free(&r);
    call("POST", "/admin/workers/gen-0/drain?wait=1&timeout_s=99999", NULL, &r);
    expect_error(&r, 400, "timeout_s");
    reply_free(&r);
    cr_expect_eq(atomic_load(&AH.fake.drains), 0, "refused requests reach no op");
    ah_stop();
}

Test(admin, unknown_paths_and_wrong_methods, .timeout = 30)
{
    ah_start();
    reply_t r;
    call("GET", "/admin/nothing", NULL, &r);
    expect_error(&r, 404, "no such admin endpoint: /admin/nothing");
    reply_free(&r);
    call("GET", "/", NULL, &r);
    expect_error(&r, 404, "no such admin endpoint");
    reply_free(&r);
    struct {
        const char *method, *path, *allow;
    } cases[] = {
        {"POST", "/admin/workers", "GET"},
        {"DELETE", "/admin/workers", "GET"},
        {"GET", "/admin/workers/gen-0/drain", "POST"},
        {"PUT", "/admin/workers/gen-0/undrain", "POST"},
        {"DELETE", "/admin/admission", "GET, POST"},
        {"GET", "/admin/admission/pause", "POST"},
        {"GET", "/admin/admission/resume", "POST"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        call(cases[i].method, cases[i].path, NULL, &r);
        expect_error(&r, 405, "not allowed");
        char want[64];
        snprintf(want, sizeof(want), "Allow: %s\r\n", cases[i].allow);
        cr_expect(strstr(r.head, want) != NULL, "%s %s: %s", cases[i].method, cases[i].path,
                  r.head);
        reply_free(&r);
    }
    ah_stop();
}

Test(admin, admission_get_pause_resume_and_set, .timeout = 30)
{
    ah_start();
    reply_t r;
    call("GET", "/admin/admission", NULL, &r);
    cr_assert_eq(r.status, 200, "%s", r.body);
    cr_expect(json_is_false(json_object_get(r.json, "paused")));
    cr_expect(json_is_true(json_object_get(r.json, "has_capacity")));
    cr_expect_eq(json_integer_value(json_object_get(r.json, "max_inflight")), 8);
    cr_expect_eq(json_integer_value(json_object_get(r.json, "max_queue")), 16);
    cr_expect_eq(json_integer_value(json_object_get(r.json, "in_flight")), 0);
    cr_expect_eq(json_integer_value(json_object_get(r.json, "queued")), 0);
    cr_expect(
        json_is_integer(json_object_get(json_object_get(r.json, "rejected_total"), "queue_full")),
        "%s", r.body);
    reply_free(&r);

    call("POST", "/admin/admission/pause", NULL, &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect(json_is_true(json_object_get(r.json, "paused")));
    reply_free(&r);
    call("POST", "/admin/admission/resume", "", &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect(json_is_false(json_object_get(r.json, "paused")));
    reply_free(&r);
    cr_expect_eq(atomic_load(&AH.fake.changed), 1, "resume tells the router");

    call("POST", "/admin/admission", "{\"max_inflight\": 3, \"max_queue\": 0}", &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect_eq(json_integer_value(json_object_get(r.json, "max_inflight")), 3);
    cr_expect_eq(json_integer_value(json_object_get(r.json, "max_queue")), 0);
    reply_free(&r);
    call("POST", "/admin/admission", "{\"max_queue\": 7}", &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect_eq(json_integer_value(json_object_get(r.json, "max_inflight")), 3, "kept");
    cr_expect_eq(json_integer_value(json_object_get(r.json, "max_queue")), 7);
    reply_free(&r);
    cr_expect_eq(atomic_load(&AH.fake.changed), 3);

    struct {
        const char *body, *fragment;
    } bad[] = {
        {"", "bad JSON"},
        {"{", "bad JSON"},
        {"{\"max_inflight\": 3,}", "bad JSON"},
        {"[1,2]", "expected a JSON object"},
        {"{}", "nothing to set"},
        {"{\"max_inflight\": 0}", "max_inflight"},
        {"{\"max_inflight\": -5}", "max_inflight"},
        {"{\"max_inflight\": 2.5}", "max_inflight"},
        {"{\"max_inflight\": \"4\"}", "max_inflight"},
        {"{\"max_queue\": 1000001}", "max_queue"},
        {"{\"max_queue\": null, \"max_inflight\": null}", "nothing to set"},
        {"{\"max_inflight\": 4, \"bogus\": 1}", "unknown field \"bogus\""},
        {"{\"max_inflight\": 4, \"max_inflight\": 5}", "bad JSON"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        call("POST", "/admin/admission", bad[i].body, &r);
        expect_error(&r, 400, bad[i].fragment);
        reply_free(&r);
    }
    call("GET", "/admin/admission", NULL, &r);
    cr_expect_eq(json_integer_value(json_object_get(r.json, "max_inflight")), 3,
                 "refused bodies change nothing");
    cr_expect_eq(json_integer_value(json_object_get(r.json, "max_queue")), 7);
    reply_free(&r);
    cr_expect_eq(atomic_load(&AH.fake.changed), 3);
    ah_stop();
}

/* ------------------------------------------------------------------ drain with wait */

Test(admin, drain_wait_answers_when_the_worker_goes_idle, .timeout = 30)
{
    ah_start();
    double t0 = mono_ms();
    int fd = request_fd("POST", "/admin/workers/gen-0/drain?wait=1", AUTH, NULL, 0);
    /* The router's wait (waited_ms) starts when it handles the drain, which a loaded machine
     * may reach tens of ms after the request left: the 300 ms start once gen-0 shows it. */
    for (int i = 0, draining = 0; i < 400 && !draining; i++) {
        reply_t w;
        call("GET", "/admin/workers", NULL, &w);
        const char *st = json_string_value(
            json_object_get(json_array_get(json_object_get(w.json, "workers"), 0), "state"));
        draining = st != NULL && strcmp(st, "draining") == 0;
        reply_free(&w);
        if (!draining)
            sleep_ms(5);
    }
    sleep_ms(300);
    ah_make_idle("gen-0");
    reply_t r;
    read_reply(fd, &r);
    double dt = mono_ms() - t0;
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect(json_is_true(json_object_get(r.json, "idle")), "%s", r.body);
    cr_expect_geq(json_integer_value(json_object_get(r.json, "waited_ms")), 250, "%s", r.body);
    cr_expect_geq(dt, 280.0, "answered only after the worker went idle (%.0f ms)", dt);
    cr_expect_lt(dt, 3000.0);
    reply_free(&r);
    cr_expect_eq(atomic_load(&AH.fake.forgets), 0, "completed waits need no forget");

    /* Already idle: answered at once (the fake calls back inside drain). */
    call("POST", "/admin/workers/gen-1/drain?wait=true", NULL, &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect(json_is_true(json_object_get(r.json, "idle")));
    reply_free(&r);
    ah_stop();
}

Test(admin, drain_wait_times_out_with_a_clear_error, .timeout = 30)
{
    ah_start();
    double t0 = mono_ms();
    reply_t r;
    call("POST", "/admin/workers/gen-0/drain?wait=1&timeout_s=0.4", NULL, &r);
    double dt = mono_ms() - t0;
    expect_error(&r, 504, "worker gen-0 still has running requests after 0.4 s");
    cr_expect(strstr(error_message(&r), "stays draining") != NULL, "%s", error_message(&r));
    cr_expect_geq(dt, 380.0);
    cr_expect_lt(dt, 3000.0);
    reply_free(&r);
    cr_expect_eq(atomic_load(&AH.fake.forgets), 1, "the router was told to forget the waiter");
    /* A late idle report finds nothing to call. */
    ah_make_idle("gen-0");
    call("GET", "/admin/workers", NULL, &r);
    cr_expect_eq(r.status, 200);
    reply_free(&r);
    ah_stop();
}

Test(admin, drain_wait_ended_by_undrain_is_a_conflict, .timeout = 30)
{
    ah_start();
    int fd = request_fd("POST", "/admin/workers/gen-0/drain?wait=1", AUTH, NULL, 0);
    sleep_ms(200);
    reply_t r;
    call("POST", "/admin/workers/gen-0/undrain", NULL, &r);
    cr_expect_eq(r.status, 200, "%s", r.body);
    reply_free(&r);
    read_reply(fd, &r);
    expect_error(&r, 409, "worker was undrained");
    reply_free(&r);
    ah_stop();
}

Test(admin, drain_wait_client_gone_forgets_the_waiter, .timeout = 30)
{
    ah_start();
    int fd = request_fd("POST", "/admin/workers/gen-0/drain?wait=1", AUTH, NULL, 0);
    sleep_ms(200);
    close(fd);
    for (int i = 0; i < 200 && atomic_load(&AH.fake.forgets) == 0; i++)
        sleep_ms(10);
    cr_expect_eq(atomic_load(&AH.fake.forgets), 1);
    ah_stop();
}

Test(admin, close_answers_pending_waits_with_503, .timeout = 30)
{
    ah_start();
    int fd = request_fd("POST", "/admin/workers/gen-0/drain?wait=1", AUTH, NULL, 0);
    sleep_ms(200);
    ah_stop();
    reply_t r;
    read_reply(fd, &r);
    expect_error(&r, 503, "shutting down");
    reply_free(&r);
    cr_expect_eq(atomic_load(&AH.fake.forgets), 1);
}

/* ------------------------------------------------------------------ fuzz */

Test(admin, fuzz_admission_bodies_and_paths, .timeout = 120)
{
    ah_start();
    unsigned rng = 7;
    static const char *seeds[] = {
        "{\"max_inflight\": 4, \"max_queue\": 8}",
        "{\"max_queue\": 0}",
        "{\"max_inflight\": 1}",
        "[]",
        "null",
        "\"x\"",
        "{\"max_inflight\": {\"a\": [1, 2, 3]}}",
    };
    char body[512];
    int ok = 0, bad = 0;
    for (int i = 0; i < 1500; i++) {
        const char *s = seeds[rand_r(&rng) % (sizeof(seeds) / sizeof(seeds[0]))];
        size_t n = strlen(s);
        memcpy(body, s, n);
        int kind = rand_r(&rng) % 3;
        if (kind == 0) { /* random bytes */
            n = (size_t)(rand_r(&rng) % 64);
            for (size_t k = 0; k < n; k++)
                body[k] = (char)(rand_r(&rng) % 256);
        } else if (kind == 1) { /* flip a few bytes */
            for (int k = 0; k < 1 + rand_r(&rng) % 4 && n > 0; k++)
                body[rand_r(&rng) % n] = (char)(rand_r(&rng) % 256);
        } else { /* truncate or splice */
            if (n > 0)
                n = (size_t)(rand_r(&rng) % (int)n);
        }
        reply_t r;
        int fd = request_fd("POST", "/admin/admission", AUTH, body, n);
        read_reply(fd, &r);
        cr_assert(r.status == 200 || r.status == 400, "body %d: status %d %s", i, r.status, r.body);
        cr_assert_not_null(r.json, "body %d: reply is not JSON: %s", i, r.body);
        if (r.status == 200)
            ok++;
        else
            bad++;
        reply_free(&r);
    }
    /* Random worker names and actions: never a crash, always a JSON answer. */
    static const char alphabet[] = "abg-0%2Fz/.~";
    for (int i = 0; i < 300; i++) {
        char path[128];
        int len = snprintf(path, sizeof(path), "/admin/workers/");
        int nn = rand_r(&rng) % 12;
        for (int k = 0; k < nn; k++)
            path[len++] = alphabet[rand_r(&rng) % (sizeof(alphabet) - 1)];
        path[len] = '\0';
        snprintf(path + len, sizeof(path) - (size_t)len, "%s",
                 rand_r(&rng) % 2 ? "/drain" : "/undrain");
        reply_t r;
        call("POST", path, NULL, &r);
        cr_assert(r.status == 200 || r.status == 400 || r.status == 404 || r.status == 409,
                  "%s: %d", path, r.status);
        cr_assert_not_null(r.json, "%s: %s", path, r.body);
        reply_free(&r);
    }
    printf("admin fuzz: %d bodies accepted, %d refused with 400\n", ok, bad);
    reply_t r;
    call("GET", "/admin/admission", NULL, &r);
    cr_expect_eq(r.status, 200);
    reply_free(&r);
    ah_stop();
}
