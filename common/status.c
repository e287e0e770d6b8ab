/* duet status codes: names, messages and the thread-local error detail. */
#include "common/status.h"

#include <stdio.h>

static _Thread_local char duet__err_buf[1024];

const char *duet_status_name(duet_status_t st)
{
    switch (st) {
#define DUET__STATUS_NAME(name, value, msg)                                                        \
    case name:                                                                                     \
        return #name;
        DUET_STATUS_MAP(DUET__STATUS_NAME)
#undef DUET__STATUS_NAME
    }
    return "DUET_ERR_UNKNOWN";
}

const char *duet_status_str(duet_status_t st)
{
    switch (st) {
#define DUET__STATUS_STR(name, value, msg)                                                         \
    case name:                                                                                     \
        return msg;
        DUET_STATUS_MAP(DUET__STATUS_STR)
#undef DUET__STATUS_STR
    }
    return "unknown status";
}

duet_status_t duet_error_setv(duet_status_t st, const char *fmt, va_list ap)
{
    vsnprintf(duet__err_buf, sizeof(duet__err_buf), fmt, ap);
    return st;
}

void duet__error_set(duet_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    duet_error_setv(st, fmt, ap);
    va_end(ap);
}

const char *duet_error_last(void)
{
    return duet__err_buf;
}

void duet_error_clear(void)
{
    duet__err_buf[0] = '\0';
}
