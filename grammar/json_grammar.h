/*
 * Constrained decoding for response_format json_object (docs/architecture.md, "Sampling"): a
 * byte-level pushdown automaton for JSON (RFC 8259) and the per-step mask it puts on a
 * vocabulary. The automaton state is plain data of a few dozen bytes, copied freely: the mask
 * walks a byte trie of the vocabulary with copies of it, pruning a branch at its first rejected
 * byte, so a step costs O(trie nodes reachable) rather than O(vocabulary x token length); inside
 * a string the ids that are plain text come from a bitmap and only the others are walked.
 *
 * Limits that keep every accepted text finite and parseable by ordinary JSON parsers: nesting at
 * most DUET_JSON_MAX_DEPTH, at most DUET_JSON_MAX_WS whitespace bytes between two tokens and none
 * before or after the top-level value, at most 15 integer and 15 fraction digits and 2 exponent
 * digits in a number; \u escapes must pair surrogates.
 */
#ifndef DUET_GRAMMAR_JSON_GRAMMAR_H
#define DUET_GRAMMAR_JSON_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define DUET_JSON_MAX_DEPTH 32
#define DUET_JSON_MAX_WS    8

/* The automaton's state; zero is not valid, use duet_json_init. */
typedef struct {
    uint32_t stack;   /* bit d: container at depth d + 1 is an object (1) or an array (0) */
    uint8_t depth;    /* open containers */
    uint8_t mode;     /* what the next byte may be (json_grammar.c) */
    uint8_t ws;       /* whitespace bytes in the current gap */
    uint8_t key;      /* the string being read is an object key */
    uint8_t aux;      /* literal: which; number: digits so far; \u: hex digits left */
    uint8_t lit;      /* literal: bytes matched */
    uint8_t ulo, uhi; /* UTF-8: the next continuation byte's range */
    uint8_t need;     /* UTF-8 continuation bytes left */
    uint16_t u;       /* \u escape: the code unit so far */
} duet_json_t;

/* The start state: a JSON text whose top-level value must be an object when top_object. */
void duet_json_init(duet_json_t *s, int top_object);

/* Feed one byte: 1 accepted (s advanced), 0 rejected (s is then unspecified: feed a copy). */
int duet_json_feed(duet_json_t *s, uint8_t c);

/* Feed n bytes: 1 when all were accepted. */
int duet_json_feed_n(duet_json_t *s, const uint8_t *p, size_t n);

/* Whether the bytes fed so far are a complete JSON text (end of output allowed here). */
int duet_json_accepting(const duet_json_t *s);

/*
 * A vocabulary as a byte trie for the mask. Ids with no bytes or marked special are never
 * allowed by the automaton (the caller decides about end-of-sequence ids).
 */
typedef struct duet_json_vocab duet_json_vocab_t;

/*
 * Build from token_bytes(user, id, &ptr, &len) for ids [0, vocab) (0: the id has bytes;
 * nonzero: it has none) and is_special(user, id). DUET_ERR_NOMEM.
 */
duet_status_t duet_json_vocab_create(
    int64_t vocab, int (*token_bytes)(void *user, uint32_t id, const uint8_t **p, size_t *n),
    int (*is_special)(void *user, uint32_t id), void *user, duet_json_vocab_t **v_p);
void duet_json_vocab_destroy(duet_json_vocab_t *v); /* accepts NULL */
int64_t duet_json_vocab_size(const duet_json_vocab_t *v);
/* The bytes of id as the trie holds them (NULL, 0 for an id never allowed). */
const uint8_t *duet_json_vocab_bytes(const duet_json_vocab_t *v, uint32_t id, size_t *n);

/*
 * ok[id] = 1 for each id whose bytes s accepts entirely, 0 for every other id of [0, vocab).
 * Returns how many ids are allowed. 0.07 ms at most for o200k_base's 200,019 ids (measured).
 */
int64_t duet_json_allowed(const duet_json_t *s, const duet_json_vocab_t *v, uint8_t *ok);

/* Whether s is inside a string (after its opening quote, between characters). */
int duet_json_in_string(const duet_json_t *s);

/*
 * The mask for any byte automaton whose state is plain data of `size` bytes (at most
 * DUET_JSON_MAX_STATE): feed(ctx, state, byte) advances a copy and returns 1 when the byte is
 * accepted. plain_ok: the state is where a plain string text id (one inside a JSON string that
 * stays inside it) is accepted and changes nothing, so those ids are allowed from a bitmap. ok
 * and the return value as for duet_json_allowed.
 */
#define DUET_JSON_MAX_STATE 512
typedef int (*duet_json_feed_fn)(const void *ctx, void *state, uint8_t c);
int64_t duet_json_allowed_fn(const duet_json_vocab_t *v, const void *state, size_t size,
                             duet_json_feed_fn feed, const void *ctx, int plain_ok, uint8_t *ok);

#endif
