/*
 * Internals shared by the tokenizer's .c files: the tokenizer body and the duet__tok_* helpers.
 *
 * Every token (ordinary or special) lives as bytes in one blob, addressed by id through two
 * id-indexed arrays; a gap in the id space has length 0. Ordinary tokens are also in an
 * open-addressing hash table (bytes -> id) that BPE merging probes; specials are not, because
 * tiktoken never merges into a special token.
 */
#ifndef DUET_ENGINE_TOKENIZER_TOKENIZER_IMPL_H
#define DUET_ENGINE_TOKENIZER_TOKENIZER_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tokenizer/tokenizer.h"

#define DUET__TOK_NONE UINT32_MAX /* "no id" in tables and ranks */

/* tok_special[id] bits. */
#define DUET__TOK_SP_SPECIAL 1u /* a special token */
#define DUET__TOK_SP_SHOWN   2u /* kept as text under skip_special_tokens */

/* Kimi's tokenization_kimi.py: its reserved specials and the limits of its encode's pieces. */
#define DUET__TOK_KIMI_N_SPECIAL 258u    /* num_reserved_special_tokens (256) + 2 */
#define DUET__TOK_KIMI_MAX_CHARS 400000u /* TIKTOKEN_MAX_ENCODE_CHARS */
#define DUET__TOK_KIMI_MAX_RUN   25000u  /* MAX_NO_WHITESPACES_CHARS */

typedef enum {
    DUET__TOK_KIND_BYTE = 0,
    DUET__TOK_KIND_TIKTOKEN = 1,
} duet__tok_kind_t;

typedef struct {
    uint32_t id;
    uint32_t off; /* into blob */
    uint32_t len;
} duet__tok_special_t;

struct duet_tokenizer {
    duet__tok_kind_t kind;
    uint32_t vocab_size;  /* largest id + 1 */
    uint32_t *tok_off;    /* (vocab_size) offset of each id's bytes in blob, owned */
    uint32_t *tok_len;    /* (vocab_size) length in bytes; 0 = no such id, owned */
    uint8_t *tok_special; /* (vocab_size) DUET__TOK_SP_* bits, owned */
    uint8_t *blob;        /* (blob_len) every token's bytes, owned */
    size_t blob_len;
    size_t max_token_len; /* longest token (ordinary or special), bytes */
    uint32_t *ht;         /* (ht_mask + 1) ordinary ids by hash; NONE = empty; owned */
    uint32_t ht_mask;
    duet__tok_special_t *specials; /* (n_special) owned */
    uint32_t n_special;
    uint8_t special_first[256]; /* 1 where some special token starts with this byte */
    pcre2_code *re;             /* split regex (tiktoken only), owned */
    bool re_jit;                /* JIT compilation succeeded */
    bool kimi_split;            /* Kimi's encode: pieces of bounded length and runs, before BPE */
    bool add_bos;               /* duet_tokenizer.json's "add_bos" */
    uint32_t bos_id, eos_id;    /* the folder's bos / eos special ids; DUET__TOK_NONE if none */
};

/* Hash of a byte string for the token table. */
uint64_t duet__tok_hash(const uint8_t *p, size_t n);

/* Ordinary id whose bytes are exactly p[0..n), or DUET__TOK_NONE. */
uint32_t duet__tok_lookup(const duet_tokenizer_t *tok, const uint8_t *p, size_t n);

/*
 * Allocate the id-indexed tables for vocab_size ids (zeroed) and an empty hash table for
 * n_ordinary tokens. Returns DUET_ERR_NOMEM (logged).
 */
duet_status_t duet__tok_tables_alloc(duet_tokenizer_t *tok, uint32_t vocab_size, size_t n_ordinary);

/*
 * Insert ordinary id (whose bytes are already in blob/tok_off/tok_len) into the hash table.
 * Returns the id already holding the same bytes, or DUET__TOK_NONE when inserted.
 */
uint32_t duet__tok_insert(duet_tokenizer_t *tok, uint32_t id);

/*
 * Register the specials: their ids must be < vocab_size, free in the tables, distinct; texts
 * non-empty and distinct. Copies the texts into blob at blob_len (blob must have room).
 * Errors are DUET_ERR_INVALID, logged with `what` (a file name or "byte tokenizer").
 */
duet_status_t duet__tok_specials_add(duet_tokenizer_t *tok, const duet_tokenizer_special_t *sp,
                                     size_t n, const char *what);

/*
 * Tiktoken from a rank file, the body of duet_tokenizer_create_tiktoken with the encoding's name
 * already resolved: `kimi` asks for Kimi's rules (contiguous ranks, the special range after them
 * with reserved names for ids `sp` does not name, run splitting). `sp_source` names where the
 * specials come from in errors about them (NULL: the rank file).
 */
duet_status_t duet__tok_tiktoken_create(const char *rank_path, const char *pattern,
                                        const duet_tokenizer_special_t *sp, size_t n_sp,
                                        const char *sp_source, bool kimi, duet_tokenizer_t **tok_p);

/* Compile the split regex (UTF, UCP, MATCH_INVALID_UTF, DOLLAR_ENDONLY; JIT when possible). */
duet_status_t duet__tok_regex_compile(duet_tokenizer_t *tok, const char *pattern, const char *what);

#endif
