/*
 * Every binary the build makes answers --help with exit status 0 and a usage line on stdout,
 * answers --version with its name, the project's version, the git commit and whether CUDA is built
 * in, and refuses an option it does not know with a non-zero status and a message on stderr
 * naming it.
 * The binaries whose option values are checked by hand refuse bad ones the same way.
 * The list comes from CMake (DUET_HELP_BINARIES: the built targets' files, ':'-separated), so a
 * build without CUDA checks the binaries it has and no others.
 */
#include <criterion/criterion.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "tests/unit/test_run.h"

static char OUT[65536];

/* Run `bin args` with stdout (and, with both, stderr) into OUT; returns the exit status. */
static int run(const char *bin, const char *args, int both)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "'%s' %s %s </dev/null", bin, args, both ? "2>&1" : "2>/dev/null");
    return test_run(cmd, OUT, sizeof(OUT));
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

/* "NAME VERSION (commit C, BUILD_TYPE, CUDA on: ARCHS)" or "... CUDA off)", C = 12 hex digits
 * (with "-dirty" for a tree with uncommitted changes) or "unknown" outside a git checkout. */
Test(binaries, version, .timeout = 60)
{
    char list[] = DUET_HELP_BINARIES;
    int n = 0;
    for (char *save = NULL, *bin = strtok_r(list, ":", &save); bin != NULL;
         bin = strtok_r(NULL, ":", &save), n++) {
        const char *name = strrchr(bin, '/') != NULL ? strrchr(bin, '/') + 1 : bin;
        const int rc = run(bin, "--version", 0);
        cr_expect_eq(rc, 0, "%s --version exited %d", name, rc);
        char want[256];
        snprintf(want, sizeof(want), "%s %s (commit ", name, DUET_EXPECT_VERSION);
        cr_expect(strncmp(OUT, want, strlen(want)) == 0,
                  "%s --version printed \"%s\", want \"%s...\"", name, OUT, want);
        const char *c = OUT + strlen(want);
        size_t hex = 0;
        while (isxdigit((unsigned char)c[hex]))
            hex++;
        cr_expect(hex == 12 || strncmp(c, "unknown,", 8) == 0, "%s: commit not 12 hex digits: %s",
                  name, OUT);
        const char *cuda = DUET_EXPECT_CUDA ? "CUDA on: " : "CUDA off)";
        cr_expect(strstr(OUT, cuda) != NULL, "%s --version does not say \"%s\": %s", name, cuda,
                  OUT);
        cr_expect(strchr(OUT, '\n') != NULL && strchr(OUT, '\n')[1] == '\0',
                  "%s --version printed more than one line: %s", name, OUT);
    }
    printf("[binaries] %d binaries answered --version\n", n);
    cr_assert(n >= 12, "only %d binaries listed: %s", n, DUET_HELP_BINARIES);
}

/* The binary of that name in the list, or NULL when the build has none (the CUDA ones). */
static const char *find_bin(const char *name, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s", DUET_HELP_BINARIES);
    for (char *save = NULL, *bin = strtok_r(buf, ":", &save); bin != NULL;
         bin = strtok_r(NULL, ":", &save)) {
        const char *base = strrchr(bin, '/') != NULL ? strrchr(bin, '/') + 1 : bin;
        if (strcmp(base, name) == 0)
            return bin;
    }
    return NULL;
}

Test(binaries, bad_option_values, .timeout = 60)
{
    static const struct {
        const char *bin, *args, *says;
    } cases[] = {
        {"duet-http-echo", "--port 70000", "bad value '70000' for --port"},
        {"duet-http-echo", "--idle-ms 0", "bad value '0' for --idle-ms"},
        {"duet-http-echo", "--max-connections x", "bad value 'x' for --max-connections"},
        {"duet-http-echo", "--port", "--port needs a value"},
        {"duet-bench-kernels", "--threads 0", "bad value '0' for --threads"},
        {"duet-bench-kernels", "--min-ms abc", "bad value 'abc' for --min-ms"},
        {"duet-bench-xfer", "--transport foo", "bad value 'foo' for --transport"},
        {"duet-bench-xfer", "--transport tcp --netns a", "bad value 'a' for --netns"},
        {"duet-bench-xfer", "--transport tcp --net-devices x,y,z",
         "bad value 'x,y,z' for --net-devices"},
        {"duet-bench-xfer", "--netns a,b --net-devices x,y", "need --transport tcp"},
        {"bench_tokenizer", "a b c", "unexpected argument c"},
        {"duet-bench-gemm-cuda", "--min-ms -1", "bad value '-1' for --min-ms"},
        {"duet-splitkv-plan", "--lens 1 --heads 1 --page 1 --units 0", "bad value '0' for --units"},
        /* the network keys are refused before UCX or the model start (no model is read) */
        {"duet-gen", "--model /nonexistent --ucx.tls 'tcp rc'",
         "ucx.tls: 'tcp rc' is not a UCX list"},
        {"duet-ctx", "--model /nonexistent --ucx.net_devices eth0,,eth1",
         "ucx.net_devices: 'eth0,,eth1' is not a UCX list"},
        {"duet-ctx", "--model /nonexistent --ucx.tls ^", "ucx.tls: '^' is not a UCX list"},
        {"duet-gen", "--model /nonexistent --ucx.net_devices 'eth0;id'",
         "ucx.net_devices: 'eth0;id' is not a UCX list"},
        /* the prefix cache's keys are both workers' (worker/prefix_cache.h) */
        {"duet-gen", "--model /nonexistent --cache.prefix_snapshots 0",
         "cache.prefix_snapshots: 0 is below the minimum 1"},
        {"duet-ctx", "--model /nonexistent --cache.prefix_state_every 0",
         "cache.prefix_state_every: 0 is below the minimum 1"},
    };
    int checked = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char buf[sizeof(DUET_HELP_BINARIES)];
        const char *bin = find_bin(cases[i].bin, buf, sizeof(buf));
        if (bin == NULL) { /* only the CUDA benchmark may be missing (a build without CUDA) */
            cr_expect(strstr(cases[i].bin, "cuda") != NULL, "%s is not built", cases[i].bin);
            continue;
        }
        const int rc = run(bin, cases[i].args, 1);
        cr_expect(rc != 0, "%s %s exited 0:\n%s", cases[i].bin, cases[i].args, OUT);
        cr_expect(strstr(OUT, cases[i].says) != NULL, "%s %s did not say \"%s\":\n%s", cases[i].bin,
                  cases[i].args, cases[i].says, OUT);
        printf("[binaries] %s %s: exit %d, \"%s\"\n", cases[i].bin, cases[i].args, rc,
               cases[i].says);
        checked++;
    }
    cr_assert(checked >= 8, "only %d cases ran", checked);
}
