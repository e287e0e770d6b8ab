/*
 * splitkv.c: the host's split-KV planner (contract in splitkv.h). The device computes the same
 * plan from the same inline helpers (kernels/cuda/mla.cu).
 */
#include "kernels/splitkv.h"

#include <stddef.h>

int64_t duet_splitkv_max_work(int64_t n_items, int64_t heads, int64_t units)
{
    return (n_items > 0 ? n_items : 0) + duet_splitkv_want_work(heads, units);
}

duet_status_t duet_splitkv_plan(const duet_splitkv_in_t *in, duet_splitkv_plan_t *plan,
                                int64_t work_cap)
{
    const int64_t n = in->n_items, bt = in->block_tokens;
    if (n < 0 || in->heads < 1 || bt < 1 || in->units < 1 || in->heads > DUET_SPLITKV_MAX_UNITS ||
        in->units > DUET_SPLITKV_MAX_UNITS || (n > 0 && (in->lens == NULL || in->rows == NULL)))
        return duet_error_set(DUET_ERR_INVALID,
                              "split-KV plan: %lld items, %lld heads, %lld-token blocks, %lld "
                              "units: every count but items must be >= 1, heads and units at "
                              "most %lld",
                              (long long)n, (long long)in->heads, (long long)bt,
                              (long long)in->units, (long long)DUET_SPLITKV_MAX_UNITS);
    int64_t total = 0, max_blocks = 0;
    for (int64_t i = 0; i < n; i++) {
        if (in->lens[i] < 0 || in->rows[i] < 0)
            return duet_error_set(DUET_ERR_INVALID,
                                  "split-KV plan: item %lld has length %lld and %lld rows",
                                  (long long)i, (long long)in->lens[i], (long long)in->rows[i]);
        const int64_t b = duet_splitkv_blocks(in->lens[i], bt);
        if (b > INT32_MAX)
            return duet_error_set(DUET_ERR_INVALID,
                                  "split-KV plan: item %lld has %lld blocks (more than int32)",
                                  (long long)i, (long long)b);
        /* The sum is checked before it is formed: past int64 it would be undefined. */
        const int64_t r = in->rows[i] > 0 ? in->rows[i] : 1;
        if (b > 0 && r > (DUET_SPLITKV_MAX_COST - total) / b)
            return duet_error_set(DUET_ERR_INVALID,
                                  "split-KV plan: the step's cost (blocks x rows) passes %lld at "
                                  "item %lld (%lld blocks, %lld rows)",
                                  (long long)DUET_SPLITKV_MAX_COST, (long long)i, (long long)b,
                                  (long long)in->rows[i]);
        total += duet_splitkv_cost(b, in->rows[i]);
        max_blocks = b > max_blocks ? b : max_blocks;
    }
    plan->chunk = duet_splitkv_chunk(total, in->heads, in->units);
    const int32_t uni = duet_splitkv_uniform(n, max_blocks, in->heads, in->units);
    int64_t w = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = duet_splitkv_blocks(in->lens[i], bt);
        int32_t s = 1;
        if (in->mode == DUET_SPLITKV_PER_REQUEST)
            s = duet_splitkv_splits(b, in->rows[i], plan->chunk);
        else if (in->mode == DUET_SPLITKV_UNIFORM && in->rows[i] <= DUET_SPLITKV_MAX_ROWS)
            s = (int32_t)(uni < b ? uni : (b > 1 ? b : 1));
        plan->splits[i] = s;
        plan->work0[i] = (int32_t)w;
        if (b == 0)
            continue;
        if (w + s > work_cap)
            return duet_error_set(DUET_ERR_RANGE,
                                  "split-KV plan: more than %lld work items (size the list with "
                                  "duet_splitkv_max_work)",
                                  (long long)work_cap);
        for (int32_t k = 0; k < s; k++) {
            int64_t b0, b1;
            duet_splitkv_range(b, s, k, &b0, &b1);
            plan->work[w++] = (duet_splitkv_work_t){
                .item = (int32_t)i, .split = k, .block0 = (int32_t)b0, .block1 = (int32_t)b1};
        }
    }
    plan->work0[n] = (int32_t)w;
    plan->n_work = w;
    return DUET_OK;
}
