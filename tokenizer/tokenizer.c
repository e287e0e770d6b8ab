/*
 * Tokenizer core: tables, special tokens, the split regex, encode (pre-tokenize + BPE) and decode.
 *
 * Encoding follows tiktoken exactly for valid UTF-8: the text is cut at allowed special tokens,
 * each stretch is split by the regex, and each piece is either one token (when its bytes are a
 * token: tiktoken checks this first and so must we, it is not always what merging would give) or
 * byte-pair merged. Merging keeps the piece as a linked list of parts and a min-heap of
 * (pair rank, position): the pair with the lowest rank merges first, the leftmost on ties, which
 * is the order of tiktoken's quadratic scan, in O(n log n) so that a megabyte-long run of letters
 * costs no more than it should. Stale heap entries are recognised because a part's pair only ever
 * grows, so its rank changes whenever the pair does (ranks of distinct byte strings differ).
 *
 * The tokenizer is immutable; encode keeps its scratch (regex match data, merge arrays for long
 * pieces) in per-call allocations and on the stack, so concurrent calls need no locking and
 * nothing is cached between calls.
 */
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/kimi_pattern.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/utf8.h"

/* ---- tables ------------------------------------------------------------------------------ */

uint64_t duet__tok_hash(const uint8_t *p, size_t n)
{
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    h *= 0x94d049bb133111ebull;
    h ^= h >> 32;
    return h;
}

uint32_t duet__tok_lookup(const duet_tokenizer_t *tok, const uint8_t *p, size_t n)
{
    if (tok->ht == NULL || n == 0 || n > tok->max_token_len)
        return DUET__TOK_NONE;
    size_t i = (size_t)duet__tok_hash(p, n) & tok->ht_mask;
    for (;;) {
        uint32_t id = tok->ht[i];
        if (id == DUET__TOK_NONE)
            return DUET__TOK_NONE;
        if (tok->tok_len[id] == n && memcmp(tok->blob + tok->tok_off[id], p, n) == 0)
            return id;
        i = (i + 1) & tok->ht_mask;
    }
}

duet_status_t duet__tok_tables_alloc(duet_tokenizer_t *tok, uint32_t vocab_size, size_t n_ordinary)
{
    tok->vocab_size = vocab_size;
    tok->tok_off = calloc(vocab_size, sizeof(*tok->tok_off));
    tok->tok_len = calloc(vocab_size, sizeof(*tok->tok_len));
    tok->tok_special = calloc(vocab_size, sizeof(*tok->tok_special));
    if (tok->tok_off == NULL || tok->tok_len == NULL || tok->tok_special == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "tokenizer: no memory for %u ids", vocab_size);
    if (n_ordinary > 0) {
        size_t cap = 16;
        while (cap < 2 * n_ordinary) /* load factor <= 1/2 keeps probes short */
            cap *= 2;
        tok->ht = malloc(cap * sizeof(*tok->ht));
        if (tok->ht == NULL)
            return DUET_FAIL(DUET_ERR_NOMEM, "tokenizer: no memory for a %zu-slot table", cap);
        memset(tok->ht, 0xff, cap * sizeof(*tok->ht));
        tok->ht_mask = (uint32_t)(cap - 1);
    }
    return DUET_OK;
}

uint32_t duet__tok_insert(duet_tokenizer_t *tok, uint32_t id)
{
    const uint8_t *p = tok->blob + tok->tok_off[id];
    size_t n = tok->tok_len[id];
    size_t i = (size_t)duet__tok_hash(p, n) & tok->ht_mask;
    for (;;) {
        uint32_t other = tok->ht[i];
        if (other == DUET__TOK_NONE) {
            tok->ht[i] = id;
            return DUET__TOK_NONE;
        }
        if (tok->tok_len[other] == n && memcmp(tok->blob + tok->tok_off[other], p, n) == 0)
            return other;
        i = (i + 1) & tok->ht_mask;
    }
}

duet_status_t duet__tok_specials_add(duet_tokenizer_t *tok, const duet_tokenizer_special_t *sp,
                                     size_t n, const char *what)
{
    if (n == 0)
        return DUET_OK;
    tok->specials = calloc(n, sizeof(*tok->specials));
    if (tok->specials == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "%s: no memory for %zu special tokens", what, n);
    for (size_t i = 0; i < n; i++) {
        const char *text = sp[i].text;
        uint32_t id = sp[i].id;
        if (text == NULL || text[0] == '\0')
            return DUET_FAIL(DUET_ERR_INVALID, "%s: special token %zu has no text", what, i);
        size_t len = strlen(text);
        if (id >= tok->vocab_size || tok->tok_len[id] != 0)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "%s: special token \"%s\": id %u is taken or out of range", what, text,
                             id);
        for (uint32_t j = 0; j < tok->n_special; j++) {
            const duet__tok_special_t *o = &tok->specials[j];
            if (o->len == len && memcmp(tok->blob + o->off, text, len) == 0)
                return DUET_FAIL(DUET_ERR_INVALID, "%s: special token \"%s\" given twice", what,
                                 text);
        }
        memcpy(tok->blob + tok->blob_len, text, len);
        tok->tok_off[id] = (uint32_t)tok->blob_len;
        tok->tok_len[id] = (uint32_t)len;
        tok->tok_special[id] =
            (uint8_t)(DUET__TOK_SP_SPECIAL |
                      ((sp[i].flags & DUET_TOKENIZER_SPECIAL_SHOWN) != 0 ? DUET__TOK_SP_SHOWN : 0));
        tok->specials[tok->n_special++] =
            (duet__tok_special_t){.id = id, .off = (uint32_t)tok->blob_len, .len = (uint32_t)len};
        tok->special_first[(uint8_t)text[0]] = 1;
        tok->blob_len += len;
        if (len > tok->max_token_len)
            tok->max_token_len = len;
    }
    return DUET_OK;
}

duet_status_t duet__tok_regex_compile(duet_tokenizer_t *tok, const char *pattern, const char *what)
{
    int err = 0;
    PCRE2_SIZE err_off = 0;
    /* DOLLAR_ENDONLY: Rust's `$` (tiktoken) means end of text, not "before a final newline". */
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_DOLLAR_ENDONLY;
    tok->re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, opts, &err, &err_off, NULL);
    if (tok->re == NULL) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof(msg));
        return DUET_FAIL(DUET_ERR_INVALID, "%s: split regex does not compile at offset %zu: %s",
                         what, (size_t)err_off, (const char *)msg);
    }
    tok->re_jit = pcre2_jit_compile(tok->re, PCRE2_JIT_COMPLETE) == 0;
    if (!tok->re_jit)
        DUET_LOG_DEBUG("%s: PCRE2 JIT unavailable, using the interpreter", what);
    return DUET_OK;
}

/* ---- lifetime ---------------------------------------------------------------------------- */

void duet_tokenizer_destroy(duet_tokenizer_t *tok)
{
    if (tok == NULL)
        return;
    pcre2_code_free(tok->re);
    free(tok->specials);
    free(tok->ht);
    free(tok->blob);
    free(tok->tok_special);
    free(tok->tok_len);
    free(tok->tok_off);
    free(tok);
}

duet_status_t duet_tokenizer_create_byte(const char *const *specials, size_t n_specials,
                                         duet_tokenizer_t **tok_p)
{
    if (tok_p == NULL || (specials == NULL && n_specials > 0))
        return DUET_FAIL(DUET_ERR_INVALID, "byte tokenizer: NULL argument");
    if (n_specials > DUET_TOKENIZER_MAX_ID - 256)
        return DUET_FAIL(DUET_ERR_INVALID, "byte tokenizer: %zu specials is too many", n_specials);

    duet_status_t st;
    duet_tokenizer_special_t *sp = NULL;
    size_t text_bytes = 0;
    for (size_t i = 0; i < n_specials; i++) {
        size_t len = specials[i] != NULL ? strlen(specials[i]) : 0;
        if (len > 256)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "byte tokenizer: special token %zu is %zu bytes "
                             "(at most 256)",
                             i, len);
        text_bytes += len;
    }
    duet_tokenizer_t *tok = calloc(1, sizeof(*tok));
    if (tok == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "byte tokenizer: no memory");
    tok->kind = DUET__TOK_KIND_BYTE;
    tok->bos_id = tok->eos_id = DUET__TOK_NONE;
    st = duet__tok_tables_alloc(tok, (uint32_t)(256 + n_specials), 0);
    if (st < 0)
        goto fail_tok;
    tok->blob = malloc(256 + text_bytes);
    if (n_specials > 0)
        sp = calloc(n_specials, sizeof(*sp));
    if (tok->blob == NULL || (n_specials > 0 && sp == NULL)) {
        st = DUET_FAIL(DUET_ERR_NOMEM, "byte tokenizer: no memory");
        goto fail_sp;
    }
    for (uint32_t b = 0; b < 256; b++) {
        tok->blob[b] = (uint8_t)b;
        tok->tok_off[b] = b;
        tok->tok_len[b] = 1;
    }
    tok->blob_len = 256;
    tok->max_token_len = 1;
    for (size_t i = 0; i < n_specials; i++)
        sp[i] = (duet_tokenizer_special_t){.text = specials[i], .id = (uint32_t)(256 + i)};
    st = duet__tok_specials_add(tok, sp, n_specials, "byte tokenizer");
    if (st < 0)
        goto fail_sp;
    free(sp);
    *tok_p = tok;
    return DUET_OK;

fail_sp:
    free(sp);
fail_tok:
    duet_tokenizer_destroy(tok);
    return st;
}

/* ---- built-in encodings ------------------------------------------------------------------ */

static const struct {
    const char *name;
    const char *pattern;
} duet__tok_patterns[] = {
    {"cl100k_base",
     "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}++|\\p{N}{1,3}+| ?[^\\s\\p{L}\\p{N}]++"
     "[\\r\\n]*+|\\s++$|\\s*[\\r\\n]|\\s+(?!\\S)|\\s"},
    {"o200k_base",
     "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
     "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
     "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    {"r50k_base", "'(?:[sdmt]|ll|ve|re)| ?\\p{L}++| ?\\p{N}++| ?[^\\s\\p{L}\\p{N}]++|\\s++$"
                  "|\\s+(?!\\S)|\\s"},
    {"p50k_base", "'(?:[sdmt]|ll|ve|re)| ?\\p{L}++| ?\\p{N}++| ?[^\\s\\p{L}\\p{N}]++|\\s++$"
                  "|\\s+(?!\\S)|\\s"},
    /* Kimi (K2, Linear), tokenization_kimi.py's pat_str:
     *   [\p{Han}]+
     *   |[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*
     *    [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
     *   |[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+
     *    [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
     *   |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
     * rewritten for PCRE2 to match what tiktoken (Rust fancy-regex) matches, classes from
     * kimi_pattern.h: tiktoken's `&&` class intersection, which PCRE2 lacks, becomes a negative
     * lookahead before the class; \p{Han} (Script in Rust, Script_Extensions in PCRE2) and \s
     * (PCRE2 adds U+180E) are spelt out; every other class gains what Unicode assigned after
     * PCRE2's tables (14.0) up to tiktoken's (16.0). */
    {"kimi",
     "[" DUET__TOK_KIMI_HAN "]+"
     "|[^\\r\\n\\p{L}\\p{N}" DUET__TOK_KIMI_D_LN "]?"
     "(?:(?![" DUET__TOK_KIMI_HAN "])[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}" DUET__TOK_KIMI_D_A "])*"
     "(?:(?![" DUET__TOK_KIMI_HAN "])[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}" DUET__TOK_KIMI_D_B "])+"
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
     "|[^\\r\\n\\p{L}\\p{N}" DUET__TOK_KIMI_D_LN "]?"
     "(?:(?![" DUET__TOK_KIMI_HAN "])[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}" DUET__TOK_KIMI_D_A "])+"
     "(?:(?![" DUET__TOK_KIMI_HAN "])[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}" DUET__TOK_KIMI_D_B "])*"
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
     "|[\\p{N}" DUET__TOK_KIMI_D_N "]{1,3}"
     "| ?[^" DUET__TOK_KIMI_WS "\\p{L}\\p{N}" DUET__TOK_KIMI_D_LN "]+[\\r\\n]*"
     "|[" DUET__TOK_KIMI_WS "]*[\\r\\n]+"
     "|[" DUET__TOK_KIMI_WS "]+(?![^" DUET__TOK_KIMI_WS "])"
     "|[" DUET__TOK_KIMI_WS "]+"},
};

const char *duet_tokenizer_pattern(const char *name)
{
    if (name == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof(duet__tok_patterns) / sizeof(duet__tok_patterns[0]); i++)
        if (strcmp(duet__tok_patterns[i].name, name) == 0)
            return duet__tok_patterns[i].pattern;
    return NULL;
}

/* ---- encode ------------------------------------------------------------------------------ */

/* Where ids go: the first `cap` are stored, all are counted. */
typedef struct {
    uint32_t *ids;
    size_t cap;
    size_t n;
} duet__tok_sink_t;

static inline void sink_put(duet__tok_sink_t *s, uint32_t id)
{
    if (s->n < s->cap)
        s->ids[s->n] = id;
    s->n++;
}

/* Per-call scratch for merging long pieces; short ones use the stack. */
typedef struct {
    uint32_t *nodes; /* (3 * cap) next | prev | rank, indexed by part start */
    uint64_t *heap;  /* (3 * cap) (rank << 32 | start) min-heap */
    size_t cap;      /* piece length the arrays hold */
} duet__tok_scratch_t;

#define DUET__TOK_STACK_PIECE 128

static void heap_push(uint64_t *heap, size_t *n, uint64_t v)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (heap[parent] <= v)
            break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = v;
}

static uint64_t heap_pop(uint64_t *heap, size_t *n)
{
    uint64_t top = heap[0];
    uint64_t v = heap[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && heap[c + 1] < heap[c])
            c++;
        if (v <= heap[c])
            break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = v;
    return top;
}

/*
 * Byte-pair merge one piece p[0..n) into the sink. Needs every single byte to be a token, which
 * loading guarantees.
 */
static duet_status_t bpe_piece(const duet_tokenizer_t *tok, const uint8_t *p, size_t n,
                               duet__tok_scratch_t *scratch, duet__tok_sink_t *sink)
{
    if (n == 0)
        return DUET_OK;
    uint32_t whole = duet__tok_lookup(tok, p, n);
    if (whole != DUET__TOK_NONE) {
        sink_put(sink, whole);
        return DUET_OK;
    }

    uint32_t stack_nodes[3 * DUET__TOK_STACK_PIECE];
    uint64_t stack_heap[3 * DUET__TOK_STACK_PIECE];
    uint32_t *nodes = stack_nodes;
    uint64_t *heap = stack_heap;
    if (n > DUET__TOK_STACK_PIECE) {
        if (n > scratch->cap) {
            size_t cap = n; /* one encode rarely holds two long pieces: no slack */
            uint32_t *nn = realloc(scratch->nodes, 3 * cap * sizeof(*nn));
            if (nn == NULL)
                return duet_error_set(DUET_ERR_NOMEM,
                                      "tokenizer: no memory to merge a %zu-byte "
                                      "piece",
                                      n);
            scratch->nodes = nn;
            uint64_t *hh = realloc(scratch->heap, 3 * cap * sizeof(*hh));
            if (hh == NULL)
                return duet_error_set(DUET_ERR_NOMEM,
                                      "tokenizer: no memory to merge a %zu-byte "
                                      "piece",
                                      n);
            scratch->heap = hh;
            scratch->cap = cap;
        }
        nodes = scratch->nodes;
        heap = scratch->heap;
    }
    /* A part is named by its first byte's index; parts tile the piece left to right. */
    uint32_t *next = nodes;         /* start of the following part (n past the last) */
    uint32_t *prev = nodes + n;     /* start of the preceding part (NONE for the first) */
    uint32_t *rank = nodes + 2 * n; /* rank of this part joined with the next; NONE if none */
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
        next[i] = (uint32_t)(i + 1);
        prev[i] = i == 0 ? DUET__TOK_NONE : (uint32_t)(i - 1);
        rank[i] = i + 1 < n ? duet__tok_lookup(tok, p + i, 2) : DUET__TOK_NONE;
        if (rank[i] != DUET__TOK_NONE)
            heap_push(heap, &hn, (uint64_t)rank[i] << 32 | i);
    }
    while (hn > 0) {
        uint64_t top = heap_pop(heap, &hn);
        uint32_t i = (uint32_t)top;
        uint32_t r = (uint32_t)(top >> 32);
        if (rank[i] != r)
            continue; /* stale: this part's pair changed or the part was absorbed */
        uint32_t j = next[i];
        uint32_t k = next[j];
        next[i] = k;
        if (k < n)
            prev[k] = i;
        rank[j] = DUET__TOK_NONE;
        rank[i] = k < n ? duet__tok_lookup(tok, p + i, next[k] - i) : DUET__TOK_NONE;
        if (rank[i] != DUET__TOK_NONE)
            heap_push(heap, &hn, (uint64_t)rank[i] << 32 | i);
        uint32_t h = prev[i];
        if (h != DUET__TOK_NONE) {
            rank[h] = duet__tok_lookup(tok, p + h, k - h);
            if (rank[h] != DUET__TOK_NONE)
                heap_push(heap, &hn, (uint64_t)rank[h] << 32 | h);
        }
    }
    for (uint32_t i = 0; i < n; i = next[i]) {
        uint32_t id = duet__tok_lookup(tok, p + i, next[i] - i);
        DUET_ASSERT(id != DUET__TOK_NONE);
        sink_put(sink, id);
    }
    return DUET_OK;
}

/* The UTF-8 character at p (n > 0 bytes available): its length, and its code point in *cp_p. An
 * ill-formed or truncated sequence is its first byte alone, with *cp_p = -1. */
static size_t utf8_char(const uint8_t *p, size_t n, int32_t *cp_p)
{
    size_t k = duet_utf8_char(p, n, cp_p);
    return k > 0 ? k : 1;
}

/* Split text[0..len) (no specials inside) with the regex and merge every piece. */
static duet_status_t encode_ordinary(const duet_tokenizer_t *tok, const uint8_t *text, size_t len,
                                     pcre2_match_data *md, duet__tok_scratch_t *scratch,
                                     duet__tok_sink_t *sink)
{
    duet_status_t st;
    size_t off = 0;
    while (off < len) {
        int rc;
        if (tok->re_jit) {
            rc = pcre2_jit_match(tok->re, text, len, off, 0, md, NULL);
            if (rc == PCRE2_ERROR_JIT_STACKLIMIT) /* a huge match: the interpreter copes */
                rc = pcre2_match(tok->re, text, len, off, PCRE2_NO_JIT, md, NULL);
        } else {
            rc = pcre2_match(tok->re, text, len, off, 0, md, NULL);
        }
        if (rc == PCRE2_ERROR_NOMATCH) {
            /* Nothing the regex accepts is left (ill-formed UTF-8): one piece, kept lossless. */
            return bpe_piece(tok, text + off, len - off, scratch, sink);
        }
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof(msg));
            return duet_error_set(DUET_ERR_INTERNAL,
                                  "tokenizer: split regex failed at byte %zu: %s", off,
                                  (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (ms > off) { /* bytes the regex skipped (ill-formed UTF-8) are a piece of their own */
            st = bpe_piece(tok, text + off, ms - off, scratch, sink);
            if (st < 0)
                return st;
        }
        if (me <= ms) { /* a custom pattern matched empty: take one character */
            int32_t cp;
            me = ms + utf8_char(text + ms, len - ms, &cp);
        }
        st = bpe_piece(tok, text + ms, me - ms, scratch, sink);
        if (st < 0)
            return st;
        off = me;
    }
    return DUET_OK;
}

/* The earliest special token at or after `from`, the longest at that position; NULL if none. */
static const duet__tok_special_t *find_special(const duet_tokenizer_t *tok, const uint8_t *text,
                                               size_t len, size_t from, size_t *at_p)
{
    for (size_t i = from; i < len; i++) {
        if (!tok->special_first[text[i]])
            continue;
        const duet__tok_special_t *best = NULL;
        for (uint32_t s = 0; s < tok->n_special; s++) {
            const duet__tok_special_t *sp = &tok->specials[s];
            if (sp->len <= len - i && memcmp(tok->blob + sp->off, text + i, sp->len) == 0 &&
                (best == NULL || sp->len > best->len))
                best = sp;
        }
        if (best != NULL) {
            *at_p = i;
            return best;
        }
    }
    return NULL;
}

static duet_status_t encode_stretch(const duet_tokenizer_t *tok, const uint8_t *text, size_t len,
                                    pcre2_match_data *md, duet__tok_scratch_t *scratch,
                                    duet__tok_sink_t *sink)
{
    if (tok->kind == DUET__TOK_KIND_BYTE) {
        for (size_t i = 0; i < len; i++)
            sink_put(sink, text[i]);
        return DUET_OK;
    }
    return encode_ordinary(tok, text, len, md, scratch, sink);
}

/* Encode text[0..len): cut at allowed special tokens, split and merge the stretches between. */
static duet_status_t encode_text(const duet_tokenizer_t *tok, const uint8_t *t, size_t len,
                                 bool specials, pcre2_match_data *md, duet__tok_scratch_t *scratch,
                                 duet__tok_sink_t *sink)
{
    size_t pos = 0;
    while (pos < len) {
        size_t at = len;
        const duet__tok_special_t *sp = specials ? find_special(tok, t, len, pos, &at) : NULL;
        duet_status_t st = encode_stretch(tok, t + pos, at - pos, md, scratch, sink);
        if (st < 0)
            return st;
        if (sp == NULL)
            break;
        sink_put(sink, sp->id);
        pos = at + sp->len;
    }
    return DUET_OK;
}

/*
 * Kimi's encode (tokenization_kimi.py): the text is cut into chunks of 400000 characters, each
 * chunk wherever a run of whitespace or of non-whitespace characters would pass 25000 (the
 * character that would be the 25001st starts the next piece, which then holds a run of 1), and
 * each piece is encoded on its own, special tokens included. Python cuts a str, so a character
 * here is a code point; each byte of ill-formed UTF-8 counts as one non-whitespace character.
 */
static duet_status_t encode_kimi(const duet_tokenizer_t *tok, const uint8_t *t, size_t len,
                                 bool specials, pcre2_match_data *md, duet__tok_scratch_t *scratch,
                                 duet__tok_sink_t *sink)
{
    size_t i = 0;
    while (i < len) {
        size_t start = i, chars = 0, run = 0;
        bool run_space = false;
        while (i < len && chars < DUET__TOK_KIMI_MAX_CHARS) {
            int32_t cp;
            size_t cl = utf8_char(t + i, len - i, &cp);
            bool space = cp >= 0 && duet_unicode_isspace((uint32_t)cp);
            if (chars == 0 || space != run_space) {
                run_space = space;
                run = 1;
            } else if (++run > DUET__TOK_KIMI_MAX_RUN) {
                duet_status_t st =
                    encode_text(tok, t + start, i - start, specials, md, scratch, sink);
                if (st < 0)
                    return st;
                start = i;
                run = 1;
            }
            i += cl;
            chars++;
        }
        duet_status_t st = encode_text(tok, t + start, i - start, specials, md, scratch, sink);
        if (st < 0)
            return st;
    }
    return DUET_OK;
}

duet_status_t duet_tokenizer_encode(const duet_tokenizer_t *tok, const char *text, size_t len,
                                    unsigned flags, uint32_t *ids_out, size_t cap, size_t *n_p)
{
    if (tok == NULL || n_p == NULL || (text == NULL && len > 0) || (ids_out == NULL && cap > 0))
        return duet_error_set(DUET_ERR_INVALID, "tokenizer encode: NULL argument");
    if (len >= UINT32_MAX) /* merge positions are 32-bit */
        return duet_error_set(DUET_ERR_RANGE, "tokenizer encode: %zu bytes is too long", len);
    duet_status_t st = DUET_OK;
    const uint8_t *t = (const uint8_t *)text;
    duet__tok_sink_t sink = {.ids = ids_out, .cap = cap, .n = 0};
    duet__tok_scratch_t scratch = {0};
    pcre2_match_data *md = NULL;
    if (tok->re != NULL && len > 0) {
        md = pcre2_match_data_create_from_pattern(tok->re, NULL);
        if (md == NULL)
            return duet_error_set(DUET_ERR_NOMEM, "tokenizer encode: no memory for match data");
    }
    bool specials = (flags & DUET_TOKENIZER_ALLOW_SPECIAL) != 0 && tok->n_special > 0;
    st = tok->kimi_split ? encode_kimi(tok, t, len, specials, md, &scratch, &sink)
                         : encode_text(tok, t, len, specials, md, &scratch, &sink);
    if (st < 0)
        goto out;
    *n_p = sink.n;
    if (sink.n > cap)
        st = duet_error_set(DUET_ERR_NO_SPACE, "tokenizer encode: %zu ids do not fit in %zu",
                            sink.n, cap);
out:
    pcre2_match_data_free(md);
    free(scratch.heap);
    free(scratch.nodes);
    return st;
}

/* ---- decode and lookups ------------------------------------------------------------------ */

duet_status_t duet_tokenizer_decode(const duet_tokenizer_t *tok, const uint32_t *ids, size_t n,
                                    char *buf, size_t cap, size_t *len_p)
{
    if (tok == NULL || len_p == NULL || (ids == NULL && n > 0) || (buf == NULL && cap > 0))
        return duet_error_set(DUET_ERR_INVALID, "tokenizer decode: NULL argument");
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t id = ids[i];
        if (id >= tok->vocab_size || tok->tok_len[id] == 0)
            return duet_error_set(DUET_ERR_RANGE,
                                  "tokenizer decode: id %u at position %zu is "
                                  "not in the vocabulary (size %u)",
                                  id, i, tok->vocab_size);
        size_t l = tok->tok_len[id];
        if (total < cap)
            memcpy(buf + total, tok->blob + tok->tok_off[id], l <= cap - total ? l : cap - total);
        total += l;
    }
    *len_p = total;
    if (total > cap)
        return duet_error_set(DUET_ERR_NO_SPACE, "tokenizer decode: %zu bytes do not fit in %zu",
                              total, cap);
    return DUET_OK;
}

duet_status_t duet_tokenizer_token_bytes(const duet_tokenizer_t *tok, uint32_t id,
                                         const uint8_t **ptr_p, size_t *len_p)
{
    if (tok == NULL || ptr_p == NULL || len_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "tokenizer token_bytes: NULL argument");
    if (id >= tok->vocab_size || tok->tok_len[id] == 0)
        return duet_error_set(DUET_ERR_RANGE,
                              "tokenizer: id %u is not in the vocabulary "
                              "(size %u)",
                              id, tok->vocab_size);
    *ptr_p = tok->blob + tok->tok_off[id];
    *len_p = tok->tok_len[id];
    return DUET_OK;
}

uint32_t duet_tokenizer_vocab_size(const duet_tokenizer_t *tok)
{
    return tok->vocab_size;
}

size_t duet_tokenizer_max_token_len(const duet_tokenizer_t *tok)
{
    return tok->max_token_len;
}

duet_status_t duet_tokenizer_special_id(const duet_tokenizer_t *tok, const char *text,
                                        uint32_t *id_p)
{
    if (tok == NULL || text == NULL || id_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "tokenizer special_id: NULL argument");
    size_t len = strlen(text);
    for (uint32_t s = 0; s < tok->n_special; s++) {
        const duet__tok_special_t *sp = &tok->specials[s];
        if (sp->len == len && memcmp(tok->blob + sp->off, text, len) == 0) {
            *id_p = sp->id;
            return DUET_OK;
        }
    }
    return duet_error_set(DUET_ERR_NOT_FOUND, "tokenizer: no special token \"%s\"", text);
}

bool duet_tokenizer_is_special(const duet_tokenizer_t *tok, uint32_t id)
{
    return id < tok->vocab_size && (tok->tok_special[id] & DUET__TOK_SP_SPECIAL) != 0;
}

bool duet_tokenizer_is_skipped(const duet_tokenizer_t *tok, uint32_t id)
{
    return id < tok->vocab_size &&
           (tok->tok_special[id] & (DUET__TOK_SP_SPECIAL | DUET__TOK_SP_SHOWN)) ==
               DUET__TOK_SP_SPECIAL;
}

static duet_status_t special_of(uint32_t id, const char *what, uint32_t *id_p)
{
    if (id_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "tokenizer %s_id: NULL argument", what);
    if (id == DUET__TOK_NONE)
        return duet_error_set(DUET_ERR_NOT_FOUND, "tokenizer: the model folder names no %s token",
                              what);
    *id_p = id;
    return DUET_OK;
}

duet_status_t duet_tokenizer_bos_id(const duet_tokenizer_t *tok, uint32_t *id_p)
{
    return special_of(tok->bos_id, "bos", id_p);
}

duet_status_t duet_tokenizer_eos_id(const duet_tokenizer_t *tok, uint32_t *id_p)
{
    return special_of(tok->eos_id, "eos", id_p);
}

bool duet_tokenizer_add_bos(const duet_tokenizer_t *tok)
{
    return tok->add_bos;
}
