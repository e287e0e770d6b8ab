/*
 * duet status codes: one X-macro gives every code its value, name and message.
 *
 * 0 is success; every error is negative so callers can test `st < 0`. Failures coming from
 * outside libraries (errno, libuv, UCX, CUDA, protobuf-c) are converted to one of these at the
 * module boundary. Alongside the code, the function that first detects an error records a
 * human-readable detail with duet_error_set() (thread-local), which is what the CLIs print and
 * what tests inspect to check that an error names the offending file, tensor or field.
 */
#ifndef DUET_COMMON_STATUS_H
#define DUET_COMMON_STATUS_H

#include <stdarg.h>

#define DUET_STATUS_MAP(X)                                                                         \
    X(DUET_OK, 0, "success")                                                                       \
    X(DUET_ERR_INVALID, -1, "invalid argument")                                                    \
    X(DUET_ERR_NOMEM, -2, "out of memory")                                                         \
    X(DUET_ERR_IO, -3, "input/output error")                                                       \
    X(DUET_ERR_FORMAT, -4, "malformed input")                                                      \
    X(DUET_ERR_UNSUPPORTED, -5, "unsupported")                                                     \
    X(DUET_ERR_NOT_FOUND, -6, "not found")                                                         \
    X(DUET_ERR_RANGE, -7, "value out of range")                                                    \
    X(DUET_ERR_NO_SPACE, -8, "no space left in pool")                                              \
    X(DUET_ERR_TIMEOUT, -9, "timed out")                                                           \
    X(DUET_ERR_CANCELLED, -10, "cancelled")                                                        \
    X(DUET_ERR_TRANSPORT, -11, "transport error")                                                  \
    X(DUET_ERR_DEVICE, -12, "device error")                                                        \
    X(DUET_ERR_BUSY, -13, "busy")                                                                  \
    X(DUET_ERR_INTERNAL, -14, "internal error")

typedef enum {
#define DUET__STATUS_ENUM(name, value, msg) name = value,
    DUET_STATUS_MAP(DUET__STATUS_ENUM)
#undef DUET__STATUS_ENUM
} duet_status_t;

/* "DUET_ERR_FORMAT" for DUET_ERR_FORMAT; "DUET_ERR_UNKNOWN" for a value outside the map. */
const char *duet_status_name(duet_status_t st);

/* "malformed input" for DUET_ERR_FORMAT; "unknown status" for a value outside the map. */
const char *duet_status_str(duet_status_t st);

/*
 * Record the detail of the error being returned (printf format) in a thread-local buffer and
 * return `st`, so a detector can write `return duet_error_set(DUET_ERR_FORMAT, "...", ...);`.
 * Does not log; see DUET_FAIL in log.h for the variant that also logs at error level.
 */
duet_status_t duet_error_setv(duet_status_t st, const char *fmt, va_list ap);
void duet__error_set(duet_status_t st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A macro around duet__error_set so that the compiler sees the status it returns (a constant at
 * most call sites): then `if (st != DUET_OK) return st;` visibly leaves every out-parameter of an
 * error path unread, and -O3's -Wmaybe-uninitialized has nothing to guess about. `st` is
 * evaluated once, before the detail is formatted (which may change errno). */
#define duet_error_set(st, ...)                                                                    \
    __extension__({                                                                                \
        duet_status_t duet__es = (st);                                                             \
        duet__error_set(duet__es, __VA_ARGS__);                                                    \
        duet__es;                                                                                  \
    })

/* The last detail recorded on this thread ("" when none). Valid until the next duet_error_set. */
const char *duet_error_last(void);

/* Forget the detail recorded on this thread. */
void duet_error_clear(void);

/* Return the status of `expr` from the calling function unless it is DUET_OK. */
#define DUET_TRY(expr)                                                                             \
    do {                                                                                           \
        duet_status_t duet_try_st_ = (expr);                                                       \
        if (duet_try_st_ != DUET_OK)                                                               \
            return duet_try_st_;                                                                   \
    } while (0)

#endif
