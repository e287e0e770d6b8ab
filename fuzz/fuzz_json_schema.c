/*
 * Fuzz target: response_format's JSON Schemas (grammar/json_schema.c, duet_jschema_compile) and
 * the automaton compiled from them.
 *
 * Input: the schema's bytes, then optionally a NUL and bytes to feed. Checked besides no crash /
 * sanitizer report:
 *  - failure leaves *s_p untouched and sets an error detail;
 *  - a compiled schema's automaton, fed the bytes (a refused byte is skipped: the state is fed a
 *    copy), parses with jansson whenever it says complete, and says nothing is complete before
 *    any byte was accepted.
 */
#include "fuzz/fuzz.h"

#include <jansson.h>

#include "common/status.h"
#include "grammar/json_schema.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    const uint8_t *nul = memchr(data, 0, size);
    size_t slen = nul != NULL ? (size_t)(nul - data) : size;
    duet_jschema_t *s = (duet_jschema_t *)0x1;
    duet_error_clear();
    duet_status_t st = duet_jschema_compile((const char *)data, slen, &s);
    if (st != DUET_OK) {
        FUZZ_CHECK(st < 0, "status %d", (int)st);
        FUZZ_CHECK(s == (duet_jschema_t *)0x1, "s_p written on failure");
        FUZZ_CHECK(duet_error_last()[0] != '\0', "failure without a detail");
        return 0;
    }
    duet_jschema_state_t state;
    duet_jschema_start(s, &state);
    FUZZ_CHECK(!duet_jschema_accepting(s, &state), "complete before any byte");
    static char text[1 << 16];
    size_t tl = 0;
    for (size_t i = slen + 1; nul != NULL && i < size && tl < sizeof(text); i++) {
        duet_jschema_state_t t = state;
        if (!duet_jschema_feed(s, &t, data[i]))
            continue;
        state = t;
        text[tl++] = (char)data[i];
        if (duet_jschema_accepting(s, &state)) {
            json_error_t err;
            json_t *j = json_loadb(text, tl, JSON_DECODE_ANY | JSON_ALLOW_NUL, &err);
            /* jansson refuses \u0000 in keys, which JSON allows */
            FUZZ_CHECK(j != NULL || strstr(err.text, "NUL byte in object key") != NULL,
                       "complete but does not parse: %.*s (%s)", (int)tl, text, err.text);
            json_decref(j);
        }
    }
    duet_jschema_free(s);
    return 0;
}
