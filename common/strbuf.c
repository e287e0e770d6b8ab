/* Growable string with sticky out-of-memory; see strbuf.h. */
#include "common/strbuf.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

void duet_strbuf_init(duet_strbuf_t *sb)
{
    memset(sb, 0, sizeof(*sb));
}

void duet_strbuf_free(duet_strbuf_t *sb)
{
    if (sb == NULL)
        return;
    free(sb->data);
    duet_strbuf_init(sb);
}

/* Make room for `extra` more bytes plus the NUL. */
static duet_status_t strbuf_reserve(duet_strbuf_t *sb, size_t extra)
{
    if (sb->oom)
        return DUET_ERR_NOMEM;
    if (extra > SIZE_MAX / 2 - sb->len) {
        sb->oom = true;
        return DUET_ERR_NOMEM;
    }
    size_t need = sb->len + extra + 1;
    if (need <= sb->cap)
        return DUET_OK;
    size_t cap = sb->cap != 0 ? sb->cap : 64;
    while (cap < need)
        cap *= 2;
    char *p = realloc(sb->data, cap);
    if (p == NULL) {
        sb->oom = true;
        return DUET_ERR_NOMEM;
    }
    sb->data = p;
    sb->cap = cap;
    return DUET_OK;
}

duet_status_t duet_strbuf_append(duet_strbuf_t *sb, const char *s, size_t n)
{
    duet_status_t st = strbuf_reserve(sb, n);
    if (st != DUET_OK)
        return st;
    if (n != 0)
        memcpy(sb->data + sb->len, s, n);
    sb->len += n;
    sb->data[sb->len] = '\0';
    return DUET_OK;
}

duet_status_t duet_strbuf_puts(duet_strbuf_t *sb, const char *s)
{
    return duet_strbuf_append(sb, s, strlen(s));
}

duet_status_t duet_strbuf_vprintf(duet_strbuf_t *sb, const char *fmt, va_list ap)
{
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    if (n < 0)
        return DUET_ERR_INVALID;
    duet_status_t st = strbuf_reserve(sb, (size_t)n);
    if (st != DUET_OK)
        return st;
    vsnprintf(sb->data + sb->len, (size_t)n + 1, fmt, ap);
    sb->len += (size_t)n;
    return DUET_OK;
}

duet_status_t duet_strbuf_printf(duet_strbuf_t *sb, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    duet_status_t st = duet_strbuf_vprintf(sb, fmt, ap);
    va_end(ap);
    return st;
}

duet_status_t duet_strbuf_status(const duet_strbuf_t *sb)
{
    return sb->oom ? DUET_ERR_NOMEM : DUET_OK;
}

char *duet_strbuf_detach(duet_strbuf_t *sb)
{
    if (sb->oom) {
        duet_strbuf_free(sb);
        return NULL;
    }
    char *s = sb->data;
    if (s == NULL)
        s = calloc(1, 1);
    duet_strbuf_init(sb);
    return s;
}

duet_status_t duet_strbuf_read_file(duet_strbuf_t *sb, const char *path, size_t max_bytes)
{
    duet_status_t st = DUET_OK;
    char chunk[65536];
    struct stat sbuf;
    const size_t start = sb->len;

    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return duet_error_set(DUET_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (fstat(fileno(f), &sbuf) == 0 && S_ISREG(sbuf.st_mode) &&
        (uint64_t)sbuf.st_size > (uint64_t)max_bytes) {
        st = duet_error_set(DUET_ERR_RANGE, "%s: %lld bytes exceeds the limit of %zu", path,
                            (long long)sbuf.st_size, max_bytes);
        goto close_file;
    }
    for (;;) {
        size_t n = fread(chunk, 1, sizeof(chunk), f);
        if (n > 0 && duet_strbuf_append(sb, chunk, n) != DUET_OK) {
            st = duet_error_set(DUET_ERR_NOMEM, "%s: out of memory reading", path);
            goto close_file;
        }
        if (sb->len - start > max_bytes) {
            st = duet_error_set(DUET_ERR_RANGE, "%s: more than %zu bytes", path, max_bytes);
            goto close_file;
        }
        if (n < sizeof(chunk))
            break;
    }
    if (ferror(f))
        st = duet_error_set(DUET_ERR_IO, "%s: read error: %s", path, strerror(errno));
close_file:
    fclose(f);
    return st;
}
