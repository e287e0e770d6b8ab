/*
 * A model folder's tokenizer (see model_tokenizer.h), moved here from duet-router so that
 * duet-chat-template loads it the same way.
 */
#include "router/model_tokenizer.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/json.h"

duet_status_t duet_router_tokenizer_load(const char *dir, duet_tokenizer_t **tok_p)
{
    char path[4096];
    struct stat sb;
    snprintf(path, sizeof(path), "%s/duet_tokenizer.json", dir);
    if (stat(path, &sb) != 0)
        return duet_tokenizer_load(dir, tok_p);
    json_t *root = NULL;
    duet_status_t st = duet_json_load_file(path, 1 << 20, &root);
    if (st < 0)
        return st;
    const char *type = json_string_value(json_object_get(root, "type"));
    json_t *specials = json_object_get(root, "specials");
    const char *names[64];
    size_t n = json_is_array(specials) ? json_array_size(specials) : 0;
    if (type == NULL || strcmp(type, "byte") != 0)
        st = duet_error_set(DUET_ERR_UNSUPPORTED, "%s: \"type\" must be \"byte\"", path);
    else if (n > 64)
        st = duet_error_set(DUET_ERR_RANGE, "%s: more than 64 specials", path);
    for (size_t i = 0; st == DUET_OK && i < n; i++)
        if ((names[i] = json_string_value(json_array_get(specials, i))) == NULL)
            st = duet_error_set(DUET_ERR_FORMAT, "%s: specials[%zu] is not a string", path, i);
    if (st == DUET_OK)
        st = duet_tokenizer_create_byte(n > 0 ? names : NULL, n, tok_p);
    json_decref(root);
    return st;
}
