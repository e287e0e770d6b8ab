/*
 * jinja2's built-in filters and tests, the Python str / dict / list methods templates call, and
 * the global functions (range, namespace, dict, and transformers' raise_exception and
 * strftime_now), with the results CPython and jinja2 give.
 *
 * transformers renders in an ImmutableSandboxedEnvironment, so methods that change a list or a
 * dict (append, update, pop, ...) are unsafe there: reading them gives an undefined value and
 * calling it fails, as it does here. Results that are generators in jinja2 (select, map, items,
 * unique, batch, ...) are one-pass iterators here too: always true, no length, not printable as
 * JSON.
 *
 * Origin: a string made from parts of other strings (strip, split, slices, replace, join, case
 * changes, padding) keeps the origin of each part; a string made from a whole value (str() of a
 * list, tojson, repr) is DATA when anything in the value is DATA.
 */
#include "router/api/jinja_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- helpers */

static bool jj_streq(const char *a, size_t al, const char *b)
{
    size_t bl = strlen(b);
    return al == bl && memcmp(a, b, al) == 0;
}

static duet_status_t jj_finish(jj_render_t *r, size_t off, jj_sb_t *sb, duet_jinja_value_t **out)
{
    *out = jj_sb_finish(sb);
    if (*out != NULL)
        return DUET_OK;
    if (sb->st == DUET_ERR_RANGE)
        return JJ_RERR(r, DUET_ERR_RANGE, off, "string longer than the output limit (%zu bytes)",
                       r->lim.max_output);
    return jj_nomem(r, off);
}

static duet_status_t jj_ret(jj_render_t *r, size_t off, duet_jinja_value_t *v,
                            duet_jinja_value_t **out)
{
    *out = v;
    return v != NULL ? DUET_OK : jj_nomem(r, off);
}

/* Bind positional and keyword arguments to `names` (n of them); out[i] NULL when not given. */
static duet_status_t jj_bind(jj_render_t *r, size_t off, const char *fn, const jj_args_t *a,
                             const char *const *names, size_t n, duet_jinja_value_t **out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = NULL;
    if (a->n_pos > n)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "%s() takes at most %zu argument(s) (%zu given)",
                       fn, n, a->n_pos);
    for (size_t i = 0; i < a->n_pos; i++)
        out[i] = a->pos[i];
    for (size_t k = 0; k < a->n_kw; k++) {
        size_t i = 0;
        while (i < n && !jj_streq(a->kwnames[k], a->kwlens[k], names[i]))
            i++;
        if (i == n)
            return JJ_RERR(r, DUET_ERR_INVALID, off,
                           "%s() got an unexpected keyword argument '%.*s'", fn, (int)a->kwlens[k],
                           a->kwnames[k]);
        if (out[i] != NULL)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "%s() got multiple values for argument '%s'",
                           fn, names[i]);
        out[i] = a->kw[k];
    }
    return DUET_OK;
}

static duet_status_t jj_need_str(jj_render_t *r, size_t off, const char *fn,
                                 const duet_jinja_value_t *v)
{
    if (v->kind == JV_STR)
        return DUET_OK;
    if (v->kind == JV_UNDEF)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "%s: an undefined value was used", fn);
    return JJ_RERR(r, DUET_ERR_INVALID, off, "%s() argument must be str, not %s", fn,
                   jj_type_name(v));
}

static bool jj_is_int(const duet_jinja_value_t *v)
{
    return v != NULL && (v->kind == JV_INT || v->kind == JV_BOOL);
}

static int64_t jj_ival(const duet_jinja_value_t *v)
{
    return v->kind == JV_INT ? v->i : v->b;
}

static duet_jinja_value_t *jj_list_new(jj_render_t *r, bool gen)
{
    duet_jinja_value_t *l = jj_new(r->arena, JV_LIST);
    if (l != NULL)
        l->gen = gen;
    return l;
}

static duet_jinja_value_t *jj_tuple2(jj_render_t *r, duet_jinja_value_t *a, duet_jinja_value_t *b)
{
    duet_jinja_value_t *t = jj_new(r->arena, JV_LIST);
    if (t == NULL || jj_push(r->arena, t, a) != DUET_OK || jj_push(r->arena, t, b) != DUET_OK)
        return NULL;
    t->tuple = true;
    return t;
}

/* ---------------------------------------------------------------- Markup (markupsafe) */

duet_status_t jj_escape(jj_render_t *r, size_t off, duet_jinja_value_t *v, duet_jinja_value_t **out)
{
    if (v->kind == JV_STR && v->markup) {
        *out = v;
        return DUET_OK;
    }
    duet_jinja_value_t *s = NULL;
    duet_status_t st = jj_stringify(r, off, v, &s);
    if (st != DUET_OK)
        return st;
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    for (size_t i = 0; i < s->len; i++) {
        const char *rep = s->s[i] == '&'    ? "&amp;"
                          : s->s[i] == '<'  ? "&lt;"
                          : s->s[i] == '>'  ? "&gt;"
                          : s->s[i] == '"'  ? "&#34;"
                          : s->s[i] == '\'' ? "&#39;"
                                            : NULL;
        if (rep != NULL)
            jj_sb_puts(&sb, rep, jj_origin_at(s, i));
        else
            jj_sb_put_range(&sb, s, i, 1);
    }
    if ((st = jj_finish(r, off, &sb, out)) == DUET_OK)
        (*out)->markup = true;
    return st;
}

duet_status_t jj_mark(jj_render_t *r, size_t off, duet_jinja_value_t *v, duet_jinja_value_t **out)
{
    *out = v;
    if (v->kind == JV_STR && !v->markup) {
        duet_jinja_value_t *m = jj_new(r->arena, JV_STR);
        if (m == NULL)
            return jj_nomem(r, off);
        *m = *v;
        m->markup = true;
        *out = m;
    } else if (v->kind == JV_LIST && !v->gen) { /* split(), partition() */
        duet_jinja_value_t *l = jj_list_new(r, false);
        if (l == NULL)
            return jj_nomem(r, off);
        l->tuple = v->tuple;
        for (size_t i = 0; i < v->n; i++) {
            duet_jinja_value_t *m = NULL;
            duet_status_t st = jj_mark(r, off, v->items[i], &m);
            if (st != DUET_OK)
                return st;
            if (jj_push(r->arena, l, m) != DUET_OK)
                return jj_nomem(r, off);
        }
        *out = l;
    }
    return DUET_OK;
}

/* str(v) where Python's str() of a Markup is a plain str again (replace, join, ~ with
 * autoescape off). */
static duet_status_t jj_plain(jj_render_t *r, size_t off, duet_jinja_value_t *v,
                              duet_jinja_value_t **out)
{
    *out = v;
    if (v->kind == JV_STR && v->markup) {
        if ((*out = jj_new(r->arena, JV_STR)) == NULL)
            return jj_nomem(r, off);
        **out = *v;
        (*out)->markup = false;
    }
    return DUET_OK;
}

/* A result that stays Markup when the string it came from was one (markupsafe wraps these). */
static duet_status_t jj_keep_markup(jj_render_t *r, size_t off, const duet_jinja_value_t *from,
                                    duet_status_t st, duet_jinja_value_t **out)
{
    if (st != DUET_OK || from->kind != JV_STR || !from->markup)
        return st;
    return jj_mark(r, off, *out, out);
}

duet_status_t jj_iterate(jj_render_t *r, size_t off, duet_jinja_value_t *v,
                         duet_jinja_value_t **list_p)
{
    duet_jinja_value_t *l;
    duet_status_t st = jj_work(r, off, v->kind == JV_STR ? v->len : v->n);
    if (st != DUET_OK)
        return st;
    switch (v->kind) {
    case JV_UNDEF:
        return jj_ret(r, off, jj_list_new(r, false), list_p);
    case JV_LIST:
        if (v->gen) {
            if (v->b) /* a one-pass iterator already walked */
                return jj_ret(r, off, jj_list_new(r, false), list_p);
            v->b = true;
        }
        *list_p = v;
        return DUET_OK;
    case JV_DICT:
    case JV_NS:
        l = jj_list_new(r, false);
        for (size_t i = 0; l != NULL && i < v->n; i++)
            if (jj_push(r->arena, l, v->keys[i]) != DUET_OK)
                l = NULL;
        return jj_ret(r, off, l, list_p);
    case JV_STR:
        l = jj_list_new(r, false);
        for (size_t i = 0; l != NULL && i < v->len;) {
            size_t at = i;
            jj_utf8_next(v->s, v->len, &i);
            jj_sb_t sb;
            jj_sb_init(&sb, r->arena, r->lim.max_output);
            jj_sb_put_range(&sb, v, at, i - at);
            duet_jinja_value_t *c = jj_sb_finish(&sb);
            if (c == NULL || jj_push(r->arena, l, c) != DUET_OK)
                l = NULL;
        }
        return jj_ret(r, off, l, list_p);
    default:
        return JJ_RERR(r, DUET_ERR_INVALID, off, "'%s' object is not iterable", jj_type_name(v));
    }
}

/* len(): code points for strings. */
static duet_status_t jj_len(jj_render_t *r, size_t off, const duet_jinja_value_t *v, int64_t *n)
{
    switch (v->kind) {
    case JV_UNDEF:
        *n = 0;
        return DUET_OK;
    case JV_STR:
        *n = (int64_t)jj_utf8_count(v->s, v->len);
        return DUET_OK;
    case JV_LIST:
        if (v->gen)
            break;
        *n = (int64_t)v->n;
        return DUET_OK;
    case JV_DICT:
        *n = (int64_t)v->n;
        return DUET_OK;
    default:
        break;
    }
    return JJ_RERR(r, DUET_ERR_INVALID, off, "object of type '%s' has no len()", jj_type_name(v));
}

/* ---------------------------------------------------------------- case mapping */

/* Python's simple case mappings for the scripts chat text uses most: Latin, Greek, Cyrillic,
 * Armenian and fullwidth Latin. Other characters are left as they are. */
static uint32_t jj_cp_upper(uint32_t c)
{
    if (c >= 'a' && c <= 'z')
        return c - 32;
    if (c < 0x80)
        return c;
    if ((c >= 0xe0 && c <= 0xfe && c != 0xf7))
        return c - 32;
    if (c == 0xff)
        return 0x178;
    if (c == 0xb5)
        return 0x39c;
    if (c >= 0x100 && c <= 0x17f) {
        if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e))
            return (c & 1) == 0 ? c - 1 : c;
        if (c == 0x131)
            return 'I';
        if (c == 0x17f)
            return 'S';
        if (c == 0x130 || c == 0x138 || c == 0x149)
            return c;
        return (c & 1) ? c - 1 : c;
    }
    if (c >= 0x3b1 && c <= 0x3c9 && c != 0x3c2)
        return c - 32;
    if (c == 0x3c2)
        return 0x3a3;
    if (c == 0x3ac)
        return 0x386;
    if (c >= 0x3ad && c <= 0x3af)
        return c - 37;
    if (c == 0x3cc)
        return 0x38c;
    if (c == 0x3cd || c == 0x3ce)
        return c - 63;
    if (c >= 0x430 && c <= 0x44f)
        return c - 32;
    if (c >= 0x450 && c <= 0x45f)
        return c - 80;
    if ((c >= 0x460 && c <= 0x481) || (c >= 0x48a && c <= 0x4bf) || (c >= 0x4d0 && c <= 0x52f))
        return (c & 1) ? c - 1 : c;
    if (c >= 0x561 && c <= 0x586)
        return c - 48;
    if (c >= 0xff41 && c <= 0xff5a)
        return c - 32;
    return c;
}

static uint32_t jj_cp_lower(uint32_t c)
{
    if (c >= 'A' && c <= 'Z')
        return c + 32;
    if (c < 0x80)
        return c;
    if (c >= 0xc0 && c <= 0xde && c != 0xd7)
        return c + 32;
    if (c == 0x178)
        return 0xff;
    if (c >= 0x100 && c <= 0x17f) {
        if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e))
            return (c & 1) ? c + 1 : c;
        if (c == 0x130)
            return 'i';
        if (c == 0x131 || c == 0x138 || c == 0x149 || c == 0x17f)
            return c;
        return (c & 1) == 0 ? c + 1 : c;
    }
    if (c >= 0x391 && c <= 0x3a9 && c != 0x3a2)
        return c + 32;
    if (c == 0x386)
        return 0x3ac;
    if (c >= 0x388 && c <= 0x38a)
        return c + 37;
    if (c == 0x38c)
        return 0x3cc;
    if (c == 0x38e || c == 0x38f)
        return c + 63;
    if (c >= 0x410 && c <= 0x42f)
        return c + 32;
    if (c >= 0x400 && c <= 0x40f)
        return c + 80;
    if ((c >= 0x460 && c <= 0x481) || (c >= 0x48a && c <= 0x4bf) || (c >= 0x4d0 && c <= 0x52f))
        return (c & 1) == 0 ? c + 1 : c;
    if (c >= 0x531 && c <= 0x556)
        return c + 48;
    if (c >= 0xff21 && c <= 0xff3a)
        return c + 32;
    return c;
}

static bool jj_cp_cased(uint32_t c)
{
    return jj_cp_upper(c) != c || jj_cp_lower(c) != c;
}

typedef enum {
    JCASE_UPPER,
    JCASE_LOWER,
    JCASE_CAPITALIZE,
    JCASE_TITLE_PY,
    JCASE_TITLE_JINJA,
    JCASE_SWAP
} jcase_t;

static bool jj_title_sep(uint32_t c)
{
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || duet_unicode_isspace(c);
}

/* Python's Final_Sigma: a capital sigma at [at, end) lowers to 'ς' when a cased letter comes
 * before it (skipping case-ignorable characters) and none comes after. */
static bool jj_final_sigma(const duet_jinja_value_t *s, size_t at, size_t end)
{
    bool before = false;
    for (size_t k = at; k > 0 && !before;) {
        size_t b = k - 1;
        while (b > 0 && ((unsigned char)s->s[b] & 0xc0) == 0x80)
            b--;
        size_t e = b;
        uint32_t c = jj_utf8_next(s->s, s->len, &e);
        if (c == '\'' || c == 0x2019 || c == 0xad || (c >= 0x300 && c <= 0x36f))
            k = b; /* case-ignorable */
        else if (jj_cp_cased(c))
            before = true;
        else
            break;
    }
    if (!before)
        return false;
    for (size_t k = end; k < s->len;) {
        uint32_t c = jj_utf8_next(s->s, s->len, &k);
        if (c == '\'' || c == 0x2019 || c == 0xad || (c >= 0x300 && c <= 0x36f))
            continue;
        return !jj_cp_cased(c);
    }
    return true;
}

/* Case conversion, each character keeping the origin of its bytes. */
static duet_status_t jj_case(jj_render_t *r, size_t off, const duet_jinja_value_t *s, jcase_t how,
                             duet_jinja_value_t **out)
{
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    bool word_start = true, prev_cased = false;
    for (size_t i = 0; i < s->len;) {
        size_t at = i;
        uint32_t c = jj_utf8_next(s->s, s->len, &i), m = c;
        switch (how) {
        case JCASE_UPPER:
            m = jj_cp_upper(c);
            break;
        case JCASE_LOWER:
            m = jj_cp_lower(c);
            break;
        case JCASE_SWAP:
            m = jj_cp_upper(c) != c ? jj_cp_upper(c) : jj_cp_lower(c);
            break;
        case JCASE_CAPITALIZE:
            m = at == 0 ? jj_cp_upper(c) : jj_cp_lower(c);
            break;
        case JCASE_TITLE_PY:
            m = prev_cased ? jj_cp_lower(c) : jj_cp_upper(c);
            prev_cased = jj_cp_cased(c);
            break;
        case JCASE_TITLE_JINJA:
            if (jj_title_sep(c)) {
                word_start = true;
            } else {
                m = word_start ? jj_cp_upper(c) : jj_cp_lower(c);
                word_start = false;
            }
            break;
        }
        char buf[8];
        size_t n;
        if (c == 0xdf && (how == JCASE_UPPER || how == JCASE_SWAP)) {
            n = 2; /* Python's full case mapping: 'ß'.upper() == 'SS' */
            buf[0] = buf[1] = 'S';
        } else {
            if (m == 0x3c3 && c == 0x3a3 && jj_final_sigma(s, at, i))
                m = 0x3c2;
            n = jj_utf8_put(buf, m);
        }
        jj_sb_put(&sb, buf, n, jj_origin_at(s, at));
    }
    return jj_finish(r, off, &sb, out);
}

/* ---------------------------------------------------------------- strings */

/* Does s[i] start one of the code points of `chars` (NULL: whitespace)? Its length, else 0. */
static size_t jj_strip_match(const duet_jinja_value_t *s, size_t i, const duet_jinja_value_t *chars)
{
    size_t k = i;
    uint32_t c = jj_utf8_next(s->s, s->len, &k);
    if (chars == NULL)
        return duet_unicode_isspace(c) ? k - i : 0;
    for (size_t j = 0; j < chars->len;) {
        if (jj_utf8_next(chars->s, chars->len, &j) == c)
            return k - i;
    }
    return 0;
}

static duet_status_t jj_strip(jj_render_t *r, size_t off, const duet_jinja_value_t *s,
                              const duet_jinja_value_t *chars, bool left, bool right,
                              duet_jinja_value_t **out)
{
    size_t b = 0, e = s->len, n;
    if (left)
        while (b < e && (n = jj_strip_match(s, b, chars)) > 0)
            b += n;
    if (right)
        while (e > b) {
            size_t k = e - 1;
            while (k > b && ((unsigned char)s->s[k] & 0xc0) == 0x80)
                k--;
            if (jj_strip_match(s, k, chars) == 0)
                break;
            e = k;
        }
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    jj_sb_put_range(&sb, s, b, e - b);
    return jj_finish(r, off, &sb, out);
}

static duet_jinja_value_t *jj_substr(jj_render_t *r, const duet_jinja_value_t *s, size_t b,
                                     size_t n)
{
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    jj_sb_put_range(&sb, s, b, n);
    return jj_sb_finish(&sb);
}

static size_t jj_find(const duet_jinja_value_t *s, size_t from, const duet_jinja_value_t *sub)
{
    if (sub->len == 0)
        return from <= s->len ? from : SIZE_MAX;
    for (size_t i = from; sub->len <= s->len && i <= s->len - sub->len; i++)
        if (memcmp(s->s + i, sub->s, sub->len) == 0)
            return i;
    return SIZE_MAX;
}

static size_t jj_rfind(const duet_jinja_value_t *s, const duet_jinja_value_t *sub)
{
    if (sub->len > s->len)
        return SIZE_MAX;
    for (size_t i = s->len - sub->len + 1; i-- > 0;)
        if (memcmp(s->s + i, sub->s, sub->len) == 0)
            return i;
    return SIZE_MAX;
}

/* Pieces [b, e) of a split, collected in order. */
typedef struct {
    size_t *b, *e;
    size_t n, cap;
} jj_pieces_t;

static bool jj_piece(jj_pieces_t *p, size_t b, size_t e)
{
    if (p->n == p->cap) {
        size_t cap = p->cap == 0 ? 16 : p->cap * 2;
        size_t *nb = realloc(p->b, cap * sizeof(*nb));
        if (nb == NULL)
            return false;
        p->b = nb;
        size_t *ne = realloc(p->e, cap * sizeof(*ne));
        if (ne == NULL)
            return false;
        p->e = ne;
        p->cap = cap;
    }
    p->b[p->n] = b;
    p->e[p->n] = e;
    p->n++;
    return true;
}

/* Start of the character that ends at e (e > 0). */
static size_t jj_char_before(const duet_jinja_value_t *s, size_t e)
{
    size_t k = e - 1;
    while (k > 0 && ((unsigned char)s->s[k] & 0xc0) == 0x80)
        k--;
    return k;
}

/* str.split / str.rsplit, as CPython splits (whitespace runs when sep is None). */
static duet_status_t jj_split(jj_render_t *r, size_t off, const duet_jinja_value_t *s,
                              const duet_jinja_value_t *sep, int64_t maxsplit, bool from_right,
                              duet_jinja_value_t **out)
{
    if (sep != NULL && sep->len == 0)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "empty separator");
    jj_pieces_t pc = {0};
    bool ok = true;
    int64_t left = maxsplit < 0 ? INT64_MAX : maxsplit;
    size_t len = s->len;
    if (sep == NULL && !from_right) {
        size_t i = 0, k;
        for (; left-- > 0 && ok;) {
            while (i < len && (k = jj_strip_match(s, i, NULL)) > 0)
                i += k;
            if (i == len)
                break;
            size_t j = i;
            while (i < len && jj_strip_match(s, i, NULL) == 0)
                jj_utf8_next(s->s, len, &i);
            ok = jj_piece(&pc, j, i);
        }
        if (ok && i < len) {
            while (i < len && (k = jj_strip_match(s, i, NULL)) > 0)
                i += k;
            if (i != len)
                ok = jj_piece(&pc, i, len);
        }
    } else if (sep == NULL) {
        size_t e = len; /* one past the last character not yet taken */
        for (; left-- > 0 && ok;) {
            while (e > 0 && jj_strip_match(s, jj_char_before(s, e), NULL) > 0)
                e = jj_char_before(s, e);
            if (e == 0)
                break;
            size_t b = e;
            while (b > 0 && jj_strip_match(s, jj_char_before(s, b), NULL) == 0)
                b = jj_char_before(s, b);
            ok = jj_piece(&pc, b, e);
            e = b;
        }
        if (ok && e > 0) {
            while (e > 0 && jj_strip_match(s, jj_char_before(s, e), NULL) > 0)
                e = jj_char_before(s, e);
            if (e > 0)
                ok = jj_piece(&pc, 0, e);
        }
        for (size_t a = 0, z = pc.n; ok && a + 1 < z; a++, z--) { /* back to left-to-right */
            size_t tb = pc.b[a], te = pc.e[a];
            pc.b[a] = pc.b[z - 1];
            pc.e[a] = pc.e[z - 1];
            pc.b[z - 1] = tb;
            pc.e[z - 1] = te;
        }
    } else if (!from_right) {
        size_t b = 0;
        for (; left-- > 0 && ok;) {
            size_t at = jj_find(s, b, sep);
            if (at == SIZE_MAX)
                break;
            ok = jj_piece(&pc, b, at);
            b = at + sep->len;
        }
        if (ok)
            ok = jj_piece(&pc, b, len);
    } else {
        size_t e = len;
        for (; left-- > 0 && ok;) {
            duet_jinja_value_t head = *s;
            head.len = e;
            size_t at = jj_rfind(&head, sep);
            if (at == SIZE_MAX)
                break;
            ok = jj_piece(&pc, at + sep->len, e);
            e = at;
        }
        if (ok)
            ok = jj_piece(&pc, 0, e);
        for (size_t a = 0, z = pc.n; ok && a + 1 < z; a++, z--) {
            size_t tb = pc.b[a], te = pc.e[a];
            pc.b[a] = pc.b[z - 1];
            pc.e[a] = pc.e[z - 1];
            pc.b[z - 1] = tb;
            pc.e[z - 1] = te;
        }
    }
    duet_jinja_value_t *l = ok ? jj_list_new(r, false) : NULL;
    for (size_t k = 0; l != NULL && k < pc.n; k++) {
        duet_jinja_value_t *piece = jj_substr(r, s, pc.b[k], pc.e[k] - pc.b[k]);
        if (piece == NULL || jj_push(r->arena, l, piece) != DUET_OK)
            l = NULL;
    }
    free(pc.b);
    free(pc.e);
    if (l == NULL)
        return jj_nomem(r, off);
    *out = l;
    return DUET_OK;
}

static duet_status_t jj_replace(jj_render_t *r, size_t off, const duet_jinja_value_t *s,
                                const duet_jinja_value_t *old, const duet_jinja_value_t *new_,
                                int64_t count, duet_jinja_value_t **out)
{
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    size_t i = 0;
    int64_t done = 0;
    if (old->len == 0) {
        /* Python inserts `new` before every character and at the end. */
        while (count < 0 || done < count) {
            jj_sb_put_str(&sb, new_);
            done++;
            if (i >= s->len)
                break;
            size_t at = i;
            jj_utf8_next(s->s, s->len, &i);
            jj_sb_put_range(&sb, s, at, i - at);
        }
        jj_sb_put_range(&sb, s, i, s->len - i);
        return jj_finish(r, off, &sb, out);
    }
    while (count < 0 || done < count) {
        size_t at = jj_find(s, i, old);
        if (at == SIZE_MAX)
            break;
        jj_sb_put_range(&sb, s, i, at - i);
        jj_sb_put_str(&sb, new_);
        i = at + old->len;
        done++;
    }
    jj_sb_put_range(&sb, s, i, s->len - i);
    return jj_finish(r, off, &sb, out);
}

/* str.startswith / endswith with a string or a tuple of strings. */
static duet_status_t jj_affix(jj_render_t *r, size_t off, const duet_jinja_value_t *s,
                              const duet_jinja_value_t *x, bool end, bool *res)
{
    *res = false;
    if (x->kind == JV_LIST && x->tuple) {
        for (size_t i = 0; i < x->n && !*res; i++) {
            duet_status_t st = jj_affix(r, off, s, x->items[i], end, res);
            if (st != DUET_OK)
                return st;
        }
        return DUET_OK;
    }
    if (x->kind != JV_STR)
        return JJ_RERR(r, DUET_ERR_INVALID, off,
                       "%s first arg must be str or a tuple of str, not %s",
                       end ? "endswith" : "startswith", jj_type_name(x));
    *res = x->len <= s->len &&
           (x->len == 0 || memcmp(s->s + (end ? s->len - x->len : 0), x->s, x->len) == 0);
    return DUET_OK;
}

static duet_status_t jj_pad(jj_render_t *r, size_t off, const duet_jinja_value_t *s, int64_t width,
                            const duet_jinja_value_t *fill,
                            int where /* 0 center, 1 ljust, 2 rjust */, duet_jinja_value_t **out)
{
    int64_t n = (int64_t)jj_utf8_count(s->s, s->len), pad = width - n;
    if (pad <= 0) {
        *out = (duet_jinja_value_t *)s;
        return DUET_OK;
    }
    if ((uint64_t)pad > r->lim.max_output)
        return JJ_RERR(r, DUET_ERR_RANGE, off, "string longer than the output limit (%zu bytes)",
                       r->lim.max_output);
    int64_t left = where == 1 ? 0 : where == 2 ? pad : pad / 2 + (pad & width & 1);
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    for (int64_t k = 0; k < left; k++)
        jj_sb_put_str(&sb, fill);
    jj_sb_put_str(&sb, s);
    for (int64_t k = 0; k < pad - left; k++)
        jj_sb_put_str(&sb, fill);
    return jj_finish(r, off, &sb, out);
}

/* str.format: {}, {0}, {name}, {{ and }}; no format specs or conversions. */
static duet_status_t jj_format(jj_render_t *r, size_t off, const duet_jinja_value_t *s,
                               const jj_args_t *a, duet_jinja_value_t **out)
{
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    size_t auto_i = 0;
    for (size_t i = 0; i < s->len;) {
        char c = s->s[i];
        if ((c == '{' || c == '}') && i + 1 < s->len && s->s[i + 1] == c) {
            jj_sb_put_range(&sb, s, i, 1);
            i += 2;
            continue;
        }
        if (c == '}')
            return JJ_RERR(r, DUET_ERR_INVALID, off, "Single '}' encountered in format string");
        if (c != '{') {
            jj_sb_put_range(&sb, s, i, 1);
            i++;
            continue;
        }
        size_t e = i + 1;
        while (e < s->len && s->s[e] != '}')
            e++;
        if (e >= s->len)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "Single '{' encountered in format string");
        const char *f = s->s + i + 1;
        size_t fl = e - i - 1;
        if (memchr(f, ':', fl) != NULL || memchr(f, '!', fl) != NULL ||
            memchr(f, '.', fl) != NULL || memchr(f, '[', fl) != NULL)
            return JJ_RERR(r, DUET_ERR_UNSUPPORTED, off,
                           "format specs and conversions in str.format are not supported");
        duet_jinja_value_t *v = NULL;
        if (fl == 0 || (f[0] >= '0' && f[0] <= '9')) {
            size_t idx = fl == 0 ? auto_i++ : (size_t)strtoul(f, NULL, 10);
            if (idx >= a->n_pos)
                return JJ_RERR(r, DUET_ERR_INVALID, off, "Replacement index %zu out of range", idx);
            v = a->pos[idx];
        } else {
            for (size_t k = 0; k < a->n_kw && v == NULL; k++)
                if (a->kwlens[k] == fl && memcmp(a->kwnames[k], f, fl) == 0)
                    v = a->kw[k];
            if (v == NULL)
                return JJ_RERR(r, DUET_ERR_INVALID, off, "KeyError: '%.*s'", (int)fl, f);
        }
        duet_status_t st = jj_to_str(r, off, v, &sb);
        if (st != DUET_OK)
            return st;
        i = e + 1;
    }
    return jj_finish(r, off, &sb, out);
}

duet_status_t jj_percent(jj_render_t *r, size_t off, const duet_jinja_value_t *fmt,
                         duet_jinja_value_t *arg, duet_jinja_value_t **out)
{
    /* Python's str % arg: a tuple gives the values in order, a dict the %(name)s values, any
     * other value is the one value. */
    duet_jinja_value_t *one[1] = {arg};
    duet_jinja_value_t **vals = one;
    size_t n = 1, used = 0;
    const duet_jinja_value_t *map = NULL;
    if (arg->kind == JV_LIST && arg->tuple) {
        vals = arg->items;
        n = arg->n;
    } else if (arg->kind == JV_DICT) {
        map = arg;
    }
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    duet_status_t st = DUET_OK;
    for (size_t i = 0; i < fmt->len && st == DUET_OK;) {
        if (fmt->s[i] != '%') {
            size_t j = i;
            while (j < fmt->len && fmt->s[j] != '%')
                j++;
            jj_sb_put_range(&sb, fmt, i, j - i);
            i = j;
            continue;
        }
        size_t at = i++;
        duet_jinja_value_t *v = NULL;
        if (i < fmt->len && fmt->s[i] == '(') {
            size_t e = i + 1;
            while (e < fmt->len && fmt->s[e] != ')')
                e++;
            if (map == NULL || e >= fmt->len)
                return JJ_RERR(r, DUET_ERR_INVALID, off, "format requires a mapping");
            v = jj_dict_get(map, fmt->s + i + 1, e - i - 1);
            if (v == NULL)
                return JJ_RERR(r, DUET_ERR_INVALID, off, "KeyError: '%.*s'", (int)(e - i - 1),
                               fmt->s + i + 1);
            i = e + 1;
        }
        char spec[32];
        size_t sl = 0;
        spec[sl++] = '%';
        while (i < fmt->len && strchr("-+ 0#", fmt->s[i]) != NULL && sl < 8)
            spec[sl++] = fmt->s[i++];
        while (i < fmt->len && fmt->s[i] >= '0' && fmt->s[i] <= '9' && sl < 16)
            spec[sl++] = fmt->s[i++];
        if (i < fmt->len && fmt->s[i] == '.') {
            spec[sl++] = fmt->s[i++];
            while (i < fmt->len && fmt->s[i] >= '0' && fmt->s[i] <= '9' && sl < 24)
                spec[sl++] = fmt->s[i++];
        }
        spec[sl] = '\0'; /* the precision is read with strtoul below */
        if (i >= fmt->len)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "incomplete format");
        /* Width and precision beyond 4 digits would only build strings over the limits. */
        size_t digits = 0;
        for (size_t k = 1; k < sl; k++) {
            digits = spec[k] >= '0' && spec[k] <= '9' ? digits + 1 : 0;
            if (digits > 4)
                return JJ_RERR(r, DUET_ERR_RANGE, off, "format width or precision too large");
        }
        char conv = fmt->s[i++];
        if (conv == '%' && sl == 1) {
            jj_sb_put_range(&sb, fmt, at, 1);
            continue;
        }
        if (v == NULL) {
            if (map != NULL)
                v = (duet_jinja_value_t *)map;
            else if (used < n)
                v = vals[used++];
            else
                return JJ_RERR(r, DUET_ERR_INVALID, off, "not enough arguments for format string");
        }
        char buf[10400]; /* 4-digit width or precision, plus a double's 309 digits */
        int len = 0;
        if (conv == 's' || conv == 'r' || conv == 'a') {
            duet_jinja_value_t *str = NULL;
            if (conv == 's') {
                st = jj_stringify(r, off, v, &str);
            } else {
                jj_sb_t rs;
                jj_sb_init(&rs, r->arena, r->lim.max_output);
                if ((st = jj_repr(r, off, v, &rs, 0)) == DUET_OK)
                    st = jj_finish(r, off, &rs, &str);
            }
            /* Markup % args escapes what %s and %r put in (markupsafe's _MarkupEscapeHelper) */
            if (st == DUET_OK && fmt->markup)
                st = jj_escape(r, off, conv == 's' ? v : str, &str);
            if (st != DUET_OK)
                return st;
            if (sl == 1) {
                jj_sb_put_str(&sb, str);
                continue;
            }
            /* width and precision count characters */
            bool left = memchr(spec, '-', sl) != NULL;
            const char *dot = memchr(spec, '.', sl);
            size_t width = 0, prec = SIZE_MAX;
            for (size_t k = 1; k < sl && spec[k] != '.'; k++)
                if (spec[k] >= '0' && spec[k] <= '9' && !(spec[k] == '0' && width == 0))
                    width = width * 10 + (size_t)(spec[k] - '0');
            if (dot != NULL)
                prec = strtoul(dot + 1, NULL, 10);
            size_t chars = jj_utf8_count(str->s, str->len), keep = chars < prec ? chars : prec;
            size_t bytes = jj_utf8_offset(str->s, str->len, keep);
            for (size_t k = keep; !left && k < width; k++)
                jj_sb_put(&sb, " ", 1, DUET_JINJA_ORIGIN_TEMPLATE);
            jj_sb_put_range(&sb, str, 0, bytes);
            for (size_t k = keep; left && k < width; k++)
                jj_sb_put(&sb, " ", 1, DUET_JINJA_ORIGIN_TEMPLATE);
            continue;
        }
        if (!jj_is_number(v))
            return JJ_RERR(r, DUET_ERR_INVALID, off,
                           "%%%c format: a real number is required, not %s", conv, jj_type_name(v));
        if (strchr("diuxXoc", conv) != NULL) {
            if (v->kind == JV_FLOAT && conv == 'c')
                return JJ_RERR(r, DUET_ERR_INVALID, off, "%%c requires int or char");
            /* A float converts when it fits duet's 64-bit integers (the range is [-2^63, 2^63)):
             * a C cast of anything else is undefined. */
            if (v->kind == JV_FLOAT && v->f != v->f)
                return JJ_RERR(r, DUET_ERR_INVALID, off, "cannot convert float NaN to integer");
            if (v->kind == JV_FLOAT && !(v->f >= -0x1p63 && v->f < 0x1p63))
                return JJ_RERR(r, DUET_ERR_RANGE, off, "%%%c format: %g: integer overflow", conv,
                               v->f);
            int64_t iv = v->kind == JV_FLOAT ? (int64_t)v->f : jj_ival(v);
            if (conv == 'c') {
                /* a code point UTF-8 can carry; Python stops at 0x10ffff, and a lone surrogate
                 * could not be encoded for the tokenizer either */
                if (iv < 0 || iv > 0x10ffff)
                    return JJ_RERR(r, DUET_ERR_RANGE, off, "%%c arg not in range(0x110000)");
                if (iv >= 0xd800 && iv <= 0xdfff)
                    return JJ_RERR(r, DUET_ERR_UNSUPPORTED, off,
                                   "%%c of a surrogate (U+%04llX) is not valid UTF-8",
                                   (unsigned long long)iv);
                char u[4];
                jj_sb_put(&sb, u, jj_utf8_put(u, (uint32_t)iv), DUET_JINJA_ORIGIN_TEMPLATE);
                continue;
            }
            char cf[40];
            snprintf(cf, sizeof(cf), "%s%s", spec,
                     conv == 'i' || conv == 'u' ? "lld"
                     : conv == 'd'              ? "lld"
                     : conv == 'x'              ? "llx"
                     : conv == 'X'              ? "llX"
                                                : "llo");
            if ((conv == 'x' || conv == 'X' || conv == 'o') && iv < 0) {
                /* Python prints a sign and the magnitude */
                char mag[64];
                snprintf(cf, sizeof(cf), "%s%s", spec,
                         conv == 'x'   ? "llx"
                         : conv == 'X' ? "llX"
                                       : "llo");
                snprintf(mag, sizeof(mag), cf, 0ull - (unsigned long long)iv); /* INT64_MIN */
                len = snprintf(buf, sizeof(buf), "-%s", mag);
            } else {
                len = snprintf(buf, sizeof(buf), cf, (long long)iv);
            }
        } else if (strchr("eEfFgG", conv) != NULL) {
            char cf[40];
            snprintf(cf, sizeof(cf), "%s%c", spec, conv);
            len = snprintf(buf, sizeof(buf), cf, jj_num(v));
        } else {
            return JJ_RERR(r, DUET_ERR_INVALID, off, "unsupported format character '%c'", conv);
        }
        if (len >= (int)sizeof(buf))
            return JJ_RERR(r, DUET_ERR_RANGE, off, "formatted number too long");
        jj_sb_put(&sb, buf, len > 0 ? (size_t)len : 0, DUET_JINJA_ORIGIN_TEMPLATE);
    }
    if (map == NULL && used < n)
        return JJ_RERR(r, DUET_ERR_INVALID, off,
                       "not all arguments converted during string formatting");
    if ((st = jj_finish(r, off, &sb, out)) == DUET_OK)
        (*out)->markup = fmt->markup;
    return st;
}

static duet_status_t jj_join(jj_render_t *r, size_t off, duet_jinja_value_t *items,
                             const duet_jinja_value_t *sep, duet_jinja_value_t **out)
{
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    for (size_t i = 0; i < items->n; i++) {
        if (i > 0 && sep != NULL)
            jj_sb_put_str(&sb, sep);
        duet_status_t st = jj_to_str(r, off, items->items[i], &sb);
        if (st != DUET_OK)
            return st;
    }
    return jj_finish(r, off, &sb, out);
}

/* ---------------------------------------------------------------- attributes and items */

static const char *const jj_str_methods[] = {
    "startswith", "endswith",  "strip",      "lstrip",       "rstrip",       "split",
    "rsplit",     "replace",   "upper",      "lower",        "title",        "capitalize",
    "swapcase",   "find",      "rfind",      "index",        "rindex",       "count",
    "join",       "format",    "isdigit",    "isalpha",      "isalnum",      "isspace",
    "islower",    "isupper",   "center",     "ljust",        "rjust",        "zfill",
    "splitlines", "partition", "rpartition", "removeprefix", "removesuffix", "casefold",
    "isnumeric",  "isdecimal", "istitle"};
static const char *const jj_dict_methods[] = {"get", "items", "keys", "values", "copy"};
static const char *const jj_dict_unsafe[] = {"pop", "popitem", "update", "setdefault", "clear"};
static const char *const jj_list_methods[] = {"index", "count", "copy"};
static const char *const jj_list_unsafe[] = {"append", "extend",  "insert", "pop",
                                             "remove", "reverse", "sort",   "clear"};

static bool jj_name_in(const char *name, size_t nlen, const char *const *names, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (jj_streq(name, nlen, names[i]))
            return true;
    return false;
}

#define JJ_COUNT(a) (sizeof(a) / sizeof((a)[0]))

static duet_status_t jj_method(jj_render_t *r, size_t off, duet_jinja_value_t *self,
                               const char *name, size_t nlen, duet_jinja_value_t **out)
{
    duet_jinja_value_t *m = jj_new(r->arena, JV_METHOD);
    if (m == NULL)
        return jj_nomem(r, off);
    m->self = self;
    m->s = name;
    m->len = nlen;
    *out = m;
    return DUET_OK;
}

duet_status_t jj_getattr(jj_render_t *r, size_t off, duet_jinja_value_t *a, const char *name,
                         size_t nlen, duet_jinja_value_t **out)
{
    *out = &jj_undef_value;
    switch (a->kind) {
    case JV_STR:
        if (jj_name_in(name, nlen, jj_str_methods, JJ_COUNT(jj_str_methods)))
            return jj_method(r, off, a, name, nlen, out);
        return DUET_OK;
    case JV_DICT: {
        if (jj_name_in(name, nlen, jj_dict_methods, JJ_COUNT(jj_dict_methods)))
            return jj_method(r, off, a, name, nlen, out);
        if (jj_name_in(name, nlen, jj_dict_unsafe, JJ_COUNT(jj_dict_unsafe))) {
            *out = &jj_unsafe_value;
            return DUET_OK;
        }
        duet_jinja_value_t *v = jj_dict_get(a, name, nlen);
        if (v != NULL)
            *out = v;
        return DUET_OK;
    }
    case JV_NS: {
        duet_jinja_value_t *v = jj_dict_get(a, name, nlen);
        if (v != NULL)
            *out = v;
        return DUET_OK;
    }
    case JV_LIST:
        if (!a->gen && jj_name_in(name, nlen, jj_list_methods, JJ_COUNT(jj_list_methods)))
            return jj_method(r, off, a, name, nlen, out);
        if (!a->gen && jj_name_in(name, nlen, jj_list_unsafe, JJ_COUNT(jj_list_unsafe)))
            *out = &jj_unsafe_value;
        return DUET_OK;
    case JV_LOOP: {
        int64_t i = a->i, n = (int64_t)a->self->n;
        if (jj_streq(name, nlen, "index"))
            return jj_ret(r, off, jj_int(r->arena, i + 1), out);
        if (jj_streq(name, nlen, "index0"))
            return jj_ret(r, off, jj_int(r->arena, i), out);
        if (jj_streq(name, nlen, "revindex"))
            return jj_ret(r, off, jj_int(r->arena, n - i), out);
        if (jj_streq(name, nlen, "revindex0"))
            return jj_ret(r, off, jj_int(r->arena, n - i - 1), out);
        if (jj_streq(name, nlen, "first"))
            return jj_ret(r, off, jj_bool(r->arena, i == 0), out);
        if (jj_streq(name, nlen, "last"))
            return jj_ret(r, off, jj_bool(r->arena, i == n - 1), out);
        if (jj_streq(name, nlen, "length"))
            return jj_ret(r, off, jj_int(r->arena, n), out);
        if (jj_streq(name, nlen, "depth"))
            return jj_ret(r, off, jj_int(r->arena, a->depth + 1), out);
        if (jj_streq(name, nlen, "depth0"))
            return jj_ret(r, off, jj_int(r->arena, a->depth), out);
        if (jj_streq(name, nlen, "previtem")) {
            if (i > 0)
                *out = a->self->items[i - 1];
            return DUET_OK;
        }
        if (jj_streq(name, nlen, "nextitem")) {
            if (i + 1 < n)
                *out = a->self->items[i + 1];
            return DUET_OK;
        }
        if (jj_streq(name, nlen, "cycle"))
            return jj_method(r, off, a, name, nlen, out);
        return DUET_OK;
    }
    default:
        return DUET_OK;
    }
}

duet_status_t jj_getitem(jj_render_t *r, size_t off, duet_jinja_value_t *a, duet_jinja_value_t *key,
                         duet_jinja_value_t **out)
{
    *out = &jj_undef_value;
    if (a->kind == JV_DICT || a->kind == JV_NS) {
        if (!((key->kind == JV_LIST && !key->tuple) || key->kind == JV_DICT))
            for (size_t i = 0; i < a->n; i++)
                if (jj_equal(a->keys[i], key, 0)) {
                    *out = a->items[i];
                    return DUET_OK;
                }
    } else if ((a->kind == JV_LIST && !a->gen) || a->kind == JV_STR) {
        if (jj_is_int(key)) {
            int64_t n = (int64_t)(a->kind == JV_LIST ? a->n : jj_utf8_count(a->s, a->len));
            int64_t i = jj_ival(key);
            if (i < 0)
                i += n;
            if (i < 0 || i >= n)
                return DUET_OK;
            if (a->kind == JV_LIST) {
                *out = a->items[i];
                return DUET_OK;
            }
            size_t b = jj_utf8_offset(a->s, a->len, (size_t)i), e = b;
            jj_utf8_next(a->s, a->len, &e);
            return jj_ret(r, off, jj_substr(r, a, b, e - b), out);
        }
    }
    if (key->kind == JV_STR)
        return jj_getattr(r, off, a, key->s, key->len, out);
    return DUET_OK;
}

/* ---------------------------------------------------------------- methods */

static duet_status_t jj_str_method_plain(jj_render_t *r, size_t off, duet_jinja_value_t *s,
                                         const char *name, size_t nlen, const jj_args_t *a,
                                         duet_jinja_value_t **out)
{
    duet_jinja_value_t *p[3];
    duet_status_t st;
#define M(n) jj_streq(name, nlen, n)
#define BIND(...)                                                                                  \
    do {                                                                                           \
        static const char *const names_[] = {__VA_ARGS__};                                         \
        if ((st = jj_bind(r, off, name, a, names_, JJ_COUNT(names_), p)) != DUET_OK)               \
            return st;                                                                             \
    } while (0)
#define BIND0()                                                                                    \
    do {                                                                                           \
        if (a->n_pos + a->n_kw > 0)                                                                \
            return JJ_RERR(r, DUET_ERR_INVALID, off, "%.*s() takes no arguments", (int)nlen,       \
                           name);                                                                  \
    } while (0)
    if (M("startswith") || M("endswith")) {
        BIND("prefix", "start", "end");
        if (p[0] == NULL)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "%.*s() takes at least 1 argument", (int)nlen,
                           name);
        if (p[1] != NULL || p[2] != NULL)
            return JJ_RERR(r, DUET_ERR_UNSUPPORTED, off, "start/end arguments are not supported");
        bool res;
        if ((st = jj_affix(r, off, s, p[0], M("endswith"), &res)) != DUET_OK)
            return st;
        return jj_ret(r, off, jj_bool(r->arena, res), out);
    }
    if (M("strip") || M("lstrip") || M("rstrip")) {
        BIND("chars");
        if (p[0] != NULL && p[0]->kind == JV_NONE)
            p[0] = NULL;
        if (p[0] != NULL && (st = jj_need_str(r, off, "strip", p[0])) != DUET_OK)
            return st;
        return jj_strip(r, off, s, p[0], !M("rstrip"), !M("lstrip"), out);
    }
    if (M("split") || M("rsplit")) {
        BIND("sep", "maxsplit");
        if (p[0] != NULL && p[0]->kind == JV_NONE)
            p[0] = NULL;
        if (p[0] != NULL && (st = jj_need_str(r, off, "split", p[0])) != DUET_OK)
            return st;
        if (p[1] != NULL && !jj_is_int(p[1]))
            return JJ_RERR(r, DUET_ERR_INVALID, off, "maxsplit must be an integer");
        return jj_split(r, off, s, p[0], p[1] != NULL ? jj_ival(p[1]) : -1, M("rsplit"), out);
    }
    if (M("replace")) {
        BIND("old", "new", "count");
        if (p[0] == NULL || p[1] == NULL)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "replace() takes at least 2 arguments");
        if ((st = jj_need_str(r, off, "replace", p[0])) != DUET_OK ||
            (st = jj_need_str(r, off, "replace", p[1])) != DUET_OK)
            return st;
        if (p[2] != NULL && !jj_is_int(p[2]))
            return JJ_RERR(r, DUET_ERR_INVALID, off, "count must be an integer");
        return jj_replace(r, off, s, p[0], p[1], p[2] != NULL ? jj_ival(p[2]) : -1, out);
    }
    if (M("upper") || M("lower") || M("title") || M("capitalize") || M("swapcase") ||
        M("casefold")) {
        BIND0();
        jcase_t how = M("upper")        ? JCASE_UPPER
                      : M("title")      ? JCASE_TITLE_PY
                      : M("capitalize") ? JCASE_CAPITALIZE
                      : M("swapcase")   ? JCASE_SWAP
                                        : JCASE_LOWER;
        return jj_case(r, off, s, how, out);
    }
    if (M("find") || M("rfind") || M("index") || M("rindex") || M("count")) {
        BIND("sub", "start", "end");
        if (p[0] == NULL)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "%.*s() takes at least 1 argument", (int)nlen,
                           name);
        if ((st = jj_need_str(r, off, name, p[0])) != DUET_OK)
            return st;
        if (p[1] != NULL || p[2] != NULL)
            return JJ_RERR(r, DUET_ERR_UNSUPPORTED, off, "start/end arguments are not supported");
        if (M("count")) {
            int64_t c = 0;
            if (p[0]->len == 0) {
                c = (int64_t)jj_utf8_count(s->s, s->len) + 1;
            } else {
                for (size_t i = 0; (i = jj_find(s, i, p[0])) != SIZE_MAX; i += p[0]->len)
                    c++;
            }
            return jj_ret(r, off, jj_int(r->arena, c), out);
        }
        size_t at = M("find") || M("index") ? jj_find(s, 0, p[0]) : jj_rfind(s, p[0]);
        if (at == SIZE_MAX && (M("index") || M("rindex")))
            return JJ_RERR(r, DUET_ERR_INVALID, off, "substring not found");
        return jj_ret(
            r, off, jj_int(r->arena, at == SIZE_MAX ? -1 : (int64_t)jj_utf8_count(s->s, at)), out);
    }
    if (M("join")) {
        BIND("iterable");
        duet_jinja_value_t *items = NULL;
        if (p[0] == NULL)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "join() takes exactly one argument");
        if ((st = jj_iterate(r, off, p[0], &items)) != DUET_OK)
            return st;
        for (size_t i = 0; i < items->n; i++)
            if (items->items[i]->kind != JV_STR)
                return JJ_RERR(r, DUET_ERR_INVALID, off,
                               "sequence item %zu: expected str instance, %s found", i,
                               jj_type_name(items->items[i]));
        return jj_join(r, off, items, s, out);
    }
    if (M("format"))
        return jj_format(r, off, s, a, out);
    if (M("isdigit") || M("isalpha") || M("isalnum") || M("isspace") || M("islower") ||
        M("isupper") || M("isnumeric") || M("isdecimal") || M("istitle")) {
        BIND0();
        bool res = s->len > 0, any_cased = false, prev_cased = false;
        for (size_t i = 0; i < s->len && res;) {
            uint32_t c = jj_utf8_next(s->s, s->len, &i);
            bool digit = (c >= '0' && c <= '9') || (c >= 0xff10 && c <= 0xff19);
            bool upper = jj_cp_lower(c) != c, lower = jj_cp_upper(c) != c;
            bool alpha = upper || lower || (c >= 0x4e00 && c <= 0x9fff) ||
                         (c >= 0x3040 && c <= 0x30ff) || (c >= 0xac00 && c <= 0xd7a3) ||
                         (c >= 0x5d0 && c <= 0x5ea) || (c >= 0x620 && c <= 0x64a);
            if (M("isdigit") || M("isnumeric") || M("isdecimal"))
                res = digit;
            else if (M("isalpha"))
                res = alpha;
            else if (M("isalnum"))
                res = alpha || digit;
            else if (M("isspace"))
                res = duet_unicode_isspace(c);
            else if (M("islower"))
                res = !upper, any_cased |= lower;
            else if (M("isupper"))
                res = !lower, any_cased |= upper;
            else { /* istitle */
                if (upper)
                    res = !prev_cased, any_cased = true;
                else if (lower)
                    res = prev_cased;
                prev_cased = upper || lower;
            }
        }
        if (M("islower") || M("isupper") || M("istitle"))
            res = res && any_cased;
        return jj_ret(r, off, jj_bool(r->arena, res), out);
    }
    if (M("center") || M("ljust") || M("rjust") || M("zfill")) {
        if (M("zfill"))
            BIND("width");
        else
            BIND("width", "fillchar");
        if (!jj_is_int(p[0]))
            return JJ_RERR(r, DUET_ERR_INVALID, off, "%.*s() needs an integer width", (int)nlen,
                           name);
        duet_jinja_value_t *fill = M("zfill") ? jj_str(r->arena, "0", 1, DUET_JINJA_ORIGIN_TEMPLATE)
                                   : p[1] != NULL
                                       ? p[1]
                                       : jj_str(r->arena, " ", 1, DUET_JINJA_ORIGIN_TEMPLATE);
        if (fill == NULL)
            return jj_nomem(r, off);
        if (fill->kind != JV_STR || jj_utf8_count(fill->s, fill->len) != 1)
            return JJ_RERR(r, DUET_ERR_INVALID, off,
                           "The fill character must be exactly one character long");
        if (M("zfill") && s->len > 0 && (s->s[0] == '-' || s->s[0] == '+')) {
            duet_jinja_value_t rest = *s;
            rest.s++;
            rest.len--;
            rest.mask = s->mask != NULL ? s->mask + 1 : NULL;
            duet_jinja_value_t *padded = NULL;
            if ((st = jj_pad(r, off, &rest, jj_ival(p[0]) - 1, fill, 2, &padded)) != DUET_OK)
                return st;
            jj_sb_t sb;
            jj_sb_init(&sb, r->arena, r->lim.max_output);
            jj_sb_put_range(&sb, s, 0, 1);
            jj_sb_put_str(&sb, padded);
            return jj_finish(r, off, &sb, out);
        }
        return jj_pad(r, off, s, jj_ival(p[0]), fill, M("center") ? 0 : M("ljust") ? 1 : 2, out);
    }
    if (M("splitlines")) {
        BIND("keepends");
        bool keep = p[0] != NULL && jj_truthy(p[0]);
        duet_jinja_value_t *l = jj_list_new(r, false);
        if (l == NULL)
            return jj_nomem(r, off);
        size_t b = 0;
        for (size_t i = 0; i < s->len;) {
            size_t at = i;
            uint32_t c = jj_utf8_next(s->s, s->len, &i);
            bool brk = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d ||
                       c == 0x1e || c == 0x85 || c == 0x2028 || c == 0x2029;
            if (!brk)
                continue;
            if (c == '\r' && i < s->len && s->s[i] == '\n')
                i++;
            duet_jinja_value_t *line = jj_substr(r, s, b, (keep ? i : at) - b);
            if (line == NULL || jj_push(r->arena, l, line) != DUET_OK)
                return jj_nomem(r, off);
            b = i;
        }
        if (b < s->len) {
            duet_jinja_value_t *line = jj_substr(r, s, b, s->len - b);
            if (line == NULL || jj_push(r->arena, l, line) != DUET_OK)
                return jj_nomem(r, off);
        }
        *out = l;
        return DUET_OK;
    }
    if (M("partition") || M("rpartition")) {
        BIND("sep");
        if (p[0] == NULL || (st = jj_need_str(r, off, name, p[0])) != DUET_OK)
            return p[0] == NULL
                       ? JJ_RERR(r, DUET_ERR_INVALID, off, "partition() takes one argument")
                       : st;
        if (p[0]->len == 0)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "empty separator");
        size_t at = M("partition") ? jj_find(s, 0, p[0]) : jj_rfind(s, p[0]);
        duet_jinja_value_t *t = jj_new(r->arena, JV_LIST), *empty = jj_str(r->arena, "", 0, 0);
        if (t == NULL || empty == NULL)
            return jj_nomem(r, off);
        t->tuple = true;
        duet_jinja_value_t *parts[3];
        if (at == SIZE_MAX) {
            bool left = M("partition");
            parts[0] = left ? s : empty;
            parts[1] = empty;
            parts[2] = left ? empty : s;
        } else {
            parts[0] = jj_substr(r, s, 0, at);
            parts[1] = jj_substr(r, s, at, p[0]->len);
            parts[2] = jj_substr(r, s, at + p[0]->len, s->len - at - p[0]->len);
        }
        for (int k = 0; k < 3; k++)
            if (parts[k] == NULL || jj_push(r->arena, t, parts[k]) != DUET_OK)
                return jj_nomem(r, off);
        *out = t;
        return DUET_OK;
    }
    if (M("removeprefix") || M("removesuffix")) {
        BIND("affix");
        if (p[0] == NULL || (st = jj_need_str(r, off, name, p[0])) != DUET_OK)
            return p[0] == NULL ? JJ_RERR(r, DUET_ERR_INVALID, off, "takes exactly one argument")
                                : st;
        bool res;
        bool suffix = M("removesuffix");
        if ((st = jj_affix(r, off, s, p[0], suffix, &res)) != DUET_OK)
            return st;
        if (!res || p[0]->len == 0) {
            *out = s;
            return DUET_OK;
        }
        return jj_ret(r, off, jj_substr(r, s, suffix ? 0 : p[0]->len, s->len - p[0]->len), out);
    }
    return JJ_RERR(r, DUET_ERR_INVALID, off, "'str' object has no method '%.*s'", (int)nlen, name);
}

/* markupsafe's Markup methods: what they give back is Markup (each string of split() and
 * partition() too), and the strings they take in are escaped first: replace's new, the fill
 * character, join's items, format's arguments. */
static duet_status_t jj_str_method(jj_render_t *r, size_t off, duet_jinja_value_t *s,
                                   const char *name, size_t nlen, const jj_args_t *a,
                                   duet_jinja_value_t **out)
{
    if (!s->markup)
        return jj_str_method_plain(r, off, s, name, nlen, a, out);
    jj_args_t e = *a;
    duet_status_t st = DUET_OK;
    bool all = jj_streq(name, nlen, "format");
    size_t only = jj_streq(name, nlen, "replace") || jj_streq(name, nlen, "center") ||
                          jj_streq(name, nlen, "ljust") || jj_streq(name, nlen, "rjust")
                      ? 1
                      : SIZE_MAX;
    if (all || only != SIZE_MAX) {
        e.pos = jj_alloc(r->arena, (a->n_pos + 1) * sizeof(*e.pos));
        e.kw = jj_alloc(r->arena, (a->n_kw + 1) * sizeof(*e.kw));
        if (e.pos == NULL || e.kw == NULL)
            return jj_nomem(r, off);
        for (size_t i = 0; i < a->n_pos && st == DUET_OK; i++)
            e.pos[i] = a->pos[i];
        for (size_t i = 0; i < a->n_pos && st == DUET_OK; i++)
            if (all || i == only)
                st = jj_escape(r, off, a->pos[i], &e.pos[i]);
        for (size_t i = 0; i < a->n_kw && st == DUET_OK; i++)
            e.kw[i] = a->kw[i];
        for (size_t i = 0; i < a->n_kw && st == DUET_OK; i++)
            if (all)
                st = jj_escape(r, off, a->kw[i], &e.kw[i]);
    } else if (jj_streq(name, nlen, "join") && a->n_pos == 1 && a->n_kw == 0) {
        duet_jinja_value_t *items = NULL, *l = jj_list_new(r, false);
        if (l == NULL)
            return jj_nomem(r, off);
        if ((st = jj_iterate(r, off, a->pos[0], &items)) != DUET_OK)
            return st;
        for (size_t i = 0; i < items->n && st == DUET_OK; i++) {
            duet_jinja_value_t *v = NULL;
            if ((st = jj_escape(r, off, items->items[i], &v)) == DUET_OK &&
                jj_push(r->arena, l, v) != DUET_OK)
                return jj_nomem(r, off);
        }
        e.pos = jj_alloc(r->arena, sizeof(*e.pos));
        if (e.pos == NULL)
            return jj_nomem(r, off);
        e.pos[0] = l;
    }
    if (st == DUET_OK)
        st = jj_str_method_plain(r, off, s, name, nlen, &e, out);
    return jj_keep_markup(r, off, s, st, out);
}

static duet_status_t jj_dict_method(jj_render_t *r, size_t off, duet_jinja_value_t *d,
                                    const char *name, size_t nlen, const jj_args_t *a,
                                    duet_jinja_value_t **out)
{
    duet_jinja_value_t *p[2];
    duet_status_t st;
    if (M("get")) {
        BIND("key", "default");
        if (p[0] == NULL)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "get expected at least 1 argument, got 0");
        if ((p[0]->kind == JV_LIST && !p[0]->tuple) || p[0]->kind == JV_DICT)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "unhashable type: '%s'", jj_type_name(p[0]));
        for (size_t i = 0; i < d->n; i++)
            if (jj_equal(d->keys[i], p[0], 0)) {
                *out = d->items[i];
                return DUET_OK;
            }
        if (p[1] != NULL) {
            *out = p[1];
            return DUET_OK;
        }
        return jj_ret(r, off, jj_new(r->arena, JV_NONE), out);
    }
    BIND0();
    if (M("copy")) {
        duet_jinja_value_t *c = jj_new(r->arena, JV_DICT);
        if (c == NULL)
            return jj_nomem(r, off);
        for (size_t i = 0; i < d->n; i++)
            if (jj_push(r->arena, c, d->items[i]) != DUET_OK)
                return jj_nomem(r, off);
            else
                c->keys[i] = d->keys[i];
        *out = c;
        return DUET_OK;
    }
    duet_jinja_value_t *l = jj_list_new(r, false);
    if (l == NULL)
        return jj_nomem(r, off);
    for (size_t i = 0; i < d->n; i++) {
        duet_jinja_value_t *x = M("keys")     ? d->keys[i]
                                : M("values") ? d->items[i]
                                              : jj_tuple2(r, d->keys[i], d->items[i]);
        if (x == NULL || jj_push(r->arena, l, x) != DUET_OK)
            return jj_nomem(r, off);
    }
    *out = l;
    return DUET_OK;
}

/* ---------------------------------------------------------------- globals */

static const char *const jj_globals[JF_COUNT] = {"range",           "namespace",    "dict",
                                                 "raise_exception", "strftime_now", NULL};

int jj_global_find(const char *name, size_t len)
{
    for (int i = 0; i < JF_COUNT; i++)
        if (jj_globals[i] != NULL && jj_streq(name, len, jj_globals[i]))
            return i;
    return -1;
}

/* Fill a DICT / NS from dict()-style arguments: one mapping (or pairs) and keywords. */
static duet_status_t jj_dict_from_args(jj_render_t *r, size_t off, const char *fn,
                                       const jj_args_t *a, duet_jinja_value_t *d)
{
    if (a->n_pos > 1)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "%s expected at most 1 argument, got %zu", fn,
                       a->n_pos);
    if (a->n_pos == 1) {
        duet_jinja_value_t *src = a->pos[0];
        if (src->kind == JV_DICT || src->kind == JV_NS) {
            for (size_t i = 0; i < src->n; i++)
                if (jj_dict_set(r->arena, d, src->keys[i], src->items[i]) != DUET_OK)
                    return jj_nomem(r, off);
        } else {
            duet_jinja_value_t *items = NULL;
            duet_status_t st = jj_iterate(r, off, src, &items);
            if (st != DUET_OK)
                return st;
            for (size_t i = 0; i < items->n; i++) {
                duet_jinja_value_t *pair = items->items[i];
                if (pair->kind != JV_LIST || pair->gen || pair->n != 2)
                    return JJ_RERR(r, DUET_ERR_INVALID, off,
                                   "dictionary update sequence element #%zu has the wrong length",
                                   i);
                if (jj_dict_set(r->arena, d, pair->items[0], pair->items[1]) != DUET_OK)
                    return jj_nomem(r, off);
            }
        }
    }
    for (size_t k = 0; k < a->n_kw; k++) {
        duet_jinja_value_t *key =
            jj_str(r->arena, a->kwnames[k], a->kwlens[k], DUET_JINJA_ORIGIN_TEMPLATE);
        if (key == NULL || jj_dict_set(r->arena, d, key, a->kw[k]) != DUET_OK)
            return jj_nomem(r, off);
    }
    return DUET_OK;
}

static duet_status_t jj_strftime(jj_render_t *r, size_t off, const duet_jinja_value_t *fmt,
                                 duet_jinja_value_t **out)
{
    struct tm tm;
    if (r->vars->has_now) {
        tm = r->vars->now;
    } else {
        time_t now = time(NULL);
        localtime_r(&now, &tm);
    }
    char cfmt[256];
    if (fmt->len >= sizeof(cfmt) || memchr(fmt->s, '\0', fmt->len) != NULL)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "strftime format too long");
    memcpy(cfmt, fmt->s, fmt->len);
    cfmt[fmt->len] = '\0';
    char buf[1024];
    size_t n = fmt->len == 0 ? 0 : strftime(buf, sizeof(buf), cfmt, &tm);
    if (n == 0 && fmt->len > 0)
        buf[0] = '\0';
    return jj_ret(r, off, jj_str(r->arena, buf, n, DUET_JINJA_ORIGIN_TEMPLATE), out);
}

duet_status_t jj_call_builtin(jj_render_t *r, size_t off, duet_jinja_value_t *f, const jj_args_t *a,
                              duet_jinja_value_t **out)
{
    duet_status_t st;
    if (f->kind == JV_METHOD) {
        duet_jinja_value_t *self = f->self;
        const char *name = f->s;
        size_t nlen = f->len;
        if (self->kind == JV_STR)
            return jj_str_method(r, off, self, name, nlen, a, out);
        if (self->kind == JV_DICT)
            return jj_dict_method(r, off, self, name, nlen, a, out);
        if (self->kind == JV_LOOP) { /* loop.cycle(a, b, ...) */
            if (a->n_pos == 0)
                return JJ_RERR(r, DUET_ERR_INVALID, off, "no items for cycling given");
            *out = a->pos[(size_t)self->i % a->n_pos];
            return DUET_OK;
        }
        /* list.index / count / copy */
        duet_jinja_value_t *p[1];
        if (M("copy")) {
            BIND0();
            duet_jinja_value_t *c = jj_list_new(r, false);
            for (size_t i = 0; c != NULL && i < self->n; i++)
                if (jj_push(r->arena, c, self->items[i]) != DUET_OK)
                    c = NULL;
            return jj_ret(r, off, c, out);
        }
        BIND("value");
        if (p[0] == NULL)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "%.*s() takes exactly one argument", (int)nlen,
                           name);
        int64_t c = 0, at = -1;
        for (size_t i = 0; i < self->n; i++)
            if (jj_equal(self->items[i], p[0], 0)) {
                c++;
                if (at < 0)
                    at = (int64_t)i;
            }
        if (M("index") && at < 0)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "value is not in list");
        return jj_ret(r, off, jj_int(r->arena, M("index") ? at : c), out);
    }
    switch ((int)f->i) {
    case JF_RANGE: {
        if (a->n_kw > 0 || a->n_pos == 0 || a->n_pos > 3)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "range expected 1 to 3 integer arguments");
        for (size_t i = 0; i < a->n_pos; i++)
            if (!jj_is_int(a->pos[i]))
                return JJ_RERR(r, DUET_ERR_INVALID, off,
                               "'%s' object cannot be interpreted as an integer",
                               jj_type_name(a->pos[i]));
        int64_t start = a->n_pos > 1 ? jj_ival(a->pos[0]) : 0;
        int64_t stop = a->n_pos > 1 ? jj_ival(a->pos[1]) : jj_ival(a->pos[0]);
        int64_t step = a->n_pos > 2 ? jj_ival(a->pos[2]) : 1;
        if (step == 0)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "range() arg 3 must not be zero");
        double count = step > 0 ? ceil(((double)stop - (double)start) / (double)step)
                                : ceil(((double)start - (double)stop) / (double)-step);
        if (count > 100000) /* the sandbox's MAX_RANGE */
            return JJ_RERR(r, DUET_ERR_RANGE, off,
                           "Range too big. The sandbox blocks ranges larger than MAX_RANGE "
                           "(100000).");
        duet_jinja_value_t *l = jj_list_new(r, false);
        for (int64_t x = start; l != NULL && (step > 0 ? x < stop : x > stop); x += step)
            if (jj_push(r->arena, l, jj_int(r->arena, x)) != DUET_OK)
                l = NULL;
        return jj_ret(r, off, l, out);
    }
    case JF_NAMESPACE:
    case JF_DICT: {
        duet_jinja_value_t *d = jj_new(r->arena, f->i == JF_DICT ? JV_DICT : JV_NS);
        if (d == NULL)
            return jj_nomem(r, off);
        if ((st = jj_dict_from_args(r, off, f->i == JF_DICT ? "dict" : "namespace", a, d)) !=
            DUET_OK)
            return st;
        *out = d;
        return DUET_OK;
    }
    case JF_RAISE: {
        if (a->n_pos != 1 || a->n_kw != 0)
            return JJ_RERR(r, DUET_ERR_INVALID, off,
                           "raise_exception() takes exactly one argument");
        duet_jinja_value_t *msg = NULL;
        if ((st = jj_stringify(r, off, a->pos[0], &msg)) != DUET_OK)
            return st;
        /* The template's own words, exactly: transformers raises TemplateError(message). */
        return duet_error_set(DUET_ERR_FORMAT, "%.*s", (int)(msg->len > 4000 ? 4000 : msg->len),
                              msg->s);
    }
    case JF_STRFTIME: {
        duet_jinja_value_t *p[1];
        static const char *const names[] = {"format"};
        if ((st = jj_bind(r, off, "strftime_now", a, names, 1, p)) != DUET_OK)
            return st;
        if (p[0] == NULL || (st = jj_need_str(r, off, "strftime_now", p[0])) != DUET_OK)
            return p[0] == NULL ? JJ_RERR(r, DUET_ERR_INVALID, off, "strftime_now() needs a format")
                                : st;
        return jj_strftime(r, off, p[0], out);
    }
    default:
        return JJ_RERR(r, DUET_ERR_INTERNAL, off, "bad function");
    }
}
#undef M
#undef BIND
#undef BIND0

/* ---------------------------------------------------------------- sorting */

typedef struct {
    jj_render_t *r;
    size_t off;
    duet_status_t st;
    bool reverse;
} jj_sort_ctx_t;

/* Stable merge sort of (key, item) pairs by key with Python's ordering. */
static void jj_msort(jj_sort_ctx_t *c, duet_jinja_value_t **keys, duet_jinja_value_t **items,
                     duet_jinja_value_t **tk, duet_jinja_value_t **ti, size_t n)
{
    if (n < 2 || c->st != DUET_OK)
        return;
    size_t h = n / 2;
    jj_msort(c, keys, items, tk, ti, h);
    jj_msort(c, keys + h, items + h, tk, ti, n - h);
    size_t i = 0, j = h, o = 0;
    if (c->st == DUET_OK)
        c->st = jj_work(c->r, c->off, n);
    while (i < h && j < n && c->st == DUET_OK) {
        int cmp = 0;
        c->st = jj_compare(c->r, c->off, keys[j], keys[i], &cmp);
        bool take_right = c->reverse ? cmp > 0 : cmp < 0;
        if (take_right) {
            tk[o] = keys[j];
            ti[o++] = items[j++];
        } else {
            tk[o] = keys[i];
            ti[o++] = items[i++];
        }
    }
    while (i < h) {
        tk[o] = keys[i];
        ti[o++] = items[i++];
    }
    while (j < n) {
        tk[o] = keys[j];
        ti[o++] = items[j++];
    }
    memcpy(keys, tk, n * sizeof(*keys));
    memcpy(items, ti, n * sizeof(*items));
}

/* The key a filter compares by: an attribute path (a.b.0), lower-cased unless case_sensitive. */
static duet_status_t jj_attr_path(jj_render_t *r, size_t off, duet_jinja_value_t *item,
                                  const duet_jinja_value_t *attr, duet_jinja_value_t **out)
{
    if (attr == NULL || attr->kind == JV_NONE) {
        *out = item;
        return DUET_OK;
    }
    if (jj_is_int(attr))
        return jj_getitem(r, off, item, (duet_jinja_value_t *)attr, out);
    if (attr->kind != JV_STR)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "attribute must be a string or an integer");
    duet_jinja_value_t *v = item;
    for (size_t b = 0; b <= attr->len;) {
        size_t e = b;
        while (e < attr->len && attr->s[e] != '.')
            e++;
        if (v->kind == JV_UNDEF)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "an undefined value has no item '%.*s'",
                           (int)(e - b), attr->s + b);
        bool digits = e > b;
        for (size_t k = b; k < e; k++)
            digits = digits && attr->s[k] >= '0' && attr->s[k] <= '9';
        duet_jinja_value_t *key =
            digits ? jj_int(r->arena, strtoll(attr->s + b, NULL, 10))
                   : jj_str(r->arena, attr->s + b, e - b, DUET_JINJA_ORIGIN_TEMPLATE);
        if (key == NULL)
            return jj_nomem(r, off);
        duet_status_t st = jj_getitem(r, off, v, key, &v);
        if (st != DUET_OK)
            return st;
        b = e + 1;
    }
    *out = v;
    return DUET_OK;
}

static duet_status_t jj_sort_key(jj_render_t *r, size_t off, duet_jinja_value_t *item,
                                 const duet_jinja_value_t *attr, bool case_sensitive,
                                 duet_jinja_value_t **out)
{
    duet_status_t st = jj_attr_path(r, off, item, attr, out);
    if (st == DUET_OK && !case_sensitive && (*out)->kind == JV_STR)
        st = jj_case(r, off, *out, JCASE_LOWER, out);
    return st;
}

static duet_status_t jj_sorted(jj_render_t *r, size_t off, duet_jinja_value_t *items,
                               duet_jinja_value_t **keys, bool reverse, duet_jinja_value_t **out)
{
    size_t n = items->n;
    duet_jinja_value_t **ti = jj_alloc(r->arena, (n + 1) * sizeof(*ti));
    duet_jinja_value_t **tk = jj_alloc(r->arena, (n + 1) * sizeof(*tk));
    duet_jinja_value_t *l = jj_list_new(r, false);
    if (ti == NULL || tk == NULL || l == NULL)
        return jj_nomem(r, off);
    for (size_t i = 0; i < n; i++)
        if (jj_push(r->arena, l, items->items[i]) != DUET_OK)
            return jj_nomem(r, off);
    jj_sort_ctx_t c = {.r = r, .off = off, .reverse = reverse};
    if (n > 0)
        jj_msort(&c, keys, l->items, tk, ti, n);
    if (c.st != DUET_OK)
        return c.st;
    *out = l;
    return DUET_OK;
}

/* ---------------------------------------------------------------- filters */

#define FILTER(name)                                                                               \
    static duet_status_t name(jj_render_t *r, size_t off, duet_jinja_value_t *x,                   \
                              const jj_args_t *a, duet_jinja_value_t **out)
#define ARGS(fn, ...)                                                                              \
    duet_jinja_value_t *p[8];                                                                      \
    duet_status_t st;                                                                              \
    do {                                                                                           \
        static const char *const names_[] = {__VA_ARGS__};                                         \
        if ((st = jj_bind(r, off, fn, a, names_, JJ_COUNT(names_), p)) != DUET_OK)                 \
            return st;                                                                             \
    } while (0)
#define NOARGS(fn)                                                                                 \
    do {                                                                                           \
        if (a->n_pos + a->n_kw > 0)                                                                \
            return JJ_RERR(r, DUET_ERR_INVALID, off, "filter '%s' takes no arguments", fn);        \
    } while (0)

static duet_status_t jj_soft_str(jj_render_t *r, size_t off, duet_jinja_value_t *x,
                                 duet_jinja_value_t **s)
{
    return jj_stringify(r, off, x, s);
}

FILTER(f_tojson)
{
    ARGS("tojson", "ensure_ascii", "indent", "separators", "sort_keys");
    jj_json_opts_t o = {.ensure_ascii = p[0] != NULL && jj_truthy(p[0]),
                        .sort_keys = p[3] != NULL && jj_truthy(p[3])};
    char spaces[64];
    if (p[1] != NULL && p[1]->kind != JV_NONE) {
        if (jj_is_int(p[1])) {
            int64_t n = jj_ival(p[1]);
            if (n > (int64_t)sizeof(spaces))
                return JJ_RERR(r, DUET_ERR_UNSUPPORTED, off, "indent too large");
            n = n < 0 ? 0 : n;
            memset(spaces, ' ', (size_t)n);
            o.indent = spaces;
            o.indent_len = (size_t)n;
        } else if (p[1]->kind == JV_STR) {
            o.indent = p[1]->s;
            o.indent_len = p[1]->len;
        } else {
            return JJ_RERR(r, DUET_ERR_INVALID, off, "indent must be an int or a string");
        }
    }
    o.item_sep = o.indent != NULL ? "," : ", ";
    o.key_sep = ": ";
    if (p[2] != NULL && p[2]->kind != JV_NONE) {
        if (p[2]->kind != JV_LIST || p[2]->gen || p[2]->n != 2 || p[2]->items[0]->kind != JV_STR ||
            p[2]->items[1]->kind != JV_STR)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "separators must be a pair of strings");
        o.item_sep = p[2]->items[0]->s;
        o.key_sep = p[2]->items[1]->s;
        o.item_sep_len = p[2]->items[0]->len;
        o.key_sep_len = p[2]->items[1]->len;
    } else {
        o.item_sep_len = strlen(o.item_sep);
        o.key_sep_len = strlen(o.key_sep);
    }
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    if ((st = jj_json(r, off, x, &sb, &o, 0)) != DUET_OK)
        return st;
    return jj_finish(r, off, &sb, out);
}

FILTER(f_string)
{
    NOARGS("string");
    return jj_soft_str(r, off, x, out);
}

FILTER(f_safe)
{
    NOARGS("safe");
    duet_jinja_value_t *s = NULL; /* Markup(x): str(x), marked safe */
    duet_status_t st = jj_stringify(r, off, x, &s);
    return st != DUET_OK ? st : jj_mark(r, off, s, out);
}

FILTER(f_escape)
{
    NOARGS("escape");
    return jj_escape(r, off, x, out);
}

FILTER(f_forceescape)
{
    NOARGS("forceescape");
    duet_jinja_value_t *s = NULL; /* escape(str(x)): a Markup's text is escaped again */
    duet_status_t st = jj_stringify(r, off, x, &s);
    if (st == DUET_OK)
        st = jj_plain(r, off, s, &s);
    return st != DUET_OK ? st : jj_escape(r, off, s, out);
}

FILTER(f_trim)
{
    ARGS("trim", "chars");
    duet_jinja_value_t *s = NULL;
    if ((st = jj_soft_str(r, off, x, &s)) != DUET_OK)
        return st;
    if (p[0] != NULL && p[0]->kind == JV_NONE)
        p[0] = NULL;
    if (p[0] != NULL && (st = jj_need_str(r, off, "trim", p[0])) != DUET_OK)
        return st;
    return jj_keep_markup(r, off, s, jj_strip(r, off, s, p[0], true, true, out), out);
}

static duet_status_t jj_case_filter(jj_render_t *r, size_t off, duet_jinja_value_t *x,
                                    const jj_args_t *a, jcase_t how, const char *fn,
                                    duet_jinja_value_t **out)
{
    NOARGS(fn);
    duet_jinja_value_t *s = NULL;
    duet_status_t st = jj_soft_str(r, off, x, &s);
    if (st != DUET_OK)
        return st;
    st = jj_case(r, off, s, how, out);
    if (how == JCASE_TITLE_JINJA) /* jinja2's title joins its words into a new (plain) str */
        return st;
    return jj_keep_markup(r, off, s, st, out);
}

FILTER(f_upper)
{
    return jj_case_filter(r, off, x, a, JCASE_UPPER, "upper", out);
}

FILTER(f_lower)
{
    return jj_case_filter(r, off, x, a, JCASE_LOWER, "lower", out);
}

FILTER(f_capitalize)
{
    return jj_case_filter(r, off, x, a, JCASE_CAPITALIZE, "capitalize", out);
}

FILTER(f_title)
{
    return jj_case_filter(r, off, x, a, JCASE_TITLE_JINJA, "title", out);
}

FILTER(f_length)
{
    NOARGS("length");
    int64_t n = 0;
    duet_status_t st = jj_len(r, off, x, &n);
    return st != DUET_OK ? st : jj_ret(r, off, jj_int(r->arena, n), out);
}

FILTER(f_default)
{
    ARGS("default", "default_value", "boolean");
    bool use = x->kind == JV_UNDEF || (p[1] != NULL && jj_truthy(p[1]) && !jj_truthy(x));
    if (!use) {
        *out = x;
        return DUET_OK;
    }
    if (p[0] != NULL) {
        *out = p[0];
        return DUET_OK;
    }
    return jj_ret(r, off, jj_str(r->arena, "", 0, DUET_JINJA_ORIGIN_TEMPLATE), out);
}

FILTER(f_join)
{
    ARGS("join", "d", "attribute");
    duet_jinja_value_t *items = NULL, *sep = p[0];
    if ((st = jj_iterate(r, off, x, &items)) != DUET_OK)
        return st;
    if (sep != NULL && (st = jj_soft_str(r, off, sep, &sep)) != DUET_OK)
        return st;
    if (p[1] != NULL) {
        duet_jinja_value_t *mapped = jj_list_new(r, false);
        if (mapped == NULL)
            return jj_nomem(r, off);
        for (size_t i = 0; i < items->n; i++) {
            duet_jinja_value_t *v = NULL;
            if ((st = jj_attr_path(r, off, items->items[i], p[1], &v)) != DUET_OK)
                return st;
            if (jj_push(r->arena, mapped, v) != DUET_OK)
                return jj_nomem(r, off);
        }
        items = mapped;
    }
    return jj_join(r, off, items, sep, out);
}

FILTER(f_list)
{
    NOARGS("list");
    duet_jinja_value_t *items = NULL;
    duet_status_t st = jj_iterate(r, off, x, &items);
    if (st != DUET_OK)
        return st;
    duet_jinja_value_t *l = jj_list_new(r, false);
    for (size_t i = 0; l != NULL && i < items->n; i++)
        if (jj_push(r->arena, l, items->items[i]) != DUET_OK)
            l = NULL;
    return jj_ret(r, off, l, out);
}

FILTER(f_first)
{
    NOARGS("first");
    duet_jinja_value_t *items = NULL;
    duet_status_t st = jj_iterate(r, off, x, &items);
    if (st != DUET_OK)
        return st;
    *out = items->n > 0 ? items->items[0] : &jj_undef_value;
    return DUET_OK;
}

FILTER(f_last)
{
    NOARGS("last");
    if (x->kind == JV_LIST && x->gen)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "'generator' object is not reversible");
    duet_jinja_value_t *items = NULL;
    duet_status_t st = jj_iterate(r, off, x, &items);
    if (st != DUET_OK)
        return st;
    *out = items->n > 0 ? items->items[items->n - 1] : &jj_undef_value;
    /* reversed() walks a str with __getitem__, which a Markup wraps: its last character is
     * Markup (while first, through iter(), is a plain str) */
    return items->n > 0 ? jj_keep_markup(r, off, x, DUET_OK, out) : DUET_OK;
}

FILTER(f_reverse)
{
    NOARGS("reverse");
    duet_status_t st;
    if (x->kind == JV_STR) {
        jj_sb_t sb;
        jj_sb_init(&sb, r->arena, r->lim.max_output);
        for (size_t e = x->len; e > 0;) {
            size_t b = e - 1;
            while (b > 0 && ((unsigned char)x->s[b] & 0xc0) == 0x80)
                b--;
            jj_sb_put_range(&sb, x, b, e - b);
            e = b;
        }
        return jj_keep_markup(r, off, x, jj_finish(r, off, &sb, out), out); /* value[::-1] */
    }
    duet_jinja_value_t *items = NULL;
    if ((st = jj_iterate(r, off, x, &items)) != DUET_OK)
        return st;
    /* reversed() of a list or dict is an iterator; of a generator, a reversed list. */
    duet_jinja_value_t *l = jj_list_new(r, !(x->kind == JV_LIST && x->gen));
    for (size_t i = items->n; l != NULL && i-- > 0;)
        if (jj_push(r->arena, l, items->items[i]) != DUET_OK)
            l = NULL;
    return jj_ret(r, off, l, out);
}

FILTER(f_items)
{
    NOARGS("items");
    duet_jinja_value_t *l = jj_list_new(r, true);
    if (l == NULL)
        return jj_nomem(r, off);
    if (x->kind == JV_UNDEF) {
        *out = l;
        return DUET_OK;
    }
    if (x->kind != JV_DICT && x->kind != JV_NS)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "Can only get item pairs from a mapping.");
    for (size_t i = 0; i < x->n; i++) {
        duet_jinja_value_t *t = jj_tuple2(r, x->keys[i], x->items[i]);
        if (t == NULL || jj_push(r->arena, l, t) != DUET_OK)
            return jj_nomem(r, off);
    }
    *out = l;
    return DUET_OK;
}

FILTER(f_dictsort)
{
    ARGS("dictsort", "case_sensitive", "by", "reverse");
    if (x->kind != JV_DICT)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "dictsort needs a mapping");
    bool by_value = false;
    if (p[1] != NULL) {
        if (p[1]->kind == JV_STR && jj_streq(p[1]->s, p[1]->len, "value"))
            by_value = true;
        else if (!(p[1]->kind == JV_STR && jj_streq(p[1]->s, p[1]->len, "key")))
            return JJ_RERR(r, DUET_ERR_INVALID, off,
                           "You can only sort by either \"key\" or \"value\"");
    }
    duet_jinja_value_t *pairs = jj_list_new(r, false);
    duet_jinja_value_t **keys = jj_alloc(r->arena, (x->n + 1) * sizeof(*keys));
    if (pairs == NULL || keys == NULL)
        return jj_nomem(r, off);
    for (size_t i = 0; i < x->n; i++) {
        duet_jinja_value_t *t = jj_tuple2(r, x->keys[i], x->items[i]);
        if (t == NULL || jj_push(r->arena, pairs, t) != DUET_OK)
            return jj_nomem(r, off);
        if ((st = jj_sort_key(r, off, by_value ? x->items[i] : x->keys[i], NULL,
                              p[0] != NULL && jj_truthy(p[0]), &keys[i])) != DUET_OK)
            return st;
    }
    return jj_sorted(r, off, pairs, keys, p[2] != NULL && jj_truthy(p[2]), out);
}

FILTER(f_sort)
{
    ARGS("sort", "reverse", "case_sensitive", "attribute");
    duet_jinja_value_t *items = NULL;
    if ((st = jj_iterate(r, off, x, &items)) != DUET_OK)
        return st;
    duet_jinja_value_t **keys = jj_alloc(r->arena, (items->n + 1) * sizeof(*keys));
    if (keys == NULL)
        return jj_nomem(r, off);
    if (p[2] != NULL && p[2]->kind == JV_STR && memchr(p[2]->s, ',', p[2]->len) != NULL)
        return JJ_RERR(r, DUET_ERR_UNSUPPORTED, off,
                       "sorting by several attributes is not supported");
    for (size_t i = 0; i < items->n; i++)
        if ((st = jj_sort_key(r, off, items->items[i], p[2], p[1] != NULL && jj_truthy(p[1]),
                              &keys[i])) != DUET_OK)
            return st;
    return jj_sorted(r, off, items, keys, p[0] != NULL && jj_truthy(p[0]), out);
}

FILTER(f_unique)
{
    ARGS("unique", "case_sensitive", "attribute");
    duet_jinja_value_t *items = NULL;
    if ((st = jj_iterate(r, off, x, &items)) != DUET_OK)
        return st;
    duet_jinja_value_t *l = jj_list_new(r, true), *seen = jj_list_new(r, false);
    if (l == NULL || seen == NULL)
        return jj_nomem(r, off);
    for (size_t i = 0; i < items->n; i++) {
        duet_jinja_value_t *k = NULL;
        if ((st = jj_sort_key(r, off, items->items[i], p[1], p[0] != NULL && jj_truthy(p[0]),
                              &k)) != DUET_OK)
            return st;
        bool dup = false;
        if ((st = jj_work(r, off, seen->n)) != DUET_OK)
            return st;
        for (size_t j = 0; j < seen->n && !dup; j++)
            dup = jj_equal(seen->items[j], k, 0);
        if (!dup && (jj_push(r->arena, seen, k) != DUET_OK ||
                     jj_push(r->arena, l, items->items[i]) != DUET_OK))
            return jj_nomem(r, off);
    }
    *out = l;
    return DUET_OK;
}

static duet_status_t jj_minmax(jj_render_t *r, size_t off, duet_jinja_value_t *x,
                               const jj_args_t *a, bool want_max, duet_jinja_value_t **out)
{
    ARGS(want_max ? "max" : "min", "case_sensitive", "attribute");
    duet_jinja_value_t *items = NULL, *best = NULL, *best_key = NULL;
    if ((st = jj_iterate(r, off, x, &items)) != DUET_OK)
        return st;
    for (size_t i = 0; i < items->n; i++) {
        duet_jinja_value_t *k = NULL;
        int c = 0;
        if ((st = jj_sort_key(r, off, items->items[i], p[1], p[0] != NULL && jj_truthy(p[0]),
                              &k)) != DUET_OK)
            return st;
        if (best != NULL && (st = jj_compare(r, off, k, best_key, &c)) != DUET_OK)
            return st;
        if (best == NULL || (want_max ? c > 0 : c < 0)) {
            best = items->items[i];
            best_key = k;
        }
    }
    *out = best != NULL ? best : &jj_undef_value;
    return DUET_OK;
}

FILTER(f_min)
{
    return jj_minmax(r, off, x, a, false, out);
}

FILTER(f_max)
{
    return jj_minmax(r, off, x, a, true, out);
}

FILTER(f_sum)
{
    ARGS("sum", "attribute", "start");
    duet_jinja_value_t *items = NULL;
    if ((st = jj_iterate(r, off, x, &items)) != DUET_OK)
        return st;
    bool is_float = false;
    int64_t acc = 0;
    double facc = 0;
    duet_jinja_value_t *start = p[1];
    if (start != NULL && !jj_is_number(start))
        return JJ_RERR(r, DUET_ERR_INVALID, off, "sum() start must be a number");
    if (start != NULL) {
        is_float = start->kind == JV_FLOAT;
        acc = is_float ? 0 : jj_ival(start);
        facc = jj_num(start);
    }
    for (size_t i = 0; i < items->n; i++) {
        duet_jinja_value_t *v = NULL;
        if ((st = jj_attr_path(r, off, items->items[i], p[0], &v)) != DUET_OK)
            return st;
        if (!jj_is_number(v))
            return JJ_RERR(r, DUET_ERR_INVALID, off,
                           "unsupported operand type(s) for +: '%s' and '%s'",
                           is_float ? "float" : "int", jj_type_name(v));
        if (v->kind == JV_FLOAT && !is_float) {
            is_float = true;
            facc = (double)acc;
        }
        if (is_float)
            facc += jj_num(v);
        else if (__builtin_add_overflow(acc, jj_ival(v), &acc))
            return JJ_RERR(r, DUET_ERR_RANGE, off, "integer overflow (beyond 64 bits)");
    }
    return jj_ret(r, off, is_float ? jj_float(r->arena, facc) : jj_int(r->arena, acc), out);
}

FILTER(f_abs)
{
    NOARGS("abs");
    if (x->kind == JV_FLOAT)
        return jj_ret(r, off, jj_float(r->arena, fabs(x->f)), out);
    if (jj_is_int(x)) {
        if (jj_ival(x) == INT64_MIN)
            return JJ_RERR(r, DUET_ERR_RANGE, off, "integer overflow (beyond 64 bits)");
        return jj_ret(r, off, jj_int(r->arena, jj_ival(x) < 0 ? -jj_ival(x) : jj_ival(x)), out);
    }
    return JJ_RERR(r, DUET_ERR_INVALID, off, "bad operand type for abs(): '%s'", jj_type_name(x));
}

/* Python's int(str): optional sign, digits with single underscores, surrounding whitespace. */
static bool jj_parse_int(const duet_jinja_value_t *s, int64_t *v)
{
    duet_jinja_value_t t;
    size_t b = 0, e = s->len, n;
    while (b < e && (n = jj_strip_match(s, b, NULL)) > 0)
        b += n;
    while (e > b && jj_strip_match(s, e - 1, NULL) > 0)
        e--;
    (void)t;
    bool neg = false;
    if (b < e && (s->s[b] == '+' || s->s[b] == '-'))
        neg = s->s[b++] == '-';
    if (b >= e)
        return false;
    int64_t acc = 0;
    bool prev_digit = false;
    for (size_t i = b; i < e; i++) {
        char c = s->s[i];
        if (c == '_' && prev_digit && i + 1 < e && s->s[i + 1] != '_') {
            prev_digit = false;
            continue;
        }
        if (c < '0' || c > '9')
            return false;
        if (__builtin_mul_overflow(acc, 10, &acc) || __builtin_add_overflow(acc, c - '0', &acc))
            return false;
        prev_digit = true;
    }
    if (!prev_digit)
        return false;
    *v = neg ? -acc : acc;
    return true;
}

/* Python's float(str). */
static bool jj_parse_float(const duet_jinja_value_t *s, double *v)
{
    char buf[128];
    size_t b = 0, e = s->len, n, o = 0;
    while (b < e && (n = jj_strip_match(s, b, NULL)) > 0)
        b += n;
    while (e > b && jj_strip_match(s, e - 1, NULL) > 0)
        e--;
    if (e - b == 0 || e - b >= sizeof(buf))
        return false;
    for (size_t i = b; i < e; i++) {
        char c = s->s[i];
        if (c == '_') {
            if (i == b || i + 1 == e || !(s->s[i - 1] >= '0' && s->s[i - 1] <= '9') ||
                !(s->s[i + 1] >= '0' && s->s[i + 1] <= '9'))
                return false;
            continue;
        }
        if (!((c >= '0' && c <= '9') || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-' ||
              (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')))
            return false;
        buf[o++] = c;
    }
    buf[o] = '\0';
    /* strtod also reads hex floats and "infinity"/"nan(...)": keep what Python accepts. */
    const char *q = buf + (buf[0] == '+' || buf[0] == '-');
    bool word = (q[0] | 32) == 'i' || (q[0] | 32) == 'n';
    if (word) {
        if (strcasecmp(q, "inf") != 0 && strcasecmp(q, "infinity") != 0 &&
            strcasecmp(q, "nan") != 0)
            return false;
    } else if (strchr(buf, 'x') != NULL || strchr(buf, 'X') != NULL) {
        return false;
    }
    char *end = NULL;
    errno = 0;
    double d = strtod(buf, &end);
    if (end == buf || *end != '\0')
        return false;
    *v = d;
    return true;
}

FILTER(f_int)
{
    ARGS("int", "default", "base");
    if (p[1] != NULL && !(jj_is_int(p[1]) && jj_ival(p[1]) == 10))
        return JJ_RERR(r, DUET_ERR_UNSUPPORTED, off, "int(): only base 10 is supported");
    int64_t v = 0;
    double d = 0;
    if (x->kind == JV_UNDEF)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "int(): an undefined value was used");
    if (jj_is_int(x))
        return jj_ret(r, off, jj_int(r->arena, jj_ival(x)), out);
    if (x->kind == JV_FLOAT && isfinite(x->f) && fabs(x->f) < 9.2e18)
        return jj_ret(r, off, jj_int(r->arena, (int64_t)x->f), out);
    if (x->kind == JV_FLOAT)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "cannot convert float %s to integer",
                       isnan(x->f) ? "NaN" : "infinity");
    if (x->kind == JV_STR && jj_parse_int(x, &v))
        return jj_ret(r, off, jj_int(r->arena, v), out);
    if (x->kind == JV_STR && jj_parse_float(x, &d) && isfinite(d) && fabs(d) < 9.2e18)
        return jj_ret(r, off, jj_int(r->arena, (int64_t)d), out);
    if (p[0] != NULL) {
        *out = p[0];
        return DUET_OK;
    }
    return jj_ret(r, off, jj_int(r->arena, 0), out);
}

FILTER(f_float)
{
    ARGS("float", "default");
    double d = 0;
    if (x->kind == JV_UNDEF)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "float(): an undefined value was used");
    if (jj_is_number(x))
        return jj_ret(r, off, jj_float(r->arena, jj_num(x)), out);
    if (x->kind == JV_STR && jj_parse_float(x, &d))
        return jj_ret(r, off, jj_float(r->arena, d), out);
    if (p[0] != NULL) {
        *out = p[0];
        return DUET_OK;
    }
    return jj_ret(r, off, jj_float(r->arena, 0.0), out);
}

FILTER(f_round)
{
    ARGS("round", "precision", "method");
    int64_t prec = p[0] != NULL && jj_is_int(p[0]) ? jj_ival(p[0]) : 0;
    const char *method = "common";
    if (p[1] != NULL) {
        if (p[1]->kind != JV_STR)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "method must be common, ceil or floor");
        method = jj_streq(p[1]->s, p[1]->len, "ceil")     ? "ceil"
                 : jj_streq(p[1]->s, p[1]->len, "floor")  ? "floor"
                 : jj_streq(p[1]->s, p[1]->len, "common") ? "common"
                                                          : NULL;
        if (method == NULL)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "method must be common, ceil or floor");
    }
    if (!jj_is_number(x))
        return JJ_RERR(r, DUET_ERR_INVALID, off, "type %s doesn't define __round__ method",
                       jj_type_name(x));
    if (prec < 0 || prec > 17)
        return JJ_RERR(r, DUET_ERR_UNSUPPORTED, off, "round(): precision must be 0 to 17");
    if (strcmp(method, "common") == 0) {
        if (x->kind != JV_FLOAT)
            return jj_ret(r, off, jj_int(r->arena, jj_ival(x)), out);
        if (!isfinite(x->f))
            return jj_ret(r, off, jj_float(r->arena, x->f), out);
        char buf[400];
        snprintf(buf, sizeof(buf), "%.*f", (int)prec, x->f); /* correctly rounded, ties to even */
        return jj_ret(r, off, jj_float(r->arena, strtod(buf, NULL)), out);
    }
    double scale = pow(10.0, (double)prec), v = jj_num(x) * scale;
    v = strcmp(method, "ceil") == 0 ? ceil(v) : floor(v);
    return jj_ret(r, off, jj_float(r->arena, v / scale), out);
}

FILTER(f_replace)
{
    ARGS("replace", "old", "new", "count");
    duet_jinja_value_t *s = NULL;
    if ((st = jj_soft_str(r, off, x, &s)) != DUET_OK)
        return st;
    if (p[0] == NULL || p[1] == NULL)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "replace needs two arguments");
    duet_jinja_value_t *o = NULL, *n = NULL;
    if ((st = jj_soft_str(r, off, p[0], &o)) != DUET_OK ||
        (st = jj_soft_str(r, off, p[1], &n)) != DUET_OK)
        return st;
    if (p[2] != NULL && !jj_is_int(p[2]) && p[2]->kind != JV_NONE)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "count must be an integer");
    /* with autoescape off jinja2 replaces in str(s): a Markup comes out plain */
    st = jj_replace(r, off, s, o, n, p[2] != NULL && jj_is_int(p[2]) ? jj_ival(p[2]) : -1, out);
    return st != DUET_OK ? st : jj_plain(r, off, *out, out);
}

FILTER(f_center)
{
    ARGS("center", "width");
    duet_jinja_value_t *s = NULL, *fill = jj_str(r->arena, " ", 1, DUET_JINJA_ORIGIN_TEMPLATE);
    if ((st = jj_soft_str(r, off, x, &s)) != DUET_OK)
        return st;
    if (fill == NULL)
        return jj_nomem(r, off);
    if (p[0] != NULL && !jj_is_int(p[0]))
        return JJ_RERR(r, DUET_ERR_INVALID, off, "center width must be an integer");
    return jj_keep_markup(r, off, s,
                          jj_pad(r, off, s, p[0] != NULL ? jj_ival(p[0]) : 80, fill, 0, out), out);
}

FILTER(f_indent)
{
    ARGS("indent", "width", "first", "blank");
    duet_jinja_value_t *s = NULL, *ind = NULL;
    if ((st = jj_soft_str(r, off, x, &s)) != DUET_OK)
        return st;
    if (p[0] != NULL && p[0]->kind == JV_STR) {
        ind = p[0];
    } else {
        int64_t w = p[0] != NULL && jj_is_int(p[0]) ? jj_ival(p[0]) : 4;
        if (p[0] != NULL && !jj_is_int(p[0]))
            return JJ_RERR(r, DUET_ERR_INVALID, off, "indent width must be an int or a string");
        char sp[256];
        if (w > (int64_t)sizeof(sp))
            return JJ_RERR(r, DUET_ERR_UNSUPPORTED, off, "indent too wide");
        w = w < 0 ? 0 : w;
        memset(sp, ' ', (size_t)w);
        if ((ind = jj_str(r->arena, sp, (size_t)w, DUET_JINJA_ORIGIN_TEMPLATE)) == NULL)
            return jj_nomem(r, off);
    }
    bool first = p[1] != NULL && jj_truthy(p[1]), blank = p[2] != NULL && jj_truthy(p[2]);
    /* jinja2: s += "\n"; lines = s.splitlines(); the first line as is, the others indented
     * (empty ones only with blank), joined by "\n". */
    duet_jinja_value_t *lines = NULL;
    jj_args_t none = {0};
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    jj_sb_put_str(&sb, s);
    jj_sb_put(&sb, "\n", 1, DUET_JINJA_ORIGIN_TEMPLATE);
    duet_jinja_value_t *s2 = NULL;
    if ((st = jj_finish(r, off, &sb, &s2)) != DUET_OK ||
        (st = jj_str_method(r, off, s2, "splitlines", 10, &none, &lines)) != DUET_OK)
        return st;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    if (first)
        jj_sb_put_str(&sb, ind);
    for (size_t i = 0; i < lines->n; i++) {
        duet_jinja_value_t *line = lines->items[i];
        if (i > 0) {
            jj_sb_put(&sb, "\n", 1, DUET_JINJA_ORIGIN_TEMPLATE);
            if (blank || line->len > 0)
                jj_sb_put_str(&sb, ind);
        }
        jj_sb_put_str(&sb, line);
    }
    /* a Markup's indent and newline are Markup too: the text is the same, and stays Markup */
    return jj_keep_markup(r, off, s, jj_finish(r, off, &sb, out), out);
}

FILTER(f_wordcount)
{
    NOARGS("wordcount");
    duet_jinja_value_t *s = NULL;
    duet_status_t st = jj_soft_str(r, off, x, &s);
    if (st != DUET_OK)
        return st;
    int64_t n = 0;
    bool in = false;
    for (size_t i = 0; i < s->len;) {
        uint32_t c = jj_utf8_next(s->s, s->len, &i);
        bool w = c == '_' || (c >= '0' && c <= '9') || jj_cp_cased(c) ||
                 (c >= 0x4e00 && c <= 0x9fff) || (c >= 0x3040 && c <= 0x30ff) ||
                 (c >= 0xac00 && c <= 0xd7a3) || (c >= 0x5d0 && c <= 0x5ea) ||
                 (c >= 0x620 && c <= 0x64a);
        if (w && !in)
            n++;
        in = w;
    }
    return jj_ret(r, off, jj_int(r->arena, n), out);
}

FILTER(f_attr)
{
    ARGS("attr", "name");
    if (p[0] == NULL || p[0]->kind != JV_STR)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "attr needs a name");
    if (x->kind == JV_UNDEF)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "an undefined value has no attributes");
    /* getattr() only: dict keys are not attributes. */
    if (x->kind == JV_DICT &&
        !jj_name_in(p[0]->s, p[0]->len, jj_dict_methods, JJ_COUNT(jj_dict_methods))) {
        *out = &jj_undef_value;
        return DUET_OK;
    }
    return jj_getattr(r, off, x, p[0]->s, p[0]->len, out);
}

static duet_status_t jj_batch_slice(jj_render_t *r, size_t off, duet_jinja_value_t *x,
                                    const jj_args_t *a, bool slice, duet_jinja_value_t **out)
{
    ARGS(slice ? "slice" : "batch", "n", "fill_with");
    if (!jj_is_int(p[0]) || jj_ival(p[0]) <= 0)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "%s needs a positive count",
                       slice ? "slice" : "batch");
    duet_jinja_value_t *items = NULL;
    if ((st = jj_iterate(r, off, x, &items)) != DUET_OK)
        return st;
    size_t n = (size_t)jj_ival(p[0]), len = items->n;
    duet_jinja_value_t *l = jj_list_new(r, true);
    if (l == NULL)
        return jj_nomem(r, off);
    if (!slice) {
        for (size_t i = 0; i < len; i += n) {
            duet_jinja_value_t *b = jj_list_new(r, false);
            if (b == NULL || jj_push(r->arena, l, b) != DUET_OK)
                return jj_nomem(r, off);
            for (size_t k = i; k < i + n; k++)
                if (k < len ? jj_push(r->arena, b, items->items[k]) != DUET_OK
                            : p[1] != NULL && jj_push(r->arena, b, p[1]) != DUET_OK)
                    return jj_nomem(r, off);
        }
    } else {
        size_t per = len / n, extra = len % n, at = 0;
        for (size_t s = 0; s < n; s++) {
            size_t cnt = per + (s < extra);
            duet_jinja_value_t *b = jj_list_new(r, false);
            if (b == NULL || jj_push(r->arena, l, b) != DUET_OK)
                return jj_nomem(r, off);
            for (size_t k = 0; k < cnt; k++)
                if (jj_push(r->arena, b, items->items[at++]) != DUET_OK)
                    return jj_nomem(r, off);
            if (p[1] != NULL && s >= extra && extra > 0 && jj_push(r->arena, b, p[1]) != DUET_OK)
                return jj_nomem(r, off);
        }
    }
    *out = l;
    return DUET_OK;
}

FILTER(f_batch)
{
    return jj_batch_slice(r, off, x, a, false, out);
}

FILTER(f_slice)
{
    return jj_batch_slice(r, off, x, a, true, out);
}

/* map(attribute=..., default=...) or map('filter', args...). */
FILTER(f_map)
{
    duet_status_t st;
    duet_jinja_value_t *l = jj_list_new(r, true);
    if (l == NULL)
        return jj_nomem(r, off);
    /* jinja2 maps nothing over a false value (none, undefined, 0, ''): an empty generator, no
     * error, and its arguments are not even looked at. */
    if (!jj_truthy(x)) {
        *out = l;
        return DUET_OK;
    }
    duet_jinja_value_t *items = NULL;
    if ((st = jj_iterate(r, off, x, &items)) != DUET_OK)
        return st;
    duet_jinja_value_t *attr = NULL, *dflt = NULL;
    for (size_t k = 0; k < a->n_kw; k++) {
        if (jj_streq(a->kwnames[k], a->kwlens[k], "attribute"))
            attr = a->kw[k];
        else if (jj_streq(a->kwnames[k], a->kwlens[k], "default"))
            dflt = a->kw[k];
    }
    if (attr != NULL) {
        for (size_t i = 0; i < items->n; i++) {
            duet_jinja_value_t *v = NULL;
            if ((st = jj_attr_path(r, off, items->items[i], attr, &v)) != DUET_OK)
                return st;
            if (v->kind == JV_UNDEF && dflt != NULL)
                v = dflt;
            if (jj_push(r->arena, l, v) != DUET_OK)
                return jj_nomem(r, off);
        }
        *out = l;
        return DUET_OK;
    }
    if (a->n_pos == 0 || a->pos[0]->kind != JV_STR)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "map requires a filter argument");
    int fid = jj_filter_find(a->pos[0]->s, a->pos[0]->len);
    if (fid < 0)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "No filter named '%.*s'.", (int)a->pos[0]->len,
                       a->pos[0]->s);
    jj_args_t rest = *a;
    rest.pos++;
    rest.n_pos--;
    for (size_t i = 0; i < items->n; i++) {
        duet_jinja_value_t *v = NULL;
        if ((st = jj_filter_call(r, off, fid, items->items[i], &rest, &v)) != DUET_OK)
            return st;
        if (jj_push(r->arena, l, v) != DUET_OK)
            return jj_nomem(r, off);
    }
    *out = l;
    return DUET_OK;
}

/* select / reject / selectattr / rejectattr. */
static duet_status_t jj_select(jj_render_t *r, size_t off, duet_jinja_value_t *x,
                               const jj_args_t *a, bool attr, bool keep, duet_jinja_value_t **out)
{
    duet_status_t st;
    if (!jj_truthy(x)) { /* as map: a false value selects nothing, whatever the arguments */
        *out = jj_list_new(r, true);
        return *out != NULL ? DUET_OK : jj_nomem(r, off);
    }
    if (a->n_kw > 0)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "select filters take no keyword arguments");
    duet_jinja_value_t *items = NULL;
    if ((st = jj_iterate(r, off, x, &items)) != DUET_OK)
        return st;
    size_t k = 0;
    duet_jinja_value_t *path = NULL;
    if (attr) {
        if (a->n_pos == 0)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "Missing parameter for attribute name");
        path = a->pos[k++];
    }
    int tid = -1;
    if (k < a->n_pos) {
        if (a->pos[k]->kind != JV_STR)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "the test name must be a string");
        tid = jj_test_find(a->pos[k]->s, a->pos[k]->len);
        if (tid < 0)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "No test named '%.*s'.", (int)a->pos[k]->len,
                           a->pos[k]->s);
        k++;
    }
    /* no positional arguments: pos may be NULL, and NULL + 0 is undefined in C */
    jj_args_t rest = {.pos = k < a->n_pos ? a->pos + k : NULL, .n_pos = a->n_pos - k};
    duet_jinja_value_t *l = jj_list_new(r, true);
    if (l == NULL)
        return jj_nomem(r, off);
    for (size_t i = 0; i < items->n; i++) {
        duet_jinja_value_t *v = items->items[i];
        if (path != NULL && (st = jj_attr_path(r, off, v, path, &v)) != DUET_OK)
            return st;
        bool res;
        if (tid < 0)
            res = jj_truthy(v);
        else if ((st = jj_test_call(r, off, tid, v, &rest, &res)) != DUET_OK)
            return st;
        if (res == keep && jj_push(r->arena, l, items->items[i]) != DUET_OK)
            return jj_nomem(r, off);
    }
    *out = l;
    return DUET_OK;
}

FILTER(f_select)
{
    return jj_select(r, off, x, a, false, true, out);
}

FILTER(f_reject)
{
    return jj_select(r, off, x, a, false, false, out);
}

FILTER(f_selectattr)
{
    return jj_select(r, off, x, a, true, true, out);
}

FILTER(f_rejectattr)
{
    return jj_select(r, off, x, a, true, false, out);
}

FILTER(f_format)
{
    duet_jinja_value_t *s = NULL;
    duet_status_t st = jj_soft_str(r, off, x, &s);
    if (st != DUET_OK)
        return st;
    if (a->n_pos > 0 && a->n_kw > 0)
        return JJ_RERR(r, DUET_ERR_INVALID, off,
                       "can't handle positional and keyword arguments at the same time");
    duet_jinja_value_t *arg = jj_new(r->arena, a->n_kw > 0 ? JV_DICT : JV_LIST);
    if (arg == NULL)
        return jj_nomem(r, off);
    arg->tuple = true;
    for (size_t i = 0; i < a->n_pos; i++)
        if (jj_push(r->arena, arg, a->pos[i]) != DUET_OK)
            return jj_nomem(r, off);
    for (size_t k = 0; k < a->n_kw; k++) {
        duet_jinja_value_t *key = jj_str(r->arena, a->kwnames[k], a->kwlens[k], 0);
        if (key == NULL || jj_dict_set(r->arena, arg, key, a->kw[k]) != DUET_OK)
            return jj_nomem(r, off);
    }
    return jj_percent(r, off, s, arg, out);
}

static const jj_filter_t jj_filters[] = {
    {"abs", f_abs},           {"attr", f_attr},
    {"batch", f_batch},       {"capitalize", f_capitalize},
    {"center", f_center},     {"count", f_length},
    {"d", f_default},         {"default", f_default},
    {"dictsort", f_dictsort}, {"e", f_escape},
    {"escape", f_escape},     {"first", f_first},
    {"float", f_float},       {"forceescape", f_forceescape},
    {"format", f_format},     {"indent", f_indent},
    {"int", f_int},           {"items", f_items},
    {"join", f_join},         {"last", f_last},
    {"length", f_length},     {"list", f_list},
    {"lower", f_lower},       {"map", f_map},
    {"max", f_max},           {"min", f_min},
    {"reject", f_reject},     {"rejectattr", f_rejectattr},
    {"replace", f_replace},   {"reverse", f_reverse},
    {"round", f_round},       {"safe", f_safe},
    {"select", f_select},     {"selectattr", f_selectattr},
    {"slice", f_slice},       {"sort", f_sort},
    {"string", f_string},     {"sum", f_sum},
    {"title", f_title},       {"tojson", f_tojson},
    {"trim", f_trim},         {"unique", f_unique},
    {"upper", f_upper},       {"wordcount", f_wordcount},
};

int jj_filter_find(const char *name, size_t len)
{
    for (size_t i = 0; i < JJ_COUNT(jj_filters); i++)
        if (jj_streq(name, len, jj_filters[i].name))
            return (int)i;
    return -1;
}

duet_status_t jj_filter_call(jj_render_t *r, size_t off, int fid, duet_jinja_value_t *x,
                             const jj_args_t *a, duet_jinja_value_t **out)
{
    return jj_filters[fid].fn(r, off, x, a, out);
}

/* ---------------------------------------------------------------- tests */

#define TEST(name)                                                                                 \
    static duet_status_t name(jj_render_t *r, size_t off, duet_jinja_value_t *x,                   \
                              const jj_args_t *a, bool *res)

static duet_status_t jj_test_arg(jj_render_t *r, size_t off, const jj_args_t *a, const char *fn,
                                 duet_jinja_value_t **v)
{
    if (a->n_pos + a->n_kw != 1)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "test '%s' takes one argument", fn);
    *v = a->n_pos == 1 ? a->pos[0] : a->kw[0];
    return DUET_OK;
}

#define NOTESTARGS(fn)                                                                             \
    do {                                                                                           \
        if (a->n_pos + a->n_kw > 0)                                                                \
            return JJ_RERR(r, DUET_ERR_INVALID, off, "test '%s' takes no arguments", fn);          \
    } while (0)

TEST(t_defined)
{
    NOTESTARGS("defined");
    *res = x->kind != JV_UNDEF;
    return DUET_OK;
}

TEST(t_undefined)
{
    NOTESTARGS("undefined");
    *res = x->kind == JV_UNDEF;
    return DUET_OK;
}

TEST(t_none)
{
    NOTESTARGS("none");
    *res = x->kind == JV_NONE;
    return DUET_OK;
}

TEST(t_string)
{
    NOTESTARGS("string");
    *res = x->kind == JV_STR;
    return DUET_OK;
}

TEST(t_number)
{
    NOTESTARGS("number");
    *res = jj_is_number(x);
    return DUET_OK;
}

TEST(t_integer)
{
    NOTESTARGS("integer");
    *res = x->kind == JV_INT;
    return DUET_OK;
}

TEST(t_float)
{
    NOTESTARGS("float");
    *res = x->kind == JV_FLOAT;
    return DUET_OK;
}

TEST(t_boolean)
{
    NOTESTARGS("boolean");
    *res = x->kind == JV_BOOL;
    return DUET_OK;
}

TEST(t_true)
{
    NOTESTARGS("true");
    *res = x->kind == JV_BOOL && x->b;
    return DUET_OK;
}

TEST(t_false)
{
    NOTESTARGS("false");
    *res = x->kind == JV_BOOL && !x->b;
    return DUET_OK;
}

TEST(t_mapping)
{
    NOTESTARGS("mapping");
    *res = x->kind == JV_DICT;
    return DUET_OK;
}

TEST(t_sequence)
{
    NOTESTARGS("sequence");
    *res = x->kind == JV_STR || (x->kind == JV_LIST && !x->gen) || x->kind == JV_DICT;
    return DUET_OK;
}

TEST(t_iterable)
{
    NOTESTARGS("iterable");
    *res = x->kind == JV_STR || x->kind == JV_LIST || x->kind == JV_DICT || x->kind == JV_UNDEF ||
           x->kind == JV_LOOP;
    return DUET_OK;
}

TEST(t_callable)
{
    NOTESTARGS("callable");
    *res = x->kind == JV_MACRO || x->kind == JV_FUNC || x->kind == JV_METHOD;
    return DUET_OK;
}

TEST(t_escaped)
{
    NOTESTARGS("escaped");
    *res = x->kind == JV_STR && x->markup; /* has __html__ */
    return DUET_OK;
}

static duet_status_t jj_test_int(jj_render_t *r, size_t off, duet_jinja_value_t *x, int64_t *v)
{
    if (!jj_is_number(x))
        return JJ_RERR(r, DUET_ERR_INVALID, off, "a number test got a %s", jj_type_name(x));
    if (x->kind == JV_FLOAT)
        return JJ_RERR(r, DUET_ERR_UNSUPPORTED, off, "odd/even/divisibleby of a float");
    *v = jj_ival(x);
    return DUET_OK;
}

TEST(t_odd)
{
    NOTESTARGS("odd");
    int64_t v = 0;
    duet_status_t st = jj_test_int(r, off, x, &v);
    *res = (v % 2) != 0;
    return st;
}

TEST(t_even)
{
    NOTESTARGS("even");
    int64_t v = 0;
    duet_status_t st = jj_test_int(r, off, x, &v);
    *res = (v % 2) == 0;
    return st;
}

TEST(t_divisibleby)
{
    duet_jinja_value_t *d = NULL;
    int64_t v = 0, n = 0;
    duet_status_t st = jj_test_arg(r, off, a, "divisibleby", &d);
    if (st == DUET_OK)
        st = jj_test_int(r, off, x, &v);
    if (st == DUET_OK)
        st = jj_test_int(r, off, d, &n);
    if (st != DUET_OK)
        return st;
    if (n == 0)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "integer division or modulo by zero");
    *res = n == -1 || v % n == 0;
    return DUET_OK;
}

TEST(t_lower)
{
    NOTESTARGS("lower");
    duet_jinja_value_t *s = NULL, *o = NULL;
    jj_args_t none = {0};
    duet_status_t st = jj_stringify(r, off, x, &s);
    if (st == DUET_OK)
        st = jj_str_method(r, off, s, "islower", 7, &none, &o);
    if (st == DUET_OK)
        *res = o->b;
    return st;
}

TEST(t_upper)
{
    NOTESTARGS("upper");
    duet_jinja_value_t *s = NULL, *o = NULL;
    jj_args_t none = {0};
    duet_status_t st = jj_stringify(r, off, x, &s);
    if (st == DUET_OK)
        st = jj_str_method(r, off, s, "isupper", 7, &none, &o);
    if (st == DUET_OK)
        *res = o->b;
    return st;
}

TEST(t_sameas)
{
    duet_jinja_value_t *o = NULL;
    duet_status_t st = jj_test_arg(r, off, a, "sameas", &o);
    if (st != DUET_OK)
        return st;
    /* `is`: singletons compare by value, everything else by identity. */
    if (x->kind == JV_NONE || x->kind == JV_BOOL || x->kind == JV_UNDEF)
        *res = x->kind == o->kind && (x->kind != JV_BOOL || x->b == o->b);
    else
        *res = x == o;
    return DUET_OK;
}

static duet_status_t jj_test_cmp(jj_render_t *r, size_t off, duet_jinja_value_t *x,
                                 const jj_args_t *a, int which, bool *res)
{
    duet_jinja_value_t *o = NULL;
    duet_status_t st = jj_test_arg(r, off, a, "comparison", &o);
    if (st != DUET_OK)
        return st;
    if (which == 0) {
        *res = jj_equal(x, o, 0);
        return DUET_OK;
    }
    if (which == 1) {
        *res = !jj_equal(x, o, 0);
        return DUET_OK;
    }
    int c = 0;
    if ((st = jj_compare(r, off, x, o, &c)) != DUET_OK)
        return st;
    *res = which == 2 ? c < 0 : which == 3 ? c <= 0 : which == 4 ? c > 0 : c >= 0;
    return DUET_OK;
}

TEST(t_eq)
{
    return jj_test_cmp(r, off, x, a, 0, res);
}

TEST(t_ne)
{
    return jj_test_cmp(r, off, x, a, 1, res);
}

TEST(t_lt)
{
    return jj_test_cmp(r, off, x, a, 2, res);
}

TEST(t_le)
{
    return jj_test_cmp(r, off, x, a, 3, res);
}

TEST(t_gt)
{
    return jj_test_cmp(r, off, x, a, 4, res);
}

TEST(t_ge)
{
    return jj_test_cmp(r, off, x, a, 5, res);
}

TEST(t_in)
{
    duet_jinja_value_t *seq = NULL, *items = NULL;
    duet_status_t st = jj_test_arg(r, off, a, "in", &seq);
    if (st != DUET_OK)
        return st;
    *res = false;
    if (seq->kind == JV_STR) {
        if (x->kind != JV_STR)
            return JJ_RERR(r, DUET_ERR_INVALID, off,
                           "'in <string>' requires string as left operand, not %s",
                           jj_type_name(x));
        *res = jj_find(seq, 0, x) != SIZE_MAX;
        return DUET_OK;
    }
    if ((st = jj_iterate(r, off, seq, &items)) != DUET_OK)
        return st;
    for (size_t i = 0; i < items->n && !*res; i++)
        *res = jj_equal(x, items->items[i], 0);
    return DUET_OK;
}

static const jj_test_t jj_tests[] = {
    {"boolean", t_boolean},
    {"callable", t_callable},
    {"defined", t_defined},
    {"divisibleby", t_divisibleby},
    {"eq", t_eq},
    {"equalto", t_eq},
    {"==", t_eq},
    {"escaped", t_escaped},
    {"even", t_even},
    {"false", t_false},
    {"float", t_float},
    {"ge", t_ge},
    {">=", t_ge},
    {"gt", t_gt},
    {"greaterthan", t_gt},
    {">", t_gt},
    {"in", t_in},
    {"integer", t_integer},
    {"iterable", t_iterable},
    {"le", t_le},
    {"<=", t_le},
    {"lower", t_lower},
    {"lt", t_lt},
    {"lessthan", t_lt},
    {"<", t_lt},
    {"mapping", t_mapping},
    {"ne", t_ne},
    {"!=", t_ne},
    {"none", t_none},
    {"number", t_number},
    {"odd", t_odd},
    {"sameas", t_sameas},
    {"sequence", t_sequence},
    {"string", t_string},
    {"true", t_true},
    {"undefined", t_undefined},
    {"upper", t_upper},
};

int jj_test_find(const char *name, size_t len)
{
    for (size_t i = 0; i < JJ_COUNT(jj_tests); i++)
        if (jj_streq(name, len, jj_tests[i].name))
            return (int)i;
    return -1;
}

duet_status_t jj_test_call(jj_render_t *r, size_t off, int tid, duet_jinja_value_t *x,
                           const jj_args_t *a, bool *res)
{
    return jj_tests[tid].fn(r, off, x, a, res);
}
