/*
 * duet-bench's accuracy gate (bench/serving_accuracy.h): the incomplete beta and Student's t
 * survival function against SciPy 1.10.1 (Debian 12's python3-scipy), computed once with
 *   from scipy.stats import t; from scipy.special import betainc
 *   t.sf(T, DF); betainc(A, B, X)
 * and stored here; the paired t-test's statistic on a hand-computable case and its edge cases;
 * echo scoring of OpenAI-shaped answers (BOS first or not, multi-byte text, code-point offsets)
 * and the refusal of every malformed or inconsistent answer; 20,000 random byte edits of a valid
 * answer never crash the scorer.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bench/serving_accuracy.h"

Test(bench_accuracy, t_sf_matches_scipy)
{
    static const struct {
        double t, df, sf;
    } ref[] = {
        {0.5, 1, 0.3524163823495668},     {2.0, 3, 0.06966298427942155},
        {-1.5, 10, 0.9177463367772799},   {3.0, 29, 0.0027495960669517033},
        {6.5, 49, 1.974738145146611e-08}, {1.96, 1000, 0.025136592477874354},
        {12.0, 4, 0.0001382142742514865}, {0.0, 7, 0.5},
        {2.5, 2.5, 0.052284981539077686}, {-4.0, 15, 0.9994203415751194},
    };
    for (size_t i = 0; i < sizeof(ref) / sizeof(ref[0]); i++) {
        double v = serving_t_sf(ref[i].t, ref[i].df);
        cr_assert(fabs(v - ref[i].sf) <= 1e-10 * ref[i].sf + 1e-15,
                  "t.sf(%g, %g) = %.17g, scipy %.17g", ref[i].t, ref[i].df, v, ref[i].sf);
    }
    cr_assert(isnan(serving_t_sf(1, 0)));
    cr_assert_eq(serving_t_sf(INFINITY, 3), 0);
    cr_assert_eq(serving_t_sf(-INFINITY, 3), 1);
}

Test(bench_accuracy, betainc_matches_scipy)
{
    static const struct {
        double a, b, x, v;
    } ref[] = {
        {0.5, 0.5, 0.3, 0.3690101195655454},
        {2, 3, 0.4, 0.5247999999999999},
        {10, 0.5, 0.9, 0.15164090963470997},
        {50, 0.5, 0.99, 0.31730439787419623},
        {1, 1, 0.25, 0.25},
    };
    for (size_t i = 0; i < sizeof(ref) / sizeof(ref[0]); i++) {
        double v = serving_betainc(ref[i].a, ref[i].b, ref[i].x);
        cr_assert(fabs(v - ref[i].v) <= 1e-11, "I(%g, %g, %g) = %.17g, scipy %.17g", ref[i].a,
                  ref[i].b, ref[i].x, v, ref[i].v);
    }
    cr_assert(isnan(serving_betainc(-1, 1, 0.5)));
    cr_assert(isnan(serving_betainc(1, 1, 1.5)));
}

Test(bench_accuracy, paired_t_statistic_and_edges)
{
    /* differences 1, 2, 3, 4: mean 2.5, sd sqrt(5/3), t = 2.5 / (sd / 2), df 3 */
    double run[] = {2, 4, 6, 8}, base[] = {1, 2, 3, 4};
    serving_paired_t r;
    cr_assert_eq(serving_paired_ttest(run, base, 4, 0.01, &r), DUET_OK);
    double sd = sqrt(5.0 / 3.0);
    cr_assert_float_eq(r.mean_diff, 2.5, 1e-12);
    cr_assert_float_eq(r.sd_diff, sd, 1e-12);
    cr_assert_float_eq(r.t, 2.5 / (sd / 2), 1e-12);
    cr_assert_eq(r.df, 3);
    cr_assert_float_eq(r.p, 0.015233145831085489, 1e-12, "scipy t.sf(3.872983346207417, 3)");
    cr_assert(!r.dropped, "p %g is not below 0.01", r.p);
    cr_assert_eq(serving_paired_ttest(run, base, 4, 0.05, &r), DUET_OK);
    cr_assert(r.dropped, "p %g is below 0.05", r.p);
}

Test(bench_accuracy, paired_t_decisions)
{
    serving_paired_t r;
    /* a rise of ~0.1 with small noise over 10 pairs: dropped */
    double base[10], up[10], same[10], down[10];
    for (int i = 0; i < 10; i++) {
        base[i] = 1.5 + 0.01 * i;
        up[i] = base[i] + 0.1 + 0.001 * ((i * 7) % 5 - 2);
        same[i] = base[i];
        down[i] = base[i] - 0.1 + 0.001 * ((i * 3) % 5 - 2);
    }
    cr_assert_eq(serving_paired_ttest(up, base, 10, 0.01, &r), DUET_OK);
    cr_assert(r.dropped && r.p < 1e-10, "p %g", r.p);
    cr_assert_eq(serving_paired_ttest(same, base, 10, 0.01, &r), DUET_OK);
    cr_assert(!r.dropped && r.p == 1 && r.t == 0);
    cr_assert_eq(serving_paired_ttest(down, base, 10, 0.01, &r), DUET_OK);
    cr_assert(!r.dropped && r.p > 0.99, "a fall is not a drop: p %g", r.p);
    /* constant non-zero difference: sd 0 */
    double plus[3] = {2, 3, 4}, b3[3] = {1, 2, 3};
    cr_assert_eq(serving_paired_ttest(plus, b3, 3, 0.01, &r), DUET_OK);
    cr_assert(r.dropped && isinf(r.t) && r.p == 0);
    cr_assert_eq(serving_paired_ttest(plus, b3, 1, 0.01, &r), DUET_ERR_INVALID);
    double bad[3] = {NAN, 1, 1};
    cr_assert_eq(serving_paired_ttest(bad, b3, 3, 0.01, &r), DUET_ERR_INVALID);
}

static json_t *answer(const char *text, const char *logprobs, const char *offsets)
{
    char buf[2048];
    snprintf(buf, sizeof(buf),
             "{\"choices\": [{\"index\": 0, \"text\": %s, \"logprobs\": {\"tokens\": null, "
             "\"token_logprobs\": %s, \"text_offset\": %s}}]}",
             text, logprobs, offsets);
    json_error_t e;
    json_t *j = json_loads(buf, 0, &e);
    cr_assert_not_null(j, "%s: %s", buf, e.text);
    json_object_del(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"),
                    "tokens");
    return j;
}

Test(bench_accuracy, score_echo)
{
    serving_doc_score_t s;
    /* BOS (empty text) then one token per character: every byte scored; "h\u00e9!" is 4 bytes,
     * 3 code points, so the offsets 0,0,1,2 are code points, not bytes */
    const char *doc = "h\xc3\xa9!";
    json_t *j = answer("\"h\\u00e9!\"", "[null, -1.0, -2.0, -0.5]", "[0, 0, 1, 2]");
    cr_assert_eq(serving_score_echo(j, doc, strlen(doc), &s), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(s.bytes_scored, 4);
    cr_assert_eq(s.tokens_scored, 3);
    cr_assert_float_eq(s.sum_logprob, -3.5, 1e-12);
    cr_assert_float_eq(s.bits_per_byte, 3.5 / M_LN2 / 4, 1e-12);
    json_decref(j);
    /* no BOS: the first token ("h") is not scored, 3 bytes are */
    j = answer("\"h\\u00e9!\"", "[null, -2.0, -0.5]", "[0, 1, 2]");
    cr_assert_eq(serving_score_echo(j, doc, strlen(doc), &s), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(s.bytes_scored, 3);
    cr_assert_float_eq(s.bits_per_byte, 2.5 / M_LN2 / 3, 1e-12);
    json_decref(j);
    /* byte-level tokens (the demo model's tokenizer): "\xc3" and "\xa9" are two tokens of one
     * character, so later offsets count bytes or fall inside it; only text_offset[1] is used */
    j = answer("\"h\\u00e9!\"", "[null, -1.0, -2.0, -0.25, -0.5]", "[0, 0, 1, 2, 3]");
    cr_assert_eq(serving_score_echo(j, doc, strlen(doc), &s), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(s.bytes_scored, 4);
    cr_assert_eq(s.tokens_scored, 4);
    cr_assert_float_eq(s.bits_per_byte, 3.75 / M_LN2 / 4, 1e-12);
    json_decref(j);
    /* BOS rendered as text before the document: still the document's bytes */
    j = answer("\"<s>h\\u00e9!\"", "[null, -1.0, -2.0, -0.5]", "[0, 3, 4, 5]");
    cr_assert_eq(serving_score_echo(j, doc, strlen(doc), &s), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(s.bytes_scored, 4);
    json_decref(j);

    static const struct {
        const char *text, *lp, *off, *why;
    } bad[] = {
        {"\"h\\u00e9!\"", "[null]", "[0]", "nothing to score"},
        {"\"h\\u00e9!\"", "[null, -1, null]", "[0, 1, 2]", "token_logprobs[2]"},
        {"\"h\\u00e9!\"", "[null, -1, 0.5]", "[0, 1, 2]", "token_logprobs[2]"},
        {"\"h\\u00e9!\"", "[null, -1, -1]", "[0, 2, 1]", "text_offset[2]"},
        {"\"h\\u00e9!\"", "[null, -1, -1]", "[0, 1]", "differ in length"},
        {"\"h\\u00e9!\"", "[null, -1, -1]", "[0, 9, 9]", "past the end"},
        {"\"h\\u00e9!\"", "[null, -1, -1]", "[-1, 1, 2]", "text_offset[0]"},
        {"\"h\\u00e9!\"", "[null, -1, -1]", "[0, 3, 3]", "empty"},
        {"\"h\\u00e9!xyz\"", "[null, -1, -1]", "[0, 1, 2]", "not the end of the document"},
        {"\"other\"", "[null, -1, -1]", "[0, 1, 2]", "not the end of the document"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        j = answer(bad[i].text, bad[i].lp, bad[i].off);
        cr_assert_eq(serving_score_echo(j, doc, strlen(doc), &s), DUET_ERR_FORMAT, "case %zu", i);
        cr_assert(strstr(duet_error_last(), bad[i].why) != NULL, "case %zu: %s", i,
                  duet_error_last());
        json_decref(j);
    }
    /* no logprobs at all (a server without echo support) */
    json_error_t e;
    j = json_loads("{\"choices\": [{\"text\": \"x\", \"logprobs\": null}]}", 0, &e);
    cr_assert_eq(serving_score_echo(j, doc, strlen(doc), &s), DUET_ERR_FORMAT);
    cr_assert(strstr(duet_error_last(), "echo") != NULL);
    json_decref(j);
    j = json_loads("{\"error\": {\"message\": \"x\"}}", 0, &e);
    cr_assert_eq(serving_score_echo(j, doc, strlen(doc), &s), DUET_ERR_FORMAT);
    json_decref(j);
}

/* splitmix64, for reproducible mutations */
static uint64_t mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Random byte edits of a valid answer: whatever still parses as JSON is scored without a crash,
 * and either fails with a reason or gives a finite, non-negative score of at most the document. */
Test(bench_accuracy, mutated_answers_never_crash)
{
    const char *doc = "h\xc3\xa9!";
    const char *valid = "{\"choices\": [{\"index\": 0, \"text\": \"h\\u00e9!\", \"logprobs\": "
                        "{\"tokens\": [\"\", \"h\", \"\\u00e9\", \"!\"], \"token_logprobs\": "
                        "[null, -1.0, -2.0, -0.5], \"text_offset\": [0, 0, 1, 2]}}]}";
    static const char alphabet[] = "{}[]\",:0123456789-.enulltrfas \\";
    size_t n = strlen(valid), parsed = 0, scored = 0;
    uint64_t seed = 42;
    char buf[512];
    for (int it = 0; it < 20000; it++) {
        memcpy(buf, valid, n + 1);
        int edits = 1 + (int)(mix(&seed) % 3);
        for (int e = 0; e < edits; e++)
            buf[mix(&seed) % n] = alphabet[mix(&seed) % (sizeof(alphabet) - 1)];
        json_error_t err;
        json_t *j = json_loads(buf, 0, &err);
        if (j == NULL)
            continue;
        parsed++;
        serving_doc_score_t s;
        duet_status_t st = serving_score_echo(j, doc, strlen(doc), &s);
        if (st == DUET_OK) {
            scored++;
            cr_assert(isfinite(s.bits_per_byte) && s.bits_per_byte >= -1e-2, "%s", buf);
            cr_assert(s.bytes_scored >= 1 && s.bytes_scored <= strlen(doc), "%s", buf);
        } else {
            cr_assert_eq(st, DUET_ERR_FORMAT, "%s", buf);
            cr_assert_neq(duet_error_last()[0], '\0');
        }
        json_decref(j);
    }
    cr_assert_gt(parsed, 500, "the mutations reach the scorer (%zu parsed)", parsed);
    cr_assert_gt(scored, 10, "some mutations still score (%zu)", scored);
}
