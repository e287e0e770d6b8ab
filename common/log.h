/*
 * Leveled logging. One line per event on stderr, in one of two formats (docs/observability.md):
 *   text  2026-01-31T12:34:56.789Z INFO  req=7 message (file.c:123)
 *   json  {"ts":"2026-01-31T12:34:56.789Z","level":"info","msg":"message","src":"file.c:123",
 *          "req":7}
 * The time is UTC, ISO-8601 with milliseconds; "req" only on lines tagged with a request id.
 * The macros test the level before evaluating arguments, so a disabled DEBUG line costs one
 * comparison. The level comes from DUET_LOG_LEVEL (error|warn|info|debug|trace) at first use,
 * or from duet_log_set_level() / the log.level key (duet_log_configure); it may change at any
 * time from any thread (the router's admin API changes it at run time).
 */
#ifndef DUET_COMMON_LOG_H
#define DUET_COMMON_LOG_H

#include <stdint.h>

#include "common/status.h"

typedef enum {
    DUET_LOG_LEVEL_ERROR = 0,
    DUET_LOG_LEVEL_WARN = 1,
    DUET_LOG_LEVEL_INFO = 2,
    DUET_LOG_LEVEL_DEBUG = 3,
    DUET_LOG_LEVEL_TRACE = 4,
} duet_log_level_t;

int duet__log_level_get(void);
void duet__log_write(duet_log_level_t lvl, const char *file, int line, uint64_t req_id,
                     const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Set the level explicitly (overrides DUET_LOG_LEVEL). */
void duet_log_set_level(duet_log_level_t lvl);

/* The level now. */
duet_log_level_t duet_log_level(void);

/* Parse "error", "warn", "info", "debug", "trace"; returns DUET_ERR_INVALID for anything else. */
duet_status_t duet_log_level_parse(const char *s, duet_log_level_t *lvl_p);

/* "error" .. "trace". */
const char *duet_log_level_name(duet_log_level_t lvl);

typedef enum {
    DUET_LOG_FORMAT_TEXT = 0,
    DUET_LOG_FORMAT_JSON = 1,
} duet_log_format_t;

/* Set the line format (default text). */
void duet_log_set_format(duet_log_format_t fmt);

/* The choices of the log.level and log.format keys (NULL-terminated). */
extern const char *const duet_log_level_names[];
extern const char *const duet_log_format_names[];

/* The log keys of every binary with a configuration table (common/config.h); read them with
 * duet_log_configure once the configuration is loaded. log.level's variable is DUET_LOG_LEVEL. */
#define DUET_LOG_CONFIG_KEYS                                                                       \
    {"log.level", DUET_CONFIG_ENUM, "info", "log level: error, warn, info, debug, trace",          \
     .choices = duet_log_level_names},                                                             \
    {                                                                                              \
        "log.format", DUET_CONFIG_ENUM, "text",                                                    \
            "log line format: text, or json (one object a line: ts, level, msg, src, req)",        \
            .choices = duet_log_format_names                                                       \
    }

struct duet_config;
/* Apply log.level and log.format of a loaded configuration that declares DUET_LOG_CONFIG_KEYS. */
void duet_log_configure(const struct duet_config *cfg);

#define DUET__LOG(lvl, rid, ...)                                                                   \
    do {                                                                                           \
        if ((int)(lvl) <= duet__log_level_get())                                                   \
            duet__log_write((lvl), __FILE__, __LINE__, (rid), __VA_ARGS__);                        \
    } while (0)

#define DUET_LOG_ERROR(...) DUET__LOG(DUET_LOG_LEVEL_ERROR, 0, __VA_ARGS__)
#define DUET_LOG_WARN(...)  DUET__LOG(DUET_LOG_LEVEL_WARN, 0, __VA_ARGS__)
#define DUET_LOG_INFO(...)  DUET__LOG(DUET_LOG_LEVEL_INFO, 0, __VA_ARGS__)
#define DUET_LOG_DEBUG(...) DUET__LOG(DUET_LOG_LEVEL_DEBUG, 0, __VA_ARGS__)
#define DUET_LOG_TRACE(...) DUET__LOG(DUET_LOG_LEVEL_TRACE, 0, __VA_ARGS__)

/* Same, tagged with a request id (printed as req=<id>). */
#define DUET_RLOG_ERROR(rid, ...) DUET__LOG(DUET_LOG_LEVEL_ERROR, (rid), __VA_ARGS__)
#define DUET_RLOG_WARN(rid, ...)  DUET__LOG(DUET_LOG_LEVEL_WARN, (rid), __VA_ARGS__)
#define DUET_RLOG_INFO(rid, ...)  DUET__LOG(DUET_LOG_LEVEL_INFO, (rid), __VA_ARGS__)
#define DUET_RLOG_DEBUG(rid, ...) DUET__LOG(DUET_LOG_LEVEL_DEBUG, (rid), __VA_ARGS__)

/*
 * Record an error detail, log it at error level, and evaluate to the status:
 *   return DUET_FAIL(DUET_ERR_FORMAT, "%s: tensor %s: bad shape", path, name);
 * Use it in the function that first detects the error; callers only propagate.
 */
#define DUET_FAIL(st, ...) duet__fail((st), __FILE__, __LINE__, __VA_ARGS__)

duet_status_t duet__fail(duet_status_t st, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Broken internal invariant: print file:line and abort. Never for bad outside input. */
#define DUET_ASSERT(cond)                                                                          \
    do {                                                                                           \
        if (!(cond))                                                                               \
            duet__assert_fail(#cond, __FILE__, __LINE__);                                          \
    } while (0)

void duet__assert_fail(const char *cond, const char *file, int line) __attribute__((noreturn));

#endif
