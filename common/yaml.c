/* One libyaml document, walked strictly and within bounds; see common/yaml.h. */
#include "common/yaml.h"

#include <string.h>

duet_status_t duet_yaml_load(duet_yaml_walk_t *w, const char *text, size_t len, size_t max_bytes,
                             duet_yaml_root_fn fn, void *user)
{
    const char *name = w->name;
    if (len > max_bytes)
        return duet_error_set(DUET_ERR_RANGE, "%s: %zu bytes exceeds the limit of %zu", name, len,
                              max_bytes);
    yaml_parser_t parser;
    yaml_document_t doc;
    duet_status_t st = DUET_OK;
    if (!yaml_parser_initialize(&parser))
        return duet_error_set(DUET_ERR_NOMEM, "%s: cannot initialise the YAML parser", name);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (!yaml_parser_load(&parser, &doc)) {
        st = duet_error_set(DUET_ERR_FORMAT, "%s:%zu:%zu: YAML syntax error: %s%s%s", name,
                            parser.problem_mark.line + 1, parser.problem_mark.column + 1,
                            parser.problem != NULL ? parser.problem : "unknown problem",
                            parser.context != NULL ? " " : "",
                            parser.context != NULL ? parser.context : "");
        goto free_parser;
    }
    w->doc = &doc;
    w->nodes = 0;
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (root != NULL && root->type != YAML_MAPPING_NODE && !duet_yaml_is_null(root))
        st = duet_error_set(DUET_ERR_FORMAT,
                            "%s:%zu: the top level must be a mapping of keys, got %s", name,
                            duet_yaml_line(root), duet_yaml_kind(w, root));
    if (st == DUET_OK)
        st = fn(w, root != NULL && root->type == YAML_MAPPING_NODE ? root : NULL, user);
    yaml_document_delete(&doc);
    w->doc = NULL;
    if (st != DUET_OK)
        goto free_parser;
    /* A second document would be silently ignored; refuse it instead. */
    if (!yaml_parser_load(&parser, &doc)) {
        st = duet_error_set(DUET_ERR_FORMAT, "%s:%zu:%zu: YAML syntax error: %s", name,
                            parser.problem_mark.line + 1, parser.problem_mark.column + 1,
                            parser.problem != NULL ? parser.problem : "unknown problem");
        goto free_parser;
    }
    if (yaml_document_get_root_node(&doc) != NULL)
        st = duet_error_set(DUET_ERR_FORMAT, "%s: more than one YAML document", name);
    yaml_document_delete(&doc);
free_parser:
    yaml_parser_delete(&parser);
    return st;
}

size_t duet_yaml_line(const yaml_node_t *n)
{
    return n->start_mark.line + 1;
}

const char *duet_yaml_kind(const duet_yaml_walk_t *w, const yaml_node_t *n)
{
    const bool plain = w->words == DUET_YAML_WORDS_PLAIN;
    switch (n->type) {
    case YAML_SCALAR_NODE:
        return plain ? "a single value" : "a scalar";
    case YAML_SEQUENCE_NODE:
        return plain ? "a list" : "a sequence";
    case YAML_MAPPING_NODE:
        return "a mapping";
    default:
        return "nothing";
    }
}

bool duet_yaml_plain_in(const yaml_node_t *n, const char *const *words)
{
    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return false;
    for (; *words != NULL; words++)
        if (strcmp((const char *)n->data.scalar.value, *words) == 0)
            return true;
    return false;
}

bool duet_yaml_is_null(const yaml_node_t *n)
{
    static const char *const nulls[] = {"", "~", "null", "Null", "NULL", NULL};
    return duet_yaml_plain_in(n, nulls);
}

bool duet_yaml_nul_free(const yaml_node_t *n)
{
    return n->data.scalar.length == strlen((const char *)n->data.scalar.value);
}

bool duet_yaml_mapping_empty(const yaml_node_t *n)
{
    return n->data.mapping.pairs.start == n->data.mapping.pairs.top;
}

duet_status_t duet_yaml_pair(duet_yaml_walk_t *w, const yaml_node_pair_t *pair, const char *section,
                             yaml_node_t **key_p, yaml_node_t **val_p)
{
    yaml_node_t *kn = yaml_document_get_node(w->doc, pair->key);
    yaml_node_t *vn = yaml_document_get_node(w->doc, pair->value);
    if (kn == NULL || vn == NULL)
        return duet_error_set(DUET_ERR_FORMAT, "%s: malformed YAML document", w->name);
    if (++w->nodes > DUET_YAML_MAX_NODES)
        return duet_error_set(DUET_ERR_FORMAT, "%s: more than %d YAML nodes (alias bomb?)", w->name,
                              DUET_YAML_MAX_NODES);
    if (kn->type != YAML_SCALAR_NODE)
        return duet_error_set(DUET_ERR_FORMAT, "%s:%zu: %s%sa key must be a plain name, not %s",
                              w->name, duet_yaml_line(kn), section, section[0] != '\0' ? ": " : "",
                              duet_yaml_kind(w, kn));
    *key_p = kn;
    *val_p = vn;
    return DUET_OK;
}

duet_status_t duet_yaml_depth(const duet_yaml_walk_t *w, const yaml_node_t *n, const char *section,
                              int depth)
{
    if (depth <= DUET_YAML_MAX_DEPTH)
        return DUET_OK;
    return duet_error_set(DUET_ERR_FORMAT, "%s:%zu: %s%smappings nested deeper than %d levels",
                          w->name, duet_yaml_line(n), section, section[0] != '\0' ? ": " : "",
                          DUET_YAML_MAX_DEPTH);
}

duet_status_t duet_yaml_scalar(const duet_yaml_walk_t *w, const yaml_node_t *n, size_t line,
                               const char *what, const char *expected, const char **text_p)
{
    if (n->type != YAML_SCALAR_NODE)
        return duet_error_set(DUET_ERR_FORMAT, "%s:%zu: %s: expected %s, got %s", w->name, line,
                              what, expected, duet_yaml_kind(w, n));
    if (duet_yaml_is_null(n))
        return duet_error_set(DUET_ERR_INVALID,
                              "%s:%zu: %s: no value given (write a value or remove the line)",
                              w->name, line, what);
    if (!duet_yaml_nul_free(n))
        return duet_error_set(DUET_ERR_FORMAT, "%s:%zu: %s: value contains a NUL byte", w->name,
                              line, what);
    *text_p = (const char *)n->data.scalar.value;
    return DUET_OK;
}
