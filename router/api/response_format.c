/*
 * response_format: which output grammar a chat request asks for. Only the mode travels to the
 * workers; the grammar itself is compiled there (engine/json_grammar.h).
 */
#include "router/api/response_format.h"

#include <jansson.h>
#include <string.h>

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
    if (strcmp(type, "json_object") == 0) {
        if (req->ignore_eos) { /* a complete object must be able to end the output */
            duet_oai_error_make(err, 400, NULL, "unsupported_value", "ignore_eos",
                                "ignore_eos cannot be combined with a response_format: the "
                                "output must end when the JSON does.");
            return DUET_ERR_INVALID;
        }
        req->response_format = DUET_RF_JSON_OBJECT;
        return DUET_OK;
    }
    if (strcmp(type, "json_schema") == 0) {
        duet_oai_error_make(err, 400, NULL, "unsupported_value", "response_format.type",
                            "response_format {\"type\": \"json_schema\"} is not supported by "
                            "this server yet; {\"type\": \"json_object\"} is.");
        return DUET_ERR_INVALID;
    }
    duet_oai_error_make(err, 400, NULL, "invalid_value", "response_format.type",
                        "Invalid value for 'response_format.type': '%s' (expected 'text', "
                        "'json_object' or 'json_schema').",
                        type);
    return DUET_ERR_INVALID;
}
