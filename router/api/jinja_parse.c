/*
 * The Jinja parser (see jinja.h): jinja2's lexer and grammar, as transformers configures the
 * environment (trim_blocks, lstrip_blocks, no trailing newline kept, loop controls, the
 * {% generation %} block).
 *
 * The whole template is parsed once, at load, so anything malformed or outside what duet runs is
 * refused there with "source:L:C: message" instead of failing a request later. The lexer follows
 * jinja2's: newlines normalised and one trailing newline dropped, whitespace control with '-',
 * '+' to keep lstrip off, lstrip_blocks only where the tag starts a line, and the end of a tag
 * recognised only while brackets are balanced. The parser follows jinja2's precedence (filters
 * and tests bind tighter than arithmetic; `not x is y` is `not (x is y)`). Every recursion counts
 * depth, bounded by DUET_JINJA_MAX_DEPTH, which later bounds the evaluator's recursion too.
 */
#include "router/api/jinja_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum {
    JT_END = 0, /* end of template */
    JT_DATA,
    JT_VAR_BEGIN,
    JT_VAR_END,
    JT_BLOCK_BEGIN,
    JT_BLOCK_END,
    JT_NAME,
    JT_STR,
    JT_INT,
    JT_FLOAT,
    JT_OP,
} jt_kind_t;

typedef struct {
    jt_kind_t kind;
    size_t off, len; /* source bytes (DATA: the text kept) */
    char op[3];
    int64_t ival;
    double fval;
    char *sval; /* STR: decoded (template arena) */
    size_t slen;
} jj_tok_t;

typedef struct {
    duet_jinja_t *t;
    const char *src;
    size_t len;
    jj_tok_t *toks;
    size_t n_toks, cap_toks, ti;
    unsigned depth;
    int loops; /* for bodies we are inside (break/continue) */
    int macros;
} jj_parser_t;

#define JJ_PERR(p, off, ...)                                                                       \
    jj_error(DUET_ERR_FORMAT, (p)->t->source, (p)->src, (p)->len, (off), __VA_ARGS__)

/* ---------------------------------------------------------------- source */

/* jinja2 reads the source as str.splitlines() joined by '\n': every line break becomes '\n', and
 * the final one is dropped (keep_trailing_newline is off). */
static char *jj_normalise(const char *text, size_t len, size_t *out_len)
{
    char *out = malloc(len + 1);
    if (out == NULL)
        return NULL;
    size_t o = 0;
    bool ends_break = false;
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)text[i];
        size_t brk = 0;
        if (c == '\r')
            brk = i + 1 < len && text[i + 1] == '\n' ? 2 : 1;
        else if (c == '\n' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e)
            brk = 1;
        else if (c == 0xc2 && i + 1 < len && (unsigned char)text[i + 1] == 0x85)
            brk = 2;
        else if (c == 0xe2 && i + 2 < len && (unsigned char)text[i + 1] == 0x80 &&
                 ((unsigned char)text[i + 2] == 0xa8 || (unsigned char)text[i + 2] == 0xa9))
            brk = 3;
        if (brk > 0) {
            out[o++] = '\n';
            i += brk;
            ends_break = i == len;
        } else {
            out[o++] = text[i++];
        }
    }
    if (ends_break)
        o--;
    out[o] = '\0';
    *out_len = o;
    return out;
}

/* ---------------------------------------------------------------- lexer */

static duet_status_t jj_tok_push(jj_parser_t *p, jj_tok_t t)
{
    if (p->n_toks == p->cap_toks) {
        size_t cap = p->cap_toks == 0 ? 64 : p->cap_toks * 2;
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

/* Length of the whitespace (Python's \s) at s[i], 0 if none. */
static size_t jj_space_at(const char *s, size_t len, size_t i)
{
    if (i >= len)
        return 0;
    size_t k = i;
    uint32_t c = jj_utf8_next(s, len, &k);
    return duet_unicode_isspace(c) ? k - i : 0;
}

static size_t jj_skip_space(const char *s, size_t len, size_t i)
{
    size_t n;
    while ((n = jj_space_at(s, len, i)) > 0)
        i += n;
    return i;
}

/* Start of the trailing whitespace of s[from, to). */
static size_t jj_rstrip(const char *s, size_t from, size_t to)
{
    while (to > from) {
        size_t k = to - 1;
        while (k > from && ((unsigned char)s[k] & 0xc0) == 0x80)
            k--;
        size_t e = k;
        if (!duet_unicode_isspace(jj_utf8_next(s, to, &e)))
            break;
        to = k;
    }
    return to;
}

/* Decode a string literal s[i] (a quote) as Python's unicode-escape does; *end_p after it. */
static duet_status_t jj_lex_string(jj_parser_t *p, size_t i, jj_tok_t *t, size_t *end_p)
{
    const char *s = p->src;
    char q = s[i];
    size_t j = i + 1;
    while (j < p->len && s[j] != q) {
        if (s[j] == '\\')
            j++;
        j++;
    }
    if (j >= p->len)
        return JJ_PERR(p, i, "unexpected end of string literal");
    char *buf = jj_alloc(&p->t->arena, j - i + 1);
    if (buf == NULL)
        return DUET_ERR_NOMEM;
    size_t n = 0;
    for (size_t k = i + 1; k < j;) {
        if (s[k] != '\\') {
            buf[n++] = s[k++];
            continue;
        }
        char e = s[k + 1];
        size_t at = k;
        k += 2;
        uint32_t cp = 0;
        int hexn = 0;
        switch (e) {
        case '\n':
            continue;
        case '\\':
            buf[n++] = '\\';
            continue;
        case '\'':
            buf[n++] = '\'';
            continue;
        case '"':
            buf[n++] = '"';
            continue;
        case 'a':
            buf[n++] = '\a';
            continue;
        case 'b':
            buf[n++] = '\b';
            continue;
        case 'f':
            buf[n++] = '\f';
            continue;
        case 'n':
            buf[n++] = '\n';
            continue;
        case 'r':
            buf[n++] = '\r';
            continue;
        case 't':
            buf[n++] = '\t';
            continue;
        case 'v':
            buf[n++] = '\v';
            continue;
        case 'x':
            hexn = 2;
            break;
        case 'u':
            hexn = 4;
            break;
        case 'U':
            hexn = 8;
            break;
        case 'N':
            return JJ_PERR(p, at, "'\\N{...}' escapes are not supported");
        default:
            if (e >= '0' && e <= '7') {
                cp = (uint32_t)(e - '0');
                for (int d = 0; d < 2 && k < j && s[k] >= '0' && s[k] <= '7'; d++)
                    cp = cp * 8 + (uint32_t)(s[k++] - '0');
                n += jj_utf8_put(buf + n, cp);
                continue;
            }
            buf[n++] = '\\'; /* unknown escapes stay as they are */
            k--;
            continue;
        }
        for (int d = 0; d < hexn; d++, k++) {
            char h = k < j ? s[k] : 0;
            int v = h >= '0' && h <= '9'   ? h - '0'
                    : h >= 'a' && h <= 'f' ? h - 'a' + 10
                    : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                           : -1;
            if (v < 0)
                return JJ_PERR(p, at, "truncated \\%c escape in a string literal", e);
            cp = cp * 16 + (uint32_t)v;
        }
        if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return JJ_PERR(p, at, "escape \\%c names no character (or a surrogate)", e);
        n += jj_utf8_put(buf + n, cp);
    }
    buf[n] = '\0';
    t->kind = JT_STR;
    t->sval = buf;
    t->slen = n;
    *end_p = j + 1;
    return DUET_OK;
}

/* Lex the inside of a {{ }} or {% %} tag from i; *end_p after its closing marker. */
static duet_status_t jj_lex_tag(jj_parser_t *p, size_t i, bool block, size_t *end_p)
{
    const char *s = p->src;
    size_t len = p->len;
    char stack[DUET_JINJA_MAX_DEPTH];
    int sp = 0;
    duet_status_t st;
    size_t tag_off = i;
    for (;;) {
        i = jj_skip_space(s, len, i);
        if (i >= len)
            return JJ_PERR(p, tag_off, "unexpected end of template, expected the end of this %s",
                           block ? "statement ('%}')" : "expression ('}}')");
        if (sp == 0) {
            char c1 = block ? '%' : '}';
            size_t e = 0;
            bool strip = false, keep = false;
            if (s[i] == '-' && i + 2 < len && s[i + 1] == c1 && s[i + 2] == '}')
                e = i + 3, strip = true;
            else if (block && s[i] == '+' && i + 2 < len && s[i + 1] == '%' && s[i + 2] == '}')
                e = i + 3, keep = true;
            else if (s[i] == c1 && i + 1 < len && s[i + 1] == '}')
                e = i + 2;
            if (e > 0) {
                if ((st = jj_tok_push(p, (jj_tok_t){.kind = block ? JT_BLOCK_END : JT_VAR_END,
                                                    .off = i})) != DUET_OK)
                    return st;
                if (strip)
                    e = jj_skip_space(s, len, e);
                else if (block && !keep && e < len && s[e] == '\n')
                    e++; /* trim_blocks */
                *end_p = e;
                return DUET_OK;
            }
        }
        jj_tok_t t = {.off = i};
        char c = s[i];
        if (jj_isalpha(c)) {
            while (i < len && (jj_isalpha(s[i]) || jj_isdigit(s[i])))
                i++;
            t.kind = JT_NAME;
        } else if (c == '0' && i + 2 < len && strchr("xXoObB", s[i + 1]) != NULL &&
                   (jj_isdigit(s[i + 2]) || strchr("abcdefABCDEF_", s[i + 2]) != NULL)) {
            /* 0x1f, 0o17, 0b101 (with single underscores between digits) */
            int base = (s[i + 1] | 32) == 'x' ? 16 : (s[i + 1] | 32) == 'o' ? 8 : 2;
            size_t k = i + 2;
            t.kind = JT_INT;
            for (; k < len; k++) {
                char d = s[k];
                if (d == '_' && k + 1 < len && s[k + 1] != '_')
                    continue;
                int v = jj_isdigit(d)                        ? d - '0'
                        : (d | 32) >= 'a' && (d | 32) <= 'f' ? (d | 32) - 'a' + 10
                                                             : 99;
                if (v >= base)
                    break;
                if (t.ival > (INT64_MAX - v) / base)
                    return JJ_PERR(p, i, "integer literal too large");
                t.ival = t.ival * base + v;
            }
            i = k;
        } else if (jj_isdigit(c)) {
            size_t k = i;
            bool is_float = false;
            while (k < len &&
                   (jj_isdigit(s[k]) || (s[k] == '_' && k + 1 < len && jj_isdigit(s[k + 1]))))
                k++;
            if (k + 1 < len && s[k] == '.' && jj_isdigit(s[k + 1])) {
                is_float = true;
                k++;
                while (k < len &&
                       (jj_isdigit(s[k]) || (s[k] == '_' && k + 1 < len && jj_isdigit(s[k + 1]))))
                    k++;
            }
            if (k < len && (s[k] == 'e' || s[k] == 'E')) {
                size_t m = k + 1;
                if (m < len && (s[m] == '+' || s[m] == '-'))
                    m++;
                if (m < len && jj_isdigit(s[m])) {
                    is_float = true;
                    k = m;
                    while (k < len && jj_isdigit(s[k]))
                        k++;
                }
            }
            char num[64];
            size_t nn = 0;
            for (size_t m = i; m < k && nn < sizeof(num) - 1; m++)
                if (s[m] != '_')
                    num[nn++] = s[m];
            num[nn] = '\0';
            if (k - i >= sizeof(num))
                return JJ_PERR(p, i, "number literal too long");
            if (is_float) {
                t.kind = JT_FLOAT;
                t.fval = strtod(num, NULL);
            } else {
                t.kind = JT_INT;
                for (size_t m = 0; m < nn; m++) {
                    if (t.ival > (INT64_MAX - (num[m] - '0')) / 10)
                        return JJ_PERR(p, i, "integer literal too large (beyond 64 bits)");
                    t.ival = t.ival * 10 + (num[m] - '0');
                }
            }
            i = k;
        } else if (c == '\'' || c == '"') {
            if ((st = jj_lex_string(p, i, &t, &i)) != DUET_OK)
                return st;
        } else {
            static const char *const ops2[] = {"//", "**", "==", "!=", ">=", "<="};
            static const char ops1[] = "+-/*%~[](){}><=.:|,;";
            t.kind = JT_OP;
            bool two = false;
            for (size_t k = 0; k < 6 && i + 1 < len; k++)
                if (s[i] == ops2[k][0] && s[i + 1] == ops2[k][1])
                    two = true;
            if (two) {
                t.op[0] = s[i];
                t.op[1] = s[i + 1];
                i += 2;
            } else if (c != '\0' && strchr(ops1, c) != NULL) {
                t.op[0] = c;
                i++;
            } else {
                return JJ_PERR(p, i, "unexpected character '%c'",
                               (unsigned char)c >= 0x20 && (unsigned char)c < 0x7f ? c : '?');
            }
            if (c == '(' || c == '[' || c == '{') {
                if (sp == DUET_JINJA_MAX_DEPTH)
                    return JJ_PERR(p, t.off, "nesting deeper than %d (brackets)",
                                   DUET_JINJA_MAX_DEPTH);
                stack[sp++] = c == '(' ? ')' : c == '[' ? ']' : '}';
            } else if (c == ')' || c == ']' || c == '}') {
                if (sp == 0 || stack[sp - 1] != c)
                    return JJ_PERR(p, t.off, "unexpected '%c'", c);
                sp--;
            }
        }
        t.len = i - t.off;
        if ((st = jj_tok_push(p, t)) != DUET_OK)
            return st;
    }
}

/* Is s[i..] "{%[-+]? name [-+]?%}"? Returns the end of the tag (0 if not) and the signs. */
static size_t jj_match_simple_tag(const char *s, size_t len, size_t i, const char *name,
                                  char *lsign, char *rsign)
{
    if (i + 1 >= len || s[i] != '{' || s[i + 1] != '%')
        return 0;
    size_t k = i + 2;
    *lsign = 0;
    if (k < len && (s[k] == '-' || s[k] == '+'))
        *lsign = s[k++];
    k = jj_skip_space(s, len, k);
    size_t nl = strlen(name);
    if (len - k < nl || memcmp(s + k, name, nl) != 0)
        return 0;
    k = jj_skip_space(s, len, k + nl);
    *rsign = 0;
    if (k < len && (s[k] == '-' || s[k] == '+'))
        *rsign = s[k++];
    if (k + 1 < len && s[k] == '%' && s[k + 1] == '}')
        return k + 2;
    return 0;
}

/* After a block tag ending at e with right sign rs: trim_blocks or '-' stripping. */
static size_t jj_after_block(const char *s, size_t len, size_t e, char rs)
{
    if (rs == '-')
        return jj_skip_space(s, len, e);
    if (rs != '+' && e < len && s[e] == '\n')
        return e + 1;
    return e;
}

/* Text s[from, to) before a tag of kind k ('{', '%', '#') with sign: where the kept text ends. */
static size_t jj_text_end(const char *s, size_t from, size_t to, char kind, char sign,
                          bool line_starting)
{
    if (sign == '-')
        return jj_rstrip(s, from, to);
    if (sign == '+' || kind == '{')
        return to;
    /* lstrip_blocks: whitespace alone between the start of the line and the tag goes. */
    size_t l = to;
    while (l > from && s[l - 1] != '\n')
        l--;
    if (l == from && !line_starting)
        return to;
    if (l < to && jj_rstrip(s, l, to) == l)
        return l;
    return to;
}

static duet_status_t jj_lex(jj_parser_t *p)
{
    const char *s = p->src;
    size_t len = p->len, i = 0;
    bool line_starting = true;
    duet_status_t st = DUET_OK;
    while (i < len) {
        size_t j = i;
        while (j + 1 < len &&
               !(s[j] == '{' && (s[j + 1] == '{' || s[j + 1] == '%' || s[j + 1] == '#')))
            j++;
        if (j + 1 >= len) {
            st = jj_tok_push(p, (jj_tok_t){.kind = JT_DATA, .off = i, .len = len - i});
            break;
        }
        char kind = s[j + 1];
        char sign = j + 2 < len && (s[j + 2] == '-' || s[j + 2] == '+') ? s[j + 2] : 0;
        char rl, rr;
        size_t raw_end = kind == '%' ? jj_match_simple_tag(s, len, j, "raw", &rl, &rr) : 0;
        size_t te = jj_text_end(s, i, j, kind, sign, line_starting);
        if (te > i &&
            (st = jj_tok_push(p, (jj_tok_t){.kind = JT_DATA, .off = i, .len = te - i})) != DUET_OK)
            return st;
        size_t in = j + 2 + (sign != 0);
        if (raw_end > 0) {
            size_t body = jj_after_block(s, len, raw_end, rr), k = body, end = 0;
            for (; k + 1 < len; k++)
                if ((end = jj_match_simple_tag(s, len, k, "endraw", &rl, &rr)) > 0)
                    break;
            if (end == 0)
                return JJ_PERR(p, j, "unclosed 'raw' (no 'endraw')");
            size_t be = jj_text_end(s, body, k, '%', rl, body == k ? false : false);
            if (rl != '-' && rl != '+') {
                /* lstrip_blocks applies to endraw as to any block tag. */
                size_t l = k;
                while (l > body && s[l - 1] != '\n')
                    l--;
                be = (l > body || (l == body && s[body - 1] == '\n')) && jj_rstrip(s, l, k) == l
                         ? l
                         : k;
            }
            if (be > body &&
                (st = jj_tok_push(p, (jj_tok_t){.kind = JT_DATA, .off = body, .len = be - body})) !=
                    DUET_OK)
                return st;
            i = jj_after_block(s, len, end, rr);
            line_starting = i > 0 && s[i - 1] == '\n';
            continue;
        }
        if (kind == '#') {
            size_t k = in;
            while (k + 1 < len && !(s[k] == '#' && s[k + 1] == '}'))
                k++;
            if (k + 1 >= len)
                return JJ_PERR(p, j, "unclosed comment (no '#}')");
            char rs = k > in && (s[k - 1] == '-' || s[k - 1] == '+') ? s[k - 1] : 0;
            i = jj_after_block(s, len, k + 2, rs);
        } else {
            bool block = kind == '%';
            if ((st = jj_tok_push(p, (jj_tok_t){.kind = block ? JT_BLOCK_BEGIN : JT_VAR_BEGIN,
                                                .off = j})) != DUET_OK ||
                (st = jj_lex_tag(p, in, block, &i)) != DUET_OK)
                return st;
        }
        line_starting = i > 0 && s[i - 1] == '\n';
    }
    if (st == DUET_OK)
        st = jj_tok_push(p, (jj_tok_t){.kind = JT_END, .off = len});
    return st;
}

/* ---------------------------------------------------------------- token helpers */

static jj_tok_t *jj_peek(jj_parser_t *p)
{
    return &p->toks[p->ti];
}

static jj_tok_t *jj_peek2(jj_parser_t *p)
{
    return p->ti + 1 < p->n_toks ? &p->toks[p->ti + 1] : &p->toks[p->n_toks - 1];
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

static const char *jj_tok_desc(const jj_parser_t *p, const jj_tok_t *t, char *buf, size_t cap)
{
    switch (t->kind) {
    case JT_END:
        return "end of template";
    case JT_BLOCK_END:
        return "end of statement block";
    case JT_VAR_END:
        return "end of print statement";
    default:
        snprintf(buf, cap, "'%.*s'", (int)(t->len > 40 ? 40 : t->len), p->src + t->off);
        return buf;
    }
}

static duet_status_t jj_unexpected(jj_parser_t *p, const char *expected)
{
    char buf[64];
    jj_tok_t *t = jj_peek(p);
    return JJ_PERR(p, t->off, "expected %s, got %s", expected, jj_tok_desc(p, t, buf, sizeof(buf)));
}

static duet_status_t jj_expect_op(jj_parser_t *p, const char *op)
{
    if (!jj_is_op(jj_peek(p), op)) {
        char want[8];
        snprintf(want, sizeof(want), "'%s'", op);
        return jj_unexpected(p, want);
    }
    p->ti++;
    return DUET_OK;
}

static duet_status_t jj_expect_block_end(jj_parser_t *p)
{
    if (jj_peek(p)->kind != JT_BLOCK_END)
        return jj_unexpected(p, "the end of the statement ('%}')");
    p->ti++;
    return DUET_OK;
}

static duet_status_t jj_enter(jj_parser_t *p, size_t off)
{
    if (++p->depth > DUET_JINJA_MAX_DEPTH)
        return JJ_PERR(p, off, "nesting deeper than %d", DUET_JINJA_MAX_DEPTH);
    return DUET_OK;
}

/* ---------------------------------------------------------------- vectors in the arena */

typedef struct {
    void **items;
    size_t n, cap;
} jj_vec_t;

static duet_status_t jj_vec_push(jj_parser_t *p, jj_vec_t *v, void *x)
{
    if (v->n == v->cap) {
        size_t cap = v->cap == 0 ? 4 : v->cap * 2;
        void **items = jj_alloc(&p->t->arena, cap * sizeof(*items));
        if (items == NULL)
            return DUET_ERR_NOMEM;
        if (v->n > 0)
            memcpy(items, v->items, v->n * sizeof(*items));
        v->items = items;
        v->cap = cap;
    }
    v->items[v->n++] = x;
    return DUET_OK;
}

/* ---------------------------------------------------------------- expressions */

static duet_status_t jj_parse_expr(jj_parser_t *p, bool condexpr, jj_expr_t **e_p);
static duet_status_t jj_parse_or(jj_parser_t *p, jj_expr_t **e_p);
static duet_status_t jj_parse_unary(jj_parser_t *p, bool with_filter, jj_expr_t **e_p);
static duet_status_t jj_parse_postfix(jj_parser_t *p, jj_expr_t **e_p);

static jj_expr_t *jj_expr_new(jj_parser_t *p, je_kind_t kind, size_t off)
{
    jj_expr_t *e = jj_alloc(&p->t->arena, sizeof(*e));
    if (e != NULL) {
        e->kind = kind;
        e->off = off;
    }
    return e;
}

static jj_expr_t *jj_lit(jj_parser_t *p, size_t off, duet_jinja_value_t *v)
{
    jj_expr_t *e = v != NULL ? jj_expr_new(p, JE_LIT, off) : NULL;
    if (e != NULL)
        e->lit = v;
    return e;
}

/* (a, b, k=v, *args, **kwargs) after '(' has been seen (it is consumed here), in jinja2's order:
 * positional, keyword, then one *expr and one **expr; any other order is a syntax error there. */
static duet_status_t jj_parse_call_args(jj_parser_t *p, jj_expr_t *call)
{
    duet_status_t st = jj_expect_op(p, "(");
    jj_vec_t pos = {0}, kw = {0}, names = {0}, lens = {0};
    bool any = false;
    while (st == DUET_OK && !jj_is_op(jj_peek(p), ")")) {
        if (any && (st = jj_expect_op(p, ",")) != DUET_OK)
            break;
        if (jj_is_op(jj_peek(p), ")"))
            break;
        any = true;
        jj_expr_t *a = NULL;
        if (jj_is_op(jj_peek(p), "*") || jj_is_op(jj_peek(p), "**")) {
            bool two = jj_is_op(jj_peek(p), "**");
            if (call->dstar != NULL || (!two && call->star != NULL)) {
                st = JJ_PERR(p, jj_peek(p)->off, "invalid syntax for function call expression");
                break;
            }
            p->ti++;
            if ((st = jj_parse_expr(p, true, &a)) != DUET_OK)
                break;
            *(two ? &call->dstar : &call->star) = a;
            continue;
        }
        if (call->star != NULL || call->dstar != NULL) {
            st = JJ_PERR(p, jj_peek(p)->off, "invalid syntax for function call expression");
            break;
        }
        if (jj_peek(p)->kind == JT_NAME && jj_is_op(jj_peek2(p), "=")) {
            jj_tok_t *n = jj_peek(p);
            p->ti += 2;
            size_t *l = jj_alloc(&p->t->arena, sizeof(*l));
            if (l == NULL)
                return DUET_ERR_NOMEM;
            *l = n->len;
            if ((st = jj_parse_expr(p, true, &a)) != DUET_OK ||
                (st = jj_vec_push(p, &kw, a)) != DUET_OK ||
                (st = jj_vec_push(p, &names, (void *)(p->src + n->off))) != DUET_OK ||
                (st = jj_vec_push(p, &lens, l)) != DUET_OK)
                break;
            continue;
        }
        if (kw.n > 0) {
            st = JJ_PERR(p, jj_peek(p)->off, "invalid syntax for function call expression");
            break;
        }
        if ((st = jj_parse_expr(p, true, &a)) == DUET_OK)
            st = jj_vec_push(p, &pos, a);
    }
    if (st != DUET_OK)
        return st;
    p->ti++; /* ')' */
    call->args = (jj_expr_t **)pos.items;
    call->n_args = pos.n;
    call->kwargs = (jj_expr_t **)kw.items;
    call->n_kw = kw.n;
    call->kwnames = (const char **)names.items;
    if (kw.n > 0) {
        call->kwlens = jj_alloc(&p->t->arena, kw.n * sizeof(size_t));
        if (call->kwlens == NULL)
            return DUET_ERR_NOMEM;
        for (size_t i = 0; i < kw.n; i++)
            call->kwlens[i] = *(size_t *)lens.items[i];
    }
    return DUET_OK;
}

/* Comma-separated expressions up to `close`; *e_p a LIST, TUPLE (explicit) or the one item. */
static duet_status_t jj_parse_seq(jj_parser_t *p, const char *close, je_kind_t kind, size_t off,
                                  bool paren, jj_expr_t **e_p)
{
    jj_vec_t items = {0};
    bool comma = false;
    duet_status_t st = DUET_OK;
    while (!jj_is_op(jj_peek(p), close)) {
        if (items.n > 0) {
            if ((st = jj_expect_op(p, ",")) != DUET_OK)
                return st;
            comma = true;
            if (jj_is_op(jj_peek(p), close))
                break;
        }
        jj_expr_t *a = NULL;
        if ((st = jj_parse_expr(p, true, &a)) != DUET_OK ||
            (st = jj_vec_push(p, &items, a)) != DUET_OK)
            return st;
    }
    p->ti++;
    if (paren && items.n == 1 && !comma) {
        *e_p = items.items[0];
        return DUET_OK;
    }
    jj_expr_t *e = jj_expr_new(p, kind, off);
    if (e == NULL)
        return DUET_ERR_NOMEM;
    e->args = (jj_expr_t **)items.items;
    e->n_args = items.n;
    *e_p = e;
    return DUET_OK;
}

static duet_status_t jj_parse_primary(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_tok_t *t = jj_peek(p);
    jj_arena_t *a = &p->t->arena;
    duet_status_t st;
    if ((st = jj_enter(p, t->off)) != DUET_OK)
        return st;
    jj_expr_t *e = NULL;
    if (t->kind == JT_STR) {
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        while (jj_peek(p)->kind == JT_STR) {
            duet_strbuf_append(&sb, jj_peek(p)->sval, jj_peek(p)->slen);
            p->ti++;
        }
        if (duet_strbuf_status(&sb) == DUET_OK)
            e = jj_lit(
                p, t->off,
                jj_str(a, sb.data != NULL ? sb.data : "", sb.len, DUET_JINJA_ORIGIN_TEMPLATE));
        duet_strbuf_free(&sb);
        st = e != NULL ? DUET_OK : DUET_ERR_NOMEM;
    } else if (t->kind == JT_INT || t->kind == JT_FLOAT) {
        p->ti++;
        e = jj_lit(p, t->off, t->kind == JT_INT ? jj_int(a, t->ival) : jj_float(a, t->fval));
        st = e != NULL ? DUET_OK : DUET_ERR_NOMEM;
    } else if (t->kind == JT_NAME) {
        p->ti++;
        static const char *const lits[] = {"true", "True", "false", "False", "none", "None"};
        for (size_t k = 0; k < 6 && e == NULL; k++)
            if (jj_is_name(p, t, lits[k]))
                e = jj_lit(p, t->off, k < 4 ? jj_bool(a, k < 2) : jj_new(a, JV_NONE));
        if (e == NULL) {
            e = jj_expr_new(p, JE_NAME, t->off);
            if (e != NULL) {
                e->name = p->src + t->off;
                e->name_len = t->len;
            }
        }
        st = e != NULL ? DUET_OK : DUET_ERR_NOMEM;
    } else if (jj_is_op(t, "(")) {
        p->ti++;
        st = jj_parse_seq(p, ")", JE_TUPLE, t->off, true, &e);
    } else if (jj_is_op(t, "[")) {
        p->ti++;
        st = jj_parse_seq(p, "]", JE_LIST, t->off, false, &e);
    } else if (jj_is_op(t, "{")) {
        p->ti++;
        jj_vec_t keys = {0}, vals = {0};
        while (st == DUET_OK && !jj_is_op(jj_peek(p), "}")) {
            if (keys.n > 0 && ((st = jj_expect_op(p, ",")) != DUET_OK || jj_is_op(jj_peek(p), "}")))
                break;
            jj_expr_t *k = NULL, *v = NULL;
            if ((st = jj_parse_expr(p, true, &k)) != DUET_OK ||
                (st = jj_expect_op(p, ":")) != DUET_OK ||
                (st = jj_parse_expr(p, true, &v)) != DUET_OK ||
                (st = jj_vec_push(p, &keys, k)) != DUET_OK)
                break;
            st = jj_vec_push(p, &vals, v);
        }
        if (st == DUET_OK) {
            p->ti++;
            e = jj_expr_new(p, JE_DICT, t->off);
            if (e == NULL)
                return DUET_ERR_NOMEM;
            e->args = (jj_expr_t **)keys.items;
            e->kwargs = (jj_expr_t **)vals.items;
            e->n_args = keys.n;
        }
    } else {
        st = jj_unexpected(p, "an expression");
    }
    p->depth--;
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

/* After '[': an index, or a slice a:b:c. */
static duet_status_t jj_parse_subscript(jj_parser_t *p, size_t off, jj_expr_t *obj, jj_expr_t **e_p)
{
    jj_expr_t *parts[3] = {NULL, NULL, NULL};
    int n = 0;
    bool slice = false;
    duet_status_t st = DUET_OK;
    for (;;) {
        jj_tok_t *t = jj_peek(p);
        if (jj_is_op(t, ":")) {
            slice = true;
            if (++n > 2)
                return JJ_PERR(p, t->off, "a slice has at most three parts");
            p->ti++;
            continue;
        }
        if (jj_is_op(t, "]"))
            break;
        if (parts[n] != NULL)
            return jj_unexpected(p, "':' or ']'");
        if (jj_is_op(t, ","))
            return JJ_PERR(p, t->off, "tuple subscripts are not supported");
        if ((st = jj_parse_expr(p, true, &parts[n])) != DUET_OK)
            return st;
    }
    p->ti++;
    jj_expr_t *e = jj_expr_new(p, slice ? JE_SLICE : JE_ITEM, off);
    if (e == NULL)
        return DUET_ERR_NOMEM;
    e->a = obj;
    if (!slice && parts[0] == NULL)
        return JJ_PERR(p, off, "expected an index");
    e->b = parts[0];
    e->c = parts[1];
    e->d = parts[2];
    *e_p = e;
    return DUET_OK;
}

static duet_status_t jj_parse_postfix_on(jj_parser_t *p, jj_expr_t *e, jj_expr_t **e_p)
{
    duet_status_t st = DUET_OK;
    for (;;) {
        jj_tok_t *t = jj_peek(p);
        if (jj_is_op(t, ".")) {
            p->ti++;
            jj_tok_t *n = jj_peek(p);
            jj_expr_t *a;
            if (n->kind == JT_NAME) {
                a = jj_expr_new(p, JE_ATTR, t->off);
                if (a == NULL)
                    return DUET_ERR_NOMEM;
                a->name = p->src + n->off;
                a->name_len = n->len;
            } else if (n->kind == JT_INT) {
                a = jj_expr_new(p, JE_ITEM, t->off);
                if (a == NULL || (a->b = jj_lit(p, n->off, jj_int(&p->t->arena, n->ival))) == NULL)
                    return DUET_ERR_NOMEM;
            } else {
                return jj_unexpected(p, "an attribute name after '.'");
            }
            p->ti++;
            a->a = e;
            e = a;
        } else if (jj_is_op(t, "[")) {
            p->ti++;
            if ((st = jj_parse_subscript(p, t->off, e, &e)) != DUET_OK)
                return st;
        } else if (jj_is_op(t, "(")) {
            jj_expr_t *c = jj_expr_new(p, JE_CALL, t->off);
            if (c == NULL)
                return DUET_ERR_NOMEM;
            c->a = e;
            if ((st = jj_parse_call_args(p, c)) != DUET_OK)
                return st;
            e = c;
        } else {
            break;
        }
    }
    *e_p = e;
    return DUET_OK;
}

static duet_status_t jj_parse_postfix(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_expr_t *e = NULL;
    duet_status_t st = jj_parse_primary(p, &e);
    if (st == DUET_OK)
        st = jj_parse_postfix_on(p, e, e_p);
    return st;
}

/* `| name(args)` applied to `obj` (NULL for a filter block / block set: a HOLE). */
static duet_status_t jj_parse_filter(jj_parser_t *p, jj_expr_t *obj, jj_expr_t **e_p)
{
    jj_tok_t *n = jj_peek(p);
    if (n->kind != JT_NAME)
        return jj_unexpected(p, "a filter name");
    int fid = jj_filter_find(p->src + n->off, n->len);
    if (fid < 0)
        return JJ_PERR(p, n->off, "no filter named '%.*s'", (int)(n->len > 64 ? 64 : n->len),
                       p->src + n->off);
    p->ti++;
    jj_expr_t *f = jj_expr_new(p, JE_FILTER, n->off);
    if (f == NULL)
        return DUET_ERR_NOMEM;
    f->fid = fid;
    f->name = p->src + n->off;
    f->name_len = n->len;
    if (obj == NULL && (obj = jj_expr_new(p, JE_HOLE, n->off)) == NULL)
        return DUET_ERR_NOMEM;
    f->a = obj;
    if (jj_is_op(jj_peek(p), "(")) {
        duet_status_t st = jj_parse_call_args(p, f);
        if (st != DUET_OK)
            return st;
    }
    *e_p = f;
    return DUET_OK;
}

static duet_status_t jj_parse_filter_expr(jj_parser_t *p, jj_expr_t *e, jj_expr_t **e_p)
{
    duet_status_t st = DUET_OK;
    for (;;) {
        jj_tok_t *t = jj_peek(p);
        if (jj_is_op(t, "|")) {
            p->ti++;
            if ((st = jj_parse_filter(p, e, &e)) != DUET_OK)
                return st;
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
            if (n->kind != JT_NAME)
                return jj_unexpected(p, "a test name");
            int tid = jj_test_find(p->src + n->off, n->len);
            if (tid < 0)
                return JJ_PERR(p, n->off, "no test named '%.*s'", (int)(n->len > 64 ? 64 : n->len),
                               p->src + n->off);
            p->ti++;
            x->fid = tid;
            x->name = p->src + n->off;
            x->name_len = n->len;
            x->a = e;
            jj_tok_t *a = jj_peek(p);
            if (jj_is_op(a, "(")) {
                if ((st = jj_parse_call_args(p, x)) != DUET_OK)
                    return st;
            } else if ((a->kind == JT_NAME || a->kind == JT_STR || a->kind == JT_INT ||
                        a->kind == JT_FLOAT || jj_is_op(a, "[") || jj_is_op(a, "{")) &&
                       !jj_is_name(p, a, "else") && !jj_is_name(p, a, "or") &&
                       !jj_is_name(p, a, "and")) {
                if (jj_is_name(p, a, "is"))
                    return JJ_PERR(p, a->off, "tests cannot be chained with 'is'");
                jj_expr_t *arg = NULL;
                if ((st = jj_parse_postfix(p, &arg)) != DUET_OK)
                    return st;
                x->args = jj_alloc(&p->t->arena, sizeof(*x->args));
                if (x->args == NULL)
                    return DUET_ERR_NOMEM;
                x->args[0] = arg;
                x->n_args = 1;
            }
            e = x;
        } else if (jj_is_op(t, "(")) {
            jj_expr_t *c = jj_expr_new(p, JE_CALL, t->off);
            if (c == NULL)
                return DUET_ERR_NOMEM;
            c->a = e;
            if ((st = jj_parse_call_args(p, c)) != DUET_OK)
                return st;
            e = c;
        } else {
            break;
        }
    }
    *e_p = e;
    return DUET_OK;
}

static duet_status_t jj_parse_unary(jj_parser_t *p, bool with_filter, jj_expr_t **e_p)
{
    jj_tok_t *t = jj_peek(p);
    duet_status_t st = jj_enter(p, t->off);
    jj_expr_t *e = NULL;
    if (st == DUET_OK && (jj_is_op(t, "-") || jj_is_op(t, "+"))) {
        p->ti++;
        e = jj_expr_new(p, jj_is_op(t, "-") ? JE_NEG : JE_POS, t->off);
        if (e == NULL)
            st = DUET_ERR_NOMEM;
        else
            st = jj_parse_unary(p, false, &e->a);
    } else if (st == DUET_OK) {
        st = jj_parse_primary(p, &e);
    }
    if (st == DUET_OK)
        st = jj_parse_postfix_on(p, e, &e);
    if (st == DUET_OK && with_filter)
        st = jj_parse_filter_expr(p, e, &e);
    p->depth--;
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

static duet_status_t jj_bin(jj_parser_t *p, je_kind_t kind, int op, size_t off, jj_expr_t *a,
                            jj_expr_t *b, jj_expr_t **e_p)
{
    jj_expr_t *e = jj_expr_new(p, kind, off);
    if (e == NULL)
        return DUET_ERR_NOMEM;
    e->op = op;
    e->a = a;
    e->b = b;
    *e_p = e;
    return DUET_OK;
}

static duet_status_t jj_parse_pow(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_expr_t *e = NULL, *r = NULL;
    duet_status_t st = jj_parse_unary(p, true, &e);
    while (st == DUET_OK && jj_is_op(jj_peek(p), "**")) {
        size_t off = jj_peek(p)->off;
        p->ti++;
        if ((st = jj_parse_unary(p, true, &r)) == DUET_OK)
            st = jj_bin(p, JE_BIN, JOP_POW, off, e, r, &e);
    }
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

static duet_status_t jj_parse_math2(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_expr_t *e = NULL, *r = NULL;
    duet_status_t st = jj_parse_pow(p, &e);
    while (st == DUET_OK) {
        jj_tok_t *t = jj_peek(p);
        int op = jj_is_op(t, "*")    ? JOP_MUL
                 : jj_is_op(t, "/")  ? JOP_DIV
                 : jj_is_op(t, "//") ? JOP_FLOORDIV
                 : jj_is_op(t, "%")  ? JOP_MOD
                                     : -1;
        if (op < 0)
            break;
        p->ti++;
        if ((st = jj_parse_pow(p, &r)) == DUET_OK)
            st = jj_bin(p, JE_BIN, op, t->off, e, r, &e);
    }
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

static duet_status_t jj_parse_concat(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_expr_t *e = NULL;
    duet_status_t st = jj_parse_math2(p, &e);
    if (st != DUET_OK || !jj_is_op(jj_peek(p), "~")) {
        if (st == DUET_OK)
            *e_p = e;
        return st;
    }
    jj_vec_t items = {0};
    size_t off = jj_peek(p)->off;
    st = jj_vec_push(p, &items, e);
    while (st == DUET_OK && jj_is_op(jj_peek(p), "~")) {
        p->ti++;
        jj_expr_t *r = NULL;
        if ((st = jj_parse_math2(p, &r)) == DUET_OK)
            st = jj_vec_push(p, &items, r);
    }
    if (st != DUET_OK)
        return st;
    jj_expr_t *c = jj_expr_new(p, JE_CONCAT, off);
    if (c == NULL)
        return DUET_ERR_NOMEM;
    c->args = (jj_expr_t **)items.items;
    c->n_args = items.n;
    *e_p = c;
    return DUET_OK;
}

static duet_status_t jj_parse_math1(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_expr_t *e = NULL, *r = NULL;
    duet_status_t st = jj_parse_concat(p, &e);
    while (st == DUET_OK) {
        jj_tok_t *t = jj_peek(p);
        int op = jj_is_op(t, "+") ? JOP_ADD : jj_is_op(t, "-") ? JOP_SUB : -1;
        if (op < 0)
            break;
        p->ti++;
        if ((st = jj_parse_concat(p, &r)) == DUET_OK)
            st = jj_bin(p, JE_BIN, op, t->off, e, r, &e);
    }
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

static duet_status_t jj_parse_compare(jj_parser_t *p, jj_expr_t **e_p)
{
    static const char *const ops[] = {"==", "!=", "<", ">", "<=", ">="};
    jj_expr_t *e = NULL;
    duet_status_t st = jj_parse_math1(p, &e);
    jj_vec_t operands = {0}, opv = {0};
    size_t off = jj_peek(p)->off;
    while (st == DUET_OK) {
        jj_tok_t *t = jj_peek(p);
        int op = -1;
        for (int k = 0; k < 6; k++)
            if (jj_is_op(t, ops[k]))
                op = k;
        if (op < 0 && jj_is_name(p, t, "in"))
            op = JCMP_IN;
        if (op < 0 && jj_is_name(p, t, "not") && jj_is_name(p, jj_peek2(p), "in")) {
            op = JCMP_NOTIN;
            p->ti++;
        }
        if (op < 0)
            break;
        p->ti++;
        jj_expr_t *r = NULL;
        int *opp = jj_alloc(&p->t->arena, sizeof(int));
        if (opp == NULL)
            return DUET_ERR_NOMEM;
        *opp = op;
        if ((st = jj_parse_math1(p, &r)) == DUET_OK &&
            (st = jj_vec_push(p, &operands, r)) == DUET_OK)
            st = jj_vec_push(p, &opv, opp);
    }
    if (st != DUET_OK)
        return st;
    if (operands.n == 0) {
        *e_p = e;
        return DUET_OK;
    }
    jj_expr_t *c = jj_expr_new(p, JE_CMP, off);
    if (c == NULL || (c->ops = jj_alloc(&p->t->arena, opv.n * sizeof(int))) == NULL)
        return DUET_ERR_NOMEM;
    for (size_t i = 0; i < opv.n; i++)
        c->ops[i] = *(int *)opv.items[i];
    c->a = e;
    c->args = (jj_expr_t **)operands.items;
    c->n_args = operands.n;
    *e_p = c;
    return DUET_OK;
}

static duet_status_t jj_parse_not(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_tok_t *t = jj_peek(p);
    if (!jj_is_name(p, t, "not"))
        return jj_parse_compare(p, e_p);
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

static duet_status_t jj_parse_and(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_expr_t *e = NULL, *r = NULL;
    duet_status_t st = jj_parse_not(p, &e);
    while (st == DUET_OK && jj_is_name(p, jj_peek(p), "and")) {
        size_t off = jj_peek(p)->off;
        p->ti++;
        if ((st = jj_parse_not(p, &r)) == DUET_OK)
            st = jj_bin(p, JE_AND, 0, off, e, r, &e);
    }
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

static duet_status_t jj_parse_or(jj_parser_t *p, jj_expr_t **e_p)
{
    jj_expr_t *e = NULL, *r = NULL;
    duet_status_t st = jj_parse_and(p, &e);
    while (st == DUET_OK && jj_is_name(p, jj_peek(p), "or")) {
        size_t off = jj_peek(p)->off;
        p->ti++;
        if ((st = jj_parse_and(p, &r)) == DUET_OK)
            st = jj_bin(p, JE_OR, 0, off, e, r, &e);
    }
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

/* An expression; with condexpr, `a if b [else c]`. */
static duet_status_t jj_parse_expr(jj_parser_t *p, bool condexpr, jj_expr_t **e_p)
{
    duet_status_t st = jj_enter(p, jj_peek(p)->off);
    jj_expr_t *e = NULL;
    if (st == DUET_OK)
        st = jj_parse_or(p, &e);
    while (st == DUET_OK && condexpr && jj_is_name(p, jj_peek(p), "if")) {
        jj_expr_t *c = jj_expr_new(p, JE_COND, jj_peek(p)->off);
        p->ti++;
        if (c == NULL) {
            st = DUET_ERR_NOMEM;
            break;
        }
        c->b = e;
        if ((st = jj_parse_or(p, &c->a)) != DUET_OK)
            break;
        if (jj_is_name(p, jj_peek(p), "else")) {
            p->ti++;
            st = jj_parse_expr(p, true, &c->c);
        }
        e = c;
    }
    p->depth--;
    if (st == DUET_OK)
        *e_p = e;
    return st;
}

/* A top-level expression of a tag: `a, b` is a tuple. */
static duet_status_t jj_parse_tuple(jj_parser_t *p, bool condexpr, jj_expr_t **e_p)
{
    size_t off = jj_peek(p)->off;
    jj_expr_t *e = NULL;
    duet_status_t st = jj_parse_expr(p, condexpr, &e);
    if (st != DUET_OK || !jj_is_op(jj_peek(p), ",")) {
        if (st == DUET_OK)
            *e_p = e;
        return st;
    }
    jj_vec_t items = {0};
    if ((st = jj_vec_push(p, &items, e)) != DUET_OK)
        return st;
    while (jj_is_op(jj_peek(p), ",")) {
        p->ti++;
        jj_tok_t *t = jj_peek(p);
        if (t->kind == JT_BLOCK_END || t->kind == JT_VAR_END || jj_is_name(p, t, "if") ||
            jj_is_name(p, t, "recursive"))
            break;
        if ((st = jj_parse_expr(p, condexpr, &e)) != DUET_OK ||
            (st = jj_vec_push(p, &items, e)) != DUET_OK)
            return st;
    }
    jj_expr_t *tu = jj_expr_new(p, JE_TUPLE, off);
    if (tu == NULL)
        return DUET_ERR_NOMEM;
    tu->args = (jj_expr_t **)items.items;
    tu->n_args = items.n;
    *e_p = tu;
    return DUET_OK;
}

/* ---------------------------------------------------------------- statements */

static jj_node_t *jj_node_new(jj_parser_t *p, jn_kind_t kind, size_t off)
{
    jj_node_t *n = jj_alloc(&p->t->arena, sizeof(*n));
    if (n != NULL) {
        n->kind = kind;
        n->off = off;
    }
    return n;
}

static bool jj_reserved(const jj_parser_t *p, const jj_tok_t *t)
{
    static const char *const kw[] = {"true", "True", "false", "False", "none", "None", "and",
                                     "or",   "not",  "in",    "is",    "if",   "else"};
    for (size_t k = 0; k < sizeof(kw) / sizeof(kw[0]); k++)
        if (jj_is_name(p, t, kw[k]))
            return true;
    return false;
}

/* Assignment target: name, or names separated by commas (optionally in parentheses). */
static duet_status_t jj_parse_targets(jj_parser_t *p, jj_node_t *n)
{
    jj_vec_t names = {0}, lens = {0};
    bool paren = jj_is_op(jj_peek(p), "(");
    if (paren)
        p->ti++;
    for (;;) {
        jj_tok_t *t = jj_peek(p);
        if (t->kind != JT_NAME || jj_reserved(p, t))
            return jj_unexpected(p, "a variable name");
        p->ti++;
        size_t *l = jj_alloc(&p->t->arena, sizeof(*l));
        if (l == NULL)
            return DUET_ERR_NOMEM;
        *l = t->len;
        duet_status_t st = jj_vec_push(p, &names, (void *)(p->src + t->off));
        if (st == DUET_OK)
            st = jj_vec_push(p, &lens, l);
        if (st != DUET_OK)
            return st;
        if (!jj_is_op(jj_peek(p), ","))
            break;
        p->ti++;
        n->tuple_target = true;
        if (paren && jj_is_op(jj_peek(p), ")"))
            break;
    }
    if (paren && jj_expect_op(p, ")") != DUET_OK)
        return jj_unexpected(p, "')'");
    n->names = (const char **)names.items;
    n->n_names = names.n;
    n->name_lens = jj_alloc(&p->t->arena, names.n * sizeof(size_t));
    if (n->name_lens == NULL)
        return DUET_ERR_NOMEM;
    for (size_t i = 0; i < names.n; i++)
        n->name_lens[i] = *(size_t *)lens.items[i];
    return DUET_OK;
}

/* Parameters of a macro or a call block: (a, b=default, ...). */
static duet_status_t jj_parse_params(jj_parser_t *p, jj_node_t *n)
{
    duet_status_t st = jj_expect_op(p, "(");
    jj_vec_t names = {0}, defs = {0};
    size_t cap = 0;
    size_t *lens = NULL;
    while (st == DUET_OK && !jj_is_op(jj_peek(p), ")")) {
        if (names.n > 0 && (st = jj_expect_op(p, ",")) != DUET_OK)
            return st;
        jj_tok_t *t = jj_peek(p);
        if (t->kind != JT_NAME || jj_reserved(p, t))
            return jj_unexpected(p, "a parameter name");
        p->ti++;
        jj_expr_t *d = NULL;
        if (jj_is_op(jj_peek(p), "=")) {
            p->ti++;
            if ((st = jj_parse_expr(p, true, &d)) != DUET_OK)
                return st;
        } else if (defs.n > 0 && defs.items[defs.n - 1] != NULL) {
            return JJ_PERR(p, t->off, "non-default parameter follows a default parameter");
        }
        if (names.n == cap) {
            cap = cap == 0 ? 4 : cap * 2;
            size_t *nl = jj_alloc(&p->t->arena, cap * sizeof(*nl));
            if (nl == NULL)
                return DUET_ERR_NOMEM;
            if (names.n > 0)
                memcpy(nl, lens, names.n * sizeof(*nl));
            lens = nl;
        }
        lens[names.n] = t->len;
        if ((st = jj_vec_push(p, &names, (void *)(p->src + t->off))) != DUET_OK ||
            (st = jj_vec_push(p, &defs, d)) != DUET_OK)
            return st;
    }
    if (st != DUET_OK)
        return st;
    p->ti++;
    n->names = (const char **)names.items;
    n->name_lens = lens;
    n->n_names = names.n;
    n->defaults = (jj_expr_t **)defs.items;
    return DUET_OK;
}

static duet_status_t jj_parse_body(jj_parser_t *p, jj_body_t *body, const char *const *ends,
                                   size_t n_ends, const char **end_p);

/* The body of a block statement up to its end tag `endname` (consumed, with its '%}'). */
static duet_status_t jj_parse_block_body(jj_parser_t *p, jj_body_t *body, const char *endname,
                                         const char *what, size_t off)
{
    const char *end = NULL;
    const char *ends[1] = {endname};
    duet_status_t st = jj_parse_body(p, body, ends, 1, &end);
    if (st != DUET_OK)
        return st;
    if (end == NULL)
        return JJ_PERR(p, off, "unclosed '%s' (no '%s')", what, endname);
    return jj_expect_block_end(p);
}

static duet_status_t jj_parse_stmt(jj_parser_t *p, jj_tok_t *kw, size_t tag_off, jj_vec_t *out)
{
    duet_status_t st;
    jj_node_t *n = NULL;
    if (jj_is_name(p, kw, "if")) {
        n = jj_node_new(p, JN_IF, tag_off);
        if (n == NULL)
            return DUET_ERR_NOMEM;
        static const char *const if_ends[] = {"elif", "else", "endif"};
        jj_vec_t conds = {0}, bodies = {0};
        for (;;) {
            jj_expr_t *c = NULL;
            jj_body_t *b = jj_alloc(&p->t->arena, sizeof(*b));
            if (b == NULL)
                return DUET_ERR_NOMEM;
            const char *end = NULL;
            if ((st = jj_parse_tuple(p, false, &c)) != DUET_OK ||
                (st = jj_expect_block_end(p)) != DUET_OK ||
                (st = jj_parse_body(p, b, if_ends, 3, &end)) != DUET_OK ||
                (st = jj_vec_push(p, &conds, c)) != DUET_OK ||
                (st = jj_vec_push(p, &bodies, b)) != DUET_OK)
                return st;
            if (end == NULL)
                return JJ_PERR(p, tag_off, "unclosed 'if' (no 'endif')");
            if (strcmp(end, "elif") == 0)
                continue;
            if (strcmp(end, "else") == 0) {
                if ((st = jj_expect_block_end(p)) != DUET_OK ||
                    (st = jj_parse_block_body(p, &n->els, "endif", "if", tag_off)) != DUET_OK)
                    return st;
            } else if ((st = jj_expect_block_end(p)) != DUET_OK) {
                return st;
            }
            break;
        }
        n->conds = (jj_expr_t **)conds.items;
        n->n_conds = conds.n;
        n->bodies = jj_alloc(&p->t->arena, bodies.n * sizeof(jj_body_t));
        if (n->bodies == NULL)
            return DUET_ERR_NOMEM;
        for (size_t i = 0; i < bodies.n; i++)
            n->bodies[i] = *(jj_body_t *)bodies.items[i];
    } else if (jj_is_name(p, kw, "for")) {
        n = jj_node_new(p, JN_FOR, tag_off);
        if (n == NULL)
            return DUET_ERR_NOMEM;
        if ((st = jj_parse_targets(p, n)) != DUET_OK)
            return st;
        if (!jj_is_name(p, jj_peek(p), "in"))
            return jj_unexpected(p, "'in'");
        p->ti++;
        if ((st = jj_parse_tuple(p, false, &n->expr)) != DUET_OK)
            return st;
        if (jj_is_name(p, jj_peek(p), "if")) {
            p->ti++;
            if ((st = jj_parse_expr(p, true, &n->cond)) != DUET_OK)
                return st;
        }
        if (jj_is_name(p, jj_peek(p), "recursive"))
            return JJ_PERR(p, jj_peek(p)->off, "recursive loops are not supported");
        if ((st = jj_expect_block_end(p)) != DUET_OK)
            return st;
        static const char *const for_ends[] = {"else", "endfor"};
        const char *end = NULL;
        p->loops++;
        st = jj_parse_body(p, &n->body, for_ends, 2, &end);
        p->loops--;
        if (st != DUET_OK)
            return st;
        if (end == NULL)
            return JJ_PERR(p, tag_off, "unclosed 'for' (no 'endfor')");
        if ((st = jj_expect_block_end(p)) != DUET_OK)
            return st;
        if (strcmp(end, "else") == 0 &&
            (st = jj_parse_block_body(p, &n->els, "endfor", "for", tag_off)) != DUET_OK)
            return st;
    } else if (jj_is_name(p, kw, "set")) {
        jj_tok_t *v = jj_peek(p);
        if (v->kind == JT_NAME && jj_is_op(jj_peek2(p), ".")) {
            n = jj_node_new(p, JN_SET_ATTR, tag_off);
            jj_tok_t *a = &p->toks[p->ti + 2];
            if (n == NULL)
                return DUET_ERR_NOMEM;
            if (a->kind != JT_NAME) {
                p->ti += 2;
                return jj_unexpected(p, "an attribute name");
            }
            n->names = jj_alloc(&p->t->arena, sizeof(*n->names));
            n->name_lens = jj_alloc(&p->t->arena, sizeof(*n->name_lens));
            if (n->names == NULL || n->name_lens == NULL)
                return DUET_ERR_NOMEM;
            n->names[0] = p->src + v->off;
            n->name_lens[0] = v->len;
            n->n_names = 1;
            n->attr = p->src + a->off;
            n->attr_len = a->len;
            p->ti += 3;
            if ((st = jj_expect_op(p, "=")) != DUET_OK)
                return st;
            if ((st = jj_parse_tuple(p, true, &n->expr)) != DUET_OK ||
                (st = jj_expect_block_end(p)) != DUET_OK)
                return st;
        } else {
            n = jj_node_new(p, JN_SET, tag_off);
            if (n == NULL)
                return DUET_ERR_NOMEM;
            if ((st = jj_parse_targets(p, n)) != DUET_OK)
                return st;
            if (jj_is_op(jj_peek(p), "=")) {
                p->ti++;
                if ((st = jj_parse_tuple(p, true, &n->expr)) != DUET_OK ||
                    (st = jj_expect_block_end(p)) != DUET_OK)
                    return st;
            } else {
                if (n->tuple_target)
                    return jj_unexpected(p, "'='");
                n->kind = JN_SET_BLOCK;
                while (jj_is_op(jj_peek(p), "|")) {
                    p->ti++;
                    if ((st = jj_parse_filter(p, n->expr, &n->expr)) != DUET_OK)
                        return st;
                }
                if ((st = jj_expect_block_end(p)) != DUET_OK ||
                    (st = jj_parse_block_body(p, &n->body, "endset", "set", tag_off)) != DUET_OK)
                    return st;
            }
        }
    } else if (jj_is_name(p, kw, "macro")) {
        n = jj_node_new(p, JN_MACRO, tag_off);
        jj_tok_t *name = jj_peek(p);
        if (n == NULL)
            return DUET_ERR_NOMEM;
        if (name->kind != JT_NAME || jj_reserved(p, name))
            return jj_unexpected(p, "a macro name");
        p->ti++;
        n->attr = p->src + name->off;
        n->attr_len = name->len;
        int loops = p->loops;
        p->loops = 0;
        p->macros++;
        if ((st = jj_parse_params(p, n)) == DUET_OK && (st = jj_expect_block_end(p)) == DUET_OK)
            st = jj_parse_block_body(p, &n->body, "endmacro", "macro", tag_off);
        p->macros--;
        p->loops = loops;
        if (st != DUET_OK)
            return st;
    } else if (jj_is_name(p, kw, "call")) {
        n = jj_node_new(p, JN_CALL_BLOCK, tag_off);
        if (n == NULL)
            return DUET_ERR_NOMEM;
        if (jj_is_op(jj_peek(p), "(") && (st = jj_parse_params(p, n)) != DUET_OK)
            return st;
        if ((st = jj_parse_expr(p, true, &n->expr)) != DUET_OK)
            return st;
        if (n->expr->kind != JE_CALL)
            return JJ_PERR(p, n->expr->off, "'call' needs a macro call");
        int loops = p->loops;
        p->loops = 0;
        if ((st = jj_expect_block_end(p)) == DUET_OK)
            st = jj_parse_block_body(p, &n->body, "endcall", "call", tag_off);
        p->loops = loops;
        if (st != DUET_OK)
            return st;
    } else if (jj_is_name(p, kw, "filter")) {
        n = jj_node_new(p, JN_FILTER_BLOCK, tag_off);
        if (n == NULL)
            return DUET_ERR_NOMEM;
        if ((st = jj_parse_filter(p, NULL, &n->expr)) != DUET_OK)
            return st;
        while (jj_is_op(jj_peek(p), "|")) {
            p->ti++;
            if ((st = jj_parse_filter(p, n->expr, &n->expr)) != DUET_OK)
                return st;
        }
        if ((st = jj_expect_block_end(p)) != DUET_OK ||
            (st = jj_parse_block_body(p, &n->body, "endfilter", "filter", tag_off)) != DUET_OK)
            return st;
    } else if (jj_is_name(p, kw, "with")) {
        n = jj_node_new(p, JN_WITH, tag_off);
        if (n == NULL)
            return DUET_ERR_NOMEM;
        jj_vec_t names = {0}, vals = {0}, lens = {0};
        while (jj_peek(p)->kind != JT_BLOCK_END) {
            if (names.n > 0 && (st = jj_expect_op(p, ",")) != DUET_OK)
                return st;
            jj_tok_t *t = jj_peek(p);
            if (t->kind != JT_NAME || jj_reserved(p, t))
                return jj_unexpected(p, "a variable name");
            p->ti++;
            jj_expr_t *v = NULL;
            size_t *l = jj_alloc(&p->t->arena, sizeof(*l));
            if (l == NULL)
                return DUET_ERR_NOMEM;
            *l = t->len;
            if ((st = jj_expect_op(p, "=")) != DUET_OK ||
                (st = jj_parse_expr(p, true, &v)) != DUET_OK ||
                (st = jj_vec_push(p, &names, (void *)(p->src + t->off))) != DUET_OK ||
                (st = jj_vec_push(p, &vals, v)) != DUET_OK ||
                (st = jj_vec_push(p, &lens, l)) != DUET_OK)
                return st;
        }
        p->ti++;
        n->names = (const char **)names.items;
        n->n_names = names.n;
        n->defaults = (jj_expr_t **)vals.items;
        n->name_lens = jj_alloc(&p->t->arena, (names.n + 1) * sizeof(size_t));
        if (n->name_lens == NULL)
            return DUET_ERR_NOMEM;
        for (size_t i = 0; i < names.n; i++)
            n->name_lens[i] = *(size_t *)lens.items[i];
        if ((st = jj_parse_block_body(p, &n->body, "endwith", "with", tag_off)) != DUET_OK)
            return st;
    } else if (jj_is_name(p, kw, "generation")) {
        n = jj_node_new(p, JN_BODY, tag_off);
        if (n == NULL)
            return DUET_ERR_NOMEM;
        if ((st = jj_expect_block_end(p)) != DUET_OK ||
            (st = jj_parse_block_body(p, &n->body, "endgeneration", "generation", tag_off)) !=
                DUET_OK)
            return st;
    } else if (jj_is_name(p, kw, "break") || jj_is_name(p, kw, "continue")) {
        if (p->loops == 0)
            return JJ_PERR(p, kw->off, "'%.*s' outside a loop", (int)kw->len, p->src + kw->off);
        n = jj_node_new(p, jj_is_name(p, kw, "break") ? JN_BREAK : JN_CONTINUE, tag_off);
        if (n == NULL)
            return DUET_ERR_NOMEM;
        if ((st = jj_expect_block_end(p)) != DUET_OK)
            return st;
    } else {
        static const char *const known[] = {"block", "extends",    "include", "import",
                                            "from",  "autoescape", "do",      "trans"};
        for (size_t k = 0; k < sizeof(known) / sizeof(known[0]); k++)
            if (jj_is_name(p, kw, known[k]))
                return JJ_PERR(p, kw->off, "'%s' is not supported", known[k]);
        return JJ_PERR(p, kw->off, "unknown or misplaced tag '%.*s'",
                       (int)(kw->len > 64 ? 64 : kw->len), p->src + kw->off);
    }
    return jj_vec_push(p, out, n);
}

/*
 * Parse into `body` until a statement whose keyword is in `ends` (its name is returned in *end_p
 * with the keyword consumed) or the end of the template (*end_p NULL).
 */
static duet_status_t jj_parse_body(jj_parser_t *p, jj_body_t *body, const char *const *ends,
                                   size_t n_ends, const char **end_p)
{
    *end_p = NULL;
    jj_vec_t nodes = {0};
    duet_status_t st = jj_enter(p, jj_peek(p)->off);
    while (st == DUET_OK) {
        jj_tok_t *t = jj_peek(p);
        if (t->kind == JT_END)
            break;
        if (t->kind == JT_DATA) {
            p->ti++;
            jj_node_t *n = jj_node_new(p, JN_TEXT, t->off);
            if (n == NULL)
                return DUET_ERR_NOMEM;
            n->text = p->src + t->off;
            n->len = t->len;
            st = jj_vec_push(p, &nodes, n);
            continue;
        }
        if (t->kind == JT_VAR_BEGIN) {
            p->ti++;
            jj_node_t *n = jj_node_new(p, JN_OUTPUT, t->off);
            if (n == NULL)
                return DUET_ERR_NOMEM;
            if ((st = jj_parse_tuple(p, true, &n->expr)) != DUET_OK)
                return st;
            if (jj_peek(p)->kind != JT_VAR_END)
                return jj_unexpected(p, "the end of the expression ('}}')");
            p->ti++;
            st = jj_vec_push(p, &nodes, n);
            continue;
        }
        if (t->kind != JT_BLOCK_BEGIN)
            return jj_unexpected(p, "text or a tag");
        p->ti++;
        jj_tok_t *kw = jj_peek(p);
        if (kw->kind != JT_NAME)
            return jj_unexpected(p, "a tag name");
        bool is_end = false;
        for (size_t k = 0; k < n_ends; k++)
            if (jj_is_name(p, kw, ends[k])) {
                p->ti++;
                *end_p = ends[k];
                is_end = true;
                break;
            }
        if (is_end)
            break;
        p->ti++;
        st = jj_parse_stmt(p, kw, t->off, &nodes);
    }
    p->depth--;
    body->nodes = (jj_node_t **)nodes.items;
    body->n = nodes.n;
    return st;
}

void duet_jinja_destroy(duet_jinja_t *tmpl)
{
    if (tmpl == NULL)
        return;
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
    if (!duet_utf8_valid(text != NULL ? text : "", len))
        return duet_error_set(DUET_ERR_FORMAT, "%s: the template is not valid UTF-8", source);
    if (len > 0 && memchr(text, '\0', len) != NULL)
        return duet_error_set(DUET_ERR_FORMAT, "%s: the template holds a NUL character", source);
    duet_jinja_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "%s: no memory", source);
    t->src = jj_normalise(text != NULL ? text : "", len, &t->src_len);
    t->source = strdup(source);
    if (t->src == NULL || t->source == NULL) {
        duet_jinja_destroy(t);
        return duet_error_set(DUET_ERR_NOMEM, "%s: no memory", source);
    }
    jj_parser_t p = {.t = t, .src = t->src, .len = t->src_len};
    duet_status_t st = jj_lex(&p);
    const char *end = NULL;
    if (st == DUET_OK)
        st = jj_parse_body(&p, &t->root, NULL, 0, &end);
    if (st == DUET_OK && jj_peek(&p)->kind != JT_END)
        st = jj_unexpected(&p, "the end of the template");
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
