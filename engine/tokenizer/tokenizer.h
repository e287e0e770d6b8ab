/*
 * duet tokenizer: text <-> token ids, for the router (which links this library alone) and the
 * engine.
 *
 * Two kinds share one opaque type:
 *   - byte:     id = byte value 0..255, special tokens from 256 upward (the demo model);
 *   - tiktoken: byte-level BPE from a tiktoken rank file (`base64(token_bytes) rank` per line),
 *               pre-tokenized by a split regex (PCRE2, UTF + UCP, JIT when available), then merged
 *               pair by pair, lowest rank first, exactly as OpenAI's tiktoken does.
 *
 * A tokenizer is immutable after creation, so any number of threads may encode and decode with
 * one tokenizer at once. Encoding is lossless for any bytes, valid UTF-8 or not: bytes that the
 * split regex cannot match (PCRE2_MATCH_INVALID_UTF skips ill-formed UTF-8) become pieces of their
 * own and are encoded byte-pair by byte-pair, so decode(encode(x)) == x for every x. Only the
 * split of ill-formed input is ours to define; for valid UTF-8 the ids equal tiktoken's.
 *
 * Special tokens (`<|endoftext|>`, `<|bos|>`, ...) are recognised in text only when the caller
 * passes DUET_TOKENIZER_ALLOW_SPECIAL; otherwise their text is encoded as ordinary text (what
 * tiktoken's encode_ordinary does). Decoding a special id always yields its text.
 *
 * For streaming output, duet_detok_* turns ids, one at a time, into complete UTF-8 only: bytes of a
 * character split across tokens are held until the character is complete, and ill-formed
 * sequences come out as U+FFFD (one per maximal subpart, as Unicode recommends).
 */
#ifndef DUET_ENGINE_TOKENIZER_TOKENIZER_H
#define DUET_ENGINE_TOKENIZER_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct duet_tokenizer duet_tokenizer_t;
typedef struct duet_detok duet_detok_t;

/* A special token of a tiktoken vocabulary: its text and its id (ids may leave gaps). */
typedef struct {
    const char *text; /* NUL-terminated, not owned: copied by create */
    uint32_t id;
} duet_tokenizer_special_t;

/* Flags of duet_tokenizer_encode. */
enum {
    DUET_TOKENIZER_ALLOW_SPECIAL = 1u << 0, /* recognise special-token text in the input */
};

/* Flags of duet_detok_create. */
enum {
    DUET_DETOK_SKIP_SPECIAL = 1u << 0, /* special tokens produce no text */
};

/* Largest id a tokenizer may use (ids index tables, so a rank file cannot ask for gigabytes). */
#define DUET_TOKENIZER_MAX_ID ((1u << 24) - 1)

/*
 * Byte tokenizer: ids 0..255 are the bytes, and specials[i] gets id 256 + i. `specials` may be
 * NULL when n_specials is 0; strings are copied, must be non-empty, distinct, and not longer than
 * 256 bytes. Returns DUET_ERR_INVALID for a bad special list, DUET_ERR_NOMEM.
 */
duet_status_t duet_tokenizer_create_byte(const char *const *specials, size_t n_specials,
                                         duet_tokenizer_t **tok_p);

/*
 * Tiktoken BPE from the rank file at `rank_path`.
 *   pattern:  the split regex (PCRE2 syntax); NULL = the built-in pattern for the file's name
 *             (basename without ".tiktoken", e.g. "cl100k_base"; "tokenizer.model" = "kimi").
 *   specials: special tokens with their ids; NULL (with n_specials 0) = the built-in specials of
 *             the named encoding (none for an unknown name). Pass a non-NULL pointer with
 *             n_specials 0 for "no specials at all".
 * The rank file must be well formed: every non-blank line `base64 SP decimal-rank` (CR LF is
 * accepted), strict base64 of 1..512 bytes, ranks unique and <= DUET_TOKENIZER_MAX_ID, token
 * bytes unique, lines at most 4096 bytes, and all 256 single bytes present (so that any input can
 * be encoded). Special ids must not collide with ranks. Errors (DUET_ERR_IO, DUET_ERR_FORMAT,
 * DUET_ERR_INVALID, DUET_ERR_NOT_FOUND for an unknown name without pattern, DUET_ERR_NOMEM) are
 * logged with the file name and line number.
 */
duet_status_t duet_tokenizer_create_tiktoken(const char *rank_path, const char *pattern,
                                             const duet_tokenizer_special_t *specials,
                                             size_t n_specials, duet_tokenizer_t **tok_p);

/*
 * Load a tokenizer from a path: a `*.tiktoken` file (cl100k_base.tiktoken, o200k_base.tiktoken),
 * or a model folder holding `tokenizer.model` (Kimi's tiktoken-format file, "kimi" pattern) or
 * exactly one `*.tiktoken` file. Built-in patterns and specials as in create_tiktoken.
 */
duet_status_t duet_tokenizer_load(const char *path, duet_tokenizer_t **tok_p);

/* Free a tokenizer; NULL is fine. No detokenizer made from it may be used afterwards. */
void duet_tokenizer_destroy(duet_tokenizer_t *tok);

/*
 * The built-in split regex of an encoding: "cl100k_base", "o200k_base", "r50k_base",
 * "p50k_base", "kimi". NULL for an unknown name. The string is static.
 */
const char *duet_tokenizer_pattern(const char *name);

/*
 * Encode `len` bytes of `text` (any bytes; need not be NUL-terminated) into ids.
 * Writes at most `cap` ids to ids_out (which may be NULL when cap is 0) and sets *n_p to the
 * number of ids the whole text encodes to, also when that does not fit: then it returns
 * DUET_ERR_NO_SPACE and ids_out holds the first `cap` ids, so a caller can size a buffer with
 * cap 0 and call again. Other errors: DUET_ERR_INVALID (NULL arguments), DUET_ERR_NOMEM,
 * DUET_ERR_INTERNAL (the regex engine gave up; details in duet_error_last()).
 */
duet_status_t duet_tokenizer_encode(const duet_tokenizer_t *tok, const char *text, size_t len,
                                    unsigned flags, uint32_t *ids_out, size_t cap, size_t *n_p);

/*
 * Decode `n` ids into bytes (no NUL terminator; may be ill-formed UTF-8 when the ids split a
 * character). Writes at most `cap` bytes and sets *len_p to the full length; DUET_ERR_NO_SPACE
 * when it does not fit (buf holds a prefix). An id outside the vocabulary (or a gap in it) gives
 * DUET_ERR_RANGE with the id and its position in duet_error_last(); *len_p is then not set.
 */
duet_status_t duet_tokenizer_decode(const duet_tokenizer_t *tok, const uint32_t *ids, size_t n,
                                    char *buf, size_t cap, size_t *len_p);

/*
 * The bytes of one id (a special token's text for a special id), pointing into the tokenizer:
 * valid as long as it lives. DUET_ERR_RANGE for an id that is not in the vocabulary.
 */
duet_status_t duet_tokenizer_token_bytes(const duet_tokenizer_t *tok, uint32_t id,
                                         const uint8_t **ptr_p, size_t *len_p);

/* Largest id + 1 (ordinary and special): the size of an embedding table for this vocabulary. */
uint32_t duet_tokenizer_vocab_size(const duet_tokenizer_t *tok);

/* Longest token, in bytes (ordinary or special). */
size_t duet_tokenizer_max_token_len(const duet_tokenizer_t *tok);

/* The id of a special token by its text; DUET_ERR_NOT_FOUND when there is no such special. */
duet_status_t duet_tokenizer_special_id(const duet_tokenizer_t *tok, const char *text,
                                        uint32_t *id_p);

/* Whether `id` is a special token of this tokenizer. */
bool duet_tokenizer_is_special(const duet_tokenizer_t *tok, uint32_t id);

/*
 * Streaming detokenizer over `tok` (which must outlive it). Its output buffer is allocated here,
 * once, so feeding ids never allocates. Not thread-safe: one per stream.
 */
duet_status_t duet_detok_create(const duet_tokenizer_t *tok, unsigned flags,
                                duet_detok_t **detok_p);

/* Free a detokenizer; NULL is fine. */
void duet_detok_destroy(duet_detok_t *detok);

/* Forget any held bytes and start a new stream. */
void duet_detok_reset(duet_detok_t *detok);

/*
 * Feed one id. *text_p / *len_p receive the complete UTF-8 text that this id finishes (possibly
 * empty, *len_p 0); the pointer is into the detokenizer and valid until the next call on it.
 * An incomplete trailing character is held for the next id. DUET_ERR_RANGE for an unknown id
 * (the stream state is unchanged).
 */
duet_status_t duet_detok_feed(duet_detok_t *detok, uint32_t id, const char **text_p, size_t *len_p);

/*
 * End of stream: emit what is held (an incomplete character becomes one U+FFFD) and reset.
 * Same output convention as duet_detok_feed.
 */
duet_status_t duet_detok_flush(duet_detok_t *detok, const char **text_p, size_t *len_p);

#endif
