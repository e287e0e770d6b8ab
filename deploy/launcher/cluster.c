/*
 * The cluster file of `duet up`: libyaml's document loader, then one strict walk; see cluster.h
 * for the format and the contract.
 *
 * The walk goes through common/yaml.h, as common/config.c's does: bounded against alias cycles
 * and bombs, every message starting with name:line of the node at fault, so an operator sees the
 * same shape of error whichever file is wrong.
 */
#define _GNU_SOURCE
#include "deploy/launcher/cluster.h"

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/strbuf.h"
#include "common/yaml.h"

#define CL_MAX_BYTES ((size_t)1 << 20)
#define CL_KEY_MAX   128
#define CL_MAX_FLAGS 1024 /* per role; also keeps the duplicate check's quadratic scan small */

#define CL_DEFAULT_PROMPT "The LORD said unto Moses,"

/* One flattened flag while the walk runs; becomes "--key=value" (or "--key" when bare). */
typedef struct {
    char *key;   /* dotted, owned */
    char *value; /* owned; NULL = bare flag (a plain `true`) */
    size_t line;
} cl_flag_t;

typedef struct {
    cl_flag_t *v; /* (n) owned */
    size_t n, cap;
} cl_flags_t;

typedef struct {
    duet_yaml_walk_t y; /* first: the walk common/yaml.h hands back; y.name for messages */
    const char *root;   /* for relative paths, may be NULL */
} cl_walk_t;

/* ---------------------------------------------------------------- small helpers */

/*
 * A key is a plain flag name: [A-Za-z0-9_-] segments joined by single dots ("http.port" may be
 * written nested or dotted, as in the binaries' own YAML), not starting with '-'.
 */
static bool cl_key_ok(const yaml_node_t *kn)
{
    const char *k = (const char *)kn->data.scalar.value;
    size_t len = kn->data.scalar.length;
    if (len == 0 || !duet_yaml_nul_free(kn) || k[0] == '-' || k[0] == '.' || k[len - 1] == '.')
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = k[i];
        if (c == '.' && k[i + 1] == '.')
            return false;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-' || c == '.'))
            return false;
    }
    return true;
}

/* Compare dotted names with '-' and '_' as the same character (the flag spellings are). */
static bool cl_key_eq(const char *a, const char *b)
{
    for (; *a != '\0' && *b != '\0'; a++, b++) {
        char x = *a == '-' ? '_' : *a, y = *b == '-' ? '_' : *b;
        if (x != y)
            return false;
    }
    return *a == *b;
}

static bool cl_key_in(const char *key, const char *const *set)
{
    for (; set != NULL && *set != NULL; set++)
        if (cl_key_eq(key, *set))
            return true;
    return false;
}

/* The next pair's key and value nodes; the key must be a plain name. */
static duet_status_t cl_pair(cl_walk_t *w, const yaml_node_pair_t *pair, const char *section,
                             const char **key_p, yaml_node_t **val_p)
{
    yaml_node_t *kn;
    duet_status_t st = duet_yaml_pair(&w->y, pair, section, &kn, val_p);
    if (st != DUET_OK)
        return st;
    const char *key = (const char *)kn->data.scalar.value;
    if (!cl_key_ok(kn))
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s:%zu: %s%skey \"%.60s\" is not a plain name (letters, digits, "
                              "'_', '-', inner dots)",
                              w->y.name, duet_yaml_line(kn), section,
                              section[0] != '\0' ? ": " : "", key);
    *key_p = key;
    return DUET_OK;
}

/* The text of a scalar that is not null and has no NUL byte. `what` names it in messages. */
static duet_status_t cl_scalar(cl_walk_t *w, const yaml_node_t *n, const char *what,
                               const char *expected, const char **text_p)
{
    return duet_yaml_scalar(&w->y, n, duet_yaml_line(n), what, expected, text_p);
}

static duet_status_t cl_parse_int(cl_walk_t *w, size_t line, const char *what, const char *s,
                                  long lo, long hi, int *out_p)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0)
        return duet_error_set(DUET_ERR_FORMAT, "%s:%zu: %s: expected an integer, got \"%.60s\"",
                              w->y.name, line, what, s);
    if (v < lo || v > hi)
        return duet_error_set(DUET_ERR_RANGE, "%s:%zu: %s: %ld is out of range (%ld..%ld)",
                              w->y.name, line, what, v, lo, hi);
    *out_p = (int)v;
    return DUET_OK;
}

static duet_status_t cl_int(cl_walk_t *w, const yaml_node_t *n, const char *what, long lo, long hi,
                            int *out_p)
{
    const char *s;
    duet_status_t st = cl_scalar(w, n, what, "an integer", &s);
    if (st != DUET_OK)
        return st;
    return cl_parse_int(w, duet_yaml_line(n), what, s, lo, hi, out_p);
}

/* A copy of `p`, joined to root when relative. */
static char *cl_path(const char *root, const char *p)
{
    char *out = NULL;
    if (p[0] == '/' || root == NULL || root[0] == '\0')
        return strdup(p);
    if (asprintf(&out, "%s/%s", root, p) < 0)
        return NULL;
    return out;
}

/* Replace *dst with a copy of the string (or root-joined path) src. */
static duet_status_t cl_set(cl_walk_t *w, char **dst, const char *src, bool path)
{
    char *copy = path ? cl_path(w->root, src) : strdup(src);
    if (copy == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", w->y.name);
    free(*dst);
    *dst = copy;
    return DUET_OK;
}

static duet_status_t cl_string(cl_walk_t *w, const yaml_node_t *n, const char *what, char **dst,
                               bool path)
{
    const char *s;
    duet_status_t st = cl_scalar(w, n, what, "a string", &s);
    if (st != DUET_OK)
        return st;
    return cl_set(w, dst, s, path);
}

/* ---------------------------------------------------------------- flattening */

static void cl_flags_free(cl_flags_t *f)
{
    for (size_t i = 0; i < f->n; i++) {
        free(f->v[i].key);
        free(f->v[i].value);
    }
    free(f->v);
    memset(f, 0, sizeof(*f));
}

static const cl_flag_t *cl_flags_find(const cl_flags_t *f, const char *key)
{
    for (size_t i = 0; i < f->n; i++)
        if (cl_key_eq(f->v[i].key, key))
            return &f->v[i];
    return NULL;
}

static duet_status_t cl_flags_add(cl_walk_t *w, cl_flags_t *f, const char *key, const char *value,
                                  size_t line)
{
    if (f->n == CL_MAX_FLAGS)
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s:%zu: more than %d keys in one section (alias "
                              "bomb?)",
                              w->y.name, line, CL_MAX_FLAGS);
    if (f->n == f->cap) {
        size_t cap = f->cap > 0 ? f->cap * 2 : 8;
        cl_flag_t *v = realloc(f->v, cap * sizeof(*v));
        if (v == NULL)
            return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", w->y.name);
        f->v = v;
        f->cap = cap;
    }
    cl_flag_t *fl = &f->v[f->n];
    fl->key = strdup(key);
    fl->value = value != NULL ? strdup(value) : NULL;
    fl->line = line;
    if (fl->key == NULL || (value != NULL && fl->value == NULL)) {
        free(fl->key);
        free(fl->value);
        return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", w->y.name);
    }
    f->n++;
    return DUET_OK;
}

/* Keys whose values are folders: joined to the root when relative, as `model` is, since the
 * processes run in the launcher's working directory, wherever that is. */
static const char *const cl_path_keys[] = {"spec.draft_model", NULL};

/*
 * Flatten one value at dotted name `key` (shown as section.key in messages) into flags: a
 * mapping recurses, a scalar is one flag, anything else is an error. `reserved` lists keys the
 * launcher sets itself, refused with `why`.
 */
static duet_status_t cl_flatten(cl_walk_t *w, const char *section, const char *key, yaml_node_t *vn,
                                int depth, cl_flags_t *out, const char *const *reserved,
                                const char *why)
{
    duet_status_t st = duet_yaml_depth(&w->y, vn, section, depth);
    if (st != DUET_OK)
        return st;
    if (cl_key_in(key, reserved))
        return duet_error_set(DUET_ERR_INVALID, "%s:%zu: %s.%s: %s", w->y.name, duet_yaml_line(vn),
                              section, key, why);
    if (vn->type == YAML_MAPPING_NODE) {
        if (duet_yaml_mapping_empty(vn))
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s:%zu: %s.%s: empty mapping (give it keys or remove it)",
                                  w->y.name, duet_yaml_line(vn), section, key);
        for (yaml_node_pair_t *p = vn->data.mapping.pairs.start; p < vn->data.mapping.pairs.top;
             p++) {
            const char *sub;
            yaml_node_t *sv;
            if ((st = cl_pair(w, p, section, &sub, &sv)) != DUET_OK)
                return st;
            char full[CL_KEY_MAX];
            int n = snprintf(full, sizeof(full), "%s.%s", key, sub);
            if (n < 0 || (size_t)n >= sizeof(full))
                return duet_error_set(DUET_ERR_FORMAT, "%s:%zu: %s: key \"%.60s...\" is too long",
                                      w->y.name, duet_yaml_line(sv), section, full);
            if ((st = cl_flatten(w, section, full, sv, depth + 1, out, reserved, why)) != DUET_OK)
                return st;
        }
        return DUET_OK;
    }
    char what[CL_KEY_MAX + 32];
    snprintf(what, sizeof(what), "%s.%s", section, key);
    if (vn->type == YAML_SEQUENCE_NODE)
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s:%zu: %s: lists are not supported (flags take one value; write "
                              "a single value or a nested mapping)",
                              w->y.name, duet_yaml_line(vn), what);
    const char *text;
    if ((st = cl_scalar(w, vn, what, "a value or a mapping", &text)) != DUET_OK)
        return st;
    const cl_flag_t *prev = cl_flags_find(out, key);
    if (prev != NULL)
        return duet_error_set(DUET_ERR_FORMAT, "%s:%zu: %s: given twice (first at line %zu)",
                              w->y.name, duet_yaml_line(vn), what, prev->line);
    static const char *const trues[] = {"true", "True", "TRUE", NULL};
    bool bare = duet_yaml_plain_in(vn, trues);
    if (bare || !cl_key_in(key, cl_path_keys))
        return cl_flags_add(w, out, key, bare ? NULL : text, duet_yaml_line(vn));
    char *joined = cl_path(w->root, text);
    if (joined == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", w->y.name);
    st = cl_flags_add(w, out, key, joined, duet_yaml_line(vn));
    free(joined);
    return st;
}

/* Turn the walk's flags into role->args ("--key=value" / "--key"). */
static duet_status_t cl_flags_to_args(cl_walk_t *w, const cl_flags_t *f, duet_cluster_role_t *role)
{
    role->args = calloc(f->n > 0 ? f->n : 1, sizeof(*role->args));
    if (role->args == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", w->y.name);
    for (size_t i = 0; i < f->n; i++) {
        int rc = f->v[i].value != NULL
                     ? asprintf(&role->args[i], "--%s=%s", f->v[i].key, f->v[i].value)
                     : asprintf(&role->args[i], "--%s", f->v[i].key);
        if (rc < 0) {
            role->args[i] = NULL;
            return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", w->y.name);
        }
        role->n_args++;
    }
    return DUET_OK;
}

/* ---------------------------------------------------------------- sections */

static const char *const cl_router_reserved[] = {"model.dir", NULL};
static const char *const cl_worker_reserved[] = {"router", "model", "model.dir", "name", NULL};
static const char *const cl_gen_reserved[] = {"router",   "model",    "model.dir", "name",
                                              "helix.cp", "helix.tp", NULL};

static duet_status_t cl_need_mapping(cl_walk_t *w, const yaml_node_t *n, const char *what)
{
    if (n->type != YAML_MAPPING_NODE)
        return duet_error_set(DUET_ERR_FORMAT, "%s:%zu: %s: expected a mapping, got %s", w->y.name,
                              duet_yaml_line(n), what, duet_yaml_kind(&w->y, n));
    return DUET_OK;
}

/* router.http.port and friends: a flag the launcher must also read itself. */
static duet_status_t cl_router_addr(cl_walk_t *w, const cl_flags_t *f, const char *prefix,
                                    char **host_p, int *port_p)
{
    char key[32];
    snprintf(key, sizeof(key), "%s.host", prefix);
    const cl_flag_t *h = cl_flags_find(f, key);
    if (h != NULL) {
        if (h->value == NULL || h->value[0] == '\0')
            return duet_error_set(DUET_ERR_INVALID, "%s:%zu: router.%s: expected an address",
                                  w->y.name, h->line, key);
        duet_status_t st = cl_set(w, host_p, h->value, false);
        if (st != DUET_OK)
            return st;
    }
    snprintf(key, sizeof(key), "%s.port", prefix);
    const cl_flag_t *p = cl_flags_find(f, key);
    if (p == NULL)
        return DUET_OK;
    char what[48];
    snprintf(what, sizeof(what), "router.%s", key);
    if (p->value == NULL)
        return duet_error_set(DUET_ERR_FORMAT, "%s:%zu: %s: expected an integer", w->y.name,
                              p->line, what);
    duet_status_t st = cl_parse_int(w, p->line, what, p->value, 0, 65535, port_p);
    if (st == DUET_OK && *port_p == 0)
        st = duet_error_set(DUET_ERR_RANGE,
                            "%s:%zu: %s: 0 (an ephemeral port) is not supported by duet up, "
                            "which must know the port to connect; pick one",
                            w->y.name, p->line, what);
    return st;
}

static duet_status_t cl_router(cl_walk_t *w, yaml_node_t *map, duet_cluster_t *spec)
{
    cl_flags_t flags = {0};
    duet_status_t st = cl_need_mapping(w, map, "router");
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start;
         st == DUET_OK && p < map->data.mapping.pairs.top; p++) {
        const char *key;
        yaml_node_t *vn;
        if ((st = cl_pair(w, p, "router", &key, &vn)) != DUET_OK)
            break;
        if (strcmp(key, "binary") == 0)
            st = cl_string(w, vn, "router.binary", &spec->router.binary, true);
        else
            st = cl_flatten(w, "router", key, vn, 1, &flags, cl_router_reserved,
                            "set by duet up from the top-level `model:`; remove it here");
    }
    if (st == DUET_OK)
        st = cl_router_addr(w, &flags, "http", &spec->http_host, &spec->http_port);
    if (st == DUET_OK)
        st = cl_router_addr(w, &flags, "workers", &spec->workers_host, &spec->workers_port);
    if (st == DUET_OK && spec->http_port == spec->workers_port)
        st = duet_error_set(DUET_ERR_INVALID,
                            "%s:%zu: router: http.port and workers.port are both %d", w->y.name,
                            duet_yaml_line(map), spec->http_port);
    if (st == DUET_OK)
        st = cl_flags_to_args(w, &flags, &spec->router);
    cl_flags_free(&flags);
    return st;
}

/* ctx: / gen: {count, args, binary}; gen (group) also takes the Helix shape {cp, tp}. */
static duet_status_t cl_workers(cl_walk_t *w, yaml_node_t *map, const char *section, int min_count,
                                bool group, duet_cluster_role_t *role)
{
    cl_flags_t flags = {0};
    duet_status_t st = cl_need_mapping(w, map, section);
    char what[64];
    size_t shape_line = 0; /* the later of cp / tp, where a too-large product is reported */
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start;
         st == DUET_OK && p < map->data.mapping.pairs.top; p++) {
        const char *key;
        yaml_node_t *vn;
        if ((st = cl_pair(w, p, section, &key, &vn)) != DUET_OK)
            break;
        snprintf(what, sizeof(what), "%s.%s", section, key);
        if (strcmp(key, "count") == 0) {
            st = cl_int(w, vn, what, min_count, DUET_CLUSTER_MAX_WORKERS, &role->count);
        } else if (group && (strcmp(key, "cp") == 0 || strcmp(key, "tp") == 0)) {
            st = cl_int(w, vn, what, 1, DUET_CLUSTER_MAX_RANKS,
                        key[0] == 'c' ? &role->cp : &role->tp);
            shape_line = duet_yaml_line(vn);
        } else if (strcmp(key, "binary") == 0) {
            st = cl_string(w, vn, what, &role->binary, true);
        } else if (strcmp(key, "args") == 0) {
            if ((st = cl_need_mapping(w, vn, what)) != DUET_OK)
                break;
            for (yaml_node_pair_t *q = vn->data.mapping.pairs.start;
                 st == DUET_OK && q < vn->data.mapping.pairs.top; q++) {
                const char *sub;
                yaml_node_t *sv;
                if ((st = cl_pair(w, q, what, &sub, &sv)) == DUET_OK)
                    st = cl_flatten(w, what, sub, sv, 1, &flags,
                                    group ? cl_gen_reserved : cl_worker_reserved,
                                    group ? "set by duet up (--router, --model, --name; "
                                            "--helix.cp / --helix.tp from gen.cp / gen.tp); "
                                            "remove it here"
                                          : "set by duet up (--router, --model, --name); "
                                            "remove it here");
            }
        } else {
            st = duet_error_set(DUET_ERR_NOT_FOUND, "%s:%zu: %s: unknown key \"%s\" (known: %s)",
                                w->y.name, duet_yaml_line(vn), section, key,
                                group ? "count, cp, tp, args, binary" : "count, args, binary");
        }
    }
    if (st == DUET_OK && role->cp * role->tp > DUET_CLUSTER_MAX_RANKS)
        st = duet_error_set(DUET_ERR_RANGE,
                            "%s:%zu: %s: cp %d x tp %d = %d ranks per group is more than %d",
                            w->y.name, shape_line, section, role->cp, role->tp, role->cp * role->tp,
                            DUET_CLUSTER_MAX_RANKS);
    if (st == DUET_OK)
        st = cl_flags_to_args(w, &flags, role);
    cl_flags_free(&flags);
    return st;
}

static duet_status_t cl_sample(cl_walk_t *w, yaml_node_t *map, duet_cluster_t *spec)
{
    duet_status_t st = cl_need_mapping(w, map, "sample");
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start;
         st == DUET_OK && p < map->data.mapping.pairs.top; p++) {
        const char *key;
        yaml_node_t *vn;
        if ((st = cl_pair(w, p, "sample", &key, &vn)) != DUET_OK)
            break;
        if (strcmp(key, "prompt") == 0)
            st = cl_string(w, vn, "sample.prompt", &spec->sample_prompt, false);
        else if (strcmp(key, "max_tokens") == 0)
            st = cl_int(w, vn, "sample.max_tokens", 1, 4096, &spec->sample_max_tokens);
        else
            st = duet_error_set(DUET_ERR_NOT_FOUND,
                                "%s:%zu: sample: unknown key \"%s\" (known: prompt, max_tokens)",
                                w->y.name, duet_yaml_line(vn), key);
    }
    return st;
}

/* ---------------------------------------------------------------- top level */

static const char *const cl_top_keys[] = {"model", "binaries",          "router",         "ctx",
                                          "gen",   "startup_timeout_s", "stop_timeout_s", "sample",
                                          NULL};

static duet_status_t cl_top(cl_walk_t *w, yaml_node_t *root, duet_cluster_t *spec)
{
    size_t seen[8] = {0}; /* line where each top key was first given */
    for (yaml_node_pair_t *p = root->data.mapping.pairs.start; p < root->data.mapping.pairs.top;
         p++) {
        const char *key;
        yaml_node_t *vn;
        duet_status_t st = cl_pair(w, p, "", &key, &vn);
        if (st != DUET_OK)
            return st;
        size_t i = 0;
        while (cl_top_keys[i] != NULL && strcmp(cl_top_keys[i], key) != 0)
            i++;
        if (cl_top_keys[i] == NULL)
            return duet_error_set(DUET_ERR_NOT_FOUND,
                                  "%s:%zu: unknown key \"%.60s\" (known: model, binaries, router, "
                                  "ctx, gen, startup_timeout_s, stop_timeout_s, sample)",
                                  w->y.name, duet_yaml_line(vn), key);
        if (seen[i] != 0)
            return duet_error_set(DUET_ERR_FORMAT, "%s:%zu: %s: given twice (first at line %zu)",
                                  w->y.name, duet_yaml_line(vn), key, seen[i]);
        seen[i] = duet_yaml_line(vn);
        switch (i) {
        case 0:
            st = cl_string(w, vn, "model", &spec->model, true);
            break;
        case 1:
            st = cl_string(w, vn, "binaries", &spec->binaries, true);
            break;
        case 2:
            st = cl_router(w, vn, spec);
            break;
        case 3:
            st = cl_workers(w, vn, "ctx", 0, false, &spec->ctx);
            break;
        case 4:
            st = cl_workers(w, vn, "gen", 1, true, &spec->gen);
            break;
        case 5:
            st = cl_int(w, vn, "startup_timeout_s", 1, 3600, &spec->startup_timeout_s);
            break;
        case 6:
            st = cl_int(w, vn, "stop_timeout_s", 1, 600, &spec->stop_timeout_s);
            break;
        default:
            st = cl_sample(w, vn, spec);
            break;
        }
        if (st != DUET_OK)
            return st;
    }
    return DUET_OK;
}

/* Defaults for what the file left out, once the walk is done. */
static duet_status_t cl_defaults(cl_walk_t *w, const duet_cluster_paths_t *paths,
                                 duet_cluster_t *spec)
{
    static const struct {
        size_t off;
        const char *sub;
    } bins[] = {
        {offsetof(duet_cluster_t, router), "router/duet-router"},
        {offsetof(duet_cluster_t, ctx), "ctx_worker/duet-ctx"},
        {offsetof(duet_cluster_t, gen), "gen_worker/duet-gen"},
    };
    if (spec->model == NULL)
        return duet_error_set(DUET_ERR_INVALID,
                              "%s: model: missing (the model folder, e.g. `model: "
                              "models/duet-demo`)",
                              w->y.name);
    duet_status_t st = DUET_OK;
    if (spec->binaries == NULL)
        st = paths->binaries != NULL ? cl_set(w, &spec->binaries, paths->binaries, false)
                                     : cl_set(w, &spec->binaries, "build", true);
    for (size_t i = 0; st == DUET_OK && i < sizeof(bins) / sizeof(bins[0]); i++) {
        duet_cluster_role_t *r = (duet_cluster_role_t *)((char *)spec + bins[i].off);
        if (r->binary == NULL && asprintf(&r->binary, "%s/%s", spec->binaries, bins[i].sub) < 0) {
            r->binary = NULL;
            st = duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", w->y.name);
        }
        if (st == DUET_OK && r->args == NULL)
            st = cl_flags_to_args(w, &(cl_flags_t){0}, r);
    }
    if (st == DUET_OK && spec->http_host == NULL)
        st = cl_set(w, &spec->http_host, "127.0.0.1", false);
    if (st == DUET_OK && spec->workers_host == NULL)
        st = cl_set(w, &spec->workers_host, "127.0.0.1", false);
    if (st == DUET_OK && spec->sample_prompt == NULL)
        st = cl_set(w, &spec->sample_prompt, CL_DEFAULT_PROMPT, false);
    return st;
}

typedef struct {
    const duet_cluster_paths_t *paths;
    duet_cluster_t *spec;
} cl_load_t;

static duet_status_t cl_root(duet_yaml_walk_t *y, yaml_node_t *root, void *user)
{
    cl_walk_t *w = (cl_walk_t *)y;
    cl_load_t *l = user;
    duet_status_t st = root != NULL ? cl_top(w, root, l->spec) : DUET_OK;
    return st == DUET_OK ? cl_defaults(w, l->paths, l->spec) : st;
}

duet_status_t duet_cluster_load_string(const char *text, size_t len, const char *name,
                                       const duet_cluster_paths_t *paths, duet_cluster_t **spec_p)
{
    static const duet_cluster_paths_t no_paths = {0};
    duet_status_t st;
    if (paths == NULL)
        paths = &no_paths;
    duet_cluster_t *spec = calloc(1, sizeof(*spec));
    if (spec == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", name);
    duet_cluster_role_t *roles[] = {&spec->router, &spec->ctx, &spec->gen};
    for (size_t i = 0; i < sizeof(roles) / sizeof(roles[0]); i++)
        roles[i]->count = roles[i]->cp = roles[i]->tp = 1;
    spec->http_port = 8000;
    spec->workers_port = 8100;
    spec->startup_timeout_s = 120;
    spec->stop_timeout_s = 10;
    spec->sample_max_tokens = 40;
    if ((spec->file = strdup(name)) == NULL) {
        st = duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", name);
    } else {
        cl_walk_t w = {.y = {.name = name, .words = DUET_YAML_WORDS_PLAIN}, .root = paths->root};
        cl_load_t l = {.paths = paths, .spec = spec};
        st = duet_yaml_load(&w.y, text, len, CL_MAX_BYTES, cl_root, &l);
    }
    if (st != DUET_OK) {
        duet_cluster_destroy(spec);
        return st;
    }
    *spec_p = spec;
    return DUET_OK;
}

duet_status_t duet_cluster_load_file(const char *path, const duet_cluster_paths_t *paths,
                                     duet_cluster_t **spec_p)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_status_t st = duet_strbuf_read_file(&sb, path, CL_MAX_BYTES);
    if (st == DUET_OK)
        st = duet_cluster_load_string(sb.data != NULL ? sb.data : "", sb.len, path, paths, spec_p);
    duet_strbuf_free(&sb);
    return st;
}

static void cl_role_free(duet_cluster_role_t *r)
{
    free(r->binary);
    for (size_t i = 0; i < r->n_args; i++)
        free(r->args[i]);
    free(r->args);
}

void duet_cluster_destroy(duet_cluster_t *spec)
{
    if (spec == NULL)
        return;
    cl_role_free(&spec->router);
    cl_role_free(&spec->ctx);
    cl_role_free(&spec->gen);
    free(spec->file);
    free(spec->model);
    free(spec->binaries);
    free(spec->http_host);
    free(spec->workers_host);
    free(spec->sample_prompt);
    free(spec);
}

const char *duet_cluster_arg(const duet_cluster_role_t *r, const char *key)
{
    size_t kl = strlen(key);
    for (size_t i = 0; i < r->n_args; i++)
        if (strncmp(r->args[i], "--", 2) == 0 && strncmp(r->args[i] + 2, key, kl) == 0 &&
            r->args[i][2 + kl] == '=')
            return r->args[i] + 3 + kl;
    return NULL;
}
