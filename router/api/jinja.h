/*
 * Chat templates rendered as transformers' apply_chat_template renders them: jinja2 in an
 * ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, loop controls, the
 * {% generation %} block, transformers' tojson (json.dumps, ensure_ascii off) and its globals
 * raise_exception(msg) and strftime_now(fmt). Output is byte for byte what CPython prints
 * (None/True/False, float repr, list and dict repr, json.dumps); the chat_template_oracle test
 * compares every published template in tests/data/chat_templates against jinja2 itself.
 *
 * The template comes from a model folder (outside bytes), so the whole template is parsed into an
 * AST once, at load, and anything malformed or outside what duet runs (an unknown filter or
 * test, include/extends/import, recursive loops) is refused there with "source:L:C: message".
 * Rendering is bounded: output bytes, loop iterations and macro calls, arena memory
 * and macro call depth have limits; nesting depth is limited at parse time.
 *
 * Supported: every statement published templates use (if/elif/else, for with else, `if`
 * filtering and tuple unpacking, loop.* and loop.cycle, break/continue, set including
 * `set ns.attr` and block set, macro with defaults and keyword calls, call blocks with caller,
 * filter blocks, with, raw, generation), the whole expression grammar of jinja2 (literals,
 * attribute / item / slice access, calls with *args and **kwargs, filters, tests, arithmetic,
 * `~`, chained comparisons, in, and/or/not, `a if b else c`), jinja2's common filters and tests,
 * markupsafe's Markup as `safe` and `escape` make it (Markup + str escapes the str), and the
 * str / dict / list methods templates call. Known differences from CPython: integers are
 * 64-bit (overflow is an error), case mapping (upper, lower, title, ...) covers Latin, Greek,
 * Cyrillic and Armenian, repr() of a string escapes the common non-printable characters only, `%`
 * string formatting and format specs in str.format are refused, range() gives a list.
 *
 * Trust. Every string carries an origin per byte: TEMPLATE (the template's literal text and
 * string literals, and values the caller marks trusted such as bos_token) or DATA (values from
 * the request). Concatenation, slicing, strip/split/replace/join, padding and case changes keep
 * the origin of each byte; a string made of a whole value (str() or repr() of a list or dict,
 * tojson) is DATA when anything in the value is DATA; numbers, booleans and None print as
 * TEMPLATE. The output is a list of segments with their origin, so the caller recognises
 * special-token text only in TEMPLATE segments.
 */
#ifndef DUET_ROUTER_JINJA_H
#define DUET_ROUTER_JINJA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <time.h>

#include "common/status.h"
#include "common/strbuf.h"

struct json_t;

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
    duet_strbuf_t text;         /* owned */
    duet_jinja_segment_t *segs; /* (n_segs) owned */
    size_t n_segs, cap_segs;
} duet_jinja_output_t;

typedef struct {
    size_t max_output;     /* bytes of output (and of any one string value) */
    size_t max_iterations; /* loop iterations and macro calls in one render, all together */
    size_t max_memory;     /* bytes of the render's arena (see duet_jinja_vars_create) */
    size_t max_call_depth; /* macro calls nested (a recursive macro stops here) */
} duet_jinja_limits_t;

/* Defaults: 4 MiB of output, 100000 iterations, 64 MiB of arena, 32 nested macro calls. A zero
 * field in the limits passed to duet_jinja_render means its default. */
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
duet_jinja_value_t *duet_jinja_float(duet_jinja_vars_t *vars, double f);
/* NULL also when s is not valid UTF-8. */
duet_jinja_value_t *duet_jinja_string(duet_jinja_vars_t *vars, const char *s, size_t len,
                                      duet_jinja_origin_t origin);
duet_jinja_value_t *duet_jinja_list(duet_jinja_vars_t *vars);
duet_jinja_value_t *duet_jinja_map(duet_jinja_vars_t *vars);

/* Append to a list / set a map key (NUL-terminated, copied). DUET_ERR_INVALID on a wrong kind. */
duet_status_t duet_jinja_list_push(duet_jinja_vars_t *vars, duet_jinja_value_t *list,
                                   duet_jinja_value_t *item);
duet_status_t duet_jinja_map_set(duet_jinja_vars_t *vars, duet_jinja_value_t *map, const char *key,
                                 duet_jinja_value_t *val);

/*
 * A value from JSON as Python's json.loads gives it: objects become dicts (key order kept),
 * arrays lists, integers ints, reals floats; every string (keys too) has `origin`. Errors:
 * DUET_ERR_RANGE (nested deeper than 256), DUET_ERR_FORMAT (a string not valid UTF-8),
 * DUET_ERR_NOMEM (over the arena's limit); the detail is in duet_error_last().
 */
duet_status_t duet_jinja_from_json(duet_jinja_vars_t *vars, const struct json_t *json,
                                   duet_jinja_origin_t origin, duet_jinja_value_t **val_p);

/* The instant strftime_now() formats (a broken-down time, copied); NULL: the local time at each
 * call, as transformers' datetime.now(). */
void duet_jinja_vars_set_time(duet_jinja_vars_t *vars, const struct tm *now);

/* Set a global variable. */
duet_status_t duet_jinja_vars_set(duet_jinja_vars_t *vars, const char *name,
                                  duet_jinja_value_t *val);

/*
 * Render. `lim` may be NULL (defaults). On success *out is filled (free with
 * duet_jinja_output_free); on failure it is left empty. Errors, with the detail in
 * duet_error_last(): DUET_ERR_FORMAT when the template called raise_exception(msg) (the detail
 * is msg exactly, as transformers raises it), DUET_ERR_INVALID where jinja2 raises (an undefined
 * value used, a type error; "source:L:C: ..."), DUET_ERR_UNSUPPORTED for the few things duet
 * does not run, DUET_ERR_RANGE (a limit), DUET_ERR_NOMEM (the arena's limit).
 * A vars may be rendered with any number of templates, one at a time.
 */
duet_status_t duet_jinja_render(const duet_jinja_t *tmpl, duet_jinja_vars_t *vars,
                                const duet_jinja_limits_t *lim, duet_jinja_output_t *out);

void duet_jinja_output_free(duet_jinja_output_t *out);

#endif
