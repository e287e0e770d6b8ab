/*
 * response_format json_schema (docs/architecture.md, "Sampling"): a JSON Schema compiled to a
 * byte automaton whose every accepted text is a JSON value valid against the schema, and the
 * per-step vocabulary mask it gives (grammar/json_grammar.h's trie walk).
 *
 * The subset compiled (anything else is refused with an error naming the keyword and where it
 * is, never silently ignored): `type` (a name or a list), `properties` (generated in the
 * schema's order; a property not in `required` may be left out), `required`,
 * `additionalProperties` (extra properties are never generated), `items`, `minItems`,
 * `maxItems`, `enum`, `const`, `anyOf` / `oneOf` whose alternatives start with different bytes
 * (e.g. a type and null), `$ref` to "#", "#/$defs/NAME" or "#/definitions/NAME" (recursion
 * included), the boolean schema `true`, and the annotations (`title`, `description`, `default`,
 * `examples`, `$schema`, `$id`, `$comment`, `deprecated`, `readOnly`, `writeOnly`). An object
 * schema without `properties` whose additionalProperties is absent or true takes any object.
 *
 * Output limits as json_grammar.h's (whitespace, number digits, nesting); enum and const
 * values are generated in their compact form.
 */
#ifndef DUET_GRAMMAR_JSON_SCHEMA_H
#define DUET_GRAMMAR_JSON_SCHEMA_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "grammar/json_grammar.h"

#define DUET_JSCHEMA_MAX_DEPTH 16   /* open objects and arrays of the schema's own nodes */
#define DUET_JSCHEMA_MAX_NODES 4096 /* compiled nodes */
#define DUET_JSCHEMA_MAX_ALTS  64   /* properties per object, values per enum */

typedef struct duet_jschema duet_jschema_t;

typedef struct {
    uint16_t node;  /* the object or array node */
    uint8_t phase;  /* json_schema.c's P_* */
    uint8_t ws;     /* whitespace bytes in the current gap */
    uint16_t count; /* object: the last property's index + 1; array: items so far */
} duet_jschema_frame_t;

/* The automaton's state: plain data, copied freely. Zero is not valid: duet_jschema_start. */
typedef struct {
    duet_jschema_frame_t f[DUET_JSCHEMA_MAX_DEPTH];
    uint64_t cand;   /* literal matching: the candidates still matching */
    duet_json_t sub; /* a scalar or free value in progress */
    uint16_t lbase;  /* literal matching: the first candidate's index in the literal table */
    uint16_t lpos;   /* literal matching: bytes matched */
    uint8_t depth;   /* frames open */
    uint8_t in;      /* what is in progress: json_schema.c's IN_* */
    uint8_t kind;    /* IN_SUB: the value's kind (integer refuses '.', 'e', 'E') */
    uint8_t done;    /* the top-level value is complete */
} duet_jschema_state_t;

/*
 * Compile `schema` (a JSON Schema, as a JSON text of len bytes). DUET_ERR_INVALID with a detail
 * naming what is unsupported or wrong and where (a JSON pointer), DUET_ERR_NOMEM.
 */
duet_status_t duet_jschema_compile(const char *schema, size_t len, duet_jschema_t **s_p);
void duet_jschema_free(duet_jschema_t *s); /* accepts NULL */

/* The start state: nothing fed yet. */
void duet_jschema_start(const duet_jschema_t *s, duet_jschema_state_t *st);

/* Feed one byte: 1 accepted (st advanced), 0 rejected (st then unspecified: feed a copy). */
int duet_jschema_feed(const duet_jschema_t *s, duet_jschema_state_t *st, uint8_t c);

/* Feed n bytes: 1 when all were accepted. */
int duet_jschema_feed_n(const duet_jschema_t *s, duet_jschema_state_t *st, const uint8_t *p,
                        size_t n);

/* Whether the bytes fed so far are a complete value valid against the schema. */
int duet_jschema_accepting(const duet_jschema_t *s, const duet_jschema_state_t *st);

/* The mask: ok[id] = 1 for each id whose bytes st accepts entirely; returns how many. */
int64_t duet_jschema_allowed(const duet_jschema_t *s, const duet_jschema_state_t *st,
                             const duet_json_vocab_t *v, uint8_t *ok);

#endif
