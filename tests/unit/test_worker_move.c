/*
 * Moving a running request between two generation workers (issue 37), the worker glue end to end
 * in one process: two transfer contexts over shared memory, two instances of the demo model
 * loaded as generation workers load theirs (pools from duet_worker_pool_alloc, the replay pool
 * too; layouts from duet_worker_layout), a speculating sequence on the first right after an
 * accept (rows still to replay), moved with the real transfer layer (reserve, encode / decode as
 * the router carries it, send, both outcomes DONE with the checksum verified) into a fresh
 * sequence of the second, handed over with duet_model_seq_set_received. Reference: the sender's
 * model, which then takes the same steps (a verify with an accept, plain decode). Bound: 0
 * (memcmp) on every logits row. And the glue's refusals: a model without a replay pool
 * advertises replay_rows 0 and cannot take rows.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model.h"
#include "transfer/xfer.h"
#include "worker/worker.h"

#include "model_step_util.h"

#define SPEC_ROWS 5
#define DEMO      DUET_SOURCE_DIR "/models/duet-demo"

static duet_xfer_ctx_t *ctx_new(void)
{
    duet_xfer_ctx_opts_t o;
    duet_xfer_ctx_opts_default(&o);
    duet_xfer_ctx_t *x = NULL;
    cr_assert_eq(duet_xfer_ctx_create(&o, &x), DUET_OK, "%s", duet_error_last());
    return x;
}

/* The demo model as a generation worker loads it: pools from UCX through x (spec_rows 0: no
 * replay pool). */
static duet_model_t *gen_model(duet_xfer_ctx_t *x, int64_t spec_rows)
{
    duet_model_opts_t o;
    duet_model_opts_default(&o);
    o.n_threads = 2;
    o.max_seqs = 4;
    o.max_seq_len = 256;
    o.page_tokens = 16;
    o.spec_rows = spec_rows;
    o.pool_alloc = duet_worker_pool_alloc;
    o.pool_alloc_user = x;
    duet_model_t *m = NULL;
    cr_assert_eq(duet_model_load(DEMO, &o, &m), DUET_OK, "%s", duet_error_last());
    return m;
}

typedef struct {
    int ended;
    duet_xfer_outcome_t o;
} outcome_t;

static void on_outcome(const duet_xfer_outcome_t *o, void *user)
{
    outcome_t *r = user;
    r->ended = 1;
    r->o = *o;
    r->o.message = NULL;
    if (o->kind != DUET_XFER_OUTCOME_DONE)
        cr_log_info("transfer aborted: %s: %s", duet_xfer_reason_str(o->reason), o->message);
}

static void setup(void)
{
    setenv("UCX_TLS", "posix,sysv,cma,self", 1);
}

TestSuite(worker_move, .init = setup, .timeout = 120);

Test(worker_move, speculating_request_moves_bit_identically)
{
    duet_xfer_ctx_t *xa = ctx_new(), *xb = ctx_new();
    duet_model_t *A = gen_model(xa, SPEC_ROWS), *B = gen_model(xb, SPEC_ROWS);
    duet_xfer_layout_t la, lb;
    duet_worker_layout(A, &la);
    duet_worker_layout(B, &lb);
    cr_assert_eq(la.replay_rows, SPEC_ROWS, "the layout advertises the replay pool's rows");
    cr_assert_eq(memcmp(&la, &lb, sizeof(la)), 0);
    cr_assert_eq(duet_worker_xfer_pool(DUET_MODEL_POOL_REPLAY), DUET_XFER_POOL_REPLAY);
    cr_assert_eq(duet_worker_xfer_pool(DUET_MODEL_POOL_KDA), DUET_XFER_POOL_KDA);
    cr_assert_eq(duet_worker_xfer_pool(DUET_MODEL_POOL_KV), DUET_XFER_POOL_KV);

    const int64_t V = duet_model_config(A)->vocab_size, P = 37;
    float *lg_a = malloc(sizeof(float) * (size_t)(P * V));
    float *lg_b = malloc(sizeof(float) * (size_t)(P * V));
    int32_t toks[P], drafts[SPEC_ROWS], next[SPEC_ROWS], cont[4];
    for (int64_t i = 0; i < P; i++)
        toks[i] = (int32_t)((i * 37 + 11) % V);
    for (int j = 0; j < SPEC_ROWS; j++) {
        drafts[j] = (int32_t)((j * 101 + 5) % V);
        next[j] = (int32_t)((j * 53 + 17) % V);
    }
    for (int j = 0; j < 4; j++)
        cont[j] = (int32_t)((j * 29 + 3) % V);

    /* the sender: a prompt, a verify of 4 drafts, 3 rows accepted and not yet folded in */
    duet_seq_t a, b, other;
    cr_assert_eq(duet_model_seq_open(A, 128, &a), DUET_OK);
    step(A, &a, toks, P, 0, lg_a);
    step(A, &a, drafts, SPEC_ROWS, 1, lg_a);
    cr_assert_eq(duet_model_seq_accept(A, &a, 3), DUET_OK);
    cr_assert_eq(a.n_replay, 3);

    /* the receiver reserves a fresh sequence (other pages and slot than the sender's) */
    cr_assert_eq(duet_model_seq_open(B, 48, &other), DUET_OK);
    cr_assert_eq(duet_model_seq_open(B, 128, &b), DUET_OK);
    cr_assert_neq(b.kda_slot, a.kda_slot);
    outcome_t ra = {0}, rb = {0};
    duet_xfer_recv_args_t ra_args = {.req_id = 7,
                                     .layout = lb,
                                     .pages = b.pages,
                                     .n_pages = (uint32_t)b.n_pages,
                                     .kda_slot = b.kda_slot,
                                     .n_tokens = (uint64_t)a.n_tokens,
                                     .n_replay = (uint32_t)a.n_replay,
                                     .group_size = 1,
                                     .deadline_unix_ms = duet_xfer_now_unix_ms() + 20000,
                                     .cb = on_outcome,
                                     .user = &rb};
    duet_xfer_reservation_t res, got;
    cr_assert_eq(duet_xfer_recv_reserve(xb, &ra_args, &res), DUET_OK, "%s", duet_error_last());
    uint8_t buf[1 << 14];
    size_t len;
    cr_assert_eq(duet_xfer_reservation_encode(&res, buf, sizeof(buf), &len), DUET_OK);
    cr_assert_eq(duet_xfer_reservation_decode(buf, len, 0, &got), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(got.n_replay, 3u);

    /* the sender moves pages, slot and the 3 rows; every layer is final */
    duet_xfer_send_args_t sa = {.req_id = 7,
                                .reservations = &got,
                                .n_ranks = 1,
                                .layout = la,
                                .src = {.pages = a.pages,
                                        .n_pages = (uint32_t)a.n_pages,
                                        .kda_slot = a.kda_slot,
                                        .n_tokens = (uint64_t)a.n_tokens,
                                        .n_replay = (uint32_t)a.n_replay},
                                .checksum = true,
                                .cb = on_outcome,
                                .user = &ra};
    duet_xfer_id_t id;
    cr_assert_eq(duet_xfer_send_start(xa, &sa, &id), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_free(&got);
    for (uint32_t l = 0; l < la.n_mla_layers; l++)
        cr_assert_eq(duet_xfer_send_layer_ready(xa, id, l), DUET_OK);
    cr_assert_eq(duet_xfer_send_kda_ready(xa, id), DUET_OK);
    for (int i = 0; i < 20000 && !(ra.ended && rb.ended); i++) {
        duet_xfer_ctx_progress(xa);
        duet_xfer_ctx_wait(xb, 1);
    }
    cr_assert(ra.ended && rb.ended, "the transfer did not end");
    cr_assert_eq(ra.o.kind, DUET_XFER_OUTCOME_DONE);
    cr_assert_eq(rb.o.kind, DUET_XFER_OUTCOME_DONE);
    cr_assert(rb.o.has_checksum && rb.o.checksum == ra.o.checksum, "checksum not verified");
    const uint64_t row = (6ull * la.kda_heads * la.kda_head_dim + la.kda_heads) * 4;
    cr_assert_eq(rb.o.bytes,
                 (uint64_t)a.n_tokens * la.n_mla_layers * la.token_bytes +
                     duet_model_seq_state_bytes(A) + 3ull * la.n_kda_layers * row,
                 "the receiver counted %llu bytes", (unsigned long long)rb.o.bytes);

    /* the receiver takes the sequence over; both continue alike */
    cr_assert_eq(duet_model_seq_set_received(B, &b, a.n_tokens, a.n_replay), DUET_OK, "%s",
                 duet_error_last());
    step(A, &a, next, SPEC_ROWS, 1, lg_a);
    step(B, &b, next, SPEC_ROWS, 1, lg_b);
    cr_assert(memcmp(lg_a, lg_b, sizeof(float) * (size_t)(SPEC_ROWS * V)) == 0,
              "verify logits after the move differ");
    cr_assert_eq(duet_model_seq_accept(A, &a, 2), DUET_OK);
    cr_assert_eq(duet_model_seq_accept(B, &b, 2), DUET_OK);
    for (int j = 0; j < 4; j++) {
        step(A, &a, &cont[j], 1, 0, lg_a);
        step(B, &b, &cont[j], 1, 0, lg_b);
        cr_assert(memcmp(lg_a, lg_b, sizeof(float) * (size_t)V) == 0,
                  "step %d after the move differs", j);
    }
    duet_model_seq_close(A, &a);
    duet_model_seq_close(B, &b);
    duet_model_seq_close(B, &other);
    free(lg_a);
    free(lg_b);
    duet_model_free(A);
    duet_model_free(B);
    duet_xfer_ctx_destroy(xa);
    duet_xfer_ctx_destroy(xb);
}

/* A model without spec_rows has no replay pool: its layout says replay_rows 0, register_pools
 * registers none, and reserving replay rows is refused; one with spec_rows registers its replay
 * pool through register_pools (the path of a worker whose pools do not come from UCX). */
Test(worker_move, replay_pool_registration)
{
    duet_xfer_ctx_t *x = ctx_new();
    duet_model_opts_t o;
    duet_model_opts_default(&o);
    o.n_threads = 1;
    o.max_seqs = 2;
    o.max_seq_len = 64;
    o.page_tokens = 16;
    duet_model_t *m = NULL;
    cr_assert_eq(duet_model_load(DEMO, &o, &m), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_worker_register_pools(x, m, false), DUET_OK, "%s", duet_error_last());
    duet_xfer_layout_t l;
    duet_worker_layout(m, &l);
    cr_assert_eq(l.replay_rows, 0u);
    duet_seq_t s;
    cr_assert_eq(duet_model_seq_open(m, 32, &s), DUET_OK);
    outcome_t r = {0};
    l.replay_rows = 2; /* even when the layout claims rows: no pool is registered */
    duet_xfer_recv_args_t args = {.layout = l,
                                  .pages = s.pages,
                                  .n_pages = (uint32_t)s.n_pages,
                                  .kda_slot = s.kda_slot,
                                  .n_tokens = 20,
                                  .n_replay = 2,
                                  .group_size = 1,
                                  .deadline_unix_ms = duet_xfer_now_unix_ms() + 5000,
                                  .cb = on_outcome,
                                  .user = &r};
    duet_xfer_reservation_t res;
    cr_assert_eq(duet_xfer_recv_reserve(x, &args, &res), DUET_ERR_INVALID);
    cr_assert(strstr(duet_error_last(), "no replay pool registered") != NULL, "%s",
              duet_error_last());
    duet_model_seq_close(m, &s);
    duet_model_free(m);
    duet_xfer_ctx_destroy(x);

    x = ctx_new();
    o.spec_rows = SPEC_ROWS;
    cr_assert_eq(duet_model_load(DEMO, &o, &m), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_worker_register_pools(x, m, false), DUET_OK, "%s", duet_error_last());
    duet_worker_layout(m, &l);
    cr_assert_eq(l.replay_rows, SPEC_ROWS);
    cr_assert_eq(duet_model_seq_open(m, 32, &s), DUET_OK);
    args.layout = l;
    args.pages = s.pages;
    args.kda_slot = s.kda_slot;
    cr_assert_eq(duet_xfer_recv_reserve(x, &args, &res), DUET_OK, "%s", duet_error_last());
    duet_replay_pool_t *rp = duet_model_replay_pool(m);
    cr_assert(res.replay_base == (uint64_t)(uintptr_t)duet_replay_pool_base(rp) &&
                  res.replay_bytes == duet_replay_pool_bytes(rp) && res.replay_rkey.len > 0,
              "the reservation advertises the model's replay pool");
    duet_model_seq_close(m, &s);
    duet_model_free(m);
    duet_xfer_ctx_destroy(x); /* aborts the reservation (shutdown) */
    cr_assert(r.ended && r.o.kind == DUET_XFER_OUTCOME_ABORTED);
}
