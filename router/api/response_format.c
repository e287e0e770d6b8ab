/*
 * response_format: which output grammar a chat request asks for. Only the mode travels to the
 * workers; the grammar itself is compiled there (grammar/json_grammar.h).
 */
#include "router/api/response_format.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/json_schema.h"

/* {"type": "json_schema"}'s "json_schema": {"name", "schema", "description", "strict"}, the schema
 * compiled here as the workers will (grammar/json_schema.h) so that what they cannot serve is a
 * 400 before anything is placed. */
static duet_status_t rf_schema(const json_t *js, duet_oai_request_t *req, duet_oai_error_t *err)
{
    if (!json_is_object(js)) {
        duet_oai_error_make(err, 400, NULL, "missing_required_parameter",
                            "response_format.json_schema",
                            "Missing required parameter: 'response_format.json_schema' (an "
                            "object with 'name' and 'schema').");
        return DUET_ERR_INVALID;
    }
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)js, key, val)
    {
        if (strcmp(key, "name") != 0 && strcmp(key, "schema") != 0 &&
            strcmp(key, "description") != 0 && strcmp(key, "strict") != 0) {
            duet_oai_error_make(
                err, 400, NULL, "unrecognized_argument", "response_format.json_schema",
                "Unrecognized argument in 'response_format.json_schema': '%s'.", key);
            return DUET_ERR_INVALID;
        }
    }
    const json_t *name = json_object_get(js, "name"), *strict = json_object_get(js, "strict");
    const json_t *schema = json_object_get(js, "schema");
    if (!json_is_string(name) || json_string_length(name) == 0 || json_string_length(name) > 64) {
        duet_oai_error_make(err, 400, NULL, "invalid_value", "response_format.json_schema.name",
                            "Invalid 'response_format.json_schema.name': expected a string of "
                            "1 to 64 characters.");
        return DUET_ERR_INVALID;
    }
    if (strict != NULL && !json_is_boolean(strict) && !json_is_null(strict)) {
        duet_oai_error_make(err, 400, NULL, "invalid_type", "response_format.json_schema.strict",
                            "Invalid type for 'response_format.json_schema.strict': expected a "
                            "boolean.");
        return DUET_ERR_INVALID;
    }
    if (!json_is_object(schema) && !json_is_boolean(schema)) {
        duet_oai_error_make(err, 400, NULL, "missing_required_parameter",
                            "response_format.json_schema.schema",
                            "Missing required parameter: 'response_format.json_schema.schema' "
                            "(a JSON Schema object).");
        return DUET_ERR_INVALID;
    }
    char *text = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY | JSON_PRESERVE_ORDER);
    if (text == NULL) {
        duet_oai_error_make(err, 500, "server_error", NULL, NULL, "Out of memory.");
        return DUET_ERR_NOMEM;
    }
    duet_jschema_t *compiled = NULL;
    duet_status_t st = duet_jschema_compile(text, strlen(text), &compiled);
    duet_jschema_free(compiled);
    if (st != DUET_OK) {
        free(text);
        duet_oai_error_make(err, st == DUET_ERR_NOMEM ? 500 : 400,
                            st == DUET_ERR_NOMEM ? "server_error" : NULL,
                            st == DUET_ERR_NOMEM ? NULL : "unsupported_value",
                            "response_format.json_schema.schema", "%s", duet_error_last());
        return st;
    }
    free(req->json_schema);
    req->json_schema = text;
    req->response_format = DUET_RF_JSON_SCHEMA;
    return DUET_OK;
}

duet_status_t duet_oai_rf_parse(const json_t *root, duet_oai_request_t *req, duet_oai_error_t *err)
{
    req->response_format = NULL;
    const json_t *v = json_object_get(root, "response_format");
    if (v == NULL || json_is_null(v))
        return DUET_OK;
    if (!json_is_object(v)) {
        duet_oai_error_make(err, 400, NULL, "invalid_type", "response_format",
                            "Invalid type for 'response_format': expected an object.");
        return DUET_ERR_INVALID;
    }
    const json_t *t = json_object_get(v, "type");
    if (!json_is_string(t)) {
        duet_oai_error_make(err, 400, NULL, "missing_required_parameter", "response_format.type",
                            "Missing required parameter: 'response_format.type' (a string).");
        return DUET_ERR_INVALID;
    }
    const char *type = json_string_value(t);
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)v, key, val)
    {
        if (strcmp(key, "type") != 0 &&
            !(strcmp(type, "json_schema") == 0 && strcmp(key, "json_schema") == 0)) {
            duet_oai_error_make(err, 400, NULL, "unrecognized_argument", "response_format",
                                "Unrecognized argument in 'response_format': '%s'.", key);
            return DUET_ERR_INVALID;
        }
    }
    if (strcmp(type, "text") == 0)
        return DUET_OK;
    if (strcmp(type, "json_object") == 0 || strcmp(type, "json_schema") == 0) {
        if (req->ignore_eos) { /* a complete object must be able to end the output */
            duet_oai_error_make(err, 400, NULL, "unsupported_value", "ignore_eos",
                                "ignore_eos cannot be combined with a response_format: the "
                                "output must end when the JSON does.");
            return DUET_ERR_INVALID;
        }
        if (strcmp(type, "json_object") == 0) {
            req->response_format = DUET_RF_JSON_OBJECT;
            return DUET_OK;
        }
        return rf_schema(json_object_get(v, "json_schema"), req, err);
    }
    duet_oai_error_make(err, 400, NULL, "invalid_value", "response_format.type",
                        "Invalid value for 'response_format.type': '%s' (expected 'text', "
                        "'json_object' or 'json_schema').",
                        type);
    return DUET_ERR_INVALID;
}
