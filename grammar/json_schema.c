/*
 * JSON Schema to a byte automaton. The compiler turns each schema into a node: a concrete value
 * kind, a union keyed by the value's first byte (the JSON types all start with different bytes,
 * which is what makes `type` lists and disjoint anyOf cheap), an enum of literal texts, or a
 * reference (for $ref, resolved when a value starts). At run time objects and arrays of the
 * schema push frames; keys and enum values are matched byte by byte against their literal texts
 * (a bitmask of the candidates still in the race); scalars and free values are read by
 * json_grammar.h's automaton, whose end is noticed as its own: the byte it refuses is fed again
 * to the frame below.
 */
#include "grammar/json_schema.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    K_ANY,
    K_UNION,
    K_ENUM,
    K_OBJECT,
    K_FREE_OBJECT,
    K_ARRAY,
    K_STRING,
    K_NUMBER,
    K_INTEGER,
    K_BOOL,
    K_NULL,
    K_REF,
    K_PENDING
};
enum { C_OBJ, C_ARR, C_STR, C_NUM, C_BOOL, C_NULL, N_CLASS };
enum {
    P_OBJ_OPEN,
    P_OBJ_NEXT,
    P_OBJ_COLON,
    P_OBJ_VALUE,
    P_OBJ_AFTER,
    P_ARR_OPEN,
    P_ARR_NEXT,
    P_ARR_AFTER
};
enum { IN_NONE, IN_SUB, IN_KEY, IN_ENUM };

#define REF_HOPS  64    /* the longest $ref / union chain followed when a value starts */
#define COUNT_MAX 65535 /* array items counted (more are allowed when maxItems is absent) */

typedef struct {
    uint8_t kind;
    int32_t alt[N_CLASS]; /* K_UNION: the node for a value starting with that class's byte */
    int32_t target;       /* K_REF */
    uint32_t first, n;    /* K_OBJECT: properties [first, first + n); K_ENUM: literals */
    int32_t items;        /* K_ARRAY: the items' node */
    uint32_t min_items, max_items;
} node_t;

typedef struct {
    uint32_t lit;  /* the key's literal ("name" with its quotes) */
    int32_t node;  /* the value's */
    bool required; /* must appear */
} prop_t;

typedef struct {
    char *bytes;
    uint32_t len;
} lit_t;

struct duet_jschema {
    node_t *nodes;
    uint32_t n_nodes, cap_nodes;
    prop_t *props;
    uint32_t n_props, cap_props;
    lit_t *lits;
    uint32_t n_lits, cap_lits;
    int32_t root;
};

/* ---- the compiler ---------------------------------------------------------------------------- */

typedef struct {
    duet_jschema_t *s;
    json_t *doc;
    struct {
        const json_t *schema;
        int32_t node;
    } memo[DUET_JSCHEMA_MAX_NODES];
    uint32_t n_memo;
} cc_t;

static const char *const ANNOTATIONS[] = {"title",    "description", "default",  "examples",
                                          "$schema",  "$id",         "$comment", "deprecated",
                                          "readOnly", "writeOnly",   "$defs",    "definitions"};
static const char *const HANDLED[] = {"type",  "properties", "required", "additionalProperties",
                                      "items", "minItems",   "maxItems", "enum",
                                      "const", "anyOf",      "oneOf",    "$ref"};

static bool in_list(const char *k, const char *const *list, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(k, list[i]) == 0)
            return true;
    return false;
}
#define IN_LIST(k, a) in_list(k, a, sizeof(a) / sizeof(a[0]))

static duet_status_t bad(const char *path, const char *what)
{
    return duet_error_set(DUET_ERR_INVALID, "json_schema at %s: %s", path, what);
}

static int32_t new_node(cc_t *c, uint8_t kind)
{
    duet_jschema_t *s = c->s;
    if (s->n_nodes == DUET_JSCHEMA_MAX_NODES)
        return -2;
    if (s->n_nodes == s->cap_nodes) {
        uint32_t cap = s->cap_nodes ? s->cap_nodes * 2 : 32;
        node_t *nn = realloc(s->nodes, sizeof(*nn) * cap);
        if (nn == NULL)
            return -1;
        s->nodes = nn;
        s->cap_nodes = cap;
    }
    node_t *n = &s->nodes[s->n_nodes];
    memset(n, 0, sizeof(*n));
    n->kind = kind;
    n->items = n->target = -1;
    for (int k = 0; k < N_CLASS; k++)
        n->alt[k] = -1;
    return (int32_t)s->n_nodes++;
}

/* A literal: the compact JSON text of v. Returns its index, -1 out of memory. */
static int64_t add_lit(duet_jschema_t *s, const json_t *v)
{
    if (s->n_lits == s->cap_lits) {
        uint32_t cap = s->cap_lits ? s->cap_lits * 2 : 32;
        lit_t *nl = realloc(s->lits, sizeof(*nl) * cap);
        if (nl == NULL)
            return -1;
        s->lits = nl;
        s->cap_lits = cap;
    }
    char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY | JSON_PRESERVE_ORDER);
    if (t == NULL)
        return -1;
    s->lits[s->n_lits] = (lit_t){t, (uint32_t)strlen(t)};
    return s->n_lits++;
}

static int class_of_byte(uint8_t b)
{
    switch (b) {
    case '{':
        return C_OBJ;
    case '[':
        return C_ARR;
    case '"':
        return C_STR;
    case 't':
    case 'f':
        return C_BOOL;
    case 'n':
        return C_NULL;
    default:
        return (b == '-' || (b >= '0' && b <= '9')) ? C_NUM : -1;
    }
}

/* The classes a node's values can start with (bit per class); -1 when not known yet (a node
 * still being compiled: recursion straight through anyOf). */
static int classes(const duet_jschema_t *s, int32_t id)
{
    for (int hop = 0; hop < REF_HOPS; hop++) {
        const node_t *n = &s->nodes[id];
        switch (n->kind) {
        case K_REF:
            id = n->target;
            continue;
        case K_PENDING:
            return -1;
        case K_ANY:
            return (1 << N_CLASS) - 1;
        case K_UNION: {
            int m = 0;
            for (int k = 0; k < N_CLASS; k++)
                m |= n->alt[k] >= 0 ? 1 << k : 0;
            return m;
        }
        case K_ENUM: {
            int m = 0;
            for (uint32_t i = 0; i < n->n; i++)
                m |= 1 << class_of_byte((uint8_t)s->lits[n->first + i].bytes[0]);
            return m;
        }
        case K_OBJECT:
        case K_FREE_OBJECT:
            return 1 << C_OBJ;
        case K_ARRAY:
            return 1 << C_ARR;
        case K_STRING:
            return 1 << C_STR;
        case K_NUMBER:
        case K_INTEGER:
            return 1 << C_NUM;
        case K_BOOL:
            return 1 << C_BOOL;
        default:
            return 1 << C_NULL;
        }
    }
    return -1;
}

static duet_status_t compile(cc_t *c, const json_t *sc, const char *path, int32_t *out);

/* Nodes are reached from several places ($ref): compile each schema object once. */
static duet_status_t compile_ref(cc_t *c, const char *ref, const char *path, int32_t *out)
{
    const json_t *t = NULL;
    char where[160];
    if (strcmp(ref, "#") == 0) {
        t = c->doc;
    } else {
        const char *name = NULL, *dict = NULL;
        if (strncmp(ref, "#/$defs/", 8) == 0)
            dict = "$defs", name = ref + 8;
        else if (strncmp(ref, "#/definitions/", 14) == 0)
            dict = "definitions", name = ref + 14;
        if (name == NULL || name[0] == '\0' || strchr(name, '/') != NULL || strchr(name, '~'))
            return bad(path, "$ref must be \"#\", \"#/$defs/NAME\" or \"#/definitions/NAME\"");
        t = json_object_get(json_object_get(c->doc, dict), name);
        if (t == NULL)
            return bad(path, "$ref names a definition that is not in the schema");
    }
    for (uint32_t i = 0; i < c->n_memo; i++)
        if (c->memo[i].schema == t) {
            *out = c->memo[i].node;
            return DUET_OK;
        }
    snprintf(where, sizeof(where), "%.150s", ref);
    return compile(c, t, where, out);
}

/* Object: properties in order, required, additionalProperties. */
static duet_status_t compile_object(cc_t *c, const json_t *sc, const char *path, int32_t id)
{
    duet_jschema_t *s = c->s;
    const json_t *props = json_object_get(sc, "properties");
    const json_t *req = json_object_get(sc, "required");
    const json_t *add = json_object_get(sc, "additionalProperties");
    if (props != NULL && !json_is_object(props))
        return bad(path, "properties must be an object");
    if (req != NULL && !json_is_array(req))
        return bad(path, "required must be an array of property names");
    if (add != NULL && !json_is_boolean(add) && !json_is_object(add))
        return bad(path, "additionalProperties must be a boolean or a schema");
    size_t n = props != NULL ? json_object_size(props) : 0;
    if (n == 0) {
        if (req != NULL && json_array_size(req) > 0)
            return bad(path, "required names properties that properties does not define");
        s->nodes[id].kind = (add == NULL || json_is_true(add)) ? K_FREE_OBJECT : K_OBJECT;
        return DUET_OK;
    }
    if (n > DUET_JSCHEMA_MAX_ALTS)
        return bad(path, "more than 64 properties in one object");
    for (size_t i = 0; i < json_array_size(req); i++) {
        const json_t *r = json_array_get(req, i);
        if (!json_is_string(r) || json_object_get(props, json_string_value(r)) == NULL)
            return bad(path, "required names a property that properties does not define");
    }
    /* the keys' literals are consecutive (matched as one candidate set), the props too */
    uint32_t prop0 = s->n_props;
    if (s->cap_props < s->n_props + n) {
        uint32_t cap = (uint32_t)(s->n_props + n) * 2;
        prop_t *np = realloc(s->props, sizeof(*np) * cap);
        if (np == NULL)
            return DUET_ERR_NOMEM;
        s->props = np;
        s->cap_props = cap;
    }
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)props, key, v)
    {
        json_t *k = json_string(key);
        int64_t li = k != NULL ? add_lit(s, k) : -1;
        json_decref(k);
        if (li < 0)
            return DUET_ERR_NOMEM;
        bool required = false;
        for (size_t i = 0; i < json_array_size(req); i++)
            required |= strcmp(json_string_value(json_array_get(req, i)), key) == 0;
        s->props[s->n_props++] = (prop_t){(uint32_t)li, -1, required};
    }
    s->nodes[id].kind = K_OBJECT;
    s->nodes[id].first = prop0;
    s->nodes[id].n = (uint32_t)n;
    uint32_t i = 0;
    json_object_foreach((json_t *)props, key, v)
    {
        char sub[256];
        snprintf(sub, sizeof(sub), "%.120s/properties/%.120s", path, key);
        int32_t vn = -1;
        duet_status_t st = compile(c, v, sub, &vn);
        if (st != DUET_OK)
            return st;
        c->s->props[prop0 + i++].node = vn;
    }
    return DUET_OK;
}

static duet_status_t compile_array(cc_t *c, const json_t *sc, const char *path, int32_t id)
{
    const json_t *items = json_object_get(sc, "items");
    const json_t *mn = json_object_get(sc, "minItems"), *mx = json_object_get(sc, "maxItems");
    if ((mn != NULL && (!json_is_integer(mn) || json_integer_value(mn) < 0)) ||
        (mx != NULL && (!json_is_integer(mx) || json_integer_value(mx) < 0)))
        return bad(path, "minItems and maxItems must be non-negative integers");
    int64_t lo = mn ? json_integer_value(mn) : 0, hi = mx ? json_integer_value(mx) : -1;
    if (lo > COUNT_MAX)
        return bad(path, "minItems above 65535 is not supported");
    if (hi >= 0 && hi < lo)
        return bad(path, "maxItems is below minItems: no array is valid");
    if (json_is_false(items))
        hi = 0;
    if (hi == 0 && lo > 0)
        return bad(path, "items is false but minItems is above 0: no array is valid");
    c->s->nodes[id].kind = K_ARRAY;
    c->s->nodes[id].min_items = (uint32_t)lo;
    c->s->nodes[id].max_items = hi < 0 || hi > COUNT_MAX ? UINT32_MAX : (uint32_t)hi;
    if (items != NULL && !json_is_boolean(items) && !json_is_object(items))
        return bad(path, "items must be a schema (tuple items are not supported)");
    int32_t in = -1;
    char sub[200];
    snprintf(sub, sizeof(sub), "%.180s/items", path);
    duet_status_t st = items != NULL && json_is_object(items) ? compile(c, items, sub, &in)
                                                              : compile(c, json_true(), sub, &in);
    c->s->nodes[id].items = in;
    return st;
}

static int type_bit(const char *t)
{
    static const char *const names[] = {"object",  "array",   "string", "number",
                                        "integer", "boolean", "null"};
    for (int i = 0; i < 7; i++)
        if (strcmp(t, names[i]) == 0)
            return 1 << i;
    return 0;
}
enum { T_OBJ = 1, T_ARR = 2, T_STR = 4, T_NUM = 8, T_INT = 16, T_BOOL = 32, T_NULL = 64 };

/* Whether JSON value v is of a type in the mask. */
static bool of_types(const json_t *v, int types)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return types & T_OBJ;
    case JSON_ARRAY:
        return types & T_ARR;
    case JSON_STRING:
        return types & T_STR;
    case JSON_INTEGER:
        return types & (T_NUM | T_INT);
    case JSON_REAL:
        return types & T_NUM;
    case JSON_TRUE:
    case JSON_FALSE:
        return types & T_BOOL;
    default:
        return types & T_NULL;
    }
}

/* anyOf / oneOf: alternatives that start with different bytes, merged into one union. */
static duet_status_t compile_union(cc_t *c, const json_t *alts, const char *kw, const char *path,
                                   int32_t id)
{
    if (!json_is_array(alts) || json_array_size(alts) == 0)
        return bad(path, "anyOf / oneOf must be a non-empty array of schemas");
    int32_t alt[N_CLASS];
    for (int k = 0; k < N_CLASS; k++)
        alt[k] = -1;
    for (size_t i = 0; i < json_array_size(alts); i++) {
        char sub[200];
        snprintf(sub, sizeof(sub), "%.160s/%s/%zu", path, kw, i);
        int32_t an = -1;
        duet_status_t st = compile(c, json_array_get(alts, i), sub, &an);
        if (st != DUET_OK)
            return st;
        int m = classes(c->s, an);
        if (m < 0)
            return bad(sub, "an alternative that refers back to its own anyOf / oneOf is not "
                            "supported");
        for (int k = 0; k < N_CLASS; k++) {
            if (!(m & (1 << k)))
                continue;
            if (alt[k] >= 0)
                return bad(path, "alternatives whose values can start alike (two of one JSON "
                                 "type, or one without a type) are not supported");
            alt[k] = an;
        }
    }
    c->s->nodes[id].kind = K_UNION;
    memcpy(c->s->nodes[id].alt, alt, sizeof(alt));
    return DUET_OK;
}

static duet_status_t compile_enum(cc_t *c, const json_t *vals, int types, const char *path,
                                  int32_t id)
{
    duet_jschema_t *s = c->s;
    uint32_t first = s->n_lits, n = 0;
    for (size_t i = 0; i < json_array_size(vals); i++) {
        const json_t *v = json_array_get(vals, i);
        if (!of_types(v, types))
            continue; /* invalid against the schema's type: never generated */
        if (n == DUET_JSCHEMA_MAX_ALTS)
            return bad(path, "more than 64 enum values");
        if (add_lit(s, v) < 0)
            return DUET_ERR_NOMEM;
        n++;
    }
    if (n == 0)
        return bad(path, "no enum / const value is valid against the schema");
    s->nodes[id].kind = K_ENUM;
    s->nodes[id].first = first;
    s->nodes[id].n = n;
    return DUET_OK;
}

static duet_status_t compile(cc_t *c, const json_t *sc, const char *path, int32_t *out)
{
    if (json_is_true(sc)) {
        int32_t id = new_node(c, K_ANY);
        if (id < 0)
            return id == -1 ? DUET_ERR_NOMEM : bad(path, "the schema has too many nodes");
        *out = id;
        return DUET_OK;
    }
    if (json_is_false(sc))
        return bad(path, "the schema false accepts no value");
    if (!json_is_object(sc))
        return bad(path, "a schema must be an object or a boolean");
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)sc, key, v)
    {
        if (!IN_LIST(key, ANNOTATIONS) && !IN_LIST(key, HANDLED)) {
            char msg[200];
            snprintf(msg, sizeof(msg), "keyword '%.100s' is not supported", key);
            return bad(path, msg);
        }
    }
    const json_t *ref = json_object_get(sc, "$ref");
    const json_t *any = json_object_get(sc, "anyOf"), *one = json_object_get(sc, "oneOf");
    size_t n_handled = 0;
    json_object_foreach((json_t *)sc, key, v) n_handled += IN_LIST(key, HANDLED);
    if ((ref != NULL || any != NULL || one != NULL) && n_handled > 1)
        return bad(path, "$ref, anyOf and oneOf are supported only with annotations beside them");
    if (ref != NULL && !json_is_string(ref))
        return bad(path, "$ref must be a string");

    int32_t id = new_node(c, K_PENDING);
    if (id < 0)
        return id == -1 ? DUET_ERR_NOMEM : bad(path, "the schema has too many nodes");
    if (c->n_memo < DUET_JSCHEMA_MAX_NODES)
        c->memo[c->n_memo++].schema = sc, c->memo[c->n_memo - 1].node = id;
    *out = id;
    if (ref != NULL) {
        int32_t t = -1;
        duet_status_t st = compile_ref(c, json_string_value(ref), path, &t);
        c->s->nodes[id].kind = K_REF;
        c->s->nodes[id].target = t;
        return st;
    }
    if (any != NULL || one != NULL)
        return compile_union(c, any != NULL ? any : one, any != NULL ? "anyOf" : "oneOf", path, id);

    const json_t *type = json_object_get(sc, "type");
    int types = 0;
    if (json_is_string(type)) {
        types = type_bit(json_string_value(type));
    } else if (json_is_array(type) && json_array_size(type) > 0) {
        for (size_t i = 0; i < json_array_size(type); i++) {
            const json_t *t = json_array_get(type, i);
            int b = json_is_string(t) ? type_bit(json_string_value(t)) : 0;
            if (b == 0) {
                types = 0;
                break;
            }
            types |= b;
        }
    } else if (type == NULL) {
        types = T_OBJ | T_ARR | T_STR | T_NUM | T_BOOL | T_NULL;
        if (json_object_get(sc, "properties") || json_object_get(sc, "required") ||
            json_object_get(sc, "additionalProperties"))
            types = T_OBJ;
        else if (json_object_get(sc, "items") || json_object_get(sc, "minItems") ||
                 json_object_get(sc, "maxItems"))
            types = T_ARR;
    }
    if (types == 0)
        return bad(path, "type must be one of object, array, string, number, integer, boolean, "
                         "null, or a non-empty list of them");
    if (types & T_NUM)
        types &= ~T_INT;

    const json_t *en = json_object_get(sc, "enum"), *cn = json_object_get(sc, "const");
    if (en != NULL || cn != NULL) {
        if (en != NULL && cn != NULL)
            return bad(path, "enum and const together are not supported");
        if (en != NULL && !json_is_array(en))
            return bad(path, "enum must be an array");
        json_t *one_val = cn != NULL ? json_pack("[O]", cn) : NULL;
        duet_status_t st = (cn != NULL && one_val == NULL)
                               ? DUET_ERR_NOMEM
                               : compile_enum(c, cn != NULL ? one_val : en, types, path, id);
        json_decref(one_val);
        return st;
    }
    if (type == NULL && types == (T_OBJ | T_ARR | T_STR | T_NUM | T_BOOL | T_NULL)) {
        c->s->nodes[id].kind = K_ANY;
        return DUET_OK;
    }
    /* one node per type; a union of them when there are several */
    static const uint8_t kind_of[7] = {K_OBJECT,  K_ARRAY, K_STRING, K_NUMBER,
                                       K_INTEGER, K_BOOL,  K_NULL};
    static const int class_of[7] = {C_OBJ, C_ARR, C_STR, C_NUM, C_NUM, C_BOOL, C_NULL};
    int32_t alt[N_CLASS];
    int n_types = 0;
    for (int k = 0; k < N_CLASS; k++)
        alt[k] = -1;
    for (int t = 0; t < 7; t++) {
        if (!(types & (1 << t)))
            continue;
        int32_t tn = n_types == 0 && __builtin_popcount((unsigned)types) == 1 ? id : new_node(c, 0);
        if (tn < 0)
            return tn == -1 ? DUET_ERR_NOMEM : bad(path, "the schema has too many nodes");
        c->s->nodes[tn].kind = kind_of[t];
        duet_status_t st = DUET_OK;
        if (t == 0)
            st = compile_object(c, sc, path, tn);
        else if (t == 1)
            st = compile_array(c, sc, path, tn);
        if (st != DUET_OK)
            return st;
        alt[class_of[t]] = tn;
        n_types++;
    }
    if (n_types > 1) {
        c->s->nodes[id].kind = K_UNION;
        memcpy(c->s->nodes[id].alt, alt, sizeof(alt));
    }
    return DUET_OK;
}

void duet_jschema_free(duet_jschema_t *s)
{
    if (s == NULL)
        return;
    for (uint32_t i = 0; i < s->n_lits; i++)
        free(s->lits[i].bytes);
    free(s->lits);
    free(s->props);
    free(s->nodes);
    free(s);
}

duet_status_t duet_jschema_compile(const char *schema, size_t len, duet_jschema_t **s_p)
{
    json_error_t jerr;
    json_t *doc = json_loadb(schema, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (doc == NULL)
        return duet_error_set(DUET_ERR_INVALID, "json_schema: invalid JSON at %d:%d: %s", jerr.line,
                              jerr.column, jerr.text);
    cc_t *c = calloc(1, sizeof(*c));
    duet_jschema_t *s = calloc(1, sizeof(*s));
    duet_status_t st = DUET_ERR_NOMEM;
    if (c != NULL && s != NULL) {
        c->s = s;
        c->doc = doc;
        st = compile(c, doc, "#", &s->root);
    }
    /* every reference chain must reach a value: a cycle of bare $refs has none */
    for (uint32_t i = 0; st == DUET_OK && i < s->n_nodes; i++)
        if (classes(s, (int32_t)i) < 0)
            st = duet_error_set(DUET_ERR_INVALID,
                                "json_schema: a $ref chain that never reaches a schema");
    free(c);
    json_decref(doc);
    if (st != DUET_OK) {
        if (st == DUET_ERR_NOMEM)
            duet_error_set(DUET_ERR_NOMEM, "json_schema: out of memory");
        duet_jschema_free(s);
        return st;
    }
    *s_p = s;
    return DUET_OK;
}

/* ---- the automaton --------------------------------------------------------------------------- */

void duet_jschema_start(const duet_jschema_t *s, duet_jschema_state_t *st)
{
    (void)s;
    memset(st, 0, sizeof(*st));
}

static int is_ws(uint8_t c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static int gap_ws(duet_jschema_frame_t *f)
{
    if (f->ws >= DUET_JSON_MAX_WS)
        return 0;
    f->ws++;
    return 1;
}

static void value_done(duet_jschema_state_t *st)
{
    st->in = IN_NONE;
    if (st->depth == 0) {
        st->done = 1;
        return;
    }
    duet_jschema_frame_t *f = &st->f[st->depth - 1];
    f->ws = 0;
    if (f->phase == P_OBJ_VALUE) {
        f->phase = P_OBJ_AFTER;
    } else {
        if (f->count < COUNT_MAX)
            f->count++;
        f->phase = P_ARR_AFTER;
    }
}

/* Candidate literals [base, base + 64) still matching after lpos bytes. */
static int lit_complete(const duet_jschema_t *s, const duet_jschema_state_t *st, int *which)
{
    for (uint64_t m = st->cand; m != 0; m &= m - 1) {
        int i = __builtin_ctzll(m);
        if (s->lits[st->lbase + i].len == st->lpos) {
            if (which != NULL)
                *which = i;
            return 1;
        }
    }
    return 0;
}

static int lit_longer(const duet_jschema_t *s, const duet_jschema_state_t *st)
{
    for (uint64_t m = st->cand; m != 0; m &= m - 1)
        if (s->lits[st->lbase + __builtin_ctzll(m)].len > st->lpos)
            return 1;
    return 0;
}

/* A literal match ended on candidate i: a key goes on to its colon, an enum value is done. */
static void lit_end(const duet_jschema_t *s, duet_jschema_state_t *st, int i)
{
    if (st->in == IN_KEY) {
        duet_jschema_frame_t *f = &st->f[st->depth - 1];
        f->count = (uint16_t)(i + 1); /* the keys' literals are the properties' order */
        f->phase = P_OBJ_COLON;
        f->ws = 0;
        st->in = IN_NONE;
    } else {
        value_done(st);
    }
}

/* Start matching the candidates `cand` of the literals from `base` with byte c. */
static int lit_start(const duet_jschema_t *s, duet_jschema_state_t *st, uint8_t in, uint32_t base,
                     uint64_t cand, uint8_t c)
{
    uint64_t keep = 0;
    for (uint64_t m = cand; m != 0; m &= m - 1) {
        int i = __builtin_ctzll(m);
        if ((uint8_t)s->lits[base + i].bytes[0] == c)
            keep |= 1ull << i;
    }
    if (keep == 0)
        return 0;
    st->in = in;
    st->lbase = (uint16_t)base;
    st->cand = keep;
    st->lpos = 1;
    int which;
    if (!lit_longer(s, st) && lit_complete(s, st, &which))
        lit_end(s, st, which);
    return 1;
}

/* The keys allowed after property count - 1: each later one up to the first required. */
static uint64_t next_keys(const duet_jschema_t *s, const node_t *n, uint32_t count)
{
    uint64_t m = 0;
    for (uint32_t j = count; j < n->n; j++) {
        m |= 1ull << j;
        if (s->props[n->first + j].required)
            break;
    }
    return m;
}

static int all_optional_from(const duet_jschema_t *s, const node_t *n, uint32_t count)
{
    for (uint32_t j = count; j < n->n; j++)
        if (s->props[n->first + j].required)
            return 0;
    return 1;
}

static int push(duet_jschema_state_t *st, int32_t node, uint8_t phase)
{
    if (st->depth == DUET_JSCHEMA_MAX_DEPTH)
        return 0;
    st->f[st->depth++] = (duet_jschema_frame_t){(uint16_t)node, phase, 0, 0};
    st->in = IN_NONE;
    return 1;
}

/* A value of node id starts with byte c. */
static int value_start(const duet_jschema_t *s, duet_jschema_state_t *st, int32_t id, uint8_t c)
{
    int cls = class_of_byte(c);
    for (int hop = 0; hop < REF_HOPS; hop++) {
        const node_t *n = &s->nodes[id];
        if (n->kind == K_REF) {
            id = n->target;
            continue;
        }
        if (n->kind == K_UNION) {
            if (cls < 0 || n->alt[cls] < 0)
                return 0;
            id = n->alt[cls];
            continue;
        }
        switch (n->kind) {
        case K_ENUM: {
            uint64_t all = n->n == 64 ? ~0ull : (1ull << n->n) - 1;
            return lit_start(s, st, IN_ENUM, n->first, all, c);
        }
        case K_OBJECT:
            return c == '{' && push(st, id, P_OBJ_OPEN);
        case K_ARRAY:
            return c == '[' && push(st, id, P_ARR_OPEN);
        case K_FREE_OBJECT:
        case K_ANY:
        case K_STRING:
        case K_NUMBER:
        case K_INTEGER:
        case K_BOOL:
        case K_NULL: {
            static const int want[] = {
                [K_FREE_OBJECT] = C_OBJ, [K_STRING] = C_STR, [K_NUMBER] = C_NUM,
                [K_INTEGER] = C_NUM,     [K_BOOL] = C_BOOL,  [K_NULL] = C_NULL};
            if (n->kind != K_ANY && cls != want[n->kind])
                return 0;
            duet_json_init(&st->sub, n->kind == K_FREE_OBJECT);
            if (!duet_json_feed(&st->sub, c))
                return 0;
            st->in = IN_SUB;
            st->kind = n->kind;
            return 1;
        }
        default:
            return 0;
        }
    }
    return 0;
}

int duet_jschema_feed(const duet_jschema_t *s, duet_jschema_state_t *st, uint8_t c)
{
    if (st->in == IN_SUB) {
        duet_json_t t = st->sub;
        if (!(st->kind == K_INTEGER && (c == '.' || c == 'e' || c == 'E')) &&
            duet_json_feed(&t, c)) {
            st->sub = t;
            return 1;
        }
        if (!duet_json_accepting(&st->sub))
            return 0;
        value_done(st); /* c belongs to what follows the value */
    } else if (st->in == IN_KEY || st->in == IN_ENUM) {
        uint64_t keep = 0;
        for (uint64_t m = st->cand; m != 0; m &= m - 1) {
            int i = __builtin_ctzll(m);
            const lit_t *l = &s->lits[st->lbase + i];
            if (l->len > st->lpos && (uint8_t)l->bytes[st->lpos] == c)
                keep |= 1ull << i;
        }
        if (keep != 0) {
            st->cand = keep;
            st->lpos++;
            int which;
            if (!lit_longer(s, st) && lit_complete(s, st, &which))
                lit_end(s, st, which);
            return 1;
        }
        int which;
        if (!lit_complete(s, st, &which))
            return 0;
        lit_end(s, st, which); /* an enum number ends at the byte after it */
    }
    if (st->depth == 0)
        return !st->done && value_start(s, st, s->root, c);
    duet_jschema_frame_t *f = &st->f[st->depth - 1];
    const node_t *n = &s->nodes[f->node];
    if (is_ws(c))
        return gap_ws(f);
    switch (f->phase) {
    case P_OBJ_OPEN:
    case P_OBJ_NEXT:
        if (c == '}' && f->phase == P_OBJ_OPEN && all_optional_from(s, n, 0))
            break;
        if (n->n == 0)
            return 0;
        return lit_start(s, st, IN_KEY, s->props[n->first].lit, next_keys(s, n, f->count), c);
    case P_OBJ_COLON:
        if (c != ':')
            return 0;
        f->phase = P_OBJ_VALUE;
        f->ws = 0;
        return 1;
    case P_OBJ_VALUE:
        f->ws = 0;
        return value_start(s, st, s->props[n->first + f->count - 1].node, c);
    case P_OBJ_AFTER:
        if (c == ',' && next_keys(s, n, f->count) != 0) {
            f->phase = P_OBJ_NEXT;
            f->ws = 0;
            return 1;
        }
        if (c == '}' && all_optional_from(s, n, f->count))
            break;
        return 0;
    case P_ARR_OPEN:
        if (c == ']' && n->min_items == 0)
            break;
        if (n->max_items == 0)
            return 0;
        f->ws = 0;
        return value_start(s, st, n->items, c);
    case P_ARR_NEXT:
        f->ws = 0;
        return value_start(s, st, n->items, c);
    case P_ARR_AFTER:
        if (c == ',' && f->count < n->max_items) {
            f->phase = P_ARR_NEXT;
            f->ws = 0;
            return 1;
        }
        if (c == ']' && f->count >= n->min_items)
            break;
        return 0;
    default:
        return 0;
    }
    /* the frame's container closed with c */
    st->depth--;
    value_done(st);
    return 1;
}

int duet_jschema_feed_n(const duet_jschema_t *s, duet_jschema_state_t *st, const uint8_t *p,
                        size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!duet_jschema_feed(s, st, p[i]))
            return 0;
    return 1;
}

int duet_jschema_accepting(const duet_jschema_t *s, const duet_jschema_state_t *st)
{
    if (st->depth != 0)
        return 0;
    if (st->done)
        return 1;
    if (st->in == IN_SUB)
        return duet_json_accepting(&st->sub);
    if (st->in == IN_ENUM)
        return lit_complete(s, st, NULL);
    return 0;
}

static int feed_cb(const void *ctx, void *state, uint8_t c)
{
    return duet_jschema_feed(ctx, state, c);
}

int64_t duet_jschema_allowed(const duet_jschema_t *s, const duet_jschema_state_t *st,
                             const duet_json_vocab_t *v, uint8_t *ok)
{
    int plain = st->in == IN_SUB && duet_json_in_string(&st->sub);
    return duet_json_allowed_fn(v, st, sizeof(*st), feed_cb, s, plain, ok);
}
