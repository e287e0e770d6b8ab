/* The helpers of fuzz/fuzz.h that need more than a line: the report fd, scratch files, quiet
 * logging. */
#include "fuzz/fuzz.h"

#include <dirent.h>
#include <limits.h>
#include <unistd.h>

#include "common/log.h"

static char tmpdir[PATH_MAX];

int fuzz_report_fd = STDERR_FILENO;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    /* libFuzzer calls this before it applies -close_fd_mask, so this is the real stderr. */
    int fd = dup(STDERR_FILENO);
    if (fd >= 0)
        fuzz_report_fd = fd;
    return 0;
}

char *fuzz_strndup(const uint8_t *data, size_t len)
{
    char *s = malloc(len + 1);
    if (s == NULL)
        abort();
    if (len > 0)
        memcpy(s, data, len);
    s[len] = '\0';
    return s;
}

static void tmpdir_remove(void)
{
    DIR *d = opendir(tmpdir);
    if (d != NULL) {
        struct dirent *e;
        char path[PATH_MAX + 256];
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                continue;
            snprintf(path, sizeof(path), "%s/%s", tmpdir, e->d_name);
            unlink(path);
        }
        closedir(d);
    }
    rmdir(tmpdir);
}

const char *fuzz_tmpdir(void)
{
    if (tmpdir[0] != '\0')
        return tmpdir;
    /* /dev/shm when there is one: file decoders run once per input, so keep them off disk. */
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR");
    if (base == NULL || base[0] == '\0')
        base = "/tmp";
    snprintf(tmpdir, sizeof(tmpdir), "%s/duet-fuzz-XXXXXX", base);
    if (mkdtemp(tmpdir) == NULL) {
        perror("fuzz: mkdtemp");
        abort();
    }
    atexit(tmpdir_remove);
    return tmpdir;
}

const char *fuzz_write_file(const char *name, const uint8_t *data, size_t len)
{
    static char path[PATH_MAX + 256];
    snprintf(path, sizeof(path), "%s/%s", fuzz_tmpdir(), name);
    FILE *f = fopen(path, "wb");
    if (f == NULL) {
        perror("fuzz: creating a scratch file");
        abort();
    }
    bool ok = len == 0 || fwrite(data, 1, len, f) == len;
    if (fclose(f) != 0 || !ok) {
        perror("fuzz: writing a scratch file");
        abort();
    }
    return path;
}

void fuzz_remove_file(const char *name)
{
    char path[PATH_MAX + 256];
    snprintf(path, sizeof(path), "%s/%s", fuzz_tmpdir(), name);
    unlink(path);
}

void fuzz_quiet(void)
{
    duet_log_set_level(DUET_LOG_LEVEL_ERROR);
}
