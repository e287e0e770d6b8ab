/* Status codes and the thread-local error detail (common/status.h, DUET_FAIL in log.h). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <string.h>

#include "common/log.h"
#include "common/status.h"

Test(common_status, names_and_messages, .timeout = 10)
{
    cr_assert_str_eq(duet_status_name(DUET_OK), "DUET_OK");
    cr_assert_str_eq(duet_status_name(DUET_ERR_FORMAT), "DUET_ERR_FORMAT");
    cr_assert_str_eq(duet_status_str(DUET_ERR_FORMAT), "malformed input");
    cr_assert_str_eq(duet_status_str(DUET_OK), "success");
    cr_assert_str_eq(duet_status_name((duet_status_t)-999), "DUET_ERR_UNKNOWN");
    cr_assert_str_eq(duet_status_str((duet_status_t)-999), "unknown status");
}

Test(common_status, every_error_is_negative_and_named, .timeout = 10)
{
#define CHECK(name, value, msg)                                                                    \
    cr_assert(value <= 0);                                                                         \
    cr_assert_str_eq(duet_status_name(name), #name);                                               \
    cr_assert_str_eq(duet_status_str(name), msg);
    DUET_STATUS_MAP(CHECK)
#undef CHECK
}

Test(common_status, error_detail_set_and_clear, .timeout = 10)
{
    duet_error_clear();
    cr_assert_str_eq(duet_error_last(), "");
    duet_status_t st = duet_error_set(DUET_ERR_RANGE, "field %s: %d too big", "x", 7);
    cr_assert_eq(st, DUET_ERR_RANGE);
    cr_assert_str_eq(duet_error_last(), "field x: 7 too big");
    duet_error_clear();
    cr_assert_str_eq(duet_error_last(), "");
}

Test(common_status, long_detail_is_truncated_not_overflowed, .timeout = 10)
{
    char big[4096];
    memset(big, 'a', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    duet_error_set(DUET_ERR_INVALID, "%s", big);
    size_t n = strlen(duet_error_last());
    cr_assert(n > 100 && n < sizeof(big));
}

Test(common_status, fail_macro_records_and_returns, .timeout = 10)
{
    duet_log_set_level(DUET_LOG_LEVEL_ERROR);
    duet_status_t st = DUET_FAIL(DUET_ERR_IO, "%s: cannot open", "weights.bin");
    cr_assert_eq(st, DUET_ERR_IO);
    cr_assert_str_eq(duet_error_last(), "weights.bin: cannot open");
}

static void *other_thread(void *arg)
{
    (void)arg;
    duet_error_set(DUET_ERR_BUSY, "other thread");
    return NULL;
}

Test(common_status, detail_is_thread_local, .timeout = 10)
{
    pthread_t t;
    duet_error_set(DUET_ERR_INVALID, "main thread");
    pthread_create(&t, NULL, other_thread, NULL);
    pthread_join(t, NULL);
    cr_assert_str_eq(duet_error_last(), "main thread");
}

Test(common_status, log_level_parse, .timeout = 10)
{
    duet_log_level_t lvl;
    cr_assert_eq(duet_log_level_parse("DEBUG", &lvl), DUET_OK);
    cr_assert_eq(lvl, DUET_LOG_LEVEL_DEBUG);
    cr_assert_eq(duet_log_level_parse("loud", &lvl), DUET_ERR_INVALID);
    cr_assert_eq(duet_log_level_parse(NULL, &lvl), DUET_ERR_INVALID);
}
