/*
 * The OpenAI API's response_format (docs/architecture.md, "Sampling"), kept apart from openai.c's
 * parser: {"type": "text"} (the default) and {"type": "json_object"} are served, the latter by
 * constrained decoding on the workers (engine/json_grammar.h), which sends the mode on in
 * Sampling.response_format. {"type": "json_schema", ...} is not built yet: a 400 says so.
 */
#ifndef DUET_ROUTER_RESPONSE_FORMAT_H
#define DUET_ROUTER_RESPONSE_FORMAT_H

#include "router/api/openai.h"

/* Sampling.response_format's values (the workers refuse any other). */
#define DUET_RF_JSON_OBJECT "json_object"

/*
 * Read and validate a chat body's response_format from `root` into req->response_format (NULL
 * for none or text, else a static string, DUET_RF_JSON_OBJECT); req->ignore_eos must be parsed
 * already (it cannot go with json_object). Bad input: a 400 in *err naming response_format (or
 * the field under it, or ignore_eos), DUET_ERR_INVALID.
 */
duet_status_t duet_oai_rf_parse(const struct json_t *root, duet_oai_request_t *req,
                                duet_oai_error_t *err);

#endif
