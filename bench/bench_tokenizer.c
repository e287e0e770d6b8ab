/*
 * bench_tokenizer: how fast the router can tokenize. Encodes a corpus (default
 * data/corpus/web-plain.txt) with cl100k_base and o200k_base in 4 KiB chunks (a prompt's
 * size, so per-call costs count), then decodes the ids, and prints tokens/s and MB/s. Also times
 * one pathological piece (64 KiB of one letter), which a quadratic merge would make minutes long.
 *
 *   bench_tokenizer [corpus.txt [tokenizer-dir]]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/version.h"
#include "tokenizer/tokenizer.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static char *slurp(const char *path, size_t *len_p)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf == NULL || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        return NULL;
    }
    fclose(f);
    *len_p = (size_t)n;
    return buf;
}

int main(int argc, char **argv)
{
    if (argc > 1 && duet_version_flag(argv[1])) {
        duet_version_print("bench_tokenizer");
        return 0;
    }
    if (argc > 1 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        printf("usage: bench_tokenizer [corpus.txt [tokenizer-dir]]\n"
               "Tokens/s and MB/s of the router's tokenizer: encodes the corpus (default\n"
               "data/corpus/web-plain.txt) with cl100k_base and o200k_base from\n"
               "tokenizer-dir (default data/tokenizers) in 4 KiB chunks, decodes the\n"
               "ids back, and times one 64 KiB piece of one letter.\n");
        return 0;
    }
    if (argc > 3 || (argc > 1 && argv[1][0] == '-')) {
        fprintf(stderr, "bench_tokenizer: unexpected argument %s (see --help)\n",
                argc > 3 ? argv[3] : argv[1]);
        return 2;
    }
    const char *corpus = argc > 1 ? argv[1] : DUET_SOURCE_DIR "/data/corpus/web-plain.txt";
    const char *dir = argc > 2 ? argv[2] : DUET_SOURCE_DIR "/data/tokenizers";
    size_t len = 0;
    char *text = slurp(corpus, &len);
    if (text == NULL) {
        fprintf(stderr, "cannot read %s\n", corpus);
        return 1;
    }
    const size_t chunk = 4096;
    uint32_t *ids = malloc((len + 1) * sizeof(*ids));
    char *out = malloc(len + 1);
    const char *names[] = {"cl100k_base", "o200k_base"};
    printf("corpus %s: %.2f MB, %zu-byte chunks\n", corpus, (double)len / 1e6, chunk);
    for (size_t k = 0; k < 2; k++) {
        char path[1024];
        snprintf(path, sizeof(path), "%s/%s.tiktoken", dir, names[k]);
        duet_tokenizer_t *tok = NULL;
        double t0 = now();
        if (duet_tokenizer_create_tiktoken(path, NULL, NULL, 0, &tok) != DUET_OK) {
            fprintf(stderr, "%s: %s\n", path, duet_error_last());
            return 1;
        }
        double t_load = now() - t0;
        size_t n_ids = 0;
        t0 = now();
        for (size_t off = 0; off < len; off += chunk) {
            size_t n = 0, l = len - off < chunk ? len - off : chunk;
            if (duet_tokenizer_encode(tok, text + off, l, 0, ids + n_ids, len + 1 - n_ids, &n) !=
                DUET_OK) {
                fprintf(stderr, "encode: %s\n", duet_error_last());
                return 1;
            }
            n_ids += n;
        }
        double t_enc = now() - t0;
        size_t out_len = 0;
        t0 = now();
        if (duet_tokenizer_decode(tok, ids, n_ids, out, len + 1, &out_len) != DUET_OK ||
            out_len != len || memcmp(out, text, len) != 0) {
            fprintf(stderr, "decode mismatch: %s\n", duet_error_last());
            return 1;
        }
        double t_dec = now() - t0;
        size_t patho = 65536, n = 0;
        char *a = malloc(patho);
        memset(a, 'a', patho);
        t0 = now();
        duet_tokenizer_encode(tok, a, patho, 0, ids, len + 1 > patho ? patho : len + 1, &n);
        double t_patho = now() - t0;
        free(a);
        printf("%-12s load %.2f s | encode %zu tokens in %.2f s: %.2f M tokens/s, %.1f MB/s | "
               "decode %.0f MB/s | 64 KiB of 'a': %.1f ms\n",
               names[k], t_load, n_ids, t_enc, (double)n_ids / t_enc / 1e6,
               (double)len / t_enc / 1e6, (double)len / t_dec / 1e6, t_patho * 1e3);
        duet_tokenizer_destroy(tok);
    }
    free(out);
    free(ids);
    free(text);
    return 0;
}
