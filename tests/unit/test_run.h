/*
 * Run a shell command from a test and capture what it prints: one helper for the suites that
 * drive the binaries (duet-generate, duetctl, duet-chat-template, duet-bench, --help/--version).
 */
#ifndef DUET_TESTS_TEST_RUN_H
#define DUET_TESTS_TEST_RUN_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <sys/wait.h>

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
