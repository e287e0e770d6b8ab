/*
 * Prometheus registry (common/metrics.h): exact exposition text for a small registry, label and
 * help escaping, histogram bucket math, name validation, concurrent updates, and a format check
 * of our own (plus promtool when it is installed) so the /metrics output stays scrapeable.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/metrics.h"
#include "common/strbuf.h"

static char *render(duet_metrics_t *reg)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_metrics_render(reg, &sb), DUET_OK);
    return duet_strbuf_detach(&sb);
}

/* ------------------------------------------------------------ exposition format checker */

static bool is_metric_name(const char *s, size_t n)
{
    if (n == 0)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
                  (i > 0 && c >= '0' && c <= '9');
        if (!ok)
            return false;
    }
    return true;
}

static bool is_value(const char *s)
{
    if (strcmp(s, "+Inf") == 0 || strcmp(s, "-Inf") == 0 || strcmp(s, "NaN") == 0)
        return true;
    char *end;
    strtod(s, &end);
    return end != s && *end == '\0';
}

/*
 * Check text against the 0.0.4 grammar: HELP/TYPE comments, then samples whose names belong to
 * the last TYPE'd family, label values with only \\ \" \n escapes, numeric values; histograms
 * with non-decreasing cumulative buckets ending in +Inf and _count equal to the +Inf bucket.
 * Returns NULL when fine, else a description of the first problem (static buffer).
 */
static const char *check_exposition(const char *text)
{
    static char why[512];
    char family[256] = "", type[32] = "";
    double last_bucket = -1, inf_bucket = -1;
    const char *line = text;
    int lineno = 0;

    if (text[0] != '\0' && text[strlen(text) - 1] != '\n')
        return "text does not end in a newline";
    while (*line != '\0') {
        const char *nl = strchr(line, '\n');
        size_t n = (size_t)(nl - line);
        char buf[1024];
        lineno++;
        if (n >= sizeof(buf))
            return "line too long";
        memcpy(buf, line, n);
        buf[n] = '\0';
        line = nl + 1;

        if (strncmp(buf, "# HELP ", 7) == 0) {
            const char *name = buf + 7, *sp = strchr(name, ' ');
            if (sp == NULL || !is_metric_name(name, (size_t)(sp - name)))
                goto bad;
            for (const char *p = sp; *p != '\0'; p++)
                if (*p == '\\' && p[1] != '\\' && p[1] != 'n')
                    goto bad;
                else if (*p == '\\')
                    p++;
            continue;
        }
        if (strncmp(buf, "# TYPE ", 7) == 0) {
            if (sscanf(buf + 7, "%255s %31s", family, type) != 2)
                goto bad;
            if (strcmp(type, "counter") != 0 && strcmp(type, "gauge") != 0 &&
                strcmp(type, "histogram") != 0)
                goto bad;
            last_bucket = -1;
            inf_bucket = -1;
            continue;
        }
        if (buf[0] == '#')
            goto bad;
        /* sample: name[{labels}] value */
        size_t nlen = strcspn(buf, "{ ");
        if (!is_metric_name(buf, nlen))
            goto bad;
        char name[256];
        memcpy(name, buf, nlen);
        name[nlen] = '\0';
        const char *p = buf + nlen;
        bool has_inf_le = false;
        if (*p == '{') {
            p++;
            while (*p != '}') {
                size_t ln = strcspn(p, "=");
                if (ln == 0 || p[ln] != '=' || p[ln + 1] != '"')
                    goto bad;
                bool is_le = ln == 2 && strncmp(p, "le", 2) == 0;
                p += ln + 2;
                const char *vstart = p;
                while (*p != '"') {
                    if (*p == '\0' || *p == '\n')
                        goto bad;
                    if (*p == '\\') {
                        if (p[1] != '\\' && p[1] != '"' && p[1] != 'n')
                            goto bad;
                        p++;
                    }
                    p++;
                }
                if (is_le && strncmp(vstart, "+Inf\"", 5) == 0)
                    has_inf_le = true;
                p++;
                if (*p == ',')
                    p++;
                else if (*p != '}')
                    goto bad;
            }
            p++;
        }
        if (*p != ' ' || !is_value(p + 1))
            goto bad;
        double v = strtod(p + 1, NULL);
        if (strcmp(type, "histogram") == 0) {
            char want[300];
            snprintf(want, sizeof(want), "%s_bucket", family);
            if (strcmp(name, want) == 0) {
                if (v < last_bucket)
                    goto bad;
                last_bucket = v;
                if (has_inf_le)
                    inf_bucket = v, last_bucket = -1;
                continue;
            }
            snprintf(want, sizeof(want), "%s_count", family);
            if (strcmp(name, want) == 0) {
                if (inf_bucket < 0 || v != inf_bucket)
                    goto bad;
                continue;
            }
            snprintf(want, sizeof(want), "%s_sum", family);
            if (strcmp(name, want) == 0)
                continue;
            goto bad;
        }
        if (strcmp(name, family) != 0)
            goto bad;
    }
    return NULL;
bad:
    snprintf(why, sizeof(why), "exposition line %d is malformed", lineno);
    return why;
}

/* Run promtool on the text when it is installed; skip silently otherwise. */
static void promtool_check(const char *text)
{
    if (system("command -v promtool >/dev/null 2>&1") != 0)
        return;
    char path[] = "/tmp/duet_metrics_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "promtool check metrics < %s", path);
    int rc = system(cmd);
    unlink(path);
    cr_assert_eq(rc, 0, "promtool check metrics failed on:\n%s", text);
}

/* ------------------------------------------------------------ tests */

static duet_metrics_t *small_registry(void)
{
    duet_metrics_t *reg;
    duet_metric_family_t *req, *depth, *ttft;
    duet_metric_t *m;
    const char *const labels[] = {"endpoint", "status"};
    const double buckets[] = {0.25, 0.5, 1};

    cr_assert_eq(duet_metrics_create(&reg), DUET_OK);
    cr_assert_eq(
        duet_metrics_counter_new(reg, "duet_requests_total", "Requests served.", labels, 2, &req),
        DUET_OK);
    cr_assert_eq(
        duet_metrics_gauge_new(reg, "duet_queue_depth", "Requests waiting.", NULL, 0, &depth),
        DUET_OK);
    cr_assert_eq(duet_metrics_histogram_new(reg, "duet_ttft_seconds", "Time to first token.", NULL,
                                            0, buckets, 3, &ttft),
                 DUET_OK);

    cr_assert_eq(duet_metrics_child(req, (const char *const[]){"/v1/completions", "200"}, 2, &m),
                 DUET_OK);
    duet_metrics_counter_inc(m);
    duet_metrics_counter_inc(m);
    duet_metrics_counter_inc(m);
    cr_assert_eq(duet_metrics_child(req, (const char *const[]){"/v1/models", "404"}, 2, &m),
                 DUET_OK);
    duet_metrics_counter_add(m, 2);
    duet_metrics_gauge_set(duet_metrics_single(depth), 7);
    m = duet_metrics_single(ttft);
    duet_metrics_histogram_observe(m, 0.125);
    duet_metrics_histogram_observe(m, 0.25); /* on the bound: counts in le="0.25" */
    duet_metrics_histogram_observe(m, 0.375);
    duet_metrics_histogram_observe(m, 2);
    return reg;
}

Test(common_metrics, exact_text_small_registry, .timeout = 30)
{
    duet_metrics_t *reg = small_registry();
    char *text = render(reg);
    const char *want = "# HELP duet_requests_total Requests served.\n"
                       "# TYPE duet_requests_total counter\n"
                       "duet_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 3\n"
                       "duet_requests_total{endpoint=\"/v1/models\",status=\"404\"} 2\n"
                       "# HELP duet_queue_depth Requests waiting.\n"
                       "# TYPE duet_queue_depth gauge\n"
                       "duet_queue_depth 7\n"
                       "# HELP duet_ttft_seconds Time to first token.\n"
                       "# TYPE duet_ttft_seconds histogram\n"
                       "duet_ttft_seconds_bucket{le=\"0.25\"} 2\n"
                       "duet_ttft_seconds_bucket{le=\"0.5\"} 3\n"
                       "duet_ttft_seconds_bucket{le=\"1\"} 3\n"
                       "duet_ttft_seconds_bucket{le=\"+Inf\"} 4\n"
                       "duet_ttft_seconds_sum 2.75\n"
                       "duet_ttft_seconds_count 4\n";
    cr_assert_str_eq(text, want);
    cr_assert_null(check_exposition(text), "%s\n%s", check_exposition(text), text);
    promtool_check(text);
    free(text);
    duet_metrics_destroy(reg);
}

Test(common_metrics, render_into_caller_buffer, .timeout = 30)
{
    duet_metrics_t *reg = small_registry();
    char *text = render(reg);
    char buf[4096];
    size_t len = 0;
    cr_assert_eq(duet_metrics_render_buf(reg, buf, sizeof(buf), &len), DUET_OK);
    cr_assert_eq(len, strlen(text));
    cr_assert_str_eq(buf, text);
    cr_assert_eq(duet_metrics_render_buf(reg, buf, 10, &len), DUET_ERR_NO_SPACE);
    cr_assert_eq(len, strlen(text), "needed length is reported");
    free(text);
    duet_metrics_destroy(reg);
}

Test(common_metrics, label_and_help_escaping, .timeout = 30)
{
    duet_metrics_t *reg;
    duet_metric_family_t *fam;
    duet_metric_t *m;
    cr_assert_eq(duet_metrics_create(&reg), DUET_OK);
    cr_assert_eq(duet_metrics_gauge_new(reg, "duet_odd", "back\\slash \"quoted\"\nsecond line",
                                        (const char *const[]){"path"}, 1, &fam),
                 DUET_OK);
    cr_assert_eq(duet_metrics_child(fam, (const char *const[]){"a\"b\\c\nd"}, 1, &m), DUET_OK);
    duet_metrics_gauge_set(m, -1.5);
    char *text = render(reg);
    cr_assert_str_eq(text, "# HELP duet_odd back\\\\slash \"quoted\"\\nsecond line\n"
                           "# TYPE duet_odd gauge\n"
                           "duet_odd{path=\"a\\\"b\\\\c\\nd\"} -1.5\n");
    cr_assert_null(check_exposition(text), "%s", text);
    promtool_check(text);
    free(text);
    duet_metrics_destroy(reg);
}

Test(common_metrics, histogram_bucket_math, .timeout = 30)
{
    duet_metrics_t *reg;
    duet_metric_family_t *fam;
    double b[5];
    duet_metrics_buckets_linear(1, 1, 5, b); /* 1 2 3 4 5 */
    cr_assert_eq(b[0], 1);
    cr_assert_eq(b[4], 5);
    cr_assert_eq(duet_metrics_create(&reg), DUET_OK);
    cr_assert_eq(duet_metrics_histogram_new(reg, "duet_batch_size", "Batch sizes.",
                                            (const char *const[]){"role"}, 1, b, 5, &fam),
                 DUET_OK);
    duet_metric_t *m;
    cr_assert_eq(duet_metrics_child(fam, (const char *const[]){"gen"}, 1, &m), DUET_OK);
    /* 0..9: le=1 gets {0,1}, le=2 {2}, ..., le=5 {5}, +Inf {6,7,8,9}. */
    for (int i = 0; i < 10; i++)
        duet_metrics_histogram_observe(m, i);
    cr_assert_eq(duet_metrics_histogram_count(m), 10);
    cr_assert_eq(duet_metrics_value(m), 45);
    char *text = render(reg);
    cr_assert(strstr(text, "duet_batch_size_bucket{role=\"gen\",le=\"1\"} 2\n") != NULL, "%s",
              text);
    cr_assert(strstr(text, "duet_batch_size_bucket{role=\"gen\",le=\"3\"} 4\n") != NULL);
    cr_assert(strstr(text, "duet_batch_size_bucket{role=\"gen\",le=\"5\"} 6\n") != NULL);
    cr_assert(strstr(text, "duet_batch_size_bucket{role=\"gen\",le=\"+Inf\"} 10\n") != NULL);
    cr_assert(strstr(text, "duet_batch_size_sum{role=\"gen\"} 45\n") != NULL);
    cr_assert(strstr(text, "duet_batch_size_count{role=\"gen\"} 10\n") != NULL);
    cr_assert_null(check_exposition(text), "%s", text);
    promtool_check(text);
    free(text);

    duet_metrics_buckets_exponential(0.001, 2, 5, b);
    cr_assert_float_eq(b[4], 0.016, 1e-12);
    duet_metrics_destroy(reg);
}

Test(common_metrics, default_buckets_and_trailing_inf, .timeout = 30)
{
    duet_metrics_t *reg;
    duet_metric_family_t *a, *b;
    const double with_inf[] = {1, 2, INFINITY};
    cr_assert_eq(duet_metrics_create(&reg), DUET_OK);
    cr_assert_eq(duet_metrics_histogram_new(reg, "duet_alpha_seconds", "A.", NULL, 0, NULL, 0, &a),
                 DUET_OK);
    cr_assert_eq(
        duet_metrics_histogram_new(reg, "duet_beta_seconds", "B.", NULL, 0, with_inf, 3, &b),
        DUET_OK);
    char *text = render(reg);
    cr_assert(strstr(text, "duet_alpha_seconds_bucket{le=\"0.005\"} 0\n") != NULL, "%s", text);
    cr_assert(strstr(text, "duet_alpha_seconds_bucket{le=\"10\"} 0\n") != NULL);
    /* exactly one +Inf bucket for b */
    const char *p = strstr(text, "duet_beta_seconds_bucket{le=\"+Inf\"}");
    cr_assert(p != NULL);
    cr_assert_null(strstr(p + 1, "duet_beta_seconds_bucket{le=\"+Inf\"}"));
    cr_assert_null(check_exposition(text), "%s", text);
    promtool_check(text);
    free(text);
    duet_metrics_destroy(reg);
}

Test(common_metrics, names_validated_at_registration, .timeout = 30)
{
    duet_metrics_t *reg;
    duet_metric_family_t *f;
    const double bad_buckets[] = {1, 1, 2};
    cr_assert_eq(duet_metrics_create(&reg), DUET_OK);
    cr_assert_eq(duet_metrics_counter_new(reg, "duet_requests", "x", NULL, 0, &f),
                 DUET_ERR_INVALID);
    cr_assert(strstr(duet_error_last(), "_total") != NULL);
    cr_assert_eq(duet_metrics_gauge_new(reg, "1duet", "x", NULL, 0, &f), DUET_ERR_INVALID);
    cr_assert_eq(duet_metrics_gauge_new(reg, "duet-x", "x", NULL, 0, &f), DUET_ERR_INVALID);
    cr_assert_eq(duet_metrics_gauge_new(reg, "", "x", NULL, 0, &f), DUET_ERR_INVALID);
    cr_assert_eq(duet_metrics_gauge_new(reg, "duet_x", "x", (const char *const[]){"__r"}, 1, &f),
                 DUET_ERR_INVALID);
    cr_assert_eq(duet_metrics_gauge_new(reg, "duet_x", "x", (const char *const[]){"a:b"}, 1, &f),
                 DUET_ERR_INVALID);
    cr_assert_eq(duet_metrics_gauge_new(reg, "duet_x", "x", (const char *const[]){"a", "a"}, 2, &f),
                 DUET_ERR_INVALID);
    cr_assert_eq(
        duet_metrics_histogram_new(reg, "duet_h", "x", (const char *const[]){"le"}, 1, NULL, 0, &f),
        DUET_ERR_INVALID);
    cr_assert_eq(duet_metrics_histogram_new(reg, "duet_h", "x", NULL, 0, bad_buckets, 3, &f),
                 DUET_ERR_INVALID);
    cr_assert_eq(duet_metrics_gauge_new(reg, "duet:ok_x", "x", NULL, 0, &f), DUET_OK);
    cr_assert_eq(duet_metrics_gauge_new(reg, "duet:ok_x", "x", NULL, 0, &f), DUET_ERR_INVALID);
    cr_assert(strstr(duet_error_last(), "already registered") != NULL);
    duet_metrics_destroy(reg);
    duet_metrics_destroy(NULL);
}

Test(common_metrics, child_lookup_is_stable_and_bounded, .timeout = 30)
{
    duet_metrics_t *reg;
    duet_metric_family_t *f;
    duet_metric_t *a, *b;
    cr_assert_eq(duet_metrics_create(&reg), DUET_OK);
    cr_assert_eq(
        duet_metrics_counter_new(reg, "duet_x_total", "x", (const char *const[]){"k"}, 1, &f),
        DUET_OK);
    cr_assert_eq(duet_metrics_child(f, (const char *const[]){"v"}, 1, &a), DUET_OK);
    cr_assert_eq(duet_metrics_child(f, (const char *const[]){"v"}, 1, &b), DUET_OK);
    cr_assert_eq(a, b);
    char v[32];
    for (int i = 1; i < DUET_METRICS_MAX_CHILDREN; i++) {
        snprintf(v, sizeof(v), "v%d", i);
        /* Plain check: ctest runs with --full-stats, which ships every assertion to the runner. */
        if (duet_metrics_child(f, (const char *const[]){v}, 1, &a) != DUET_OK)
            cr_assert_fail("child %d: %s", i, duet_error_last());
    }
    cr_assert_eq(duet_metrics_child(f, (const char *const[]){"one-too-many"}, 1, &a),
                 DUET_ERR_NO_SPACE);
    duet_metrics_destroy(reg);
}

Test(common_metrics, wrong_label_count_aborts, .timeout = 30, .signal = SIGABRT)
{
    duet_metrics_t *reg;
    duet_metric_family_t *f;
    duet_metric_t *m;
    cr_assert_eq(duet_metrics_create(&reg), DUET_OK);
    cr_assert_eq(
        duet_metrics_counter_new(reg, "duet_x_total", "x", (const char *const[]){"k"}, 1, &f),
        DUET_OK);
    duet_metrics_child(f, NULL, 0, &m);
}

/* ------------------------------------------------------------ concurrency */

#define N_THREADS 8
#define N_ITERS   100000

typedef struct {
    duet_metric_family_t *req;
    duet_metric_t *gauge;
    duet_metric_t *hist;
    duet_metrics_t *reg;
} shared_t;

/* Criterion's asserts may not fire off the main thread: threads count failures instead. */
static _Atomic int thread_failures;

static void *hammer(void *arg)
{
    shared_t *s = arg;
    duet_metric_t *m;
    /* Every thread looks the same child up: all must get the same series. */
    if (duet_metrics_child(s->req, (const char *const[]){"/v1/completions"}, 1, &m) != DUET_OK) {
        thread_failures++;
        return NULL;
    }
    for (int i = 0; i < N_ITERS; i++) {
        duet_metrics_counter_inc(m);
        duet_metrics_gauge_inc(s->gauge);
        duet_metrics_gauge_dec(s->gauge);
        duet_metrics_histogram_observe(s->hist, (double)(i % 4));
    }
    return NULL;
}

static void *scraper(void *arg)
{
    shared_t *s = arg;
    for (int i = 0; i < 50; i++) {
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        if (duet_metrics_render(s->reg, &sb) != DUET_OK || check_exposition(sb.data) != NULL)
            thread_failures++;
        duet_strbuf_free(&sb);
    }
    return NULL;
}

Test(common_metrics, concurrent_updates_are_exact, .timeout = 60)
{
    shared_t s;
    duet_metric_family_t *g, *h;
    pthread_t t[N_THREADS + 1];
    const double buckets[] = {0, 1, 2};

    cr_assert_eq(duet_metrics_create(&s.reg), DUET_OK);
    cr_assert_eq(duet_metrics_counter_new(s.reg, "duet_requests_total", "Requests.",
                                          (const char *const[]){"endpoint"}, 1, &s.req),
                 DUET_OK);
    cr_assert_eq(duet_metrics_gauge_new(s.reg, "duet_inflight", "In flight.", NULL, 0, &g),
                 DUET_OK);
    cr_assert_eq(duet_metrics_histogram_new(s.reg, "duet_x", "X.", NULL, 0, buckets, 3, &h),
                 DUET_OK);
    s.gauge = duet_metrics_single(g);
    s.hist = duet_metrics_single(h);
    for (int i = 0; i < N_THREADS; i++)
        pthread_create(&t[i], NULL, hammer, &s);
    pthread_create(&t[N_THREADS], NULL, scraper, &s);
    for (int i = 0; i <= N_THREADS; i++)
        pthread_join(t[i], NULL);

    cr_assert_eq(thread_failures, 0);
    duet_metric_t *m;
    cr_assert_eq(duet_metrics_child(s.req, (const char *const[]){"/v1/completions"}, 1, &m),
                 DUET_OK);
    cr_assert_eq(duet_metrics_value(m), (double)N_THREADS * N_ITERS);
    cr_assert_eq(duet_metrics_value(s.gauge), 0);
    cr_assert_eq(duet_metrics_histogram_count(s.hist), (uint64_t)N_THREADS * N_ITERS);
    /* i % 4 over 0..N_ITERS-1 sums to 1.5 * N_ITERS per thread. */
    cr_assert_eq(duet_metrics_value(s.hist), 1.5 * N_THREADS * N_ITERS);
    char *text = render(s.reg);
    cr_assert(strstr(text, "duet_requests_total{endpoint=\"/v1/completions\"} 800000\n") != NULL,
              "%s", text);
    cr_assert(strstr(text, "duet_x_bucket{le=\"0\"} 200000\n") != NULL, "%s", text);
    cr_assert(strstr(text, "duet_x_bucket{le=\"+Inf\"} 800000\n") != NULL, "%s", text);
    promtool_check(text);
    free(text);
    duet_metrics_destroy(s.reg);
}
