/*
 * Fuzz target: the router's worker port (router/cluster/registry.c through its test seam
 * duet__registry_start_fake): frames from workers, decoded (proto/frame.c) and validated as the
 * router does on every received Envelope: the version, Register before anything else (protocol
 * version, role, model fingerprint, name), heartbeats, and which bodies a worker of each role may
 * send; the bodies of the request path go on to the router core (on_message).
 *
 * Input: a control byte (bit 0: adopt the first worker's fingerprint, else it must be
 * "fp-fuzz"; bits 1-7 seed the read sizes), then worker connections separated by
 * "\n--conn--\n", each the bytes one worker sends before its EOF.
 * Checked besides no crash / sanitizer report:
 *  - a worker reported up has a role (ctx or gen), a name (a C string within the table's
 *    buffer), the model fingerprint, and its capacity; ids are unique and increasing;
 *  - on_message gets only request-path bodies (Reserved, Refused, Tokens; MovePaused and Moved
 *    from generation workers) of this protocol version, from a worker that is up;
 *  - everything the registry wrote back is a stream of RegisterAck frames, one accepting ack per
 *    worker that came up;
 *  - heartbeat counter increments never exceed the counters.
 */
#include "fuzz/fuzz.h"
#include "fuzz/fuzz_loop.h"

#include <uv.h>

#include "common/status.h"
#include "common/strbuf.h"
#include "proto/frame.h"
#include "router/cluster/registry.h"

#define FUZZ_FP "fp-fuzz"

typedef struct {
    duet_registry_t *reg;
    size_t ups, downs, messages;
    uint64_t last_id;
    bool adopt;
    char fp[DUET_REGISTRY_FINGERPRINT_MAX + 1];
} app_t;

static void on_up(const duet_worker_info_t *w, void *user)
{
    app_t *app = user;
    FUZZ_CHECK(w->id > app->last_id, "worker id %llu after %llu", (unsigned long long)w->id,
               (unsigned long long)app->last_id);
    app->last_id = w->id;
    FUZZ_CHECK(w->role == DUET_WORKER_ROLE_CTX || w->role == DUET_WORKER_ROLE_GEN, "role %d",
               (int)w->role);
    FUZZ_CHECK(memchr(w->name, '\0', sizeof(w->name)) != NULL && w->name[0] != '\0', "name");
    FUZZ_CHECK(w->state == DUET_WORKER_STATE_UP && w->free_pages == w->kv_pages, "state");
    const char *fp = duet_registry_fingerprint(app->reg);
    FUZZ_CHECK(fp[0] != '\0' && strlen(fp) <= DUET_REGISTRY_FINGERPRINT_MAX, "fingerprint");
    if (!app->adopt)
        FUZZ_CHECK(strcmp(fp, FUZZ_FP) == 0, "fingerprint changed to %s", fp);
    app->ups++;
}

static void on_down(const duet_worker_info_t *w, const char *reason, void *user)
{
    app_t *app = user;
    FUZZ_CHECK(w->state == DUET_WORKER_STATE_DEAD && reason != NULL, "down");
    app->downs++;
}

static void on_message(uint64_t worker_id, const Duet__Envelope *env, void *user)
{
    app_t *app = user;
    duet_worker_info_t w;
    FUZZ_CHECK(duet_registry_get(app->reg, worker_id, &w) == DUET_OK, "message from worker %llu",
               (unsigned long long)worker_id);
    FUZZ_CHECK(w.state != DUET_WORKER_STATE_DEAD, "message from a dead worker");
    FUZZ_CHECK(env->version == DUET_PROTO_VERSION, "version %u", env->version);
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_RESERVED:
    case DUET__ENVELOPE__BODY_REFUSED:
    case DUET__ENVELOPE__BODY_TOKENS:
        break;
    case DUET__ENVELOPE__BODY_MOVE_PAUSED:
    case DUET__ENVELOPE__BODY_MOVED:
        FUZZ_CHECK(w.role == DUET_WORKER_ROLE_GEN, "a ctx worker's move message passed");
        break;
    default:
        FUZZ_CHECK(false, "body %d reached the router core", (int)env->body_case);
    }
    app->messages++;
}

static void on_stats(const duet_worker_info_t *w, const duet_worker_stats_t *d, void *user)
{
    const duet_worker_stats_t *now = &w->stats;
    FUZZ_CHECK(d->decode_steps <= now->decode_steps && d->decoded_tokens <= now->decoded_tokens &&
                   d->prefill_tokens <= now->prefill_tokens && d->resumes <= now->resumes,
               "an increment exceeds its counter");
    FUZZ_CHECK(d->step_seconds >= 0 && d->step_seconds <= now->step_seconds, "step_seconds %g",
               d->step_seconds);
    for (size_t i = 0; i < DUET_PROTO_SPEC_POSITIONS; i++)
        FUZZ_CHECK(d->spec_drafted[i] <= now->spec_drafted[i] &&
                       d->spec_accepted[i] <= now->spec_accepted[i],
                   "spec increments");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    uv_loop_t *loop = fuzz_loop();
    fuzz_in_t in = {data, size};
    uint8_t ctl = fuzz_byte(&in);
    uint32_t rng = (ctl >> 1) * 2654435761u + 5;
    app_t app = {.adopt = (ctl & 1) != 0};
    duet_registry_options_t o;
    duet_registry_options_default(&o);
    o.fingerprint = app.adopt ? NULL : FUZZ_FP;
    o.max_frame = 64 * 1024;
    o.max_workers = 4;
    o.on_worker_up = on_up;
    o.on_worker_down = on_down;
    o.on_message = on_message;
    o.on_stats = on_stats;
    o.user = &app;
    duet_strbuf_t out;
    duet_strbuf_init(&out);
    FUZZ_CHECK(duet__registry_start_fake(loop, &o, &out, &app.reg) == DUET_OK, "start");
    while (in.n > 0) {
        size_t len;
        const uint8_t *conn = fuzz_piece(&in, "\n--conn--\n", &len);
        size_t at = 0;
        while (at < len) {
            rng = rng * 1103515245u + 12345u;
            size_t chunk = 1 + (rng >> 16) % 256;
            if (chunk > len - at)
                chunk = len - at;
            if (!duet__registry_feed(app.reg, conn + at, chunk))
                break;
            at += chunk;
        }
        (void)duet__registry_feed(app.reg, NULL, 0); /* the worker's EOF */
        uv_run(loop, UV_RUN_NOWAIT);
    }
    bool closed = false;
    duet_registry_close(app.reg, fuzz_on_closed, &closed);
    while (!closed)
        uv_run(loop, UV_RUN_ONCE);

    /* What the registry wrote: RegisterAck frames, one accepting ack per worker up. */
    duet_frame_decoder_t d;
    FUZZ_CHECK(duet_frame_decoder_init(&d, 0) == DUET_OK, "decoder");
    const uint8_t *p = (const uint8_t *)out.data;
    size_t left = out.len, accepted = 0;
    while (left > 0) {
        size_t used = 0;
        Duet__Envelope *env = NULL;
        FUZZ_CHECK(duet_frame_decoder_feed(&d, p, left, &used, &env) == DUET_OK,
                   "the registry wrote a bad frame: %s", duet_error_last());
        p += used;
        left -= used;
        if (env != NULL) {
            FUZZ_CHECK(env->version == DUET_PROTO_VERSION &&
                           env->body_case == DUET__ENVELOPE__BODY_REGISTER_ACK,
                       "the registry wrote body %d", (int)env->body_case);
            accepted += env->register_ack->accepted;
            duet_envelope_free(env);
        }
    }
    FUZZ_CHECK(duet_frame_decoder_idle(&d), "a partial frame");
    FUZZ_CHECK(accepted == app.ups, "%zu accepting acks for %zu workers up", accepted, app.ups);
    duet_frame_decoder_free(&d);
    duet_strbuf_free(&out);
    return 0;
}
