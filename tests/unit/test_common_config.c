/*
 * Configuration (common/config.h): precedence default < YAML < env < CLI whatever the load order,
 * strict unknown-key handling with suggestions, type/range/size errors that name key and source,
 * malformed YAML refused without crashing (syntax, structure, truncation, alias cycles, a fuzz
 * pass), help and dump text.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"

static const char *const dtype_choices[] = {"fp32", "bf16", "fp16", NULL};

static const duet_config_key_t test_keys[] = {
    {.name = "cache.page_tokens",
     .type = DUET_CONFIG_INT,
     .def = "64",
     .help = "tokens per KV page",
     .min = "1",
     .max = "4096",
     .alias = "page-tokens"},
    {.name = "cache.budget",
     .type = DUET_CONFIG_SIZE,
     .def = "4GiB",
     .help = "bytes of KV cache per worker",
     .min = "1MiB"},
    {.name = "sampler.temperature",
     .type = DUET_CONFIG_FLOAT,
     .def = "1.0",
     .help = "sampling temperature",
     .min = "0",
     .max = "10"},
    {.name = "spec.enabled",
     .type = DUET_CONFIG_BOOL,
     .def = "false",
     .help = "speculative decoding"},
    {.name = "model.path", .type = DUET_CONFIG_STRING, .help = "checkpoint directory"},
    {.name = "model.dtype",
     .type = DUET_CONFIG_ENUM,
     .def = "bf16",
     .help = "weight dtype",
     .choices = dtype_choices},
    {.name = "router.port",
     .type = DUET_CONFIG_INT,
     .def = "8000",
     .help = "HTTP port",
     .min = "1",
     .max = "65535",
     .alias = "port"},
    {.name = "admin.token",
     .type = DUET_CONFIG_STRING,
     .def = "",
     .help = "admin API token",
     .secret = true},
};
#define N_KEYS (sizeof(test_keys) / sizeof(test_keys[0]))

static duet_config_t *new_cfg(void)
{
    duet_config_t *cfg = NULL;
    cr_assert_eq(duet_config_create(test_keys, N_KEYS, &cfg), DUET_OK);
    return cfg;
}

static duet_status_t load_yaml(duet_config_t *cfg, const char *text)
{
    return duet_config_load_yaml_string(cfg, text, strlen(text), "cfg.yaml");
}

static duet_status_t parse_argv(duet_config_t *cfg, char **argv, int *n_pos)
{
    int argc = 0;
    while (argv[argc] != NULL)
        argc++;
    return duet_config_parse_args(cfg, argc, argv, n_pos);
}

#define ASSERT_ERR(expr, want_st, needle)                                                          \
    do {                                                                                           \
        duet_status_t st_ = (expr);                                                                \
        cr_assert_eq(st_, (want_st), "status %s, detail: %s", duet_status_name(st_),               \
                     duet_error_last());                                                           \
        cr_assert(strstr(duet_error_last(), (needle)) != NULL, "detail \"%s\" lacks \"%s\"",       \
                  duet_error_last(), (needle));                                                    \
    } while (0)

static void quiet(void)
{
    duet_log_set_level(DUET_LOG_LEVEL_ERROR);
}

/* ------------------------------------------------------------ defaults and getters */

Test(common_config, defaults, .timeout = 10)
{
    duet_config_t *cfg = new_cfg();
    cr_assert_eq(duet_config_get_int(cfg, "cache.page_tokens"), 64);
    cr_assert_eq(duet_config_get_size(cfg, "cache.budget"), 4ull << 30);
    cr_assert_eq(duet_config_get_float(cfg, "sampler.temperature"), 1.0);
    cr_assert_eq(duet_config_get_bool(cfg, "spec.enabled"), false);
    cr_assert_null(duet_config_get_string(cfg, "model.path"));
    cr_assert_str_eq(duet_config_get_enum(cfg, "model.dtype"), "bf16");
    cr_assert_eq(duet_config_get_enum_index(cfg, "model.dtype"), 1);
    cr_assert_str_eq(duet_config_get_string(cfg, "admin.token"), "");
    cr_assert_eq(duet_config_source(cfg, "cache.page_tokens"), DUET_CONFIG_SRC_DEFAULT);
    cr_assert_eq(duet_config_source(cfg, "model.path"), DUET_CONFIG_SRC_UNSET);
    cr_assert_str_eq(duet_config_origin(cfg, "cache.page_tokens"), "default");
    duet_config_destroy(cfg);
    duet_config_destroy(NULL);
}

Test(common_config, undeclared_key_aborts, .timeout = 10, .signal = SIGABRT)
{
    duet_config_t *cfg = new_cfg();
    quiet();
    duet_config_get_int(cfg, "cache.page_tokenz");
}

Test(common_config, wrong_type_getter_aborts, .timeout = 10, .signal = SIGABRT)
{
    duet_config_t *cfg = new_cfg();
    quiet();
    duet_config_get_string(cfg, "cache.page_tokens");
}

/* ------------------------------------------------------------ sources and precedence */

static const char *const yaml_doc = "cache:\n"
                                    "  page_tokens: 16\n"
                                    "  budget: 512MiB\n"
                                    "sampler.temperature: 0.5\n"
                                    "model:\n"
                                    "  path: /models/kimi\n"
                                    "  dtype: fp16\n";

Test(common_config, yaml_nested_and_flat, .timeout = 10)
{
    duet_config_t *cfg = new_cfg();
    cr_assert_eq(load_yaml(cfg, yaml_doc), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_config_get_int(cfg, "cache.page_tokens"), 16);
    cr_assert_eq(duet_config_get_size(cfg, "cache.budget"), 512ull << 20);
    cr_assert_eq(duet_config_get_float(cfg, "sampler.temperature"), 0.5);
    cr_assert_str_eq(duet_config_get_string(cfg, "model.path"), "/models/kimi");
    cr_assert_str_eq(duet_config_get_enum(cfg, "model.dtype"), "fp16");
    cr_assert_eq(duet_config_source(cfg, "cache.page_tokens"), DUET_CONFIG_SRC_YAML);
    cr_assert_str_eq(duet_config_origin(cfg, "cache.page_tokens"), "cfg.yaml:2");
    cr_assert_str_eq(duet_config_origin(cfg, "model.dtype"), "cfg.yaml:7");
    duet_config_destroy(cfg);
}

static void check_precedence(duet_config_t *cfg)
{
    /* page_tokens: yaml 16, env 32, cli 128 -> cli. budget: yaml, env -> env.
       temperature: yaml only. port: default. */
    cr_assert_eq(duet_config_get_int(cfg, "cache.page_tokens"), 128);
    cr_assert_eq(duet_config_source(cfg, "cache.page_tokens"), DUET_CONFIG_SRC_CLI);
    cr_assert_str_eq(duet_config_origin(cfg, "cache.page_tokens"), "flag --page-tokens");
    cr_assert_eq(duet_config_get_size(cfg, "cache.budget"), 1ull << 30);
    cr_assert_eq(duet_config_source(cfg, "cache.budget"), DUET_CONFIG_SRC_ENV);
    cr_assert_eq(duet_config_get_float(cfg, "sampler.temperature"), 0.5);
    cr_assert_eq(duet_config_source(cfg, "sampler.temperature"), DUET_CONFIG_SRC_YAML);
    cr_assert_eq(duet_config_get_int(cfg, "router.port"), 8000);
    cr_assert_eq(duet_config_source(cfg, "router.port"), DUET_CONFIG_SRC_DEFAULT);
}

Test(common_config, precedence_default_yaml_env_cli, .timeout = 10)
{
    char *env[] = {"DUET_CACHE_PAGE_TOKENS=32", "DUET_CACHE_BUDGET=1GiB", "PATH=/bin", NULL};
    char *argv[] = {"prog", "--page-tokens", "128", NULL};
    int n_pos;

    /* In priority order. */
    duet_config_t *cfg = new_cfg();
    cr_assert_eq(load_yaml(cfg, yaml_doc), DUET_OK);
    cr_assert_eq(duet_config_load_env(cfg, env, NULL), DUET_OK);
    cr_assert_eq(parse_argv(cfg, argv, &n_pos), DUET_OK);
    check_precedence(cfg);
    duet_config_destroy(cfg);

    /* Reversed order: the CLI first (as programs do, to learn --config), then YAML, then env. */
    char *argv2[] = {"prog", "--page-tokens", "128", NULL};
    cfg = new_cfg();
    cr_assert_eq(parse_argv(cfg, argv2, &n_pos), DUET_OK);
    cr_assert_eq(duet_config_load_env(cfg, env, NULL), DUET_OK);
    cr_assert_eq(load_yaml(cfg, yaml_doc), DUET_OK);
    check_precedence(cfg);

    /* The program's own override beats everything. */
    cr_assert_eq(duet_config_set(cfg, "cache.page_tokens", "8"), DUET_OK);
    cr_assert_eq(duet_config_get_int(cfg, "cache.page_tokens"), 8);
    ASSERT_ERR(duet_config_set(cfg, "cache.nope", "8"), DUET_ERR_NOT_FOUND, "cache.nope");
    duet_config_destroy(cfg);
}

Test(common_config, load_all_reads_config_flag_file_and_env, .timeout = 10)
{
    char path[] = "/tmp/duet_cfg_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, yaml_doc, strlen(yaml_doc)), (ssize_t)strlen(yaml_doc));
    close(fd);
    setenv("DUET_ROUTER_PORT", "9001", 1);
    setenv("DUET_LOG_LEVEL", "error", 1);
    char *argv[] = {"prog", "model-dir", "--config", path, "--spec.enabled", NULL};
    int n_pos = -1;

    duet_config_t *cfg = new_cfg();
    cr_assert_eq(duet_config_load_all(cfg, 5, argv, &n_pos), DUET_OK, "%s", duet_error_last());
    cr_assert_str_eq(duet_config_file(cfg), path);
    cr_assert_eq(n_pos, 1);
    cr_assert_str_eq(argv[1], "model-dir");
    cr_assert_eq(duet_config_get_int(cfg, "cache.page_tokens"), 16);
    cr_assert_eq(duet_config_get_int(cfg, "router.port"), 9001);
    cr_assert_eq(duet_config_get_bool(cfg, "spec.enabled"), true);
    cr_assert_eq(duet_config_help_requested(cfg), false);
    duet_config_destroy(cfg);
    unlink(path);
}

Test(common_config, cli_forms_and_positionals, .timeout = 10)
{
    char *argv[] = {"prog",
                    "first",
                    "--cache.page-tokens",
                    "32",
                    "--router.port=81",
                    "second",
                    "--spec.enabled",
                    "--model.dtype",
                    "fp32",
                    "--",
                    "--page-tokens",
                    NULL};
    int n_pos;

    duet_config_t *cfg = new_cfg();
    cr_assert_eq(parse_argv(cfg, argv, &n_pos), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_config_get_int(cfg, "cache.page_tokens"), 32);
    cr_assert_eq(duet_config_get_int(cfg, "router.port"), 81);
    cr_assert_eq(duet_config_get_bool(cfg, "spec.enabled"), true);
    cr_assert_str_eq(duet_config_get_enum(cfg, "model.dtype"), "fp32");
    cr_assert_eq(n_pos, 3);
    cr_assert_str_eq(argv[0], "prog");
    cr_assert_str_eq(argv[1], "first");
    cr_assert_str_eq(argv[2], "second");
    cr_assert_str_eq(argv[3], "--page-tokens", "after -- everything is positional");

    char *argv2[] = {"prog", "--cache.page_tokens=48", "--no-spec.enabled", "--port", "7", NULL};
    cr_assert_eq(parse_argv(cfg, argv2, &n_pos), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_config_get_int(cfg, "cache.page_tokens"), 48);
    cr_assert_eq(duet_config_get_bool(cfg, "spec.enabled"), false);
    cr_assert_eq(duet_config_get_int(cfg, "router.port"), 7);
    cr_assert_eq(n_pos, 0);

    char *argv3[] = {"prog", "--spec.enabled=yes", "-h", NULL};
    cr_assert_eq(parse_argv(cfg, argv3, &n_pos), DUET_OK);
    cr_assert_eq(duet_config_get_bool(cfg, "spec.enabled"), true);
    cr_assert(duet_config_help_requested(cfg));
    duet_config_destroy(cfg);
}

Test(common_config, cli_errors, .timeout = 10)
{
    int n_pos;
    duet_config_t *cfg = new_cfg();

    char *a1[] = {"prog", "--page-tokns", "5", NULL};
    ASSERT_ERR(parse_argv(cfg, a1, &n_pos), DUET_ERR_NOT_FOUND, "unknown flag \"--page-tokns\"");
    cr_assert(strstr(duet_error_last(), "(did you mean --cache.page-tokens?)") != NULL, "%s",
              duet_error_last());
    char *a1b[] = {"prog", "--cache.page-tokns", "5", NULL};
    ASSERT_ERR(parse_argv(cfg, a1b, &n_pos), DUET_ERR_NOT_FOUND,
               "(did you mean --cache.page-tokens?)");
    char *a2[] = {"prog", "--cache.page-tokens", NULL};
    ASSERT_ERR(parse_argv(cfg, a2, &n_pos), DUET_ERR_INVALID, "missing value");
    char *a3[] = {"prog", "--page-tokens", "abc", NULL};
    ASSERT_ERR(parse_argv(cfg, a3, &n_pos), DUET_ERR_INVALID,
               "flag --page-tokens: cache.page_tokens: expected an integer, got \"abc\"");
    char *a4[] = {"prog", "--page-tokens=0", NULL};
    ASSERT_ERR(parse_argv(cfg, a4, &n_pos), DUET_ERR_RANGE,
               "flag --page-tokens: cache.page_tokens: 0 is below the minimum 1");
    char *a5[] = {"prog", "--router.port", "70000", NULL};
    ASSERT_ERR(parse_argv(cfg, a5, &n_pos), DUET_ERR_RANGE, "above the maximum 65535");
    char *a6[] = {"prog", "-x", NULL};
    ASSERT_ERR(parse_argv(cfg, a6, &n_pos), DUET_ERR_NOT_FOUND, "\"-x\"");
    char *a7[] = {"prog", "--model.dtype", "int4", NULL};
    ASSERT_ERR(parse_argv(cfg, a7, &n_pos), DUET_ERR_INVALID,
               "\"int4\" is not one of: fp32, bf16, fp16");
    char *a8[] = {"prog", "--no-spec.enabled=1", NULL};
    ASSERT_ERR(parse_argv(cfg, a8, &n_pos), DUET_ERR_INVALID, "takes no value");
    char *a9[] = {"prog", "--no-page-tokens", NULL};
    ASSERT_ERR(parse_argv(cfg, a9, &n_pos), DUET_ERR_NOT_FOUND, "--no-page-tokens");
    char *a10[] = {"prog", "--config", NULL};
    ASSERT_ERR(parse_argv(cfg, a10, &n_pos), DUET_ERR_INVALID, "missing file name");
    char *a11[] = {"prog", "--spec.enabled=maybe", NULL};
    ASSERT_ERR(parse_argv(cfg, a11, &n_pos), DUET_ERR_INVALID, "expected a boolean");
    char *a12[] = {"prog", "--sampler.temperature", "nan", NULL};
    ASSERT_ERR(parse_argv(cfg, a12, &n_pos), DUET_ERR_RANGE, "not a finite number");
    char *a13[] = {"prog", "--sampler.temperature", "1.5x", NULL};
    ASSERT_ERR(parse_argv(cfg, a13, &n_pos), DUET_ERR_INVALID, "expected a number");
    char *a14[] = {"prog", "--page-tokens", "99999999999999999999", NULL};
    ASSERT_ERR(parse_argv(cfg, a14, &n_pos), DUET_ERR_RANGE, "does not fit in 64 bits");
    char *a15[] = {"prog", "--cache.budget", "4XB", NULL};
    ASSERT_ERR(parse_argv(cfg, a15, &n_pos), DUET_ERR_INVALID,
               "cache.budget: expected a size (e.g. 4096, 64KiB, 4GiB), got \"4XB\"");
    char *a16[] = {"prog", "--cache.budget", "512KiB", NULL};
    ASSERT_ERR(parse_argv(cfg, a16, &n_pos), DUET_ERR_RANGE, "below the minimum 1MiB");
    duet_config_destroy(cfg);
}

Test(common_config, env_errors_and_unknown_vars, .timeout = 10)
{
    quiet();
    duet_config_t *cfg = new_cfg();
    size_t n_unknown;
    char *ok[] = {"DUET_LOG_LEVEL=debug",
                  "DUET_SOURCE_DIR=/x",
                  "DUET_BINARY_DIR=/y",
                  "DUET_CUDA_NO_PDL=1",    /* the switches of docs/switches.md: prefix */
                  "DUET_KERNELS_ISA=avx2", /* and by name */
                  "DUET_CACHE_PAGETOKENS=3",
                  "DUET_MODEL_PATH=/m",
                  "DUETX=1",
                  "OTHER=2",
                  NULL};
    cr_assert_eq(duet_config_load_env(cfg, ok, &n_unknown), DUET_OK);
    cr_assert_eq(n_unknown, 1, "only the misspelt DUET_ variable is unknown, not the switches");
    cr_assert_str_eq(duet_config_get_string(cfg, "model.path"), "/m");
    cr_assert_str_eq(duet_config_origin(cfg, "model.path"), "environment variable DUET_MODEL_PATH");

    char *bad[] = {"DUET_CACHE_PAGE_TOKENS=many", NULL};
    ASSERT_ERR(duet_config_load_env(cfg, bad, NULL), DUET_ERR_INVALID,
               "environment variable DUET_CACHE_PAGE_TOKENS: cache.page_tokens: expected an "
               "integer, got \"many\"");
    char *range[] = {"DUET_SAMPLER_TEMPERATURE=11", NULL};
    ASSERT_ERR(duet_config_load_env(cfg, range, NULL), DUET_ERR_RANGE,
               "DUET_SAMPLER_TEMPERATURE: sampler.temperature: 11 is above the maximum 10");
    char *empty[] = {"DUET_ROUTER_PORT=", NULL};
    ASSERT_ERR(duet_config_load_env(cfg, empty, NULL), DUET_ERR_INVALID, "DUET_ROUTER_PORT");
    duet_config_destroy(cfg);
}

Test(common_config, required_keys, .timeout = 10)
{
    static const duet_config_key_t keys[] = {
        {.name = "model.path", .type = DUET_CONFIG_STRING, .help = "x", .required = true},
    };
    duet_config_t *cfg;
    cr_assert_eq(duet_config_create(keys, 1, &cfg), DUET_OK);
    ASSERT_ERR(duet_config_check_required(cfg), DUET_ERR_NOT_FOUND,
               "model.path is required: set it in the config file, with DUET_MODEL_PATH");
    cr_assert_eq(duet_config_set(cfg, "model.path", "/m"), DUET_OK);
    cr_assert_eq(duet_config_check_required(cfg), DUET_OK);
    duet_config_destroy(cfg);
}

/* ------------------------------------------------------------ sizes */

Test(common_config, size_strings, .timeout = 10)
{
    static const struct {
        const char *s;
        uint64_t v;
    } good[] = {
        {"0", 0},
        {"4096", 4096},
        {"4GiB", 4ull << 30},
        {"4 GiB", 4ull << 30},
        {"4gib", 4ull << 30},
        {"512MiB", 512ull << 20},
        {"1.5GiB", 3ull << 29},
        {"2GB", 2000000000ull},
        {"8G", 8ull << 30},
        {"64k", 64ull << 10},
        {"1Ki", 1024},
        {"100B", 100},
        {"1TiB", 1ull << 40},
        {"0.5KiB", 512},
        {"16777215TiB", 16777215ull << 40},
        {"18446744073709551615", UINT64_MAX},
    };
    static const char *const bad[] = {"",      "GiB",  "-1",          "4XB",
                                      "1.5B",  "1e3",  " 4GiB",       "4GiB ",
                                      "4..5G", "4.G",  "16777216TiB", "18446744073709551616",
                                      ".5GiB", "0x10", "4 G iB",      "1.0000000000000000001K"};
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        uint64_t v = 1;
        cr_assert_eq(duet_config_parse_size(good[i].s, &v), DUET_OK, "\"%s\"", good[i].s);
        cr_assert_eq(v, good[i].v, "\"%s\" -> %llu", good[i].s, (unsigned long long)v);
    }
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        uint64_t v = 7;
        cr_assert_eq(duet_config_parse_size(bad[i], &v), DUET_ERR_INVALID, "\"%s\"", bad[i]);
        cr_assert_eq(v, 7);
    }
}

/* ------------------------------------------------------------ YAML errors */

Test(common_config, yaml_unknown_key_named_with_line, .timeout = 10)
{
    duet_config_t *cfg = new_cfg();
    ASSERT_ERR(
        load_yaml(cfg, "router:\n  port: 80\ncache:\n  page_tokns: 16\n"), DUET_ERR_NOT_FOUND,
        "cfg.yaml:4: unknown key \"cache.page_tokns\" (did you mean \"cache.page_tokens\"?)");
    ASSERT_ERR(load_yaml(cfg, "zzz_completely_else: 1\n"), DUET_ERR_NOT_FOUND,
               "cfg.yaml:1: unknown key \"zzz_completely_else\"");
    cr_assert_null(strstr(duet_error_last(), "did you mean"));
    ASSERT_ERR(load_yaml(cfg, "cache: 5\n"), DUET_ERR_NOT_FOUND, "unknown key \"cache\"");
    duet_config_destroy(cfg);

    /* From a file: the path is in the message. */
    char path[] = "/tmp/duet_cfg_XXXXXX";
    int fd = mkstemp(path);
    const char *doc = "# comment\nspec:\n  enabld: true\n";
    cr_assert_eq(write(fd, doc, strlen(doc)), (ssize_t)strlen(doc));
    close(fd);
    char want[128];
    snprintf(want, sizeof(want), "%s:3: unknown key \"spec.enabld\"", path);
    cfg = new_cfg();
    ASSERT_ERR(duet_config_load_yaml_file(cfg, path), DUET_ERR_NOT_FOUND, want);
    unlink(path);
    ASSERT_ERR(duet_config_load_yaml_file(cfg, "/nonexistent/duet.yaml"), DUET_ERR_IO,
               "/nonexistent/duet.yaml: cannot open");
    duet_config_destroy(cfg);
}

Test(common_config, yaml_malformed_refused, .timeout = 10)
{
    static const struct {
        const char *doc;
        duet_status_t st;
        const char *needle;
    } cases[] = {
        {"cache:\n  page_tokens: [1, 2\n", DUET_ERR_FORMAT, "cfg.yaml:"},
        {"cache:\n  page_tokens: [1, 2]\n", DUET_ERR_FORMAT,
         "cfg.yaml:2: cache.page_tokens: expected a single value, got a sequence"},
        {"cache:\n  page_tokens:\n    x: 1\n", DUET_ERR_FORMAT, "got a mapping"},
        {"- a\n- b\n", DUET_ERR_FORMAT, "cfg.yaml:1: the top level must be a mapping"},
        {"just a scalar\n", DUET_ERR_FORMAT, "top level must be a mapping"},
        {"cache:\n\tpage_tokens: 1\n", DUET_ERR_FORMAT, "YAML syntax error"},
        {"a: b: c\n", DUET_ERR_FORMAT, "YAML syntax error"},
        {"cache: {page_tokens: 1\n", DUET_ERR_FORMAT, "YAML syntax error"},
        {"\"cache.page_tokens: 1\n", DUET_ERR_FORMAT, "YAML syntax error"},
        {"cache:\n  page_tokens: 1\n  page_tokens: 2\n", DUET_ERR_FORMAT, "given twice"},
        {"cache.page_tokens: 1\ncache:\n  page_tokens: 2\n", DUET_ERR_FORMAT, "given twice"},
        {"cache:\n  page_tokens:\n", DUET_ERR_INVALID, "cache.page_tokens: no value given"},
        {"cache:\n  page_tokens: ~\n", DUET_ERR_INVALID, "no value given"},
        {"cache:\n  page_tokens: sixteen\n", DUET_ERR_INVALID,
         "cfg.yaml:2: cache.page_tokens: expected an integer, got \"sixteen\""},
        {"cache:\n  page_tokens: 5000\n", DUET_ERR_RANGE, "cfg.yaml:2: cache.page_tokens: 5000"},
        {"cache:\n  budget: 4 parsecs\n", DUET_ERR_INVALID, "expected a size"},
        {"[a, b]: 1\n", DUET_ERR_FORMAT, "a key must be a plain name"},
        {"spec.enabled: true\n---\nspec.enabled: false\n", DUET_ERR_FORMAT,
         "more than one YAML document"},
        {"a: &x\n  b: *x\n", DUET_ERR_FORMAT, "cfg.yaml"}, /* alias cycle */
        {"model:\n  dtype: FP32\n", DUET_ERR_INVALID, "model.dtype: \"FP32\" is not one of"},
        {"cache: {}\nbogus: {}\n", DUET_ERR_NOT_FOUND, "cfg.yaml:2: unknown section \"bogus\""},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        duet_config_t *cfg = new_cfg();
        duet_status_t st = load_yaml(cfg, cases[i].doc);
        cr_assert(st < 0, "case %zu accepted", i);
        if (st != cases[i].st || strstr(duet_error_last(), cases[i].needle) == NULL)
            cr_assert_fail("case %zu (%s): got %s \"%s\", want %s \"%s\"", i, cases[i].doc,
                           duet_status_name(st), duet_error_last(), duet_status_name(cases[i].st),
                           cases[i].needle);
        duet_config_destroy(cfg);
    }
}

Test(common_config, yaml_empty_and_comments_ok, .timeout = 10)
{
    duet_config_t *cfg = new_cfg();
    cr_assert_eq(load_yaml(cfg, ""), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(load_yaml(cfg, "# nothing here\n"), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(load_yaml(cfg, "---\n"), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(load_yaml(cfg, "cache: {}\n"), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(load_yaml(cfg, "model: {path: \"/a b\", dtype: 'fp32'}\n"), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_str_eq(duet_config_get_string(cfg, "model.path"), "/a b");
    cr_assert_eq(duet_config_get_int(cfg, "cache.page_tokens"), 64);
    duet_config_destroy(cfg);
}

Test(common_config, yaml_truncated_at_every_byte, .timeout = 30)
{
    size_t n = strlen(yaml_doc);
    for (size_t len = 0; len <= n; len++) {
        duet_config_t *cfg = new_cfg();
        duet_status_t st = duet_config_load_yaml_string(cfg, yaml_doc, len, "cut.yaml");
        cr_assert(st == DUET_OK || st == DUET_ERR_FORMAT || st == DUET_ERR_NOT_FOUND ||
                      st == DUET_ERR_INVALID || st == DUET_ERR_RANGE,
                  "len %zu: %d", len, st);
        if (st != DUET_OK)
            cr_assert(strstr(duet_error_last(), "cut.yaml") != NULL, "len %zu: %s", len,
                      duet_error_last());
        duet_config_destroy(cfg);
    }
}

/* ------------------------------------------------------------ help and dump */

Test(common_config, help_lists_keys_defaults_aligned, .timeout = 10)
{
    duet_config_t *cfg = new_cfg();
    char *text = NULL;
    cr_assert_eq(duet_config_help(cfg, "duet-gen [options] MODEL_DIR", &text), DUET_OK);
    static const char *const needles[] = {
        "usage: duet-gen [options] MODEL_DIR",
        "--cache.page-tokens, --page-tokens INT",
        "tokens per KV page",
        "default: 64; range: 1..4096; env DUET_CACHE_PAGE_TOKENS",
        "--cache.budget SIZE",
        "default: 4GiB; range: 1MiB..;",
        "one of: fp32|bf16|fp16",
        "--spec.enabled, --no-spec.enabled\n",
        "--config FILE",
        "--help",
        "DUET_ADMIN_TOKEN",
    };
    for (size_t i = 0; i < sizeof(needles) / sizeof(needles[0]); i++)
        cr_assert(strstr(text, needles[i]) != NULL, "help lacks \"%s\":\n%s", needles[i], text);
    /* Every key's help starts in the same column. */
    long col = -1;
    for (size_t i = 0; i < N_KEYS; i++) {
        const char *h = strstr(text, test_keys[i].help);
        cr_assert(h != NULL);
        const char *bol = h;
        while (bol > text && bol[-1] != '\n')
            bol--;
        if (col < 0)
            col = h - bol;
        cr_assert_eq(h - bol, col, "help of %s not aligned:\n%s", test_keys[i].name, text);
    }
    free(text);
    duet_config_destroy(cfg);
}

Test(common_config, dump_shows_values_and_origins, .timeout = 10)
{
    duet_config_t *cfg = new_cfg();
    char *argv[] = {"prog", "--port", "9", "--admin.token", "hunter2", NULL};
    int n_pos;
    char *text = NULL;
    cr_assert_eq(parse_argv(cfg, argv, &n_pos), DUET_OK);
    cr_assert_eq(load_yaml(cfg, "cache:\n  budget: 1536MiB\n"), DUET_OK);
    cr_assert_eq(duet_config_dump(cfg, &text), DUET_OK);
    cr_assert(strstr(text, "cache.page_tokens   = 64  (default)\n") != NULL, "%s", text);
    cr_assert(strstr(text, "cache.budget        = 1536MiB  (cfg.yaml:2)\n") != NULL, "%s", text);
    cr_assert(strstr(text, "router.port         = 9  (flag --port)\n") != NULL, "%s", text);
    cr_assert(strstr(text, "model.path            (unset)\n") != NULL, "%s", text);
    cr_assert(strstr(text, "<redacted>") != NULL, "%s", text);
    cr_assert_null(strstr(text, "hunter2"), "secrets never reach the log");
    free(text);
    quiet();
    duet_config_log(cfg);
    duet_config_destroy(cfg);
}

/* ------------------------------------------------------------ fuzz */

static uint64_t rng_state;

static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

Test(common_config, fuzz_yaml_loader, .timeout = 120)
{
    static const char alphabet[] = "abcdegkmnoprstuz_.:-[]{},&*!|>'\"#~ \n\t0123456789\x01\xff";
    const char *seeds[] = {yaml_doc, "a: &x\n  b: *x\n",
                           "model: {path: \"/a\", dtype: fp32}\ncache: {budget: 1GiB}\n"};
    char buf[1024];
    rng_state = 0x2545f4914f6cdd1dull;
    quiet();

    for (int iter = 0; iter < 3000; iter++) {
        size_t len;
        if (iter % 5 == 4) {
            len = rng() % 200;
            for (size_t i = 0; i < len; i++)
                buf[i] = (char)(rng() & 0xff);
        } else {
            const char *seed = seeds[rng() % 3];
            len = strlen(seed);
            memcpy(buf, seed, len);
            int n_mut = 1 + (int)(rng() % 4);
            for (int m = 0; m < n_mut && len > 0 && len < sizeof(buf) - 2; m++) {
                size_t at = rng() % len;
                switch (rng() % 4) {
                case 0:
                    buf[at] = alphabet[rng() % (sizeof(alphabet) - 1)];
                    break;
                case 1:
                    memmove(buf + at + 1, buf + at, len - at);
                    buf[at] = alphabet[rng() % (sizeof(alphabet) - 1)];
                    len++;
                    break;
                case 2:
                    memmove(buf + at, buf + at + 1, len - at - 1);
                    len--;
                    break;
                default:
                    len = at;
                    break;
                }
            }
        }
        duet_config_t *cfg = NULL;
        if (duet_config_create(test_keys, N_KEYS, &cfg) != DUET_OK)
            cr_assert_fail("create");
        duet_error_clear();
        duet_status_t st = duet_config_load_yaml_string(cfg, buf, len, "fuzz.yaml");
        /* Plain checks: ctest runs with --full-stats, which ships every assertion. */
        if (!(st == DUET_OK || st == DUET_ERR_FORMAT || st == DUET_ERR_NOT_FOUND ||
              st == DUET_ERR_INVALID || st == DUET_ERR_RANGE))
            cr_assert_fail("iter %d: status %d", iter, st);
        if (st != DUET_OK && strstr(duet_error_last(), "fuzz.yaml") == NULL)
            cr_assert_fail("iter %d: detail \"%s\"", iter, duet_error_last());
        /* Whatever was accepted reads back through the getters. */
        (void)duet_config_get_int(cfg, "cache.page_tokens");
        (void)duet_config_get_enum(cfg, "model.dtype");
        duet_config_destroy(cfg);
    }
}

/* duet_config_parse_int / _float, the INT / FLOAT syntax for flags outside a config table: good
 * values inside the bounds; bad syntax (DUET_ERR_INVALID) and values outside the bounds, 64 bits
 * or finiteness (DUET_ERR_RANGE) leave *out untouched. */
Test(common_config, parse_int_and_float_standalone, .timeout = 10)
{
    static const struct {
        const char *s;
        int64_t v;
    } igood[] = {{"0", 0}, {"+7", 7}, {"-3", -3}, {"65535", 65535}};
    for (size_t i = 0; i < sizeof(igood) / sizeof(igood[0]); i++) {
        int64_t v = 99;
        cr_assert_eq(duet_config_parse_int(igood[i].s, -5, 65535, &v), DUET_OK, "\"%s\"",
                     igood[i].s);
        cr_assert_eq(v, igood[i].v, "\"%s\" -> %lld", igood[i].s, (long long)v);
    }
    static const struct {
        const char *s;
        duet_status_t st;
    } ibad[] = {{"", DUET_ERR_INVALID},     {" 5", DUET_ERR_INVALID},
                {"5 ", DUET_ERR_INVALID},   {"12abc", DUET_ERR_INVALID},
                {"0x10", DUET_ERR_INVALID}, {"1.5", DUET_ERR_INVALID},
                {"-", DUET_ERR_INVALID},    {"65536", DUET_ERR_RANGE},
                {"-6", DUET_ERR_RANGE},     {"99999999999999999999", DUET_ERR_RANGE}};
    for (size_t i = 0; i < sizeof(ibad) / sizeof(ibad[0]); i++) {
        int64_t v = 99;
        cr_assert_eq(duet_config_parse_int(ibad[i].s, -5, 65535, &v), ibad[i].st, "\"%s\"",
                     ibad[i].s);
        cr_assert_eq(v, 99, "\"%s\" wrote %lld", ibad[i].s, (long long)v);
    }
    static const struct {
        const char *s;
        double v;
    } fgood[] = {{"100", 100.0}, {"0.25", 0.25}, {"1e3", 1000.0}, {"1e6", 1e6}};
    for (size_t i = 0; i < sizeof(fgood) / sizeof(fgood[0]); i++) {
        double v = -1.0;
        cr_assert_eq(duet_config_parse_float(fgood[i].s, 0.1, 1e6, &v), DUET_OK, "\"%s\"",
                     fgood[i].s);
        cr_assert_eq(v, fgood[i].v, "\"%s\" -> %g", fgood[i].s, v);
    }
    static const struct {
        const char *s;
        duet_status_t st;
    } fbad[] = {{"", DUET_ERR_INVALID},    {" 1", DUET_ERR_INVALID}, {"1ms", DUET_ERR_INVALID},
                {"abc", DUET_ERR_INVALID}, {"0", DUET_ERR_RANGE},    {"-1", DUET_ERR_RANGE},
                {"1e7", DUET_ERR_RANGE},   {"inf", DUET_ERR_RANGE},  {"nan", DUET_ERR_RANGE},
                {"1e999", DUET_ERR_RANGE}};
    for (size_t i = 0; i < sizeof(fbad) / sizeof(fbad[0]); i++) {
        double v = -1.0;
        cr_assert_eq(duet_config_parse_float(fbad[i].s, 0.1, 1e6, &v), fbad[i].st, "\"%s\"",
                     fbad[i].s);
        cr_assert_eq(v, -1.0, "\"%s\" wrote %g", fbad[i].s, v);
    }
}
