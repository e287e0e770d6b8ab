/*
 * Typed configuration: schema, the four sources, help and dump; see config.h for the contract.
 *
 * Every source funnels into config_assign(), which parses the text with the key's type, checks
 * the range and applies the value only when the source's priority is at least the current one.
 * That single path is why messages look the same whatever the source ("<origin>: <key>: ...")
 * and why the loaders can run in any order.
 *
 * YAML is read through common/yaml.h, whose walk is bounded against alias cycles and bombs.
 */
#define _GNU_SOURCE
#include "common/config.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "common/log.h"
#include "common/strbuf.h"
#include "common/yaml.h"

extern char **environ;

#define CONFIG_NAME_MAX       128 /* longest key or flag name */
#define CONFIG_ORIGIN_MAX     192 /* "file.yaml:12", "flag --x", ... */
#define CONFIG_YAML_MAX_BYTES ((size_t)16 << 20)
#define CONFIG_HELP_COLUMN    36

/* DUET_ variables that are not configuration keys and must not draw a warning: the switches of
 * docs/switches.md. An entry ending in '*' is a prefix. */
static const char *const config_env_allowlist[] = {"DUET_LOG_LEVEL",
                                                   "DUET_SOURCE_DIR",
                                                   "DUET_BINARY_DIR",
                                                   "DUET_THREADS",
                                                   "DUET_SPIN_US",
                                                   "DUET_KERNELS_ISA",
                                                   "DUET_TRACE_OUT",
                                                   "DUET_ADMIN_TOKEN",
                                                   "DUET_CUDA_*",
                                                   "DUET_TEST_*",
                                                   "DUET_KEEP_TEST_DIR",
                                                   "DUET_ADMIN_FILE",
                                                   NULL};

/* A parsed value of any type. */
typedef struct {
    union {
        int64_t i;  /* INT */
        double f;   /* FLOAT */
        bool b;     /* BOOL */
        uint64_t z; /* SIZE */
        int e;      /* ENUM: index into choices, -1 when unset */
    };
    char *s; /* STRING: owned, NULL when unset */
} config_value_t;

typedef struct {
    const duet_config_key_t *key; /* not owned: the caller's static table */
    config_value_t val;
    duet_config_source_t src;
    char origin[CONFIG_ORIGIN_MAX];
    char env[CONFIG_NAME_MAX + 8]; /* DUET_CACHE_PAGE_TOKENS */
    char alias[CONFIG_NAME_MAX];   /* normalised alias ('-' -> '_'), or "" */
    bool has_min, has_max;
    config_value_t min, max; /* parsed bounds (INT/FLOAT/SIZE) */
} config_slot_t;

struct duet_config {
    config_slot_t *slots; /* owned, n_slots entries in declaration order */
    size_t n_slots;
    char *config_file; /* owned: --config FILE, or NULL */
    bool help;         /* -h/--help seen */
    bool version;      /* --version seen */
};

/* ---------------------------------------------------------------- small helpers */

static const char *config_type_name(duet_config_type_t t)
{
    switch (t) {
    case DUET_CONFIG_INT:
        return "an integer";
    case DUET_CONFIG_FLOAT:
        return "a number";
    case DUET_CONFIG_BOOL:
        return "a boolean (true/false)";
    case DUET_CONFIG_STRING:
        return "a string";
    case DUET_CONFIG_ENUM:
        return "one of the listed values";
    case DUET_CONFIG_SIZE:
        return "a size (e.g. 4096, 64KiB, 4GiB)";
    }
    return "?";
}

static const char *config_metavar(duet_config_type_t t)
{
    switch (t) {
    case DUET_CONFIG_INT:
        return "INT";
    case DUET_CONFIG_FLOAT:
        return "NUM";
    case DUET_CONFIG_BOOL:
        return "";
    case DUET_CONFIG_STRING:
        return "STR";
    case DUET_CONFIG_ENUM:
        return "CHOICE";
    case DUET_CONFIG_SIZE:
        return "SIZE";
    }
    return "?";
}

/* Copy `s` with '-' turned into '_' (flag spelling -> key spelling). False if too long. */
static bool config_normalise(const char *s, size_t n, char *out, size_t cap)
{
    if (n >= cap)
        return false;
    for (size_t i = 0; i < n; i++)
        out[i] = s[i] == '-' ? '_' : s[i];
    out[n] = '\0';
    return true;
}

/* Flag spelling of a key: '_' -> '-' ("cache.page-tokens"). */
static void config_flag_name(const char *name, char *out, size_t cap)
{
    snprintf(out, cap, "%s", name);
    for (char *p = out; *p != '\0'; p++)
        if (*p == '_')
            *p = '-';
}

static bool config_name_valid(const char *s)
{
    if (s == NULL || s[0] == '\0' || s[0] == '.' || strlen(s) >= CONFIG_NAME_MAX)
        return false;
    for (const char *p = s; *p != '\0'; p++) {
        bool ok = (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '_' || *p == '.';
        if (!ok || (p[0] == '.' && (p[1] == '.' || p[1] == '\0')))
            return false;
    }
    return true;
}

/* Levenshtein distance, capped to keep the cost trivial for long garbage input. */
static size_t config_edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    if (la > 64 || lb > 64)
        return SIZE_MAX;
    size_t row[65];
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] == b[j - 1] ? 0 : 1);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

/* The declared key closest to `name` (by name or alias), or NULL when nothing is close. */
static const char *config_suggest(const duet_config_t *cfg, const char *name)
{
    const char *best = NULL;
    size_t best_d = SIZE_MAX;
    size_t limit = strlen(name) / 3;
    if (limit < 2)
        limit = 2;
    for (size_t i = 0; i < cfg->n_slots; i++) {
        const config_slot_t *sl = &cfg->slots[i];
        size_t d = config_edit_distance(name, sl->key->name);
        if (sl->alias[0] != '\0') {
            size_t da = config_edit_distance(name, sl->alias);
            if (da < d)
                d = da;
        }
        /* A name that is a suffix of a key ("page_tokens" for "cache.page_tokens") is a hit too. */
        const char *dot = strrchr(sl->key->name, '.');
        if (dot != NULL && strcmp(dot + 1, name) == 0)
            d = 1;
        if (d < best_d) {
            best_d = d;
            best = sl->key->name;
        }
    }
    return best_d <= limit ? best : NULL;
}

/* Append ` (did you mean "x"?)` to an error detail when there is a close key. */
static duet_status_t config_unknown(const duet_config_t *cfg, const char *origin, const char *what,
                                    const char *name)
{
    const char *sugg = config_suggest(cfg, name);
    if (sugg != NULL)
        return duet_error_set(DUET_ERR_NOT_FOUND, "%s: unknown %s \"%s\" (did you mean \"%s\"?)",
                              origin, what, name, sugg);
    return duet_error_set(DUET_ERR_NOT_FOUND, "%s: unknown %s \"%s\"", origin, what, name);
}

static config_slot_t *config_find(const duet_config_t *cfg, const char *name)
{
    for (size_t i = 0; i < cfg->n_slots; i++)
        if (strcmp(cfg->slots[i].key->name, name) == 0)
            return &cfg->slots[i];
    return NULL;
}

/* Key by normalised flag name: the key name or its alias. */
static config_slot_t *config_find_flag(const duet_config_t *cfg, const char *norm)
{
    config_slot_t *sl = config_find(cfg, norm);
    if (sl != NULL)
        return sl;
    for (size_t i = 0; i < cfg->n_slots; i++)
        if (cfg->slots[i].alias[0] != '\0' && strcmp(cfg->slots[i].alias, norm) == 0)
            return &cfg->slots[i];
    return NULL;
}

/* ---------------------------------------------------------------- value parsing */

duet_status_t duet_config_parse_size(const char *s, uint64_t *bytes_p)
{
    static const struct {
        const char *unit;
        uint64_t mult;
    } units[] = {
        {"", 1},
        {"b", 1},
        {"k", 1ull << 10},
        {"ki", 1ull << 10},
        {"kib", 1ull << 10},
        {"kb", 1000ull},
        {"m", 1ull << 20},
        {"mi", 1ull << 20},
        {"mib", 1ull << 20},
        {"mb", 1000000ull},
        {"g", 1ull << 30},
        {"gi", 1ull << 30},
        {"gib", 1ull << 30},
        {"gb", 1000000000ull},
        {"t", 1ull << 40},
        {"ti", 1ull << 40},
        {"tib", 1ull << 40},
        {"tb", 1000000000000ull},
    };
    const char *p = s;
    uint64_t ip = 0;
    uint64_t fnum = 0, fden = 1;

    if (s == NULL || !isdigit((unsigned char)*p))
        return DUET_ERR_INVALID;
    for (; isdigit((unsigned char)*p); p++) {
        uint64_t d = (uint64_t)(*p - '0');
        if (ip > (UINT64_MAX - d) / 10)
            return DUET_ERR_INVALID;
        ip = ip * 10 + d;
    }
    if (*p == '.') {
        p++;
        if (!isdigit((unsigned char)*p))
            return DUET_ERR_INVALID;
        for (int nd = 0; isdigit((unsigned char)*p); p++, nd++) {
            if (nd >= 18)
                return DUET_ERR_INVALID;
            fnum = fnum * 10 + (uint64_t)(*p - '0');
            fden *= 10;
        }
    }
    while (*p == ' ')
        p++;
    for (size_t u = 0; u < sizeof(units) / sizeof(units[0]); u++) {
        if (strcasecmp(p, units[u].unit) != 0)
            continue;
        unsigned __int128 whole = (unsigned __int128)ip * units[u].mult;
        unsigned __int128 frac = (unsigned __int128)fnum * units[u].mult;
        if (frac % fden != 0)
            return DUET_ERR_INVALID; /* a fraction of a byte */
        whole += frac / fden;
        if (whole > UINT64_MAX)
            return DUET_ERR_INVALID;
        *bytes_p = (uint64_t)whole;
        return DUET_OK;
    }
    return DUET_ERR_INVALID;
}

/* Render a byte count the way a person writes it: "4GiB" when exact, else the plain number. */
static void config_format_size(uint64_t z, char *buf, size_t cap)
{
    static const char *const names[] = {"TiB", "GiB", "MiB", "KiB"};
    static const int shifts[] = {40, 30, 20, 10};
    for (int i = 0; i < 4; i++) {
        uint64_t unit = 1ull << shifts[i];
        if (z != 0 && z % unit == 0) {
            snprintf(buf, cap, "%" PRIu64 "%s", z / unit, names[i]);
            return;
        }
    }
    snprintf(buf, cap, "%" PRIu64, z);
}

static bool config_parse_bool(const char *s, bool *b_p)
{
    static const char *const yes[] = {"true", "yes", "on", "1"};
    static const char *const no[] = {"false", "no", "off", "0"};
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *b_p = true;
            return true;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *b_p = false;
            return true;
        }
    }
    return false;
}

/* A whole decimal integer (optional sign, no spaces): DUET_ERR_INVALID on other text,
 * DUET_ERR_RANGE when it does not fit in 64 bits. */
static duet_status_t config_parse_ll(const char *text, int64_t *x_p)
{
    if (!(isdigit((unsigned char)text[0]) ||
          ((text[0] == '-' || text[0] == '+') && isdigit((unsigned char)text[1]))))
        return DUET_ERR_INVALID;
    char *end;
    errno = 0;
    const long long x = strtoll(text, &end, 10);
    if (*end != '\0')
        return DUET_ERR_INVALID;
    if (errno == ERANGE)
        return DUET_ERR_RANGE;
    *x_p = x;
    return DUET_OK;
}

/* A whole number strtod reads (no leading space): DUET_ERR_INVALID on other text,
 * DUET_ERR_RANGE when it is not finite or overflows. */
static duet_status_t config_parse_double(const char *text, double *x_p)
{
    if (text[0] == '\0' || isspace((unsigned char)text[0]))
        return DUET_ERR_INVALID;
    char *end;
    errno = 0;
    const double x = strtod(text, &end);
    if (*end != '\0')
        return DUET_ERR_INVALID;
    if (!isfinite(x) || errno == ERANGE)
        return DUET_ERR_RANGE;
    *x_p = x;
    return DUET_OK;
}

duet_status_t duet_config_parse_int(const char *s, int64_t min, int64_t max, int64_t *out)
{
    int64_t x = 0;
    const duet_status_t st = config_parse_ll(s, &x);
    if (st != DUET_OK)
        return st;
    if (x < min || x > max)
        return DUET_ERR_RANGE;
    *out = x;
    return DUET_OK;
}

duet_status_t duet_config_parse_float(const char *s, double min, double max, double *out)
{
    double x = 0.0;
    const duet_status_t st = config_parse_double(s, &x);
    if (st != DUET_OK)
        return st;
    if (!(x >= min && x <= max))
        return DUET_ERR_RANGE;
    *out = x;
    return DUET_OK;
}

/*
 * Parse `text` as key k's type into *v (strings strdup'ed). On failure returns the status and
 * writes a reason (without key or origin) into why.
 */
static duet_status_t config_parse_value(const duet_config_key_t *k, const char *text,
                                        config_value_t *v, char *why, size_t why_cap)
{
    memset(v, 0, sizeof(*v));
    switch (k->type) {
    case DUET_CONFIG_INT: {
        const duet_status_t st = config_parse_ll(text, &v->i);
        if (st == DUET_ERR_RANGE)
            snprintf(why, why_cap, "\"%s\" does not fit in 64 bits", text);
        if (st != DUET_ERR_INVALID)
            return st;
        goto bad_type;
    }
    case DUET_CONFIG_FLOAT: {
        const duet_status_t st = config_parse_double(text, &v->f);
        if (st == DUET_ERR_RANGE)
            snprintf(why, why_cap, "\"%s\" is not a finite number", text);
        if (st != DUET_ERR_INVALID)
            return st;
        goto bad_type;
    }
    case DUET_CONFIG_BOOL:
        if (!config_parse_bool(text, &v->b))
            goto bad_type;
        return DUET_OK;
    case DUET_CONFIG_STRING:
        v->s = strdup(text);
        if (v->s == NULL) {
            snprintf(why, why_cap, "out of memory");
            return DUET_ERR_NOMEM;
        }
        return DUET_OK;
    case DUET_CONFIG_ENUM: {
        for (int i = 0; k->choices != NULL && k->choices[i] != NULL; i++) {
            if (strcmp(text, k->choices[i]) == 0) {
                v->e = i;
                return DUET_OK;
            }
        }
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        for (int i = 0; k->choices != NULL && k->choices[i] != NULL; i++)
            duet_strbuf_printf(&sb, "%s%s", i > 0 ? ", " : "", k->choices[i]);
        snprintf(why, why_cap, "\"%s\" is not one of: %s", text, sb.data != NULL ? sb.data : "");
        duet_strbuf_free(&sb);
        return DUET_ERR_INVALID;
    }
    case DUET_CONFIG_SIZE:
        if (duet_config_parse_size(text, &v->z) != DUET_OK)
            goto bad_type;
        return DUET_OK;
    }
bad_type:
    snprintf(why, why_cap, "expected %s, got \"%s\"", config_type_name(k->type), text);
    return DUET_ERR_INVALID;
}

static void config_value_text(const duet_config_key_t *k, const config_value_t *v, char *buf,
                              size_t cap)
{
    switch (k->type) {
    case DUET_CONFIG_INT:
        snprintf(buf, cap, "%" PRId64, v->i);
        return;
    case DUET_CONFIG_FLOAT:
        snprintf(buf, cap, "%g", v->f);
        return;
    case DUET_CONFIG_BOOL:
        snprintf(buf, cap, "%s", v->b ? "true" : "false");
        return;
    case DUET_CONFIG_STRING:
        snprintf(buf, cap, "%s", v->s != NULL ? v->s : "(unset)");
        return;
    case DUET_CONFIG_ENUM:
        snprintf(buf, cap, "%s", v->e >= 0 ? k->choices[v->e] : "(unset)");
        return;
    case DUET_CONFIG_SIZE:
        config_format_size(v->z, buf, cap);
        return;
    }
}

/* -1, 0, 1 comparing two numeric values of the key's type. */
static int config_compare(duet_config_type_t t, const config_value_t *a, const config_value_t *b)
{
    switch (t) {
    case DUET_CONFIG_INT:
        return a->i < b->i ? -1 : a->i > b->i;
    case DUET_CONFIG_FLOAT:
        return a->f < b->f ? -1 : a->f > b->f;
    case DUET_CONFIG_SIZE:
        return a->z < b->z ? -1 : a->z > b->z;
    default:
        return 0;
    }
}

/*
 * The one way a value enters the configuration: parse, range-check, then apply if `src` is at
 * least as strong as the value's current source. Errors read "<origin>: <key>: <reason>".
 */
static duet_status_t config_assign(config_slot_t *sl, const char *text, duet_config_source_t src,
                                   const char *origin)
{
    const duet_config_key_t *k = sl->key;
    config_value_t v;
    char why[512];
    char num[64];

    duet_status_t st = config_parse_value(k, text, &v, why, sizeof(why));
    if (st != DUET_OK)
        return duet_error_set(st, "%s: %s: %s", origin, k->name, why);
    if (sl->has_min && config_compare(k->type, &v, &sl->min) < 0) {
        config_value_text(k, &sl->min, num, sizeof(num));
        return duet_error_set(DUET_ERR_RANGE, "%s: %s: %s is below the minimum %s", origin, k->name,
                              text, num);
    }
    if (sl->has_max && config_compare(k->type, &v, &sl->max) > 0) {
        config_value_text(k, &sl->max, num, sizeof(num));
        return duet_error_set(DUET_ERR_RANGE, "%s: %s: %s is above the maximum %s", origin, k->name,
                              text, num);
    }
    if (src < sl->src) {
        free(v.s);
        return DUET_OK;
    }
    free(sl->val.s);
    sl->val = v;
    sl->src = src;
    snprintf(sl->origin, sizeof(sl->origin), "%s", origin);
    return DUET_OK;
}

/* ---------------------------------------------------------------- create / destroy */

static bool config_is_builtin_flag(const char *norm)
{
    return strcmp(norm, "help") == 0 || strcmp(norm, "config") == 0 || strcmp(norm, "version") == 0;
}

duet_status_t duet_config_create(const duet_config_key_t *keys, size_t n_keys,
                                 duet_config_t **cfg_p)
{
    char why[512];
    duet_config_t *cfg = calloc(1, sizeof(*cfg));
    if (cfg == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "config: out of memory");
    cfg->slots = calloc(n_keys > 0 ? n_keys : 1, sizeof(*cfg->slots));
    if (cfg->slots == NULL) {
        free(cfg);
        return duet_error_set(DUET_ERR_NOMEM, "config: out of memory");
    }
    cfg->n_slots = n_keys;

    for (size_t i = 0; i < n_keys; i++) {
        const duet_config_key_t *k = &keys[i];
        config_slot_t *sl = &cfg->slots[i];
        sl->key = k;
        sl->val.e = k->type == DUET_CONFIG_ENUM ? -1 : 0;
        DUET_ASSERT(config_name_valid(k->name));
        DUET_ASSERT(!config_is_builtin_flag(k->name) && strncmp(k->name, "no_", 3) != 0);
        DUET_ASSERT(k->type >= DUET_CONFIG_INT && k->type <= DUET_CONFIG_SIZE);
        DUET_ASSERT(k->type != DUET_CONFIG_ENUM || (k->choices != NULL && k->choices[0] != NULL));
        for (size_t j = 0; j < i; j++)
            DUET_ASSERT(strcmp(keys[j].name, k->name) != 0);

        /* DUET_ + upper-cased name with '.' -> '_'; must not collide with another key's. */
        size_t n = (size_t)snprintf(sl->env, sizeof(sl->env), "DUET_%s", k->name);
        for (size_t c = 5; c < n; c++)
            sl->env[c] = sl->env[c] == '.' ? '_' : (char)toupper((unsigned char)sl->env[c]);
        for (size_t j = 0; j < i; j++)
            DUET_ASSERT(strcmp(cfg->slots[j].env, sl->env) != 0);

        if (k->alias != NULL) {
            DUET_ASSERT(config_normalise(k->alias, strlen(k->alias), sl->alias, sizeof(sl->alias)));
            DUET_ASSERT(config_name_valid(sl->alias) && !config_is_builtin_flag(sl->alias));
        }

        if (k->def != NULL) {
            DUET_ASSERT(config_parse_value(k, k->def, &sl->val, why, sizeof(why)) == DUET_OK);
            sl->src = DUET_CONFIG_SRC_DEFAULT;
            snprintf(sl->origin, sizeof(sl->origin), "default");
        }
        if (k->min != NULL) {
            DUET_ASSERT(k->type == DUET_CONFIG_INT || k->type == DUET_CONFIG_FLOAT ||
                        k->type == DUET_CONFIG_SIZE);
            DUET_ASSERT(config_parse_value(k, k->min, &sl->min, why, sizeof(why)) == DUET_OK);
            sl->has_min = true;
        }
        if (k->max != NULL) {
            DUET_ASSERT(k->type == DUET_CONFIG_INT || k->type == DUET_CONFIG_FLOAT ||
                        k->type == DUET_CONFIG_SIZE);
            DUET_ASSERT(config_parse_value(k, k->max, &sl->max, why, sizeof(why)) == DUET_OK);
            sl->has_max = true;
        }
        if (sl->has_min && sl->has_max)
            DUET_ASSERT(config_compare(k->type, &sl->min, &sl->max) <= 0);
        if (k->def != NULL && sl->has_min)
            DUET_ASSERT(config_compare(k->type, &sl->val, &sl->min) >= 0);
        if (k->def != NULL && sl->has_max)
            DUET_ASSERT(config_compare(k->type, &sl->val, &sl->max) <= 0);
    }
    /* Aliases must not shadow a key or another alias. */
    for (size_t i = 0; i < n_keys; i++) {
        if (cfg->slots[i].alias[0] == '\0')
            continue;
        for (size_t j = 0; j < n_keys; j++) {
            DUET_ASSERT(strcmp(cfg->slots[i].alias, keys[j].name) != 0);
            DUET_ASSERT(j == i || strcmp(cfg->slots[i].alias, cfg->slots[j].alias) != 0);
        }
    }
    *cfg_p = cfg;
    return DUET_OK;
}

void duet_config_destroy(duet_config_t *cfg)
{
    if (cfg == NULL)
        return;
    for (size_t i = 0; i < cfg->n_slots; i++)
        free(cfg->slots[i].val.s);
    free(cfg->slots);
    free(cfg->config_file);
    free(cfg);
}

/* ---------------------------------------------------------------- YAML */

typedef struct {
    duet_config_t *cfg;
    bool *seen; /* n_slots flags: key already given in this file */
} config_yaml_t;

/* Whether some declared key starts with "<prefix>.". */
static bool config_is_prefix(const duet_config_t *cfg, const char *prefix)
{
    size_t n = strlen(prefix);
    for (size_t i = 0; i < cfg->n_slots; i++) {
        const char *name = cfg->slots[i].key->name;
        if (strncmp(name, prefix, n) == 0 && name[n] == '.')
            return true;
    }
    return false;
}

static duet_status_t config_yaml_mapping(duet_yaml_walk_t *w, config_yaml_t *c, yaml_node_t *map,
                                         const char *prefix, int depth)
{
    char origin[CONFIG_ORIGIN_MAX];
    char full[CONFIG_NAME_MAX * 2];

    duet_status_t st = duet_yaml_depth(w, map, "", depth);
    if (st != DUET_OK)
        return st;
    for (yaml_node_pair_t *pair = map->data.mapping.pairs.start; pair < map->data.mapping.pairs.top;
         pair++) {
        yaml_node_t *kn, *vn;
        if ((st = duet_yaml_pair(w, pair, "", &kn, &vn)) != DUET_OK)
            return st;
        snprintf(origin, sizeof(origin), "%s:%zu", w->name, duet_yaml_line(kn));
        const char *key = (const char *)kn->data.scalar.value;
        if (!duet_yaml_nul_free(kn) || key[0] == '\0')
            return duet_error_set(DUET_ERR_FORMAT, "%s: empty or malformed key", origin);
        int n = snprintf(full, sizeof(full), "%s%s%s", prefix, prefix[0] != '\0' ? "." : "", key);
        if (n < 0 || (size_t)n >= CONFIG_NAME_MAX)
            return duet_error_set(DUET_ERR_NOT_FOUND, "%s: unknown key \"%.60s...\"", origin, full);

        config_slot_t *sl = config_find(c->cfg, full);
        if (vn->type == YAML_MAPPING_NODE && sl == NULL && duet_yaml_mapping_empty(vn) &&
            !config_is_prefix(c->cfg, full))
            return config_unknown(c->cfg, origin, "section", full); /* "bogus: {}" */
        if (vn->type == YAML_MAPPING_NODE && sl == NULL) {
            if ((st = config_yaml_mapping(w, c, vn, full, depth + 1)) != DUET_OK)
                return st;
            continue;
        }
        if (sl == NULL)
            return config_unknown(c->cfg, origin, "key", full);
        const char *text;
        if ((st = duet_yaml_scalar(w, vn, duet_yaml_line(kn), full, "a single value", &text)) !=
            DUET_OK)
            return st;
        size_t idx = (size_t)(sl - c->cfg->slots);
        if (c->seen[idx])
            return duet_error_set(DUET_ERR_FORMAT, "%s: %s: given twice in this file", origin,
                                  full);
        c->seen[idx] = true;
        snprintf(origin, sizeof(origin), "%s:%zu", w->name, duet_yaml_line(vn));
        if ((st = config_assign(sl, text, DUET_CONFIG_SRC_YAML, origin)) != DUET_OK)
            return st;
    }
    return DUET_OK;
}

static duet_status_t config_yaml_root(duet_yaml_walk_t *w, yaml_node_t *root, void *user)
{
    return root != NULL ? config_yaml_mapping(w, user, root, "", 0) : DUET_OK;
}

duet_status_t duet_config_load_yaml_string(duet_config_t *cfg, const char *text, size_t len,
                                           const char *name)
{
    config_yaml_t c = {.cfg = cfg};
    c.seen = calloc(cfg->n_slots > 0 ? cfg->n_slots : 1, sizeof(*c.seen));
    if (c.seen == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", name);
    duet_yaml_walk_t w = {.name = name, .words = DUET_YAML_WORDS_YAML};
    duet_status_t st = duet_yaml_load(&w, text, len, CONFIG_YAML_MAX_BYTES, config_yaml_root, &c);
    free(c.seen);
    return st;
}

duet_status_t duet_config_load_yaml_file(duet_config_t *cfg, const char *path)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_status_t st = duet_strbuf_read_file(&sb, path, CONFIG_YAML_MAX_BYTES);
    if (st == DUET_OK)
        st = duet_config_load_yaml_string(cfg, sb.data != NULL ? sb.data : "", sb.len, path);
    duet_strbuf_free(&sb);
    return st;
}

/* ---------------------------------------------------------------- environment */

duet_status_t duet_config_load_env(duet_config_t *cfg, char *const *envp, size_t *n_unknown_p)
{
    char name[CONFIG_NAME_MAX + 8];
    char origin[CONFIG_ORIGIN_MAX];
    size_t n_unknown = 0;

    if (envp == NULL)
        envp = environ;
    for (size_t i = 0; envp != NULL && envp[i] != NULL; i++) {
        const char *e = envp[i];
        if (strncmp(e, "DUET_", 5) != 0)
            continue;
        const char *eq = strchr(e, '=');
        if (eq == NULL)
            continue;
        size_t n = (size_t)(eq - e);
        if (n >= sizeof(name)) {
            DUET_LOG_WARN("ignoring unknown environment variable %.40s...", e);
            n_unknown++;
            continue;
        }
        memcpy(name, e, n);
        name[n] = '\0';

        config_slot_t *sl = NULL;
        for (size_t j = 0; j < cfg->n_slots && sl == NULL; j++)
            if (strcmp(cfg->slots[j].env, name) == 0)
                sl = &cfg->slots[j];
        if (sl != NULL) {
            snprintf(origin, sizeof(origin), "environment variable %s", name);
            duet_status_t st = config_assign(sl, eq + 1, DUET_CONFIG_SRC_ENV, origin);
            if (st != DUET_OK)
                return st;
            continue;
        }
        bool allowed = false;
        for (size_t j = 0; config_env_allowlist[j] != NULL; j++) {
            const char *a = config_env_allowlist[j];
            const size_t len = strlen(a);
            allowed = allowed ||
                      (a[len - 1] == '*' ? strncmp(a, name, len - 1) == 0 : strcmp(a, name) == 0);
        }
        if (!allowed) {
            DUET_LOG_WARN("ignoring unknown environment variable %s (no such config key)", name);
            n_unknown++;
        }
    }
    if (n_unknown_p != NULL)
        *n_unknown_p = n_unknown;
    return DUET_OK;
}

/* ---------------------------------------------------------------- command line */

duet_status_t duet_config_parse_args(duet_config_t *cfg, int argc, char **argv, int *n_pos_p)
{
    duet_status_t st = DUET_OK;
    int n_pos = 0;
    int n_flag = 0;
    bool dashdash = false;
    char norm[CONFIG_NAME_MAX];
    char origin[CONFIG_ORIGIN_MAX];

    char **pos = calloc(argc > 0 ? (size_t)argc : 1, sizeof(*pos));
    char **flags = calloc(argc > 0 ? (size_t)argc : 1, sizeof(*flags));
    if (pos == NULL || flags == NULL) {
        st = duet_error_set(DUET_ERR_NOMEM, "command line: out of memory");
        goto free_arrays;
    }
    for (int i = 1; i < argc; i++) {
        char *a = argv[i];
        if (dashdash || a[0] != '-' || strcmp(a, "-") == 0) {
            pos[n_pos++] = a;
            continue;
        }
        flags[n_flag++] = a;
        if (strcmp(a, "--") == 0) {
            dashdash = true;
            continue;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            cfg->help = true;
            continue;
        }
        if (strcmp(a, "--version") == 0) {
            cfg->version = true;
            continue;
        }
        if (strcmp(a, "-c") == 0 || strcmp(a, "--config") == 0 || strncmp(a, "--config=", 9) == 0) {
            const char *file = a[1] == 'c' ? NULL : (a[8] == '=' ? a + 9 : NULL);
            if (file == NULL) {
                if (i + 1 >= argc) {
                    st = duet_error_set(DUET_ERR_INVALID, "flag %s: missing file name", a);
                    goto free_arrays;
                }
                file = argv[++i];
                flags[n_flag++] = argv[i];
            }
            free(cfg->config_file);
            cfg->config_file = strdup(file);
            if (cfg->config_file == NULL) {
                st = duet_error_set(DUET_ERR_NOMEM, "command line: out of memory");
                goto free_arrays;
            }
            continue;
        }
        if (a[1] != '-') {
            st = duet_error_set(DUET_ERR_NOT_FOUND, "unknown flag \"%s\" (flags are --name)", a);
            goto free_arrays;
        }
        const char *body = a + 2;
        const char *eq = strchr(body, '=');
        size_t n = eq != NULL ? (size_t)(eq - body) : strlen(body);
        const char *value = eq != NULL ? eq + 1 : NULL;
        if (!config_normalise(body, n, norm, sizeof(norm))) {
            st = duet_error_set(DUET_ERR_NOT_FOUND, "unknown flag \"%.60s...\"", a);
            goto free_arrays;
        }
        snprintf(origin, sizeof(origin), "flag --%.*s", (int)n, body);

        config_slot_t *sl = config_find_flag(cfg, norm);
        if (sl == NULL && strncmp(norm, "no_", 3) == 0) {
            config_slot_t *neg = config_find_flag(cfg, norm + 3);
            if (neg != NULL && neg->key->type == DUET_CONFIG_BOOL) {
                if (value != NULL) {
                    st = duet_error_set(DUET_ERR_INVALID, "%s: takes no value", origin);
                    goto free_arrays;
                }
                st = config_assign(neg, "false", DUET_CONFIG_SRC_CLI, origin);
                if (st != DUET_OK)
                    goto free_arrays;
                continue;
            }
        }
        if (sl == NULL) {
            const char *sugg = config_suggest(cfg, norm);
            if (sugg != NULL) {
                config_flag_name(sugg, norm, sizeof(norm));
                st = duet_error_set(DUET_ERR_NOT_FOUND,
                                    "command line: unknown flag \"%.*s\" (did you mean --%s?)",
                                    (int)(n + 2), a, norm);
            } else
                st = duet_error_set(DUET_ERR_NOT_FOUND, "command line: unknown flag \"%.*s\"",
                                    (int)(n + 2), a);
            goto free_arrays;
        }
        if (value == NULL) {
            if (sl->key->type == DUET_CONFIG_BOOL) {
                value = "true";
            } else if (i + 1 < argc) {
                value = argv[++i];
                flags[n_flag++] = argv[i];
            } else {
                st = duet_error_set(DUET_ERR_INVALID, "%s: missing value (%s)", origin,
                                    config_type_name(sl->key->type));
                goto free_arrays;
            }
        }
        st = config_assign(sl, value, DUET_CONFIG_SRC_CLI, origin);
        if (st != DUET_OK)
            goto free_arrays;
    }
    /* Positionals first, in order, then the flags: argv stays a permutation of itself. */
    for (int i = 0; i < n_pos; i++)
        argv[1 + i] = pos[i];
    for (int i = 0; i < n_flag; i++)
        argv[1 + n_pos + i] = flags[i];
    *n_pos_p = n_pos;
free_arrays:
    free(flags);
    free(pos);
    return st;
}

duet_status_t duet_config_load_all(duet_config_t *cfg, int argc, char **argv, int *n_pos_p)
{
    duet_status_t st = duet_config_parse_args(cfg, argc, argv, n_pos_p);
    if (st != DUET_OK || cfg->help || cfg->version)
        return st;
    if (cfg->config_file != NULL) {
        st = duet_config_load_yaml_file(cfg, cfg->config_file);
        if (st != DUET_OK)
            return st;
    }
    st = duet_config_load_env(cfg, NULL, NULL);
    if (st != DUET_OK)
        return st;
    return duet_config_check_required(cfg);
}

duet_status_t duet_config_set(duet_config_t *cfg, const char *name, const char *value)
{
    config_slot_t *sl = config_find(cfg, name);
    if (sl == NULL)
        return config_unknown(cfg, "set", "key", name);
    return config_assign(sl, value, DUET_CONFIG_SRC_OVERRIDE, "set by the program");
}

duet_status_t duet_config_check_required(const duet_config_t *cfg)
{
    for (size_t i = 0; i < cfg->n_slots; i++) {
        const config_slot_t *sl = &cfg->slots[i];
        if (sl->key->required && sl->src == DUET_CONFIG_SRC_UNSET)
            return duet_error_set(DUET_ERR_NOT_FOUND,
                                  "%s is required: set it in the config file, with %s or with "
                                  "--%s",
                                  sl->key->name, sl->env, sl->key->name);
    }
    return DUET_OK;
}

const char *duet_config_file(const duet_config_t *cfg)
{
    return cfg->config_file;
}

bool duet_config_help_requested(const duet_config_t *cfg)
{
    return cfg->help;
}

bool duet_config_version_requested(const duet_config_t *cfg)
{
    return cfg->version;
}

/* ---------------------------------------------------------------- help and dump */

/* Pad the current line (which started at line_start) to the help column, or break the line. */
static void config_help_pad(duet_strbuf_t *sb, size_t line_start)
{
    size_t used = sb->len - line_start;
    if (used + 2 > CONFIG_HELP_COLUMN) {
        duet_strbuf_puts(sb, "\n");
        used = 0;
    }
    duet_strbuf_printf(sb, "%*s", (int)(CONFIG_HELP_COLUMN - used), "");
}

duet_status_t duet_config_help(const duet_config_t *cfg, const char *usage, char **text_p)
{
    duet_strbuf_t sb;
    char flag[CONFIG_NAME_MAX];
    char num[64];
    size_t start;

    duet_strbuf_init(&sb);
    duet_strbuf_printf(&sb, "usage: %s\n\noptions:\n", usage != NULL ? usage : "[options]");
    start = sb.len;
    duet_strbuf_puts(&sb, "  -h, --help");
    config_help_pad(&sb, start);
    duet_strbuf_puts(&sb, "show this help and exit\n");
    start = sb.len;
    duet_strbuf_puts(&sb, "  --version");
    config_help_pad(&sb, start);
    duet_strbuf_puts(&sb, "show the version, git commit and CUDA build, and exit\n");
    start = sb.len;
    duet_strbuf_puts(&sb, "  -c, --config FILE");
    config_help_pad(&sb, start);
    duet_strbuf_puts(&sb,
                     "YAML file with any of the keys below (nested mappings: a.b -> a: {b: })\n");

    for (size_t i = 0; i < cfg->n_slots; i++) {
        const config_slot_t *sl = &cfg->slots[i];
        const duet_config_key_t *k = sl->key;
        const char *mv = config_metavar(k->type);
        start = sb.len;
        config_flag_name(k->name, flag, sizeof(flag));
        duet_strbuf_printf(&sb, "  --%s", flag);
        if (k->alias != NULL) {
            config_flag_name(sl->alias, flag, sizeof(flag));
            duet_strbuf_printf(&sb, ", --%s", flag);
        }
        if (mv[0] != '\0') {
            duet_strbuf_printf(&sb, " %s", mv);
        } else {
            config_flag_name(k->name, flag, sizeof(flag));
            duet_strbuf_printf(&sb, ", --no-%s", flag);
        }
        config_help_pad(&sb, start);
        duet_strbuf_printf(&sb, "%s\n", k->help != NULL ? k->help : "");

        /* Second line: default, range or choices, environment variable. */
        duet_strbuf_printf(&sb, "%*s", CONFIG_HELP_COLUMN, "");
        if (k->required)
            duet_strbuf_puts(&sb, "required; ");
        else if (k->def != NULL)
            duet_strbuf_printf(&sb, "default: %s; ", k->def[0] != '\0' ? k->def : "\"\"");
        if (sl->has_min || sl->has_max) {
            duet_strbuf_puts(&sb, "range: ");
            if (sl->has_min) {
                config_value_text(k, &sl->min, num, sizeof(num));
                duet_strbuf_puts(&sb, num);
            }
            duet_strbuf_puts(&sb, "..");
            if (sl->has_max) {
                config_value_text(k, &sl->max, num, sizeof(num));
                duet_strbuf_puts(&sb, num);
            }
            duet_strbuf_puts(&sb, "; ");
        }
        if (k->type == DUET_CONFIG_ENUM) {
            duet_strbuf_puts(&sb, "one of: ");
            for (int c = 0; k->choices[c] != NULL; c++)
                duet_strbuf_printf(&sb, "%s%s", c > 0 ? "|" : "", k->choices[c]);
            duet_strbuf_puts(&sb, "; ");
        }
        duet_strbuf_printf(&sb, "env %s\n", sl->env);
    }
    if (duet_strbuf_status(&sb) != DUET_OK) {
        duet_strbuf_free(&sb);
        return duet_error_set(DUET_ERR_NOMEM, "config: out of memory building help");
    }
    *text_p = duet_strbuf_detach(&sb);
    return *text_p != NULL ? DUET_OK : duet_error_set(DUET_ERR_NOMEM, "config: out of memory");
}

duet_status_t duet_config_dump(const duet_config_t *cfg, char **text_p)
{
    duet_strbuf_t sb;
    char val[512];
    size_t width = 0;

    for (size_t i = 0; i < cfg->n_slots; i++) {
        size_t n = strlen(cfg->slots[i].key->name);
        width = n > width ? n : width;
    }
    duet_strbuf_init(&sb);
    for (size_t i = 0; i < cfg->n_slots; i++) {
        const config_slot_t *sl = &cfg->slots[i];
        if (sl->src == DUET_CONFIG_SRC_UNSET) {
            duet_strbuf_printf(&sb, "%-*s   (unset)\n", (int)width, sl->key->name);
            continue;
        }
        if (sl->key->secret)
            snprintf(val, sizeof(val), "<redacted>");
        else
            config_value_text(sl->key, &sl->val, val, sizeof(val));
        duet_strbuf_printf(&sb, "%-*s = %s  (%s)\n", (int)width, sl->key->name, val, sl->origin);
    }
    if (duet_strbuf_status(&sb) != DUET_OK) {
        duet_strbuf_free(&sb);
        return duet_error_set(DUET_ERR_NOMEM, "config: out of memory building dump");
    }
    *text_p = duet_strbuf_detach(&sb);
    return *text_p != NULL ? DUET_OK : duet_error_set(DUET_ERR_NOMEM, "config: out of memory");
}

void duet_config_log(const duet_config_t *cfg)
{
    char *text = NULL;
    if (duet_config_dump(cfg, &text) != DUET_OK)
        return;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save))
        DUET_LOG_INFO("config: %s", line);
    free(text);
}

/* ---------------------------------------------------------------- getters */

static const config_slot_t *config_get_slot(const duet_config_t *cfg, const char *name,
                                            duet_config_type_t type)
{
    const config_slot_t *sl = config_find(cfg, name);
    if (sl == NULL || sl->key->type != type) {
        DUET_LOG_ERROR("config: getter for %s key \"%s\": %s", config_metavar(type), name,
                       sl == NULL ? "not declared" : "declared with another type");
        DUET_ASSERT(sl != NULL && sl->key->type == type);
    }
    return sl;
}

int64_t duet_config_get_int(const duet_config_t *cfg, const char *name)
{
    return config_get_slot(cfg, name, DUET_CONFIG_INT)->val.i;
}

double duet_config_get_float(const duet_config_t *cfg, const char *name)
{
    return config_get_slot(cfg, name, DUET_CONFIG_FLOAT)->val.f;
}

bool duet_config_get_bool(const duet_config_t *cfg, const char *name)
{
    return config_get_slot(cfg, name, DUET_CONFIG_BOOL)->val.b;
}

const char *duet_config_get_string(const duet_config_t *cfg, const char *name)
{
    return config_get_slot(cfg, name, DUET_CONFIG_STRING)->val.s;
}

uint64_t duet_config_get_size(const duet_config_t *cfg, const char *name)
{
    return config_get_slot(cfg, name, DUET_CONFIG_SIZE)->val.z;
}

const char *duet_config_get_enum(const duet_config_t *cfg, const char *name)
{
    const config_slot_t *sl = config_get_slot(cfg, name, DUET_CONFIG_ENUM);
    return sl->val.e >= 0 ? sl->key->choices[sl->val.e] : NULL;
}

int duet_config_get_enum_index(const duet_config_t *cfg, const char *name)
{
    return config_get_slot(cfg, name, DUET_CONFIG_ENUM)->val.e;
}

duet_config_source_t duet_config_source(const duet_config_t *cfg, const char *name)
{
    const config_slot_t *sl = config_find(cfg, name);
    DUET_ASSERT(sl != NULL);
    return sl->src;
}

const char *duet_config_origin(const duet_config_t *cfg, const char *name)
{
    const config_slot_t *sl = config_find(cfg, name);
    DUET_ASSERT(sl != NULL);
    return sl->src == DUET_CONFIG_SRC_UNSET ? "unset" : sl->origin;
}
