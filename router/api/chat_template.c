/*
 * Chat templates (see chat_template.h and CHAT_TEMPLATE.md).
 *
 * A template is compiled once into lists of parts: ordinary bytes, a special-token id, or a
 * {role} / {content} hole. The literal text of the template is split at special tokens by encoding
 * it with specials allowed and decoding the ordinary runs back to bytes (encoding is lossless),
 * so the tokenizer alone decides what a special token is. Applying a template appends ordinary
 * bytes to one pending buffer and encodes it only when a special id (or the end) cuts it: content
 * is never scanned for special-token text, and BPE merges across template text and content as it
 * would for the whole string.
 */
#include "router/api/chat_template.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/json.h"
#include "common/log.h"
#include "common/strbuf.h"
#include "router/api/jinja.h"

typedef enum {
    TPL_PART_TEXT = 0, /* off/len into the template's text blob */
    TPL_PART_SPECIAL,  /* id */
    TPL_PART_ROLE,     /* the role's name */
    TPL_PART_CONTENT,  /* the message's content */
} tpl_part_kind_t;

typedef struct {
    tpl_part_kind_t kind;
    uint32_t id;
    size_t off, len;
} tpl_part_t;

typedef struct {
    tpl_part_t *parts; /* (n) owned */
    size_t n;
} tpl_seq_t;

enum {
    TPL_SEQ_PREFIX = 0,
    TPL_SEQ_MSG_SYSTEM, /* + role: one per role */
    TPL_SEQ_MSG_USER,
    TPL_SEQ_MSG_ASSISTANT,
    TPL_SEQ_GENERATION,
    TPL_SEQ_COMPLETION,
    TPL_SEQ_COUNT,
};

struct duet_oai_template {
    const duet_tokenizer_t *tok; /* not owned; outlives the template */
    tpl_seq_t seq[TPL_SEQ_COUNT];
    char *blob; /* (blob_len) owned: the ordinary text of every TEXT part */
    size_t blob_len;
    duet_jinja_t *jinja; /* owned; non-NULL for a Jinja template (then seq[] is empty) */
    json_t *specials;    /* owned; Jinja: {"bos_token": "<s>", ...} the template sees */
    int32_t prompt_bos;  /* the id a /v1/completions text prompt starts with, -1 = none: the
                            model folder's rule (duet_tokenizer_prompt_bos), as duet-generate's */
};

static const char *const tpl_role_names[DUET_OAI_ROLE_COUNT] = {"system", "user", "assistant"};

const char *duet_oai_role_name(duet_oai_role_t role)
{
    if ((int)role < 0 || role >= DUET_OAI_ROLE_COUNT)
        return "unknown";
    return tpl_role_names[role];
}

/* ---------------------------------------------------------------- compiling */

static duet_status_t tpl_seq_push(tpl_seq_t *seq, tpl_part_t part)
{
    tpl_part_t *p = realloc(seq->parts, (seq->n + 1) * sizeof(*p));
    if (p == NULL)
        return DUET_ERR_NOMEM;
    p[seq->n++] = part;
    seq->parts = p;
    return DUET_OK;
}

/*
 * Template text may name special tokens: encode it with specials allowed, append the bytes of
 * the ordinary tokens to `text` and call on_special(user, id) at each special token, in order.
 * Shared by duet's format (compiled once) and Jinja output (rendered per request).
 */
static duet_status_t tpl_split_specials(const duet_tokenizer_t *tok, const char *s, size_t len,
                                        duet_strbuf_t *text,
                                        duet_status_t (*on_special)(void *user, uint32_t id),
                                        void *user)
{
    if (len == 0)
        return DUET_OK;
    uint32_t *ids = malloc(len * sizeof(*ids)); /* a token is at least one byte */
    if (ids == NULL)
        return DUET_ERR_NOMEM;
    size_t n = 0;
    duet_status_t st =
        duet_tokenizer_encode(tok, s, len, DUET_TOKENIZER_ALLOW_SPECIAL, ids, len, &n);
    for (size_t i = 0; st == DUET_OK && i < n; i++) {
        if (duet_tokenizer_is_special(tok, ids[i])) {
            st = on_special(user, ids[i]);
        } else {
            const uint8_t *b = NULL;
            size_t bl = 0;
            st = duet_tokenizer_token_bytes(tok, ids[i], &b, &bl);
            if (st == DUET_OK)
                st = duet_strbuf_append(text, (const char *)b, bl);
        }
    }
    free(ids);
    return st;
}

/* tpl_add_literal's state: ordinary bytes since `off` in the blob become one TEXT part. */
typedef struct {
    duet_strbuf_t *blob;
    tpl_seq_t *seq;
    size_t off;
} tpl_lit_t;

static duet_status_t tpl_lit_text(tpl_lit_t *l)
{
    duet_status_t st = DUET_OK;
    if (l->blob->len > l->off)
        st = tpl_seq_push(
            l->seq,
            (tpl_part_t){.kind = TPL_PART_TEXT, .off = l->off, .len = l->blob->len - l->off});
    l->off = l->blob->len;
    return st;
}

static duet_status_t tpl_lit_special(void *user, uint32_t id)
{
    tpl_lit_t *l = user;
    duet_status_t st = tpl_lit_text(l);
    if (st == DUET_OK)
        st = tpl_seq_push(l->seq, (tpl_part_t){.kind = TPL_PART_SPECIAL, .id = id});
    return st;
}

/* Append literal template text: split at special tokens into TEXT and SPECIAL parts. */
static duet_status_t tpl_add_literal(duet_oai_template_t *t, duet_strbuf_t *blob, tpl_seq_t *seq,
                                     const char *s, size_t len)
{
    tpl_lit_t l = {.blob = blob, .seq = seq, .off = blob->len};
    duet_status_t st = tpl_split_specials(t->tok, s, len, blob, tpl_lit_special, &l);
    return st == DUET_OK ? tpl_lit_text(&l) : st;
}

/*
 * Compile one format string. `holes` allows {role} and {content} (message templates only).
 * Errors are DUET_ERR_FORMAT with a detail naming source and key.
 */
static duet_status_t tpl_compile(duet_oai_template_t *t, duet_strbuf_t *blob, tpl_seq_t *seq,
                                 const char *fmt, bool holes, const char *source, const char *key)
{
    duet_strbuf_t lit;
    duet_strbuf_init(&lit);
    duet_status_t st = DUET_OK;
    for (size_t i = 0; fmt[i] != '\0' && st == DUET_OK; i++) {
        char c = fmt[i];
        if ((c == '{' && fmt[i + 1] == '{') || (c == '}' && fmt[i + 1] == '}')) {
            st = duet_strbuf_append(&lit, &c, 1);
            i++;
            continue;
        }
        if (c == '}') {
            st = duet_error_set(DUET_ERR_FORMAT,
                                "%s: \"%s\": lone '}' at byte %zu (write '}}' for a brace)", source,
                                key, i);
            break;
        }
        if (c != '{') {
            st = duet_strbuf_append(&lit, &c, 1);
            continue;
        }
        const char *end = strchr(fmt + i, '}');
        if (end == NULL) {
            st = duet_error_set(DUET_ERR_FORMAT,
                                "%s: \"%s\": unclosed '{' at byte %zu (write '{{' for a brace)",
                                source, key, i);
            break;
        }
        size_t nlen = (size_t)(end - (fmt + i + 1));
        tpl_part_kind_t kind;
        if (nlen == 4 && memcmp(fmt + i + 1, "role", 4) == 0)
            kind = TPL_PART_ROLE;
        else if (nlen == 7 && memcmp(fmt + i + 1, "content", 7) == 0)
            kind = TPL_PART_CONTENT;
        else {
            st = duet_error_set(DUET_ERR_FORMAT,
                                "%s: \"%s\": unknown placeholder {%.*s} (known: {role}, {content})",
                                source, key, (int)(nlen > 64 ? 64 : nlen), fmt + i + 1);
            break;
        }
        if (!holes) {
            st = duet_error_set(DUET_ERR_FORMAT,
                                "%s: \"%s\": placeholders are only allowed in message templates",
                                source, key);
            break;
        }
        st = tpl_add_literal(t, blob, seq, lit.data, lit.len);
        lit.len = 0;
        if (st == DUET_OK)
            st = tpl_seq_push(seq, (tpl_part_t){.kind = kind});
        i += nlen + 1;
    }
    if (st == DUET_OK)
        st = tpl_add_literal(t, blob, seq, lit.data, lit.len);
    duet_strbuf_free(&lit);
    if (st == DUET_ERR_NOMEM)
        duet_error_set(st, "%s: no memory", source);
    return st;
}

void duet_oai_template_destroy(duet_oai_template_t *tmpl)
{
    if (tmpl == NULL)
        return;
    for (int i = 0; i < TPL_SEQ_COUNT; i++)
        free(tmpl->seq[i].parts);
    free(tmpl->blob);
    duet_jinja_destroy(tmpl->jinja);
    json_decref(tmpl->specials);
    free(tmpl);
}

static const char *const tpl_keys[] = {
    "duet_chat_template", "prefix",           "message", "system", "user", "assistant",
    "generation_prompt",  "completion_prefix"};

duet_status_t duet_oai_template_create(const char *json, size_t len, const char *source,
                                       const duet_tokenizer_t *tok, duet_oai_template_t **tmpl_p)
{
    if (tok == NULL || tmpl_p == NULL || source == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "chat template: NULL argument (duet's format needs a "
                                           "tokenizer)");
    const char *prefix = "<|bos|>", *message = "{role}: {content}\n";
    const char *gen = "assistant: ", *cprefix = "";
    const char *per_role[DUET_OAI_ROLE_COUNT] = {NULL, NULL, NULL};
    json_t *root = NULL;
    duet_status_t st = DUET_OK;
    duet_strbuf_t blob;
    duet_strbuf_init(&blob);

    if (json == NULL) {
        uint32_t bos;
        if (duet_tokenizer_special_id(tok, "<|bos|>", &bos) != DUET_OK)
            return DUET_FAIL(DUET_ERR_NOT_FOUND,
                             "%s: the default chat template needs a <|bos|> special token, which "
                             "this tokenizer lacks; ship a chat_template.json (see "
                             "router/api/CHAT_TEMPLATE.md)",
                             source);
    } else {
        st = duet_json_load_buffer(json, len, source, DUET_JSON_DEFAULT_MAX_BYTES, &root);
        if (st != DUET_OK)
            goto fail;
        if (!json_is_object(root)) {
            st = duet_error_set(DUET_ERR_FORMAT, "%s: expected a JSON object, got %s", source,
                                duet_json_type_name(root));
            goto fail;
        }
        int64_t version = 0;
        if (json_object_get(root, "duet_chat_template") == NULL &&
            json_object_get(root, "chat_template") != NULL) {
            st =
                duet_error_set(DUET_ERR_UNSUPPORTED,
                               "%s: holds a Jinja \"chat_template\"; Jinja is not supported: write "
                               "duet's own chat_template.json (see router/api/CHAT_TEMPLATE.md)",
                               source);
            goto fail;
        }
        st = duet_json_get_int(root, source, "duet_chat_template", INT64_MIN, INT64_MAX, &version);
        if (st != DUET_OK)
            goto fail;
        if (version != 1) {
            st = duet_error_set(DUET_ERR_UNSUPPORTED,
                                "%s: duet_chat_template version %lld is not supported (only 1)",
                                source, (long long)version);
            goto fail;
        }
        const char *key;
        json_t *val;
        json_object_foreach(root, key, val)
        {
            bool known = false;
            for (size_t k = 0; k < sizeof(tpl_keys) / sizeof(tpl_keys[0]); k++)
                known = known || strcmp(key, tpl_keys[k]) == 0;
            if (!known) {
                st = duet_error_set(DUET_ERR_FORMAT, "%s: unknown key \"%s\"", source, key);
                goto fail;
            }
            if (strcmp(key, "duet_chat_template") != 0 && json_is_string(val) &&
                strlen(json_string_value(val)) != json_string_length(val)) {
                st = duet_error_set(DUET_ERR_FORMAT, "%s: \"%s\" contains a NUL character", source,
                                    key);
                goto fail;
            }
        }
        if ((st = duet_json_get_string_opt(root, source, "prefix", "", &prefix)) != DUET_OK ||
            (st = duet_json_get_string_opt(root, source, "message", message, &message)) !=
                DUET_OK ||
            (st = duet_json_get_string_opt(root, source, "generation_prompt", "", &gen)) !=
                DUET_OK ||
            (st = duet_json_get_string_opt(root, source, "completion_prefix", "", &cprefix)) !=
                DUET_OK)
            goto fail;
        for (int r = 0; r < DUET_OAI_ROLE_COUNT; r++)
            if ((st = duet_json_get_string_opt(root, source, tpl_role_names[r], NULL,
                                               &per_role[r])) != DUET_OK)
                goto fail;
    }

    duet_oai_template_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        st = duet_error_set(DUET_ERR_NOMEM, "%s: no memory", source);
        goto fail;
    }
    t->tok = tok;
    t->prompt_bos = -1;
    st = tpl_compile(t, &blob, &t->seq[TPL_SEQ_PREFIX], prefix, false, source, "prefix");
    for (int r = 0; r < DUET_OAI_ROLE_COUNT && st == DUET_OK; r++)
        st = tpl_compile(t, &blob, &t->seq[TPL_SEQ_MSG_SYSTEM + r],
                         per_role[r] != NULL ? per_role[r] : message, true, source,
                         per_role[r] != NULL ? tpl_role_names[r] : "message");
    if (st == DUET_OK)
        st = tpl_compile(t, &blob, &t->seq[TPL_SEQ_GENERATION], gen, false, source,
                         "generation_prompt");
    if (st == DUET_OK)
        st = tpl_compile(t, &blob, &t->seq[TPL_SEQ_COMPLETION], cprefix, false, source,
                         "completion_prefix");
    if (st != DUET_OK) {
        duet_oai_template_destroy(t);
        goto fail;
    }
    t->blob_len = blob.len;
    t->blob = blob.len > 0 ? duet_strbuf_detach(&blob) : NULL;
    if (blob.len > 0 && t->blob == NULL) {
        duet_oai_template_destroy(t);
        st = duet_error_set(DUET_ERR_NOMEM, "%s: no memory", source);
        goto fail;
    }
    duet_strbuf_free(&blob);
    json_decref(root);
    *tmpl_p = t;
    return DUET_OK;

fail:
    duet_strbuf_free(&blob);
    json_decref(root);
    DUET_LOG_ERROR("%s", duet_error_last());
    return st;
}

/* The special-token strings transformers passes to a template (its special_tokens_map). */
static const char *const tpl_special_keys[] = {
    "bos_token", "eos_token", "unk_token",  "sep_token",
    "pad_token", "cls_token", "mask_token", "additional_special_tokens"};

/* A token as tokenizer_config.json writes it: a string, or {"content": "..."}; NULL otherwise. */
static const char *tpl_token_text(const json_t *v)
{
    if (json_is_object(v))
        v = json_object_get(v, "content");
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* Add to `specials` the tokens `config` has that it lacks yet. */
static duet_status_t tpl_add_specials(json_t *specials, const json_t *config)
{
    if (!json_is_object(config))
        return DUET_OK;
    for (size_t k = 0; k < sizeof(tpl_special_keys) / sizeof(tpl_special_keys[0]); k++) {
        const char *key = tpl_special_keys[k];
        const json_t *v = json_object_get(config, key);
        if (v == NULL || json_object_get(specials, key) != NULL)
            continue;
        json_t *val = NULL;
        if (json_is_array(v)) {
            val = json_array();
            size_t i;
            const json_t *item;
            json_array_foreach(v, i, item)
            {
                const char *t = tpl_token_text(item);
                if (val != NULL && t != NULL && json_array_append_new(val, json_string(t)) != 0)
                    return DUET_ERR_NOMEM;
            }
        } else if (tpl_token_text(v) != NULL) {
            val = json_string(tpl_token_text(v));
        } else {
            continue; /* null or a shape transformers would not pass either */
        }
        if (val == NULL || json_object_set_new(specials, key, val) != 0)
            return DUET_ERR_NOMEM;
    }
    return DUET_OK;
}

duet_status_t duet_oai_template_create_jinja(const char *text, size_t len, const char *source,
                                             const json_t *config, const duet_tokenizer_t *tok,
                                             duet_oai_template_t **tmpl_p)
{
    if ((text == NULL && len > 0) || source == NULL || tmpl_p == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "chat template: NULL argument");
    duet_oai_template_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "%s: no memory", source);
    t->tok = tok;
    t->prompt_bos = -1;
    duet_status_t st = duet_jinja_parse(text, len, source, &t->jinja);
    if (st != DUET_OK) {
        DUET_LOG_ERROR("%s", duet_error_last());
        duet_oai_template_destroy(t);
        return st;
    }
    t->specials = json_object();
    if (t->specials == NULL || tpl_add_specials(t->specials, config) != DUET_OK) {
        duet_oai_template_destroy(t);
        return DUET_FAIL(DUET_ERR_NOMEM, "%s: no memory", source);
    }
    *tmpl_p = t;
    return DUET_OK;
}

duet_status_t duet_oai_template_set_token(duet_oai_template_t *tmpl, const char *name,
                                          const char *value)
{
    if (tmpl == NULL || tmpl->jinja == NULL || name == NULL || value == NULL)
        return duet_error_set(DUET_ERR_INVALID, "chat template: special tokens are set only on "
                                                "a Jinja template");
    if (json_object_set_new(tmpl->specials, name, json_string(value)) != 0)
        return duet_error_set(DUET_ERR_NOMEM, "chat template: no memory");
    return DUET_OK;
}

bool duet_oai_template_is_jinja(const duet_oai_template_t *tmpl)
{
    return tmpl != NULL && tmpl->jinja != NULL;
}

static bool tpl_file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

static duet_status_t tpl_load(const char *dir, const duet_tokenizer_t *tok,
                              duet_oai_template_t **tmpl_p)
{
    if (dir == NULL || tmpl_p == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "chat template: NULL argument");
    duet_strbuf_t path;
    duet_strbuf_init(&path);
    duet_status_t st = duet_strbuf_printf(&path, "%s/chat_template.json", dir);
    if (st != DUET_OK)
        return DUET_FAIL(st, "chat template: no memory");

    if (tpl_file_exists(path.data)) {
        if (tok == NULL) {
            duet_strbuf_free(&path);
            return DUET_FAIL(DUET_ERR_INVALID,
                             "%s/chat_template.json: duet's format needs a "
                             "tokenizer",
                             dir);
        }
        duet_strbuf_t text;
        duet_strbuf_init(&text);
        st = duet_strbuf_read_file(&text, path.data, DUET_JSON_DEFAULT_MAX_BYTES);
        if (st == DUET_OK)
            st = duet_oai_template_create(text.data != NULL ? text.data : "", text.len, path.data,
                                          tok, tmpl_p);
        else
            DUET_LOG_ERROR("%s", duet_error_last());
        duet_strbuf_free(&text);
        duet_strbuf_free(&path);
        return st;
    }

    /* Jinja: chat_template.jinja beside tokenizer_config.json (newer transformers), else the
     * config's string "chat_template". bos/eos come from the config either way. */
    path.len = 0;
    st = duet_strbuf_printf(&path, "%s/tokenizer_config.json", dir);
    json_t *root = NULL;
    if (st == DUET_OK && tpl_file_exists(path.data)) {
        /* reals: transformers writes an unbounded model_max_length as 1e30, past int64 */
        st = duet_json_load_file_reals(path.data, DUET_JSON_DEFAULT_MAX_BYTES, &root);
        if (st != DUET_OK) {
            DUET_LOG_ERROR("%s", duet_error_last());
            duet_strbuf_free(&path);
            return st;
        }
        if (!json_is_object(root)) {
            json_decref(root);
            root = NULL;
        }
    }
    duet_strbuf_t jpath, jtext;
    duet_strbuf_init(&jpath);
    duet_strbuf_init(&jtext);
    const char *jsrc = NULL;
    size_t jlen = 0;
    st = duet_strbuf_printf(&jpath, "%s/chat_template.jinja", dir);
    if (st == DUET_OK && tpl_file_exists(jpath.data)) {
        st = duet_strbuf_read_file(&jtext, jpath.data, DUET_JSON_DEFAULT_MAX_BYTES);
        jsrc = jtext.data != NULL ? jtext.data : "";
        jlen = jtext.len;
    } else if (st == DUET_OK && root != NULL) {
        json_t *ct = json_object_get(root, "chat_template");
        if (ct != NULL && !json_is_null(ct) && !json_is_string(ct)) {
            st =
                duet_error_set(DUET_ERR_UNSUPPORTED,
                               "%s: \"chat_template\" is %s; only a string (one Jinja template) is "
                               "supported",
                               path.data, duet_json_type_name(ct));
        } else if (json_is_string(ct)) {
            jsrc = json_string_value(ct);
            jlen = json_string_length(ct);
            jpath.len = 0;
            st = duet_strbuf_printf(&jpath, "%s:chat_template", path.data);
        }
    }
    if (st == DUET_OK && jsrc != NULL) {
        /* The token strings: special_tokens_map.json's win over tokenizer_config.json's, as in
         * transformers and in the tokenizer's own loader (tokenizer). */
        path.len = 0;
        json_t *map = NULL;
        if (duet_strbuf_printf(&path, "%s/special_tokens_map.json", dir) == DUET_OK &&
            tpl_file_exists(path.data))
            st = duet_json_load_file(path.data, DUET_JSON_DEFAULT_MAX_BYTES, &map);
        if (st == DUET_OK)
            st = duet_oai_template_create_jinja(jsrc, jlen, jpath.data, map, tok, tmpl_p);
        if (st == DUET_OK && tpl_add_specials((*tmpl_p)->specials, root) != DUET_OK) {
            st = duet_error_set(DUET_ERR_NOMEM, "%s: no memory", dir);
            duet_oai_template_destroy(*tmpl_p);
            *tmpl_p = NULL;
        }
        json_decref(map);
        if (st != DUET_OK)
            DUET_LOG_ERROR("%s", duet_error_last());
    } else if (st != DUET_OK)
        DUET_LOG_ERROR("%s", duet_error_last());
    json_decref(root);
    duet_strbuf_free(&jtext);
    if (st != DUET_OK || jsrc != NULL) {
        duet_strbuf_free(&jpath);
        duet_strbuf_free(&path);
        return st;
    }
    duet_strbuf_free(&jpath);
    duet_strbuf_free(&path);
    if (tok == NULL)
        return DUET_FAIL(DUET_ERR_NOT_FOUND,
                         "%s: no Jinja chat template (chat_template.jinja or "
                         "tokenizer_config.json's \"chat_template\")",
                         dir);
    return duet_oai_template_create(NULL, 0, "default chat template", tok, tmpl_p);
}

duet_status_t duet_oai_template_load(const char *dir, const duet_tokenizer_t *tok,
                                     duet_oai_template_t **tmpl_p)
{
    duet_status_t st = tpl_load(dir, tok, tmpl_p);
    if (st == DUET_OK && tok != NULL &&
        (st = duet_tokenizer_prompt_bos(dir, tok, &(*tmpl_p)->prompt_bos)) != DUET_OK) {
        DUET_LOG_ERROR("%s", duet_error_last());
        duet_oai_template_destroy(*tmpl_p);
        *tmpl_p = NULL;
    }
    return st;
}

/* ---------------------------------------------------------------- applying */

/* Ids being built: ordinary bytes wait in `text` until a special id or the end cuts them. */
typedef struct {
    const duet_tokenizer_t *tok;
    duet_strbuf_t text;
    uint32_t *ids;
    size_t n, cap;
} tpl_out_t;

static duet_status_t tpl_out_reserve(tpl_out_t *o, size_t more)
{
    if (more > SIZE_MAX / sizeof(uint32_t) - o->n)
        return DUET_ERR_NOMEM;
    if (o->n + more <= o->cap)
        return DUET_OK;
    size_t cap = o->cap * 2 > o->n + more ? o->cap * 2 : o->n + more;
    uint32_t *ids = realloc(o->ids, cap * sizeof(*ids));
    if (ids == NULL)
        return DUET_ERR_NOMEM;
    o->ids = ids;
    o->cap = cap;
    return DUET_OK;
}

static duet_status_t tpl_out_flush(tpl_out_t *o)
{
    duet_status_t st = duet_strbuf_status(&o->text);
    if (st != DUET_OK || o->text.len == 0)
        return st;
    st = tpl_out_reserve(o, o->text.len); /* a token is at least one byte */
    size_t n = 0;
    if (st == DUET_OK)
        st = duet_tokenizer_encode(o->tok, o->text.data, o->text.len, 0, o->ids + o->n,
                                   o->cap - o->n, &n);
    if (st == DUET_OK)
        o->n += n;
    o->text.len = 0;
    return st;
}

static duet_status_t tpl_out_special(tpl_out_t *o, uint32_t id)
{
    duet_status_t st = tpl_out_flush(o);
    if (st == DUET_OK)
        st = tpl_out_reserve(o, 1);
    if (st == DUET_OK)
        o->ids[o->n++] = id;
    return st;
}

static duet_status_t tpl_out_seq(tpl_out_t *o, const duet_oai_template_t *t, const tpl_seq_t *seq,
                                 const duet_oai_message_t *msg)
{
    duet_status_t st = DUET_OK;
    for (size_t i = 0; i < seq->n && st == DUET_OK; i++) {
        const tpl_part_t *p = &seq->parts[i];
        switch (p->kind) {
        case TPL_PART_TEXT:
            st = duet_strbuf_append(&o->text, t->blob + p->off, p->len);
            break;
        case TPL_PART_SPECIAL:
            st = tpl_out_special(o, p->id);
            break;
        case TPL_PART_ROLE:
            st = duet_strbuf_puts(&o->text, duet_oai_role_name(msg->role));
            break;
        case TPL_PART_CONTENT:
            st = duet_strbuf_append(&o->text, msg->content, msg->content_len);
            break;
        }
    }
    return st;
}

static duet_status_t tpl_out_finish(tpl_out_t *o, duet_status_t st, uint32_t **ids_p, size_t *n_p)
{
    if (st == DUET_OK)
        st = tpl_out_flush(o);
    duet_strbuf_free(&o->text);
    if (st != DUET_OK) {
        free(o->ids);
        if (st == DUET_ERR_NOMEM)
            return DUET_FAIL(st, "chat template: no memory");
        return st;
    }
    *ids_p = o->ids;
    *n_p = o->n;
    return DUET_OK;
}

/*
 * Template-origin text: split at special tokens (encoded with specials allowed); the ordinary
 * runs go back to bytes in the pending buffer so BPE still merges across template and content.
 */
static duet_status_t tpl_out_special_cb(void *user, uint32_t id)
{
    return tpl_out_special(user, id);
}

static duet_status_t tpl_out_trusted(tpl_out_t *o, const char *s, size_t len)
{
    return tpl_split_specials(o->tok, s, len, &o->text, tpl_out_special_cb, o);
}

/* The variables transformers' render_jinja_template passes: messages, tools, documents,
 * add_generation_prompt, the special tokens (trusted, so TEMPLATE), then the caller's keyword
 * arguments (DATA), which win over the special tokens as they do there. */
static duet_status_t tpl_jinja_vars(const duet_oai_template_t *t, const duet_oai_chat_t *chat,
                                    duet_jinja_vars_t *vars)
{
    duet_jinja_value_t *v = NULL;
    duet_status_t st;
    if (!json_is_array(chat->messages))
        return duet_error_set(DUET_ERR_INVALID, "chat template: messages must be an array");
    if (chat->tools != NULL && !json_is_array(chat->tools))
        return duet_error_set(DUET_ERR_INVALID, "chat template: tools must be an array");
    if (chat->documents != NULL && !json_is_array(chat->documents))
        return duet_error_set(DUET_ERR_INVALID, "chat template: documents must be an array");
    if (chat->kwargs != NULL && !json_is_object(chat->kwargs))
        return duet_error_set(DUET_ERR_INVALID,
                              "chat template: the keyword arguments must be an object");
    if ((st = duet_jinja_from_json(vars, chat->messages, DUET_JINJA_ORIGIN_DATA, &v)) != DUET_OK ||
        (st = duet_jinja_vars_set(vars, "messages", v)) != DUET_OK)
        return st;
    if (chat->tools != NULL)
        st = duet_jinja_from_json(vars, chat->tools, DUET_JINJA_ORIGIN_DATA, &v);
    else
        st = (v = duet_jinja_none(vars)) != NULL ? DUET_OK : DUET_ERR_NOMEM;
    if (st == DUET_OK && (st = duet_jinja_vars_set(vars, "tools", v)) != DUET_OK)
        return st;
    if (chat->documents != NULL)
        st = duet_jinja_from_json(vars, chat->documents, DUET_JINJA_ORIGIN_DATA, &v);
    else
        st = (v = duet_jinja_none(vars)) != NULL ? DUET_OK : DUET_ERR_NOMEM;
    duet_jinja_value_t *gen = duet_jinja_bool(vars, chat->add_generation_prompt);
    if (st == DUET_OK && gen == NULL)
        st = DUET_ERR_NOMEM;
    if (st == DUET_OK &&
        ((st = duet_jinja_vars_set(vars, "documents", v)) != DUET_OK ||
         (st = duet_jinja_vars_set(vars, "add_generation_prompt", gen)) != DUET_OK))
        return st;
    const char *key;
    json_t *val;
    json_object_foreach(t->specials, key, val)
    {
        if (st != DUET_OK)
            break;
        if ((st = duet_jinja_from_json(vars, val, DUET_JINJA_ORIGIN_TEMPLATE, &v)) == DUET_OK)
            st = duet_jinja_vars_set(vars, key, v);
    }
    if (chat->kwargs != NULL) {
        json_object_foreach((json_t *)chat->kwargs, key, val)
        {
            if (st != DUET_OK)
                break;
            if (strcmp(key, "messages") == 0 || strcmp(key, "tools") == 0 ||
                strcmp(key, "documents") == 0 || strcmp(key, "add_generation_prompt") == 0)
                return duet_error_set(DUET_ERR_INVALID,
                                      "chat template: got multiple values for keyword argument "
                                      "'%s'",
                                      key);
            if ((st = duet_jinja_from_json(vars, val, DUET_JINJA_ORIGIN_DATA, &v)) == DUET_OK)
                st = duet_jinja_vars_set(vars, key, v);
        }
    }
    duet_jinja_vars_set_time(vars, chat->now);
    if (st == DUET_ERR_NOMEM && duet_error_last()[0] == '\0')
        duet_error_set(st, "chat template: no memory");
    return st;
}

duet_status_t duet_oai_template_render(const duet_oai_template_t *tmpl, const duet_oai_chat_t *chat,
                                       duet_jinja_output_t *out)
{
    return duet__oai_template_render_limits(tmpl, chat, NULL, out);
}

duet_status_t duet__oai_template_render_limits(const duet_oai_template_t *tmpl,
                                               const duet_oai_chat_t *chat,
                                               const duet_jinja_limits_t *lim,
                                               duet_jinja_output_t *out)
{
    if (out != NULL)
        memset(out, 0, sizeof(*out));
    if (tmpl == NULL || chat == NULL || out == NULL || tmpl->jinja == NULL)
        return duet_error_set(DUET_ERR_INVALID, "chat template: render needs a Jinja template");
    duet_jinja_vars_t *vars = NULL;
    duet_status_t st = duet_jinja_vars_create(0, &vars);
    if (st != DUET_OK)
        return duet_error_set(st, "chat template: no memory");
    duet_error_clear();
    st = tpl_jinja_vars(tmpl, chat, vars);
    if (st == DUET_OK)
        st = duet_jinja_render(tmpl->jinja, vars, lim, out);
    duet_jinja_vars_destroy(vars);
    return st;
}

/* Template-origin text is split at special tokens; data is ordinary text. */
static duet_status_t tpl_jinja_tokens(tpl_out_t *o, const duet_oai_template_t *t,
                                      const duet_oai_chat_t *chat)
{
    duet_jinja_output_t out;
    duet_status_t st = duet_oai_template_render(t, chat, &out);
    if (st != DUET_OK) {
        if (st != DUET_ERR_NOMEM)
            DUET_LOG_WARN("%s", duet_error_last());
        return st;
    }
    for (size_t i = 0; st == DUET_OK && i < out.n_segs; i++) {
        const duet_jinja_segment_t *sg = &out.segs[i];
        if (sg->origin == DUET_JINJA_ORIGIN_TEMPLATE)
            st = tpl_out_trusted(o, out.text.data + sg->off, sg->len);
        else
            st = duet_strbuf_append(&o->text, out.text.data + sg->off, sg->len);
    }
    duet_jinja_output_free(&out);
    return st;
}

duet_status_t duet_oai_chat_prompt_json(const duet_oai_template_t *tmpl,
                                        const duet_tokenizer_t *tok, const duet_oai_chat_t *chat,
                                        uint32_t **ids_p, size_t *n_p)
{
    if (tmpl == NULL || tok == NULL || chat == NULL || ids_p == NULL || n_p == NULL ||
        tmpl->jinja == NULL || (tmpl->tok != NULL && tmpl->tok != tok))
        return DUET_FAIL(DUET_ERR_INVALID, "chat template: bad arguments");
    tpl_out_t o = {.tok = tok};
    duet_strbuf_init(&o.text);
    duet_status_t st = tpl_jinja_tokens(&o, tmpl, chat);
    if (st != DUET_OK) {
        duet_strbuf_free(&o.text);
        free(o.ids);
        return st; /* the render's detail stays in duet_error_last() */
    }
    return tpl_out_finish(&o, st, ids_p, n_p);
}

/* duet_oai_chat_prompt's messages as the OpenAI JSON a Jinja template reads. */
static json_t *tpl_messages_json(const duet_oai_message_t *msgs, size_t n_msgs)
{
    json_t *arr = json_array();
    for (size_t i = 0; arr != NULL && i < n_msgs; i++) {
        json_t *m = json_object();
        if (m == NULL || json_array_append_new(arr, m) != 0 ||
            json_object_set_new(m, "role", json_string(duet_oai_role_name(msgs[i].role))) != 0 ||
            json_object_set_new(m, "content", json_stringn(msgs[i].content, msgs[i].content_len)) !=
                0) {
            json_decref(arr);
            return NULL;
        }
    }
    return arr;
}

duet_status_t duet_oai_chat_prompt(const duet_oai_template_t *tmpl, const duet_tokenizer_t *tok,
                                   const duet_oai_message_t *msgs, size_t n_msgs, uint32_t **ids_p,
                                   size_t *n_p)
{
    return duet_oai_chat_prompt_ex(tmpl, tok, msgs, n_msgs, true, ids_p, n_p);
}

duet_status_t duet_oai_chat_prompt_ex(const duet_oai_template_t *tmpl, const duet_tokenizer_t *tok,
                                      const duet_oai_message_t *msgs, size_t n_msgs,
                                      bool add_generation_prompt, uint32_t **ids_p, size_t *n_p)
{
    if (tmpl == NULL || tok == NULL || (msgs == NULL && n_msgs > 0) || ids_p == NULL ||
        n_p == NULL || tmpl->tok != tok)
        return DUET_FAIL(DUET_ERR_INVALID, "chat template: bad arguments");
    if (tmpl->jinja != NULL) {
        for (size_t i = 0; i < n_msgs; i++)
            if ((int)msgs[i].role < 0 || msgs[i].role >= DUET_OAI_ROLE_COUNT)
                return DUET_FAIL(DUET_ERR_INVALID, "chat template: message %zu has a bad role", i);
        json_t *arr = tpl_messages_json(msgs, n_msgs);
        if (arr == NULL)
            return DUET_FAIL(DUET_ERR_NOMEM, "chat template: no memory");
        duet_oai_chat_t chat = {.messages = arr, .add_generation_prompt = add_generation_prompt};
        duet_status_t st = duet_oai_chat_prompt_json(tmpl, tok, &chat, ids_p, n_p);
        json_decref(arr);
        return st;
    }
    tpl_out_t o = {.tok = tok};
    duet_strbuf_init(&o.text);
    duet_status_t st = tpl_out_seq(&o, tmpl, &tmpl->seq[TPL_SEQ_PREFIX], NULL);
    for (size_t i = 0; i < n_msgs && st == DUET_OK; i++) {
        if ((int)msgs[i].role < 0 || msgs[i].role >= DUET_OAI_ROLE_COUNT) {
            st = DUET_FAIL(DUET_ERR_INVALID, "chat template: message %zu has a bad role", i);
            break;
        }
        st = tpl_out_seq(&o, tmpl, &tmpl->seq[TPL_SEQ_MSG_SYSTEM + msgs[i].role], &msgs[i]);
    }
    if (st == DUET_OK && add_generation_prompt)
        st = tpl_out_seq(&o, tmpl, &tmpl->seq[TPL_SEQ_GENERATION], NULL);
    return tpl_out_finish(&o, st, ids_p, n_p);
}

duet_status_t duet_oai_completion_prompt(const duet_oai_template_t *tmpl,
                                         const duet_tokenizer_t *tok, const char *text, size_t len,
                                         uint32_t **ids_p, size_t *n_p)
{
    if (tmpl == NULL || tok == NULL || (text == NULL && len > 0) || ids_p == NULL || n_p == NULL ||
        tmpl->tok != tok)
        return DUET_FAIL(DUET_ERR_INVALID, "completion prompt: bad arguments");
    tpl_out_t o = {.tok = tok};
    duet_strbuf_init(&o.text);
    duet_status_t st = DUET_OK;
    if (tmpl->prompt_bos >= 0)
        st = tpl_out_special(&o, (uint32_t)tmpl->prompt_bos);
    if (st == DUET_OK)
        st = tpl_out_seq(&o, tmpl, &tmpl->seq[TPL_SEQ_COMPLETION], NULL);
    if (st == DUET_OK && len > 0)
        st = duet_strbuf_append(&o.text, text, len);
    return tpl_out_finish(&o, st, ids_p, n_p);
}
