/*
 * The tokenizer of a model folder, as duet-router and duet-chat-template load it: the folder's
 * duet_tokenizer.json ({"type": "byte", "specials": [...]}, the demo model's) when there is one,
 * else the tokenizer library's own loader (tiktoken.model + tokenizer_config.json).
 *
 * Kept small and in one place so that it can move into the tokenizer library's single loader
 * without touching its callers' logic.
 */
#ifndef DUET_ROUTER_MODEL_TOKENIZER_H
#define DUET_ROUTER_MODEL_TOKENIZER_H

#include "common/status.h"
#include "engine/tokenizer/tokenizer.h"

/*
 * Load the tokenizer of model folder `dir` into *tok_p (free with duet_tokenizer_destroy).
 * Errors: those of duet_tokenizer_load and duet_json_load_file; DUET_ERR_UNSUPPORTED (a
 * duet_tokenizer.json whose "type" is not "byte"), DUET_ERR_RANGE (more than 64 specials),
 * DUET_ERR_FORMAT (a special that is not a string); the detail is in duet_error_last().
 */
duet_status_t duet_router_tokenizer_load(const char *dir, duet_tokenizer_t **tok_p);

#endif
