/*
 * common/log.c's lines as a reader sees them: the text format starts with the UTC time in
 * ISO-8601 with milliseconds (parsed back with strptime and compared with the clock), the JSON
 * format is one object a line that jansson parses (ts, level, msg, src, and req only on tagged
 * lines), with quotes, control characters and ill-formed UTF-8 in the message escaped or
 * replaced; the level filters at once when changed and log.level / log.format configure both.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"

static char LINES[16384];

/* Run fn with stderr going to a file; its lines into LINES. */
static void capture(void (*fn)(void))
{
    char path[] = "/tmp/duet-log-test-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    fn();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    lseek(fd, 0, SEEK_SET);
    ssize_t n = read(fd, LINES, sizeof(LINES) - 1);
    LINES[n > 0 ? n : 0] = '\0';
    close(fd);
    unlink(path);
}

/* Seconds between an ISO-8601 "YYYY-MM-DDTHH:MM:SS.mmmZ" stamp and now; asserts the shape. */
static double age_of(const char *ts)
{
    struct tm tm = {0};
    const char *rest = strptime(ts, "%Y-%m-%dT%H:%M:%S", &tm);
    cr_assert_not_null(rest, "not ISO-8601: %.40s", ts);
    cr_assert(rest[0] == '.' && rest[1] >= '0' && rest[1] <= '9' && rest[2] >= '0' &&
                  rest[2] <= '9' && rest[3] >= '0' && rest[3] <= '9' && rest[4] == 'Z',
              "no .mmmZ after the seconds: %.40s", ts);
    return difftime(time(NULL), timegm(&tm));
}

static void log_text(void)
{
    duet_log_set_format(DUET_LOG_FORMAT_TEXT);
    duet_log_set_level(DUET_LOG_LEVEL_INFO);
    DUET_LOG_INFO("hello %d", 42);
    DUET_RLOG_WARN(7, "tagged");
    DUET_LOG_DEBUG("not shown at info");
}

Test(common_log, text_lines_start_with_iso8601_utc_milliseconds, .timeout = 10)
{
    capture(log_text);
    char *second = strchr(LINES, '\n');
    cr_assert_not_null(second, "%s", LINES);
    *second++ = '\0';
    double age = age_of(LINES);
    cr_expect(age >= -1 && age <= 5, "the stamp is %.0f s from now (UTC?): %s", age, LINES);
    cr_expect(strstr(LINES, "Z INFO  hello 42 (test_common_log.c:") != NULL, "%s", LINES);
    cr_expect(strstr(second, "Z WARN  req=7 tagged (") != NULL, "%s", second);
    cr_expect(strstr(second, "not shown") == NULL, "a DEBUG line at info: %s", second);
}

static void log_json(void)
{
    duet_log_set_format(DUET_LOG_FORMAT_JSON);
    duet_log_set_level(DUET_LOG_LEVEL_DEBUG);
    DUET_LOG_INFO("quote \" backslash \\ tab \t newline \n end");
    DUET_RLOG_DEBUG(12345678901234ULL, "bad utf-8 \xff\xfe then \xc3\xa9");
    duet_log_set_level(DUET_LOG_LEVEL_ERROR);
    DUET_LOG_WARN("filtered");
    DUET_LOG_ERROR("kept");
    duet_log_set_format(DUET_LOG_FORMAT_TEXT);
    duet_log_set_level(DUET_LOG_LEVEL_INFO);
}

Test(common_log, json_lines_parse_with_their_fields, .timeout = 10)
{
    capture(log_json);
    json_t *o[3];
    char *line = LINES;
    for (int i = 0; i < 3; i++) {
        char *nl = strchr(line, '\n');
        cr_assert_not_null(nl, "line %d missing: %s", i, LINES);
        *nl = '\0';
        json_error_t e;
        o[i] = json_loads(line, 0, &e);
        cr_assert_not_null(o[i], "line %d is not JSON (%s): %s", i, e.text, line);
        cr_expect_eq(json_object_size(o[i]), i == 1 ? 5 : 4, "fields of %s", line);
        double age = age_of(json_string_value(json_object_get(o[i], "ts")));
        cr_expect(age >= -1 && age <= 5, "%s", line);
        cr_expect(
            strncmp(json_string_value(json_object_get(o[i], "src")), "test_common_log.c:", 18) == 0,
            "%s", line);
        line = nl + 1;
    }
    cr_expect_eq(line[0], '\0', "the WARN line passed the error level: %s", line);
    cr_expect_str_eq(json_string_value(json_object_get(o[0], "level")), "info");
    cr_expect_str_eq(json_string_value(json_object_get(o[0], "msg")),
                     "quote \" backslash \\ tab \t newline \n end");
    cr_expect_str_eq(json_string_value(json_object_get(o[1], "level")), "debug");
    cr_expect_str_eq(json_string_value(json_object_get(o[1], "msg")),
                     "bad utf-8 \xef\xbf\xbd\xef\xbf\xbd then \xc3\xa9");
    cr_expect_eq(json_integer_value(json_object_get(o[1], "req")), 12345678901234LL);
    cr_expect_str_eq(json_string_value(json_object_get(o[2], "msg")), "kept");
    for (int i = 0; i < 3; i++)
        json_decref(o[i]);
}

static const duet_config_key_t keys[] = {DUET_LOG_CONFIG_KEYS};

Test(common_log, config_keys_set_level_and_format, .timeout = 10)
{
    duet_config_t *cfg;
    cr_assert_eq(duet_config_create(keys, sizeof(keys) / sizeof(keys[0]), &cfg), DUET_OK);
    char *argv[] = {"x", "--log.level", "trace", "--log.format=json", NULL};
    int n_pos = 0;
    cr_assert_eq(duet_config_load_all(cfg, 4, argv, &n_pos), DUET_OK, "%s", duet_error_last());
    duet_log_configure(cfg);
    cr_expect_eq(duet_log_level(), DUET_LOG_LEVEL_TRACE);
    duet_config_destroy(cfg);
    cr_assert_eq(duet_config_create(keys, sizeof(keys) / sizeof(keys[0]), &cfg), DUET_OK);
    char *bad[] = {"x", "--log.level", "loud", NULL};
    cr_expect_neq(duet_config_load_all(cfg, 3, bad, &n_pos), DUET_OK, "an unknown level");
    duet_config_destroy(cfg);
    duet_log_set_format(DUET_LOG_FORMAT_TEXT);
    duet_log_set_level(DUET_LOG_LEVEL_INFO);
}
