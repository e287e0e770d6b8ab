/*
 * Typed configuration for every duet binary (docs/switches.md: one YAML, every key also a CLI flag
 * and a DUET_* environment override).
 *
 * A program declares its keys once, in a static table of duet_config_key_t, and everything else
 * follows from that table: parsing and validation of each source, --help text, the start-up dump
 * and typed getters. Sources, lowest to highest priority:
 *
 *   defaults  <  YAML file  <  DUET_* environment  <  CLI flags  <  duet_config_set()
 *
 * Each value remembers the priority and place it came from, and a source never overrides a value
 * that came from a higher one, so the loaders may be called in any order (a program usually
 * parses the command line first to learn --config FILE, then loads the file and the environment).
 *
 * Naming. Keys are dotted lower-case names ("cache.page_tokens"). YAML nests mappings and the
 * nesting flattens to the dotted name. The environment variable is DUET_ + the name upper-cased
 * with '.' turned into '_' (DUET_CACHE_PAGE_TOKENS). Flags are "--" + the name, where '-' and '_'
 * are interchangeable (--cache.page-tokens 64, --cache.page_tokens=64), plus an optional per-key
 * alias (--page-tokens). Bool flags take no separate argument: --x sets true, --no-x sets false,
 * --x=false also works. "--" ends the flags.
 *
 * Strictness. An unknown key in YAML or on the command line is an error naming the file and line
 * (or the flag) and the closest known key; a type or range error names the key and the source.
 * Unknown DUET_* environment variables only warn, because other DUET_ variables exist
 * (DUET_LOG_LEVEL, DUET_SOURCE_DIR, DUET_BINARY_DIR are known and silent). Errors are reported
 * with duet_error_set() and not logged; the caller prints duet_error_last() and exits. After an
 * error the configuration may hold some values of the failed source.
 *
 * Schema mistakes (duplicate names, a default that does not parse, min > max, asking a getter for
 * an undeclared key or the wrong type) are programming errors and abort via DUET_ASSERT.
 */
#ifndef DUET_COMMON_CONFIG_H
#define DUET_COMMON_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum {
    DUET_CONFIG_INT = 0,    /* int64_t, decimal */
    DUET_CONFIG_FLOAT = 1,  /* double, finite */
    DUET_CONFIG_BOOL = 2,   /* true/false, yes/no, on/off, 1/0 (case-insensitive) */
    DUET_CONFIG_STRING = 3, /* any text */
    DUET_CONFIG_ENUM = 4,   /* one of `choices` (case-sensitive) */
    DUET_CONFIG_SIZE = 5,   /* bytes as uint64_t: "4096", "64KiB", "4GiB", "1.5GiB", "2GB", "8G" */
} duet_config_type_t;

/*
 * One declared key. Values that depend on the type (default, min, max) are written as text and
 * parsed with the key's own parser when the schema is created, so one table row reads like the
 * YAML it describes: {"cache.page_tokens", DUET_CONFIG_INT, "64", "tokens per KV page",
 * .min = "1", .max = "4096", .alias = "page-tokens"}.
 */
typedef struct {
    const char *name; /* dotted key, [a-z0-9_.], e.g. "cache.page_tokens" */
    duet_config_type_t type;
    const char *def;  /* default as text; NULL = unset (getters then read 0, false
                         or NULL; see `required`) */
    const char *help; /* one line for --help */
    const char *min;  /* INT/FLOAT/SIZE: inclusive bounds as text, NULL = unbounded */
    const char *max;
    const char *const *choices; /* ENUM: NULL-terminated list of allowed values */
    const char *alias;          /* optional short flag name without "--", e.g. "page-tokens" */
    bool required;              /* duet_config_check_required fails while no source set it */
    bool secret;                /* duet_config_dump prints <redacted> (tokens, passwords) */
} duet_config_key_t;

/* Where a value came from, in increasing priority. */
typedef enum {
    DUET_CONFIG_SRC_UNSET = 0,
    DUET_CONFIG_SRC_DEFAULT = 1,
    DUET_CONFIG_SRC_YAML = 2,
    DUET_CONFIG_SRC_ENV = 3,
    DUET_CONFIG_SRC_CLI = 4,
    DUET_CONFIG_SRC_OVERRIDE = 5,
} duet_config_source_t;

typedef struct duet_config duet_config_t;

/*
 * Build a configuration from keys[0..n_keys) (the table is referenced, not copied: keep it
 * static) with every key at its default. Asserts on schema mistakes.
 */
duet_status_t duet_config_create(const duet_config_key_t *keys, size_t n_keys,
                                 duet_config_t **cfg_p);

/* Free cfg. Accepts NULL. */
void duet_config_destroy(duet_config_t *cfg);

/*
 * Load a YAML file: the top level must be a mapping (an empty file is fine); nested mappings
 * flatten into dotted names; leaves must be scalars. DUET_ERR_IO if unreadable, DUET_ERR_FORMAT
 * for syntax errors and structure errors, DUET_ERR_NOT_FOUND for unknown keys, DUET_ERR_INVALID /
 * DUET_ERR_RANGE for bad values; the detail names path:line. Files over 16 MiB are refused.
 */
duet_status_t duet_config_load_yaml_file(duet_config_t *cfg, const char *path);

/* Same from a buffer of len bytes; `name` stands in for the file name in messages. */
duet_status_t duet_config_load_yaml_string(duet_config_t *cfg, const char *text, size_t len,
                                           const char *name);

/*
 * Apply DUET_* variables from envp (NULL-terminated "NAME=value" strings; NULL = the process
 * environment). A DUET_ variable that matches no key and is not on the allowlist is logged as a
 * warning and counted in *n_unknown_p (may be NULL).
 */
duet_status_t duet_config_load_env(duet_config_t *cfg, char *const *envp, size_t *n_unknown_p);

/*
 * Parse command-line flags argv[1..argc). Positional arguments are moved, in order, to
 * argv[1..1 + *n_pos_p) (argv[0] stays); everything after "--" is positional. Built-in flags:
 * "--config FILE" / "-c FILE" (remembered, see duet_config_file), "-h" / "--help" (sets
 * duet_config_help_requested; the caller prints duet_config_help and exits 0) and "--version"
 * (sets duet_config_version_requested; the caller prints duet_version_print and exits 0). Unknown
 * flags are DUET_ERR_NOT_FOUND with a suggestion; a missing value is DUET_ERR_INVALID.
 */
duet_status_t duet_config_parse_args(duet_config_t *cfg, int argc, char **argv, int *n_pos_p);

/*
 * The usual start-up in one call: parse_args, then the --config file if one was given, then the
 * process environment. Stops early (DUET_OK) when --help or --version was given.
 */
duet_status_t duet_config_load_all(duet_config_t *cfg, int argc, char **argv, int *n_pos_p);

/* Set a key from text at the highest priority (programs deriving values, tests). */
duet_status_t duet_config_set(duet_config_t *cfg, const char *name, const char *value);

/* DUET_ERR_NOT_FOUND naming the first `required` key that no source set. */
duet_status_t duet_config_check_required(const duet_config_t *cfg);

/* The --config FILE given on the command line, or NULL. Owned by cfg. */
const char *duet_config_file(const duet_config_t *cfg);

/* Whether -h/--help was seen by duet_config_parse_args. */
bool duet_config_help_requested(const duet_config_t *cfg);

/* Whether --version was seen by duet_config_parse_args. */
bool duet_config_version_requested(const duet_config_t *cfg);

/*
 * --help text: `usage` (e.g. "duet-gen [options] MODEL_DIR") then one aligned entry per key with
 * its flag(s), value type, help, default, range or choices and environment variable. *text_p
 * receives a malloc'd string (free() it).
 */
duet_status_t duet_config_help(const duet_config_t *cfg, const char *usage, char **text_p);

/*
 * The effective configuration, one "name = value  (source)" line per key, in declaration order,
 * for logging at start-up. *text_p receives a malloc'd string (free() it).
 */
duet_status_t duet_config_dump(const duet_config_t *cfg, char **text_p);

/* Log the dump at info level, one line per key. */
void duet_config_log(const duet_config_t *cfg);

/*
 * Typed getters. The key must be declared with exactly that type (asserted: asking for an
 * undeclared key is a programming error). A key with no default that no source set reads as
 * 0 / false / NULL (enum index -1); mark it `required` to refuse that at start-up.
 */
int64_t duet_config_get_int(const duet_config_t *cfg, const char *name);
double duet_config_get_float(const duet_config_t *cfg, const char *name);
bool duet_config_get_bool(const duet_config_t *cfg, const char *name);
const char *duet_config_get_string(const duet_config_t *cfg, const char *name); /* owned by cfg */
uint64_t duet_config_get_size(const duet_config_t *cfg, const char *name);
const char *duet_config_get_enum(const duet_config_t *cfg,
                                 const char *name); /* a choices[] entry */
int duet_config_get_enum_index(const duet_config_t *cfg, const char *name);

/* Where the current value of `name` came from, and a description ("x.yaml:3", "env DUET_X"). */
duet_config_source_t duet_config_source(const duet_config_t *cfg, const char *name);
const char *duet_config_origin(const duet_config_t *cfg, const char *name);

/*
 * Parse a size string ("4GiB", "512 MiB", "4096", "1.5GiB", "2GB", "8G"; binary units K/M/G/T,
 * Ki/KiB..., decimal KB/MB/GB/TB; case-insensitive). DUET_ERR_INVALID on bad syntax, a
 * fractional byte count or overflow. Exposed for programs that parse sizes elsewhere.
 */
duet_status_t duet_config_parse_size(const char *s, uint64_t *bytes_p);

/*
 * Parse a whole integer / finite number with an INT / FLOAT key's syntax (no surrounding space,
 * nothing after it) and keep it only inside [min, max]: DUET_ERR_INVALID on bad syntax,
 * DUET_ERR_RANGE outside the bounds (or 64 bits, or not finite); *out is set on DUET_OK only.
 * For programs whose flags are not a config table (the benchmarks, duet-http-echo).
 */
duet_status_t duet_config_parse_int(const char *s, int64_t min, int64_t max, int64_t *out);
duet_status_t duet_config_parse_float(const char *s, double min, double max, double *out);

#endif
