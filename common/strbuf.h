/*
 * A growable, always NUL-terminated string for building text (help output, config dumps,
 * Prometheus exposition, JSON bodies).
 *
 * Errors are sticky: once an append fails for lack of memory every later append is a no-op and
 * duet_strbuf_status() reports DUET_ERR_NOMEM, so a writer can append many pieces and check once
 * at the end instead of after each call. The struct is public because callers embed it on the
 * stack; treat the fields as read-only.
 */
#ifndef DUET_COMMON_STRBUF_H
#define DUET_COMMON_STRBUF_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

typedef struct {
    char *data; /* owned, NUL-terminated once anything was appended; NULL before */
    size_t len; /* bytes before the terminating NUL */
    size_t cap; /* bytes allocated at data */
    bool oom;   /* an append failed; the content is truncated */
} duet_strbuf_t;

/* An empty buffer that owns nothing. Equivalent to zero-initialising the struct. */
void duet_strbuf_init(duet_strbuf_t *sb);

/* Free the content and return to the empty state. Accepts NULL. */
void duet_strbuf_free(duet_strbuf_t *sb);

/* Append n bytes of s (which need not be NUL-terminated). DUET_ERR_NOMEM if growth fails. */
duet_status_t duet_strbuf_append(duet_strbuf_t *sb, const char *s, size_t n);

/* Append a NUL-terminated string. */
duet_status_t duet_strbuf_puts(duet_strbuf_t *sb, const char *s);

/* Append printf-formatted text. */
duet_status_t duet_strbuf_printf(duet_strbuf_t *sb, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
duet_status_t duet_strbuf_vprintf(duet_strbuf_t *sb, const char *fmt, va_list ap);

/* DUET_OK, or DUET_ERR_NOMEM if any append since init/free failed. */
duet_status_t duet_strbuf_status(const duet_strbuf_t *sb);

/*
 * Hand the content to the caller (free() it) and reset the buffer. Returns "" as a fresh
 * allocation when nothing was appended, NULL when that allocation fails or the buffer is in the
 * out-of-memory state (the truncated content is freed).
 */
char *duet_strbuf_detach(duet_strbuf_t *sb);

/*
 * Append the whole file at `path` to sb, refusing files over max_bytes: a regular file's size is
 * checked before reading, pipes and growing files stop as soon as the cap is passed. Errors:
 * DUET_ERR_IO (cannot open / read), DUET_ERR_RANGE (too big), DUET_ERR_NOMEM; the detail names
 * the path.
 */
duet_status_t duet_strbuf_read_file(duet_strbuf_t *sb, const char *path, size_t max_bytes);

#endif
