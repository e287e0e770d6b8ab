/*
 * duet-generate as a real process: its --json and --dump-logits contract against transformers'
 * golden outputs (tests/fixtures), the demo model's and its drafter's greedy text against
 * transformers fp32, speculation with the shipped drafter leaving the greedy text unchanged, and
 * clear errors with exit status 1 for bad invocations.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "tests/unit/test_run.h"

#define GEN test_bin("engine/duet-generate") /* or DUET_TEST_BIN_DIR's (test_run.h) */
#define FIX DUET_SOURCE_DIR "/tests/fixtures/kda-first-fp32"

static json_t *golden(void)
{
    json_error_t e;
    json_t *g = json_load_file(FIX "/golden.json", 0, &e);
    cr_assert_not_null(g, "%s", e.text);
    return g;
}

static char *ids_csv(json_t *arr)
{
    static char buf[8192];
    size_t at = 0;
    for (size_t i = 0; i < json_array_size(arr); i++)
        at += (size_t)snprintf(buf + at, sizeof(buf) - at, "%s%lld", i ? "," : "",
                               (long long)json_integer_value(json_array_get(arr, i)));
    return buf;
}

Test(generate_cli, json_tokens_match_transformers_greedy, .timeout = 120)
{
    json_t *g = golden();
    char cmd[12288], out[65536];
    snprintf(cmd, sizeof(cmd),
             "DUET_LOG_LEVEL=error %s --model %s --tokens %s --max-tokens 32 --json", GEN, FIX,
             ids_csv(json_object_get(g, "prompt_ids")));
    cr_assert_eq(test_run(cmd, out, sizeof(out)), 0, "%s", out);
    json_error_t e;
    json_t *o = json_loads(out, 0, &e);
    cr_assert_not_null(o, "not JSON: %s", out);
    json_t *toks = json_object_get(o, "tokens"), *want = json_object_get(g, "greedy_ids");
    cr_assert_eq(json_array_size(toks), 32);
    for (size_t i = 0; i < 32; i++)
        cr_expect_eq(json_integer_value(json_array_get(toks, i)),
                     json_integer_value(json_array_get(want, i)), "token %zu", i);
    cr_expect_eq(json_integer_value(json_object_get(o, "prompt_tokens")),
                 (json_int_t)json_array_size(json_object_get(g, "prompt_ids")));
    cr_expect(json_is_number(json_object_get(o, "prefill_tokens_per_s")));
    cr_expect(json_is_number(json_object_get(o, "decode_tokens_per_s")));
    cr_expect(json_is_string(json_object_get(o, "text")));
    json_decref(o);
    json_decref(g);
}

Test(generate_cli, dump_logits_matches_transformers, .timeout = 120)
{
    json_t *g = golden();
    char cmd[12288], out[4096];
    const char *dump = "/tmp/duet_test_dump_logits.bin";
    snprintf(cmd, sizeof(cmd),
             "DUET_LOG_LEVEL=error %s --model %s --tokens %s --max-tokens 1 "
             "--prefill-chunk 50 --dump-logits %s >/dev/null",
             GEN, FIX, ids_csv(json_object_get(g, "prompt_ids")), dump);
    cr_assert_eq(test_run(cmd, out, sizeof(out)), 0);
    const int64_t P = (int64_t)json_array_size(json_object_get(g, "prompt_ids"));
    const int64_t V = json_integer_value(json_object_get(g, "vocab_size"));
    float *a = malloc(sizeof(float) * (size_t)(P * V)),
          *b = malloc(sizeof(float) * (size_t)(P * V));
    FILE *f = fopen(dump, "rb");
    cr_assert_not_null(f);
    cr_assert_eq(fread(a, sizeof(float), (size_t)(P * V), f), (size_t)(P * V), "dump is short");
    cr_expect_eq(fgetc(f), EOF, "dump is [prompt_len, vocab] exactly");
    fclose(f);
    f = fopen(FIX "/logits_fp32.bin", "rb");
    cr_assert_eq(fread(b, sizeof(float), (size_t)(P * V), f), (size_t)(P * V));
    fclose(f);
    double num = 0, den = 0;
    for (int64_t i = 0; i < P * V; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    printf("duet-generate --dump-logits (prefill chunk 50) vs transformers: rel L2 %.3g\n",
           sqrt(num / den));
    cr_expect_leq(sqrt(num / den), 1e-4);
    remove(dump);
    free(a);
    free(b);
    json_decref(g);
}

Test(generate_cli, demo_model_greedy_matches_transformers_fp32, .timeout = 120)
{
    /* transformers 5.17 fp32, prompt <|bos|> "And God said", 60 greedy tokens (cached decode) */
    static const char *want =
        "32,116,111,32,104,105,109,44,32,226,128,156,73,32,119,105,108,108,32,115,101,101,32,121,"
        "111,117,32,97,110,100,32,116,104,101,32,112,114,111,112,104,101,116,115,32,119,104,111,"
        "32,97,114,101,32,105,110,32,121,111,117,114,32";
    char out[65536];
    /* --dtype f32: on a GPU, auto would compute this bf16 model in bf16 */
    char cmd[8192];
    snprintf(cmd, sizeof(cmd),
             "DUET_LOG_LEVEL=error %s --model " DUET_SOURCE_DIR "/models/duet-demo "
             "--prompt 'And God said' --max-tokens 60 --dtype f32 --json",
             GEN);
    cr_assert_eq(test_run(cmd, out, sizeof(out)), 0, "%s", out);
    json_t *o = json_loads(out, 0, NULL);
    cr_assert_not_null(o, "%s", out);
    cr_expect_str_eq(ids_csv(json_object_get(o, "tokens")), want);
    cr_expect_eq(json_integer_value(json_object_get(o, "prompt_tokens")), 13, "BOS + 12 bytes");
    cr_expect(strncmp(json_string_value(json_object_get(o, "text")), " to him, \xe2\x80\x9cI will",
                      14) == 0,
              "%s", json_string_value(json_object_get(o, "text")));
    json_decref(o);
}

#define DEMO  DUET_SOURCE_DIR "/models/duet-demo"
#define DRAFT DUET_SOURCE_DIR "/models/duet-demo-draft"

Test(generate_cli, demo_draft_model_matches_transformers_fp32, .timeout = 120)
{
    /* transformers 5.17 fp32 on <|bos|> "And God said", m =
     * KimiLinearForCausalLM.from_pretrained("models/duet-demo-draft", dtype=torch.float32):
     * each prompt row's argmax and its logit, m(ids).logits[0].max(-1), and 40 greedy tokens,
     * m.generate(ids, max_new_tokens=40, do_sample=False) */
    static const struct {
        int id;
        float logit;
    } rows[] = {{32, 3.435763f},  {32, 3.703476f},  {100, 5.934399f}, {32, 7.177752f},
                {116, 4.093529f}, {111, 6.475026f}, {100, 6.997732f}, {32, 7.332189f},
                {104, 4.567614f}, {97, 7.545786f},  {121, 8.088357f}, {100, 12.039888f},
                {32, 9.640642f}};
    /* " to him, “Why do you see the Lord?” " */
    static const char *want =
        "32,116,111,32,104,105,109,44,32,226,128,156,87,104,121,32,100,111,32,121,111,117,32,115,"
        "101,101,32,116,104,101,32,76,111,114,100,63,226,128,157,32";
    const char *dump = "/tmp/duet_test_draft_logits.bin";
    char out[65536];
    char cmd[8192];
    snprintf(cmd, sizeof(cmd),
             "DUET_LOG_LEVEL=error %s --model " DRAFT
             " --prompt 'And God said' --max-tokens 40 --dtype f32 --json"
             " --dump-logits /tmp/duet_test_draft_logits.bin",
             GEN);
    cr_assert_eq(test_run(cmd, out, sizeof(out)), 0, "%s", out);
    json_t *o = json_loads(out, 0, NULL);
    cr_assert_not_null(o, "%s", out);
    cr_expect_str_eq(ids_csv(json_object_get(o, "tokens")), want);
    json_decref(o);
    enum { P = 13, V = 258 };
    static float lg[P * V];
    FILE *f = fopen(dump, "rb");
    cr_assert_not_null(f);
    cr_assert_eq(fread(lg, sizeof(float), P * V, f), (size_t)(P * V), "dump is short");
    cr_expect_eq(fgetc(f), EOF, "dump is [13, 258] exactly");
    fclose(f);
    remove(dump);
    for (int t = 0; t < P; t++) {
        int best = 0;
        for (int v = 1; v < V; v++)
            if (lg[t * V + v] > lg[t * V + best])
                best = v;
        cr_expect_eq(best, rows[t].id, "row %d", t);
        cr_expect(fabsf(lg[t * V + best] - rows[t].logit) <= 1e-4f, "row %d: %.6f vs %.6f", t,
                  (double)lg[t * V + best], (double)rows[t].logit);
    }
}

/* The shipped drafter against the demo model: at every k the greedy tokens equal those of plain
 * decoding, and the drafter's tokens are verified and some kept, which a drafter that failed to
 * load or ran wrong would not give (its greedy text alone is checked above). */
Test(generate_cli, demo_draft_speculation_keeps_greedy_output, .timeout = 180)
{
    const char *prompt =
        "'Janet\xe2\x80\x99s ducks lay 16 eggs per day. She eats three for breakfast "
        "every morning.'";
    char cmd[4096], out[65536];
    snprintf(cmd, sizeof(cmd),
             "DUET_LOG_LEVEL=error %s --model %s --prompt %s --max-tokens 96 --device cpu --json",
             GEN, DEMO, prompt);
    cr_assert_eq(test_run(cmd, out, sizeof(out)), 0, "%s", out);
    json_t *plain = json_loads(out, 0, NULL);
    cr_assert_not_null(plain, "%s", out);
    char want[8192];
    snprintf(want, sizeof(want), "%s", ids_csv(json_object_get(plain, "tokens")));
    cr_assert_eq(json_array_size(json_object_get(plain, "tokens")), 96);
    static const int ks[] = {1, 2, 4, 7};
    for (size_t i = 0; i < sizeof(ks) / sizeof(ks[0]); i++) {
        snprintf(
            cmd, sizeof(cmd),
            "DUET_LOG_LEVEL=error %s --model %s --prompt %s --max-tokens 96 --device cpu --json "
            "--spec.method draft --spec.draft-model %s --spec.k %d",
            GEN, DEMO, prompt, DRAFT, ks[i]);
        cr_assert_eq(test_run(cmd, out, sizeof(out)), 0, "k %d: %s", ks[i], out);
        json_t *o = json_loads(out, 0, NULL);
        cr_assert_not_null(o, "%s", out);
        cr_expect_str_eq(ids_csv(json_object_get(o, "tokens")), want, "k %d", ks[i]);
        const json_int_t steps = json_integer_value(json_object_get(o, "steps")),
                         drafted = json_integer_value(json_object_get(o, "draft_tokens")),
                         kept = json_integer_value(json_object_get(o, "accepted_tokens"));
        printf("demo + duet-demo-draft, k %d: %lld steps, %lld drafted, %lld accepted\n", ks[i],
               (long long)steps, (long long)drafted, (long long)kept);
        cr_expect_gt(drafted, 0, "k %d", ks[i]);
        cr_expect_gt(kept, 0, "k %d", ks[i]);
        cr_expect_leq(kept, drafted, "k %d", ks[i]);
        cr_expect_leq(drafted, steps * ks[i], "k %d", ks[i]);
        cr_expect_eq(steps + kept, 95, "k %d: each step emits its kept drafts and one token",
                     ks[i]);
        json_decref(o);
    }
    json_decref(plain);
}

Test(generate_cli, bad_invocations_fail_clearly, .timeout = 60)
{
    static const struct {
        const char *args, *needle;
    } cases[] = {
        {"", "model"},
        {"--model " FIX, "exactly one of --prompt and --tokens"},
        {"--model " FIX " --tokens 1,x,3", "--tokens"},
        {"--model " FIX " --prompt hi", "no tokenizer"},
        {"--model /nonexistent --tokens 1", "/nonexistent"},
        {"--model " FIX " --tokens 1 --temperature -1", "temperature"},
        {"--model " FIX " --tokens 1 --bogus 3", "bogus"},
        {"--model " FIX " --tokens 99999", "vocabulary"},
        {"--model " FIX " --tokens 1 --dtype fp16", "auto, f32, bf16"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char cmd[4096], out[65536];
        snprintf(cmd, sizeof(cmd), "DUET_LOG_LEVEL=error %s %s 2>&1", GEN, cases[i].args);
        int rc = test_run(cmd, out, sizeof(out));
        cr_expect_neq(rc, 0, "'%s' should fail", cases[i].args);
        cr_expect(strstr(out, cases[i].needle) != NULL, "'%s': message lacks \"%s\": %s",
                  cases[i].args, cases[i].needle, out);
    }
    char out[65536];
    char cmd[4200];
    snprintf(cmd, sizeof(cmd), "%s --help", GEN);
    cr_expect_eq(test_run(cmd, out, sizeof(out)), 0);
    cr_expect(strstr(out, "--dump-logits") != NULL || strstr(out, "dump_logits") != NULL, "%s",
              out);
}

/*
 * --logprobs N: each generated token's logprob and the N most likely are the log-softmax of the
 * raw row --dump-step-logits writes for it (float32 logits, log-softmax in double here; 1e-5
 * absolute covers the JSON's 17 digits and the float32 rounding of duet's result); the top ids
 * are the row's largest logits in descending order (ties: lower id first), and the tokens are
 * the rows' argmax (greedy). With a processing flag the logprobs stay the raw rows' while the
 * tokens change.
 */
Test(generate_cli, logprobs_are_the_step_logits_log_softmax, .timeout = 120)
{
    const char *dump = "/tmp/duet_test_step_logits.bin";
    char cmd[4096];
    static char out[1 << 16];
    for (int processed = 0; processed < 2; processed++) {
        snprintf(cmd, sizeof(cmd),
                 "DUET_LOG_LEVEL=error %s --model " DRAFT " --prompt 'And God said' --max-tokens "
                 "12 --dtype f32 --json --logprobs 5 --dump-step-logits %s%s",
                 GEN, dump, processed ? " --repetition-penalty 3 --logit-bias 32:-100" : "");
        cr_assert_eq(test_run(cmd, out, sizeof(out)), 0, "%s", out);
        json_t *o = json_loads(out, 0, NULL);
        cr_assert_not_null(o, "%s", out);
        json_t *toks = json_object_get(o, "tokens"), *lps = json_object_get(o, "logprobs");
        const size_t n = json_array_size(toks);
        cr_assert(n > 0 && json_array_size(lps) == n, "%s", out);
        enum { V = 258 };
        static float rows[64 * V];
        FILE *f = fopen(dump, "rb");
        cr_assert_not_null(f);
        cr_assert_eq(fread(rows, sizeof(float), n * V, f), n * V, "dump is short");
        cr_expect_eq(fgetc(f), EOF, "dump is [n_generated, vocab] exactly");
        fclose(f);
        remove(dump);
        int differs = 0;
        for (size_t t = 0; t < n; t++) {
            const float *row = rows + t * V;
            double mx = row[0], sum = 0;
            int best = 0;
            for (int v = 1; v < V; v++)
                if (row[v] > row[best])
                    best = v;
            mx = row[best];
            for (int v = 0; v < V; v++)
                sum += exp((double)row[v] - mx);
            const double lse = mx + log(sum);
            json_t *e = json_array_get(lps, t);
            const json_int_t id = json_integer_value(json_array_get(toks, t));
            cr_expect_eq(json_integer_value(json_object_get(e, "id")), id);
            cr_expect_float_eq(json_number_value(json_object_get(e, "logprob")),
                               (double)row[id] - lse, 1e-5, "token %zu", t);
            differs += id != best;
            if (!processed)
                cr_expect_eq(id, best, "greedy token %zu is the row's argmax", t);
            json_t *top = json_object_get(e, "top");
            cr_assert_eq(json_array_size(top), 5);
            int prev = -1;
            for (size_t k = 0; k < 5; k++) {
                const int tid = (int)json_integer_value(json_array_get(json_array_get(top, k), 0));
                const double tlp = json_number_value(json_array_get(json_array_get(top, k), 1));
                cr_expect_float_eq(tlp, (double)row[tid] - lse, 1e-5, "token %zu top %zu", t, k);
                if (prev >= 0)
                    cr_expect(row[tid] < row[prev] || (row[tid] == row[prev] && tid > prev),
                              "token %zu top %zu out of order", t, k);
                /* nothing outside the list beats its last */
                prev = tid;
            }
            int above = 0;
            for (int v = 0; v < V; v++)
                above += row[v] > row[prev] || (row[v] == row[prev] && v < prev);
            cr_expect_eq(above, 4, "token %zu: the top 5 are not the 5 largest", t);
        }
        if (processed)
            cr_expect_gt(differs, 0,
                         "the processing flags changed no token (the case cannot fail)");
        json_decref(o);
    }
}

/*
 * Speculating (the shipped drafter), the logprobs come from the verify rows of the emitted
 * positions, which on the CPU are bit-identical to plain decoding's rows: the JSON equals a run
 * without speculation exactly, and drafts were kept (else the case proves nothing).
 */
Test(generate_cli, logprobs_under_speculation_equal_plain_decoding, .timeout = 120)
{
    static char plain[1 << 16], spec[1 << 16];
    char cmd[4096];
    const char *base = "DUET_LOG_LEVEL=error %s --model " DEMO " --prompt 'And God said' "
                       "--max-tokens 24 --dtype f32 --json --logprobs 3%s";
    snprintf(cmd, sizeof(cmd), base, GEN, "");
    cr_assert_eq(test_run(cmd, plain, sizeof(plain)), 0, "%s", plain);
    snprintf(cmd, sizeof(cmd), base, GEN,
             " --spec.method draft --spec.k 3 --spec.draft-model " DRAFT);
    cr_assert_eq(test_run(cmd, spec, sizeof(spec)), 0, "%s", spec);
    json_t *a = json_loads(plain, 0, NULL), *b = json_loads(spec, 0, NULL);
    cr_assert(a != NULL && b != NULL);
    cr_expect_gt(json_integer_value(json_object_get(b, "accepted_tokens")), 0,
                 "no draft was kept: %s", spec);
    cr_expect(json_equal(json_object_get(a, "tokens"), json_object_get(b, "tokens")));
    cr_expect(json_equal(json_object_get(a, "logprobs"), json_object_get(b, "logprobs")),
              "speculating changed the logprobs:\n%s\n%s", plain, spec);
    cr_expect_eq(json_array_size(json_object_get(b, "logprobs")), 24);
    json_decref(a);
    json_decref(b);
}
