/*
 * Rendering a parsed template (see jinja.h): statements, expressions, scopes and macros, with
 * jinja2's semantics as transformers runs them.
 *
 * Scopes follow jinja2's: `if` opens none; every iteration of a for loop, a macro call, a
 * `with` and a call/filter block opens one, so a `set` inside a loop is gone after it (hence
 * namespace()). Undefined is jinja2's default Undefined: it prints as "", is false, iterates as
 * empty, but reading an attribute or item of it, calling it, or doing arithmetic on it is an
 * error. `and` / `or` return an operand, as in Python.
 *
 * Bounds: the parser bounded nesting, so expression and statement recursion is bounded; macro
 * calls (which can recurse) are bounded by max_call_depth; loop iterations and macro calls count
 * against max_iterations; every string against max_output; every value against the arena.
 */
#include "router/api/jinja_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- scopes */

/* Bind a name in a scope; names live in the template, which outlives the render. */
static duet_status_t jj_set_var(jj_render_t *r, jj_scope_t *sc, const char *name, size_t nlen,
                                duet_jinja_value_t *val)
{
    return jj_scope_set(r->arena, sc, name, nlen, val, false) == DUET_OK ? DUET_OK : jj_nomem(r, 0);
}

static duet_jinja_value_t *jj_lookup(jj_render_t *r, const jj_scope_t *sc, const char *name,
                                     size_t nlen)
{
    for (; sc != NULL; sc = sc->parent)
        for (jj_var_t *v = sc->vars; v != NULL; v = v->next)
            if (v->name_len == nlen && memcmp(v->name, name, nlen) == 0)
                return v->val;
    int g = jj_global_find(name, nlen);
    if (g >= 0) {
        duet_jinja_value_t *f = jj_new(r->arena, JV_FUNC);
        if (f != NULL) {
            f->i = g;
            return f;
        }
    }
    return &jj_undef_value;
}

static jj_scope_t *jj_scope_new(jj_render_t *r, jj_scope_t *parent)
{
    jj_scope_t *sc = jj_alloc(r->arena, sizeof(*sc));
    if (sc != NULL)
        sc->parent = parent;
    return sc;
}

duet_status_t jj_tick(jj_render_t *r, size_t off)
{
    if (++r->iterations > r->lim.max_iterations)
        return JJ_RERR(r, DUET_ERR_RANGE, off, "more than %zu loop iterations and macro calls",
                       r->lim.max_iterations);
    return DUET_OK;
}

duet_status_t jj_work(jj_render_t *r, size_t off, uint64_t n)
{
    r->work += n;
    if (r->work > (uint64_t)r->lim.max_iterations * 1000)
        return JJ_RERR(r, DUET_ERR_RANGE, off,
                       "more than %zu items visited by filters and comparisons",
                       r->lim.max_iterations * 1000);
    return DUET_OK;
}

static duet_status_t jj_undefined_error(jj_render_t *r, const jj_expr_t *e)
{
    if (e->kind == JE_NAME)
        return JJ_RERR(r, DUET_ERR_INVALID, e->off, "'%.*s' is undefined",
                       (int)(e->name_len > 64 ? 64 : e->name_len), e->name);
    if (e->kind == JE_ATTR)
        return JJ_RERR(r, DUET_ERR_INVALID, e->off, "a value has no attribute '%.*s'",
                       (int)(e->name_len > 64 ? 64 : e->name_len), e->name);
    return JJ_RERR(r, DUET_ERR_INVALID, e->off, "an undefined value was used");
}

/* ---------------------------------------------------------------- expressions */

static duet_status_t jj_eval(jj_render_t *r, const jj_expr_t *e, jj_scope_t *sc,
                             duet_jinja_value_t **v_p);
static duet_status_t jj_run(jj_render_t *r, const jj_body_t *body, jj_scope_t *sc);

typedef struct {
    jj_args_t a;
    duet_jinja_value_t *hole; /* the text of a filter block while its filters run */
} jj_argbuf_t;

/* f(*x): the positional arguments after the written ones, as Python unpacks any iterable
 * (undefined unpacks to nothing, as jinja2's Undefined iterates empty). */
static duet_status_t jj_eval_star(jj_render_t *r, const jj_expr_t *e, jj_scope_t *sc, jj_args_t *a)
{
    duet_jinja_value_t *x = NULL, *items = NULL;
    duet_status_t st = jj_eval(r, e->star, sc, &x);
    if (st != DUET_OK)
        return st;
    if (x->kind != JV_UNDEF && x->kind != JV_LIST && x->kind != JV_DICT && x->kind != JV_STR)
        return JJ_RERR(r, DUET_ERR_INVALID, e->star->off,
                       "Value after * must be an iterable, not %s", jj_type_name(x));
    if ((st = jj_iterate(r, e->star->off, x, &items)) != DUET_OK)
        return st;
    if (items->n == 0)
        return DUET_OK;
    duet_jinja_value_t **pos = jj_alloc(r->arena, (a->n_pos + items->n) * sizeof(*pos));
    if (pos == NULL)
        return jj_nomem(r, e->off);
    if (a->n_pos > 0)
        memcpy(pos, a->pos, a->n_pos * sizeof(*pos));
    memcpy(pos + a->n_pos, items->items, items->n * sizeof(*pos));
    a->pos = pos;
    a->n_pos += items->n;
    return DUET_OK;
}

/* f(**d): keyword arguments from a dict with string keys, none repeating a written one. */
static duet_status_t jj_eval_dstar(jj_render_t *r, const jj_expr_t *e, jj_scope_t *sc, jj_args_t *a)
{
    duet_jinja_value_t *d = NULL;
    duet_status_t st = jj_eval(r, e->dstar, sc, &d);
    if (st != DUET_OK)
        return st;
    if (d->kind != JV_DICT)
        return JJ_RERR(r, DUET_ERR_INVALID, e->dstar->off,
                       "argument after ** must be a mapping, not %s", jj_type_name(d));
    if (d->n == 0)
        return DUET_OK;
    size_t n = a->n_kw + d->n;
    duet_jinja_value_t **kw = jj_alloc(r->arena, n * sizeof(*kw));
    const char **names = jj_alloc(r->arena, n * sizeof(*names));
    size_t *lens = jj_alloc(r->arena, n * sizeof(*lens));
    if (kw == NULL || names == NULL || lens == NULL)
        return jj_nomem(r, e->off);
    for (size_t i = 0; i < a->n_kw; i++) {
        kw[i] = a->kw[i];
        names[i] = a->kwnames[i];
        lens[i] = a->kwlens[i];
    }
    for (size_t i = 0; i < d->n; i++) {
        const duet_jinja_value_t *k = d->keys[i];
        if (k->kind != JV_STR)
            return JJ_RERR(r, DUET_ERR_INVALID, e->dstar->off, "keywords must be strings");
        for (size_t j = 0; j < a->n_kw; j++)
            if (lens[j] == k->len && memcmp(names[j], k->s, k->len) == 0)
                return JJ_RERR(r, DUET_ERR_INVALID, e->dstar->off,
                               "got multiple values for keyword argument '%.*s'", (int)k->len,
                               k->s);
        kw[a->n_kw + i] = d->items[i];
        names[a->n_kw + i] = k->s;
        lens[a->n_kw + i] = k->len;
    }
    a->kw = kw;
    a->kwnames = names;
    a->kwlens = lens;
    a->n_kw = n;
    return DUET_OK;
}

static duet_status_t jj_eval_args(jj_render_t *r, const jj_expr_t *e, jj_scope_t *sc, jj_args_t *a)
{
    memset(a, 0, sizeof(*a));
    if (e->n_args > 0) {
        a->pos = jj_alloc(r->arena, e->n_args * sizeof(*a->pos));
        if (a->pos == NULL)
            return jj_nomem(r, e->off);
        for (size_t i = 0; i < e->n_args; i++) {
            duet_status_t st = jj_eval(r, e->args[i], sc, &a->pos[i]);
            if (st != DUET_OK)
                return st;
        }
        a->n_pos = e->n_args;
    }
    if (e->n_kw > 0) {
        a->kw = jj_alloc(r->arena, e->n_kw * sizeof(*a->kw));
        if (a->kw == NULL)
            return jj_nomem(r, e->off);
        for (size_t i = 0; i < e->n_kw; i++) {
            duet_status_t st = jj_eval(r, e->kwargs[i], sc, &a->kw[i]);
            if (st != DUET_OK)
                return st;
        }
        a->kwnames = e->kwnames;
        a->kwlens = e->kwlens;
        a->n_kw = e->n_kw;
    }
    duet_status_t st = DUET_OK;
    if (e->star != NULL)
        st = jj_eval_star(r, e, sc, a);
    if (st == DUET_OK && e->dstar != NULL)
        st = jj_eval_dstar(r, e, sc, a);
    return st;
}

static duet_status_t jj_int_result(jj_render_t *r, size_t off, int64_t i, duet_jinja_value_t **v_p)
{
    *v_p = jj_int(r->arena, i);
    return *v_p != NULL ? DUET_OK : jj_nomem(r, off);
}

static duet_status_t jj_float_result(jj_render_t *r, size_t off, double f, duet_jinja_value_t **v_p)
{
    *v_p = jj_float(r->arena, f);
    return *v_p != NULL ? DUET_OK : jj_nomem(r, off);
}

static duet_status_t jj_repeat(jj_render_t *r, size_t off, duet_jinja_value_t *seq, int64_t n,
                               duet_jinja_value_t **v_p)
{
    if (n < 0)
        n = 0;
    if (seq->kind == JV_STR) {
        if (seq->len > 0 && (uint64_t)n > r->lim.max_output / seq->len)
            return JJ_RERR(r, DUET_ERR_RANGE, off,
                           "string longer than the output limit (%zu bytes)", r->lim.max_output);
        jj_sb_t sb;
        jj_sb_init(&sb, r->arena, r->lim.max_output);
        for (int64_t k = 0; k < n; k++)
            jj_sb_put_str(&sb, seq);
        *v_p = jj_sb_finish(&sb);
        if (*v_p == NULL)
            return jj_nomem(r, off);
        (*v_p)->markup = seq->markup; /* Markup * n is Markup */
        return DUET_OK;
    }
    if (seq->n > 0 && (uint64_t)n > r->lim.max_iterations / seq->n)
        return JJ_RERR(r, DUET_ERR_RANGE, off, "list longer than %zu items", r->lim.max_iterations);
    duet_jinja_value_t *l = jj_new(r->arena, JV_LIST);
    if (l == NULL)
        return jj_nomem(r, off);
    l->tuple = seq->tuple;
    for (int64_t k = 0; k < n; k++)
        for (size_t i = 0; i < seq->n; i++)
            if (jj_push(r->arena, l, seq->items[i]) != DUET_OK)
                return jj_nomem(r, off);
    *v_p = l;
    return DUET_OK;
}

static duet_status_t jj_eval_bin(jj_render_t *r, const jj_expr_t *e, duet_jinja_value_t *a,
                                 duet_jinja_value_t *b, duet_jinja_value_t **v_p)
{
    static const char *const opname[] = {"+", "-", "*", "/", "//", "%", "**"};
    if (a->kind == JV_UNDEF || (b->kind == JV_UNDEF && !(e->op == JOP_MOD && a->kind == JV_STR)))
        return jj_undefined_error(r, a->kind == JV_UNDEF ? e->a : e->b);
    bool nums = jj_is_number(a) && jj_is_number(b);
    bool ints = nums && a->kind != JV_FLOAT && b->kind != JV_FLOAT;
    int64_t x = a->kind == JV_INT ? a->i : a->b, y = b->kind == JV_INT ? b->i : b->b, z = 0;
    double fx = jj_num(a), fy = jj_num(b);
    switch ((jop_t)e->op) {
    case JOP_ADD:
        if (ints) {
            if (__builtin_add_overflow(x, y, &z))
                goto overflow;
            return jj_int_result(r, e->off, z, v_p);
        }
        if (nums)
            return jj_float_result(r, e->off, fx + fy, v_p);
        if (a->kind == JV_STR && b->kind == JV_STR) {
            /* Markup + str escapes the str (and str + Markup): the sum is Markup */
            bool markup = a->markup || b->markup;
            duet_status_t st = DUET_OK;
            if (markup && ((st = jj_escape(r, e->off, a, &a)) != DUET_OK ||
                           (st = jj_escape(r, e->off, b, &b)) != DUET_OK))
                return st;
            jj_sb_t sb;
            jj_sb_init(&sb, r->arena, r->lim.max_output);
            jj_sb_put_str(&sb, a);
            jj_sb_put_str(&sb, b);
            *v_p = jj_sb_finish(&sb);
            if (*v_p == NULL)
                return sb.st == DUET_ERR_RANGE
                           ? JJ_RERR(r, DUET_ERR_RANGE, e->off,
                                     "string longer than the output limit (%zu bytes)",
                                     r->lim.max_output)
                           : jj_nomem(r, e->off);
            (*v_p)->markup = markup;
            return DUET_OK;
        }
        if (a->kind == JV_LIST && b->kind == JV_LIST && !a->gen && !b->gen &&
            a->tuple == b->tuple) {
            duet_jinja_value_t *l = jj_new(r->arena, JV_LIST);
            if (l == NULL)
                return jj_nomem(r, e->off);
            l->tuple = a->tuple;
            for (size_t i = 0; i < a->n + b->n; i++)
                if (jj_push(r->arena, l, i < a->n ? a->items[i] : b->items[i - a->n]) != DUET_OK)
                    return jj_nomem(r, e->off);
            *v_p = l;
            return DUET_OK;
        }
        if (a->kind == JV_STR)
            return JJ_RERR(r, DUET_ERR_INVALID, e->off,
                           "can only concatenate str (not \"%s\") to str", jj_type_name(b));
        break;
    case JOP_SUB:
        if (ints) {
            if (__builtin_sub_overflow(x, y, &z))
                goto overflow;
            return jj_int_result(r, e->off, z, v_p);
        }
        if (nums)
            return jj_float_result(r, e->off, fx - fy, v_p);
        break;
    case JOP_MUL:
        if (ints) {
            if (__builtin_mul_overflow(x, y, &z))
                goto overflow;
            return jj_int_result(r, e->off, z, v_p);
        }
        if (nums)
            return jj_float_result(r, e->off, fx * fy, v_p);
        if ((a->kind == JV_STR || (a->kind == JV_LIST && !a->gen)) &&
            (b->kind == JV_INT || b->kind == JV_BOOL))
            return jj_repeat(r, e->off, a, y, v_p);
        if ((b->kind == JV_STR || (b->kind == JV_LIST && !b->gen)) &&
            (a->kind == JV_INT || a->kind == JV_BOOL))
            return jj_repeat(r, e->off, b, x, v_p);
        break;
    case JOP_DIV:
        if (nums) {
            if (fy == 0.0)
                return JJ_RERR(r, DUET_ERR_INVALID, e->off, "division by zero");
            return jj_float_result(r, e->off, fx / fy, v_p);
        }
        break;
    case JOP_FLOORDIV:
    case JOP_MOD:
        if (nums) {
            if (fy == 0.0)
                return JJ_RERR(r, DUET_ERR_INVALID, e->off, "integer division or modulo by zero");
            if (ints) {
                if (x == INT64_MIN && y == -1)
                    goto overflow;
                int64_t q = x / y, m = x % y;
                if (m != 0 && ((m < 0) != (y < 0))) {
                    q--;
                    m += y;
                }
                return jj_int_result(r, e->off, e->op == JOP_MOD ? m : q, v_p);
            }
            double m = fmod(fx, fy);
            if (m != 0.0 && ((m < 0) != (fy < 0)))
                m += fy;
            else if (m == 0.0)
                m = copysign(0.0, fy);
            if (e->op == JOP_MOD)
                return jj_float_result(r, e->off, m, v_p);
            return jj_float_result(r, e->off, floor((fx - m) / fy + 0.5), v_p);
        }
        if (e->op == JOP_MOD && a->kind == JV_STR)
            return jj_percent(r, e->off, a, b, v_p);
        break;
    case JOP_POW:
        if (ints && y >= 0) {
            int64_t acc = 1, base = x;
            for (int64_t k = y; k > 0; k >>= 1) {
                if ((k & 1) && __builtin_mul_overflow(acc, base, &acc))
                    goto overflow;
                if (k > 1 && __builtin_mul_overflow(base, base, &base))
                    goto overflow;
            }
            return jj_int_result(r, e->off, acc, v_p);
        }
        if (nums) {
            if (fx == 0.0 && fy < 0)
                return JJ_RERR(r, DUET_ERR_INVALID, e->off,
                               "0.0 cannot be raised to a negative power");
            return jj_float_result(r, e->off, pow(fx, fy), v_p);
        }
        break;
    }
    return JJ_RERR(r, DUET_ERR_INVALID, e->off, "unsupported operand type(s) for %s: '%s' and '%s'",
                   opname[e->op], jj_type_name(a), jj_type_name(b));
overflow:
    return JJ_RERR(r, DUET_ERR_RANGE, e->off, "integer overflow (beyond 64 bits)");
}

/* `a in b`. */
static duet_status_t jj_contains(jj_render_t *r, size_t off, duet_jinja_value_t *a,
                                 duet_jinja_value_t *b, bool *res)
{
    *res = false;
    switch (b->kind) {
    case JV_UNDEF:
        return DUET_OK;
    case JV_STR:
        if (a->kind != JV_STR)
            return JJ_RERR(r, DUET_ERR_INVALID, off,
                           "'in <string>' requires string as left operand, not %s",
                           jj_type_name(a));
        if (a->len == 0) {
            *res = true;
            return DUET_OK;
        }
        for (size_t i = 0; a->len <= b->len && i <= b->len - a->len && !*res; i++)
            *res = memcmp(b->s + i, a->s, a->len) == 0;
        return DUET_OK;
    case JV_LIST:
        for (size_t i = 0; i < b->n && !*res; i++)
            *res = jj_equal(a, b->items[i], 0);
        return jj_work(r, off, b->n);
    case JV_DICT:
    case JV_NS:
        if ((a->kind == JV_LIST && !a->tuple) || a->kind == JV_DICT)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "unhashable type: '%s'", jj_type_name(a));
        for (size_t i = 0; i < b->n && !*res; i++)
            *res = jj_equal(a, b->keys[i], 0);
        return DUET_OK;
    default:
        return JJ_RERR(r, DUET_ERR_INVALID, off, "argument of type '%s' is not iterable",
                       jj_type_name(b));
    }
}

static duet_status_t jj_slice(jj_render_t *r, const jj_expr_t *e, jj_scope_t *sc,
                              duet_jinja_value_t *obj, duet_jinja_value_t **v_p)
{
    duet_jinja_value_t *pv[3] = {NULL, NULL, NULL};
    const jj_expr_t *pe[3] = {e->b, e->c, e->d};
    for (int k = 0; k < 3; k++) {
        if (pe[k] == NULL)
            continue;
        duet_status_t st = jj_eval(r, pe[k], sc, &pv[k]);
        if (st != DUET_OK)
            return st;
        if (pv[k]->kind == JV_NONE) {
            pv[k] = NULL;
        } else if (pv[k]->kind != JV_INT && pv[k]->kind != JV_BOOL) {
            if (pv[k]->kind == JV_UNDEF)
                return jj_undefined_error(r, pe[k]);
            return JJ_RERR(r, DUET_ERR_INVALID, pe[k]->off,
                           "slice indices must be integers or None");
        }
    }
    if (obj->kind != JV_STR && !(obj->kind == JV_LIST && !obj->gen)) {
        *v_p = &jj_undef_value;
        return DUET_OK;
    }
    int64_t n = (int64_t)(obj->kind == JV_STR ? jj_utf8_count(obj->s, obj->len) : obj->n);
    int64_t step = pv[2] != NULL ? (pv[2]->kind == JV_INT ? pv[2]->i : pv[2]->b) : 1;
    if (step == 0)
        return JJ_RERR(r, DUET_ERR_INVALID, e->off, "slice step cannot be zero");
    int64_t lo = step > 0 ? 0 : -1, hi = step > 0 ? n : n - 1;
    int64_t start = step > 0 ? lo : hi, stop = step > 0 ? hi : lo;
    for (int k = 0; k < 2; k++) {
        if (pv[k] == NULL)
            continue;
        int64_t x = pv[k]->kind == JV_INT ? pv[k]->i : pv[k]->b;
        if (x < 0) {
            x += n;
            if (x < lo)
                x = lo;
        } else if (x > hi) {
            x = hi;
        }
        if (k == 0)
            start = x;
        else
            stop = x;
    }
    if (obj->kind == JV_LIST) {
        duet_jinja_value_t *l = jj_new(r->arena, JV_LIST);
        if (l == NULL)
            return jj_nomem(r, e->off);
        l->tuple = obj->tuple;
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
            if (jj_push(r->arena, l, obj->items[i]) != DUET_OK)
                return jj_nomem(r, e->off);
        *v_p = l;
        return DUET_OK;
    }
    /* Strings slice by character: map character indices to byte offsets once. */
    size_t *offs = jj_alloc(r->arena, ((size_t)n + 1) * sizeof(*offs));
    if (offs == NULL)
        return jj_nomem(r, e->off);
    size_t bi = 0;
    for (int64_t c = 0; c < n; c++) {
        offs[c] = bi;
        jj_utf8_next(obj->s, obj->len, &bi);
    }
    offs[n] = obj->len;
    jj_sb_t sb;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    if (step == 1) {
        if (stop > start)
            jj_sb_put_range(&sb, obj, offs[start], offs[stop] - offs[start]);
    } else {
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
            jj_sb_put_range(&sb, obj, offs[i], offs[i + 1] - offs[i]);
    }
    *v_p = jj_sb_finish(&sb);
    return *v_p != NULL ? DUET_OK : jj_nomem(r, e->off);
}

/* A new LIST, TUPLE or DICT from its item expressions. */
static duet_status_t jj_eval_container(jj_render_t *r, const jj_expr_t *e, jj_scope_t *sc,
                                       duet_jinja_value_t **v_p)
{
    duet_jinja_value_t *c = jj_new(r->arena, e->kind == JE_DICT ? JV_DICT : JV_LIST);
    if (c == NULL)
        return jj_nomem(r, e->off);
    c->tuple = e->kind == JE_TUPLE;
    for (size_t i = 0; i < e->n_args; i++) {
        duet_jinja_value_t *k = NULL, *v = NULL;
        duet_status_t st = jj_eval(r, e->args[i], sc, &k);
        if (st != DUET_OK)
            return st;
        if (e->kind == JE_DICT) {
            if ((st = jj_eval(r, e->kwargs[i], sc, &v)) != DUET_OK)
                return st;
            if ((k->kind == JV_LIST && !k->tuple) || k->kind == JV_DICT)
                return JJ_RERR(r, DUET_ERR_INVALID, e->args[i]->off, "unhashable type: '%s'",
                               jj_type_name(k));
            st = jj_dict_set(r->arena, c, k, v);
        } else {
            st = jj_push(r->arena, c, k);
        }
        if (st != DUET_OK)
            return jj_nomem(r, e->off);
    }
    *v_p = c;
    return DUET_OK;
}

static duet_status_t jj_call(jj_render_t *r, const jj_expr_t *e, jj_scope_t *sc,
                             duet_jinja_value_t *caller, duet_jinja_value_t **v_p)
{
    duet_jinja_value_t *f = NULL;
    duet_status_t st = jj_eval(r, e->a, sc, &f);
    jj_args_t args;
    if (st == DUET_OK)
        st = jj_eval_args(r, e, sc, &args);
    if (st != DUET_OK)
        return st;
    switch (f->kind) {
    case JV_UNDEF:
        if (f == &jj_unsafe_value) /* ImmutableSandboxedEnvironment's SecurityError */
            return JJ_RERR(r, DUET_ERR_INVALID, e->off,
                           "access to attribute '%.*s' is unsafe: lists and dicts cannot be "
                           "changed in a chat template",
                           (int)e->a->name_len, e->a->name != NULL ? e->a->name : "");
        return jj_undefined_error(r, e->a);
    case JV_MACRO:
        if (caller != NULL) {
            duet_jinja_value_t *m = jj_new(r->arena, JV_MACRO);
            if (m == NULL)
                return jj_nomem(r, e->off);
            *m = *f;
            m->caller = caller;
            f = m;
        }
        return jj_call_macro(r, e->off, f, &args, v_p);
    case JV_FUNC:
    case JV_METHOD:
        return jj_call_builtin(r, e->off, f, &args, v_p);
    default:
        return JJ_RERR(r, DUET_ERR_INVALID, e->off, "'%s' object is not callable", jj_type_name(f));
    }
}

static duet_status_t jj_eval(jj_render_t *r, const jj_expr_t *e, jj_scope_t *sc,
                             duet_jinja_value_t **v_p)
{
    duet_jinja_value_t *a = NULL, *b = NULL;
    duet_status_t st = DUET_OK;
    switch (e->kind) {
    case JE_LIT:
        *v_p = e->lit;
        return DUET_OK;
    case JE_NAME:
        *v_p = jj_lookup(r, sc, e->name, e->name_len);
        return DUET_OK;
    case JE_HOLE:
        *v_p = sc != NULL ? jj_lookup(r, sc, "\x01hole", 5) : &jj_undef_value;
        return DUET_OK;
    case JE_ATTR:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK)
            return st;
        if (a->kind == JV_UNDEF)
            return jj_undefined_error(r, e->a);
        return jj_getattr(r, e->off, a, e->name, e->name_len, v_p);
    case JE_ITEM:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK ||
            (st = jj_eval(r, e->b, sc, &b)) != DUET_OK)
            return st;
        if (a->kind == JV_UNDEF)
            return jj_undefined_error(r, e->a);
        if ((st = jj_getitem(r, e->off, a, b, v_p)) != DUET_OK)
            return st;
        /* a Markup's character is Markup (its __getitem__) */
        return a->kind == JV_STR && a->markup ? jj_mark(r, e->off, *v_p, v_p) : DUET_OK;
    case JE_SLICE:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK)
            return st;
        if (a->kind == JV_UNDEF)
            return jj_undefined_error(r, e->a);
        if ((st = jj_slice(r, e, sc, a, v_p)) != DUET_OK)
            return st;
        return a->kind == JV_STR && a->markup ? jj_mark(r, e->off, *v_p, v_p) : DUET_OK;
    case JE_CALL:
        return jj_call(r, e, sc, NULL, v_p);
    case JE_FILTER: {
        jj_args_t args;
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK ||
            (st = jj_eval_args(r, e, sc, &args)) != DUET_OK)
            return st;
        return jj_filter_call(r, e->off, e->fid, a, &args, v_p);
    }
    case JE_TEST: {
        jj_args_t args;
        bool res = false;
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK ||
            (st = jj_eval_args(r, e, sc, &args)) != DUET_OK ||
            (st = jj_test_call(r, e->off, e->fid, a, &args, &res)) != DUET_OK)
            return st;
        *v_p = jj_bool(r->arena, res != e->negate);
        return *v_p != NULL ? DUET_OK : jj_nomem(r, e->off);
    }
    case JE_BIN:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK ||
            (st = jj_eval(r, e->b, sc, &b)) != DUET_OK)
            return st;
        return jj_eval_bin(r, e, a, b, v_p);
    case JE_NEG:
    case JE_POS:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK)
            return st;
        if (a->kind == JV_UNDEF)
            return jj_undefined_error(r, e->a);
        if (!jj_is_number(a))
            return JJ_RERR(r, DUET_ERR_INVALID, e->off, "bad operand type for unary %c: '%s'",
                           e->kind == JE_NEG ? '-' : '+', jj_type_name(a));
        if (a->kind == JV_FLOAT)
            return jj_float_result(r, e->off, e->kind == JE_NEG ? -a->f : a->f, v_p);
        if (a->kind == JV_INT && a->i == INT64_MIN && e->kind == JE_NEG)
            return JJ_RERR(r, DUET_ERR_RANGE, e->off, "integer overflow (beyond 64 bits)");
        {
            int64_t x = a->kind == JV_INT ? a->i : a->b;
            return jj_int_result(r, e->off, e->kind == JE_NEG ? -x : x, v_p);
        }
    case JE_NOT:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK)
            return st;
        *v_p = jj_bool(r->arena, !jj_truthy(a));
        return *v_p != NULL ? DUET_OK : jj_nomem(r, e->off);
    case JE_AND:
    case JE_OR:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK)
            return st;
        if (jj_truthy(a) == (e->kind == JE_OR)) {
            *v_p = a;
            return DUET_OK;
        }
        return jj_eval(r, e->b, sc, v_p);
    case JE_CMP: {
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK)
            return st;
        bool res = true;
        for (size_t i = 0; i < e->n_args && res; i++) {
            if ((st = jj_eval(r, e->args[i], sc, &b)) != DUET_OK)
                return st;
            int c = 0;
            switch ((jcmp_t)e->ops[i]) {
            case JCMP_EQ:
                res = jj_equal(a, b, 0);
                break;
            case JCMP_NE:
                res = !jj_equal(a, b, 0);
                break;
            case JCMP_IN:
            case JCMP_NOTIN:
                if ((st = jj_contains(r, e->off, a, b, &res)) != DUET_OK)
                    return st;
                if (e->ops[i] == JCMP_NOTIN)
                    res = !res;
                break;
            default:
                if ((st = jj_compare(r, e->off, a, b, &c)) != DUET_OK)
                    return st;
                res = e->ops[i] == JCMP_LT   ? c < 0
                      : e->ops[i] == JCMP_GT ? c > 0
                      : e->ops[i] == JCMP_LE ? c <= 0
                                             : c >= 0;
            }
            a = b;
        }
        *v_p = jj_bool(r->arena, res);
        return *v_p != NULL ? DUET_OK : jj_nomem(r, e->off);
    }
    case JE_COND:
        if ((st = jj_eval(r, e->a, sc, &a)) != DUET_OK)
            return st;
        if (jj_truthy(a))
            return jj_eval(r, e->b, sc, v_p);
        if (e->c == NULL) {
            *v_p = &jj_undef_value;
            return DUET_OK;
        }
        return jj_eval(r, e->c, sc, v_p);
    case JE_LIST:
    case JE_TUPLE:
    case JE_DICT:
        return jj_eval_container(r, e, sc, v_p);
    case JE_CONCAT: {
        jj_sb_t sb;
        jj_sb_init(&sb, r->arena, r->lim.max_output);
        for (size_t i = 0; i < e->n_args; i++)
            if ((st = jj_eval(r, e->args[i], sc, &a)) != DUET_OK ||
                (st = jj_to_str(r, e->off, a, &sb)) != DUET_OK)
                return st;
        *v_p = jj_sb_finish(&sb);
        return *v_p != NULL ? DUET_OK : jj_nomem(r, e->off);
    }
    }
    return JJ_RERR(r, DUET_ERR_INTERNAL, e->off, "bad expression node");
}

/* ---------------------------------------------------------------- statements */

/* Bind for/set targets to `v` (unpacking when the target is a tuple). */
static duet_status_t jj_assign(jj_render_t *r, const jj_node_t *n, jj_scope_t *sc,
                               duet_jinja_value_t *v)
{
    if (!n->tuple_target)
        return jj_set_var(r, sc, n->names[0], n->name_lens[0], v);
    duet_jinja_value_t *items = NULL;
    duet_status_t st = jj_iterate(r, n->off, v, &items);
    if (st != DUET_OK)
        return st;
    if (items->n != n->n_names)
        return JJ_RERR(r, DUET_ERR_INVALID, n->off, "%s values to unpack (expected %zu, got %zu)",
                       items->n < n->n_names ? "not enough" : "too many", n->n_names, items->n);
    for (size_t i = 0; i < n->n_names && st == DUET_OK; i++)
        st = jj_set_var(r, sc, n->names[i], n->name_lens[i], items->items[i]);
    return st;
}

/* Render `body` into a string of its own (macro, block set, filter block). */
static duet_status_t jj_capture(jj_render_t *r, const jj_body_t *body, jj_scope_t *sc, size_t off,
                                duet_jinja_value_t **v_p)
{
    jj_sb_t sb, *saved = r->out;
    jj_sb_init(&sb, r->arena, r->lim.max_output);
    r->out = &sb;
    duet_status_t st = jj_run(r, body, sc);
    r->out = saved;
    if (st != DUET_OK)
        return st;
    *v_p = jj_sb_finish(&sb);
    if (*v_p == NULL)
        return sb.st == DUET_ERR_RANGE
                   ? JJ_RERR(r, DUET_ERR_RANGE, off, "output longer than the limit (%zu bytes)",
                             r->lim.max_output)
                   : jj_nomem(r, off);
    return DUET_OK;
}

duet_status_t jj_call_macro(jj_render_t *r, size_t off, duet_jinja_value_t *m, const jj_args_t *a,
                            duet_jinja_value_t **out)
{
    const jj_node_t *n = m->node;
    const char *what = n->kind == JN_MACRO ? "macro" : "caller";
    if (r->call_depth >= (int)r->lim.max_call_depth)
        return JJ_RERR(r, DUET_ERR_RANGE, off, "macro calls nested deeper than %zu",
                       r->lim.max_call_depth);
    duet_status_t st = jj_tick(r, off);
    if (st != DUET_OK)
        return st;
    if (a->n_pos > n->n_names)
        return JJ_RERR(r, DUET_ERR_INVALID, off, "%s '%.*s' takes not more than %zu argument(s)",
                       what, (int)n->attr_len, n->attr != NULL ? n->attr : "", n->n_names);
    jj_scope_t *sc = jj_scope_new(r, m->closure);
    if (sc == NULL)
        return jj_nomem(r, off);
    for (size_t k = 0; k < a->n_kw; k++) {
        bool known = false;
        for (size_t i = 0; i < n->n_names && !known; i++)
            known = n->name_lens[i] == a->kwlens[k] &&
                    memcmp(n->names[i], a->kwnames[k], a->kwlens[k]) == 0;
        if (!known)
            return JJ_RERR(r, DUET_ERR_INVALID, off, "%s takes no keyword argument '%.*s'", what,
                           (int)a->kwlens[k], a->kwnames[k]);
    }
    for (size_t i = 0; i < n->n_names; i++) {
        duet_jinja_value_t *v = i < a->n_pos ? a->pos[i] : NULL;
        for (size_t k = 0; k < a->n_kw; k++)
            if (n->name_lens[i] == a->kwlens[k] &&
                memcmp(n->names[i], a->kwnames[k], a->kwlens[k]) == 0) {
                if (v != NULL)
                    return JJ_RERR(r, DUET_ERR_INVALID, off,
                                   "%s got multiple values for argument '%.*s'", what,
                                   (int)a->kwlens[k], a->kwnames[k]);
                v = a->kw[k];
            }
        if (v == NULL && n->defaults != NULL && n->defaults[i] != NULL &&
            (st = jj_eval(r, n->defaults[i], sc, &v)) != DUET_OK)
            return st;
        if ((st = jj_set_var(r, sc, n->names[i], n->name_lens[i],
                             v != NULL ? v : &jj_undef_value)) != DUET_OK)
            return st;
    }
    if (m->caller != NULL && (st = jj_set_var(r, sc, "caller", 6, m->caller)) != DUET_OK)
        return st;
    r->call_depth++;
    st = jj_capture(r, &n->body, sc, off, out);
    r->call_depth--;
    return st;
}

static duet_status_t jj_run_for(jj_render_t *r, const jj_node_t *n, jj_scope_t *sc)
{
    duet_jinja_value_t *it = NULL, *items = NULL;
    duet_status_t st = jj_eval(r, n->expr, sc, &it);
    if (st == DUET_OK)
        st = jj_iterate(r, n->off, it, &items);
    if (st != DUET_OK)
        return st;
    if (n->cond != NULL) { /* `for x in y if c`: the loop sees only the items that pass */
        duet_jinja_value_t *kept = jj_new(r->arena, JV_LIST);
        if (kept == NULL)
            return jj_nomem(r, n->off);
        for (size_t i = 0; i < items->n; i++) {
            jj_scope_t *fs = jj_scope_new(r, sc);
            duet_jinja_value_t *c = NULL;
            if (fs == NULL)
                return jj_nomem(r, n->off);
            if ((st = jj_tick(r, n->off)) != DUET_OK ||
                (st = jj_assign(r, n, fs, items->items[i])) != DUET_OK ||
                (st = jj_eval(r, n->cond, fs, &c)) != DUET_OK)
                return st;
            if (jj_truthy(c) && jj_push(r->arena, kept, items->items[i]) != DUET_OK)
                return jj_nomem(r, n->off);
        }
        items = kept;
    }
    if (items->n == 0) {
        jj_scope_t *es = jj_scope_new(r, sc);
        return es != NULL ? jj_run(r, &n->els, es) : jj_nomem(r, n->off);
    }
    for (size_t i = 0; i < items->n; i++) {
        if ((st = jj_tick(r, n->off)) != DUET_OK)
            return st;
        jj_scope_t *is = jj_scope_new(r, sc);
        duet_jinja_value_t *loop = jj_new(r->arena, JV_LOOP);
        if (is == NULL || loop == NULL)
            return jj_nomem(r, n->off);
        loop->self = items;
        loop->i = (int64_t)i;
        loop->depth = 0; /* loop.depth counts recursive loops only, which duet refuses */
        if ((st = jj_set_var(r, is, "loop", 4, loop)) != DUET_OK ||
            (st = jj_assign(r, n, is, items->items[i])) != DUET_OK ||
            (st = jj_run(r, &n->body, is)) != DUET_OK)
            return st;
        if (r->loop_ctl != 0) {
            bool brk = r->loop_ctl == 1;
            r->loop_ctl = 0;
            if (brk)
                break;
        }
    }
    return DUET_OK;
}

static duet_status_t jj_emit(jj_render_t *r, size_t off, duet_jinja_value_t *v)
{
    duet_status_t st = jj_to_str(r, off, v, r->out);
    if (st == DUET_OK && r->out->st != DUET_OK)
        st = r->out->st == DUET_ERR_RANGE
                 ? JJ_RERR(r, DUET_ERR_RANGE, off, "output longer than the limit (%zu bytes)",
                           r->lim.max_output)
                 : jj_nomem(r, off);
    return st;
}

static duet_status_t jj_run(jj_render_t *r, const jj_body_t *body, jj_scope_t *sc)
{
    duet_status_t st = DUET_OK;
    for (size_t i = 0; i < body->n && st == DUET_OK && r->loop_ctl == 0; i++) {
        const jj_node_t *n = body->nodes[i];
        duet_jinja_value_t *v = NULL;
        switch (n->kind) {
        case JN_TEXT:
            jj_sb_put(r->out, n->text, n->len, DUET_JINJA_ORIGIN_TEMPLATE);
            if (r->out->st != DUET_OK)
                st = r->out->st == DUET_ERR_RANGE
                         ? JJ_RERR(r, DUET_ERR_RANGE, n->off,
                                   "output longer than the limit (%zu bytes)", r->lim.max_output)
                         : jj_nomem(r, n->off);
            break;
        case JN_OUTPUT:
            if ((st = jj_eval(r, n->expr, sc, &v)) == DUET_OK)
                st = jj_emit(r, n->off, v);
            break;
        case JN_IF: {
            const jj_body_t *chosen = &n->els;
            for (size_t k = 0; k < n->n_conds && st == DUET_OK; k++)
                if ((st = jj_eval(r, n->conds[k], sc, &v)) == DUET_OK && jj_truthy(v)) {
                    chosen = &n->bodies[k];
                    break;
                }
            if (st == DUET_OK)
                st = jj_run(r, chosen, sc);
            break;
        }
        case JN_FOR:
            st = jj_run_for(r, n, sc);
            break;
        case JN_SET:
            if ((st = jj_eval(r, n->expr, sc, &v)) == DUET_OK)
                st = jj_assign(r, n, sc, v);
            break;
        case JN_SET_ATTR: {
            duet_jinja_value_t *ns = jj_lookup(r, sc, n->names[0], n->name_lens[0]);
            if (ns->kind != JV_NS) {
                st = JJ_RERR(r, DUET_ERR_INVALID, n->off,
                             "cannot assign attribute on non-namespace object");
                break;
            }
            duet_jinja_value_t *k =
                jj_str(r->arena, n->attr, n->attr_len, DUET_JINJA_ORIGIN_TEMPLATE);
            if (k == NULL) {
                st = jj_nomem(r, n->off);
                break;
            }
            if ((st = jj_eval(r, n->expr, sc, &v)) == DUET_OK &&
                jj_dict_set(r->arena, ns, k, v) != DUET_OK)
                st = jj_nomem(r, n->off);
            break;
        }
        case JN_SET_BLOCK:
        case JN_FILTER_BLOCK: {
            jj_scope_t *bs = n->kind == JN_FILTER_BLOCK ? jj_scope_new(r, sc) : sc;
            if (bs == NULL) {
                st = jj_nomem(r, n->off);
                break;
            }
            if ((st = jj_capture(r, &n->body, bs, n->off, &v)) != DUET_OK)
                break;
            if (n->expr != NULL) {
                jj_scope_t *hs = jj_scope_new(r, sc);
                if (hs == NULL || jj_set_var(r, hs, "\x01hole", 5, v) != DUET_OK) {
                    st = jj_nomem(r, n->off);
                    break;
                }
                if ((st = jj_eval(r, n->expr, hs, &v)) != DUET_OK)
                    break;
            }
            st = n->kind == JN_SET_BLOCK ? jj_set_var(r, sc, n->names[0], n->name_lens[0], v)
                                         : jj_emit(r, n->off, v);
            break;
        }
        case JN_MACRO:
            v = jj_new(r->arena, JV_MACRO);
            if (v == NULL) {
                st = jj_nomem(r, n->off);
                break;
            }
            v->node = n;
            v->closure = sc;
            st = jj_set_var(r, sc, n->attr, n->attr_len, v);
            break;
        case JN_CALL_BLOCK: {
            duet_jinja_value_t *caller = jj_new(r->arena, JV_MACRO);
            if (caller == NULL) {
                st = jj_nomem(r, n->off);
                break;
            }
            caller->node = n;
            caller->closure = sc;
            if ((st = jj_call(r, n->expr, sc, caller, &v)) == DUET_OK)
                st = jj_emit(r, n->off, v);
            break;
        }
        case JN_WITH: {
            jj_scope_t *ws = jj_scope_new(r, sc);
            if (ws == NULL) {
                st = jj_nomem(r, n->off);
                break;
            }
            duet_jinja_value_t **vals = jj_alloc(r->arena, (n->n_names + 1) * sizeof(*vals));
            if (vals == NULL) {
                st = jj_nomem(r, n->off);
                break;
            }
            for (size_t k = 0; k < n->n_names && st == DUET_OK; k++)
                st = jj_eval(r, n->defaults[k], sc, &vals[k]);
            for (size_t k = 0; k < n->n_names && st == DUET_OK; k++)
                st = jj_set_var(r, ws, n->names[k], n->name_lens[k], vals[k]);
            if (st == DUET_OK)
                st = jj_run(r, &n->body, ws);
            break;
        }
        case JN_BREAK:
            r->loop_ctl = 1;
            break;
        case JN_CONTINUE:
            r->loop_ctl = 2;
            break;
        case JN_BODY:
            st = jj_run(r, &n->body, sc);
            break;
        }
    }
    return st;
}

/* ---------------------------------------------------------------- API */

void duet_jinja_output_free(duet_jinja_output_t *out)
{
    if (out == NULL)
        return;
    duet_strbuf_free(&out->text);
    free(out->segs);
    memset(out, 0, sizeof(*out));
}

static duet_status_t jj_output_segment(duet_jinja_output_t *o, size_t off, size_t len, int origin)
{
    if (o->n_segs == o->cap_segs) {
        size_t cap = o->cap_segs == 0 ? 16 : o->cap_segs * 2;
        duet_jinja_segment_t *segs = realloc(o->segs, cap * sizeof(*segs));
        if (segs == NULL)
            return DUET_ERR_NOMEM;
        o->segs = segs;
        o->cap_segs = cap;
    }
    o->segs[o->n_segs++] =
        (duet_jinja_segment_t){.off = off, .len = len, .origin = (duet_jinja_origin_t)origin};
    return DUET_OK;
}

duet_status_t duet_jinja_render(const duet_jinja_t *tmpl, duet_jinja_vars_t *vars,
                                const duet_jinja_limits_t *lim, duet_jinja_output_t *out)
{
    if (tmpl == NULL || vars == NULL || out == NULL)
        return duet_error_set(DUET_ERR_INVALID, "jinja: NULL argument");
    memset(out, 0, sizeof(*out));
    duet_jinja_limits_t l = lim != NULL ? *lim : duet_jinja_limits_default;
    if (l.max_output == 0)
        l.max_output = duet_jinja_limits_default.max_output;
    if (l.max_iterations == 0)
        l.max_iterations = duet_jinja_limits_default.max_iterations;
    if (l.max_call_depth == 0)
        l.max_call_depth = duet_jinja_limits_default.max_call_depth;
    jj_render_t r = {.t = tmpl, .vars = vars, .arena = &vars->arena, .lim = l};
    jj_sb_t sb;
    jj_sb_init(&sb, r.arena, l.max_output);
    r.out = &sb;
    /* Top-level set writes a scope of its own, so a render leaves the globals unchanged. */
    jj_scope_t top = {.parent = &vars->globals};
    duet_status_t st = jj_run(&r, &tmpl->root, &top);
    if (st == DUET_OK && sb.len > 0) {
        st = duet_strbuf_append(&out->text, sb.buf, sb.len);
        for (size_t i = 0; st == DUET_OK && i < sb.len;) {
            size_t j = i;
            int o = sb.mask != NULL ? sb.mask[i] : sb.origin;
            while (j < sb.len && (sb.mask != NULL ? sb.mask[j] : sb.origin) == o)
                j++;
            st = jj_output_segment(out, i, j - i, o);
            i = j;
        }
    } else if (st == DUET_OK) {
        st = duet_strbuf_append(&out->text, "", 0);
    }
    if (st != DUET_OK) {
        if (st == DUET_ERR_NOMEM && strstr(duet_error_last(), "out of memory") == NULL)
            duet_error_set(st, "%s: out of memory while rendering", tmpl->source);
        duet_jinja_output_free(out);
    }
    return st;
}
