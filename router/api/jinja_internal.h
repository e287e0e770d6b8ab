/*
 * What the Jinja engine's files share (router/api/jinja*.c): values, the arena, the AST, the render
 * state. Not a public header: callers use router/api/jinja.h.
 *
 *   jinja.c        values, strings with per-byte origin, Python formatting (str, repr, json.dumps),
 *                  equality and ordering, the public constructors, JSON input
 *   jinja_parse.c  jinja2's lexer (whitespace control, trim_blocks, lstrip_blocks) and parser
 *   jinja_eval.c   rendering: statements, expressions, scopes, macros, limits
 *   jinja_lib.c    filters, tests, str/dict/list methods and the global functions
 */
#ifndef DUET_ROUTER_JINJA_INTERNAL_H
#define DUET_ROUTER_JINJA_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "common/utf8.h" /* duet_utf8_valid, duet_unicode_isspace */
#include "router/api/jinja.h"

/* ---------------------------------------------------------------- arena */

typedef struct jj_block {
    struct jj_block *next;
    size_t used, cap;
    max_align_t data[];
} jj_block_t;

typedef struct {
    jj_block_t *head;
    size_t total, limit; /* limit 0: none */
} jj_arena_t;

/* Zeroed memory from the arena; NULL when over the limit or out of memory. */
void *jj_alloc(jj_arena_t *a, size_t n);
void jj_arena_free(jj_arena_t *a);

/* ---------------------------------------------------------------- values */

typedef enum {
    JV_UNDEF = 0,
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST, /* also a tuple (tuple) or a one-shot iterator such as select's result (gen) */
    JV_DICT,
    JV_NS,     /* namespace(): a dict whose attributes can be set */
    JV_LOOP,   /* a for loop's `loop` */
    JV_MACRO,  /* a macro, or a call block's caller */
    JV_FUNC,   /* a global function: range, namespace, dict, raise_exception, ... */
    JV_METHOD, /* a bound method: self.name */
} jv_kind_t;

enum { JJ_ORIGIN_MIXED = 2 };

struct jj_node;
struct jj_scope;

struct duet_jinja_value {
    uint8_t kind;
    uint8_t origin; /* STR: TEMPLATE, DATA or MIXED (then mask) */
    bool tuple;     /* LIST: a tuple (repr with parentheses, != list) */
    bool gen;       /* LIST: an iterator: always true, no len(), one pass */
    bool b;
    bool markup;                /* STR: a markupsafe Markup (what safe / escape give) */
    int64_t i;                  /* INT; FUNC: which; LOOP: index0 */
    double f;                   /* FLOAT */
    const char *s;              /* STR: (len) bytes, NUL after; METHOD: the name */
    size_t len;                 /* STR, METHOD name */
    const uint8_t *mask;        /* STR MIXED: per-byte origin */
    duet_jinja_value_t **items; /* LIST items, DICT/NS values: (n) */
    duet_jinja_value_t **keys;  /* DICT/NS keys: (n) */
    size_t n, cap;
    duet_jinja_value_t *self;   /* METHOD: the object; LOOP: the items (a LIST) */
    const struct jj_node *node; /* MACRO: the definition */
    struct jj_scope *closure;   /* MACRO: the scope it was defined in */
    duet_jinja_value_t *caller; /* MACRO: the caller passed to a call block's macro */
    int depth;                  /* LOOP: loop.depth0 */
};

extern duet_jinja_value_t jj_undef_value;
/* The undefined value a method that would change a list or dict gives (the sandbox's). */
extern duet_jinja_value_t jj_unsafe_value;

duet_jinja_value_t *jj_new(jj_arena_t *a, jv_kind_t kind);
duet_jinja_value_t *jj_str(jj_arena_t *a, const char *s, size_t len, int origin);
duet_jinja_value_t *jj_int(jj_arena_t *a, int64_t i);
duet_jinja_value_t *jj_float(jj_arena_t *a, double f);
duet_jinja_value_t *jj_bool(jj_arena_t *a, bool b);
duet_status_t jj_push(jj_arena_t *a, duet_jinja_value_t *c, duet_jinja_value_t *item);
/* Set key (copied by reference) in a DICT or NS; replaces an equal key. */
duet_status_t jj_dict_set(jj_arena_t *a, duet_jinja_value_t *d, duet_jinja_value_t *key,
                          duet_jinja_value_t *val);
/* The value of a string key (NULL when absent). */
duet_jinja_value_t *jj_dict_get(const duet_jinja_value_t *d, const char *k, size_t kl);
/* Python == (no error: every pair compares). */
bool jj_equal(const duet_jinja_value_t *a, const duet_jinja_value_t *b, int depth);
bool jj_truthy(const duet_jinja_value_t *v);
/* Python's type name, for error messages: 'str', 'list', 'NoneType', ... */
const char *jj_type_name(const duet_jinja_value_t *v);
bool jj_is_number(const duet_jinja_value_t *v); /* int, float or bool */
double jj_num(const duet_jinja_value_t *v);
uint8_t jj_origin_at(const duet_jinja_value_t *s, size_t i);
bool jj_has_data(const duet_jinja_value_t *v, int depth); /* any DATA byte inside */

/* ---------------------------------------------------------------- UTF-8 */

/* Decode one code point at s[*i] (valid UTF-8 assumed; a bad byte decodes as itself). */
uint32_t jj_utf8_next(const char *s, size_t len, size_t *i);
size_t jj_utf8_put(char *out, uint32_t cp); /* 1..4 bytes */
size_t jj_utf8_count(const char *s, size_t len);
/* Byte offset of code point index `cp` (len if past the end). */
size_t jj_utf8_offset(const char *s, size_t len, size_t cp);

/* ---------------------------------------------------------------- render state, errors */

typedef struct jj_var {
    const char *name;
    size_t name_len;
    duet_jinja_value_t *val;
    struct jj_var *next;
} jj_var_t;

typedef struct jj_scope {
    jj_var_t *vars;
    struct jj_scope *parent;
} jj_scope_t;

/* Bind `name` (nlen bytes; copied into the arena when copy_name, else it must outlive the
 * scope) to val in sc, replacing an existing binding. DUET_ERR_NOMEM when the arena is full. */
duet_status_t jj_scope_set(jj_arena_t *a, jj_scope_t *sc, const char *name, size_t nlen,
                           duet_jinja_value_t *val, bool copy_name);

struct duet_jinja_vars {
    jj_arena_t arena;
    jj_scope_t globals;
    bool has_now;
    struct tm now;
};

/* A string being built: bytes and, once two origins meet, one origin byte per byte. */
typedef struct {
    jj_arena_t *a;
    char *buf;
    uint8_t *mask; /* NULL while every byte has `origin` */
    size_t len, cap, limit;
    int origin; /* -1 before the first byte */
    duet_status_t st;
} jj_sb_t;

void jj_sb_init(jj_sb_t *sb, jj_arena_t *a, size_t limit);
void jj_sb_put(jj_sb_t *sb, const char *s, size_t n, int origin);
void jj_sb_puts(jj_sb_t *sb, const char *s, int origin);
void jj_sb_put_str(jj_sb_t *sb, const duet_jinja_value_t *s); /* keeps per-byte origin */
void jj_sb_put_range(jj_sb_t *sb, const duet_jinja_value_t *s, size_t off, size_t n);
/* The string built (NULL on error: sb->st says which). */
duet_jinja_value_t *jj_sb_finish(jj_sb_t *sb);

typedef struct jj_body {
    struct jj_node **nodes;
    size_t n;
} jj_body_t;

struct duet_jinja {
    jj_arena_t arena;
    jj_body_t root;
    char *src; /* the normalised source, for error positions */
    size_t src_len;
    char *source;
};

typedef struct {
    const duet_jinja_t *t;
    duet_jinja_vars_t *vars;
    jj_arena_t *arena;
    duet_jinja_limits_t lim;
    size_t iterations;
    uint64_t work; /* items filters visit and comparisons they make (jj_work) */
    int call_depth;
    int loop_ctl; /* 1: break, 2: continue, pending */
    jj_sb_t *out; /* where text goes now */
} jj_render_t;

/* Record "source:L:C: message" for `off` and return st. */
duet_status_t jj_error(duet_status_t st, const char *source, const char *src, size_t len,
                       size_t off, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
#define JJ_RERR(r, st, off, ...)                                                                   \
    jj_error((st), (r)->t->source, (r)->t->src, (r)->t->src_len, (off), __VA_ARGS__)
/* The arena ran out: the memory limit. */
duet_status_t jj_nomem(jj_render_t *r, size_t off);

/* Python str() / repr() / json.dumps of v into sb. Errors name `off`. */
duet_status_t jj_to_str(jj_render_t *r, size_t off, const duet_jinja_value_t *v, jj_sb_t *sb);
duet_status_t jj_repr(jj_render_t *r, size_t off, const duet_jinja_value_t *v, jj_sb_t *sb,
                      int depth);
typedef struct {
    bool ensure_ascii, sort_keys;
    const char *indent; /* NULL: none */
    size_t indent_len;
    const char *item_sep, *key_sep;
    size_t item_sep_len, key_sep_len;
} jj_json_opts_t;
duet_status_t jj_json(jj_render_t *r, size_t off, const duet_jinja_value_t *v, jj_sb_t *sb,
                      const jj_json_opts_t *o, int depth);
/* str(v) as a new string value. */
duet_status_t jj_stringify(jj_render_t *r, size_t off, const duet_jinja_value_t *v,
                           duet_jinja_value_t **out);
/* Python's repr(float): shortest round trip ("1.0", "0.1", "1e+20", "inf"). */
size_t jj_fmt_float(double f, char *buf, size_t cap);
/* Python ordering: <0, 0, >0 in *c; DUET_ERR_INVALID when the two do not order. */
duet_status_t jj_compare(jj_render_t *r, size_t off, const duet_jinja_value_t *a,
                         const duet_jinja_value_t *b, int *c);

#define JJ_MAX_VALUE_DEPTH 256 /* nesting of values printed, compared or converted */

/* ---------------------------------------------------------------- AST */

typedef enum {
    JE_LIT = 0,
    JE_NAME,
    JE_ATTR,   /* a.name */
    JE_ITEM,   /* a[b] */
    JE_SLICE,  /* a[b:c:d] (NULL parts absent) */
    JE_CALL,   /* a(args, kw=...) */
    JE_FILTER, /* a | name(args) */
    JE_TEST,   /* a is [not] name(args) */
    JE_BIN,    /* a op b */
    JE_NEG,
    JE_POS,
    JE_NOT,
    JE_AND,
    JE_OR,
    JE_CMP,    /* a op1 args[0] op2 args[1] ... */
    JE_COND,   /* b if a else c (c NULL: undefined) */
    JE_LIST,   /* [args] */
    JE_TUPLE,  /* (args) */
    JE_DICT,   /* {args[i]: kwargs[i]} */
    JE_CONCAT, /* args[0] ~ args[1] ~ ... */
    JE_HOLE,   /* the text of a filter block / block set */
} je_kind_t;

typedef enum { JOP_ADD = 0, JOP_SUB, JOP_MUL, JOP_DIV, JOP_FLOORDIV, JOP_MOD, JOP_POW } jop_t;
typedef enum {
    JCMP_EQ = 0,
    JCMP_NE,
    JCMP_LT,
    JCMP_GT,
    JCMP_LE,
    JCMP_GE,
    JCMP_IN,
    JCMP_NOTIN
} jcmp_t;

typedef struct jj_expr {
    je_kind_t kind;
    size_t off;
    int op;      /* BIN: jop_t */
    bool negate; /* TEST: is not */
    int fid;     /* FILTER / TEST: the index in jj_filters / jj_tests */
    const char *name;
    size_t name_len;
    duet_jinja_value_t *lit;
    struct jj_expr *a, *b, *c, *d;
    struct jj_expr **args;        /* positional arguments, items, dict keys, comparison operands */
    struct jj_expr *star, *dstar; /* CALL / FILTER / TEST: f(*star, **dstar) (NULL: none) */
    size_t n_args;
    struct jj_expr **kwargs; /* keyword argument values, dict values */
    const char **kwnames;
    size_t *kwlens;
    size_t n_kw;
    int *ops; /* CMP: (n_args) jcmp_t */
} jj_expr_t;

typedef enum {
    JN_TEXT = 0,
    JN_OUTPUT,
    JN_IF,
    JN_FOR,
    JN_SET,       /* names = expr */
    JN_SET_ATTR,  /* names[0].attr = expr */
    JN_SET_BLOCK, /* names[0] = body | expr(hole) */
    JN_MACRO,
    JN_CALL_BLOCK, /* expr with caller = macro(params) body */
    JN_FILTER_BLOCK,
    JN_WITH,
    JN_BREAK,
    JN_CONTINUE,
    JN_BODY, /* generation: just its body */
} jn_kind_t;

typedef struct jj_node {
    jn_kind_t kind;
    size_t off;
    const char *text; /* TEXT */
    size_t len;
    jj_expr_t *expr;
    jj_expr_t *cond; /* FOR: the `if` filter */
    const char **names;
    size_t *name_lens;
    size_t n_names;
    bool tuple_target;
    const char *attr;
    size_t attr_len;
    jj_expr_t **defaults; /* MACRO / CALL_BLOCK: (n_names), NULL entries: none; WITH: values */
    jj_expr_t **conds;    /* IF: (n_conds) */
    jj_body_t *bodies;
    size_t n_conds;
    jj_body_t body, els;
} jj_node_t;

/* ---------------------------------------------------------------- library */

typedef struct {
    duet_jinja_value_t **pos;
    size_t n_pos;
    duet_jinja_value_t **kw;
    const char **kwnames;
    size_t *kwlens;
    size_t n_kw;
} jj_args_t;

typedef duet_status_t (*jj_filter_fn)(jj_render_t *r, size_t off, duet_jinja_value_t *x,
                                      const jj_args_t *a, duet_jinja_value_t **out);
typedef struct {
    const char *name;
    jj_filter_fn fn;
} jj_filter_t;
typedef duet_status_t (*jj_test_fn)(jj_render_t *r, size_t off, duet_jinja_value_t *x,
                                    const jj_args_t *a, bool *res);
typedef struct {
    const char *name;
    jj_test_fn fn;
} jj_test_t;

int jj_filter_find(const char *name, size_t len); /* -1 when unknown */
int jj_test_find(const char *name, size_t len);
duet_status_t jj_filter_call(jj_render_t *r, size_t off, int fid, duet_jinja_value_t *x,
                             const jj_args_t *a, duet_jinja_value_t **out);
duet_status_t jj_test_call(jj_render_t *r, size_t off, int tid, duet_jinja_value_t *x,
                           const jj_args_t *a, bool *res);

enum { JF_RANGE = 0, JF_NAMESPACE, JF_DICT, JF_RAISE, JF_STRFTIME, JF_JOINER_UNUSED, JF_COUNT };
int jj_global_find(const char *name, size_t len); /* JF_*, -1 */
/* Call a METHOD or FUNC value. */
duet_status_t jj_call_builtin(jj_render_t *r, size_t off, duet_jinja_value_t *f, const jj_args_t *a,
                              duet_jinja_value_t **out);
/* a.name on a value that is not undefined: a method, a key, a loop attribute, or undefined. */
duet_status_t jj_getattr(jj_render_t *r, size_t off, duet_jinja_value_t *a, const char *name,
                         size_t nlen, duet_jinja_value_t **out);
/* a[key] (jinja2's getitem: the item, else the attribute of that name, else undefined). */
duet_status_t jj_getitem(jj_render_t *r, size_t off, duet_jinja_value_t *a, duet_jinja_value_t *key,
                         duet_jinja_value_t **out);
/* The items a for loop or a filter walks over (a LIST); TypeError when not iterable. */
duet_status_t jj_iterate(jj_render_t *r, size_t off, duet_jinja_value_t *v,
                         duet_jinja_value_t **list_p);
/* Call a macro value (from eval). */
duet_status_t jj_call_macro(jj_render_t *r, size_t off, duet_jinja_value_t *m, const jj_args_t *a,
                            duet_jinja_value_t **out);
/* markupsafe's escape(v): str(v) with & < > ' " as HTML entities, as a Markup string; a Markup
 * comes back as it is. */
duet_status_t jj_escape(jj_render_t *r, size_t off, duet_jinja_value_t *v,
                        duet_jinja_value_t **out);
/* v (a str, or a list / tuple of them) as Markup: v itself when it already is, else a copy, so
 * that a value other code holds never changes. Other values come back as they are. */
duet_status_t jj_mark(jj_render_t *r, size_t off, duet_jinja_value_t *v, duet_jinja_value_t **out);
/* Python's printf-style `fmt % arg` (a tuple: the values; a dict: %(name)s). */
duet_status_t jj_percent(jj_render_t *r, size_t off, const duet_jinja_value_t *fmt,
                         duet_jinja_value_t *arg, duet_jinja_value_t **out);
/* Count n items visited or compared by a filter against 1000 x max_iterations, so that sorting
 * or de-duplicating a huge list built by the template cannot hold the CPU unboundedly. */
duet_status_t jj_work(jj_render_t *r, size_t off, uint64_t n);
/* Count one unit of work against the iteration limit. */
duet_status_t jj_tick(jj_render_t *r, size_t off);

#endif
