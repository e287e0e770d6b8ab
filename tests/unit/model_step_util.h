/*
 * model_step_util.h: one item run alone through duet_model_forward, every row's logits kept: the
 * step the engine's speculation tests and the worker's move test take their sequences through.
 * Header-only (Criterion asserts).
 */
#ifndef DUET_TESTS_MODEL_STEP_UTIL_H
#define DUET_TESTS_MODEL_STEP_UTIL_H

#include <criterion/criterion.h>

#include "engine/model.h"

/* One item of `n` tokens (a verify item when `verify`), logits of every row into `logits`. */
static inline void step(duet_model_t *m, duet_seq_t *s, const int32_t *toks, int64_t n, int verify,
                        float *logits)
{
    duet_batch_item_t it = {.seq = s,
                            .tokens = toks,
                            .n_tokens = n,
                            .logits_mode = DUET_LOGITS_ALL,
                            .logits = logits,
                            .verify = verify};
    cr_assert_eq(duet_model_forward(m, &it, 1), DUET_OK, "%s", duet_error_last());
}

#endif
