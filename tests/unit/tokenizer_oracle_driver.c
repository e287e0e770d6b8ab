/*
 * duet's side of the tokenizer oracle test (tests/unit/tokenizer_kimi_oracle.py): loads a model
 * folder's tokenizer with duet_tokenizer_load, exactly as the router and duet-generate do, and
 * answers requests on stdin so that one process serves thousands of comparisons.
 *
 * Requests (binary-safe, one after the other):
 *   E <flags> <len>\n<len bytes>   encode (flags 1 = special tokens allowed)
 *                                  -> "<n> <rt> <id> ...\n", rt 1 when decode(ids) == the bytes
 *   T <id>\n                       one id's bytes -> "<hex> <special> <skipped>\n"
 *   S\n                            stop ids of the folder -> "<n> <id> ...\n"
 *   I\n                            "<vocab size> <bos id or -1> <eos id or -1>\n"
 * Any failure prints "ERR <message>" and exits 1.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/version.h"
#include "tokenizer/tokenizer.h"

static void die(const char *what)
{
    printf("ERR %s: %s\n", what, duet_error_last());
    exit(1);
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--help") == 0) {
        printf("usage: tokenizer_oracle_driver MODEL_DIR < requests (see the source's header)\n");
        return 0;
    }
    if (argc == 2 && duet_version_flag(argv[1])) {
        duet_version_print("tokenizer_oracle_driver");
        return 0;
    }
    if (argc != 2 || argv[1][0] == '-') {
        if (argc == 2)
            fprintf(stderr, "tokenizer_oracle_driver: unknown option %s\n", argv[1]);
        fprintf(stderr, "usage: tokenizer_oracle_driver MODEL_DIR < requests\n");
        return 2;
    }
    duet_tokenizer_t *tok = NULL;
    if (duet_tokenizer_load(argv[1], &tok) != DUET_OK)
        die("load");
    char op;
    while (scanf(" %c", &op) == 1) {
        if (op == 'E') {
            unsigned flags;
            size_t len;
            if (scanf("%u %zu", &flags, &len) != 2 || getchar() != '\n')
                die("bad E request");
            char *text = malloc(len + 1);
            if (text == NULL || fread(text, 1, len, stdin) != len)
                die("short E request");
            size_t n = 0;
            duet_status_t st = duet_tokenizer_encode(tok, text, len, flags, NULL, 0, &n);
            if (st != DUET_OK && st != DUET_ERR_NO_SPACE)
                die("encode");
            uint32_t *ids = malloc((n + 1) * sizeof(*ids));
            char *back = malloc(len + 1);
            size_t back_len = 0;
            if (ids == NULL || back == NULL ||
                duet_tokenizer_encode(tok, text, len, flags, ids, n, &n) != DUET_OK)
                die("encode");
            st = duet_tokenizer_decode(tok, ids, n, back, len + 1, &back_len);
            int rt = (st == DUET_OK || st == DUET_ERR_NO_SPACE) && back_len == len &&
                     memcmp(back, text, len) == 0;
            printf("%zu %d", n, rt);
            for (size_t i = 0; i < n; i++)
                printf(" %u", ids[i]);
            printf("\n");
            free(back);
            free(ids);
            free(text);
        } else if (op == 'T') {
            unsigned id;
            const uint8_t *p;
            size_t len;
            if (scanf("%u", &id) != 1)
                die("bad T request");
            if (duet_tokenizer_token_bytes(tok, id, &p, &len) != DUET_OK) {
                printf("- 0 0\n");
                continue;
            }
            for (size_t i = 0; i < len; i++)
                printf("%02x", p[i]);
            printf(" %d %d\n", (int)duet_tokenizer_is_special(tok, id),
                   (int)duet_tokenizer_is_skipped(tok, id));
        } else if (op == 'S') {
            uint32_t ids[64];
            size_t n = 0;
            if (duet_tokenizer_stop_ids(argv[1], tok, ids, 64, &n) != DUET_OK)
                die("stop ids");
            printf("%zu", n);
            for (size_t i = 0; i < n; i++)
                printf(" %u", ids[i]);
            printf("\n");
        } else if (op == 'I') {
            uint32_t bos, eos;
            long b = duet_tokenizer_bos_id(tok, &bos) == DUET_OK ? (long)bos : -1;
            long e = duet_tokenizer_eos_id(tok, &eos) == DUET_OK ? (long)eos : -1;
            printf("%u %ld %ld\n", duet_tokenizer_vocab_size(tok), b, e);
        } else {
            die("unknown request");
        }
    }
    duet_tokenizer_destroy(tok);
    return 0;
}
