/*
 * Run a shell command from a test and capture what it prints: one helper for the suites that
 * drive the binaries (duet-generate, duetctl, duet-chat-template, duet-bench, --help/--version).
 */
#ifndef DUET_TESTS_TEST_RUN_H
#define DUET_TESTS_TEST_RUN_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* The path of binary `rel` (as "engine/duet-generate") in this build, or in the build folder
 * DUET_TEST_BIN_DIR names: CI runs suites built with AddressSanitizer against the binaries of the
 * ThreadSanitizer build, since Criterion cannot run under TSan itself (docs/sanitizers.md).
 * Returns one of a few static buffers (reused round robin: keep at most 4 paths at once). */
static inline char *test_bin(const char *rel)
{
    static char bufs[4][4096];
    static unsigned next;
    char *b = bufs[next++ % 4];
    const char *dir = getenv("DUET_TEST_BIN_DIR");
    snprintf(b, sizeof(bufs[0]), "%s/%s", dir != NULL && dir[0] != '\0' ? dir : DUET_BINARY_DIR,
             rel);
    return b;
}

/* Run `cmd` with popen; its stdout (add "2>&1" to the command for stderr) goes into out[cap],
 * NUL-terminated and cut at cap - 1 bytes. Returns the exit status, or -1 if it did not exit. */
static inline int test_run(const char *cmd, char *out, size_t cap)
{
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p, "popen %s", cmd);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#endif
