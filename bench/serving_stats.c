/*
 * Serving-benchmark metric math; the definitions are in serving_stats.h. Kept free of I/O so the
 * unit tests can feed hand-computed record sets.
 */
#include "bench/serving_stats.h"

#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static int stats_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double serving_percentile_sorted(const double *v, size_t n, double p)
{
    if (n == 0)
        return NAN;
    double rank = p / 100.0 * (double)(n - 1);
    if (rank <= 0)
        return v[0];
    if (rank >= (double)(n - 1))
        return v[n - 1];
    size_t lo = (size_t)floor(rank);
    double frac = rank - (double)lo;
    return v[lo] + (v[lo + 1] - v[lo]) * frac;
}

void serving_dist_compute(double *v, size_t n, serving_dist_t *d)
{
    d->n = n;
    if (n == 0) {
        d->mean = d->median = d->std = d->p90 = d->p99 = d->min = d->max = NAN;
        return;
    }
    qsort(v, n, sizeof(*v), stats_cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    double mean = sum / (double)n;
    double ss = 0;
    for (size_t i = 0; i < n; i++)
        ss += (v[i] - mean) * (v[i] - mean);
    d->mean = mean;
    d->std = sqrt(ss / (double)n);
    d->median = serving_percentile_sorted(v, n, 50);
    d->p90 = serving_percentile_sorted(v, n, 90);
    d->p99 = serving_percentile_sorted(v, n, 99);
    d->min = v[0];
    d->max = v[n - 1];
}

/* The request's TPOT in ms, or NaN when it has fewer than 2 output tokens. */
static double stats_tpot(const serving_record_t *r)
{
    if (r->output_tokens < 2)
        return NAN;
    return (r->e2el_ms - r->ttft_ms) / (double)(r->output_tokens - 1);
}

static bool stats_meets_slo(const serving_record_t *r, const serving_slo_t *slo)
{
    double tpot = stats_tpot(r);
    if (isnan(tpot))
        tpot = 0; /* vLLM: a 1-token request has TPOT 0 for goodput */
    if (slo->ttft_ms > 0 && r->ttft_ms > slo->ttft_ms)
        return false;
    if (slo->tpot_ms > 0 && tpot > slo->tpot_ms)
        return false;
    if (slo->e2el_ms > 0 && r->e2el_ms > slo->e2el_ms)
        return false;
    return true;
}

duet_status_t serving_summarize(const serving_record_t *recs, size_t n, double duration_s,
                                const serving_slo_t *slo, serving_summary_t *out_p)
{
    if (!(duration_s > 0))
        return duet_error_set(DUET_ERR_INVALID, "benchmark duration must be positive");
    size_t n_itl = 0;
    for (size_t i = 0; i < n; i++)
        if (recs[i].ok)
            n_itl += recs[i].n_itl;
    /* one allocation carved into the four scratch arrays (+1 so malloc(0) never happens) */
    double *scratch = malloc((3 * n + n_itl + 1) * sizeof(*scratch));
    if (scratch == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "stats scratch for %zu records", n);
    double *ttft = scratch, *tpot = scratch + n, *e2el = scratch + 2 * n, *itl = scratch + 3 * n;

    serving_summary_t s = {0};
    size_t n_tpot = 0, at_itl = 0, n_user = 0;
    double user_sum = 0;
    bool has_slo = slo != NULL && (slo->ttft_ms > 0 || slo->tpot_ms > 0 || slo->e2el_ms > 0);
    for (size_t i = 0; i < n; i++) {
        const serving_record_t *r = &recs[i];
        if (!r->ok) {
            s.failed++;
            continue;
        }
        ttft[s.completed] = r->ttft_ms;
        e2el[s.completed] = r->e2el_ms;
        s.completed++;
        s.total_input_tokens += r->prompt_tokens;
        s.total_output_tokens += r->output_tokens;
        double t = stats_tpot(r);
        if (!isnan(t)) {
            tpot[n_tpot++] = t;
            double decode_ms = r->e2el_ms - r->ttft_ms;
            if (decode_ms > 0) {
                user_sum += (double)(r->output_tokens - 1) * 1000.0 / decode_ms;
                n_user++;
            }
        }
        if (r->n_itl > 0) {
            memcpy(itl + at_itl, r->itl_ms, r->n_itl * sizeof(*itl));
            at_itl += r->n_itl;
        }
        if (has_slo && stats_meets_slo(r, slo))
            s.good++;
    }
    s.duration_s = duration_s;
    s.error_rate = n > 0 ? (double)s.failed / (double)n : NAN;
    s.request_throughput = (double)s.completed / duration_s;
    s.output_throughput = (double)s.total_output_tokens / duration_s;
    s.total_token_throughput = (double)(s.total_input_tokens + s.total_output_tokens) / duration_s;
    s.user_throughput = n_user > 0 ? user_sum / (double)n_user : NAN;
    s.has_goodput = has_slo;
    s.goodput = has_slo ? (double)s.good / duration_s : NAN;
    serving_dist_compute(ttft, s.completed, &s.ttft);
    serving_dist_compute(tpot, n_tpot, &s.tpot);
    serving_dist_compute(itl, at_itl, &s.itl);
    serving_dist_compute(e2el, s.completed, &s.e2el);
    free(scratch);
    *out_p = s;
    return DUET_OK;
}

duet_status_t serving_slo_parse_item(const char *item, serving_slo_t *slo)
{
    const char *colon = strchr(item, ':');
    if (colon == NULL)
        return duet_error_set(DUET_ERR_INVALID, "--goodput item \"%s\": expected NAME:MS", item);
    size_t klen = (size_t)(colon - item);
    char *end = NULL;
    double ms = strtod(colon + 1, &end);
    if (end == colon + 1 || *end != '\0' || !(ms > 0) || isinf(ms))
        return duet_error_set(DUET_ERR_INVALID,
                              "--goodput item \"%s\": the bound must be a positive number of ms",
                              item);
    if (klen == 4 && strncmp(item, "ttft", 4) == 0)
        slo->ttft_ms = ms;
    else if (klen == 4 && strncmp(item, "tpot", 4) == 0)
        slo->tpot_ms = ms;
    else if (klen == 4 && strncmp(item, "e2el", 4) == 0)
        slo->e2el_ms = ms;
    else
        return duet_error_set(DUET_ERR_INVALID,
                              "--goodput item \"%s\": the metric must be ttft, tpot or e2el", item);
    return DUET_OK;
}

/*
 * The label set of a sample from line[*i] = '{' to its '}' (line[*i] is left after it): false
 * when it does not parse. *match says whether it holds label="value" (true when label is NULL).
 */
static bool prom_labels(const char *line, size_t llen, size_t *i, const char *label,
                        const char *value, bool *match)
{
    size_t at = *i + 1;
    *match = label == NULL;
    for (;;) {
        while (at < llen && (line[at] == ' ' || line[at] == ','))
            at++;
        if (at < llen && line[at] == '}')
            break;
        const size_t key = at;
        while (at < llen && (isalnum((unsigned char)line[at]) || line[at] == '_'))
            at++;
        const size_t key_len = at - key;
        if (key_len == 0 || at + 1 >= llen || line[at] != '=' || line[at + 1] != '"')
            return false;
        at += 2;
        const size_t val = at; /* label values may hold '}' and escaped quotes */
        while (at < llen && line[at] != '"')
            at += line[at] == '\\' ? 2 : 1;
        if (at >= llen)
            return false;
        if (label != NULL && strlen(label) == key_len && memcmp(line + key, label, key_len) == 0 &&
            strlen(value) == at - val && memcmp(line + val, value, at - val) == 0)
            *match = true;
        at++; /* the closing quote */
    }
    *i = at + 1;
    return true;
}

void serving_prom_sum(const char *text, size_t len, const char *name, double *sum_p, bool *found_p)
{
    serving_prom_sum_where(text, len, name, NULL, NULL, sum_p, found_p);
}

void serving_prom_sum_where(const char *text, size_t len, const char *name, const char *label,
                            const char *value, double *sum_p, bool *found_p)
{
    size_t nlen = strlen(name);
    double sum = 0;
    bool found = false;
    size_t at = 0;
    while (at < len) {
        const char *line = text + at;
        const char *nl = memchr(line, '\n', len - at);
        size_t llen = nl != NULL ? (size_t)(nl - line) : len - at;
        at += llen + 1;
        if (llen <= nlen || line[0] == '#' || memcmp(line, name, nlen) != 0)
            continue;
        size_t i = nlen;
        bool match = label == NULL;
        if (line[i] == '{' && !prom_labels(line, llen, &i, label, value, &match))
            continue;
        if (i >= llen || (line[i] != ' ' && line[i] != '\t'))
            continue; /* a longer name sharing the prefix, e.g. name_bucket */
        if (!match)
            continue;
        while (i < llen && (line[i] == ' ' || line[i] == '\t'))
            i++;
        char num[64];
        size_t k = 0;
        while (i < llen && !isspace((unsigned char)line[i]) && k + 1 < sizeof(num))
            num[k++] = line[i++];
        num[k] = '\0';
        char *end = NULL;
        double v = strtod(num, &end);
        if (k == 0 || *end != '\0' || isnan(v))
            continue;
        sum += v;
        found = true;
    }
    *sum_p = sum;
    *found_p = found;
}
