/*
 * Every binary the build makes answers --help with exit status 0 and a usage line on stdout, and
 * refuses an option it does not know with a non-zero status and a message on stderr naming it.
 * The list comes from CMake (DUET_HELP_BINARIES: the built targets' files, ':'-separated), so a
 * build without CUDA checks the binaries it has and no others.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

static char OUT[65536];

/* Run `bin args` with stdout (and, with both, stderr) into OUT; returns the exit status. */
static int run(const char *bin, const char *args, int both)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "'%s' %s %s </dev/null", bin, args, both ? "2>&1" : "2>/dev/null");
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p, "popen %s", cmd);
    size_t n = fread(OUT, 1, sizeof(OUT) - 1, p);
    OUT[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(binaries, help_and_unknown_option, .timeout = 120)
{
    char list[] = DUET_HELP_BINARIES;
    int n = 0;
    for (char *save = NULL, *bin = strtok_r(list, ":", &save); bin != NULL;
         bin = strtok_r(NULL, ":", &save), n++) {
        const char *name = strrchr(bin, '/') != NULL ? strrchr(bin, '/') + 1 : bin;
        const int rc_help = run(bin, "--help", 0);
        cr_expect_eq(rc_help, 0, "%s --help exited %d", name, rc_help);
        cr_expect(strstr(OUT, "usage") != NULL || strstr(OUT, "Usage") != NULL,
                  "%s --help printed no usage line on stdout:\n%s", name, OUT);
        const int rc_bad = run(bin, "--no-such-option-xyz", 1);
        cr_expect(rc_bad != 0, "%s accepted an unknown option (exit 0):\n%s", name, OUT);
        cr_expect(strstr(OUT, "--no-such-option-xyz") != NULL,
                  "%s did not name the unknown option:\n%s", name, OUT);
        printf("[binaries] %-26s --help exit %d; an unknown option exit %d\n", name, rc_help,
               rc_bad);
    }
    cr_assert(n >= 12, "only %d binaries listed: %s", n, DUET_HELP_BINARIES);
}
