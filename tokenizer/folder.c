/*
 * A model folder's tokenizer and stop ids: the one reader of duet_tokenizer.json, Kimi's
 * tokenizer files (tiktoken.model, tokenizer_config.json, special_tokens_map.json) and the
 * eos_token_id of config.json / generation_config.json, for the router (which links this library
 * alone), duet-generate and the tests.
 *
 * Every file comes from outside, so each is validated before use and a refusal names the file
 * and the field. What Kimi's files mean follows tokenization_kimi.py (TikTokenTokenizer): its
 * specials are the 258 ids after the last rank, named from added_tokens_decoder or
 * `<|reserved_token_ID|>`; bos_token / eos_token are texts of those specials, which the class
 * looks up in its special table (a text that is none is its KeyError, here an error).
 */
#include "tokenizer/tokenizer_impl.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/json.h"
#include "common/log.h"

#define DUET__TOK_MAX_JSON         DUET_JSON_DEFAULT_MAX_BYTES /* 16 MiB */
#define DUET__TOK_MAX_SPECIAL_TEXT 1024                        /* bytes of one special's text */
#define DUET__TOK_MAX_BYTE_SPECIAL 1024                        /* duet_tokenizer.json specials */

static bool is_file(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* A special token's text from JSON: a non-empty string without NUL, at most 1024 bytes. */
static duet_status_t special_text(const json_t *v, const char *file, const char *field,
                                  const char **text_p)
{
    if (!json_is_string(v))
        return duet_error_set(DUET_ERR_FORMAT, "%s: field \"%s\": expected a string, got %s", file,
                              field, duet_json_type_name(v));
    size_t len = json_string_length(v);
    const char *text = json_string_value(v);
    if (len == 0 || len > DUET__TOK_MAX_SPECIAL_TEXT || strlen(text) != len)
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: field \"%s\": a special token's text must be 1..%d bytes "
                              "without NUL (got %zu bytes)",
                              file, field, DUET__TOK_MAX_SPECIAL_TEXT, len);
    *text_p = text;
    return DUET_OK;
}

/* ---- duet_tokenizer.json --------------------------------------------------------------- */

static duet_status_t load_byte_json(const char *path, duet_tokenizer_t **tok_p)
{
    json_t *root = NULL;
    const char **names = NULL;
    duet_status_t st = duet_json_load_file(path, DUET__TOK_MAX_JSON, &root);
    if (st < 0) {
        DUET_LOG_ERROR("%s", duet_error_last());
        return st;
    }
    if (!json_is_object(root)) {
        st = DUET_FAIL(DUET_ERR_FORMAT, "%s: expected a JSON object, got %s", path,
                       duet_json_type_name(root));
        goto out;
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val)
    {
        if (strcmp(key, "type") != 0 && strcmp(key, "specials") != 0 &&
            strcmp(key, "add_bos") != 0) {
            st = DUET_FAIL(DUET_ERR_FORMAT,
                           "%s: unknown field \"%s\" (known: type, specials, add_bos)", path, key);
            goto out;
        }
    }
    const char *type = NULL;
    bool add_bos = false;
    json_t *specials = json_object_get(root, "specials");
    if ((st = duet_json_get_string(root, path, "type", &type)) < 0 ||
        (st = duet_json_get_bool_opt(root, path, "add_bos", false, &add_bos)) < 0) {
        DUET_LOG_ERROR("%s", duet_error_last());
        goto out;
    }
    if (strcmp(type, "byte") != 0) {
        st = DUET_FAIL(DUET_ERR_UNSUPPORTED,
                       "%s: field \"type\": \"%s\" is not supported (\"byte\")", path, type);
        goto out;
    }
    size_t n = 0;
    if (specials != NULL && !json_is_null(specials)) {
        if (!json_is_array(specials)) {
            st = DUET_FAIL(DUET_ERR_FORMAT, "%s: field \"specials\": expected an array, got %s",
                           path, duet_json_type_name(specials));
            goto out;
        }
        n = json_array_size(specials);
        if (n > DUET__TOK_MAX_BYTE_SPECIAL) {
            st = DUET_FAIL(DUET_ERR_RANGE, "%s: field \"specials\": %zu entries (at most %d)", path,
                           n, DUET__TOK_MAX_BYTE_SPECIAL);
            goto out;
        }
        names = calloc(n > 0 ? n : 1, sizeof(*names));
        if (names == NULL) {
            st = DUET_FAIL(DUET_ERR_NOMEM, "%s: no memory", path);
            goto out;
        }
        for (size_t i = 0; i < n; i++) {
            char field[32];
            snprintf(field, sizeof(field), "specials[%zu]", i);
            if ((st = special_text(json_array_get(specials, i), path, field, &names[i])) < 0) {
                DUET_LOG_ERROR("%s", duet_error_last());
                goto out;
            }
        }
    }
    st = duet_tokenizer_create_byte(names, n, tok_p);
    if (st < 0) {
        char why[512]; /* the detail lives in the buffer the new one is written to */
        snprintf(why, sizeof(why), "%s", duet_error_last());
        st = DUET_FAIL(st, "%s: %s", path, why);
        goto out;
    }
    (*tok_p)->add_bos = add_bos;
out:
    free(names);
    json_decref(root);
    return st;
}

/* ---- Kimi's layout ---------------------------------------------------------------------- */

/* The decimal id of an added_tokens_decoder key: digits only, no leading zero, <= MAX_ID. */
static bool parse_id(const char *key, uint32_t *id_p)
{
    if (key[0] < '0' || key[0] > '9' || (key[0] == '0' && key[1] != '\0'))
        return false;
    uint64_t v = 0;
    for (const char *p = key; *p != '\0'; p++) {
        if (*p < '0' || *p > '9')
            return false;
        v = v * 10 + (uint64_t)(*p - '0');
        if (v > DUET_TOKENIZER_MAX_ID)
            return false;
    }
    *id_p = (uint32_t)v;
    return true;
}

/* tokenizer_config.json's added_tokens_decoder: {"ID": {"content": TEXT, "special": bool}}. */
static duet_status_t read_added_tokens(const json_t *root, const char *file,
                                       duet_tokenizer_special_t **sp_p, size_t *n_p)
{
    const json_t *dec = json_object_get(root, "added_tokens_decoder");
    *sp_p = NULL;
    *n_p = 0;
    if (dec == NULL || json_is_null(dec))
        return DUET_OK;
    if (!json_is_object(dec))
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: field \"added_tokens_decoder\": expected an object, got %s",
                              file, duet_json_type_name(dec));
    size_t n = json_object_size(dec);
    if (n > DUET__TOK_KIMI_N_SPECIAL)
        return duet_error_set(DUET_ERR_RANGE,
                              "%s: field \"added_tokens_decoder\": %zu entries, but Kimi's "
                              "tokenizer has %u special ids",
                              file, n, DUET__TOK_KIMI_N_SPECIAL);
    duet_tokenizer_special_t *sp = calloc(n > 0 ? n : 1, sizeof(*sp));
    if (sp == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "%s: no memory", file);
    size_t i = 0;
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)dec, key, val)
    {
        char field[96];
        snprintf(field, sizeof(field), "added_tokens_decoder.%.40s", key);
        uint32_t id;
        if (!parse_id(key, &id)) {
            free(sp);
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s: field \"%s\": the key must be a token id (a decimal "
                                  "number up to %u)",
                                  file, field, DUET_TOKENIZER_MAX_ID);
        }
        if (!json_is_object(val)) {
            free(sp);
            return duet_error_set(DUET_ERR_FORMAT, "%s: field \"%s\": expected an object, got %s",
                                  file, field, duet_json_type_name(val));
        }
        char sub[128];
        snprintf(sub, sizeof(sub), "%s.content", field);
        const char *text = NULL;
        duet_status_t st = special_text(json_object_get(val, "content"), file, sub, &text);
        if (st < 0) {
            free(sp);
            return st;
        }
        const json_t *special = json_object_get(val, "special");
        if (special != NULL && !json_is_boolean(special)) {
            free(sp);
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s: field \"%s.special\": expected a "
                                  "boolean, got %s",
                                  file, field, duet_json_type_name(special));
        }
        sp[i++] = (duet_tokenizer_special_t){
            .text = text,
            .id = id,
            .flags = json_is_false(special) ? DUET_TOKENIZER_SPECIAL_SHOWN : 0,
        };
    }
    *sp_p = sp;
    *n_p = i;
    return DUET_OK;
}

/*
 * A bos_token / eos_token entry: a string, {"content": string, ...} (an AddedToken, as
 * transformers saves it), or null / absent (*text_p untouched).
 */
static duet_status_t read_token_text(const json_t *root, const char *file, const char *key,
                                     const char **text_p)
{
    const json_t *v = json_object_get(root, key);
    if (v == NULL || json_is_null(v))
        return DUET_OK;
    char field[64];
    snprintf(field, sizeof(field), "%s", key);
    if (json_is_object(v)) {
        snprintf(field, sizeof(field), "%s.content", key);
        v = json_object_get(v, "content");
    } else if (!json_is_string(v)) {
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: field \"%s\": expected a string or {\"content\": string}, got "
                              "%s",
                              file, key, duet_json_type_name(v));
    }
    return special_text(v, file, field, text_p);
}

/* The special id of a bos / eos text read from `file`. */
static duet_status_t token_id(const duet_tokenizer_t *tok, const char *file, const char *key,
                              const char *text, uint32_t *id_p)
{
    if (text == NULL)
        return DUET_OK;
    if (duet_tokenizer_special_id(tok, text, id_p) != DUET_OK)
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: field \"%s\": \"%s\" is not a special token of the tokenizer",
                              file, key, text);
    return DUET_OK;
}

/* Load an optional JSON object file (reals: tokenizer configs hold 1e30 as an integer). */
static duet_status_t load_object(const char *path, json_t **root_p)
{
    *root_p = NULL;
    if (!is_file(path))
        return DUET_OK;
    json_t *root = NULL;
    duet_status_t st = duet_json_load_file_reals(path, DUET__TOK_MAX_JSON, &root);
    if (st < 0)
        return st;
    if (!json_is_object(root)) {
        st = duet_error_set(DUET_ERR_FORMAT, "%s: expected a JSON object, got %s", path,
                            duet_json_type_name(root));
        json_decref(root);
        return st;
    }
    *root_p = root;
    return DUET_OK;
}

static duet_status_t load_kimi(const char *dir, const char *rank_path, duet_tokenizer_t **tok_p)
{
    char cfg_path[4096], map_path[4096];
    snprintf(cfg_path, sizeof(cfg_path), "%s/tokenizer_config.json", dir);
    snprintf(map_path, sizeof(map_path), "%s/special_tokens_map.json", dir);
    json_t *cfg = NULL, *map = NULL;
    duet_tokenizer_special_t *sp = NULL;
    size_t n_sp = 0;
    duet_tokenizer_t *tok = NULL;
    const char *bos = NULL, *eos = NULL;
    const char *bos_file = cfg_path, *eos_file = cfg_path;
    duet_status_t st = load_object(cfg_path, &cfg);
    if (st == DUET_OK)
        st = load_object(map_path, &map);
    if (st == DUET_OK && cfg != NULL)
        st = read_added_tokens(cfg, cfg_path, &sp, &n_sp);
    if (st == DUET_OK && cfg != NULL)
        st = read_token_text(cfg, cfg_path, "bos_token", &bos);
    if (st == DUET_OK && cfg != NULL)
        st = read_token_text(cfg, cfg_path, "eos_token", &eos);
    /* special_tokens_map.json overrides tokenizer_config.json, as in transformers */
    if (st == DUET_OK && map != NULL) {
        const char *b = NULL, *e = NULL;
        st = read_token_text(map, map_path, "bos_token", &b);
        if (st == DUET_OK)
            st = read_token_text(map, map_path, "eos_token", &e);
        if (b != NULL) {
            bos = b;
            bos_file = map_path;
        }
        if (e != NULL) {
            eos = e;
            eos_file = map_path;
        }
    }
    if (st < 0) {
        DUET_LOG_ERROR("%s", duet_error_last());
        goto out;
    }
    st = duet__tok_tiktoken_create(rank_path, duet_tokenizer_pattern("kimi"), sp, n_sp,
                                   cfg != NULL ? cfg_path : NULL, true, &tok);
    if (st < 0)
        goto out;
    if ((st = token_id(tok, bos_file, "bos_token", bos, &tok->bos_id)) < 0 ||
        (st = token_id(tok, eos_file, "eos_token", eos, &tok->eos_id)) < 0) {
        DUET_LOG_ERROR("%s", duet_error_last());
        duet_tokenizer_destroy(tok);
        goto out;
    }
    *tok_p = tok;
out:
    free(sp);
    json_decref(map);
    json_decref(cfg);
    return st;
}

/* ---- loading ---------------------------------------------------------------------------- */

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
    snprintf(file, sizeof(file), "%s/duet_tokenizer.json", path);
    if (is_file(file))
        return load_byte_json(file, tok_p);
    snprintf(file, sizeof(file), "%s/tiktoken.model", path);
    if (is_file(file))
        return load_kimi(path, file, tok_p);
    snprintf(file, sizeof(file), "%s/tokenizer.model", path);
    if (is_file(file))
        return load_kimi(path, file, tok_p);
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
    if (found !=
        1) /* not logged: a caller may go on without a tokenizer (duet-generate --tokens) */
        return duet_error_set(
            DUET_ERR_NOT_FOUND,
            "%s: no tokenizer: expected duet_tokenizer.json, tiktoken.model, "
            "tokenizer.model or exactly one *.tiktoken file (found %zu *.tiktoken)",
            path, found);
    return duet_tokenizer_create_tiktoken(file, NULL, NULL, 0, tok_p);
}

/* ---- stop ids ---------------------------------------------------------------------------- */

static duet_status_t add_stop(uint32_t id, const char *file, const char *field, uint32_t *ids,
                              size_t cap, size_t *n_p)
{
    for (size_t i = 0; i < *n_p; i++)
        if (ids[i] == id)
            return DUET_OK;
    if (*n_p == cap)
        return duet_error_set(DUET_ERR_RANGE, "%s: field \"%s\": more than %zu stop ids", file,
                              field, cap);
    ids[(*n_p)++] = id;
    return DUET_OK;
}

/* eos_token_id of one JSON file: an integer or a list of integers, each below `limit`. */
static duet_status_t file_stop_ids(const char *path, uint32_t limit, uint32_t *ids, size_t cap,
                                   size_t *n_p)
{
    if (!is_file(path))
        return DUET_OK;
    json_t *root = NULL;
    duet_status_t st = duet_json_load_file(path, DUET__TOK_MAX_JSON, &root);
    if (st < 0)
        return st;
    const json_t *eos = json_is_object(root) ? json_object_get(root, "eos_token_id") : NULL;
    if (!json_is_object(root)) {
        st = duet_error_set(DUET_ERR_FORMAT, "%s: expected a JSON object, got %s", path,
                            duet_json_type_name(root));
    } else if (json_is_array(eos)) {
        for (size_t i = 0; st == DUET_OK && i < json_array_size(eos); i++) {
            char field[48];
            snprintf(field, sizeof(field), "eos_token_id[%zu]", i);
            int64_t v = 0;
            st = duet_json_get_int(root, path, field, 0, (int64_t)limit - 1, &v);
            if (st == DUET_OK)
                st = add_stop((uint32_t)v, path, field, ids, cap, n_p);
        }
    } else if (eos != NULL && !json_is_null(eos)) {
        int64_t v = 0;
        if (!json_is_integer(eos))
            st = duet_error_set(DUET_ERR_FORMAT,
                                "%s: field \"eos_token_id\": expected an integer or a list of "
                                "integers, got %s",
                                path, duet_json_type_name(eos));
        else
            st = duet_json_get_int(root, path, "eos_token_id", 0, (int64_t)limit - 1, &v);
        if (st == DUET_OK)
            st = add_stop((uint32_t)v, path, "eos_token_id", ids, cap, n_p);
    }
    json_decref(root);
    return st;
}

duet_status_t duet_tokenizer_prompt_bos(const char *dir, const duet_tokenizer_t *tok,
                                        int32_t *bos_p)
{
    if (dir == NULL || tok == NULL || bos_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "prompt bos: NULL argument");
    if (!tok->add_bos) {
        *bos_p = -1;
        return DUET_OK;
    }
    if (tok->bos_id != DUET__TOK_NONE) {
        *bos_p = (int32_t)tok->bos_id;
        return DUET_OK;
    }
    char path[4096];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    json_t *root = NULL;
    duet_status_t st =
        is_file(path) ? duet_json_load_file(path, DUET__TOK_MAX_JSON, &root) : DUET_OK;
    const json_t *v = json_is_object(root) ? json_object_get(root, "bos_token_id") : NULL;
    int64_t bos = -1;
    if (st == DUET_OK && (v == NULL || json_is_null(v)))
        st = duet_error_set(DUET_ERR_NOT_FOUND,
                            "%s: the tokenizer adds a bos token to text prompts (add_bos) but "
                            "neither it nor config.json's \"bos_token_id\" names one",
                            dir);
    else if (st == DUET_OK)
        st = duet_json_get_int(root, path, "bos_token_id", 0, (int64_t)tok->vocab_size - 1, &bos);
    json_decref(root);
    if (st == DUET_OK)
        *bos_p = (int32_t)bos;
    return st;
}

duet_status_t duet_tokenizer_stop_ids(const char *dir, const duet_tokenizer_t *tok, uint32_t *ids,
                                      size_t cap, size_t *n_p)
{
    if (dir == NULL || (ids == NULL && cap > 0) || n_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "stop ids: NULL argument");
    uint32_t limit = tok != NULL ? tok->vocab_size : DUET_TOKENIZER_MAX_ID + 1;
    size_t n = 0;
    char path[4096];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    DUET_TRY(file_stop_ids(path, limit, ids, cap, &n));
    snprintf(path, sizeof(path), "%s/generation_config.json", dir);
    DUET_TRY(file_stop_ids(path, limit, ids, cap, &n));
    if (tok != NULL && tok->eos_id != DUET__TOK_NONE)
        DUET_TRY(add_stop(tok->eos_id, "tokenizer", "eos_token", ids, cap, &n));
    *n_p = n;
    return DUET_OK;
}
