/*
 * Loading tiktoken rank files: `base64(token_bytes) SP rank` per line, rank = token id.
 *
 * The file is untrusted input, so the parser is strict and every refusal names the file and the
 * line: bad base64, a missing or non-numeric rank, a rank too large for our id tables, a rank or
 * token given twice, an over-long line, an empty file, and a vocabulary without all 256 single
 * bytes (without them some inputs could not be encoded at all). Blank lines are skipped, as
 * tiktoken's own loader does. Built-in encodings (cl100k_base, o200k_base, ...) are recognised by
 * the file's name and bring their split regex and special tokens.
 */
#include "engine/tokenizer/tokenizer_impl.h"

#include <dirent.h>
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
    {"<|endoftext|>", 100257},  {"<|fim_prefix|>", 100258},  {"<|fim_middle|>", 100259},
    {"<|fim_suffix|>", 100260}, {"<|endofprompt|>", 100276},
};
static const duet_tokenizer_special_t duet__tok_o200k_specials[] = {
    {"<|endoftext|>", 199999},
    {"<|endofprompt|>", 200018},
};
static const duet_tokenizer_special_t duet__tok_r50k_specials[] = {
    {"<|endoftext|>", 50256},
};
static const duet_tokenizer_special_t duet__tok_p50k_specials[] = {
    {"<|endoftext|>", 50256},
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
            return DUET_FAIL(DUET_ERR_FORMAT, "%s:%zu: line of %zu bytes is longer than %d",
                                  path, line_no, ll, DUET__TOK_MAX_LINE);
        if (ll > 0 && line[ll - 1] == '\r')
            ll--;
        if (ll == 0)
            continue;
        const uint8_t *sp = memchr(line, ' ', ll);
        if (sp == NULL)
            return DUET_FAIL(DUET_ERR_FORMAT,
                                  "%s:%zu: missing rank (expected \"base64 rank\")", path, line_no);
        size_t b64_len = (size_t)(sp - line);
        const uint8_t *r = sp + 1;
        size_t r_len = ll - b64_len - 1;
        if (r_len == 0)
            return DUET_FAIL(DUET_ERR_FORMAT, "%s:%zu: missing rank", path, line_no);
        uint64_t rank = 0;
        for (size_t i = 0; i < r_len; i++) {
            if (r[i] < '0' || r[i] > '9')
                return DUET_FAIL(DUET_ERR_FORMAT,
                                      "%s:%zu: rank \"%.*s\" is not a decimal number", path,
                                      line_no, (int)(r_len > 32 ? 32 : r_len), (const char *)r);
            rank = rank * 10 + (uint64_t)(r[i] - '0');
            if (rank > DUET_TOKENIZER_MAX_ID)
                return DUET_FAIL(DUET_ERR_FORMAT, "%s:%zu: rank \"%.*s\" is larger than %u",
                                      path, line_no, (int)(r_len > 32 ? 32 : r_len),
                                      (const char *)r, DUET_TOKENIZER_MAX_ID);
        }
        if (b64_len > 4 * ((DUET__TOK_MAX_TOKEN + 2) / 3))
            return DUET_FAIL(DUET_ERR_FORMAT, "%s:%zu: token longer than %d bytes", path,
                                  line_no, DUET__TOK_MAX_TOKEN);
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
            st = DUET_FAIL(DUET_ERR_FORMAT, "%s:%u: duplicate rank %u (first at line %u)",
                                path, e->line, e->rank, line_of[e->rank]);
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

/* "cl100k_base" for ".../cl100k_base.tiktoken", "kimi" for ".../tokenizer.model". */
static void encoding_name(const char *path, char *name, size_t cap)
{
    const char *base = strrchr(path, '/');
    base = base != NULL ? base + 1 : path;
    if (strcmp(base, "tokenizer.model") == 0) {
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
                                  "%s: no built-in split regex for encoding \"%s\" "
                                  "(pass a pattern)",
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
    if (n_specials > DUET__TOK_MAX_SPECIAL)
        return DUET_FAIL(DUET_ERR_INVALID, "%s: %zu special tokens (at most %d)", rank_path,
                              n_specials, DUET__TOK_MAX_SPECIAL);
    size_t special_bytes = 0;
    uint32_t max_id = 0;
    for (size_t i = 0; i < n_specials; i++) {
        if (specials[i].text == NULL || specials[i].id > DUET_TOKENIZER_MAX_ID)
            return DUET_FAIL(DUET_ERR_INVALID, "%s: special token %zu: no text or id > %u",
                                  rank_path, i, DUET_TOKENIZER_MAX_ID);
        special_bytes += strlen(specials[i].text);
        if (specials[i].id > max_id)
            max_id = specials[i].id;
    }

    duet_status_t st;
    uint8_t *data = NULL;
    size_t len = 0;
    duet__tok_entry_t *entries = NULL;
    duet_tokenizer_t *tok = calloc(1, sizeof(*tok));
    if (tok == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "%s: no memory", rank_path);
    tok->kind = DUET__TOK_KIND_TIKTOKEN;
    st = read_file(rank_path, &data, &len);
    if (st < 0)
        goto fail_tok;
    /* A line holds at least "xxxx 0" (6 bytes, 3 decoded), so these bounds are never exceeded. */
    tok->blob = malloc(len + special_bytes + 1);
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
    if (max_rank > max_id)
        max_id = max_rank;
    st = duet__tok_tables_alloc(tok, max_id + 1, n);
    if (st < 0)
        goto fail_data;
    st = index_ranks(tok, rank_path, entries, n);
    if (st < 0)
        goto fail_data;
    st = duet__tok_specials_add(tok, specials, n_specials, rank_path);
    if (st < 0)
        goto fail_data;
    st = duet__tok_regex_compile(tok, pattern, rank_path);
    if (st < 0)
        goto fail_data;
    free(entries);
    free(data);
    DUET_LOG_DEBUG("%s: %zu tokens, %u specials, vocab size %u, regex JIT %s", rank_path, n,
                   tok->n_special, tok->vocab_size, tok->re_jit ? "on" : "off");
    *tok_p = tok;
    return DUET_OK;

fail_data:
    free(entries);
    free(data);
fail_tok:
    duet_tokenizer_destroy(tok);
    return st;
}

duet_status_t duet_tokenizer_load(const char *path, duet_tokenizer_t **tok_p)
{
    if (path == NULL || tok_p == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "tokenizer load: NULL argument");
    struct stat sb;
    if (stat(path, &sb) != 0)
        return DUET_FAIL(DUET_ERR_IO, "%s: %s", path, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return duet_tokenizer_create_tiktoken(path, NULL, NULL, 0, tok_p);

    char file[4096];
    snprintf(file, sizeof(file), "%s/tokenizer.model", path);
    if (stat(file, &sb) == 0 && S_ISREG(sb.st_mode))
        return duet_tokenizer_create_tiktoken(file, NULL, NULL, 0, tok_p);
    DIR *dir = opendir(path);
    if (dir == NULL)
        return DUET_FAIL(DUET_ERR_IO, "%s: %s", path, strerror(errno));
    size_t found = 0;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        size_t n = strlen(de->d_name);
        if (n > 9 && strcmp(de->d_name + n - 9, ".tiktoken") == 0) {
            if (found++ == 0)
                snprintf(file, sizeof(file), "%s/%s", path, de->d_name);
        }
    }
    closedir(dir);
    if (found != 1)
        return DUET_FAIL(DUET_ERR_NOT_FOUND,
                              "%s: expected tokenizer.model or exactly one "
                              "*.tiktoken file, found %zu *.tiktoken",
                              path, found);
    return duet_tokenizer_create_tiktoken(file, NULL, NULL, 0, tok_p);
}
