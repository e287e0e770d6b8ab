/*
 * Fuzz target: a binary's --config YAML file (common/config.c over common/yaml.c,
 * duet_config_load_yaml_string), against a key table with one key of every type, nested names,
 * bounds, an alias, a secret and a required key, as the binaries declare theirs.
 *
 * Input: the file's bytes. Checked besides no crash / sanitizer report (libyaml's aliases make
 * cycles and exponential fan-out: a hang here is a finding):
 *  - every value after a load (also after a failed one, which may keep some values) is inside
 *    its key's bounds or choices, a string is a C string;
 *  - a value set from the file reads back unchanged when its text is set again on a fresh
 *    configuration (what the file gave, the setter accepts and keeps as is);
 *  - dump and help work on the result.
 */
#include "fuzz/fuzz.h"

#include <inttypes.h>

#include "common/config.h"
#include "common/status.h"

static const char *const levels[] = {"error", "warn", "info", "debug", NULL};

static const duet_config_key_t keys[] = {
    {.name = "model.dir", .type = DUET_CONFIG_STRING, .help = "model folder", .required = true},
    {.name = "http.host", .type = DUET_CONFIG_STRING, .def = "127.0.0.1", .help = "bind"},
    {.name = "http.port",
     .type = DUET_CONFIG_INT,
     .def = "8000",
     .help = "port",
     .min = "0",
     .max = "65535",
     .alias = "port"},
    {.name = "cache.budget",
     .type = DUET_CONFIG_SIZE,
     .def = "1GiB",
     .help = "bytes",
     .min = "1MiB",
     .max = "1TiB"},
    {.name = "cache.page_tokens",
     .type = DUET_CONFIG_INT,
     .def = "64",
     .help = "tokens",
     .min = "1",
     .max = "4096",
     .alias = "page-tokens"},
    {.name = "sampling.temperature",
     .type = DUET_CONFIG_FLOAT,
     .def = "1.0",
     .help = "t",
     .min = "0",
     .max = "2"},
    {.name = "sampling.seed", .type = DUET_CONFIG_INT, .help = "unbounded, no default"},
    {.name = "log.level",
     .type = DUET_CONFIG_ENUM,
     .def = "info",
     .help = "level",
     .choices = levels},
    {.name = "spec.enabled", .type = DUET_CONFIG_BOOL, .def = "false", .help = "flag"},
    {.name = "admin.token", .type = DUET_CONFIG_STRING, .def = "", .help = "t", .secret = true},
    {.name = "a.b.c.d.e", .type = DUET_CONFIG_FLOAT, .help = "deep, unbounded"},
};
#define N_KEYS (sizeof(keys) / sizeof(keys[0]))

/* Check every value of cfg; when `again` is set, set each YAML-given value's text on it. */
static void check_values(const duet_config_t *cfg, duet_config_t *again)
{
    char text[128];
    for (size_t i = 0; i < N_KEYS; i++) {
        const duet_config_key_t *k = &keys[i];
        duet_config_source_t src = duet_config_source(cfg, k->name);
        FUZZ_CHECK(src <= DUET_CONFIG_SRC_YAML, "%s: source %d", k->name, (int)src);
        FUZZ_CHECK(duet_config_origin(cfg, k->name) != NULL, "%s: origin", k->name);
        const char *set = NULL;
        switch (k->type) {
        case DUET_CONFIG_INT: {
            int64_t v = duet_config_get_int(cfg, k->name);
            if (k->min != NULL)
                FUZZ_CHECK(v >= strtoll(k->min, NULL, 10), "%s = %" PRId64, k->name, v);
            if (k->max != NULL)
                FUZZ_CHECK(v <= strtoll(k->max, NULL, 10), "%s = %" PRId64, k->name, v);
            snprintf(text, sizeof(text), "%" PRId64, v);
            set = text;
            break;
        }
        case DUET_CONFIG_FLOAT: {
            double v = duet_config_get_float(cfg, k->name);
            FUZZ_CHECK(v == v && v - v == 0, "%s = %g is not finite", k->name, v);
            if (k->min != NULL)
                FUZZ_CHECK(v >= strtod(k->min, NULL), "%s = %g", k->name, v);
            if (k->max != NULL)
                FUZZ_CHECK(v <= strtod(k->max, NULL), "%s = %g", k->name, v);
            snprintf(text, sizeof(text), "%.17g", v);
            set = text;
            break;
        }
        case DUET_CONFIG_SIZE: {
            uint64_t v = duet_config_get_size(cfg, k->name), lo = 0, hi = 0;
            FUZZ_CHECK(duet_config_parse_size(k->min, &lo) == DUET_OK &&
                           duet_config_parse_size(k->max, &hi) == DUET_OK,
                       "bounds");
            FUZZ_CHECK(v >= lo && v <= hi, "%s = %" PRIu64, k->name, v);
            snprintf(text, sizeof(text), "%" PRIu64, v);
            set = text;
            break;
        }
        case DUET_CONFIG_BOOL:
            set = duet_config_get_bool(cfg, k->name) ? "true" : "false";
            break;
        case DUET_CONFIG_STRING:
            set = duet_config_get_string(cfg, k->name);
            if (set != NULL)
                (void)strlen(set);
            break;
        case DUET_CONFIG_ENUM: {
            int idx = duet_config_get_enum_index(cfg, k->name);
            FUZZ_CHECK(idx >= 0 && idx < 4, "%s index %d", k->name, idx);
            set = duet_config_get_enum(cfg, k->name);
            FUZZ_CHECK(set == k->choices[idx], "%s choice", k->name);
            break;
        }
        }
        if (again == NULL || src != DUET_CONFIG_SRC_YAML || set == NULL)
            continue;
        duet_status_t st = duet_config_set(again, k->name, set);
        FUZZ_CHECK(st == DUET_OK, "%s: the file's value \"%s\" is refused when set again: %s",
                   k->name, set, duet_error_last());
        switch (k->type) {
        case DUET_CONFIG_INT:
            FUZZ_CHECK(duet_config_get_int(again, k->name) == duet_config_get_int(cfg, k->name),
                       "%s changed", k->name);
            break;
        case DUET_CONFIG_FLOAT:
            FUZZ_CHECK(duet_config_get_float(again, k->name) == duet_config_get_float(cfg, k->name),
                       "%s changed", k->name);
            break;
        case DUET_CONFIG_SIZE:
            FUZZ_CHECK(duet_config_get_size(again, k->name) == duet_config_get_size(cfg, k->name),
                       "%s changed", k->name);
            break;
        case DUET_CONFIG_BOOL:
            FUZZ_CHECK(duet_config_get_bool(again, k->name) == duet_config_get_bool(cfg, k->name),
                       "%s changed", k->name);
            break;
        case DUET_CONFIG_STRING:
            FUZZ_CHECK(strcmp(duet_config_get_string(again, k->name), set) == 0, "%s changed",
                       k->name);
            break;
        case DUET_CONFIG_ENUM:
            FUZZ_CHECK(duet_config_get_enum_index(again, k->name) ==
                           duet_config_get_enum_index(cfg, k->name),
                       "%s changed", k->name);
            break;
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    duet_config_t *cfg = NULL, *again = NULL;
    FUZZ_CHECK(duet_config_create(keys, N_KEYS, &cfg) == DUET_OK, "create");
    FUZZ_CHECK(duet_config_create(keys, N_KEYS, &again) == DUET_OK, "create");
    duet_error_clear();
    duet_status_t st = duet_config_load_yaml_string(cfg, (const char *)data, size, "fuzz.yaml");
    if (st != DUET_OK) {
        FUZZ_CHECK(st < 0 && duet_error_last()[0] != '\0', "failure %d without a detail", (int)st);
        check_values(cfg, NULL);
    } else {
        check_values(cfg, again);
        char *text = NULL;
        FUZZ_CHECK(duet_config_dump(cfg, &text) == DUET_OK, "dump");
        free(text);
        FUZZ_CHECK(duet_config_help(cfg, "fuzz [options]", &text) == DUET_OK, "help");
        free(text);
        (void)duet_config_check_required(cfg);
    }
    duet_config_destroy(again);
    duet_config_destroy(cfg);
    return 0;
}
