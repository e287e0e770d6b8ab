/*
 * What every fuzz target shares (docs/fuzzing.md): the invariant check that turns a broken
 * promise into a crash libFuzzer keeps, a reader that splits one input into the pieces a target
 * needs (chunk sizes, modes, several files), and a private scratch folder for the decoders that
 * read files. The same target sources build two ways: linked with libFuzzer (fuzz_<name>, the
 * DUET_FUZZ build) and with fuzz/replay.c (replay_<name>, every build), which runs the corpus and
 * the regressions through LLVMFuzzerTestOneInput as a ctest.
 */
#ifndef DUET_FUZZ_FUZZ_H
#define DUET_FUZZ_FUZZ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* Called once before the first input (fuzz_util.c: keeps a copy of stderr for FUZZ_CHECK). */
int LLVMFuzzerInitialize(int *argc, char ***argv);

/*
 * Where FUZZ_CHECK reports: stderr as it was when the process started (fuzz/run.sh has libFuzzer
 * send the targets' own stderr, where the decoders log every refusal, to /dev/null).
 */
extern int fuzz_report_fd;

/* A broken invariant: say which, then abort (libFuzzer keeps the input as a crash). */
#define FUZZ_CHECK(cond, ...)                                                                      \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            dprintf(fuzz_report_fd, "%s:%d: invariant failed: %s: ", __FILE__, __LINE__, #cond);   \
            dprintf(fuzz_report_fd, __VA_ARGS__);                                                  \
            dprintf(fuzz_report_fd, "\n");                                                         \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* Consumes an input from the front: control bytes first, the rest as payload. */
typedef struct {
    const uint8_t *p;
    size_t n;
} fuzz_in_t;

/* The next byte (0 once the input is used up). */
static inline uint8_t fuzz_byte(fuzz_in_t *in)
{
    if (in->n == 0)
        return 0;
    in->n--;
    return *in->p++;
}

/* The next `len` bytes, fewer at the end; *got_p = how many. */
static inline const uint8_t *fuzz_take(fuzz_in_t *in, size_t len, size_t *got_p)
{
    const uint8_t *p = in->p;
    if (len > in->n)
        len = in->n;
    in->p += len;
    in->n -= len;
    *got_p = len;
    return p;
}

/*
 * The next piece up to the separator `sep` (not included; the separator is consumed), or the
 * rest of the input when there is none: how a target reads several files out of one input.
 */
static inline const uint8_t *fuzz_piece(fuzz_in_t *in, const char *sep, size_t *len_p)
{
    size_t sl = strlen(sep);
    const uint8_t *p = in->p;
    for (size_t i = 0; i + sl <= in->n; i++)
        if (memcmp(p + i, sep, sl) == 0) {
            *len_p = i;
            in->p += i + sl;
            in->n -= i + sl;
            return p;
        }
    *len_p = in->n;
    in->p += in->n;
    in->n = 0;
    return p;
}

/* A copy of data[0..len) with a NUL after it (the decoders that take C strings); aborts on OOM. */
char *fuzz_strndup(const uint8_t *data, size_t len);

/* This process's scratch folder (made at the first call, removed at exit), for file decoders. */
const char *fuzz_tmpdir(void);

/* Write data[0..len) to fuzz_tmpdir()/name; returns the path (static buffer of the call). */
const char *fuzz_write_file(const char *name, const uint8_t *data, size_t len);

/* Remove fuzz_tmpdir()/name if it exists. */
void fuzz_remove_file(const char *name);

/* Quiet logging: the decoders' error lines would cost more than the decode (set once). */
void fuzz_quiet(void);

#endif
