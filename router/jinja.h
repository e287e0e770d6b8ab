/*
 * A small Jinja subset renderer, enough for Hugging Face / Kimi-style chat templates.
 *
 * The template comes from a model folder (outside bytes), so the whole template is parsed into an
 * AST once, at load, and anything unsupported or malformed is refused there with "source:L:C:
 * message". Rendering is bounded: output bytes, loop iterations and memory have limits, nesting
 * depth is limited at parse time, and nothing recurses deeper than the parse allowed.
 *
 * Supported: text; {{ expr }}; {% if %}/{% elif %}/{% else %}/{% endif %}; {% for x in expr %}
 * ... {% endfor %} with loop.first/last/index/index0/length; {% set name = expr %}; {# #};
 * whitespace control {%- -%} {{- -}} ({%+ disables lstrip). Like Hugging Face's environment,
 * trim_blocks and lstrip_blocks are on. Expressions: '..' / ".." strings with escapes, integers,
 * true/false/none (any capitalisation Jinja accepts: True/False/None), list literals, variables,
 * a.b, a['b'], a[0] (negative indices count from the end), + (string concat or int add), - (int),
 * == != < > <= >=, in, not in, not, and, or, parentheses; tests is [not] string/defined/undefined/
 * none/number/mapping/sequence; filters |trim, |length, |default(x).
 *
 * Trust. Every string carries its origin: TEMPLATE (the template's literal text and string
 * literals, and values the caller marks trusted such as bos_token) or DATA (values from the
 * request). Concatenation keeps the origin of each byte. The output is a list of segments with
 * their origin, so the caller recognises special-token text only in TEMPLATE segments.
 */
#ifndef DUET_ROUTER_JINJA_H
#define DUET_ROUTER_JINJA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/strbuf.h"

typedef struct duet_jinja duet_jinja_t;             /* a parsed template; immutable */
typedef struct duet_jinja_vars duet_jinja_vars_t;   /* the variables of one render, and its arena */
typedef struct duet_jinja_value duet_jinja_value_t; /* lives in a vars' arena */

typedef enum {
    DUET_JINJA_ORIGIN_TEMPLATE = 0,
    DUET_JINJA_ORIGIN_DATA = 1,
} duet_jinja_origin_t;

typedef struct {
    size_t off, len; /* bytes of duet_jinja_output_t.text */
    duet_jinja_origin_t origin;
} duet_jinja_segment_t;

/* What a render produced. Adjacent segments never share an origin. */
typedef struct {
    duet_strbuf_t text;          /* owned */
    duet_jinja_segment_t *segs;  /* (n_segs) owned */
    size_t n_segs, cap_segs;
} duet_jinja_output_t;

typedef struct {
    size_t max_output;     /* bytes of output (and of any one string value) */
    size_t max_iterations; /* loop iterations in one render, all loops together */
    size_t max_memory;     /* bytes of the render's arena */
} duet_jinja_limits_t;

/* Defaults: 4 MiB of output, 100000 iterations, 64 MiB of arena. */
extern const duet_jinja_limits_t duet_jinja_limits_default;

/* Maximum nesting of blocks and expressions accepted by the parser. */
#define DUET_JINJA_MAX_DEPTH 64

/*
 * Parse `len` bytes of template text (`source` names it in errors). Errors: DUET_ERR_FORMAT
 * ("source:L:C: ..." in duet_error_last()) for malformed or unsupported templates, DUET_ERR_NOMEM.
 */
duet_status_t duet_jinja_parse(const char *text, size_t len, const char *source,
                               duet_jinja_t **tmpl_p);

/* Free a template; NULL is fine. */
void duet_jinja_destroy(duet_jinja_t *tmpl);

/* Variables for one render. `max_memory` bounds the arena (0 = the default limit). */
duet_status_t duet_jinja_vars_create(size_t max_memory, duet_jinja_vars_t **vars_p);
void duet_jinja_vars_destroy(duet_jinja_vars_t *vars);

/* Value constructors: NULL when out of memory (or over the arena's limit). */
duet_jinja_value_t *duet_jinja_none(duet_jinja_vars_t *vars);
duet_jinja_value_t *duet_jinja_bool(duet_jinja_vars_t *vars, bool b);
duet_jinja_value_t *duet_jinja_int(duet_jinja_vars_t *vars, int64_t i);
duet_jinja_value_t *duet_jinja_string(duet_jinja_vars_t *vars, const char *s, size_t len,
                                      duet_jinja_origin_t origin);
duet_jinja_value_t *duet_jinja_list(duet_jinja_vars_t *vars);
duet_jinja_value_t *duet_jinja_map(duet_jinja_vars_t *vars);

/* Append to a list / set a map key (NUL-terminated, copied). DUET_ERR_INVALID on a wrong kind. */
duet_status_t duet_jinja_list_push(duet_jinja_vars_t *vars, duet_jinja_value_t *list,
                                   duet_jinja_value_t *item);
duet_status_t duet_jinja_map_set(duet_jinja_vars_t *vars, duet_jinja_value_t *map, const char *key,
                                 duet_jinja_value_t *val);

/* Set a global variable. */
duet_status_t duet_jinja_vars_set(duet_jinja_vars_t *vars, const char *name,
                                  duet_jinja_value_t *val);

/*
 * Render. `lim` may be NULL (defaults). On success *out is filled (free with
 * duet_jinja_output_free); on failure it is left empty. Errors: DUET_ERR_INVALID (a type error,
 * e.g. rendering a list; "source:L:C: ..."), DUET_ERR_RANGE (a limit), DUET_ERR_NOMEM.
 */
duet_status_t duet_jinja_render(const duet_jinja_t *tmpl, duet_jinja_vars_t *vars,
                                const duet_jinja_limits_t *lim, duet_jinja_output_t *out);

void duet_jinja_output_free(duet_jinja_output_t *out);

#endif
