/* The cache plan: one budget split between the cache pools; see engine/cache_plan.h. */
#include "engine/cache_plan.h"

#include <inttypes.h>
#include <math.h>
#include <string.h>

/* A pool's per-token, per-page and fixed bytes from its layouts (the pools' own arithmetic,
 * common/cache_layout.h). false on overflow. */
static bool plan_pool_sizes(const duet_cache_plan_pool_in_t *p, int64_t max_seqs,
                            duet_cache_plan_pool_t *o)
{
    memset(o, 0, sizeof(*o));
    o->page_tokens = p->kv.page_tokens;
    if (p->kv.n_layers > 0 &&
        (!duet__layout_mul(p->kv.token_bytes, p->kv.n_layers, &o->token_bytes) ||
         !duet_kv_layout_page_bytes(&p->kv, &o->page_bytes)))
        return false;
    uint64_t slot;
    if (p->kda.n_layers > 0 && (!duet_kda_layout_slot_bytes(&p->kda, &slot) ||
                                !duet__layout_mul(slot, (uint64_t)max_seqs, &o->kda_bytes)))
        return false;
    if (p->replay.n_layers > 0 && p->replay.rows > 0 &&
        (!duet_replay_layout_slot_bytes(&p->replay, &slot) ||
         !duet__layout_mul(slot, (uint64_t)max_seqs, &o->replay_bytes)))
        return false;
    return true;
}

static duet_status_t plan_overflow(void)
{
    return duet_error_set(DUET_ERR_RANGE, "cache plan: the pools' sizes overflow 64 bits");
}

duet_status_t duet_cache_plan_compute(const duet_cache_plan_in_t *in, duet_cache_plan_t *plan)
{
    if (in->max_seqs < 1 || in->target.seq_tokens < 1 || in->target.kv.page_tokens < 1 ||
        (in->has_draft && (in->draft.seq_tokens < 1 || in->draft.kv.page_tokens < 1)))
        return duet_error_set(DUET_ERR_INVALID,
                              "cache plan: batch.max_seqs, the sequence lengths and the page "
                              "sizes must be >= 1");
    duet_cache_plan_t p;
    memset(&p, 0, sizeof(p));
    p.has_draft = in->has_draft;
    p.draft_cap_bytes = in->draft_cap_bytes;
    duet_cache_plan_pool_t *t = &p.target, *d = &p.draft;
    if (!plan_pool_sizes(&in->target, in->max_seqs, t) ||
        (in->has_draft && !plan_pool_sizes(&in->draft, in->max_seqs, d)))
        return plan_overflow();
    if (!duet__layout_add(t->kda_bytes, t->replay_bytes, &p.fixed_bytes) ||
        !duet__layout_add(p.fixed_bytes, d->kda_bytes, &p.fixed_bytes) ||
        !duet__layout_add(p.fixed_bytes, d->replay_bytes, &p.fixed_bytes))
        return plan_overflow();

    /* the target's minimum: one request; the draft's floor: every request, at their lengths */
    if (t->page_bytes > 0)
        t->min_pages =
            (in->target.seq_tokens + (int64_t)t->page_tokens - 1) / (int64_t)t->page_tokens;
    if (d->page_bytes > 0)
        d->min_pages = in->max_seqs * ((in->draft.seq_tokens + (int64_t)d->page_tokens - 1) /
                                       (int64_t)d->page_tokens);
    if (!duet__layout_mul((uint64_t)t->min_pages, t->page_bytes, &t->min_bytes) ||
        !duet__layout_mul((uint64_t)d->min_pages, d->page_bytes, &d->min_bytes))
        return plan_overflow();

    p.budget_bytes = in->budget_bytes;
    if (p.budget_bytes == 0) { /* what the pools take without a budget */
        uint64_t tb = 0, db = 0;
        p.budget_implied = true;
        if (!duet__layout_mul((uint64_t)in->target.kv_pages, t->page_bytes, &tb) ||
            (in->has_draft &&
             !duet__layout_mul((uint64_t)in->draft.kv_pages, d->page_bytes, &db)) ||
            !duet__layout_add(p.fixed_bytes, tb, &p.budget_bytes) ||
            !duet__layout_add(p.budget_bytes, db, &p.budget_bytes))
            return plan_overflow();
    }
    /* An implied budget holds whatever target pages cache.kv_pages names, however few: a small
     * pool is how a worker is made to suspend requests under pressure, and a request that could
     * never fit it alone is refused at Reserve. A budget given in GiB must hold one request. */
    const uint64_t t_min = p.budget_implied ? 0 : t->min_bytes;
    uint64_t need;
    if (!duet__layout_add(p.fixed_bytes, t_min, &need) ||
        !duet__layout_add(need, d->min_bytes, &need))
        return plan_overflow();
    if (p.budget_bytes < need)
        return duet_error_set(
            DUET_ERR_RANGE,
            "cache budget of %" PRIu64 " bytes (%s) is too small: the KDA state and replay slots "
            "of batch.max_seqs %lld requests take %" PRIu64 " bytes, the target's minimum (one "
            "request at cache.max_seq_len %lld tokens: %lld pages of cache.page_tokens %" PRIu64
            ") %" PRIu64 " bytes, the draft floor (batch.max_seqs %lld requests at "
            "cache.max_seq_len + spec.k = %lld tokens: %lld pages of cache.draft_page_tokens "
            "%" PRIu64 ") %" PRIu64 " bytes; %" PRIu64 " bytes in all",
            p.budget_bytes,
            p.budget_implied ? "what cache.kv_pages implies; set cache.budget_gib or a larger "
                               "cache.kv_pages"
                             : "cache.budget_gib",
            (long long)in->max_seqs, p.fixed_bytes, (long long)in->target.seq_tokens,
            (long long)t->min_pages, t->page_tokens, t->min_bytes, (long long)in->max_seqs,
            (long long)(in->has_draft ? in->draft.seq_tokens : 0), (long long)d->min_pages,
            d->page_tokens, d->min_bytes, need);
    p.kv_budget_bytes = p.budget_bytes - p.fixed_bytes;

    /* the draft's share: proportional to bytes per token, capped, floored, the target's minimum
     * kept (budget >= fixed + target min + floor, so the last clamp never undercuts the floor) */
    uint64_t want = 0;
    if (in->has_draft && d->page_bytes > 0) {
        const unsigned __int128 sum = (unsigned __int128)t->token_bytes + d->token_bytes;
        p.draft_share_bytes =
            (uint64_t)((unsigned __int128)p.kv_budget_bytes * d->token_bytes / sum);
        want = p.draft_share_bytes;
        if (in->draft_cap_bytes > 0 && want > in->draft_cap_bytes) {
            want = in->draft_cap_bytes;
            p.cap_bound = true;
        }
        if (want < d->min_bytes) {
            want = d->min_bytes;
            p.floor_bound = true;
        }
        if (want > p.kv_budget_bytes - t_min) {
            want = p.kv_budget_bytes - t_min;
            p.target_min_bound = true;
        }
        d->pages = (int64_t)(want / d->page_bytes);
        d->bytes = (uint64_t)d->pages * d->page_bytes;
    }
    const uint64_t left = p.kv_budget_bytes - d->bytes;
    if (t->page_bytes > 0) {
        const uint64_t pages = left / t->page_bytes;
        if (pages > INT32_MAX)
            return duet_error_set(DUET_ERR_RANGE,
                                  "cache plan: %" PRIu64 " target KV pages of %" PRIu64
                                  " bytes: more than a pool holds (%d); lower the cache budget "
                                  "or raise cache.page_tokens",
                                  pages, t->page_bytes, INT32_MAX);
        t->pages = (int64_t)pages;
        t->bytes = pages * t->page_bytes;
    }
    if (d->pages > INT32_MAX)
        return duet_error_set(DUET_ERR_RANGE,
                              "cache plan: %lld draft KV pages: more than a pool holds (%d); set "
                              "cache.draft_kv_budget_gib or raise cache.draft_page_tokens",
                              (long long)d->pages, INT32_MAX);
    p.unused_bytes = left - t->bytes;
    *plan = p;
    return DUET_OK;
}

/* The pool in of a model of config c loaded with o. */
static void plan_pool_in(const duet_model_config_t *c, const duet_model_opts_t *o,
                         int64_t seq_tokens, duet_cache_plan_pool_in_t *p)
{
    duet_kv_pool_desc_t kd;
    duet_kda_pool_desc_t sd;
    duet_replay_pool_desc_t rd;
    duet_model_pool_descs(c, o, &kd, &sd, &rd);
    p->kv = duet_kv_pool_desc_layout(&kd);
    p->kda = duet_kda_pool_desc_layout(&sd);
    p->replay = duet_replay_pool_desc_layout(&rd);
    p->seq_tokens = seq_tokens;
    p->kv_pages = kd.n_pages;
}

void duet_cache_plan_inputs(const duet_model_config_t *tc, const duet_model_opts_t *to,
                            const duet_model_config_t *dc, const duet_spec_opts_t *so,
                            uint64_t budget_bytes, uint64_t draft_cap_bytes,
                            duet_cache_plan_in_t *in)
{
    memset(in, 0, sizeof(*in));
    in->budget_bytes = budget_bytes;
    in->draft_cap_bytes = draft_cap_bytes;
    in->max_seqs = to->max_seqs;
    plan_pool_in(tc, to, to->max_seq_len, &in->target);
    in->has_draft = so->method == DUET_SPEC_DRAFT && dc != NULL;
    if (in->has_draft) {
        duet_spec_opts_t dso = *so;
        dso.draft_kv_pages = 0; /* the default pool: what the implied budget counts */
        duet_model_opts_t dopts;
        duet_spec_draft_opts(&dso, to, &dopts);
        plan_pool_in(dc, &dopts, to->max_seq_len + so->k, &in->draft);
    }
}

static duet_status_t plan_pool_json(duet_strbuf_t *sb, const char *name,
                                    const duet_cache_plan_pool_t *p, const char *min_name)
{
    return duet_strbuf_printf(
        sb,
        "\"%s\":{\"token_bytes\":%" PRIu64 ",\"page_tokens\":%" PRIu64 ",\"page_bytes\":%" PRIu64
        ",\"pages\":%lld,\"bytes\":%" PRIu64 ",\"%s_pages\":%lld,\"%s_bytes\":%" PRIu64
        ",\"kda_bytes\":%" PRIu64 ",\"replay_bytes\":%" PRIu64 "}",
        name, p->token_bytes, p->page_tokens, p->page_bytes, (long long)p->pages, p->bytes,
        min_name, (long long)p->min_pages, min_name, p->min_bytes, p->kda_bytes, p->replay_bytes);
}

duet_status_t duet_cache_plan_json(const duet_cache_plan_t *p, duet_strbuf_t *sb)
{
    duet_strbuf_printf(sb,
                       "{\"budget_bytes\":%" PRIu64
                       ",\"budget_source\":\"%s\",\"fixed_bytes\":%" PRIu64
                       ",\"kv_budget_bytes\":%" PRIu64 ",",
                       p->budget_bytes, p->budget_implied ? "cache.kv_pages" : "cache.budget_gib",
                       p->fixed_bytes, p->kv_budget_bytes);
    plan_pool_json(sb, "target", &p->target, "min");
    if (p->has_draft) {
        duet_strbuf_puts(sb, ",");
        plan_pool_json(sb, "draft", &p->draft, "floor");
    } else {
        duet_strbuf_puts(sb, ",\"draft\":null");
    }
    duet_strbuf_printf(sb,
                       ",\"draft_share_bytes\":%" PRIu64 ",\"draft_cap_bytes\":%" PRIu64
                       ",\"cap_bound\":%s,\"floor_bound\":%s,\"target_min_bound\":%s,"
                       "\"unused_bytes\":%" PRIu64 "}",
                       p->draft_share_bytes, p->draft_cap_bytes, p->cap_bound ? "true" : "false",
                       p->floor_bound ? "true" : "false", p->target_min_bound ? "true" : "false",
                       p->unused_bytes);
    return duet_strbuf_status(sb);
}

uint64_t duet_cache_plan_gib_bytes(double gib)
{
    const double b = floor(gib * 1073741824.0);
    if (!(b >= 0.0))
        return 0;
    return b >= 18446744073709551615.0 ? UINT64_MAX : (uint64_t)b;
}
