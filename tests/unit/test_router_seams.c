/*
 * The socketless test seams of the worker registry (duet__registry_start_fake / _feed) and the
 * admin API (duet__admin_start_fake / _feed), which fuzz/fuzz_registry.c and fuzz/fuzz_admin.c
 * drive: bytes fed in any split are read as from a socket, what the module writes comes out in
 * order, and closing leaves no handle on the loop.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>

#include <stdio.h>
#include <string.h>

#include "common/strbuf.h"
#include "proto/envelope.h"
#include "proto/frame.h"
#include "router/cluster/admin.h"
#include "router/cluster/admission.h"
#include "router/cluster/registry.h"

static void on_closed(void *user)
{
    *(bool *)user = true;
}

/* ---------------------------------------------------------------- registry */

typedef struct {
    int ups;
    uint64_t token_request; /* request_id of the last Tokens that reached on_message */
} reg_seen_t;

static void reg_on_up(const duet_worker_info_t *w, void *user)
{
    ((reg_seen_t *)user)->ups++;
}

static void reg_on_message(uint64_t worker_id, const Duet__Envelope *env, void *user)
{
    if (env->body_case == DUET__ENVELOPE__BODY_TOKENS)
        ((reg_seen_t *)user)->token_request = env->tokens->request_id;
}

static void append_register(duet_strbuf_t *sb, const char *fingerprint)
{
    Duet__Capacity cap = DUET__CAPACITY__INIT;
    cap.kv_pages = 64;
    cap.page_tokens = 16;
    Duet__Register r = DUET__REGISTER__INIT;
    r.role = DUET__WORKER_ROLE__WORKER_ROLE_GEN;
    r.worker_name = "gen-0";
    r.version = DUET_PROTO_VERSION;
    r.model_fingerprint = (char *)fingerprint;
    r.capacity = &cap;
    Duet__Envelope env = duet_envelope_register_(&r);
    cr_assert_eq(duet_frame_append(&env, sb), DUET_OK);
}

/* The RegisterAcks in out[from..]: how many, and whether the last one accepted. */
static int acks(const duet_strbuf_t *out, size_t from, bool *last_accepted)
{
    duet_frame_decoder_t d;
    cr_assert_eq(duet_frame_decoder_init(&d, 0), DUET_OK);
    const uint8_t *p = (const uint8_t *)out->data + from;
    size_t left = out->len - from;
    int n = 0;
    while (left > 0) {
        size_t used = 0;
        Duet__Envelope *env = NULL;
        cr_assert_eq(duet_frame_decoder_feed(&d, p, left, &used, &env), DUET_OK);
        p += used;
        left -= used;
        if (env != NULL) {
            cr_assert_eq(env->body_case, DUET__ENVELOPE__BODY_REGISTER_ACK);
            *last_accepted = env->register_ack->accepted;
            n++;
            duet_envelope_free(env);
        }
    }
    duet_frame_decoder_free(&d);
    return n;
}

Test(router_seams, registry_reads_frames_in_any_split_and_writes_its_acks, .timeout = 10,
     .init = cr_redirect_stderr)
{
    uv_loop_t loop;
    cr_assert_eq(uv_loop_init(&loop), 0);
    reg_seen_t seen = {0};
    duet_registry_options_t o;
    duet_registry_options_default(&o);
    o.fingerprint = "fp-test";
    o.on_worker_up = reg_on_up;
    o.on_message = reg_on_message;
    o.user = &seen;
    duet_strbuf_t out;
    duet_strbuf_init(&out);
    duet_registry_t *reg = NULL;
    cr_assert_eq(duet__registry_start_fake(&loop, &o, &out, &reg), DUET_OK, "%s",
                 duet_error_last());

    /* a worker: Register, then Tokens, fed 3 bytes at a time */
    duet_strbuf_t in;
    duet_strbuf_init(&in);
    append_register(&in, "fp-test");
    uint32_t ids[] = {5, 6};
    Duet__Tokens t = DUET__TOKENS__INIT;
    t.request_id = 77;
    t.n_ids = 2;
    t.ids = ids;
    Duet__Envelope env = duet_envelope_tokens(&t);
    cr_assert_eq(duet_frame_append(&env, &in), DUET_OK);
    for (size_t at = 0; at < in.len; at += 3)
        cr_assert(duet__registry_feed(reg, (const uint8_t *)in.data + at,
                                      in.len - at < 3 ? in.len - at : 3));
    cr_assert_eq(seen.ups, 1);
    cr_assert_eq(seen.token_request, 77u);
    bool accepted = false;
    cr_assert_eq(acks(&out, 0, &accepted), 1);
    cr_assert(accepted);
    cr_assert(duet__registry_feed(reg, NULL, 0)); /* its EOF: the worker is gone */
    uv_run(&loop, UV_RUN_NOWAIT);

    /* a second worker with another model: refused, and its connection closes */
    size_t mark = out.len;
    duet_strbuf_free(&in);
    append_register(&in, "fp-other");
    cr_assert(duet__registry_feed(reg, (const uint8_t *)in.data, in.len));
    cr_assert_eq(acks(&out, mark, &accepted), 1);
    cr_assert(!accepted, "a worker of another model was accepted");
    cr_assert_eq(seen.ups, 1);
    cr_assert(!duet__registry_feed(reg, (const uint8_t *)in.data, in.len),
              "a refused connection read on");

    bool closed = false;
    duet_registry_close(reg, on_closed, &closed);
    while (!closed)
        uv_run(&loop, UV_RUN_ONCE);
    cr_assert_eq(uv_loop_close(&loop), 0, "a handle was left open");
    duet_strbuf_free(&in);
    duet_strbuf_free(&out);
}

/* ---------------------------------------------------------------- admin API */

static void adm_list(void *ctx, duet_admin_worker_visit_cb visit, void *visit_user)
{
    const duet_admin_worker_info_t w = {
        .id = 1, .name = "gen-0", .role = "gen", .state = DUET_ADMIN_WORKER_LIVE};
    visit(&w, visit_user);
}

static duet_status_t adm_drain(void *ctx, const char *name, bool migrate,
                               duet_admin_drain_done_cb done_cb, void *done_user)
{
    return strcmp(name, "gen-0") == 0 ? DUET_OK : DUET_ERR_NOT_FOUND;
}

static void adm_forget(void *ctx, void *done_user) {}

static duet_status_t adm_undrain(void *ctx, const char *name)
{
    return DUET_OK;
}

Test(router_seams, admin_answers_pipelined_requests_in_order, .timeout = 10,
     .init = cr_redirect_stderr)
{
    uv_loop_t loop;
    cr_assert_eq(uv_loop_init(&loop), 0);
    duet_admission_options_t ao;
    duet_admission_options_default(&ao);
    duet_admission_t *adm = NULL;
    cr_assert_eq(duet_admission_create(&ao, &adm), DUET_OK);
    const duet_admin_ops_t ops = {.list_workers = adm_list,
                                  .drain = adm_drain,
                                  .drain_forget = adm_forget,
                                  .undrain = adm_undrain};
    duet_admin_options_t o;
    duet_admin_options_default(&o);
    o.token = "tok";
    o.ops = &ops;
    o.admission = adm;
    duet_strbuf_t out;
    duet_strbuf_init(&out);
    duet_admin_t *admin = NULL;
    cr_assert_eq(duet__admin_start_fake(&loop, &o, &out, &admin), DUET_OK, "%s", duet_error_last());
    const char *req = "GET /admin/workers HTTP/1.1\r\nAuthorization: Bearer tok\r\n\r\n"
                      "POST /admin/workers/gen-0/drain HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
                      "POST /admin/workers/gen-9/drain HTTP/1.1\r\nAuthorization: Bearer tok\r\n"
                      "Content-Length: 0\r\n\r\n";
    for (size_t at = 0, len = strlen(req); at < len; at += 7) {
        cr_assert(duet__admin_feed(admin, req + at, len - at < 7 ? len - at : 7));
        uv_run(&loop, UV_RUN_NOWAIT);
    }
    (void)duet__admin_feed(admin, "", 0);
    bool closed = false;
    duet_admin_close(admin, on_closed, &closed);
    while (!closed)
        uv_run(&loop, UV_RUN_ONCE);
    cr_assert_eq(uv_loop_close(&loop), 0, "a handle was left open");
    const char *a = strstr(out.data, "HTTP/1.1 200"), *b = strstr(out.data, "HTTP/1.1 401"),
               *c = strstr(out.data, "HTTP/1.1 404");
    cr_assert(a != NULL && b > a && c > b, "answers out of order: %s", out.data);
    cr_assert_not_null(strstr(a, "\"gen-0\""));
    duet_strbuf_free(&out);
    duet_admission_destroy(adm);
}
