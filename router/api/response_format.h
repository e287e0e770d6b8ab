/*
 * The OpenAI API's response_format (docs/architecture.md, "Sampling"), kept apart from openai.c's
 * parser: {"type": "text"} (the default), {"type": "json_object"} and {"type": "json_schema",
 * "json_schema": {"name": ..., "schema": {...}}} are served, the latter two by constrained
 * decoding on the workers (grammar/json_grammar.h, grammar/json_schema.h): the mode travels in
 * Sampling.response_format and the schema's text in Sampling.json_schema. The router compiles
 * the schema too, so that one it cannot serve is a 400 naming what is not supported.
 */
#ifndef DUET_ROUTER_RESPONSE_FORMAT_H
#define DUET_ROUTER_RESPONSE_FORMAT_H

#include "router/api/openai.h"

/* Sampling.response_format's values (the workers refuse any other). */
#define DUET_RF_JSON_OBJECT "json_object"
#define DUET_RF_JSON_SCHEMA "json_schema"

/*
 * Read and validate a chat body's response_format from `root` into req->response_format (NULL
 * for none or text, else a static string, DUET_RF_JSON_OBJECT or DUET_RF_JSON_SCHEMA, with the
 * schema's text in req->json_schema); req->ignore_eos must be parsed already (it cannot go with
 * either). Bad input: a 400 in *err naming response_format (or
 * the field under it, or ignore_eos), DUET_ERR_INVALID.
 */
duet_status_t duet_oai_rf_parse(const struct json_t *root, duet_oai_request_t *req,
                                duet_oai_error_t *err);

#endif
