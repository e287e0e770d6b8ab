/*
 * The cache plan (engine/cache_plan.h): a table of budgets, caps and page sizes whose expected
 * pools are worked out by hand in each row's comment, and duet-gen --print-cache-plan with the demo
 * model and its drafter against the pure function on the same configs.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "engine/cache_plan.h"
#include "test_run.h"

/*
 * Small layouts so the arithmetic fits a comment:
 *  target KV: 4 tokens per page, 2 MLA layers, 8 bytes per token and layer
 *             -> 16 bytes per token, 64 bytes per page; max_seq_len 10 -> minimum ceil(10/4) = 3
 *             pages = 192 bytes
 *  draft KV:  2 tokens per page, 1 layer, 16 bytes per token -> 16 bytes per token, 32 per page;
 *             k = 2 -> 12 tokens per request, ceil(12/2) = 6 pages, max_seqs 2 -> floor 12 pages
 *             = 384 bytes
 *  equal bytes per token, so the proportional share is half the KV budget.
 *  KDA (the "kda" rows): 1 layer, H 1, K 2, W 3: (H*K*K + 3*H*K*(W-1)) * 4 = (4 + 12) * 4 = 64
 *             bytes per slot, 2 slots = 128; replay rows 3: (6*H*K + H) * 4 = 52 bytes per row,
 *             * 3 = 156 per slot, 2 slots = 312; fixed = 440.
 */
static duet_cache_plan_in_t base_in(bool draft, bool kda)
{
    duet_cache_plan_in_t in = {
        .max_seqs = 2,
        .has_draft = draft,
        .target = {.kv = {.page_tokens = 4, .n_layers = 2, .token_bytes = 8},
                   .seq_tokens = 10,
                   .kv_pages = 20},
        .draft = {.kv = {.page_tokens = 2, .n_layers = 1, .token_bytes = 16},
                  .seq_tokens = 12,
                  .kv_pages = 12},
    };
    if (kda) {
        in.target.kda = (duet_kda_layout_t){
            .n_layers = 1, .heads = 1, .head_dim = 2, .conv_kernel = 3, .elem_bytes = 4};
        in.target.replay = (duet_replay_layout_t){
            .n_layers = 1, .heads = 1, .head_dim = 2, .rows = 3, .elem_bytes = 4};
    }
    return in;
}

typedef struct {
    const char *name;
    bool draft, kda;
    uint64_t budget, cap;
    duet_status_t st; /* DUET_OK or the error */
    int64_t t_pages, d_pages;
    uint64_t fixed, share, unused;
    bool cap_bound, floor_bound;
} plan_case_t;

static const plan_case_t cases[] = {
    /* kv 2048, share 1024 >= floor: draft 1024/32 = 32 pages, target 1024/64 = 16 pages */
    {"split", true, false, 2048, 0, DUET_OK, 16, 32, 0, 1024, 0, false, false},
    /* cap 1500 above the share 1024: not bound, as "split" */
    {"cap above", true, false, 2048, 1500, DUET_OK, 16, 32, 0, 1024, 0, false, false},
    /* cap 500 below the share, above the floor: draft 500/32 = 15 pages (480), target
     * (2048 - 480)/64 = 24 pages (1536), unused 1568 - 1536 = 32 */
    {"cap below", true, false, 2048, 500, DUET_OK, 24, 15, 0, 1024, 32, true, false},
    /* cap at the floor 384: draft 12 pages (384), target (2048 - 384)/64 = 26 (1664), unused 0 */
    {"cap at floor", true, false, 2048, 384, DUET_OK, 26, 12, 0, 1024, 0, true, false},
    /* cap 100 under the floor: the floor wins, as "cap at floor" */
    {"cap under floor", true, false, 2048, 100, DUET_OK, 26, 12, 0, 1024, 0, true, true},
    /* no drafter: 2048/64 = 32 target pages */
    {"no drafter", false, false, 2048, 0, DUET_OK, 32, 0, 0, 0, 0, false, false},
    /* no drafter, a cap is ignored */
    {"no drafter, cap", false, false, 2048, 100, DUET_OK, 32, 0, 0, 0, 0, false, false},
    /* odd budget, no drafter: 2047/64 = 31 pages (1984), unused 63 */
    {"odd, no drafter", false, false, 2047, 0, DUET_OK, 31, 0, 0, 0, 63, false, false},
    /* odd budget: share 2047*16/32 = 1023 -> 31 draft pages (992); target (2047 - 992)/64 =
     * 16 (1024); unused 1055 - 1024 = 31 */
    {"odd", true, false, 2047, 0, DUET_OK, 16, 31, 0, 1023, 31, false, false},
    /* exactly target minimum + floor = 192 + 384 = 576: share 288 < floor -> 12 draft pages,
     * target 192/64 = 3 pages */
    {"at minimum", true, false, 576, 0, DUET_OK, 3, 12, 0, 288, 0, false, true},
    /* one byte less than 576: too small */
    {"too small", true, false, 575, 0, DUET_ERR_RANGE, 0, 0, 0, 0, 0, false, false},
    /* no drafter: the target's minimum 192 */
    {"too small, no drafter", false, false, 191, 0, DUET_ERR_RANGE, 0, 0, 0, 0, 0, false, false},
    {"minimum, no drafter", false, false, 192, 0, DUET_OK, 3, 0, 0, 0, 0, false, false},
    /* KDA + replay 440 come first: 2488 - 440 = 2048, then as "split" */
    {"kda first", true, true, 2488, 0, DUET_OK, 16, 32, 440, 1024, 0, false, false},
    /* 440 + 576 = 1016 needed: 1015 is too small */
    {"kda too small", true, true, 1015, 0, DUET_ERR_RANGE, 0, 0, 440, 0, 0, false, false},
    /* implied (budget 0): 20 target pages * 64 + 12 draft pages * 32 = 1280 + 384 = 1664;
     * share 832 -> 26 draft pages (832), target 832/64 = 13 pages */
    {"implied", true, false, 0, 0, DUET_OK, 13, 26, 0, 832, 0, false, false},
    /* implied, no drafter: 20 pages as configured */
    {"implied, no drafter", false, false, 0, 0, DUET_OK, 20, 0, 0, 0, 0, false, false},
};

Test(cache_plan, table)
{
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const plan_case_t *c = &cases[i];
        duet_cache_plan_in_t in = base_in(c->draft, c->kda);
        in.budget_bytes = c->budget;
        in.draft_cap_bytes = c->cap;
        duet_cache_plan_t p;
        memset(&p, 0xab, sizeof(p));
        duet_status_t st = duet_cache_plan_compute(&in, &p);
        cr_assert_eq(st, c->st, "%s: status %d, want %d (%s)", c->name, st, c->st,
                     duet_error_last());
        if (st != DUET_OK)
            continue;
        cr_expect_eq(p.target.pages, c->t_pages, "%s: target pages %lld, want %lld", c->name,
                     (long long)p.target.pages, (long long)c->t_pages);
        cr_expect_eq(p.draft.pages, c->d_pages, "%s: draft pages %lld, want %lld", c->name,
                     (long long)p.draft.pages, (long long)c->d_pages);
        cr_expect_eq(p.fixed_bytes, c->fixed, "%s: fixed", c->name);
        cr_expect_eq(p.draft_share_bytes, c->share, "%s: share", c->name);
        cr_expect_eq(p.unused_bytes, c->unused, "%s: unused %llu", c->name,
                     (unsigned long long)p.unused_bytes);
        cr_expect_eq(p.cap_bound, c->cap_bound, "%s: cap_bound", c->name);
        cr_expect_eq(p.floor_bound, c->floor_bound, "%s: floor_bound", c->name);
        cr_expect_eq(p.budget_implied, c->budget == 0, "%s: implied", c->name);
        /* every row: the pools add up to the budget exactly, and respect the bounds */
        cr_expect_eq(p.fixed_bytes + p.target.bytes + p.draft.bytes + p.unused_bytes,
                     p.budget_bytes, "%s: sum", c->name);
        cr_expect_geq(p.target.pages, p.target.min_pages, "%s: target minimum", c->name);
        cr_expect_geq(p.draft.pages, p.draft.min_pages, "%s: draft floor", c->name);
    }
}

/* The error names the keys and the numbers a reader needs to fix the config. */
Test(cache_plan, too_small_message)
{
    duet_cache_plan_in_t in = base_in(true, true);
    in.budget_bytes = 1015;
    duet_cache_plan_t p;
    cr_assert_eq(duet_cache_plan_compute(&in, &p), DUET_ERR_RANGE);
    const char *e = duet_error_last();
    const char *const want[] = {
        "cache.budget_gib",  "1015 bytes", "batch.max_seqs 2", "440 bytes",
        "cache.max_seq_len", "3 pages",    "12 pages",         "cache.draft_page_tokens 2",
        "1016 bytes in all"};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
        cr_expect_not_null(strstr(e, want[i]), "'%s' not in: %s", want[i], e);
    in.budget_bytes = 0; /* implied: the message says which key to raise */
    in.target.kv_pages = 1;
    in.draft.kv_pages = 1;
    cr_assert_eq(duet_cache_plan_compute(&in, &p), DUET_ERR_RANGE);
    cr_expect_not_null(strstr(duet_error_last(), "cache.kv_pages"), "%s", duet_error_last());
    /* an implied budget below one request's target minimum is the operator's choice (suspend
     * under pressure): only the draft floor is required */
    in = base_in(false, false);
    in.budget_bytes = 0;
    in.target.kv_pages = 1;
    cr_expect_eq(duet_cache_plan_compute(&in, &p), DUET_OK, "%s", duet_error_last());
    cr_expect_eq(p.target.pages, 1);
}

Test(cache_plan, bad_inputs)
{
    duet_cache_plan_in_t in = base_in(true, false);
    duet_cache_plan_t p;
    in.max_seqs = 0;
    cr_expect_eq(duet_cache_plan_compute(&in, &p), DUET_ERR_INVALID);
    in = base_in(true, false);
    in.draft.kv.page_tokens = 0;
    cr_expect_eq(duet_cache_plan_compute(&in, &p), DUET_ERR_INVALID);
    in = base_in(false, false); /* more pages than a pool holds */
    in.budget_bytes = UINT64_MAX / 2;
    cr_expect_eq(duet_cache_plan_compute(&in, &p), DUET_ERR_RANGE);
    in = base_in(false, false); /* a layout whose bytes overflow */
    in.target.kv.token_bytes = UINT64_MAX / 2;
    cr_expect_eq(duet_cache_plan_compute(&in, &p), DUET_ERR_RANGE);
}

Test(cache_plan, gib_bytes)
{
    cr_expect_eq(duet_cache_plan_gib_bytes(0.0), 0u);
    cr_expect_eq(duet_cache_plan_gib_bytes(1.0), 1073741824u);
    cr_expect_eq(duet_cache_plan_gib_bytes(0.5), 536870912u);
    cr_expect_eq(duet_cache_plan_gib_bytes(1e30), UINT64_MAX);
}

/* ---- duet-gen --print-cache-plan ---------------------------------------------------------- */

#define GEN   DUET_BINARY_DIR "/gen_worker/duet-gen"
#define DEMO  DUET_SOURCE_DIR "/models/duet-demo"
#define DRAFT DUET_SOURCE_DIR "/models/duet-demo-draft"

static uint64_t jget(json_t *o, const char *pool, const char *key)
{
    json_t *p = pool != NULL ? json_object_get(o, pool) : o;
    json_t *v = json_object_get(p, key);
    cr_assert(json_is_integer(v), "%s.%s missing", pool != NULL ? pool : "", key);
    return (uint64_t)json_integer_value(v);
}

/* The binary prints the plan the pure function computes from the same configs and keys. */
static void check_cli(const char *extra, double budget_gib, double cap_gib, int64_t max_seqs,
                      int64_t max_seq_len, int k, int64_t draft_page_tokens)
{
    char cmd[1024];
    static char out[1 << 16];
    snprintf(cmd, sizeof(cmd),
             GEN " --model " DEMO " --spec.method draft --spec.draft_model " DRAFT
                 " --batch.max_seqs %lld --cache.max_seq_len %lld --spec.k %d "
                 "--cache.draft_page_tokens %lld --cache.budget_gib %.17g "
                 "--cache.draft_kv_budget_gib %.17g --router 127.0.0.1:1 %s "
                 "--print-cache-plan 2>/dev/null",
             (long long)max_seqs, (long long)max_seq_len, k, (long long)draft_page_tokens,
             budget_gib, cap_gib, extra);
    cr_assert_eq(test_run(cmd, out, sizeof(out)), 0, "%s\n%s", cmd, out);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    cr_assert_not_null(o, "not JSON: %s (%s)", je.text, out);

    duet_model_config_t tc, dc;
    cr_assert_eq(duet_model_config_load(DEMO, &tc), DUET_OK);
    cr_assert_eq(duet_model_config_load(DRAFT, &dc), DUET_OK);
    duet_model_opts_t mo;
    duet_model_opts_default(&mo);
    mo.max_seqs = max_seqs;
    mo.max_seq_len = max_seq_len;
    mo.page_tokens = 128; /* duet-gen's default cache.page_tokens */
    duet_spec_opts_t so;
    duet_spec_opts_default(&so);
    so.method = DUET_SPEC_DRAFT;
    so.k = k;
    so.draft_model = DRAFT;
    so.draft_page_tokens = draft_page_tokens;
    mo.spec_rows = duet_spec_target_rows(&so);
    duet_cache_plan_in_t in;
    duet_cache_plan_inputs(&tc, &mo, &dc, &so, duet_cache_plan_gib_bytes(budget_gib),
                           duet_cache_plan_gib_bytes(cap_gib), &in);
    duet_cache_plan_t p;
    cr_assert_eq(duet_cache_plan_compute(&in, &p), DUET_OK, "%s", duet_error_last());

    cr_expect_eq(jget(o, NULL, "budget_bytes"), p.budget_bytes);
    cr_expect_eq(jget(o, NULL, "fixed_bytes"), p.fixed_bytes);
    cr_expect_eq(jget(o, "target", "pages"), (uint64_t)p.target.pages);
    cr_expect_eq(jget(o, "target", "bytes"), p.target.bytes);
    cr_expect_eq(jget(o, "target", "token_bytes"), p.target.token_bytes);
    cr_expect_eq(jget(o, "target", "kda_bytes"), p.target.kda_bytes);
    cr_expect_eq(jget(o, "target", "replay_bytes"), p.target.replay_bytes);
    cr_expect_eq(jget(o, "draft", "pages"), (uint64_t)p.draft.pages);
    cr_expect_eq(jget(o, "draft", "bytes"), p.draft.bytes);
    cr_expect_eq(jget(o, "draft", "token_bytes"), p.draft.token_bytes);
    cr_expect_eq(jget(o, "draft", "floor_pages"), (uint64_t)p.draft.min_pages);
    cr_expect_eq(json_is_true(json_object_get(o, "cap_bound")), p.cap_bound);
    cr_expect_eq(json_is_true(json_object_get(o, "floor_bound")), p.floor_bound);
    /* the demo target's MLA layers: (kv_lora_rank + rope dims) * 4 bytes each, per token */
    cr_expect_eq(p.target.token_bytes,
                 (uint64_t)(tc.n_mla_layers * (tc.kv_lora_rank + tc.qk_rope_head_dim) * 4));
    cr_expect_leq(jget(o, NULL, "fixed_bytes") + jget(o, "target", "bytes") +
                      jget(o, "draft", "bytes"),
                  jget(o, NULL, "budget_bytes"));
    json_decref(o);
}

Test(cache_plan, print_cache_plan_cli, .timeout = 60)
{
    check_cli("", 0.0, 0.0, 16, 4096, 4, 32);   /* implied by kv_pages */
    check_cli("", 0.25, 0.0, 16, 4096, 4, 32);  /* a budget, no cap */
    check_cli("", 0.25, 0.03, 4, 2048, 3, 48);  /* capped above the floor */
    check_cli("", 0.25, 0.001, 4, 2048, 3, 48); /* the floor wins over the cap */
    check_cli("", 0.0137, 0.0, 2, 1000, 4, 7);  /* odd page sizes */
}

/* A budget too small is refused at once (exit 2), naming the key. */
Test(cache_plan, print_cache_plan_too_small, .timeout = 60)
{
    static char out[1 << 16];
    const int rc = test_run(GEN " --model " DEMO " --spec.method draft --spec.draft_model " DRAFT
                                " --cache.budget_gib 0.001 --print-cache-plan 2>&1",
                            out, sizeof(out));
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect_not_null(strstr(out, "cache.budget_gib) is too small"), "%s", out);
}
