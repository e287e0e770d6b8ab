/*
 * Typed, validated reads from jansson values, for every JSON that comes from outside: the
 * model's config.json, safetensors headers, OpenAI request bodies, admin API bodies.
 *
 * Every failure is a status plus a duet_error_set() detail that names where the value came from
 * and the full path to it, e.g.
 *   config.json: field "linear_attn_config.kda_layers[3]": expected integer, got string
 * so a user can find the problem without a debugger. To make that possible each getter takes
 * `source` (a file name, or a phrase such as "request body") and a `path` relative to `obj`:
 * dotted object keys with optional array indices ("a.b[3].c"). Pass the root and a full path
 * (built with snprintf inside loops) and the message names the full path. Keys that themselves
 * contain '.' or '[' cannot be addressed this way; use jansson directly for those.
 *
 * Required getters fail with DUET_ERR_NOT_FOUND when the field is absent and DUET_ERR_FORMAT on
 * the wrong type; `_opt` getters return the default when the field is absent or JSON null. Range
 * violations are DUET_ERR_RANGE. Out-params are written only on success. The getters do not log;
 * the caller decides whether the error is fatal (DUET_FAIL) or goes back in an HTTP 400.
 */
#ifndef DUET_COMMON_JSON_H
#define DUET_COMMON_JSON_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* Default cap for duet_json_load_file: config.json files are a few KiB. */
#define DUET_JSON_DEFAULT_MAX_BYTES ((size_t)16 << 20)

/*
 * Parse the file at `path` (at most max_bytes bytes, else DUET_ERR_RANGE without reading it).
 * Duplicate object keys are rejected. Syntax errors are DUET_ERR_FORMAT with detail
 * "path:line:column: jansson's message". *root_p receives a new reference (json_decref it).
 */
duet_status_t duet_json_load_file(const char *path, size_t max_bytes, json_t **root_p);

/* Same for a buffer of len bytes (need not be NUL-terminated); `source` names it in errors. */
duet_status_t duet_json_load_buffer(const char *buf, size_t len, const char *source,
                                    size_t max_bytes, json_t **root_p);

/*
 * duet_json_load_file for a file whose numbers are not read as integers: every number loads as a
 * real, so an integer beyond int64 is no error. transformers writes an unbounded
 * model_max_length as 1000000000000000019884624838656 into tokenizer_config.json, which
 * duet_json_load_file refuses ("too big integer").
 */
duet_status_t duet_json_load_file_reals(const char *path, size_t max_bytes, json_t **root_p);

/*
 * The value at `path` under `obj`, borrowed (valid while obj lives), or NULL when any step is
 * missing. DUET_ERR_FORMAT when a step walks into a non-object / non-array; DUET_ERR_INVALID for
 * a malformed path (a programming error, but reported rather than asserted).
 */
duet_status_t duet_json_lookup(const json_t *obj, const char *source, const char *path,
                               json_t **v_p);

/* Integer in [min, max]. JSON reals are refused even when integral ("expected integer"). */
duet_status_t duet_json_get_int(const json_t *obj, const char *source, const char *path,
                                int64_t min, int64_t max, int64_t *v_p);
duet_status_t duet_json_get_int_opt(const json_t *obj, const char *source, const char *path,
                                    int64_t min, int64_t max, int64_t def, int64_t *v_p);

/* Number (integer or real) as a double in [min, max]; use -INFINITY/INFINITY for no bound. */
duet_status_t duet_json_get_double(const json_t *obj, const char *source, const char *path,
                                   double min, double max, double *v_p);
duet_status_t duet_json_get_double_opt(const json_t *obj, const char *source, const char *path,
                                       double min, double max, double def, double *v_p);

/* true/false. */
duet_status_t duet_json_get_bool(const json_t *obj, const char *source, const char *path,
                                 bool *v_p);
duet_status_t duet_json_get_bool_opt(const json_t *obj, const char *source, const char *path,
                                     bool def, bool *v_p);

/* String, borrowed from the JSON value (valid while obj lives). def may be NULL. */
duet_status_t duet_json_get_string(const json_t *obj, const char *source, const char *path,
                                   const char **v_p);
duet_status_t duet_json_get_string_opt(const json_t *obj, const char *source, const char *path,
                                       const char *def, const char **v_p);

/*
 * Array of integers, each in [min, max]. *v_p receives a malloc'd array (free() it; NULL when
 * the array is empty) and *n_p its length. Errors name the element: "kda_layers[3]".
 */
duet_status_t duet_json_get_int_array(const json_t *obj, const char *source, const char *path,
                                      int64_t min, int64_t max, int64_t **v_p, size_t *n_p);

/* Object / array at path, borrowed. */
duet_status_t duet_json_get_object(const json_t *obj, const char *source, const char *path,
                                   json_t **v_p);
duet_status_t duet_json_get_array(const json_t *obj, const char *source, const char *path,
                                  json_t **v_p);

/* "object", "array", "string", "integer", "real", "true", "false", "null" (for messages). */
const char *duet_json_type_name(const json_t *v);

#endif
