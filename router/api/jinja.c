/*
 * The Jinja engine's values (see jinja.h and jinja_internal.h): the arena every render value
 * lives in, strings that carry one origin per byte, and Python's own formatting of values, since
 * a chat template prints what CPython would print: str() and repr() of None/True/ints/floats
 * (shortest round trip)/lists/dicts/tuples, and json.dumps as transformers' tojson calls it.
 *
 * Render values live in the vars' arena, which is capped: a hostile template can spend only
 * bounded memory, and nothing is freed one by one.
 */
#include "router/api/jinja_internal.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

const duet_jinja_limits_t duet_jinja_limits_default = {
    .max_output = 4u << 20,
    .max_iterations = 100000,
    .max_memory = 64u << 20,
    .max_call_depth = 32,
};

duet_jinja_value_t jj_undef_value = {.kind = JV_UNDEF};
duet_jinja_value_t jj_unsafe_value = {.kind = JV_UNDEF};

/* ---------------------------------------------------------------- arena */

void *jj_alloc(jj_arena_t *a, size_t n)
{
    if (n > SIZE_MAX / 2)
        return NULL;
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

void jj_arena_free(jj_arena_t *a)
{
    while (a->head != NULL) {
        jj_block_t *b = a->head;
        a->head = b->next;
        free(b);
    }
    a->total = 0;
}

/* ---------------------------------------------------------------- errors */

duet_status_t jj_error(duet_status_t st, const char *source, const char *src, size_t len,
                       size_t off, const char *fmt, ...)
{
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    unsigned line = 1, col = 1;
    for (size_t i = 0; i < off && i < len; i++) {
        if (src[i] == '\n') {
            line++;
            col = 1;
        } else if (((unsigned char)src[i] & 0xc0) != 0x80) {
            col++; /* columns count characters */
        }
    }
    return duet_error_set(st, "%s:%u:%u: %s", source, line, col, msg);
}

duet_status_t jj_nomem(jj_render_t *r, size_t off)
{
    return JJ_RERR(r, DUET_ERR_NOMEM, off, "out of memory while rendering (limit %zu bytes)",
                   r->arena->limit);
}

/* ---------------------------------------------------------------- UTF-8 */

uint32_t jj_utf8_next(const char *s, size_t len, size_t *i)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t k = *i;
    uint32_t c = p[k];
    size_t n = c < 0x80 ? 1 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    if (k + n > len)
        n = 1;
    if (n == 2)
        c = ((c & 0x1f) << 6) | (p[k + 1] & 0x3f);
    else if (n == 3)
        c = ((c & 0x0f) << 12) | ((uint32_t)(p[k + 1] & 0x3f) << 6) | (p[k + 2] & 0x3f);
    else if (n == 4)
        c = ((c & 0x07) << 18) | ((uint32_t)(p[k + 1] & 0x3f) << 12) |
            ((uint32_t)(p[k + 2] & 0x3f) << 6) | (p[k + 3] & 0x3f);
    *i = k + n;
    return c;
}

size_t jj_utf8_put(char *out, uint32_t cp)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

size_t jj_utf8_count(const char *s, size_t len)
{
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        n += ((unsigned char)s[i] & 0xc0) != 0x80;
    return n;
}

size_t jj_utf8_offset(const char *s, size_t len, size_t cp)
{
    size_t i = 0;
    while (i < len && cp > 0) {
        jj_utf8_next(s, len, &i);
        cp--;
    }
    return i;
}

/* Python's str.isprintable() for one code point, for repr(): the common non-printables (control
 * characters, separators other than space, format characters, surrogates, private use). */
static bool jj_cp_isprintable(uint32_t c)
{
    if (c < 0x20 || (c >= 0x7f && c <= 0xa0) || c == 0xad)
        return false;
    if ((c >= 0x600 && c <= 0x605) || c == 0x61c || c == 0x6dd || c == 0x70f || c == 0x890 ||
        c == 0x891 || c == 0x8e2 || c == 0x1680 || c == 0x180e || (c >= 0x2000 && c <= 0x200f) ||
        (c >= 0x2028 && c <= 0x202f) || (c >= 0x205f && c <= 0x2064) ||
        (c >= 0x2066 && c <= 0x206f) || c == 0x3000 || (c >= 0xd800 && c <= 0xf8ff) ||
        c == 0xfeff || (c >= 0xfff9 && c <= 0xfffb) || c == 0xfffe || c == 0xffff || c == 0x110bd ||
        c == 0x110cd || (c >= 0x13430 && c <= 0x1343f) || (c >= 0x1bca0 && c <= 0x1bca3) ||
        (c >= 0x1d173 && c <= 0x1d17a) || c == 0xe0001 || (c >= 0xe0020 && c <= 0xe007f) ||
        c >= 0xf0000)
        return false;
    return true;
}

/* ---------------------------------------------------------------- values */

duet_jinja_value_t *jj_new(jj_arena_t *a, jv_kind_t kind)
{
    duet_jinja_value_t *v = jj_alloc(a, sizeof(*v));
    if (v != NULL)
        v->kind = (uint8_t)kind;
    return v;
}

duet_jinja_value_t *jj_str(jj_arena_t *a, const char *s, size_t len, int origin)
{
    duet_jinja_value_t *v = jj_new(a, JV_STR);
    char *copy = v != NULL ? jj_alloc(a, len + 1) : NULL;
    if (copy == NULL)
        return NULL;
    if (len > 0)
        memcpy(copy, s, len);
    v->s = copy;
    v->len = len;
    v->origin = (uint8_t)origin;
    return v;
}

duet_jinja_value_t *jj_int(jj_arena_t *a, int64_t i)
{
    duet_jinja_value_t *v = jj_new(a, JV_INT);
    if (v != NULL)
        v->i = i;
    return v;
}

duet_jinja_value_t *jj_float(jj_arena_t *a, double f)
{
    duet_jinja_value_t *v = jj_new(a, JV_FLOAT);
    if (v != NULL)
        v->f = f;
    return v;
}

duet_jinja_value_t *jj_bool(jj_arena_t *a, bool b)
{
    duet_jinja_value_t *v = jj_new(a, JV_BOOL);
    if (v != NULL)
        v->b = b;
    return v;
}

duet_status_t jj_push(jj_arena_t *a, duet_jinja_value_t *c, duet_jinja_value_t *item)
{
    if (c->n == c->cap) {
        size_t cap = c->cap == 0 ? 4 : c->cap * 2;
        duet_jinja_value_t **items = jj_alloc(a, cap * sizeof(*items));
        if (items == NULL)
            return DUET_ERR_NOMEM;
        if (c->n > 0)
            memcpy(items, c->items, c->n * sizeof(*items));
        c->items = items;
        if (c->kind == JV_DICT || c->kind == JV_NS) {
            duet_jinja_value_t **keys = jj_alloc(a, cap * sizeof(*keys));
            if (keys == NULL)
                return DUET_ERR_NOMEM;
            if (c->n > 0)
                memcpy(keys, c->keys, c->n * sizeof(*keys));
            c->keys = keys;
        }
        c->cap = cap;
    }
    c->items[c->n++] = item;
    return DUET_OK;
}

duet_status_t jj_dict_set(jj_arena_t *a, duet_jinja_value_t *d, duet_jinja_value_t *key,
                          duet_jinja_value_t *val)
{
    for (size_t i = 0; i < d->n; i++)
        if (jj_equal(d->keys[i], key, 0)) {
            d->items[i] = val;
            return DUET_OK;
        }
    duet_status_t st = jj_push(a, d, val);
    if (st == DUET_OK)
        d->keys[d->n - 1] = key;
    return st;
}

duet_jinja_value_t *jj_dict_get(const duet_jinja_value_t *d, const char *k, size_t kl)
{
    for (size_t i = 0; i < d->n; i++) {
        const duet_jinja_value_t *key = d->keys[i];
        if (key->kind == JV_STR && key->len == kl && (kl == 0 || memcmp(key->s, k, kl) == 0))
            return d->items[i];
    }
    return NULL;
}

bool jj_is_number(const duet_jinja_value_t *v)
{
    return v->kind == JV_INT || v->kind == JV_FLOAT || v->kind == JV_BOOL;
}

double jj_num(const duet_jinja_value_t *v)
{
    return v->kind == JV_FLOAT ? v->f : v->kind == JV_INT ? (double)v->i : (double)v->b;
}

bool jj_equal(const duet_jinja_value_t *a, const duet_jinja_value_t *b, int depth)
{
    if (a == b)
        return true;
    if (depth > JJ_MAX_VALUE_DEPTH)
        return false;
    if (jj_is_number(a) && jj_is_number(b)) {
        if (a->kind != JV_FLOAT && b->kind != JV_FLOAT)
            return (a->kind == JV_INT ? a->i : a->b) == (b->kind == JV_INT ? b->i : b->b);
        return jj_num(a) == jj_num(b);
    }
    if (a->kind != b->kind)
        return false;
    switch (a->kind) {
    case JV_UNDEF:
    case JV_NONE:
        return true;
    case JV_STR:
        return a->len == b->len && (a->len == 0 || memcmp(a->s, b->s, a->len) == 0);
    case JV_LIST:
        if (a->gen || b->gen || a->tuple != b->tuple || a->n != b->n)
            return false;
        for (size_t i = 0; i < a->n; i++)
            if (!jj_equal(a->items[i], b->items[i], depth + 1))
                return false;
        return true;
    case JV_DICT:
        if (a->n != b->n)
            return false;
        for (size_t i = 0; i < a->n; i++) {
            bool found = false;
            for (size_t k = 0; k < b->n && !found; k++)
                if (jj_equal(a->keys[i], b->keys[k], depth + 1)) {
                    if (!jj_equal(a->items[i], b->items[k], depth + 1))
                        return false;
                    found = true;
                }
            if (!found)
                return false;
        }
        return true;
    case JV_FUNC:
        return a->i == b->i;
    case JV_METHOD:
        return a->self == b->self && a->len == b->len && memcmp(a->s, b->s, a->len) == 0;
    default:
        return false;
    }
}

bool jj_truthy(const duet_jinja_value_t *v)
{
    switch (v->kind) {
    case JV_UNDEF:
    case JV_NONE:
        return false;
    case JV_BOOL:
        return v->b;
    case JV_INT:
        return v->i != 0;
    case JV_FLOAT:
        return v->f != 0.0;
    case JV_STR:
        return v->len > 0;
    case JV_LIST:
        return v->gen || v->n > 0;
    case JV_DICT:
        return v->n > 0;
    default:
        return true;
    }
}

const char *jj_type_name(const duet_jinja_value_t *v)
{
    switch (v->kind) {
    case JV_UNDEF:
        return "Undefined";
    case JV_NONE:
        return "NoneType";
    case JV_BOOL:
        return "bool";
    case JV_INT:
        return "int";
    case JV_FLOAT:
        return "float";
    case JV_STR:
        return "str";
    case JV_LIST:
        return v->gen ? "generator" : v->tuple ? "tuple" : "list";
    case JV_DICT:
        return "dict";
    case JV_NS:
        return "Namespace";
    case JV_LOOP:
        return "LoopContext";
    case JV_MACRO:
        return "Macro";
    case JV_FUNC:
        return "function";
    default:
        return "builtin_function_or_method";
    }
}

uint8_t jj_origin_at(const duet_jinja_value_t *s, size_t i)
{
    return s->origin == JJ_ORIGIN_MIXED ? s->mask[i] : s->origin;
}

bool jj_has_data(const duet_jinja_value_t *v, int depth)
{
    if (depth > JJ_MAX_VALUE_DEPTH)
        return true;
    if (v->kind == JV_STR)
        return v->origin != DUET_JINJA_ORIGIN_TEMPLATE && v->len > 0;
    if (v->kind == JV_LIST || v->kind == JV_DICT || v->kind == JV_NS) {
        for (size_t i = 0; i < v->n; i++)
            if (jj_has_data(v->items[i], depth + 1) ||
                (v->kind != JV_LIST && jj_has_data(v->keys[i], depth + 1)))
                return true;
    }
    return false;
}

/* ---------------------------------------------------------------- string builder */

void jj_sb_init(jj_sb_t *sb, jj_arena_t *a, size_t limit)
{
    memset(sb, 0, sizeof(*sb));
    sb->a = a;
    sb->limit = limit;
    sb->origin = -1;
}

static bool jj_sb_grow(jj_sb_t *sb, size_t n)
{
    if (sb->st != DUET_OK)
        return false;
    if (n > sb->limit || sb->len > sb->limit - n) {
        sb->st = DUET_ERR_RANGE;
        return false;
    }
    if (sb->len + n + 1 <= sb->cap)
        return true;
    size_t cap = sb->cap < 64 ? 64 : sb->cap;
    while (cap < sb->len + n + 1)
        cap *= 2;
    char *buf = jj_alloc(sb->a, cap);
    uint8_t *mask = sb->mask != NULL ? jj_alloc(sb->a, cap) : NULL;
    if (buf == NULL || (sb->mask != NULL && mask == NULL)) {
        sb->st = DUET_ERR_NOMEM;
        return false;
    }
    if (sb->len > 0) {
        memcpy(buf, sb->buf, sb->len);
        if (mask != NULL)
            memcpy(mask, sb->mask, sb->len);
    }
    sb->buf = buf;
    sb->mask = mask;
    sb->cap = cap;
    return true;
}

/* The bytes from `at` on get origin o; switch to a mask when origins start to differ. */
static void jj_sb_mark(jj_sb_t *sb, size_t at, size_t n, int o)
{
    if (sb->mask == NULL) {
        if (sb->origin < 0 || sb->origin == o) {
            sb->origin = o;
            return;
        }
        sb->mask = jj_alloc(sb->a, sb->cap);
        if (sb->mask == NULL) {
            sb->st = DUET_ERR_NOMEM;
            return;
        }
        memset(sb->mask, sb->origin, at);
        sb->origin = JJ_ORIGIN_MIXED;
    }
    memset(sb->mask + at, o, n);
}

void jj_sb_put(jj_sb_t *sb, const char *s, size_t n, int origin)
{
    if (n == 0 || !jj_sb_grow(sb, n))
        return;
    memcpy(sb->buf + sb->len, s, n);
    jj_sb_mark(sb, sb->len, n, origin);
    sb->len += n;
}

void jj_sb_puts(jj_sb_t *sb, const char *s, int origin)
{
    jj_sb_put(sb, s, strlen(s), origin);
}

void jj_sb_put_range(jj_sb_t *sb, const duet_jinja_value_t *s, size_t off, size_t n)
{
    if (s->origin != JJ_ORIGIN_MIXED) {
        jj_sb_put(sb, s->s + off, n, s->origin);
        return;
    }
    for (size_t i = off; i < off + n;) {
        size_t j = i;
        while (j < off + n && s->mask[j] == s->mask[i])
            j++;
        jj_sb_put(sb, s->s + i, j - i, s->mask[i]);
        i = j;
    }
}

void jj_sb_put_str(jj_sb_t *sb, const duet_jinja_value_t *s)
{
    jj_sb_put_range(sb, s, 0, s->len);
}

duet_jinja_value_t *jj_sb_finish(jj_sb_t *sb)
{
    if (sb->st != DUET_OK)
        return NULL;
    duet_jinja_value_t *v = jj_new(sb->a, JV_STR);
    if (v == NULL) {
        sb->st = DUET_ERR_NOMEM;
        return NULL;
    }
    if (sb->buf == NULL) {
        v->s = "";
        v->origin = DUET_JINJA_ORIGIN_TEMPLATE;
        return v;
    }
    sb->buf[sb->len] = '\0';
    v->s = sb->buf;
    v->len = sb->len;
    v->origin = (uint8_t)(sb->mask != NULL ? JJ_ORIGIN_MIXED : sb->origin);
    v->mask = sb->mask;
    return v;
}

/* ---------------------------------------------------------------- formatting */

size_t jj_fmt_float(double f, char *buf, size_t cap)
{
    if (isnan(f))
        return (size_t)snprintf(buf, cap, "nan");
    if (isinf(f))
        return (size_t)snprintf(buf, cap, f < 0 ? "-inf" : "inf");
    char e[40];
    int prec = 1;
    for (; prec <= 17; prec++) {
        snprintf(e, sizeof(e), "%.*e", prec - 1, f);
        if (strtod(e, NULL) == f)
            break;
    }
    /* e = "[-]d[.ddd]e[+-]xx": pull out the digits and the exponent. */
    char digits[24];
    size_t nd = 0;
    const char *p = e;
    bool neg = *p == '-';
    if (neg)
        p++;
    for (; *p != 'e'; p++)
        if (*p >= '0' && *p <= '9' && nd < sizeof(digits) - 1)
            digits[nd++] = *p;
    int exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = '\0';
    char out[64];
    size_t o = 0;
    if (neg)
        out[o++] = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 >= 0) {
            for (int k = 0; k <= exp10; k++)
                out[o++] = (size_t)k < nd ? digits[k] : '0';
            out[o++] = '.';
            if ((size_t)exp10 + 1 < nd)
                for (size_t k = (size_t)exp10 + 1; k < nd; k++)
                    out[o++] = digits[k];
            else
                out[o++] = '0';
        } else {
            out[o++] = '0';
            out[o++] = '.';
            for (int k = 0; k < -exp10 - 1; k++)
                out[o++] = '0';
            for (size_t k = 0; k < nd; k++)
                out[o++] = digits[k];
        }
        out[o] = '\0';
    } else {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (size_t k = 1; k < nd; k++)
                out[o++] = digits[k];
        }
        snprintf(out + o, sizeof(out) - o, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    }
    return (size_t)snprintf(buf, cap, "%s", out);
}

static void jj_put_int(jj_sb_t *sb, int64_t i, int origin)
{
    char buf[32];
    int n = snprintf(buf, sizeof(buf), "%" PRId64, i);
    jj_sb_put(sb, buf, (size_t)n, origin);
}

static duet_status_t jj_sb_status(jj_render_t *r, size_t off, jj_sb_t *sb)
{
    if (sb->st == DUET_ERR_RANGE)
        return JJ_RERR(r, DUET_ERR_RANGE, off, "string longer than the output limit (%zu bytes)",
                       r->lim.max_output);
    if (sb->st != DUET_OK)
        return jj_nomem(r, off);
    return DUET_OK;
}

/* repr() of a string: Python's choice of quotes and escapes. */
static void jj_repr_str(jj_sb_t *sb, const duet_jinja_value_t *s, int origin)
{
    bool sq = memchr(s->s, '\'', s->len) != NULL, dq = memchr(s->s, '"', s->len) != NULL;
    char q = sq && !dq ? '"' : '\'';
    jj_sb_put(sb, &q, 1, origin);
    for (size_t i = 0; i < s->len;) {
        size_t at = i;
        uint32_t c = jj_utf8_next(s->s, s->len, &i);
        char buf[16];
        if (c == (uint32_t)q || c == '\\') {
            buf[0] = '\\';
            buf[1] = (char)c;
            jj_sb_put(sb, buf, 2, origin);
        } else if (c == '\t' || c == '\n' || c == '\r') {
            jj_sb_put(sb, c == '\t' ? "\\t" : c == '\n' ? "\\n" : "\\r", 2, origin);
        } else if (!jj_cp_isprintable(c)) {
            int n = c <= 0xff     ? snprintf(buf, sizeof(buf), "\\x%02x", c)
                    : c <= 0xffff ? snprintf(buf, sizeof(buf), "\\u%04x", c)
                                  : snprintf(buf, sizeof(buf), "\\U%08x", c);
            jj_sb_put(sb, buf, (size_t)n, origin);
        } else {
            jj_sb_put(sb, s->s + at, i - at, origin);
        }
    }
    jj_sb_put(sb, &q, 1, origin);
}

static duet_status_t jj_repr_into(jj_render_t *r, size_t off, const duet_jinja_value_t *v,
                                  jj_sb_t *sb, int depth, int origin)
{
    if (depth > JJ_MAX_VALUE_DEPTH)
        return JJ_RERR(r, DUET_ERR_RANGE, off, "values nested deeper than %d", JJ_MAX_VALUE_DEPTH);
    char buf[40];
    duet_status_t st = DUET_OK;
    switch (v->kind) {
    case JV_UNDEF:
        jj_sb_puts(sb, "Undefined", origin);
        break;
    case JV_NONE:
        jj_sb_puts(sb, "None", origin);
        break;
    case JV_BOOL:
        jj_sb_puts(sb, v->b ? "True" : "False", origin);
        break;
    case JV_INT:
        jj_put_int(sb, v->i, origin);
        break;
    case JV_FLOAT:
        jj_sb_put(sb, buf, jj_fmt_float(v->f, buf, sizeof(buf)), origin);
        break;
    case JV_STR:
        if (v->markup)
            jj_sb_puts(sb, "Markup(", origin);
        jj_repr_str(sb, v, origin);
        if (v->markup)
            jj_sb_puts(sb, ")", origin);
        break;
    case JV_LIST:
        if (v->gen) {
            jj_sb_puts(sb, "<generator object>", origin);
            break;
        }
        jj_sb_puts(sb, v->tuple ? "(" : "[", origin);
        for (size_t i = 0; i < v->n && st == DUET_OK; i++) {
            if (i > 0)
                jj_sb_puts(sb, ", ", origin);
            st = jj_repr_into(r, off, v->items[i], sb, depth + 1, origin);
        }
        jj_sb_puts(sb, v->tuple ? (v->n == 1 ? ",)" : ")") : "]", origin);
        break;
    case JV_DICT:
    case JV_NS:
        jj_sb_puts(sb, v->kind == JV_NS ? "<Namespace {" : "{", origin);
        for (size_t i = 0; i < v->n && st == DUET_OK; i++) {
            if (i > 0)
                jj_sb_puts(sb, ", ", origin);
            st = jj_repr_into(r, off, v->keys[i], sb, depth + 1, origin);
            jj_sb_puts(sb, ": ", origin);
            if (st == DUET_OK)
                st = jj_repr_into(r, off, v->items[i], sb, depth + 1, origin);
        }
        jj_sb_puts(sb, v->kind == JV_NS ? "}>" : "}", origin);
        break;
    case JV_LOOP: {
        int n = snprintf(buf, sizeof(buf), "<LoopContext %" PRId64 "/%zu>", v->i + 1, v->self->n);
        jj_sb_put(sb, buf, (size_t)n, origin);
        break;
    }
    case JV_MACRO:
        jj_sb_puts(sb, "<Macro>", origin);
        break;
    default:
        jj_sb_puts(sb, "<built-in function>", origin);
        break;
    }
    if (st == DUET_OK)
        st = jj_sb_status(r, off, sb);
    return st;
}

duet_status_t jj_repr(jj_render_t *r, size_t off, const duet_jinja_value_t *v, jj_sb_t *sb,
                      int depth)
{
    /* Containers print as one piece: DATA if anything inside came from the request. */
    int origin = jj_has_data(v, 0) ? DUET_JINJA_ORIGIN_DATA : DUET_JINJA_ORIGIN_TEMPLATE;
    return jj_repr_into(r, off, v, sb, depth, origin);
}

duet_status_t jj_to_str(jj_render_t *r, size_t off, const duet_jinja_value_t *v, jj_sb_t *sb)
{
    if (v->kind == JV_STR) {
        jj_sb_put_str(sb, v);
        return jj_sb_status(r, off, sb);
    }
    if (v->kind == JV_UNDEF)
        return DUET_OK;
    return jj_repr(r, off, v, sb, 0);
}

duet_status_t jj_stringify(jj_render_t *r, size_t off, const duet_jinja_value_t *v,
                           duet_jinja_value_t **out)
{
    if (v->kind == JV_STR) {
        *out = (duet_jinja_value_t *)v;
        return DUET_OK;
    }
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    duet_status_t st = jj_to_str(r, off, v, &sb);
    if (st != DUET_OK)
        return st;
    *out = jj_sb_finish(&sb);
    return *out != NULL ? DUET_OK : jj_nomem(r, off);
}

/* A JSON string as json.dumps writes it. */
static void jj_json_str(jj_sb_t *sb, const duet_jinja_value_t *s, bool ensure_ascii, int origin)
{
    static const char hex[] = "0123456789abcdef";
    jj_sb_put(sb, "\"", 1, origin);
    for (size_t i = 0; i < s->len;) {
        size_t at = i;
        uint32_t c = jj_utf8_next(s->s, s->len, &i);
        char e[16];
        if (c == '"' || c == '\\') {
            e[0] = '\\';
            e[1] = (char)c;
            jj_sb_put(sb, e, 2, origin);
        } else if (c == '\n' || c == '\r' || c == '\t' || c == '\b' || c == '\f') {
            e[0] = '\\';
            e[1] = c == '\n' ? 'n' : c == '\r' ? 'r' : c == '\t' ? 't' : c == '\b' ? 'b' : 'f';
            jj_sb_put(sb, e, 2, origin);
        } else if (c < 0x20 || (ensure_ascii && c >= 0x7f)) {
            uint32_t units[2] = {c, 0};
            int nu = 1;
            if (c >= 0x10000) {
                units[0] = 0xd800 + ((c - 0x10000) >> 10);
                units[1] = 0xdc00 + ((c - 0x10000) & 0x3ff);
                nu = 2;
            }
            for (int k = 0; k < nu; k++) {
                char u[6] = {'\\',
                             'u',
                             hex[(units[k] >> 12) & 15],
                             hex[(units[k] >> 8) & 15],
                             hex[(units[k] >> 4) & 15],
                             hex[units[k] & 15]};
                jj_sb_put(sb, u, 6, origin);
            }
        } else {
            jj_sb_put(sb, s->s + at, i - at, origin);
        }
    }
    jj_sb_put(sb, "\"", 1, origin);
}

static void jj_json_newline(jj_sb_t *sb, const jj_json_opts_t *o, int level, int origin)
{
    jj_sb_put(sb, "\n", 1, origin);
    for (int k = 0; k < level; k++)
        jj_sb_put(sb, o->indent, o->indent_len, origin);
}

/* A dict key as json.dumps turns it into a string; false when the key's type is refused. */
static bool jj_json_key(jj_sb_t *sb, const duet_jinja_value_t *k, const jj_json_opts_t *o,
                        int origin)
{
    char buf[40];
    switch (k->kind) {
    case JV_STR:
        jj_json_str(sb, k, o->ensure_ascii, origin);
        return true;
    case JV_INT:
        jj_sb_put(sb, "\"", 1, origin);
        jj_put_int(sb, k->i, origin);
        jj_sb_put(sb, "\"", 1, origin);
        return true;
    case JV_FLOAT: {
        size_t n = isnan(k->f) ? (size_t)snprintf(buf, sizeof(buf), "NaN")
                   : isinf(k->f)
                       ? (size_t)snprintf(buf, sizeof(buf), k->f < 0 ? "-Infinity" : "Infinity")
                       : jj_fmt_float(k->f, buf, sizeof(buf));
        jj_sb_put(sb, "\"", 1, origin);
        jj_sb_put(sb, buf, n, origin);
        jj_sb_put(sb, "\"", 1, origin);
        return true;
    }
    case JV_BOOL:
        jj_sb_puts(sb, k->b ? "\"true\"" : "\"false\"", origin);
        return true;
    case JV_NONE:
        jj_sb_puts(sb, "\"null\"", origin);
        return true;
    default:
        return false;
    }
}

static duet_status_t jj_json_into(jj_render_t *r, size_t off, const duet_jinja_value_t *v,
                                  jj_sb_t *sb, const jj_json_opts_t *o, int depth, int origin)
{
    if (depth > JJ_MAX_VALUE_DEPTH)
        return JJ_RERR(r, DUET_ERR_RANGE, off, "values nested deeper than %d", JJ_MAX_VALUE_DEPTH);
    char buf[40];
    duet_status_t st = DUET_OK;
    switch (v->kind) {
    case JV_NONE:
        jj_sb_puts(sb, "null", origin);
        break;
    case JV_BOOL:
        jj_sb_puts(sb, v->b ? "true" : "false", origin);
        break;
    case JV_INT:
        jj_put_int(sb, v->i, origin);
        break;
    case JV_FLOAT: {
        size_t n = isnan(v->f) ? (size_t)snprintf(buf, sizeof(buf), "NaN")
                   : isinf(v->f)
                       ? (size_t)snprintf(buf, sizeof(buf), v->f < 0 ? "-Infinity" : "Infinity")
                       : jj_fmt_float(v->f, buf, sizeof(buf));
        jj_sb_put(sb, buf, n, origin);
        break;
    }
    case JV_STR:
        jj_json_str(sb, v, o->ensure_ascii, origin);
        break;
    case JV_LIST:
        if (v->gen)
            goto refuse;
        if (v->n == 0) {
            jj_sb_puts(sb, "[]", origin);
            break;
        }
        jj_sb_puts(sb, "[", origin);
        for (size_t i = 0; i < v->n && st == DUET_OK; i++) {
            if (i > 0)
                jj_sb_put(sb, o->item_sep, o->item_sep_len, origin);
            if (o->indent != NULL)
                jj_json_newline(sb, o, depth + 1, origin);
            st = jj_json_into(r, off, v->items[i], sb, o, depth + 1, origin);
        }
        if (o->indent != NULL)
            jj_json_newline(sb, o, depth, origin);
        jj_sb_puts(sb, "]", origin);
        break;
    case JV_DICT: {
        if (v->n == 0) {
            jj_sb_puts(sb, "{}", origin);
            break;
        }
        size_t *order = jj_alloc(r->arena, v->n * sizeof(*order));
        if (order == NULL)
            return jj_nomem(r, off);
        for (size_t i = 0; i < v->n; i++)
            order[i] = i;
        if (o->sort_keys) /* insertion sort: stable, and dicts are small */
            for (size_t i = 1; i < v->n; i++) {
                size_t x = order[i], k = i;
                while (k > 0) {
                    int c = 0;
                    if ((st = jj_compare(r, off, v->keys[order[k - 1]], v->keys[x], &c)) != DUET_OK)
                        return st;
                    if (c <= 0)
                        break;
                    order[k] = order[k - 1];
                    k--;
                }
                order[k] = x;
            }
        jj_sb_puts(sb, "{", origin);
        for (size_t j = 0; j < v->n && st == DUET_OK; j++) {
            size_t i = order[j];
            if (j > 0)
                jj_sb_put(sb, o->item_sep, o->item_sep_len, origin);
            if (o->indent != NULL)
                jj_json_newline(sb, o, depth + 1, origin);
            if (!jj_json_key(sb, v->keys[i], o, origin))
                return JJ_RERR(r, DUET_ERR_INVALID, off,
                               "keys must be str, int, float, bool or None, not %s",
                               jj_type_name(v->keys[i]));
            jj_sb_put(sb, o->key_sep, o->key_sep_len, origin);
            st = jj_json_into(r, off, v->items[i], sb, o, depth + 1, origin);
        }
        if (o->indent != NULL)
            jj_json_newline(sb, o, depth, origin);
        jj_sb_puts(sb, "}", origin);
        break;
    }
    default:
        goto refuse;
    }
    if (st == DUET_OK)
        st = jj_sb_status(r, off, sb);
    return st;
refuse:
    return JJ_RERR(r, DUET_ERR_INVALID, off, "Object of type %s is not JSON serializable",
                   jj_type_name(v));
}

duet_status_t jj_json(jj_render_t *r, size_t off, const duet_jinja_value_t *v, jj_sb_t *sb,
                      const jj_json_opts_t *o, int depth)
{
    int origin = jj_has_data(v, 0) ? DUET_JINJA_ORIGIN_DATA : DUET_JINJA_ORIGIN_TEMPLATE;
    return jj_json_into(r, off, v, sb, o, depth, origin);
}

duet_status_t jj_compare(jj_render_t *r, size_t off, const duet_jinja_value_t *a,
                         const duet_jinja_value_t *b, int *c)
{
    if (a->kind == JV_UNDEF || b->kind == JV_UNDEF)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "an undefined value cannot be ordered");
    if (jj_is_number(a) && jj_is_number(b)) {
        if (a->kind != JV_FLOAT && b->kind != JV_FLOAT) {
            int64_t x = a->kind == JV_INT ? a->i : a->b, y = b->kind == JV_INT ? b->i : b->b;
            *c = x < y ? -1 : x > y;
        } else {
            double x = jj_num(a), y = jj_num(b);
            *c = x < y ? -1 : x > y;
        }
        return DUET_OK;
    }
    if (a->kind == JV_STR && b->kind == JV_STR) {
        size_t m = a->len < b->len ? a->len : b->len;
        int k = m > 0 ? memcmp(a->s, b->s, m) : 0;
        *c = k != 0 ? (k < 0 ? -1 : 1) : a->len < b->len ? -1 : a->len > b->len;
        return DUET_OK;
    }
    if (a->kind == JV_LIST && b->kind == JV_LIST && !a->gen && !b->gen && a->tuple == b->tuple) {
        for (size_t i = 0; i < a->n && i < b->n; i++) {
            if (jj_equal(a->items[i], b->items[i], 0))
                continue;
            return jj_compare(r, off, a->items[i], b->items[i], c);
        }
        *c = a->n < b->n ? -1 : a->n > b->n;
        return DUET_OK;
    }
    return JJ_RERR(r, DUET_ERR_INVALID, off, "'<' not supported between instances of '%s' and '%s'",
                   jj_type_name(a), jj_type_name(b));
}

/* ---------------------------------------------------------------- public API */

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

void duet_jinja_vars_set_time(duet_jinja_vars_t *vars, const struct tm *now)
{
    if (vars == NULL)
        return;
    vars->has_now = now != NULL;
    if (now != NULL)
        vars->now = *now;
}

duet_jinja_value_t *duet_jinja_none(duet_jinja_vars_t *vars)
{
    return jj_new(&vars->arena, JV_NONE);
}

duet_jinja_value_t *duet_jinja_bool(duet_jinja_vars_t *vars, bool b)
{
    return jj_bool(&vars->arena, b);
}

duet_jinja_value_t *duet_jinja_int(duet_jinja_vars_t *vars, int64_t i)
{
    return jj_int(&vars->arena, i);
}

duet_jinja_value_t *duet_jinja_float(duet_jinja_vars_t *vars, double f)
{
    return jj_float(&vars->arena, f);
}

duet_jinja_value_t *duet_jinja_string(duet_jinja_vars_t *vars, const char *s, size_t len,
                                      duet_jinja_origin_t origin)
{
    if (!duet_utf8_valid(s, len))
        return NULL;
    return jj_str(&vars->arena, s, len, (int)origin);
}

duet_jinja_value_t *duet_jinja_list(duet_jinja_vars_t *vars)
{
    return jj_new(&vars->arena, JV_LIST);
}

duet_jinja_value_t *duet_jinja_map(duet_jinja_vars_t *vars)
{
    return jj_new(&vars->arena, JV_DICT);
}

duet_status_t duet_jinja_list_push(duet_jinja_vars_t *vars, duet_jinja_value_t *list,
                                   duet_jinja_value_t *item)
{
    if (vars == NULL || list == NULL || item == NULL || list->kind != JV_LIST)
        return DUET_ERR_INVALID;
    return jj_push(&vars->arena, list, item);
}

duet_status_t duet_jinja_map_set(duet_jinja_vars_t *vars, duet_jinja_value_t *map, const char *key,
                                 duet_jinja_value_t *val)
{
    if (vars == NULL || map == NULL || key == NULL || val == NULL || map->kind != JV_DICT)
        return DUET_ERR_INVALID;
    duet_jinja_value_t *k = duet_jinja_string(vars, key, strlen(key), DUET_JINJA_ORIGIN_DATA);
    if (k == NULL)
        return DUET_ERR_NOMEM;
    return jj_dict_set(&vars->arena, map, k, val);
}

duet_status_t jj_scope_set(jj_arena_t *a, jj_scope_t *sc, const char *name, size_t nlen,
                           duet_jinja_value_t *val, bool copy_name)
{
    for (jj_var_t *v = sc->vars; v != NULL; v = v->next)
        if (v->name_len == nlen && memcmp(v->name, name, nlen) == 0) {
            v->val = val;
            return DUET_OK;
        }
    jj_var_t *v = jj_alloc(a, sizeof(*v));
    if (v == NULL)
        return DUET_ERR_NOMEM;
    if (copy_name) {
        char *copy = jj_alloc(a, nlen + 1);
        if (copy == NULL)
            return DUET_ERR_NOMEM;
        memcpy(copy, name, nlen);
        name = copy;
    }
    v->name = name;
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
    return jj_scope_set(&vars->arena, &vars->globals, name, strlen(name), val, true);
}

static duet_status_t jj_from_json(duet_jinja_vars_t *vars, const json_t *j, int origin, int depth,
                                  duet_jinja_value_t **out)
{
    jj_arena_t *a = &vars->arena;
    if (depth > JJ_MAX_VALUE_DEPTH)
        return duet_error_set(DUET_ERR_RANGE, "JSON nested deeper than %d levels",
                              JJ_MAX_VALUE_DEPTH);
    duet_jinja_value_t *v = NULL;
    duet_status_t st = DUET_OK;
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        v = jj_new(a, JV_DICT);
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)j, key, val)
        {
            duet_jinja_value_t *k = v != NULL ? jj_str(a, key, strlen(key), origin) : NULL, *x;
            if (k == NULL)
                return duet_error_set(DUET_ERR_NOMEM, "JSON too large for the render's memory");
            if ((st = jj_from_json(vars, val, origin, depth + 1, &x)) != DUET_OK)
                return st;
            if (jj_push(a, v, x) != DUET_OK)
                return duet_error_set(DUET_ERR_NOMEM, "JSON too large for the render's memory");
            v->keys[v->n - 1] = k;
        }
        break;
    }
    case JSON_ARRAY: {
        v = jj_new(a, JV_LIST);
        size_t i;
        json_t *val;
        json_array_foreach(j, i, val)
        {
            duet_jinja_value_t *x;
            if (v == NULL)
                break;
            if ((st = jj_from_json(vars, val, origin, depth + 1, &x)) != DUET_OK)
                return st;
            if (jj_push(a, v, x) != DUET_OK)
                return duet_error_set(DUET_ERR_NOMEM, "JSON too large for the render's memory");
        }
        break;
    }
    case JSON_STRING:
        if (!duet_utf8_valid(json_string_value(j), json_string_length(j)))
            return duet_error_set(DUET_ERR_FORMAT, "JSON string is not valid UTF-8");
        v = jj_str(a, json_string_value(j), json_string_length(j), origin);
        break;
    case JSON_INTEGER:
        v = jj_int(a, (int64_t)json_integer_value(j));
        break;
    case JSON_REAL:
        v = jj_float(a, json_real_value(j));
        break;
    case JSON_TRUE:
        v = jj_bool(a, true);
        break;
    case JSON_FALSE:
        v = jj_bool(a, false);
        break;
    default:
        v = jj_new(a, JV_NONE);
        break;
    }
    if (v == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "JSON too large for the render's memory");
    *out = v;
    return DUET_OK;
}

duet_status_t duet_jinja_from_json(duet_jinja_vars_t *vars, const struct json_t *json,
                                   duet_jinja_origin_t origin, duet_jinja_value_t **val_p)
{
    if (vars == NULL || json == NULL || val_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "jinja: NULL argument");
    return jj_from_json(vars, (const json_t *)json, (int)origin, 0, val_p);
}
