/*
 * duet-jschema-walk: TEST TOOL. Compile a JSON Schema (grammar/json_schema.h) and print N random
 * texts its automaton accepts, one per line, each a walk of bytes (printable ASCII and every
 * byte of multi-byte UTF-8) chosen among those the automaton takes (towards closing once the text
 * is long), ended when it is complete. tests/integration/json_schema_oracle_test.py checks every
 * line against the schema with the Python jsonschema package.
 *
 * Usage: duet-jschema-walk SCHEMA_FILE N SEED. Exit 1 when the schema does not compile (the
 * error on stderr) or a walk dead-ends (no byte accepted and not complete) or runs past 64 KiB.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/version.h"
#include "grammar/json_schema.h"

static uint64_t g_rng;

static uint32_t next_rand(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}

int main(int argc, char **argv)
{
    if (argc > 1 && duet_version_flag(argv[1])) {
        duet_version_print("duet-jschema-walk");
        return 0;
    }
    if (argc > 1 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        printf(
            "usage: duet-jschema-walk SCHEMA_FILE N SEED\n"
            "TEST TOOL: prints N random texts the response_format json_schema automaton\n"
            "compiled from SCHEMA_FILE accepts, one per line (the jsonschema oracle's input).\n");
        return 0;
    }
    if (argc != 4 || argv[1][0] == '-') {
        fprintf(stderr,
                "duet-jschema-walk: unexpected argument %s (usage: SCHEMA_FILE N SEED; see "
                "--help)\n",
                argc > 1 ? argv[argc > 4 ? 4 : 1] : "(none)");
        return 2;
    }
    FILE *f = fopen(argv[1], "rb");
    if (f == NULL) {
        perror(argv[1]);
        return 1;
    }
    static char schema[1 << 20];
    size_t len = fread(schema, 1, sizeof(schema), f);
    fclose(f);
    duet_jschema_t *s;
    if (duet_jschema_compile(schema, len, &s) != DUET_OK) {
        fprintf(stderr, "%s\n", duet_error_last());
        return 1;
    }
    long n = strtol(argv[2], NULL, 10);
    g_rng = strtoull(argv[3], NULL, 10) * 0x9e3779b97f4a7c15ull + 1;
    static char text[1 << 16];
    for (long w = 0; w < n; w++) {
        duet_jschema_state_t st;
        duet_jschema_start(s, &st);
        size_t tl = 0;
        for (;;) {
            uint8_t ok[384], closers[384];
            int n_ok = 0, n_close = 0;
            const int utf8 = next_rand() % 4 == 0; /* non-ASCII bytes now and then */
            for (int c = 0x20; c < 0x100 + 0x80; c++) {
                if (c == 0x100 && n_ok > 0)
                    break; /* a second pass over 0x80-0xff only when nothing else goes on */
                if (c == 0x7f || (c >= 0x80 && c < 0x100 && !utf8))
                    continue;
                duet_jschema_state_t t = st;
                if (!duet_jschema_feed(s, &t, (uint8_t)(c < 0x100 ? c : c - 0x80)))
                    continue;
                ok[n_ok++] = (uint8_t)(c < 0x100 ? c : c - 0x80);
                if (c == '"' || c == ']' || c == '}')
                    closers[n_close++] = (uint8_t)c;
            }
            int done = duet_jschema_accepting(s, &st);
            if (done && (n_ok == 0 || next_rand() % 8 == 0 || tl > 40))
                break;
            if (n_ok == 0 || tl + 1 >= sizeof(text)) {
                fprintf(stderr, "walk %ld: %s after %.*s\n", w, n_ok == 0 ? "dead end" : "too long",
                        (int)(tl < 200 ? tl : 200), text);
                return 1;
            }
            /* long texts close what they can; short ones wander */
            uint8_t c = tl > 40 && n_close > 0 && next_rand() % 4 != 0
                            ? closers[next_rand() % (uint32_t)n_close]
                            : ok[next_rand() % (uint32_t)n_ok];
            if (tl > 80) { /* no new containers or keys while others can end it */
                for (int i = 0; i < n_ok; i++)
                    if (ok[i] != '{' && ok[i] != '[' && ok[i] != ',' && ok[i] != ' ' &&
                        next_rand() % 2 == 0) {
                        c = ok[i];
                        break;
                    }
            }
            (void)duet_jschema_feed(s, &st, c);
            text[tl++] = (char)c;
        }
        fwrite(text, 1, tl, stdout);
        fputc('\n', stdout);
    }
    duet_jschema_free(s);
    return 0;
}
