/* Leveled logging to stderr, text or JSON lines; see log.h. */
#include "common/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/config.h"
#include "common/utf8.h"

/* Both change at run time (the admin API) while other threads log: atomics, relaxed (a line
 * written with the old level or format while it changes is harmless). */
static _Atomic int log_level = -1; /* -1 until initialised from the environment */
static _Atomic int log_format = DUET_LOG_FORMAT_TEXT;

static const char *const duet__log_names[] = {"ERROR", "WARN", "INFO", "DEBUG", "TRACE"};
const char *const duet_log_level_names[] = {"error", "warn", "info", "debug", "trace", NULL};
const char *const duet_log_format_names[] = {"text", "json", NULL};

duet_status_t duet_log_level_parse(const char *s, duet_log_level_t *lvl_p)
{
    if (s == NULL)
        return DUET_ERR_INVALID;
    for (int i = 0; i < 5; i++) {
        if (strcasecmp(s, duet_log_level_names[i]) == 0) {
            *lvl_p = (duet_log_level_t)i;
            return DUET_OK;
        }
    }
    return DUET_ERR_INVALID;
}

const char *duet_log_level_name(duet_log_level_t lvl)
{
    return (unsigned)lvl < 5 ? duet_log_level_names[lvl] : "?";
}

int duet__log_level_get(void)
{
    int lvl = atomic_load_explicit(&log_level, memory_order_relaxed);
    if (lvl < 0) {
        duet_log_level_t l = DUET_LOG_LEVEL_INFO;
        const char *env = getenv("DUET_LOG_LEVEL");
        if (env != NULL && duet_log_level_parse(env, &l) != DUET_OK)
            fprintf(stderr, "duet: ignoring unknown DUET_LOG_LEVEL=%s\n", env);
        int unset = -1; /* a concurrent duet_log_set_level wins */
        atomic_compare_exchange_strong(&log_level, &unset, (int)l);
        lvl = atomic_load_explicit(&log_level, memory_order_relaxed);
    }
    return lvl;
}

void duet_log_set_level(duet_log_level_t lvl)
{
    atomic_store_explicit(&log_level, (int)lvl, memory_order_relaxed);
}

duet_log_level_t duet_log_level(void)
{
    return (duet_log_level_t)duet__log_level_get();
}

void duet_log_set_format(duet_log_format_t fmt)
{
    atomic_store_explicit(&log_format, (int)fmt, memory_order_relaxed);
}

void duet_log_configure(const duet_config_t *cfg)
{
    const int lvl = duet_config_get_enum_index(cfg, "log.level");
    if (lvl >= 0)
        duet_log_set_level((duet_log_level_t)lvl);
    duet_log_set_format(duet_config_get_enum_index(cfg, "log.format") == 1 ? DUET_LOG_FORMAT_JSON
                                                                           : DUET_LOG_FORMAT_TEXT);
}

/* s as the body of a JSON string: quotes, backslashes and control characters escaped, a byte
 * that is not well-formed UTF-8 replaced by U+FFFD (a message may quote outside bytes). */
static void log_json_escape(const char *s, char *out, size_t cap)
{
    size_t at = 0;
    const size_t n = strlen(s);
    for (size_t i = 0; i < n && at + 8 < cap;) {
        const unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            out[at++] = '\\';
            out[at++] = (char)c;
            i++;
        } else if (c < 0x20) {
            at += (size_t)snprintf(out + at, cap - at, "\\u%04x", c);
            i++;
        } else if (c < 0x80) {
            out[at++] = (char)c;
            i++;
        } else {
            const size_t len = duet_utf8_char((const uint8_t *)s + i, n - i, NULL);
            if (len == 0) {
                memcpy(out + at, "\xef\xbf\xbd", 3);
                at += 3;
                i++;
            } else {
                memcpy(out + at, s + i, len);
                at += len;
                i += len;
            }
        }
    }
    out[at] = '\0';
}

void duet__log_write(duet_log_level_t lvl, const char *file, int line, uint64_t req_id,
                     const char *fmt, ...)
{
    char msg[2048], ts[96];
    struct timespec now;
    struct tm tm;
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    clock_gettime(CLOCK_REALTIME, &now);
    gmtime_r(&now.tv_sec, &tm);
    snprintf(ts, sizeof(ts), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900,
             tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, now.tv_nsec / 1000000);
    const char *base = strrchr(file, '/');
    base = base != NULL ? base + 1 : file;
    if (atomic_load_explicit(&log_format, memory_order_relaxed) == DUET_LOG_FORMAT_JSON) {
        char esc[sizeof(msg) * 6 + 16];
        log_json_escape(msg, esc, sizeof(esc));
        char req[40] = "";
        if (req_id != 0)
            snprintf(req, sizeof(req), ",\"req\":%llu", (unsigned long long)req_id);
        fprintf(stderr, "{\"ts\":\"%s\",\"level\":\"%s\",\"msg\":\"%s\",\"src\":\"%s:%d\"%s}\n", ts,
                duet_log_level_names[lvl], esc, base, line, req);
    } else if (req_id != 0) {
        fprintf(stderr, "%s %-5s req=%llu %s (%s:%d)\n", ts, duet__log_names[lvl],
                (unsigned long long)req_id, msg, base, line);
    } else {
        fprintf(stderr, "%s %-5s %s (%s:%d)\n", ts, duet__log_names[lvl], msg, base, line);
    }
}

void duet__assert_fail(const char *cond, const char *file, int line)
{
    fprintf(stderr, "duet: assertion failed: %s (%s:%d)\n", cond, file, line);
    abort();
}

duet_status_t duet__fail(duet_status_t st, const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    duet_error_setv(st, fmt, ap);
    va_end(ap);
    if ((int)DUET_LOG_LEVEL_ERROR <= duet__log_level_get())
        duet__log_write(DUET_LOG_LEVEL_ERROR, file, line, 0, "%s", duet_error_last());
    return st;
}
