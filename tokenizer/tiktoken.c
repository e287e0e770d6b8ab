/*
 * Loading tiktoken rank files: `base64(token_bytes) SP rank` per line, rank = token id.
 *
 * The file is untrusted input, so the parser is strict and every refusal names the file and the
 * line: bad base64, a missing or non-numeric rank, a rank too large for our id tables, a rank or
 * token given twice, an over-long line, an empty file, and a vocabulary without all 256 single
 * bytes (without them some inputs could not be encoded at all). Blank lines are skipped, as
 * tiktoken's own loader does. Built-in encodings (cl100k_base, o200k_base, ...) are recognised by
 * the file's name and bring their split regex and special tokens; Kimi's (tiktoken.model) brings
 * its regex, its encode's run splitting and its special range (the 258 ids after the last rank,
 * which tokenization_kimi.py numbers from the rank count, so its ranks must leave no gap).
 */
#include "tokenizer/tokenizer_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/log.h"

#define DUET__TOK_MAX_LINE    4096
#define DUET__TOK_MAX_TOKEN   512
#define DUET__TOK_MAX_FILE    (1ull << 30)
#define DUET__TOK_MAX_SPECIAL 1024

/* Built-in special tokens, by encoding name. */
static const duet_tokenizer_special_t duet__tok_cl100k_specials[] = {
    {"<|endoftext|>", 100257, 0},  {"<|fim_prefix|>", 100258, 0},  {"<|fim_middle|>", 100259, 0},
    {"<|fim_suffix|>", 100260, 0}, {"<|endofprompt|>", 100276, 0},
};
static const duet_tokenizer_special_t duet__tok_o200k_specials[] = {
    {"<|endoftext|>", 199999, 0},
    {"<|endofprompt|>", 200018, 0},
};
static const duet_tokenizer_special_t duet__tok_r50k_specials[] = {
    {"<|endoftext|>", 50256, 0},
};
static const duet_tokenizer_special_t duet__tok_p50k_specials[] = {
    {"<|endoftext|>", 50256, 0},
};

static const struct {
    const char *name;
    const duet_tokenizer_special_t *specials;
    size_t n;
} duet__tok_builtin_specials[] = {
    {"cl100k_base", duet__tok_cl100k_specials, 5},
    {"o200k_base", duet__tok_o200k_specials, 2},
    {"r50k_base", duet__tok_r50k_specials, 1},
    {"p50k_base", duet__tok_p50k_specials, 1},
};

/* One parsed line, before the id tables exist. */
typedef struct {
    uint32_t rank;
    uint32_t off; /* decoded bytes in the blob */
    uint32_t len;
    uint32_t line;
} duet__tok_entry_t;

static int b64_value(uint8_t c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    if (c == '+')
        return 62;
    if (c == '/')
        return 63;
    return -1;
}

/* Strict base64 (padded, standard alphabet) of s[0..n) into out; -1 when malformed. */
static long b64_decode(const uint8_t *s, size_t n, uint8_t *out)
{
    if (n == 0 || n % 4 != 0)
        return -1;
    size_t pad = s[n - 1] == '=' ? (s[n - 2] == '=' ? 2 : 1) : 0;
    size_t o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4];
        for (size_t k = 0; k < 4; k++) {
            bool pad_slot = i + 4 == n && k >= 4 - pad;
            v[k] = pad_slot ? 0 : b64_value(s[i + k]);
            if (v[k] < 0)
                return -1;
        }
        uint32_t w =
            (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (uint8_t)(w >> 16);
        if (!(i + 4 == n && pad == 2))
            out[o++] = (uint8_t)(w >> 8);
        if (!(i + 4 == n && pad >= 1))
            out[o++] = (uint8_t)w;
    }
    return (long)o;
}

static duet_status_t read_file(const char *path, uint8_t **data_p, size_t *len_p)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return DUET_FAIL(DUET_ERR_IO, "%s: cannot open rank file: %s", path, strerror(errno));
    duet_status_t st = DUET_OK;
    uint8_t *data = NULL;
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        st = DUET_FAIL(DUET_ERR_IO, "%s: not a regular file", path);
        goto out;
    }
    if ((unsigned long long)sb.st_size > DUET__TOK_MAX_FILE) {
        st = DUET_FAIL(DUET_ERR_FORMAT, "%s: rank file of %lld bytes is too large", path,
                       (long long)sb.st_size);
        goto out;
    }
    size_t len = (size_t)sb.st_size;
    data = malloc(len + 1);
    if (data == NULL) {
        st = DUET_FAIL(DUET_ERR_NOMEM, "%s: no memory for %zu bytes", path, len);
        goto out;
    }
    if (len > 0 && fread(data, 1, len, f) != len) {
        st = DUET_FAIL(DUET_ERR_IO, "%s: read failed", path);
        free(data);
        goto out;
    }
    *data_p = data;
    *len_p = len;
out:
    fclose(f);
    return st;
}

/* Parse every line into entries (decoded bytes appended to tok->blob). */
static duet_status_t parse_ranks(duet_tokenizer_t *tok, const char *path, const uint8_t *data,
                                 size_t len, duet__tok_entry_t *entries, size_t *n_p,
                                 uint32_t *max_rank_p)
{
    size_t n = 0, line_no = 0;
    uint32_t max_rank = 0;
    size_t pos = 0;
    while (pos < len) {
        line_no++;
        const uint8_t *line = data + pos;
        const uint8_t *nl = memchr(line, '\n', len - pos);
        size_t ll = nl != NULL ? (size_t)(nl - line) : len - pos;
        pos += ll + (nl != NULL ? 1 : 0);
        if (ll > DUET__TOK_MAX_LINE)
            return DUET_FAIL(DUET_ERR_FORMAT, "%s:%zu: line of %zu bytes is longer than %d", path,
                             line_no, ll, DUET__TOK_MAX_LINE);
        if (ll > 0 && line[ll - 1] == '\r')
            ll--;
        if (ll == 0)
            continue;
        const uint8_t *sp = memchr(line, ' ', ll);
        if (sp == NULL)
            return DUET_FAIL(DUET_ERR_FORMAT, "%s:%zu: missing rank (expected \"base64 rank\")",
                             path, line_no);
        size_t b64_len = (size_t)(sp - line);
        const uint8_t *r = sp + 1;
        size_t r_len = ll - b64_len - 1;
        if (r_len == 0)
            return DUET_FAIL(DUET_ERR_FORMAT, "%s:%zu: missing rank", path, line_no);
        uint64_t rank = 0;
        for (size_t i = 0; i < r_len; i++) {
            if (r[i] < '0' || r[i] > '9')
                return DUET_FAIL(DUET_ERR_FORMAT, "%s:%zu: rank \"%.*s\" is not a decimal number",
                                 path, line_no, (int)(r_len > 32 ? 32 : r_len), (const char *)r);
            rank = rank * 10 + (uint64_t)(r[i] - '0');
            if (rank > DUET_TOKENIZER_MAX_ID)
                return DUET_FAIL(DUET_ERR_FORMAT, "%s:%zu: rank \"%.*s\" is larger than %u", path,
                                 line_no, (int)(r_len > 32 ? 32 : r_len), (const char *)r,
                                 DUET_TOKENIZER_MAX_ID);
        }
        if (b64_len > 4 * ((DUET__TOK_MAX_TOKEN + 2) / 3))
            return DUET_FAIL(DUET_ERR_FORMAT, "%s:%zu: token longer than %d bytes", path, line_no,
                             DUET__TOK_MAX_TOKEN);
        long dl = b64_decode(line, b64_len, tok->blob + tok->blob_len);
        if (dl <= 0)
            return DUET_FAIL(DUET_ERR_FORMAT, "%s:%zu: bad base64 \"%.*s\"", path, line_no,
                             (int)(b64_len > 64 ? 64 : b64_len), (const char *)line);
        entries[n++] = (duet__tok_entry_t){.rank = (uint32_t)rank,
                                           .off = (uint32_t)tok->blob_len,
                                           .len = (uint32_t)dl,
                                           .line = (uint32_t)line_no};
        tok->blob_len += (size_t)dl;
        if ((size_t)dl > tok->max_token_len)
            tok->max_token_len = (size_t)dl;
        if (rank > max_rank)
            max_rank = (uint32_t)rank;
    }
    if (n == 0)
        return DUET_FAIL(DUET_ERR_FORMAT, "%s: empty rank file (no tokens)", path);
    *n_p = n;
    *max_rank_p = max_rank;
    return DUET_OK;
}

/* Fill the id tables and the hash table from the entries; refuse duplicates. */
static duet_status_t index_ranks(duet_tokenizer_t *tok, const char *path,
                                 const duet__tok_entry_t *entries, size_t n)
{
    duet_status_t st = DUET_OK;
    uint32_t *line_of = calloc(tok->vocab_size, sizeof(*line_of)); /* temporary, for messages */
    if (line_of == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "%s: no memory", path);
    for (size_t i = 0; i < n; i++) {
        const duet__tok_entry_t *e = &entries[i];
        if (tok->tok_len[e->rank] != 0) {
            st = DUET_FAIL(DUET_ERR_FORMAT, "%s:%u: duplicate rank %u (first at line %u)", path,
                           e->line, e->rank, line_of[e->rank]);
            goto out;
        }
        tok->tok_off[e->rank] = e->off;
        tok->tok_len[e->rank] = e->len;
        line_of[e->rank] = e->line;
        uint32_t other = duet__tok_insert(tok, e->rank);
        if (other != DUET__TOK_NONE) {
            st = DUET_FAIL(DUET_ERR_FORMAT,
                           "%s:%u: duplicate token bytes (same as rank %u at "
                           "line %u)",
                           path, e->line, other, line_of[other]);
            goto out;
        }
    }
    for (unsigned b = 0; b < 256; b++) {
        uint8_t byte = (uint8_t)b;
        if (duet__tok_lookup(tok, &byte, 1) == DUET__TOK_NONE) {
            st = DUET_FAIL(DUET_ERR_FORMAT,
                           "%s: no token for the single byte 0x%02x (a rank file "
                           "must hold all 256 bytes)",
                           path, b);
            goto out;
        }
    }
out:
    free(line_of);
    return st;
}

/* "cl100k_base" for ".../cl100k_base.tiktoken", "kimi" for ".../tiktoken.model" (Kimi's name
 * for it) and ".../tokenizer.model" (the name duet used first). */
static void encoding_name(const char *path, char *name, size_t cap)
{
    const char *base = strrchr(path, '/');
    base = base != NULL ? base + 1 : path;
    if (strcmp(base, "tiktoken.model") == 0 || strcmp(base, "tokenizer.model") == 0) {
        snprintf(name, cap, "kimi");
        return;
    }
    size_t n = strlen(base);
    const char *ext = ".tiktoken";
    size_t el = strlen(ext);
    if (n > el && strcmp(base + n - el, ext) == 0)
        n -= el;
    snprintf(name, cap, "%.*s", (int)n, base);
}

/*
 * Kimi's special range: ids n_ranks .. n_ranks + 257, named by `sp` (whose ids must lie there)
 * or `<|reserved_token_ID|>` (tokenization_kimi.py's name for the others, shown under
 * skip_special_tokens: they are no added tokens for transformers). *all_p (DUET__TOK_KIMI_N_SPECIAL
 * entries) and *names_p (their reserved texts) are malloc'd.
 */
static duet_status_t kimi_specials(const char *source, uint32_t n_ranks,
                                   const duet_tokenizer_special_t *sp, size_t n_sp,
                                   duet_tokenizer_special_t **all_p, char **names_p)
{
    enum { NAME_CAP = 32 };
    duet_tokenizer_special_t *all = calloc(DUET__TOK_KIMI_N_SPECIAL, sizeof(*all));
    char *names = malloc((size_t)DUET__TOK_KIMI_N_SPECIAL * NAME_CAP);
    if (all == NULL || names == NULL) {
        free(all);
        free(names);
        return DUET_FAIL(DUET_ERR_NOMEM, "%s: no memory", source);
    }
    for (uint32_t k = 0; k < DUET__TOK_KIMI_N_SPECIAL; k++) {
        char *name = names + (size_t)k * NAME_CAP;
        snprintf(name, NAME_CAP, "<|reserved_token_%u|>", n_ranks + k);
        all[k] = (duet_tokenizer_special_t){
            .text = name, .id = n_ranks + k, .flags = DUET_TOKENIZER_SPECIAL_SHOWN};
    }
    for (size_t i = 0; i < n_sp; i++) {
        if (sp[i].id < n_ranks || sp[i].id - n_ranks >= DUET__TOK_KIMI_N_SPECIAL) {
            free(all);
            free(names);
            return DUET_FAIL(DUET_ERR_INVALID,
                             "%s: special token \"%s\": id %u is %s Kimi's special range %u..%u "
                             "(the %u ids after the last rank)",
                             source, sp[i].text, sp[i].id,
                             sp[i].id < n_ranks ? "a rank, not in" : "outside", n_ranks,
                             n_ranks + DUET__TOK_KIMI_N_SPECIAL - 1, DUET__TOK_KIMI_N_SPECIAL);
        }
        all[sp[i].id - n_ranks] = sp[i];
    }
    *all_p = all;
    *names_p = names;
    return DUET_OK;
}

duet_status_t duet__tok_tiktoken_create(const char *rank_path, const char *pattern,
                                        const duet_tokenizer_special_t *specials, size_t n_specials,
                                        const char *sp_source, bool kimi, duet_tokenizer_t **tok_p)
{
    if (rank_path == NULL || pattern == NULL || tok_p == NULL ||
        (specials == NULL && n_specials > 0))
        return DUET_FAIL(DUET_ERR_INVALID, "tiktoken tokenizer: NULL argument");
    if (sp_source == NULL)
        sp_source = rank_path;
    if (n_specials > DUET__TOK_MAX_SPECIAL)
        return DUET_FAIL(DUET_ERR_INVALID, "%s: %zu special tokens (at most %d)", sp_source,
                         n_specials, DUET__TOK_MAX_SPECIAL);
    for (size_t i = 0; i < n_specials; i++)
        if (specials[i].text == NULL || specials[i].id > DUET_TOKENIZER_MAX_ID)
            return DUET_FAIL(DUET_ERR_INVALID, "%s: special token %zu: no text or id > %u",
                             sp_source, i, DUET_TOKENIZER_MAX_ID);

    duet_status_t st;
    uint8_t *data = NULL;
    size_t len = 0;
    duet__tok_entry_t *entries = NULL;
    duet_tokenizer_special_t *kimi_sp = NULL;
    char *kimi_names = NULL;
    duet_tokenizer_t *tok = calloc(1, sizeof(*tok));
    if (tok == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "%s: no memory", rank_path);
    tok->kind = DUET__TOK_KIND_TIKTOKEN;
    tok->bos_id = tok->eos_id = DUET__TOK_NONE;
    tok->kimi_split = kimi;
    st = read_file(rank_path, &data, &len);
    if (st < 0)
        goto fail_tok;
    /* A line holds at least "xxxx 0" (6 bytes, 3 decoded), so these bounds are never exceeded. */
    tok->blob = malloc(len + 1);
    entries = malloc((len / 6 + 1) * sizeof(*entries));
    if (tok->blob == NULL || entries == NULL) {
        st = DUET_FAIL(DUET_ERR_NOMEM, "%s: no memory", rank_path);
        goto fail_data;
    }
    size_t n = 0;
    uint32_t max_rank = 0;
    st = parse_ranks(tok, rank_path, data, len, entries, &n, &max_rank);
    if (st < 0)
        goto fail_data;
    if (kimi) {
        /* tokenization_kimi.py numbers its specials from len(ranks): ranks must leave no gap */
        if ((size_t)max_rank + 1 != n) {
            st = DUET_FAIL(DUET_ERR_FORMAT,
                           "%s: %zu ranks but the largest is %u: Kimi's tokenizer needs ranks "
                           "0..N-1 (its special tokens follow them)",
                           rank_path, n, max_rank);
            goto fail_data;
        }
        if (n + DUET__TOK_KIMI_N_SPECIAL - 1 > DUET_TOKENIZER_MAX_ID) {
            st = DUET_FAIL(DUET_ERR_FORMAT, "%s: %zu ranks leave no room for Kimi's specials",
                           rank_path, n);
            goto fail_data;
        }
        st = kimi_specials(sp_source, (uint32_t)n, specials, n_specials, &kimi_sp, &kimi_names);
        if (st < 0)
            goto fail_data;
        specials = kimi_sp;
        n_specials = DUET__TOK_KIMI_N_SPECIAL;
    }
    size_t special_bytes = 0;
    uint32_t max_id = max_rank;
    for (size_t i = 0; i < n_specials; i++) {
        special_bytes += strlen(specials[i].text);
        if (specials[i].id > max_id)
            max_id = specials[i].id;
    }
    uint8_t *blob = realloc(tok->blob, tok->blob_len + special_bytes + 1);
    if (blob == NULL) {
        st = DUET_FAIL(DUET_ERR_NOMEM, "%s: no memory", rank_path);
        goto fail_data;
    }
    tok->blob = blob;
    st = duet__tok_tables_alloc(tok, max_id + 1, n);
    if (st < 0)
        goto fail_data;
    st = index_ranks(tok, rank_path, entries, n);
    if (st < 0)
        goto fail_data;
    st = duet__tok_specials_add(tok, specials, n_specials, sp_source);
    if (st < 0)
        goto fail_data;
    st = duet__tok_regex_compile(tok, pattern, rank_path);
    if (st < 0)
        goto fail_data;
    free(kimi_names);
    free(kimi_sp);
    free(entries);
    free(data);
    DUET_LOG_DEBUG("%s: %zu tokens, %u specials, vocab size %u, regex JIT %s", rank_path, n,
                   tok->n_special, tok->vocab_size, tok->re_jit ? "on" : "off");
    *tok_p = tok;
    return DUET_OK;

fail_data:
    free(kimi_names);
    free(kimi_sp);
    free(entries);
    free(data);
fail_tok:
    duet_tokenizer_destroy(tok);
    return st;
}

duet_status_t duet_tokenizer_create_tiktoken(const char *rank_path, const char *pattern,
                                             const duet_tokenizer_special_t *specials,
                                             size_t n_specials, duet_tokenizer_t **tok_p)
{
    if (rank_path == NULL || tok_p == NULL || (specials == NULL && n_specials > 0))
        return DUET_FAIL(DUET_ERR_INVALID, "tiktoken tokenizer: NULL argument");
    char name[256];
    encoding_name(rank_path, name, sizeof(name));
    if (pattern == NULL) {
        pattern = duet_tokenizer_pattern(name);
        if (pattern == NULL)
            return DUET_FAIL(DUET_ERR_NOT_FOUND,
                             "%s: no built-in split regex for encoding \"%s\" (pass a pattern)",
                             rank_path, name);
    }
    if (specials == NULL) {
        for (size_t i = 0;
             i < sizeof(duet__tok_builtin_specials) / sizeof(duet__tok_builtin_specials[0]); i++) {
            if (strcmp(duet__tok_builtin_specials[i].name, name) == 0) {
                specials = duet__tok_builtin_specials[i].specials;
                n_specials = duet__tok_builtin_specials[i].n;
            }
        }
    }
    return duet__tok_tiktoken_create(rank_path, pattern, specials, n_specials, NULL,
                                     strcmp(name, "kimi") == 0, tok_p);
}
