/*
 * Typed JSON reads with path-naming errors; see json.h.
 *
 * Paths are parsed on every call rather than compiled: these getters run when a config or a
 * request body is read, never per token, and a plain walk keeps the error messages exact.
 */
#include "common/json.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/strbuf.h"

const char *duet_json_type_name(const json_t *v)
{
    if (v == NULL)
        return "nothing";
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "object";
    case JSON_ARRAY:
        return "array";
    case JSON_STRING:
        return "string";
    case JSON_INTEGER:
        return "integer";
    case JSON_REAL:
        return "real";
    case JSON_TRUE:
        return "true";
    case JSON_FALSE:
        return "false";
    case JSON_NULL:
        return "null";
    }
    return "unknown";
}

/* ---------------------------------------------------------------- loading */

static duet_status_t json_parse(const char *buf, size_t len, const char *source, size_t max_bytes,
                                size_t flags, json_t **root_p)
{
    json_error_t err;
    if (len > max_bytes)
        return duet_error_set(DUET_ERR_RANGE, "%s: %zu bytes exceeds the limit of %zu", source, len,
                              max_bytes);
    json_t *root = json_loadb(buf, len, JSON_REJECT_DUPLICATES | flags, &err);
    if (root == NULL)
        return duet_error_set(DUET_ERR_FORMAT, "%s:%d:%d: %s", source, err.line, err.column,
                              err.text);
    *root_p = root;
    return DUET_OK;
}

duet_status_t duet_json_load_buffer(const char *buf, size_t len, const char *source,
                                    size_t max_bytes, json_t **root_p)
{
    return json_parse(buf, len, source, max_bytes, 0, root_p);
}

static duet_status_t json_parse_file(const char *path, size_t max_bytes, size_t flags,
                                     json_t **root_p)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_status_t st = duet_strbuf_read_file(&sb, path, max_bytes);
    if (st == DUET_OK)
        st = json_parse(sb.data != NULL ? sb.data : "", sb.len, path, max_bytes, flags, root_p);
    duet_strbuf_free(&sb);
    return st;
}

duet_status_t duet_json_load_file(const char *path, size_t max_bytes, json_t **root_p)
{
    return json_parse_file(path, max_bytes, 0, root_p);
}

duet_status_t duet_json_load_file_reals(const char *path, size_t max_bytes, json_t **root_p)
{
    return json_parse_file(path, max_bytes, JSON_DECODE_INT_AS_REAL, root_p);
}

/* ---------------------------------------------------------------- paths */

/* A path step met the wrong container: name the prefix walked so far ("the root" when empty). */
static duet_status_t json_step_error(const char *source, const char *path, size_t prefix_len,
                                     const json_t *cur, const char *want)
{
    if (prefix_len == 0)
        return duet_error_set(DUET_ERR_FORMAT, "%s: field \"%s\": the root is %s, expected %s",
                              source, path, duet_json_type_name(cur), want);
    return duet_error_set(DUET_ERR_FORMAT, "%s: field \"%s\": \"%.*s\" is %s, expected %s", source,
                          path, (int)prefix_len, path, duet_json_type_name(cur), want);
}

duet_status_t duet_json_lookup(const json_t *obj, const char *source, const char *path,
                               json_t **v_p)
{
    json_t *cur = (json_t *)obj;
    const char *p = path;
    char key[256];

    if (path == NULL || path[0] == '\0')
        return duet_error_set(DUET_ERR_INVALID, "%s: empty JSON path", source);
    while (*p != '\0') {
        /* One object key (possibly empty when the path starts with an index). */
        size_t n = strcspn(p, ".[");
        if (n > 0) {
            if (n >= sizeof(key))
                return duet_error_set(DUET_ERR_INVALID, "%s: JSON path \"%s\": key too long",
                                      source, path);
            memcpy(key, p, n);
            key[n] = '\0';
            if (cur == NULL || json_is_null(cur)) {
                *v_p = NULL;
                return DUET_OK;
            }
            if (!json_is_object(cur))
                return json_step_error(source, path, (size_t)(p > path ? p - path - 1 : 0), cur,
                                       "object");
            cur = json_object_get(cur, key);
            p += n;
        } else if (*p != '[') {
            return duet_error_set(DUET_ERR_INVALID, "%s: malformed JSON path \"%s\"", source, path);
        }
        /* Zero or more [index]. */
        while (*p == '[') {
            char *end;
            unsigned long idx;
            errno = 0;
            idx = strtoul(p + 1, &end, 10);
            if (end == p + 1 || *end != ']' || errno != 0 || p[1] == '-' || p[1] == '+')
                return duet_error_set(DUET_ERR_INVALID, "%s: malformed JSON path \"%s\"", source,
                                      path);
            if (cur == NULL || json_is_null(cur)) {
                *v_p = NULL;
                return DUET_OK;
            }
            if (!json_is_array(cur))
                return json_step_error(source, path, (size_t)(p - path), cur, "array");
            cur = json_array_get(cur, idx); /* NULL when out of bounds */
            p = end + 1;
        }
        if (*p == '.') {
            p++;
            if (*p == '\0' || *p == '.' || *p == '[')
                return duet_error_set(DUET_ERR_INVALID, "%s: malformed JSON path \"%s\"", source,
                                      path);
        } else if (*p != '\0') {
            return duet_error_set(DUET_ERR_INVALID, "%s: malformed JSON path \"%s\"", source, path);
        }
    }
    *v_p = cur;
    return DUET_OK;
}

/*
 * The value at path for a getter: DUET_OK with *v_p set (possibly NULL for absent/null when
 * `optional`), or DUET_ERR_NOT_FOUND when required and absent.
 */
static duet_status_t json_fetch(const json_t *obj, const char *source, const char *path,
                                bool optional, json_t **v_p)
{
    json_t *v = NULL;
    duet_status_t st = duet_json_lookup(obj, source, path, &v);
    if (st != DUET_OK)
        return st;
    if (v == NULL || (optional && json_is_null(v))) {
        if (!optional)
            return duet_error_set(DUET_ERR_NOT_FOUND, "%s: field \"%s\": missing", source, path);
        v = NULL;
    }
    *v_p = v;
    return DUET_OK;
}

static duet_status_t json_type_error(const char *source, const char *path, const char *want,
                                     const json_t *v)
{
    return duet_error_set(DUET_ERR_FORMAT, "%s: field \"%s\": expected %s, got %s", source, path,
                          want, duet_json_type_name(v));
}

/* Check one integer value; `path` is the full name for messages. */
static duet_status_t json_int_value(const json_t *v, const char *source, const char *path,
                                    int64_t min, int64_t max, int64_t *v_p)
{
    if (!json_is_integer(v))
        return json_type_error(source, path, "integer", v);
    int64_t x = (int64_t)json_integer_value(v);
    if (x < min || x > max)
        return duet_error_set(DUET_ERR_RANGE,
                              "%s: field \"%s\": %" PRId64 " is outside [%" PRId64 ", %" PRId64 "]",
                              source, path, x, min, max);
    *v_p = x;
    return DUET_OK;
}

/* ---------------------------------------------------------------- getters */

duet_status_t duet_json_get_int(const json_t *obj, const char *source, const char *path,
                                int64_t min, int64_t max, int64_t *v_p)
{
    json_t *v = NULL;
    duet_status_t st = json_fetch(obj, source, path, false, &v);
    if (st != DUET_OK)
        return st;
    return json_int_value(v, source, path, min, max, v_p);
}

duet_status_t duet_json_get_int_opt(const json_t *obj, const char *source, const char *path,
                                    int64_t min, int64_t max, int64_t def, int64_t *v_p)
{
    json_t *v = NULL;
    duet_status_t st = json_fetch(obj, source, path, true, &v);
    if (st != DUET_OK)
        return st;
    if (v == NULL) {
        *v_p = def;
        return DUET_OK;
    }
    return json_int_value(v, source, path, min, max, v_p);
}

static duet_status_t json_double_value(const json_t *v, const char *source, const char *path,
                                       double min, double max, double *v_p)
{
    if (!json_is_number(v))
        return json_type_error(source, path, "number", v);
    double x = json_number_value(v);
    if (!(x >= min && x <= max))
        return duet_error_set(DUET_ERR_RANGE, "%s: field \"%s\": %g is outside [%g, %g]", source,
                              path, x, min, max);
    *v_p = x;
    return DUET_OK;
}

duet_status_t duet_json_get_double(const json_t *obj, const char *source, const char *path,
                                   double min, double max, double *v_p)
{
    json_t *v = NULL;
    duet_status_t st = json_fetch(obj, source, path, false, &v);
    if (st != DUET_OK)
        return st;
    return json_double_value(v, source, path, min, max, v_p);
}

duet_status_t duet_json_get_double_opt(const json_t *obj, const char *source, const char *path,
                                       double min, double max, double def, double *v_p)
{
    json_t *v = NULL;
    duet_status_t st = json_fetch(obj, source, path, true, &v);
    if (st != DUET_OK)
        return st;
    if (v == NULL) {
        *v_p = def;
        return DUET_OK;
    }
    return json_double_value(v, source, path, min, max, v_p);
}

duet_status_t duet_json_get_bool(const json_t *obj, const char *source, const char *path, bool *v_p)
{
    json_t *v = NULL;
    duet_status_t st = json_fetch(obj, source, path, false, &v);
    if (st != DUET_OK)
        return st;
    if (!json_is_boolean(v))
        return json_type_error(source, path, "true or false", v);
    *v_p = json_is_true(v);
    return DUET_OK;
}

duet_status_t duet_json_get_bool_opt(const json_t *obj, const char *source, const char *path,
                                     bool def, bool *v_p)
{
    json_t *v = NULL;
    duet_status_t st = json_fetch(obj, source, path, true, &v);
    if (st != DUET_OK)
        return st;
    if (v == NULL) {
        *v_p = def;
        return DUET_OK;
    }
    if (!json_is_boolean(v))
        return json_type_error(source, path, "true or false", v);
    *v_p = json_is_true(v);
    return DUET_OK;
}

duet_status_t duet_json_get_string(const json_t *obj, const char *source, const char *path,
                                   const char **v_p)
{
    json_t *v = NULL;
    duet_status_t st = json_fetch(obj, source, path, false, &v);
    if (st != DUET_OK)
        return st;
    if (!json_is_string(v))
        return json_type_error(source, path, "string", v);
    *v_p = json_string_value(v);
    return DUET_OK;
}

duet_status_t duet_json_get_string_opt(const json_t *obj, const char *source, const char *path,
                                       const char *def, const char **v_p)
{
    json_t *v = NULL;
    duet_status_t st = json_fetch(obj, source, path, true, &v);
    if (st != DUET_OK)
        return st;
    if (v == NULL) {
        *v_p = def;
        return DUET_OK;
    }
    if (!json_is_string(v))
        return json_type_error(source, path, "string", v);
    *v_p = json_string_value(v);
    return DUET_OK;
}

duet_status_t duet_json_get_int_array(const json_t *obj, const char *source, const char *path,
                                      int64_t min, int64_t max, int64_t **v_p, size_t *n_p)
{
    json_t *arr = NULL;
    int64_t *out = NULL;
    duet_status_t st = json_fetch(obj, source, path, false, &arr);
    if (st != DUET_OK)
        return st;
    if (!json_is_array(arr))
        return json_type_error(source, path, "array of integers", arr);
    size_t n = json_array_size(arr);
    if (n > 0) {
        out = malloc(n * sizeof(*out));
        if (out == NULL)
            return duet_error_set(DUET_ERR_NOMEM, "%s: field \"%s\": out of memory", source, path);
    }
    for (size_t i = 0; i < n; i++) {
        char elem[512];
        snprintf(elem, sizeof(elem), "%s[%zu]", path, i);
        st = json_int_value(json_array_get(arr, i), source, elem, min, max, &out[i]);
        if (st != DUET_OK)
            goto free_out;
    }
    *v_p = out;
    *n_p = n;
    return DUET_OK;
free_out:
    free(out);
    return st;
}

duet_status_t duet_json_get_object(const json_t *obj, const char *source, const char *path,
                                   json_t **v_p)
{
    json_t *v = NULL;
    duet_status_t st = json_fetch(obj, source, path, false, &v);
    if (st != DUET_OK)
        return st;
    if (!json_is_object(v))
        return json_type_error(source, path, "object", v);
    *v_p = v;
    return DUET_OK;
}

duet_status_t duet_json_get_array(const json_t *obj, const char *source, const char *path,
                                  json_t **v_p)
{
    json_t *v = NULL;
    duet_status_t st = json_fetch(obj, source, path, false, &v);
    if (st != DUET_OK)
        return st;
    if (!json_is_array(v))
        return json_type_error(source, path, "array", v);
    *v_p = v;
    return DUET_OK;
}
