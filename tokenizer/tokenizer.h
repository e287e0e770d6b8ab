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
 * tiktoken's encode_ordinary does). duet_tokenizer_decode always yields a special id's text; the
 * streaming detokenizer drops it under DUET_DETOK_SKIP_SPECIAL (transformers' and vLLM's
 * skip_special_tokens), except for specials marked DUET_TOKENIZER_SPECIAL_SHOWN, which
 * transformers does not count as special either (Kimi's tool-call markers, its unnamed
 * reserved ids).
 *
 * The "kimi" encoding (a model folder's tiktoken.model or tokenizer.model) is Kimi's
 * tokenization_kimi.py: its split regex (tiktoken's `&&` class intersection rewritten for PCRE2),
 * its special range (the 258 ids after the last rank, named from tokenizer_config.json or
 * `<|reserved_token_ID|>`), and its encode, which cuts the text into pieces of at most 400000
 * characters and then wherever a run of whitespace or of non-whitespace characters (Python's
 * str.isspace) grows past 25000, before special tokens are looked for and before BPE; ids equal
 * TikTokenTokenizer.encode's for any valid UTF-8 (each byte of ill-formed UTF-8 counts as one
 * non-whitespace character), with the character classes of tiktoken 0.12 (Unicode 16.0, see
 * kimi_pattern.h) on a PCRE2 whose tables are Unicode 14.0..16.0.
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
    unsigned flags; /* DUET_TOKENIZER_SPECIAL_*; 0 for an ordinary special token */
} duet_tokenizer_special_t;

/* Flags of duet_tokenizer_special_t. */
enum {
    /* decoded as text even under DUET_DETOK_SKIP_SPECIAL: an added token that transformers does
     * not count as special ("special": false in tokenizer_config.json's added_tokens_decoder) */
    DUET_TOKENIZER_SPECIAL_SHOWN = 1u << 0,
};

/* Flags of duet_tokenizer_encode. */
enum {
    DUET_TOKENIZER_ALLOW_SPECIAL = 1u << 0, /* recognise special-token text in the input */
};

/* Flags of duet_detok_create. */
enum {
    DUET_DETOK_SKIP_SPECIAL = 1u << 0, /* skipped special tokens (is_skipped) produce no text */
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
 *             (basename without ".tiktoken", e.g. "cl100k_base"; "tiktoken.model" and
 *             "tokenizer.model" = "kimi").
 *   specials: special tokens with their ids; NULL (with n_specials 0) = the built-in specials of
 *             the named encoding (none for an unknown name). Pass a non-NULL pointer with
 *             n_specials 0 for "no specials at all".
 * The rank file must be well formed: every non-blank line `base64 SP decimal-rank` (CR LF is
 * accepted), strict base64 of 1..512 bytes, ranks unique and <= DUET_TOKENIZER_MAX_ID, token
 * bytes unique, lines at most 4096 bytes, and all 256 single bytes present (so that any input can
 * be encoded). Special ids must not collide with ranks. Errors (DUET_ERR_IO, DUET_ERR_FORMAT,
 * DUET_ERR_INVALID, DUET_ERR_NOT_FOUND for an unknown name without pattern, DUET_ERR_NOMEM) are
 * logged with the file name and line number.
 *
 * The "kimi" encoding (chosen by the file's name, whatever the pattern) also brings Kimi's
 * encode (the run splitting described above) and its special range: the ranks must be exactly
 * 0..N-1, ids N..N+257 are special, `specials` may name some of them (ids outside that range are
 * refused) and every other one is `<|reserved_token_ID|>`, shown under skip_special_tokens as
 * transformers shows it.
 */
duet_status_t duet_tokenizer_create_tiktoken(const char *rank_path, const char *pattern,
                                             const duet_tokenizer_special_t *specials,
                                             size_t n_specials, duet_tokenizer_t **tok_p);

/*
 * Load a tokenizer from a path: a rank file (as duet_tokenizer_create_tiktoken with the built-in
 * pattern and specials), or a model folder, by the first of these it holds:
 *   - duet_tokenizer.json: duet's byte tokenizer, {"type": "byte", "specials": ["<|bos|>", ...],
 *     "add_bos": bool} (no other keys; specials get ids 256, 257, ...);
 *   - tiktoken.model, else tokenizer.model: Kimi's layout ("kimi" encoding). The specials come
 *     from tokenizer_config.json's added_tokens_decoder ({"ID": {"content": TEXT, "special":
 *     bool, ...}}; "special": false = DUET_TOKENIZER_SPECIAL_SHOWN), the bos / eos token texts
 *     from special_tokens_map.json, else tokenizer_config.json (`"bos_token": TEXT` or
 *     `{"content": TEXT}`, as transformers reads them; the map wins, as in transformers); both
 *     files are optional and each must name special tokens of the vocabulary;
 *   - exactly one *.tiktoken file.
 * Every file is validated and a refusal names the file and the field: malformed JSON, a wrong
 * type, an id that is not a canonical decimal, outside Kimi's special range or on a rank, a text
 * given twice, empty, holding a NUL or over 1024 bytes, a bos / eos text that is no special
 * token, files over 16 MiB (rank files over 1 GiB). DUET_ERR_NOT_FOUND when the folder holds no
 * tokenizer.
 */
duet_status_t duet_tokenizer_load(const char *path, duet_tokenizer_t **tok_p);

/*
 * The ids that end a generation for the model folder `dir`, written to ids[0..cap) with their
 * count in *n_p: the union, without repeats and in this order, of config.json's eos_token_id,
 * generation_config.json's eos_token_id (what transformers' generate stops on) and, when `tok`
 * is given and names one, the tokenizer's eos token (which vLLM also stops on). Each file and
 * field may be absent (or null); eos_token_id is an integer or a list of integers, each at most
 * DUET_TOKENIZER_MAX_ID and, with `tok`, inside its vocabulary. Errors name the file and field:
 * DUET_ERR_FORMAT (malformed JSON, wrong type), DUET_ERR_RANGE (an id out of range, more than
 * `cap` ids), DUET_ERR_IO.
 */
duet_status_t duet_tokenizer_stop_ids(const char *dir, const duet_tokenizer_t *tok, uint32_t *ids,
                                      size_t cap, size_t *n_p);

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

/* Whether skip_special_tokens drops `id`: a special token not marked DUET_TOKENIZER_SPECIAL_SHOWN.
 */
bool duet_tokenizer_is_skipped(const duet_tokenizer_t *tok, uint32_t id);

/*
 * The special ids a model folder names as its bos / eos tokens (duet_tokenizer_load of a Kimi
 * layout); DUET_ERR_NOT_FOUND when it names none.
 */
duet_status_t duet_tokenizer_bos_id(const duet_tokenizer_t *tok, uint32_t *id_p);
duet_status_t duet_tokenizer_eos_id(const duet_tokenizer_t *tok, uint32_t *id_p);

/* Whether text prompts should start with the model's bos id (duet_tokenizer.json's "add_bos"). */
bool duet_tokenizer_add_bos(const duet_tokenizer_t *tok);

/*
 * The id a text prompt of model folder `dir` starts with, the one rule duet-generate and the
 * router's /v1/completions share: -1 when the tokenizer does not add one (duet_tokenizer_add_bos),
 * else the tokenizer's bos token, else config.json's "bos_token_id". DUET_ERR_NOT_FOUND when
 * add_bos is set but neither names a bos token; config.json's errors as duet_tokenizer_stop_ids.
 */
duet_status_t duet_tokenizer_prompt_bos(const char *dir, const duet_tokenizer_t *tok,
                                        int32_t *bos_p);

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
