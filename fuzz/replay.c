/*
 * replay_<name>: one fuzz target without libFuzzer. Runs every file of the given folders (or the
 * given files) through the target's LLVMFuzzerTestOneInput once, in name order, so that a normal
 * build (gcc, no sanitizers) compiles every target and its ctest replays the seed corpus and the
 * stored regressions: an input that once crashed a decoder is run on every build from then on.
 *
 * Usage: replay_<name> [--min N] [--if-exists] PATH...
 *   a PATH that is a folder stands for its regular files (not recursive); after --if-exists a
 *   missing PATH is skipped (a target's regressions folder exists once it has a finding).
 * Fails when a path cannot be read, or when fewer than N inputs ran (default 1: a replay that
 * ran nothing has checked nothing). A crash or a broken invariant aborts, which fails the test.
 */
#include <dirent.h>
#include <stdbool.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz/fuzz.h"

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t cap = 4096, len = 0;
    uint8_t *buf = malloc(cap);
    size_t got;
    while (buf != NULL && (got = fread(buf + len, 1, cap - len, f)) > 0) {
        len += got;
        if (len == cap) {
            uint8_t *nb = realloc(buf, cap * 2);
            if (nb == NULL) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    int err = ferror(f);
    fclose(f);
    if (buf == NULL || err) {
        fprintf(stderr, "replay: %s: cannot read\n", path);
        free(buf);
        return -1;
    }
    /* An exact-size copy, so an overread by one byte is one the sanitizers of a fuzz build see. */
    uint8_t *exact = malloc(len > 0 ? len : 1);
    if (exact == NULL) {
        free(buf);
        return -1;
    }
    memcpy(exact, buf, len);
    free(buf);
    fprintf(stderr, "replay: %s (%zu bytes)\n", path, len);
    LLVMFuzzerTestOneInput(exact, len);
    free(exact);
    return 0;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Run every regular file of folder `dir`; returns how many ran, -1 on an error. */
static long run_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL) {
        fprintf(stderr, "replay: %s: %s\n", dir, strerror(errno));
        return -1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.' || strcmp(e->d_name, "README.md") == 0)
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            char **nn = realloc(names, cap * sizeof(*names));
            if (nn == NULL)
                abort();
            names = nn;
        }
        size_t l = strlen(dir) + strlen(e->d_name) + 2;
        names[n] = malloc(l);
        if (names[n] == NULL)
            abort();
        snprintf(names[n], l, "%s/%s", dir, e->d_name);
        n++;
    }
    closedir(d);
    qsort(names, n, sizeof(*names), cmp_names);
    long ran = 0;
    for (size_t i = 0; i < n; i++) {
        struct stat sb;
        if (stat(names[i], &sb) == 0 && S_ISREG(sb.st_mode)) {
            if (run_file(names[i]) != 0)
                ran = -1;
            else if (ran >= 0)
                ran++;
        }
        free(names[i]);
    }
    free(names);
    return ran;
}

int main(int argc, char **argv)
{
    long min = 1;
    int first = 1;
    if (argc > 2 && strcmp(argv[1], "--min") == 0) {
        min = strtol(argv[2], NULL, 10);
        first = 3;
    }
    if (first >= argc) {
        fprintf(stderr, "usage: %s [--min N] PATH...\n", argv[0]);
        return 2;
    }
    LLVMFuzzerInitialize(&argc, &argv);
    long total = 0;
    bool optional = false;
    for (int i = first; i < argc; i++) {
        if (strcmp(argv[i], "--if-exists") == 0) {
            optional = true;
            continue;
        }
        struct stat sb;
        if (optional && stat(argv[i], &sb) != 0 && errno == ENOENT)
            continue;
        if (stat(argv[i], &sb) != 0) {
            fprintf(stderr, "replay: %s: %s\n", argv[i], strerror(errno));
            return 1;
        }
        long ran = S_ISDIR(sb.st_mode) ? run_dir(argv[i]) : (run_file(argv[i]) == 0 ? 1 : -1);
        if (ran < 0)
            return 1;
        total += ran;
    }
    printf("replay: %ld input(s) ran without a crash or a broken invariant\n", total);
    if (total < min) {
        fprintf(stderr, "replay: only %ld input(s), expected at least %ld\n", total, min);
        return 1;
    }
    return 0;
}
