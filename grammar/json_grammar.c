/*
 * The JSON automaton: one mode says what the next byte may be, a bit stack says which containers
 * are open. A value's end is noticed by the byte after it for numbers (that byte is then fed
 * again in the mode the end leads to); everything else ends on its own last byte.
 */
#include "grammar/json_grammar.h"

#include <stdlib.h>
#include <string.h>

#include "common/utf8.h"

enum {
    M_VALUE,     /* a value (the top one, or after ':' or an array's ',') */
    M_TOP_OBJ,   /* the top-level value, which must be an object */
    M_ARR_FIRST, /* after '[': a value or ']' */
    M_OBJ_FIRST, /* after '{': a key or '}' */
    M_OBJ_KEY,   /* after an object's ',': a key */
    M_COLON,     /* after a key */
    M_AFTER,     /* after a value inside a container: ',' or its close */
    M_DONE,      /* the top-level value is complete */
    M_STR,       /* inside a string */
    M_ESC,       /* after '\' */
    M_HEX,       /* \u: aux hex digits left, the code unit in u */
    M_LOW_BS,    /* after a high surrogate: its '\' */
    M_LOW_U,     /* its 'u' */
    M_UTF8,      /* need continuation bytes in [ulo, uhi] next, then [0x80, 0xbf] */
    M_LIT,       /* true / false / null: aux the literal, lit bytes matched */
    M_NUM_MINUS, /* after '-' */
    M_NUM_ZERO,  /* after a leading 0 */
    M_NUM_INT,   /* integer digits (aux counts them) */
    M_NUM_DOT,   /* after '.' */
    M_NUM_FRAC,  /* fraction digits */
    M_NUM_E,     /* after e / E */
    M_NUM_ESIGN, /* after the exponent's sign */
    M_NUM_EXP,   /* exponent digits */
};

#define NUM_MAX_INT  15
#define NUM_MAX_FRAC 15
#define NUM_MAX_EXP  2

static const char *const LITS[3] = {"true", "false", "null"};

void duet_json_init(duet_json_t *s, int top_object)
{
    memset(s, 0, sizeof(*s));
    s->mode = top_object ? M_TOP_OBJ : M_VALUE;
}

static int is_ws(uint8_t c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static int is_digit(uint8_t c)
{
    return c >= '0' && c <= '9';
}

/* A value ended: the next byte is the enclosing container's. */
static void value_done(duet_json_t *s)
{
    s->mode = s->depth == 0 ? M_DONE : M_AFTER;
    s->ws = 0;
}

static int push(duet_json_t *s, int object)
{
    if (s->depth >= DUET_JSON_MAX_DEPTH)
        return 0;
    if (object)
        s->stack |= 1u << s->depth;
    else
        s->stack &= ~(1u << s->depth);
    s->depth++;
    s->mode = object ? M_OBJ_FIRST : M_ARR_FIRST;
    s->ws = 0;
    return 1;
}

static int top_is_object(const duet_json_t *s)
{
    return (s->stack >> (s->depth - 1)) & 1u;
}

/* Whitespace in a gap: counted, at most DUET_JSON_MAX_WS. */
static int gap_ws(duet_json_t *s)
{
    if (s->ws >= DUET_JSON_MAX_WS)
        return 0;
    s->ws++;
    return 1;
}

/* The first byte of a value. */
static int value_start(duet_json_t *s, uint8_t c)
{
    s->ws = 0;
    switch (c) {
    case '{':
        return push(s, 1);
    case '[':
        return push(s, 0);
    case '"':
        s->mode = M_STR;
        s->key = 0;
        return 1;
    case '-':
        s->mode = M_NUM_MINUS;
        return 1;
    case '0':
        s->mode = M_NUM_ZERO;
        return 1;
    case 't':
    case 'f':
    case 'n':
        s->mode = M_LIT;
        s->aux = c == 't' ? 0 : c == 'f' ? 1 : 2;
        s->lit = 1;
        return 1;
    default:
        if (c >= '1' && c <= '9') {
            s->mode = M_NUM_INT;
            s->aux = 1;
            return 1;
        }
        return 0;
    }
}

/* A number ended before c: close it and feed c to what follows. */
static int num_end(duet_json_t *s, uint8_t c)
{
    if (s->depth == 0)
        return 0; /* a top-level number ends only with the text */
    value_done(s);
    return duet_json_feed(s, c);
}

static int str_byte(duet_json_t *s, uint8_t c)
{
    if (c == '"') {
        if (s->key) {
            s->mode = M_COLON;
            s->ws = 0;
        } else {
            value_done(s);
        }
        return 1;
    }
    if (c == '\\') {
        s->mode = M_ESC;
        return 1;
    }
    if (c < 0x20)
        return 0;
    if (c < 0x80)
        return 1;
    /* UTF-8 lead bytes (RFC 3629: no overlongs, no surrogates, nothing past U+10FFFF) */
    s->ulo = 0x80;
    s->uhi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf)
        s->need = 1;
    else if (c >= 0xe0 && c <= 0xef) {
        s->need = 2;
        if (c == 0xe0)
            s->ulo = 0xa0;
        else if (c == 0xed)
            s->uhi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        s->need = 3;
        if (c == 0xf0)
            s->ulo = 0x90;
        else if (c == 0xf4)
            s->uhi = 0x8f;
    } else
        return 0;
    s->mode = M_UTF8;
    return 1;
}

int duet_json_feed(duet_json_t *s, uint8_t c)
{
    switch (s->mode) {
    case M_TOP_OBJ: /* no whitespace before the top-level value (nor after it) */
        return c == '{' && push(s, 1);
    case M_VALUE:
        if (is_ws(c))
            return s->depth > 0 && gap_ws(s);
        return value_start(s, c);
    case M_ARR_FIRST:
        if (is_ws(c))
            return gap_ws(s);
        if (c == ']') {
            s->depth--;
            value_done(s);
            return 1;
        }
        return value_start(s, c);
    case M_OBJ_FIRST:
    case M_OBJ_KEY:
        if (is_ws(c))
            return gap_ws(s);
        if (c == '}' && s->mode == M_OBJ_FIRST) {
            s->depth--;
            value_done(s);
            return 1;
        }
        if (c != '"')
            return 0;
        s->mode = M_STR;
        s->key = 1;
        return 1;
    case M_COLON:
        if (is_ws(c))
            return gap_ws(s);
        if (c != ':')
            return 0;
        s->mode = M_VALUE;
        s->ws = 0;
        return 1;
    case M_AFTER:
        if (is_ws(c))
            return gap_ws(s);
        if (c == ',') {
            s->mode = top_is_object(s) ? M_OBJ_KEY : M_VALUE;
            s->ws = 0;
            return 1;
        }
        if (c != (top_is_object(s) ? '}' : ']'))
            return 0;
        s->depth--;
        value_done(s);
        return 1;
    case M_DONE:
        return 0;
    case M_STR:
        return str_byte(s, c);
    case M_ESC:
        if (c == 'u') {
            s->mode = M_HEX;
            s->aux = 4;
            s->u = 0;
            return 1;
        }
        if (strchr("\"\\/bfnrt", c) == NULL || c == 0)
            return 0;
        s->mode = M_STR;
        return 1;
    case M_HEX: {
        int h = duet_hex_digit(c);
        if (h < 0)
            return 0;
        s->u = (uint16_t)(s->u << 4 | (unsigned)h);
        /* after the first two digits the surrogate kind is known: a low one is expected exactly
         * after a high one (lit = 1), and nowhere else */
        if (s->aux == 3) {
            int lead = s->u; /* the first two hex digits as a byte */
            int low = lead >= 0xdc && lead <= 0xdf;
            if (s->lit ? !low : low)
                return 0;
        }
        if (--s->aux > 0)
            return 1;
        if (s->lit) { /* the low half of a pair */
            s->lit = 0;
            s->mode = M_STR;
        } else if (s->u >= 0xd800 && s->u <= 0xdbff) {
            s->mode = M_LOW_BS;
        } else {
            s->mode = M_STR;
        }
        return 1;
    }
    case M_LOW_BS:
        if (c != '\\')
            return 0;
        s->mode = M_LOW_U;
        return 1;
    case M_LOW_U:
        if (c != 'u')
            return 0;
        s->mode = M_HEX;
        s->aux = 4;
        s->u = 0;
        s->lit = 1;
        return 1;
    case M_UTF8:
        if (c < s->ulo || c > s->uhi)
            return 0;
        s->ulo = 0x80;
        s->uhi = 0xbf;
        if (--s->need == 0)
            s->mode = M_STR;
        return 1;
    case M_LIT: {
        const char *l = LITS[s->aux];
        if ((uint8_t)l[s->lit] != c)
            return 0;
        if (l[++s->lit] == '\0') {
            s->lit = 0;
            value_done(s);
        }
        return 1;
    }
    case M_NUM_MINUS:
        if (c == '0') {
            s->mode = M_NUM_ZERO;
            return 1;
        }
        if (c >= '1' && c <= '9') {
            s->mode = M_NUM_INT;
            s->aux = 1;
            return 1;
        }
        return 0;
    case M_NUM_ZERO:
    case M_NUM_INT:
        if (is_digit(c) && s->mode == M_NUM_INT) {
            if (s->aux >= NUM_MAX_INT)
                return 0;
            s->aux++;
            return 1;
        }
        if (c == '.') {
            s->mode = M_NUM_DOT;
            s->aux = 0;
            return 1;
        }
        if (c == 'e' || c == 'E') {
            s->mode = M_NUM_E;
            s->aux = 0;
            return 1;
        }
        return !is_digit(c) && num_end(s, c);
    case M_NUM_DOT:
    case M_NUM_FRAC:
        if (is_digit(c)) {
            if (s->aux >= NUM_MAX_FRAC)
                return 0;
            s->aux++;
            s->mode = M_NUM_FRAC;
            return 1;
        }
        if (s->mode == M_NUM_DOT)
            return 0;
        if (c == 'e' || c == 'E') {
            s->mode = M_NUM_E;
            s->aux = 0;
            return 1;
        }
        return num_end(s, c);
    case M_NUM_E:
        if (c == '+' || c == '-') {
            s->mode = M_NUM_ESIGN;
            return 1;
        }
        /* fall through */
    case M_NUM_ESIGN:
        if (!is_digit(c))
            return 0;
        s->mode = M_NUM_EXP;
        s->aux = 1;
        return 1;
    case M_NUM_EXP:
        if (is_digit(c)) {
            if (s->aux >= NUM_MAX_EXP)
                return 0;
            s->aux++;
            return 1;
        }
        return num_end(s, c);
    default:
        return 0;
    }
}

int duet_json_feed_n(duet_json_t *s, const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!duet_json_feed(s, p[i]))
            return 0;
    return 1;
}

int duet_json_accepting(const duet_json_t *s)
{
    if (s->mode == M_DONE)
        return 1;
    return s->depth == 0 && (s->mode == M_NUM_ZERO || s->mode == M_NUM_INT ||
                             s->mode == M_NUM_FRAC || s->mode == M_NUM_EXP);
}

/* ---- the vocabulary trie and the mask --------------------------------------------------- */

typedef struct {
    uint32_t child;   /* first child node, 0 = none (node 0 is the root) */
    uint32_t sibling; /* next sibling, 0 = none */
    int32_t tok;      /* first id ending here, -1 = none (more in next_tok) */
    uint8_t byte;
} duet__trie_node_t;

typedef struct {
    duet__trie_node_t *nodes;
    uint32_t n_nodes, cap_nodes;
} duet__trie_t;

/*
 * Two tries: every id, and the ids that are not plain string text. Inside a string (the state
 * the mask meets most, and the costliest: nearly every id continues it) the plain ids are
 * allowed wholesale from a bitmap and only the other trie is walked.
 */
struct duet_json_vocab {
    int64_t vocab;
    duet__trie_t all, rest;
    int32_t *next_all, *next_rest; /* [vocab]: the next id ending at the same node, -1 = none */
    uint8_t *plain;                /* [vocab]: 1 = fed inside a string, leaves it as it was */
    int64_t n_plain;
    const uint8_t **bytes; /* [vocab] */
    size_t *len;           /* [vocab] */
};

static int duet__trie_init(duet__trie_t *t)
{
    t->cap_nodes = 1024;
    t->nodes = malloc(sizeof(*t->nodes) * t->cap_nodes);
    if (t->nodes == NULL)
        return 0;
    t->nodes[0] = (duet__trie_node_t){.tok = -1};
    t->n_nodes = 1;
    return 1;
}

static int64_t duet__trie_child(duet__trie_t *t, uint32_t node, uint8_t b)
{
    uint32_t c = t->nodes[node].child;
    for (; c != 0; c = t->nodes[c].sibling)
        if (t->nodes[c].byte == b)
            return c;
    if (t->n_nodes == t->cap_nodes) {
        uint32_t ncap = t->cap_nodes * 2;
        duet__trie_node_t *nn = realloc(t->nodes, sizeof(*nn) * ncap);
        if (nn == NULL)
            return -1;
        t->nodes = nn;
        t->cap_nodes = ncap;
    }
    c = t->n_nodes++;
    t->nodes[c] =
        (duet__trie_node_t){.child = 0, .sibling = t->nodes[node].child, .tok = -1, .byte = b};
    t->nodes[node].child = c;
    return c;
}

/* Add id's bytes; 0 when out of memory. */
static int duet__trie_add(duet__trie_t *t, int32_t *next, int32_t id, const uint8_t *p, size_t n)
{
    int64_t node = 0;
    for (size_t i = 0; i < n && node >= 0; i++)
        node = duet__trie_child(t, (uint32_t)node, p[i]);
    if (node < 0)
        return 0;
    next[id] = t->nodes[node].tok;
    t->nodes[node].tok = id;
    return 1;
}

/* Whether p[0..n) inside a string stays string text and ends where it began (outside a
 * multi-byte character): then it is allowed in every string state and changes none. */
static int duet__plain_text(const uint8_t *p, size_t n)
{
    duet_json_t s;
    duet_json_init(&s, 0);
    s.mode = M_STR;
    for (size_t i = 0; i < n; i++)
        if (!duet_json_feed(&s, p[i]) || (s.mode != M_STR && s.mode != M_UTF8))
            return 0;
    return s.mode == M_STR;
}

duet_status_t duet_json_vocab_create(
    int64_t vocab, int (*token_bytes)(void *user, uint32_t id, const uint8_t **p, size_t *n),
    int (*is_special)(void *user, uint32_t id), void *user, duet_json_vocab_t **v_p)
{
    duet_json_vocab_t *v = calloc(1, sizeof(*v));
    if (v == NULL || vocab <= 0 || vocab > INT32_MAX)
        goto nomem;
    v->vocab = vocab;
    v->next_all = malloc(sizeof(*v->next_all) * (size_t)vocab);
    v->next_rest = malloc(sizeof(*v->next_rest) * (size_t)vocab);
    v->plain = calloc((size_t)vocab, 1);
    v->bytes = calloc((size_t)vocab, sizeof(*v->bytes));
    v->len = calloc((size_t)vocab, sizeof(*v->len));
    if (!duet__trie_init(&v->all) || !duet__trie_init(&v->rest) || v->next_all == NULL ||
        v->next_rest == NULL || v->plain == NULL || v->bytes == NULL || v->len == NULL)
        goto nomem;
    for (int64_t id = 0; id < vocab; id++) {
        const uint8_t *p;
        size_t n;
        v->next_all[id] = v->next_rest[id] = -1;
        if (token_bytes(user, (uint32_t)id, &p, &n) != 0 || n == 0 ||
            (is_special != NULL && is_special(user, (uint32_t)id)))
            continue;
        if (!duet__trie_add(&v->all, v->next_all, (int32_t)id, p, n))
            goto nomem;
        if (duet__plain_text(p, n)) {
            v->plain[id] = 1;
            v->n_plain++;
        } else if (!duet__trie_add(&v->rest, v->next_rest, (int32_t)id, p, n)) {
            goto nomem;
        }
        v->bytes[id] = p;
        v->len[id] = n;
    }
    *v_p = v;
    return DUET_OK;
nomem:
    duet_json_vocab_destroy(v);
    return duet_error_set(DUET_ERR_NOMEM, "json grammar: out of memory for the vocabulary trie");
}

void duet_json_vocab_destroy(duet_json_vocab_t *v)
{
    if (v == NULL)
        return;
    free(v->all.nodes);
    free(v->rest.nodes);
    free(v->next_all);
    free(v->next_rest);
    free(v->plain);
    free(v->bytes);
    free(v->len);
    free(v);
}

int64_t duet_json_vocab_size(const duet_json_vocab_t *v)
{
    return v->vocab;
}

const uint8_t *duet_json_vocab_bytes(const duet_json_vocab_t *v, uint32_t id, size_t *n)
{
    if ((int64_t)id >= v->vocab) {
        *n = 0;
        return NULL;
    }
    *n = v->len[id];
    return v->bytes[id];
}

int duet_json_in_string(const duet_json_t *s)
{
    return s->mode == M_STR;
}

/* Depth-first under node with s (the state after the node's bytes): every id ending below, the
 * state copies on the stack. The recursion is as deep as the longest token. */
static int64_t duet__walk_fn(const duet__trie_t *t, const int32_t *next, uint32_t node,
                             const void *s, size_t size, duet_json_feed_fn feed, const void *ctx,
                             uint8_t *ok)
{
    int64_t n = 0;
    unsigned char u[DUET_JSON_MAX_STATE];
    for (uint32_t c = t->nodes[node].child; c != 0; c = t->nodes[c].sibling) {
        memcpy(u, s, size);
        if (!feed(ctx, u, t->nodes[c].byte))
            continue;
        for (int32_t id = t->nodes[c].tok; id >= 0; id = next[id]) {
            ok[id] = 1;
            n++;
        }
        n += duet__walk_fn(t, next, c, u, size, feed, ctx, ok);
    }
    return n;
}

int64_t duet_json_allowed_fn(const duet_json_vocab_t *v, const void *state, size_t size,
                             duet_json_feed_fn feed, const void *ctx, int plain_ok, uint8_t *ok)
{
    if (size > DUET_JSON_MAX_STATE)
        return -1;
    if (plain_ok) {
        memcpy(ok, v->plain, (size_t)v->vocab);
        return v->n_plain + duet__walk_fn(&v->rest, v->next_rest, 0, state, size, feed, ctx, ok);
    }
    memset(ok, 0, (size_t)v->vocab);
    return duet__walk_fn(&v->all, v->next_all, 0, state, size, feed, ctx, ok);
}

static int duet__json_feed_cb(const void *ctx, void *state, uint8_t c)
{
    (void)ctx;
    return duet_json_feed(state, c);
}

int64_t duet_json_allowed(const duet_json_t *s, const duet_json_vocab_t *v, uint8_t *ok)
{
    return duet_json_allowed_fn(v, s, sizeof(*s), duet__json_feed_cb, NULL, s->mode == M_STR, ok);
}
