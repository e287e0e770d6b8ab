/*
 * The libuv pieces the socketless-seam targets (http, registry, admin) share: one loop for the
 * process, made at the first input, and the close callback that marks a flag.
 */
#ifndef DUET_FUZZ_LOOP_H
#define DUET_FUZZ_LOOP_H

#include <stdbool.h>

#include <uv.h>

#include "fuzz/fuzz.h"

/* The process's loop, initialised at the first call (every input reuses it). */
static inline uv_loop_t *fuzz_loop(void)
{
    static uv_loop_t loop;
    static bool ready;
    if (!ready) {
        FUZZ_CHECK(uv_loop_init(&loop) == 0, "loop");
        ready = true;
    }
    return &loop;
}

/* A close callback: sets the bool that user points to. */
static inline void fuzz_on_closed(void *user)
{
    *(bool *)user = true;
}

#endif
