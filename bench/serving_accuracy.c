/*
 * duet-bench's accuracy gate: echo scoring and the paired t-test; the contract is in
 * serving_accuracy.h.
 */
#include "bench/serving_accuracy.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "common/utf8.h"

/* Byte position of code point `cp` in the valid UTF-8 text s[0..len); SIZE_MAX past its end. */
static size_t acc_cp_to_byte(const char *s, size_t len, size_t cp)
{
    size_t at = 0;
    for (size_t k = 0; k < cp; k++) {
        if (at >= len)
            return SIZE_MAX;
        int32_t c;
        size_t n = duet_utf8_char((const uint8_t *)s + at, len - at, &c);
        at += n > 0 ? n : 1;
    }
    return at;
}

duet_status_t serving_score_echo(const json_t *resp, const char *doc, size_t doc_len,
                                 serving_doc_score_t *out)
{
    json_t *c0 = json_array_get(json_object_get(resp, "choices"), 0);
    if (!json_is_object(c0))
        return duet_error_set(DUET_ERR_FORMAT, "no choices[0] object");
    json_t *text = json_object_get(c0, "text");
    if (!json_is_string(text))
        return duet_error_set(DUET_ERR_FORMAT, "choices[0].text is not a string");
    json_t *lp = json_object_get(c0, "logprobs");
    if (!json_is_object(lp))
        return duet_error_set(DUET_ERR_FORMAT,
                              "choices[0].logprobs is %s (does the server support echo with "
                              "logprobs?)",
                              lp == NULL ? "missing" : "not an object");
    json_t *tl = json_object_get(lp, "token_logprobs");
    json_t *off = json_object_get(lp, "text_offset");
    json_t *toks = json_object_get(lp, "tokens");
    if (!json_is_array(tl) || !json_is_array(off))
        return duet_error_set(DUET_ERR_FORMAT,
                              "choices[0].logprobs needs token_logprobs and text_offset arrays");
    size_t n = json_array_size(tl);
    if (n < 2)
        return duet_error_set(
            DUET_ERR_FORMAT, "%zu echoed token(s): nothing to score (the first has no logprob)", n);
    if (json_array_size(off) != n || (toks != NULL && json_array_size(toks) != n))
        return duet_error_set(DUET_ERR_FORMAT,
                              "token_logprobs (%zu), text_offset (%zu) and tokens (%zu) differ "
                              "in length",
                              n, json_array_size(off), json_array_size(toks));
    const char *t = json_string_value(text);
    size_t tlen = json_string_length(text);
    json_int_t prev = 0;
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *o = json_array_get(off, i);
        if (!json_is_integer(o) || json_integer_value(o) < prev) /* prev starts at 0 */
            return duet_error_set(DUET_ERR_FORMAT,
                                  "text_offset[%zu] is not an integer >= the one before", i);
        prev = json_integer_value(o);
        if (i == 0)
            continue; /* the first token has no prediction */
        json_t *v = json_array_get(tl, i);
        double x = json_is_number(v) ? json_number_value(v) : NAN;
        if (!isfinite(x) || x > 1e-3)
            return duet_error_set(DUET_ERR_FORMAT,
                                  "token_logprobs[%zu] is not a finite number <= 0", i);
        sum += x;
    }
    /* only text_offset[1] is used: later offsets may fall inside a character (a byte-level
     * token of a multi-byte one), where servers differ in what they count */
    json_int_t first = json_integer_value(json_array_get(off, 1));
    size_t pos = first >= 0 ? acc_cp_to_byte(t, tlen, (size_t)first) : SIZE_MAX;
    if (pos == SIZE_MAX)
        return duet_error_set(DUET_ERR_FORMAT, "text_offset[1] past the end of choices[0].text");
    size_t scored = tlen - pos;
    if (scored == 0)
        return duet_error_set(DUET_ERR_FORMAT, "the scored text (from text_offset[1]) is empty");
    if (scored > doc_len || memcmp(t + pos, doc + doc_len - scored, scored) != 0)
        return duet_error_set(DUET_ERR_FORMAT,
                              "choices[0].text from text_offset[1] is not the end of the "
                              "document (echo off, or text generated after the prompt?)");
    out->sum_logprob = sum;
    out->tokens_scored = n - 1;
    out->bytes_scored = scored;
    out->bits_per_byte = -sum / M_LN2 / (double)scored;
    return DUET_OK;
}

/* The continued fraction of I_x(a, b), evaluated by the modified Lentz method. */
static double acc_betacf(double a, double b, double x)
{
    const double tiny = 1e-300, eps = 1e-15;
    double qab = a + b, qap = a + 1, qam = a - 1;
    double c = 1, d = 1 - qab * x / qap;
    if (fabs(d) < tiny)
        d = tiny;
    d = 1 / d;
    double h = d;
    for (int m = 1; m <= 1000; m++) {
        double m2 = 2.0 * m;
        /* even step */
        double aa = m * (b - m) * x / ((qam + m2) * (a + m2));
        d = 1 + aa * d;
        d = fabs(d) < tiny ? 1 / tiny : 1 / d;
        c = 1 + aa / c;
        if (fabs(c) < tiny)
            c = tiny;
        h *= d * c;
        /* odd step */
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2));
        d = 1 + aa * d;
        d = fabs(d) < tiny ? 1 / tiny : 1 / d;
        c = 1 + aa / c;
        if (fabs(c) < tiny)
            c = tiny;
        double del = d * c;
        h *= del;
        if (fabs(del - 1) < eps)
            break;
    }
    return h;
}

double serving_betainc(double a, double b, double x)
{
    if (!(a > 0) || !(b > 0) || !(x >= 0) || !(x <= 1))
        return NAN;
    if (x == 0 || x == 1)
        return x;
    double lfront = lgamma(a + b) - lgamma(a) - lgamma(b) + a * log(x) + b * log1p(-x);
    /* the fraction converges fast for x below (a + 1) / (a + b + 2); use symmetry above it */
    if (x < (a + 1) / (a + b + 2))
        return exp(lfront) * acc_betacf(a, b, x) / a;
    return 1 - exp(lfront) * acc_betacf(b, a, 1 - x) / b;
}

double serving_t_sf(double t, double df)
{
    if (!(df > 0) || isnan(t))
        return NAN;
    if (isinf(t))
        return t > 0 ? 0 : 1;
    /* P(|T| >= |t|) = I_{df / (df + t^2)}(df / 2, 1 / 2); half of it in each tail */
    double tail = 0.5 * serving_betainc(df / 2, 0.5, df / (df + t * t));
    return t >= 0 ? tail : 1 - tail;
}

duet_status_t serving_paired_ttest(const double *run, const double *base, size_t n, double alpha,
                                   serving_paired_t *out)
{
    if (n < 2)
        return duet_error_set(DUET_ERR_INVALID,
                              "a paired t-test needs 2 or more documents, not %zu", n);
    double mean = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(run[i]) || !isfinite(base[i]))
            return duet_error_set(DUET_ERR_INVALID, "document %zu: a value is not finite", i);
        mean += run[i] - base[i];
    }
    mean /= (double)n;
    double ss = 0;
    for (size_t i = 0; i < n; i++) {
        double d = run[i] - base[i] - mean;
        ss += d * d;
    }
    serving_paired_t r = {.n = n, .mean_diff = mean, .df = (double)(n - 1)};
    r.sd_diff = sqrt(ss / (double)(n - 1));
    if (r.sd_diff > 0) {
        r.t = mean / (r.sd_diff / sqrt((double)n));
        r.p = serving_t_sf(r.t, r.df);
    } else if (mean != 0) { /* every difference the same, non-zero: certain either way */
        r.t = mean > 0 ? INFINITY : -INFINITY;
        r.p = mean > 0 ? 0 : 1;
    } else { /* identical: no evidence of a rise */
        r.t = 0;
        r.p = 1;
    }
    r.dropped = r.p < alpha;
    *out = r;
    return DUET_OK;
}
