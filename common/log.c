/* Leveled logging to stderr; see log.h. */
#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

int duet__log_level = -1;

static const char *const duet__log_names[] = {"ERROR", "WARN", "INFO", "DEBUG", "TRACE"};

duet_status_t duet_log_level_parse(const char *s, duet_log_level_t *lvl_p)
{
    static const char *const names[] = {"error", "warn", "info", "debug", "trace"};
    if (s == NULL)
        return DUET_ERR_INVALID;
    for (int i = 0; i < 5; i++) {
        if (strcasecmp(s, names[i]) == 0) {
            *lvl_p = (duet_log_level_t)i;
            return DUET_OK;
        }
    }
    return DUET_ERR_INVALID;
}

int duet__log_level_get(void)
{
    if (duet__log_level < 0) {
        duet_log_level_t lvl = DUET_LOG_LEVEL_INFO;
        const char *env = getenv("DUET_LOG_LEVEL");
        if (env != NULL && duet_log_level_parse(env, &lvl) != DUET_OK)
            fprintf(stderr, "duet: ignoring unknown DUET_LOG_LEVEL=%s\n", env);
        duet__log_level = (int)lvl;
    }
    return duet__log_level;
}

void duet_log_set_level(duet_log_level_t lvl)
{
    duet__log_level = (int)lvl;
}

void duet__log_write(duet_log_level_t lvl, const char *file, int line, uint64_t req_id,
                     const char *fmt, ...)
{
    char msg[2048];
    struct timespec ts;
    struct tm tm;
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    const char *base = strrchr(file, '/');
    base = base != NULL ? base + 1 : file;
    if (req_id != 0)
        fprintf(stderr, "%02d:%02d:%02d.%03ld %-5s req=%llu %s (%s:%d)\n", tm.tm_hour, tm.tm_min,
                tm.tm_sec, ts.tv_nsec / 1000000, duet__log_names[lvl], (unsigned long long)req_id,
                msg, base, line);
    else
        fprintf(stderr, "%02d:%02d:%02d.%03ld %-5s %s (%s:%d)\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
                ts.tv_nsec / 1000000, duet__log_names[lvl], msg, base, line);
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
