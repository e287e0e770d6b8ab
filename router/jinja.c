/*
 * The Jinja subset renderer (see jinja.h).
 *
 * Parsing runs in two steps: the source is cut into chunks (text, {{ }}, {% %}) with whitespace
 * control applied, then a recursive-descent parser builds the AST, tracking a depth that bounds
 * every later recursion. AST nodes and parse-time literals live in the template's arena; render
 * values live in the vars' arena, which is capped, so a hostile template can spend only bounded
 * memory. Errors store byte offsets; line:column is computed from the source only when reporting.
 */
#include "router/jinja.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const duet_jinja_limits_t duet_jinja_limits_default = {
    .max_output = 4u << 20,
    .max_iterations = 100000,
    .max_memory = 64u << 20,
};

/* ---------------------------------------------------------------- arena */

typedef struct jj_block {
    struct jj_block *next;
    size_t used, cap;
    max_align_t data[];
} jj_block_t;

typedef struct {
    jj_block_t *head;
    size_t total, limit;
} jj_arena_t;

static void *jj_alloc(jj_arena_t *a, size_t n)
{
    n = (n + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
    if (n == 0)
        n = sizeof(max_align_t);
    if (a->head == NULL || a->head->cap - a->head->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->limit != 0 && (a->total > a->limit || cap > a->limit - a->total))
            return NULL;
        jj_block_t *b = malloc(sizeof(*b) + cap);
        if (b == NULL)
            return NULL;
        b->next = a->head;
        b->used = 0;
        b->cap = cap;
        a->head = b;
        a->total += cap;
    }
    void *p = (char *)a->head->data + a->head->used;
    a->head->used += n;
    memset(p, 0, n);
    return p;
}

static void jj_arena_free(jj_arena_t *a)
{
    while (a->head != NULL) {
        jj_block_t *b = a->head;
        a->head = b->next;
        free(b);
    }
    a->total = 0;
}

/* ---------------------------------------------------------------- values */

typedef enum {
    JJ_UNDEF = 0,
    JJ_NONE,
    JJ_BOOL,
    JJ_INT,
    JJ_STR,
    JJ_LIST,
    JJ_MAP,
} jj_kind_t;

enum { JJ_ORIGIN_MIXED = 2 };

struct duet_jinja_value {
    jj_kind_t kind;
    bool b;
    int64_t i;
    const char *s;       /* JJ_STR: (len) bytes */
    size_t len;
    int origin;          /* JJ_STR: TEMPLATE, DATA or MIXED */
    const uint8_t *mask; /* MIXED: (len) per-byte origin */
    duet_jinja_value_t **items; /* LIST and MAP values: (n) */
    const char **keys;          /* MAP: (n) NUL-terminated */
    size_t n, cap;
};

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

struct duet_jinja_vars {
    jj_arena_t arena;
    jj_scope_t globals;
};

static duet_jinja_value_t jj_undef_value = {.kind = JJ_UNDEF};

static duet_jinja_value_t *jj_new(jj_arena_t *a, jj_kind_t kind)
{
    duet_jinja_value_t *v = jj_alloc(a, sizeof(*v));
    if (v != NULL)
        v->kind = kind;
    return v;
}

static duet_jinja_value_t *jj_str(jj_arena_t *a, const char *s, size_t len, int origin)
{
    duet_jinja_value_t *v = jj_new(a, JJ_STR);
    char *copy = v != NULL ? jj_alloc(a, len + 1) : NULL;
    if (copy == NULL)
        return NULL;
    if (len > 0)
        memcpy(copy, s, len);
    v->s = copy;
    v->len = len;
    v->origin = origin;
    return v;
}

duet_status_t duet_jinja_vars_create(size_t max_memory, duet_jinja_vars_t **vars_p)
{
    if (vars_p == NULL)
        return DUET_ERR_INVALID;
    duet_jinja_vars_t *v = calloc(1, sizeof(*v));
    if (v == NULL)
        return DUET_ERR_NOMEM;
    v->arena.limit = max_memory != 0 ? max_memory : duet_jinja_limits_default.max_memory;
    *vars_p = v;
    return DUET_OK;
}

void duet_jinja_vars_destroy(duet_jinja_vars_t *vars)
{
    if (vars == NULL)
        return;
    jj_arena_free(&vars->arena);
    free(vars);
}

duet_jinja_value_t *duet_jinja_none(duet_jinja_vars_t *vars)
{
    return jj_new(&vars->arena, JJ_NONE);
}

duet_jinja_value_t *duet_jinja_bool(duet_jinja_vars_t *vars, bool b)
{
    duet_jinja_value_t *v = jj_new(&vars->arena, JJ_BOOL);
    if (v != NULL)
        v->b = b;
    return v;
}

duet_jinja_value_t *duet_jinja_int(duet_jinja_vars_t *vars, int64_t i)
{
    duet_jinja_value_t *v = jj_new(&vars->arena, JJ_INT);
    if (v != NULL)
        v->i = i;
    return v;
}

duet_jinja_value_t *duet_jinja_string(duet_jinja_vars_t *vars, const char *s, size_t len,
                                      duet_jinja_origin_t origin)
{
    return jj_str(&vars->arena, s, len, (int)origin);
}

duet_jinja_value_t *duet_jinja_list(duet_jinja_vars_t *vars)
{
    return jj_new(&vars->arena, JJ_LIST);
}

duet_jinja_value_t *duet_jinja_map(duet_jinja_vars_t *vars)
{
    return jj_new(&vars->arena, JJ_MAP);
}

/* Grow items (and keys for maps) by one slot. */
static duet_status_t jj_grow(jj_arena_t *a, duet_jinja_value_t *c)
{
    if (c->n < c->cap)
        return DUET_OK;
    size_t cap = c->cap == 0 ? 4 : c->cap * 2;
    duet_jinja_value_t **items = jj_alloc(a, cap * sizeof(*items));
    if (items == NULL)
        return DUET_ERR_NOMEM;
    if (c->n > 0)
        memcpy(items, c->items, c->n * sizeof(*items));
    if (c->kind == JJ_MAP) {
        const char **keys = jj_alloc(a, cap * sizeof(*keys));
        if (keys == NULL)
            return DUET_ERR_NOMEM;
        if (c->n > 0)
            memcpy(keys, c->keys, c->n * sizeof(*keys));
        c->keys = keys;
    }
    c->items = items;
    c->cap = cap;
    return DUET_OK;
}

duet_status_t duet_jinja_list_push(duet_jinja_vars_t *vars, duet_jinja_value_t *list,
                                   duet_jinja_value_t *item)
{
    if (vars == NULL || list == NULL || item == NULL || list->kind != JJ_LIST)
        return DUET_ERR_INVALID;
    duet_status_t st = jj_grow(&vars->arena, list);
    if (st == DUET_OK)
        list->items[list->n++] = item;
    return st;
}

duet_status_t duet_jinja_map_set(duet_jinja_vars_t *vars, duet_jinja_value_t *map, const char *key,
                                 duet_jinja_value_t *val)
{
    if (vars == NULL || map == NULL || key == NULL || val == NULL || map->kind != JJ_MAP)
        return DUET_ERR_INVALID;
    for (size_t i = 0; i < map->n; i++)
        if (strcmp(map->keys[i], key) == 0) {
            map->items[i] = val;
            return DUET_OK;
        }
    duet_status_t st = jj_grow(&vars->arena, map);
    if (st != DUET_OK)
        return st;
    size_t kl = strlen(key);
    char *k = jj_alloc(&vars->arena, kl + 1);
    if (k == NULL)
        return DUET_ERR_NOMEM;
    memcpy(k, key, kl + 1);
    map->keys[map->n] = k;
    map->items[map->n++] = val;
    return DUET_OK;
}

static duet_status_t jj_scope_set(jj_arena_t *a, jj_scope_t *sc, const char *name, size_t nlen,
                                  duet_jinja_value_t *val)
{
    for (jj_var_t *v = sc->vars; v != NULL; v = v->next)
        if (v->name_len == nlen && memcmp(v->name, name, nlen) == 0) {
            v->val = val;
            return DUET_OK;
        }
    jj_var_t *v = jj_alloc(a, sizeof(*v));
    char *copy = v != NULL ? jj_alloc(a, nlen + 1) : NULL;
    if (copy == NULL)
        return DUET_ERR_NOMEM;
    memcpy(copy, name, nlen);
    v->name = copy;
    v->name_len = nlen;
    v->val = val;
    v->next = sc->vars;
    sc->vars = v;
    return DUET_OK;
}

duet_status_t duet_jinja_vars_set(duet_jinja_vars_t *vars, const char *name,
                                  duet_jinja_value_t *val)
{
    if (vars == NULL || name == NULL || val == NULL)
        return DUET_ERR_INVALID;
    return jj_scope_set(&vars->arena, &vars->globals, name, strlen(name), val);
}

static duet_jinja_value_t *jj_lookup(const jj_scope_t *sc, const char *name, size_t nlen)
{
    for (; sc != NULL; sc = sc->parent)
        for (jj_var_t *v = sc->vars; v != NULL; v = v->next)
            if (v->name_len == nlen && memcmp(v->name, name, nlen) == 0)
                return v->val;
    return &jj_undef_value;
}

/* ---------------------------------------------------------------- AST */

typedef enum {
    JE_LIT = 0, /* lit */
    JE_VAR,     /* name */
    JE_ATTR,    /* a.name */
    JE_INDEX,   /* a[b] */
    JE_LIST,    /* [kids] */
    JE_BIN,     /* a op b */
    JE_NOT,     /* not a */
    JE_NEG,     /* -a */
    JE_TEST,    /* a is [not] name */
    JE_FILTER,  /* a | name [ (b) ] */
} je_kind_t;

typedef enum {
    JOP_OR = 0,
    JOP_AND,
    JOP_EQ,
    JOP_NE,
    JOP_LT,
    JOP_GT,
    JOP_LE,
    JOP_GE,
    JOP_IN,
    JOP_NOTIN,
    JOP_ADD,
    JOP_SUB,
} jop_t;

typedef struct jj_expr {
    je_kind_t kind;
    size_t off; /* source offset, for errors */
    jop_t op;
    bool negate; /* JE_TEST: is not */
    const char *name;
    size_t name_len;
    duet_jinja_value_t *lit;
    struct jj_expr *a, *b;
    struct jj_expr **kids; /* JE_LIST: (n_kids) */
    size_t n_kids;
} jj_expr_t;

typedef struct jj_node jj_node_t;

typedef struct {
    jj_node_t **nodes; /* (n) */
    size_t n, cap;
} jj_body_t;

typedef enum { JN_TEXT = 0, JN_OUTPUT, JN_IF, JN_FOR, JN_SET } jn_kind_t;

struct jj_node {
    jn_kind_t kind;
    size_t off;
    const char *text; /* TEXT: (len) bytes */
    size_t len;
    jj_expr_t *expr;  /* OUTPUT, SET value, FOR iterable */
    const char *name; /* SET / FOR target */
    size_t name_len;
    jj_expr_t **conds; /* IF: (n_conds) */
    jj_body_t *bodies; /* IF: (n_conds) */
    size_t n_conds;
    jj_body_t els;  /* IF: else */
    jj_body_t body; /* FOR */
};

struct duet_jinja {
    jj_arena_t arena;
    jj_body_t root;
    char *src; /* (src_len) owned copy, for error positions */
    size_t src_len;
    char *source; /* owned: the name used in errors */
};

/* ---------------------------------------------------------------- errors */

static void jj_linecol(const char *src, size_t len, size_t off, unsigned *line_p, unsigned *col_p)
{
    unsigned line = 1, col = 1;
    for (size_t i = 0; i < off && i < len; i++) {
        if (src[i] == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    *line_p = line;
    *col_p = col;
}

static duet_status_t jj_error(duet_status_t st, const char *source, const char *src, size_t len,
                              size_t off, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

static duet_status_t jj_error(duet_status_t st, const char *source, const char *src, size_t len,
                              size_t off, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    unsigned line, col;
    jj_linecol(src, len, off, &line, &col);
    return duet_error_set(st, "%s:%u:%u: %s", source, line, col, msg);
}

/* ---------------------------------------------------------------- chunks */

typedef enum { JC_TEXT = 0, JC_EXPR, JC_STMT } jc_kind_t;

typedef struct {
    jc_kind_t kind;
    size_t off, len; /* TEXT: the bytes kept; EXPR/STMT: the inside of the tag */
    size_t tag_off;  /* where the tag starts */
} jj_chunk_t;

typedef enum { JT_END = 0, JT_NAME, JT_STR, JT_INT, JT_OP } jt_kind_t;

typedef struct {
    jt_kind_t kind;
    size_t off, len; /* source bytes of the token */
    char op[3];
    int64_t ival;
    char *sval; /* JT_STR: decoded, in the template arena */
    size_t slen;
} jj_tok_t;

typedef struct {
    duet_jinja_t *t;
    const char *src;
    size_t len;
    jj_chunk_t *chunks;
    size_t n_chunks, cap_chunks, ci;
    jj_tok_t *toks; /* tokens of the current tag */
    size_t n_toks, cap_toks, ti;
    unsigned depth;
} jj_parser_t;

#define JJ_PERR(p, off, ...)                                                                      \
    jj_error(DUET_ERR_FORMAT, (p)->t->source, (p)->src, (p)->len, (off), __VA_ARGS__)

static bool jj_isspace(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

static duet_status_t jj_chunk_push(jj_parser_t *p, jj_chunk_t c)
{
    if (c.kind == JC_TEXT && c.len == 0)
        return DUET_OK;
    if (p->n_chunks == p->cap_chunks) {
        size_t cap = p->cap_chunks == 0 ? 16 : p->cap_chunks * 2;
        jj_chunk_t *n = realloc(p->chunks, cap * sizeof(*n));
        if (n == NULL)
            return DUET_ERR_NOMEM;
        p->chunks = n;
        p->cap_chunks = cap;
    }
    p->chunks[p->n_chunks++] = c;
    return DUET_OK;
}

/* Find the closing "xy" of a tag from `i`, skipping string literals. SIZE_MAX if none. */
static size_t jj_find_close(const char *s, size_t len, size_t i, char x, char y, bool strings)
{
    while (i + 1 < len) {
        char c = s[i];
        if (strings && (c == '\'' || c == '"')) {
            size_t j = i + 1;
            while (j < len && s[j] != c) {
                if (s[j] == '\\')
                    j++;
                j++;
            }
            if (j >= len)
                return SIZE_MAX;
            i = j + 1;
            continue;
        }
        if (c == x && s[i + 1] == y)
            return i;
        i++;
    }
    return SIZE_MAX;
}

static duet_status_t jj_chunkify(jj_parser_t *p)
{
    const char *s = p->src;
    size_t len = p->len, i = 0;
    bool lstrip_next = false; /* the previous tag ended with '-' */
    duet_status_t st = DUET_OK;
    while (i < len && st == DUET_OK) {
        size_t j = i;
        while (j + 1 < len && !(s[j] == '{' && (s[j + 1] == '{' || s[j + 1] == '%' ||
                                                 s[j + 1] == '#')))
            j++;
        if (j + 1 >= len)
            j = len;
        size_t ts = i, te = j;
        if (lstrip_next)
            while (ts < te && jj_isspace(s[ts]))
                ts++;
        lstrip_next = false;
        if (j == len) {
            st = jj_chunk_push(p, (jj_chunk_t){.kind = JC_TEXT, .off = ts, .len = te - ts});
            break;
        }
        char kind = s[j + 1];
        size_t in = j + 2;
        bool block = kind != '{';
        if (in < len && s[in] == '-') {
            while (te > ts && jj_isspace(s[te - 1]))
                te--;
            in++;
        } else if (in < len && s[in] == '+') {
            in++;
        } else if (block) {
            /* lstrip_blocks: spaces and tabs from the start of the line to the tag. */
            size_t k = te;
            while (k > ts && (s[k - 1] == ' ' || s[k - 1] == '\t'))
                k--;
            if (k == 0 || s[k - 1] == '\n')
                te = k;
        }
        st = jj_chunk_push(p, (jj_chunk_t){.kind = JC_TEXT, .off = ts, .len = te - ts});
        if (st != DUET_OK)
            break;
        char cx = kind == '{' ? '}' : kind;
        size_t close = jj_find_close(s, len, in, cx, '}', kind != '#');
        if (close == SIZE_MAX)
            return JJ_PERR(p, j, "unclosed %s", kind == '{'   ? "'{{' (no '}}')"
                                               : kind == '%' ? "'{%' (no '%}')"
                                                             : "comment (no '#}')");
        size_t ie = close, next = close + 2;
        if (ie > in && s[ie - 1] == '-' && kind != '#') {
            ie--;
            lstrip_next = true;
        } else if (kind == '#' && ie > in && s[ie - 1] == '-') {
            lstrip_next = true;
        } else if (block) {
            /* trim_blocks: the first newline after a block tag is removed. */
            if (next < len && s[next] == '\n')
                next++;
            else if (next + 1 < len && s[next] == '\r' && s[next + 1] == '\n')
                next += 2;
        }
        if (kind != '#')
            st = jj_chunk_push(p, (jj_chunk_t){.kind = kind == '{' ? JC_EXPR : JC_STMT,
                                               .off = in,
                                               .len = ie > in ? ie - in : 0,
                                               .tag_off = j});
        i = next;
    }
    return st;
}

/* ---------------------------------------------------------------- tokens */

static duet_status_t jj_tok_push(jj_parser_t *p, jj_tok_t t)
{
    if (p->n_toks == p->cap_toks) {
        size_t cap = p->cap_toks == 0 ? 16 : p->cap_toks * 2;
        jj_tok_t *n = realloc(p->toks, cap * sizeof(*n));
        if (n == NULL)
            return DUET_ERR_NOMEM;
        p->toks = n;
        p->cap_toks = cap;
    }
    p->toks[p->n_toks++] = t;
    return DUET_OK;
}

static bool jj_isalpha(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static bool jj_isdigit(char c)
{
    return c >= '0' && c <= '9';
}

static duet_status_t jj_lex(jj_parser_t *p, size_t off, size_t len)
{
    const char *s = p->src;
    size_t i = off, end = off + len;
    p->n_toks = 0;
    p->ti = 0;
    duet_status_t st = DUET_OK;
    while (st == DUET_OK) {
        while (i < end && jj_isspace(s[i]))
            i++;
        if (i >= end)
            break;
        jj_tok_t t = {.off = i};
        char c = s[i];
        if (jj_isalpha(c)) {
            while (i < end && (jj_isalpha(s[i]) || jj_isdigit(s[i])))
                i++;
            t.kind = JT_NAME;
        } else if (jj_isdigit(c)) {
            int64_t v = 0;
            while (i < end && jj_isdigit(s[i])) {
                if (v > (INT64_MAX - 9) / 10)
                    return JJ_PERR(p, t.off, "integer literal too large");
                v = v * 10 + (s[i] - '0');
                i++;
            }
            if (i < end && (jj_isalpha(s[i]) || s[i] == '.'))
                return JJ_PERR(p, t.off, "unsupported number literal");
            t.kind = JT_INT;
            t.ival = v;
        } else if (c == '\'' || c == '"') {
            char *buf = jj_alloc(&p->t->arena, end - i + 1);
            if (buf == NULL)
                return DUET_ERR_NOMEM;
            size_t n = 0;
            i++;
            while (i < end && s[i] != c) {
                char d = s[i++];
                if (d == '\\') {
                    if (i >= end)
                        break;
                    char e = s[i++];
                    switch (e) {
                    case 'n': d = '\n'; break;
                    case 't': d = '\t'; break;
                    case 'r': d = '\r'; break;
                    case '0': d = '\0'; break;
                    case '\\': d = '\\'; break;
                    case '\'': d = '\''; break;
                    case '"': d = '"'; break;
                    default:
                        return JJ_PERR(p, i - 2, "unsupported escape '\\%c'", e);
                    }
                }
                buf[n++] = d;
            }
            if (i >= end)
                return JJ_PERR(p, t.off, "unterminated string literal");
            i++;
            t.kind = JT_STR;
            t.sval = buf;
            t.slen = n;
        } else {
            static const char *const ops2[] = {"==", "!=", "<=", ">="};
            static const char ops1[] = "()[].,|+-<>=";
            t.kind = JT_OP;
            bool two = false;
            for (size_t k = 0; k < 4 && i + 1 < end; k++)
                if (s[i] == ops2[k][0] && s[i + 1] == ops2[k][1])
                    two = true;
            if (two) {
                t.op[0] = s[i];
                t.op[1] = s[i + 1];
                i += 2;
            } else if (strchr(ops1, c) != NULL) {
                t.op[0] = c;
                i++;
            } else {
                return JJ_PERR(p, i, "unexpected character '%c'",
                               (unsigned char)c >= 0x20 && (unsigned char)c < 0x7f ? c : '?');
            }
        }
        t.len = i - t.off;
        st = jj_tok_push(p, t);
    }
    if (st == DUET_OK)
        st = jj_tok_push(p, (jj_tok_t){.kind = JT_END, .off = end});
    return st;
}

static jj_tok_t *jj_peek(jj_parser_t *p)
{
    return &p->toks[p->ti];
}

static bool jj_is_op(const jj_tok_t *t, const char *op)
{
    return t->kind == JT_OP && strcmp(t->op, op) == 0;
}

static bool jj_is_name(const jj_parser_t *p, const jj_tok_t *t, const char *name)
{
    size_t n = strlen(name);
    return t->kind == JT_NAME && t->len == n && memcmp(p->src + t->off, name, n) == 0;
}

static duet_status_t jj_expect_op(jj_parser_t *p, const char *op)
{
    jj_tok_t *t = jj_peek(p);
    if (!jj_is_op(t, op))
        return JJ_PERR(p, t->off, "expected '%s'", op);
    p->ti++;
    return DUET_OK;
}

/* ---------------------------------------------------------------- expressions */

static duet_status_t jj_parse_expr(jj_parser_t *p, jj_expr_t **e_p);

static jj_expr_t *jj_expr_new(jj_parser_t *p, je_kind_t kind, size_t off)
{
    jj_expr_t *e = jj_alloc(&p->t->arena, sizeof(*e));
    if (e != NULL) {
        e->kind = kind;
        e->off = off;
    }
    return e;
}

static duet_status_t jj_enter(jj_parser_t *p, size_t off)
{
    if (++p->depth > DUET_JINJA_MAX_DEPTH)
        return JJ_PERR(p, off, "nesting deeper than %d", DUET_JINJA_MAX_DEPTH);
    return DUET_OK;
}

static duet_status_t jj_parse_primary(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_tok_t *t = jj_peek(p);
    jj_expr_t *e = NULL;
    duet_status_t st = DUET_OK;
    if (t->kind == JT_STR) {
        /* Adjacent literals concatenate, as in Python. */
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        while (jj_peek(p)->kind == JT_STR) {
            duet_strbuf_append(&sb, jj_peek(p)->sval, jj_peek(p)->slen);
            p->ti++;
        }
        if (duet_strbuf_status(&sb) != DUET_OK) {
            duet_strbuf_free(&sb);
            return DUET_ERR_NOMEM;
        }
        e = jj_expr_new(p, JE_LIT, t->off);
        if (e != NULL)
            e->lit = jj_str(&p->t->arena, sb.data != NULL ? sb.data : "", sb.len,
                            DUET_JINJA_ORIGIN_TEMPLATE);
        duet_strbuf_free(&sb);
        if (e == NULL || e->lit == NULL)
            return DUET_ERR_NOMEM;
    } else if (t->kind == JT_INT) {
        p->ti++;
        e = jj_expr_new(p, JE_LIT, t->off);
        if (e == NULL || (e->lit = jj_new(&p->t->arena, JJ_INT)) == NULL)
            return DUET_ERR_NOMEM;
        e->lit->i = t->ival;
    } else if (t->kind == JT_NAME) {
        p->ti++;
        static const char *const lits[] = {"true", "True", "false", "False", "none", "None"};
        for (size_t k = 0; k < 6; k++)
            if (jj_is_name(p, t, lits[k])) {
                e = jj_expr_new(p, JE_LIT, t->off);
                if (e == NULL || (e->lit = jj_new(&p->t->arena, k < 4 ? JJ_BOOL : JJ_NONE)) ==
                                     NULL)
                    return DUET_ERR_NOMEM;
                e->lit->b = k < 2;
                *e_p = e;
                return DUET_OK;
            }
        static const char *const reserved[] = {"and", "or", "not", "in", "is", "if", "else"};
        for (size_t k = 0; k < 7; k++)
            if (jj_is_name(p, t, reserved[k]))
                return JJ_PERR(p, t->off, "unexpected '%s'", reserved[k]);
        e = jj_expr_new(p, JE_VAR, t->off);
        if (e == NULL)
            return DUET_ERR_NOMEM;
        e->name = p->src + t->off;
        e->name_len = t->len;
    } else if (jj_is_op(t, "(")) {
        p->ti++;
        if ((st = jj_parse_expr(p, &e)) != DUET_OK || (st = jj_expect_op(p, ")")) != DUET_OK)
            return st;
    } else if (jj_is_op(t, "[")) {
        p->ti++;
        e = jj_expr_new(p, JE_LIST, t->off);
        if (e == NULL)
            return DUET_ERR_NOMEM;
        size_t cap = 0;
        while (!jj_is_op(jj_peek(p), "]")) {
            if (e->n_kids > 0 && (st = jj_expect_op(p, ",")) != DUET_OK)
                return st;
            jj_expr_t *k = NULL;
            if ((st = jj_parse_expr(p, &k)) != DUET_OK)
                return st;
            if (e->n_kids == cap) {
                cap = cap == 0 ? 4 : cap * 2;
                jj_expr_t **kids = jj_alloc(&p->t->arena, cap * sizeof(*kids));
                if (kids == NULL)
                    return DUET_ERR_NOMEM;
                if (e->n_kids > 0)
                    memcpy(kids, e->kids, e->n_kids * sizeof(*kids));
                e->kids = kids;
            }
            e->kids[e->n_kids++] = k;
        }
        p->ti++;
    } else if (t->kind == JT_END) {
        return JJ_PERR(p, t->off, "expected an expression");
    } else {
        return JJ_PERR(p, t->off, "unexpected '%.*s'", (int)t->len, p->src + t->off);
    }
    *e_p = e;
    return DUET_OK;
}

static const char *const jj_filters[] = {"trim", "length", "default"};
static const char *const jj_tests[] = {"string", "defined", "undefined", "none",
                                       "number", "mapping", "sequence"};

static bool jj_name_in(const jj_parser_t *p, const jj_tok_t *t, const char *const *names,
                       size_t n)
{
    for (size_t k = 0; k < n; k++)
        if (jj_is_name(p, t, names[k]))
            return true;
    return false;
}

/* primary, then .name [expr] |filter, then is [not] test. */
static duet_status_t jj_parse_postfix(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_expr_t *e = NULL;
    duet_status_t st = jj_parse_primary(p, &e);
    while (st == DUET_OK) {
        jj_tok_t *t = jj_peek(p);
        if (jj_is_op(t, ".")) {
            p->ti++;
            jj_tok_t *n = jj_peek(p);
            if (n->kind != JT_NAME)
                return JJ_PERR(p, n->off, "expected an attribute name after '.'");
            p->ti++;
            jj_expr_t *a = jj_expr_new(p, JE_ATTR, t->off);
            if (a == NULL)
                return DUET_ERR_NOMEM;
            a->a = e;
            a->name = p->src + n->off;
            a->name_len = n->len;
            e = a;
        } else if (jj_is_op(t, "[")) {
            p->ti++;
            jj_expr_t *a = jj_expr_new(p, JE_INDEX, t->off);
            if (a == NULL)
                return DUET_ERR_NOMEM;
            a->a = e;
            if ((st = jj_parse_expr(p, &a->b)) != DUET_OK || (st = jj_expect_op(p, "]")) != DUET_OK)
                return st;
            e = a;
        } else if (jj_is_op(t, "(")) {
            return JJ_PERR(p, t->off, "function calls are not supported");
        } else if (jj_is_op(t, "|")) {
            p->ti++;
            jj_tok_t *n = jj_peek(p);
            if (n->kind != JT_NAME)
                return JJ_PERR(p, n->off, "expected a filter name after '|'");
            if (!jj_name_in(p, n, jj_filters, 3))
                return JJ_PERR(p, n->off, "unsupported filter '%.*s' (supported: trim, length, "
                                          "default)",
                               (int)(n->len > 64 ? 64 : n->len), p->src + n->off);
            p->ti++;
            jj_expr_t *f = jj_expr_new(p, JE_FILTER, n->off);
            if (f == NULL)
                return DUET_ERR_NOMEM;
            f->a = e;
            f->name = p->src + n->off;
            f->name_len = n->len;
            bool is_default = jj_is_name(p, n, "default");
            if (jj_is_op(jj_peek(p), "(")) {
                if (!is_default)
                    return JJ_PERR(p, jj_peek(p)->off, "filter '%.*s' takes no arguments",
                                   (int)n->len, p->src + n->off);
                p->ti++;
                if ((st = jj_parse_expr(p, &f->b)) != DUET_OK ||
                    (st = jj_expect_op(p, ")")) != DUET_OK)
                    return st;
            } else if (is_default) {
                return JJ_PERR(p, jj_peek(p)->off, "filter 'default' needs an argument");
            }
            e = f;
        } else if (jj_is_name(p, t, "is")) {
            p->ti++;
            jj_expr_t *x = jj_expr_new(p, JE_TEST, t->off);
            if (x == NULL)
                return DUET_ERR_NOMEM;
            if (jj_is_name(p, jj_peek(p), "not")) {
                x->negate = true;
                p->ti++;
            }
            jj_tok_t *n = jj_peek(p);
            if (n->kind != JT_NAME || !jj_name_in(p, n, jj_tests, 7))
                return JJ_PERR(p, n->off, "unsupported test '%.*s' (supported: string, defined, "
                                          "undefined, none, number, mapping, sequence)",
                               (int)(n->len > 64 ? 64 : n->len), p->src + n->off);
            p->ti++;
            x->a = e;
            x->name = p->src + n->off;
            x->name_len = n->len;
            e = x;
        } else {
            break;
        }
    }
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

static duet_status_t jj_parse_unary(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_tok_t *t = jj_peek(p);
    if (jj_is_op(t, "-")) {
        p->ti++;
        duet_status_t st = jj_enter(p, t->off);
        jj_expr_t *e = jj_expr_new(p, JE_NEG, t->off);
        if (st == DUET_OK && e == NULL)
            st = DUET_ERR_NOMEM;
        if (st == DUET_OK)
            st = jj_parse_unary(p, &e->a);
        p->depth--;
        if (st == DUET_OK)
            *e_p = e;
        return st;
    }
    return jj_parse_postfix(p, e_p);
}

static duet_status_t jj_bin(jj_parser_t *p, jop_t op, size_t off, jj_expr_t *a, jj_expr_t *b,
                            jj_expr_t **e_p)
{
    jj_expr_t *e = jj_expr_new(p, JE_BIN, off);
    if (e == NULL)
        return DUET_ERR_NOMEM;
    e->op = op;
    e->a = a;
    e->b = b;
    *e_p = e;
    return DUET_OK;
}

static duet_status_t jj_parse_add(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_expr_t *e = NULL, *r = NULL;
    duet_status_t st = jj_parse_unary(p, &e);
    while (st == DUET_OK) {
        jj_tok_t *t = jj_peek(p);
        jop_t op;
        if (jj_is_op(t, "+"))
            op = JOP_ADD;
        else if (jj_is_op(t, "-"))
            op = JOP_SUB;
        else
            break;
        p->ti++;
        if ((st = jj_parse_unary(p, &r)) == DUET_OK)
            st = jj_bin(p, op, t->off, e, r, &e);
    }
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

static duet_status_t jj_parse_cmp(jj_parser_t *p, jj_expr_t **e_p)
{
    static const char *const ops[] = {"==", "!=", "<", ">", "<=", ">="};
    static const jop_t opv[] = {JOP_EQ, JOP_NE, JOP_LT, JOP_GT, JOP_LE, JOP_GE};
    jj_expr_t *e = NULL, *r = NULL;
    duet_status_t st = jj_parse_add(p, &e);
    while (st == DUET_OK) {
        jj_tok_t *t = jj_peek(p);
        int op = -1;
        for (int k = 0; k < 6; k++)
            if (jj_is_op(t, ops[k]))
                op = (int)opv[k];
        if (op < 0 && jj_is_name(p, t, "in"))
            op = JOP_IN;
        if (op < 0 && jj_is_name(p, t, "not") && jj_is_name(p, &p->toks[p->ti + 1], "in")) {
            op = JOP_NOTIN;
            p->ti++;
        }
        if (op < 0)
            break;
        p->ti++;
        if ((st = jj_parse_add(p, &r)) == DUET_OK)
            st = jj_bin(p, (jop_t)op, t->off, e, r, &e);
    }
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

static duet_status_t jj_parse_not(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_tok_t *t = jj_peek(p);
    if (jj_is_name(p, t, "not")) {
        p->ti++;
        duet_status_t st = jj_enter(p, t->off);
        jj_expr_t *e = jj_expr_new(p, JE_NOT, t->off);
        if (st == DUET_OK && e == NULL)
            st = DUET_ERR_NOMEM;
        if (st == DUET_OK)
            st = jj_parse_not(p, &e->a);
        p->depth--;
        if (st == DUET_OK)
            *e_p = e;
        return st;
    }
    return jj_parse_cmp(p, e_p);
}

static duet_status_t jj_parse_and(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_expr_t *e = NULL, *r = NULL;
    duet_status_t st = jj_parse_not(p, &e);
    while (st == DUET_OK && jj_is_name(p, jj_peek(p), "and")) {
        size_t off = jj_peek(p)->off;
        p->ti++;
        if ((st = jj_parse_not(p, &r)) == DUET_OK)
            st = jj_bin(p, JOP_AND, off, e, r, &e);
    }
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

/*
 * Left-associative chains are built in loops; only parentheses, brackets, unary operators and
 * filter arguments recurse, and each pass through here counts one level of depth.
 */
static duet_status_t jj_parse_expr(jj_parser_t *p, jj_expr_t **e_p)
{
    duet_status_t st = jj_enter(p, jj_peek(p)->off);
    jj_expr_t *e = NULL, *r = NULL;
    if (st == DUET_OK)
        st = jj_parse_and(p, &e);
    while (st == DUET_OK && jj_is_name(p, jj_peek(p), "or")) {
        size_t off = jj_peek(p)->off;
        p->ti++;
        if ((st = jj_parse_and(p, &r)) == DUET_OK)
            st = jj_bin(p, JOP_OR, off, e, r, &e);
    }
    p->depth--;
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

/* A whole tag's expression: nothing may follow it. */
static duet_status_t jj_parse_full_expr(jj_parser_t *p, jj_expr_t **e_p)
{
    duet_status_t st = jj_parse_expr(p, e_p);
    if (st == DUET_OK && jj_peek(p)->kind != JT_END)
        st = JJ_PERR(p, jj_peek(p)->off, "unexpected '%.*s' after the expression",
                     (int)(jj_peek(p)->len > 64 ? 64 : jj_peek(p)->len), p->src + jj_peek(p)->off);
    return st;
}

/* ---------------------------------------------------------------- statements */

static duet_status_t jj_body_push(jj_body_t *b, jj_node_t *n)
{
    if (b->n == b->cap) {
        size_t cap = b->cap == 0 ? 8 : b->cap * 2;
        jj_node_t **nodes = realloc(b->nodes, cap * sizeof(*nodes));
        if (nodes == NULL)
            return DUET_ERR_NOMEM;
        b->nodes = nodes;
        b->cap = cap;
    }
    b->nodes[b->n++] = n;
    return DUET_OK;
}

static void jj_body_free(jj_body_t *b)
{
    for (size_t i = 0; i < b->n; i++) {
        jj_node_t *n = b->nodes[i];
        for (size_t k = 0; k < n->n_conds; k++)
            jj_body_free(&n->bodies[k]);
        free(n->conds);
        free(n->bodies);
        jj_body_free(&n->els);
        jj_body_free(&n->body);
    }
    free(b->nodes);
    b->nodes = NULL;
    b->n = b->cap = 0;
}

static jj_node_t *jj_node_new(jj_parser_t *p, jn_kind_t kind, size_t off)
{
    jj_node_t *n = jj_alloc(&p->t->arena, sizeof(*n));
    if (n != NULL) {
        n->kind = kind;
        n->off = off;
    }
    return n;
}

/*
 * Parse chunks into `body` until a statement whose keyword is in `ends` (its name is returned in
 * *end_p, its chunk left consumed and its tokens lexed) or the end of the template (*end_p NULL).
 */
static duet_status_t jj_parse_body(jj_parser_t *p, jj_body_t *body, const char *const *ends,
                                   size_t n_ends, const char **end_p)
{
    *end_p = NULL;
    while (p->ci < p->n_chunks) {
        jj_chunk_t *c = &p->chunks[p->ci++];
        duet_status_t st;
        if (c->kind == JC_TEXT) {
            jj_node_t *n = jj_node_new(p, JN_TEXT, c->off);
            if (n == NULL)
                return DUET_ERR_NOMEM;
            n->text = p->src + c->off;
            n->len = c->len;
            if ((st = jj_body_push(body, n)) != DUET_OK)
                return st;
            continue;
        }
        if ((st = jj_lex(p, c->off, c->len)) != DUET_OK)
            return st;
        if (c->kind == JC_EXPR) {
            jj_node_t *n = jj_node_new(p, JN_OUTPUT, c->tag_off);
            if (n == NULL)
                return DUET_ERR_NOMEM;
            if ((st = jj_parse_full_expr(p, &n->expr)) != DUET_OK ||
                (st = jj_body_push(body, n)) != DUET_OK)
                return st;
            continue;
        }
        jj_tok_t *kw = jj_peek(p);
        if (kw->kind != JT_NAME)
            return JJ_PERR(p, kw->off, "expected a tag name");
        for (size_t k = 0; k < n_ends; k++)
            if (jj_is_name(p, kw, ends[k])) {
                p->ti++;
                *end_p = ends[k];
                return DUET_OK;
            }
        p->ti++;
        if (jj_is_name(p, kw, "if")) {
            if ((st = jj_enter(p, kw->off)) != DUET_OK)
                return st;
            jj_node_t *n = jj_node_new(p, JN_IF, c->tag_off);
            if (n == NULL)
                return DUET_ERR_NOMEM;
            if ((st = jj_body_push(body, n)) != DUET_OK)
                return st;
            static const char *const if_ends[] = {"elif", "else", "endif"};
            bool in_else = false;
            for (;;) {
                const char *end = NULL;
                if (!in_else) {
                    jj_expr_t **conds = realloc(n->conds, (n->n_conds + 1) * sizeof(*conds));
                    if (conds == NULL)
                        return DUET_ERR_NOMEM;
                    n->conds = conds;
                    jj_body_t *bodies = realloc(n->bodies, (n->n_conds + 1) * sizeof(*bodies));
                    if (bodies == NULL)
                        return DUET_ERR_NOMEM;
                    n->bodies = bodies;
                    memset(&n->bodies[n->n_conds], 0, sizeof(*bodies));
                    n->conds[n->n_conds] = NULL;
                    n->n_conds++;
                    if ((st = jj_parse_full_expr(p, &n->conds[n->n_conds - 1])) != DUET_OK)
                        return st;
                    st = jj_parse_body(p, &n->bodies[n->n_conds - 1], if_ends, 3, &end);
                } else {
                    st = jj_parse_body(p, &n->els, if_ends + 2, 1, &end);
                }
                if (st != DUET_OK)
                    return st;
                if (end == NULL)
                    return JJ_PERR(p, c->tag_off, "unclosed 'if' (no 'endif')");
                jj_tok_t *e = &p->toks[p->ti - 1];
                if (strcmp(end, "endif") == 0) {
                    if (jj_peek(p)->kind != JT_END)
                        return JJ_PERR(p, jj_peek(p)->off, "unexpected text after 'endif'");
                    break;
                }
                if (strcmp(end, "else") == 0) {
                    if (jj_peek(p)->kind != JT_END)
                        return JJ_PERR(p, jj_peek(p)->off, "unexpected text after 'else'");
                    in_else = true;
                }
                (void)e;
            }
            p->depth--;
        } else if (jj_is_name(p, kw, "for")) {
            if ((st = jj_enter(p, kw->off)) != DUET_OK)
                return st;
            jj_node_t *n = jj_node_new(p, JN_FOR, c->tag_off);
            if (n == NULL)
                return DUET_ERR_NOMEM;
            if ((st = jj_body_push(body, n)) != DUET_OK)
                return st;
            jj_tok_t *v = jj_peek(p);
            if (v->kind != JT_NAME)
                return JJ_PERR(p, v->off, "expected a loop variable name");
            p->ti++;
            if (jj_is_op(jj_peek(p), ","))
                return JJ_PERR(p, jj_peek(p)->off, "tuple unpacking in 'for' is not supported");
            if (!jj_is_name(p, jj_peek(p), "in"))
                return JJ_PERR(p, jj_peek(p)->off, "expected 'in'");
            p->ti++;
            n->name = p->src + v->off;
            n->name_len = v->len;
            if (jj_is_name(p, v, "loop"))
                return JJ_PERR(p, v->off, "'loop' cannot be a loop variable");
            if ((st = jj_parse_expr(p, &n->expr)) != DUET_OK)
                return st;
            if (jj_peek(p)->kind != JT_END)
                return JJ_PERR(p, jj_peek(p)->off,
                               "unsupported 'for' syntax (no 'if' filter or 'recursive')");
            static const char *const for_ends[] = {"endfor", "else"};
            const char *end = NULL;
            if ((st = jj_parse_body(p, &n->body, for_ends, 2, &end)) != DUET_OK)
                return st;
            if (end == NULL)
                return JJ_PERR(p, c->tag_off, "unclosed 'for' (no 'endfor')");
            if (strcmp(end, "else") == 0)
                return JJ_PERR(p, p->toks[p->ti - 1].off, "'else' in 'for' is not supported");
            if (jj_peek(p)->kind != JT_END)
                return JJ_PERR(p, jj_peek(p)->off, "unexpected text after 'endfor'");
            p->depth--;
        } else if (jj_is_name(p, kw, "set")) {
            jj_tok_t *v = jj_peek(p);
            if (v->kind != JT_NAME)
                return JJ_PERR(p, v->off, "expected a variable name after 'set'");
            p->ti++;
            if (!jj_is_op(jj_peek(p), "="))
                return JJ_PERR(p, jj_peek(p)->off,
                               "expected '=' (block set, attribute set and tuples are not "
                               "supported)");
            p->ti++;
            jj_node_t *n = jj_node_new(p, JN_SET, c->tag_off);
            if (n == NULL)
                return DUET_ERR_NOMEM;
            n->name = p->src + v->off;
            n->name_len = v->len;
            if ((st = jj_parse_full_expr(p, &n->expr)) != DUET_OK ||
                (st = jj_body_push(body, n)) != DUET_OK)
                return st;
        } else {
            return JJ_PERR(p, kw->off, "unknown or misplaced tag '%.*s'",
                           (int)(kw->len > 64 ? 64 : kw->len), p->src + kw->off);
        }
    }
    return DUET_OK;
}

void duet_jinja_destroy(duet_jinja_t *tmpl)
{
    if (tmpl == NULL)
        return;
    jj_body_free(&tmpl->root);
    jj_arena_free(&tmpl->arena);
    free(tmpl->src);
    free(tmpl->source);
    free(tmpl);
}

duet_status_t duet_jinja_parse(const char *text, size_t len, const char *source,
                               duet_jinja_t **tmpl_p)
{
    if ((text == NULL && len > 0) || source == NULL || tmpl_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "jinja: NULL argument");
    duet_jinja_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "%s: no memory", source);
    t->src = malloc(len + 1);
    t->source = strdup(source);
    if (t->src == NULL || t->source == NULL) {
        duet_jinja_destroy(t);
        return duet_error_set(DUET_ERR_NOMEM, "%s: no memory", source);
    }
    if (len > 0)
        memcpy(t->src, text, len);
    t->src[len] = '\0';
    t->src_len = len;

    jj_parser_t p = {.t = t, .src = t->src, .len = len};
    duet_status_t st = jj_chunkify(&p);
    const char *end = NULL;
    if (st == DUET_OK)
        st = jj_parse_body(&p, &t->root, NULL, 0, &end);
    free(p.chunks);
    free(p.toks);
    if (st != DUET_OK) {
        if (st == DUET_ERR_NOMEM)
            duet_error_set(st, "%s: no memory", source);
        duet_jinja_destroy(t);
        return st;
    }
    *tmpl_p = t;
    return DUET_OK;
}

/* ---------------------------------------------------------------- rendering */

typedef struct {
    const duet_jinja_t *t;
    jj_arena_t *arena;
    duet_jinja_limits_t lim;
    size_t iterations;
    duet_jinja_output_t *out;
} jj_render_t;

#define JJ_RERR(r, st, off, ...)                                                                  \
    jj_error((st), (r)->t->source, (r)->t->src, (r)->t->src_len, (off), __VA_ARGS__)

static bool jj_truthy(const duet_jinja_value_t *v)
{
    switch (v->kind) {
    case JJ_UNDEF:
    case JJ_NONE: return false;
    case JJ_BOOL: return v->b;
    case JJ_INT: return v->i != 0;
    case JJ_STR: return v->len > 0;
    case JJ_LIST:
    case JJ_MAP: return v->n > 0;
    }
    return false;
}

static bool jj_equal(const duet_jinja_value_t *a, const duet_jinja_value_t *b)
{
    bool an = a->kind == JJ_INT || a->kind == JJ_BOOL, bn = b->kind == JJ_INT || b->kind == JJ_BOOL;
    if (an && bn)
        return (a->kind == JJ_INT ? a->i : a->b) == (b->kind == JJ_INT ? b->i : b->b);
    if (a->kind != b->kind)
        return false;
    switch (a->kind) {
    case JJ_UNDEF:
    case JJ_NONE: return true;
    case JJ_STR: return a->len == b->len && (a->len == 0 || memcmp(a->s, b->s, a->len) == 0);
    case JJ_LIST:
    case JJ_MAP:
        if (a->n != b->n)
            return false;
        for (size_t i = 0; i < a->n; i++)
            if ((a->kind == JJ_MAP && strcmp(a->keys[i], b->keys[i]) != 0) ||
                !jj_equal(a->items[i], b->items[i]))
                return false;
        return true;
    default: return false;
    }
}

static duet_jinja_value_t *jj_map_get(const duet_jinja_value_t *m, const char *k, size_t kl)
{
    for (size_t i = 0; i < m->n; i++)
        if (strlen(m->keys[i]) == kl && memcmp(m->keys[i], k, kl) == 0)
            return m->items[i];
    return &jj_undef_value;
}

static uint8_t jj_origin_at(const duet_jinja_value_t *s, size_t i)
{
    return s->origin == JJ_ORIGIN_MIXED ? s->mask[i] : (uint8_t)s->origin;
}

/* A substring of a string value, keeping per-byte origins. */
static duet_jinja_value_t *jj_substr(jj_arena_t *a, const duet_jinja_value_t *s, size_t off,
                                     size_t len)
{
    duet_jinja_value_t *v = jj_str(a, s->s + off, len, s->origin);
    if (v != NULL && s->origin == JJ_ORIGIN_MIXED) {
        uint8_t *m = jj_alloc(a, len + 1);
        if (m == NULL)
            return NULL;
        memcpy(m, s->mask + off, len);
        v->mask = m;
    }
    return v;
}

static duet_status_t jj_concat(jj_render_t *r, size_t off, const duet_jinja_value_t *a,
                               const duet_jinja_value_t *b, duet_jinja_value_t **v_p)
{
    if (a->len > r->lim.max_output || b->len > r->lim.max_output - a->len)
        return JJ_RERR(r, DUET_ERR_RANGE, off, "string longer than the output limit (%zu bytes)",
                       r->lim.max_output);
    size_t n = a->len + b->len;
    duet_jinja_value_t *v = jj_new(r->arena, JJ_STR);
    char *s = v != NULL ? jj_alloc(r->arena, n + 1) : NULL;
    if (s == NULL)
        return DUET_ERR_NOMEM;
    if (a->len > 0)
        memcpy(s, a->s, a->len);
    if (b->len > 0)
        memcpy(s + a->len, b->s, b->len);
    v->s = s;
    v->len = n;
    if (a->origin == b->origin && a->origin != JJ_ORIGIN_MIXED) {
        v->origin = a->origin;
    } else if (a->len == 0 || b->len == 0) {
        const duet_jinja_value_t *src = a->len == 0 ? b : a;
        v->origin = src->origin;
        v->mask = src->mask;
    } else {
        uint8_t *m = jj_alloc(r->arena, n + 1);
        if (m == NULL)
            return DUET_ERR_NOMEM;
        for (size_t i = 0; i < a->len; i++)
            m[i] = jj_origin_at(a, i);
        for (size_t i = 0; i < b->len; i++)
            m[a->len + i] = jj_origin_at(b, i);
        v->origin = JJ_ORIGIN_MIXED;
        v->mask = m;
    }
    *v_p = v;
    return DUET_OK;
}

static const char *jj_kind_name(jj_kind_t k)
{
    static const char *const names[] = {"undefined", "none", "bool", "int",
                                        "string",    "list", "map"};
    return names[k];
}

static duet_status_t jj_eval(jj_render_t *r, const jj_expr_t *e, const jj_scope_t *sc,
                             duet_jinja_value_t **v_p);

static duet_status_t jj_eval_bin(jj_render_t *r, const jj_expr_t *e, const jj_scope_t *sc,
                                 duet_jinja_value_t **v_p)
{
    duet_jinja_value_t *a = NULL, *b = NULL;
    duet_status_t st = jj_eval(r, e->a, sc, &a);
    if (st != DUET_OK)
        return st;
    if (e->op == JOP_AND || e->op == JOP_OR) {
        /* Python semantics: the deciding operand is the value. */
        if ((e->op == JOP_AND) != jj_truthy(a)) {
            *v_p = a;
            return DUET_OK;
        }
        return jj_eval(r, e->b, sc, v_p);
    }
    if ((st = jj_eval(r, e->b, sc, &b)) != DUET_OK)
        return st;
    bool res = false;
    switch (e->op) {
    case JOP_EQ: res = jj_equal(a, b); break;
    case JOP_NE: res = !jj_equal(a, b); break;
    case JOP_LT:
    case JOP_GT:
    case JOP_LE:
    case JOP_GE: {
        int c;
        if ((a->kind == JJ_INT || a->kind == JJ_BOOL) && (b->kind == JJ_INT || b->kind == JJ_BOOL)) {
            int64_t x = a->kind == JJ_INT ? a->i : a->b, y = b->kind == JJ_INT ? b->i : b->b;
            c = x < y ? -1 : x > y;
        } else if (a->kind == JJ_STR && b->kind == JJ_STR) {
            size_t m = a->len < b->len ? a->len : b->len;
            c = m > 0 ? memcmp(a->s, b->s, m) : 0;
            if (c == 0)
                c = a->len < b->len ? -1 : a->len > b->len;
        } else {
            return JJ_RERR(r, DUET_ERR_INVALID, e->off, "cannot compare %s with %s",
                           jj_kind_name(a->kind), jj_kind_name(b->kind));
        }
        res = e->op == JOP_LT ? c < 0 : e->op == JOP_GT ? c > 0 : e->op == JOP_LE ? c <= 0 : c >= 0;
        break;
    }
    case JOP_IN:
    case JOP_NOTIN:
        if (b->kind == JJ_STR && a->kind == JJ_STR) {
            res = a->len == 0;
            for (size_t i = 0; !res && a->len <= b->len && i <= b->len - a->len; i++)
                res = memcmp(b->s + i, a->s, a->len) == 0;
        } else if (b->kind == JJ_LIST) {
            for (size_t i = 0; !res && i < b->n; i++)
                res = jj_equal(a, b->items[i]);
        } else if (b->kind == JJ_MAP && a->kind == JJ_STR) {
            res = jj_map_get(b, a->s, a->len)->kind != JJ_UNDEF;
        } else if (b->kind == JJ_MAP) {
            res = false;
        } else {
            return JJ_RERR(r, DUET_ERR_INVALID, e->off, "'in' needs a string, list or map, not %s",
                           jj_kind_name(b->kind));
        }
        if (e->op == JOP_NOTIN)
            res = !res;
        break;
    case JOP_ADD:
    case JOP_SUB:
        if (a->kind == JJ_INT && b->kind == JJ_INT) {
            int64_t v;
            bool ovf = e->op == JOP_ADD ? __builtin_add_overflow(a->i, b->i, &v)
                                        : __builtin_sub_overflow(a->i, b->i, &v);
            if (ovf)
                return JJ_RERR(r, DUET_ERR_RANGE, e->off, "integer overflow");
            *v_p = jj_new(r->arena, JJ_INT);
            if (*v_p == NULL)
                return DUET_ERR_NOMEM;
            (*v_p)->i = v;
            return DUET_OK;
        }
        if (e->op == JOP_ADD && a->kind == JJ_STR && b->kind == JJ_STR)
            return jj_concat(r, e->off, a, b, v_p);
        return JJ_RERR(r, DUET_ERR_INVALID, e->off, "cannot apply '%c' to %s and %s",
                       e->op == JOP_ADD ? '+' : '-', jj_kind_name(a->kind), jj_kind_name(b->kind));
    default: break;
    }
    *v_p = jj_new(r->arena, JJ_BOOL);
    if (*v_p == NULL)
        return DUET_ERR_NOMEM;
    (*v_p)->b = res;
    return DUET_OK;
}

static bool jj_name_is(const jj_expr_t *e, const char *name)
{
    return e->name_len == strlen(name) && memcmp(e->name, name, e->name_len) == 0;
}

static duet_status_t jj_eval(jj_render_t *r, const jj_expr_t *e, const jj_scope_t *sc,
                             duet_jinja_value_t **v_p)
{
    duet_jinja_value_t *a = NULL, *b = NULL;
    duet_status_t st = DUET_OK;
    switch (e->kind) {
    case JE_LIT: *v_p = e->lit; return DUET_OK;
    case JE_VAR: *v_p = jj_lookup(sc, e->name, e->name_len); return DUET_OK;
    case JE_ATTR:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK)
            return st;
        *v_p = a->kind == JJ_MAP ? jj_map_get(a, e->name, e->name_len) : &jj_undef_value;
        return DUET_OK;
    case JE_INDEX:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK || (st = jj_eval(r, e->b, sc, &b)) != DUET_OK)
            return st;
        *v_p = &jj_undef_value;
        if (a->kind == JJ_MAP && b->kind == JJ_STR) {
            *v_p = jj_map_get(a, b->s, b->len);
        } else if ((a->kind == JJ_LIST || a->kind == JJ_STR) && b->kind == JJ_INT) {
            size_t n = a->kind == JJ_LIST ? a->n : a->len;
            int64_t i = b->i < 0 ? b->i + (int64_t)n : b->i;
            if (i >= 0 && (uint64_t)i < n)
                *v_p = a->kind == JJ_LIST ? a->items[i] : jj_substr(r->arena, a, (size_t)i, 1);
            if (*v_p == NULL)
                return DUET_ERR_NOMEM;
        }
        return DUET_OK;
    case JE_LIST: {
        duet_jinja_value_t *l = jj_new(r->arena, JJ_LIST);
        if (l == NULL)
            return DUET_ERR_NOMEM;
        for (size_t i = 0; i < e->n_kids; i++) {
            if ((st = jj_eval(r, e->kids[i], sc, &a)) != DUET_OK)
                return st;
            if ((st = jj_grow(r->arena, l)) != DUET_OK)
                return st;
            l->items[l->n++] = a;
        }
        *v_p = l;
        return DUET_OK;
    }
    case JE_BIN: return jj_eval_bin(r, e, sc, v_p);
    case JE_NOT:
    case JE_NEG:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK)
            return st;
        if (e->kind == JE_NEG && (a->kind != JJ_INT || a->i == INT64_MIN))
            return JJ_RERR(r, DUET_ERR_INVALID, e->off, "unary '-' needs an int, not %s",
                           jj_kind_name(a->kind));
        *v_p = jj_new(r->arena, e->kind == JE_NOT ? JJ_BOOL : JJ_INT);
        if (*v_p == NULL)
            return DUET_ERR_NOMEM;
        (*v_p)->b = !jj_truthy(a);
        (*v_p)->i = e->kind == JE_NEG ? -a->i : 0;
        return DUET_OK;
    case JE_TEST: {
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK)
            return st;
        bool res = false;
        if (jj_name_is(e, "string"))
            res = a->kind == JJ_STR;
        else if (jj_name_is(e, "defined"))
            res = a->kind != JJ_UNDEF;
        else if (jj_name_is(e, "undefined"))
            res = a->kind == JJ_UNDEF;
        else if (jj_name_is(e, "none"))
            res = a->kind == JJ_NONE;
        else if (jj_name_is(e, "number"))
            res = a->kind == JJ_INT;
        else if (jj_name_is(e, "mapping"))
            res = a->kind == JJ_MAP;
        else if (jj_name_is(e, "sequence"))
            res = a->kind == JJ_LIST || a->kind == JJ_STR;
        *v_p = jj_new(r->arena, JJ_BOOL);
        if (*v_p == NULL)
            return DUET_ERR_NOMEM;
        (*v_p)->b = res != e->negate;
        return DUET_OK;
    }
    case JE_FILTER:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK)
            return st;
        if (jj_name_is(e, "default")) {
            if (a->kind != JJ_UNDEF) {
                *v_p = a;
                return DUET_OK;
            }
            return jj_eval(r, e->b, sc, v_p);
        }
        if (jj_name_is(e, "length")) {
            if (a->kind != JJ_STR && a->kind != JJ_LIST && a->kind != JJ_MAP)
                return JJ_RERR(r, DUET_ERR_INVALID, e->off, "'length' of %s",
                               jj_kind_name(a->kind));
            *v_p = jj_new(r->arena, JJ_INT);
            if (*v_p == NULL)
                return DUET_ERR_NOMEM;
            (*v_p)->i = (int64_t)(a->kind == JJ_STR ? a->len : a->n);
            return DUET_OK;
        }
        /* trim */
        if (a->kind == JJ_UNDEF) {
            *v_p = jj_str(r->arena, "", 0, DUET_JINJA_ORIGIN_TEMPLATE);
            return *v_p != NULL ? DUET_OK : DUET_ERR_NOMEM;
        }
        if (a->kind != JJ_STR)
            return JJ_RERR(r, DUET_ERR_INVALID, e->off, "'trim' of %s", jj_kind_name(a->kind));
        {
            size_t s = 0, n = a->len;
            while (s < n && jj_isspace(a->s[s]))
                s++;
            while (n > s && jj_isspace(a->s[n - 1]))
                n--;
            *v_p = jj_substr(r->arena, a, s, n - s);
            return *v_p != NULL ? DUET_OK : DUET_ERR_NOMEM;
        }
    }
    return JJ_RERR(r, DUET_ERR_INTERNAL, e->off, "bad expression node");
}

static duet_status_t jj_emit(jj_render_t *r, size_t off, const char *s, size_t len, uint8_t origin)
{
    duet_jinja_output_t *o = r->out;
    if (len == 0)
        return DUET_OK;
    if (o->text.len > r->lim.max_output || len > r->lim.max_output - o->text.len)
        return JJ_RERR(r, DUET_ERR_RANGE, off, "output longer than the limit (%zu bytes)",
                       r->lim.max_output);
    size_t at = o->text.len;
    duet_status_t st = duet_strbuf_append(&o->text, s, len);
    if (st != DUET_OK)
        return st;
    if (o->n_segs > 0 && o->segs[o->n_segs - 1].origin == (duet_jinja_origin_t)origin) {
        o->segs[o->n_segs - 1].len += len;
        return DUET_OK;
    }
    if (o->n_segs == o->cap_segs) {
        size_t cap = o->cap_segs == 0 ? 16 : o->cap_segs * 2;
        duet_jinja_segment_t *segs = realloc(o->segs, cap * sizeof(*segs));
        if (segs == NULL)
            return DUET_ERR_NOMEM;
        o->segs = segs;
        o->cap_segs = cap;
    }
    o->segs[o->n_segs++] =
        (duet_jinja_segment_t){.off = at, .len = len, .origin = (duet_jinja_origin_t)origin};
    return DUET_OK;
}

static duet_status_t jj_emit_value(jj_render_t *r, size_t off, const duet_jinja_value_t *v)
{
    char buf[32];
    switch (v->kind) {
    case JJ_UNDEF: return DUET_OK;
    case JJ_NONE: return jj_emit(r, off, "None", 4, DUET_JINJA_ORIGIN_TEMPLATE);
    case JJ_BOOL:
        return jj_emit(r, off, v->b ? "True" : "False", v->b ? 4 : 5, DUET_JINJA_ORIGIN_TEMPLATE);
    case JJ_INT: {
        int n = snprintf(buf, sizeof(buf), "%" PRId64, v->i);
        return jj_emit(r, off, buf, (size_t)n, DUET_JINJA_ORIGIN_TEMPLATE);
    }
    case JJ_STR:
        if (v->origin != JJ_ORIGIN_MIXED)
            return jj_emit(r, off, v->s, v->len, (uint8_t)v->origin);
        for (size_t i = 0; i < v->len;) {
            size_t j = i;
            while (j < v->len && v->mask[j] == v->mask[i])
                j++;
            duet_status_t st = jj_emit(r, off, v->s + i, j - i, v->mask[i]);
            if (st != DUET_OK)
                return st;
            i = j;
        }
        return DUET_OK;
    default:
        return JJ_RERR(r, DUET_ERR_INVALID, off, "cannot render a %s", jj_kind_name(v->kind));
    }
}

static duet_status_t jj_run(jj_render_t *r, const jj_body_t *body, jj_scope_t *sc);

static duet_status_t jj_run_for(jj_render_t *r, const jj_node_t *n, jj_scope_t *sc)
{
    duet_jinja_value_t *it = NULL;
    duet_status_t st = jj_eval(r, n->expr, sc, &it);
    if (st != DUET_OK)
        return st;
    if (it->kind == JJ_UNDEF || it->kind == JJ_NONE)
        return DUET_OK; /* Jinja iterates an undefined as empty */
    if (it->kind != JJ_LIST && it->kind != JJ_MAP && it->kind != JJ_STR)
        return JJ_RERR(r, DUET_ERR_INVALID, n->off, "cannot iterate over %s",
                       jj_kind_name(it->kind));
    size_t count = it->kind == JJ_STR ? it->len : it->n;
    for (size_t i = 0; i < count; i++) {
        if (++r->iterations > r->lim.max_iterations)
            return JJ_RERR(r, DUET_ERR_RANGE, n->off, "more than %zu loop iterations",
                           r->lim.max_iterations);
        jj_scope_t inner = {.parent = sc};
        duet_jinja_value_t *item;
        if (it->kind == JJ_LIST)
            item = it->items[i];
        else if (it->kind == JJ_MAP)
            item = jj_str(r->arena, it->keys[i], strlen(it->keys[i]), DUET_JINJA_ORIGIN_DATA);
        else
            item = jj_substr(r->arena, it, i, 1);
        duet_jinja_value_t *loop = jj_new(r->arena, JJ_MAP);
        if (item == NULL || loop == NULL)
            return DUET_ERR_NOMEM;
        static const char *const keys[] = {"first", "last", "index", "index0", "length"};
        duet_jinja_value_t *vals[5];
        for (int k = 0; k < 5; k++)
            if ((vals[k] = jj_new(r->arena, k < 2 ? JJ_BOOL : JJ_INT)) == NULL)
                return DUET_ERR_NOMEM;
        vals[0]->b = i == 0;
        vals[1]->b = i + 1 == count;
        vals[2]->i = (int64_t)i + 1;
        vals[3]->i = (int64_t)i;
        vals[4]->i = (int64_t)count;
        loop->keys = (const char **)keys;
        loop->items = jj_alloc(r->arena, 5 * sizeof(*loop->items));
        if (loop->items == NULL)
            return DUET_ERR_NOMEM;
        memcpy(loop->items, vals, sizeof(vals));
        loop->n = loop->cap = 5;
        if ((st = jj_scope_set(r->arena, &inner, "loop", 4, loop)) != DUET_OK ||
            (st = jj_scope_set(r->arena, &inner, n->name, n->name_len, item)) != DUET_OK ||
            (st = jj_run(r, &n->body, &inner)) != DUET_OK)
            return st;
    }
    return DUET_OK;
}

static duet_status_t jj_run(jj_render_t *r, const jj_body_t *body, jj_scope_t *sc)
{
    duet_status_t st = DUET_OK;
    for (size_t i = 0; i < body->n && st == DUET_OK; i++) {
        const jj_node_t *n = body->nodes[i];
        duet_jinja_value_t *v = NULL;
        switch (n->kind) {
        case JN_TEXT: st = jj_emit(r, n->off, n->text, n->len, DUET_JINJA_ORIGIN_TEMPLATE); break;
        case JN_OUTPUT:
            if ((st = jj_eval(r, n->expr, sc, &v)) == DUET_OK)
                st = jj_emit_value(r, n->off, v);
            break;
        case JN_SET:
            if ((st = jj_eval(r, n->expr, sc, &v)) == DUET_OK)
                st = jj_scope_set(r->arena, sc, n->name, n->name_len, v);
            break;
        case JN_IF: {
            const jj_body_t *chosen = &n->els;
            for (size_t k = 0; k < n->n_conds && st == DUET_OK; k++) {
                if ((st = jj_eval(r, n->conds[k], sc, &v)) == DUET_OK && jj_truthy(v)) {
                    chosen = &n->bodies[k];
                    break;
                }
            }
            if (st == DUET_OK)
                st = jj_run(r, chosen, sc);
            break;
        }
        case JN_FOR: st = jj_run_for(r, n, sc); break;
        }
    }
    return st;
}

void duet_jinja_output_free(duet_jinja_output_t *out)
{
    if (out == NULL)
        return;
    duet_strbuf_free(&out->text);
    free(out->segs);
    memset(out, 0, sizeof(*out));
}

duet_status_t duet_jinja_render(const duet_jinja_t *tmpl, duet_jinja_vars_t *vars,
                                const duet_jinja_limits_t *lim, duet_jinja_output_t *out)
{
    if (tmpl == NULL || vars == NULL || out == NULL)
        return duet_error_set(DUET_ERR_INVALID, "jinja: NULL argument");
    memset(out, 0, sizeof(*out));
    jj_render_t r = {.t = tmpl,
                     .arena = &vars->arena,
                     .lim = lim != NULL ? *lim : duet_jinja_limits_default,
                     .out = out};
    /* Top-level set writes a scope of its own, so a render leaves the globals unchanged. */
    jj_scope_t top = {.parent = &vars->globals};
    duet_status_t st = jj_run(&r, &tmpl->root, &top);
    if (st == DUET_OK)
        st = duet_strbuf_status(&out->text);
    if (st != DUET_OK) {
        if (st == DUET_ERR_NOMEM)
            duet_error_set(st, "%s: out of memory while rendering (arena limit %zu bytes)",
                           tmpl->source, vars->arena.limit);
        duet_jinja_output_free(out);
    }
    return st;
}
