/*
 * Prometheus registry and text exposition; see metrics.h for the model.
 *
 * Locking: the registry mutex guards the family list, each family's mutex guards its child list.
 * Both lists are append-only until destroy, so a child pointer handed out stays valid and updates
 * need no lock. Rendering holds the registry mutex, then each family's in turn (always in that
 * order), and reads the values with atomic loads.
 */
#include "common/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

struct duet_metric {
    duet_metric_family_t *fam;   /* not owned: the family this child belongs to */
    char **values;               /* owned: fam->n_labels label values */
    _Atomic uint64_t value_bits; /* double bits: counter/gauge value, histogram sum */
    _Atomic uint64_t *buckets;   /* owned, histogram only: (n_bounds + 1) counts, last = +Inf */
    duet_metric_t *next;         /* creation order */
};

struct duet_metric_family {
    duet_metric_type_t type;
    char *name;         /* owned */
    char *help;         /* owned */
    char **label_names; /* owned, n_labels entries */
    size_t n_labels;
    double *bounds; /* owned, histogram only: n_bounds finite upper bounds */
    size_t n_bounds;
    pthread_mutex_t mu; /* guards head/tail/n_children */
    duet_metric_t *head;
    duet_metric_t **tail;
    size_t n_children;
    duet_metric_family_t *next; /* registration order */
};

struct duet_metrics {
    pthread_mutex_t mu; /* guards the family list */
    duet_metric_family_t *head;
    duet_metric_family_t **tail;
};

static const double metrics_default_buckets[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                 0.5,   1.0,  2.5,   5.0,  10.0};

static inline double bits_to_double(uint64_t b)
{
    double d;
    memcpy(&d, &b, sizeof(d));
    return d;
}

static inline uint64_t double_to_bits(double d)
{
    uint64_t b;
    memcpy(&b, &d, sizeof(b));
    return b;
}

static void atomic_add_double(_Atomic uint64_t *p, double v)
{
    uint64_t old = atomic_load_explicit(p, memory_order_relaxed);
    for (;;) {
        uint64_t upd = double_to_bits(bits_to_double(old) + v);
        if (atomic_compare_exchange_weak_explicit(p, &old, upd, memory_order_relaxed,
                                                  memory_order_relaxed))
            return;
    }
}

/* ---------------------------------------------------------------- names */

static bool metric_name_valid(const char *s)
{
    if (s == NULL || s[0] == '\0')
        return false;
    for (size_t i = 0; s[i] != '\0'; i++) {
        char c = s[i];
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
        bool digit = c >= '0' && c <= '9';
        if (!(alpha || (i > 0 && digit)))
            return false;
    }
    return true;
}

static bool label_name_valid(const char *s)
{
    if (s == NULL || s[0] == '\0' || strncmp(s, "__", 2) == 0)
        return false;
    for (size_t i = 0; s[i] != '\0'; i++) {
        char c = s[i];
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
        bool digit = c >= '0' && c <= '9';
        if (!(alpha || (i > 0 && digit)))
            return false;
    }
    return true;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* ---------------------------------------------------------------- registry */

duet_status_t duet_metrics_create(duet_metrics_t **reg_p)
{
    duet_metrics_t *reg = calloc(1, sizeof(*reg));
    if (reg == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "metrics: out of memory");
    pthread_mutex_init(&reg->mu, NULL);
    reg->tail = &reg->head;
    *reg_p = reg;
    return DUET_OK;
}

static void metric_free(duet_metric_t *m, size_t n_labels)
{
    if (m == NULL)
        return;
    if (m->values != NULL) {
        for (size_t i = 0; i < n_labels; i++)
            free(m->values[i]);
        free(m->values);
    }
    free((void *)m->buckets);
    free(m);
}

static void family_free(duet_metric_family_t *fam)
{
    if (fam == NULL)
        return;
    duet_metric_t *m = fam->head;
    while (m != NULL) {
        duet_metric_t *next = m->next;
        metric_free(m, fam->n_labels);
        m = next;
    }
    if (fam->label_names != NULL) {
        for (size_t i = 0; i < fam->n_labels; i++)
            free(fam->label_names[i]);
        free(fam->label_names);
    }
    pthread_mutex_destroy(&fam->mu);
    free(fam->bounds);
    free(fam->help);
    free(fam->name);
    free(fam);
}

void duet_metrics_destroy(duet_metrics_t *reg)
{
    if (reg == NULL)
        return;
    duet_metric_family_t *fam = reg->head;
    while (fam != NULL) {
        duet_metric_family_t *next = fam->next;
        family_free(fam);
        fam = next;
    }
    pthread_mutex_destroy(&reg->mu);
    free(reg);
}

/* A new child with copied label values, not yet linked. NULL on allocation failure. */
static duet_metric_t *metric_new(duet_metric_family_t *fam, const char *const *values)
{
    duet_metric_t *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return NULL;
    m->fam = fam;
    if (fam->n_labels > 0) {
        m->values = calloc(fam->n_labels, sizeof(*m->values));
        if (m->values == NULL)
            goto fail;
        for (size_t i = 0; i < fam->n_labels; i++) {
            m->values[i] = strdup(values[i]);
            if (m->values[i] == NULL)
                goto fail;
        }
    }
    if (fam->type == DUET_METRIC_HISTOGRAM) {
        m->buckets = calloc(fam->n_bounds + 1, sizeof(*m->buckets));
        if (m->buckets == NULL)
            goto fail;
    }
    atomic_init(&m->value_bits, double_to_bits(0.0));
    return m;
fail:
    metric_free(m, fam->n_labels);
    return NULL;
}

static duet_status_t family_register(duet_metrics_t *reg, duet_metric_type_t type, const char *name,
                                     const char *help, const char *const *label_names,
                                     size_t n_labels, const double *buckets, size_t n_buckets,
                                     duet_metric_family_t **fam_p)
{
    duet_status_t st = DUET_OK;
    duet_metric_family_t *fam = NULL;

    if (!metric_name_valid(name))
        return duet_error_set(DUET_ERR_INVALID, "metrics: invalid metric name \"%s\"",
                              name != NULL ? name : "(null)");
    if (type == DUET_METRIC_COUNTER && !ends_with(name, "_total"))
        return duet_error_set(DUET_ERR_INVALID, "metrics: counter \"%s\" must end in _total", name);
    if (n_labels > DUET_METRICS_MAX_LABELS)
        return duet_error_set(DUET_ERR_INVALID, "metrics: %s: too many labels (%zu)", name,
                              n_labels);
    for (size_t i = 0; i < n_labels; i++) {
        if (!label_name_valid(label_names[i]))
            return duet_error_set(DUET_ERR_INVALID, "metrics: %s: invalid label name \"%s\"", name,
                                  label_names[i] != NULL ? label_names[i] : "(null)");
        if (type == DUET_METRIC_HISTOGRAM && strcmp(label_names[i], "le") == 0)
            return duet_error_set(DUET_ERR_INVALID,
                                  "metrics: %s: label \"le\" is reserved for histograms", name);
        for (size_t j = 0; j < i; j++)
            if (strcmp(label_names[i], label_names[j]) == 0)
                return duet_error_set(DUET_ERR_INVALID, "metrics: %s: duplicate label \"%s\"", name,
                                      label_names[i]);
    }
    if (type == DUET_METRIC_HISTOGRAM) {
        if (buckets == NULL) {
            buckets = metrics_default_buckets;
            n_buckets = sizeof(metrics_default_buckets) / sizeof(metrics_default_buckets[0]);
        }
        if (n_buckets > 0 && isinf(buckets[n_buckets - 1]) && buckets[n_buckets - 1] > 0)
            n_buckets--; /* +Inf is implied */
        if (n_buckets > DUET_METRICS_MAX_BUCKETS)
            return duet_error_set(DUET_ERR_INVALID, "metrics: %s: too many buckets (%zu)", name,
                                  n_buckets);
        for (size_t i = 0; i < n_buckets; i++) {
            if (!isfinite(buckets[i]) || (i > 0 && !(buckets[i] > buckets[i - 1])))
                return duet_error_set(DUET_ERR_INVALID,
                                      "metrics: %s: buckets must be finite and strictly "
                                      "increasing (bucket %zu)",
                                      name, i);
        }
    }

    fam = calloc(1, sizeof(*fam));
    if (fam == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "metrics: out of memory");
    pthread_mutex_init(&fam->mu, NULL);
    fam->type = type;
    fam->tail = &fam->head;
    fam->name = strdup(name);
    fam->help = strdup(help != NULL ? help : "");
    if (fam->name == NULL || fam->help == NULL)
        goto nomem;
    if (n_labels > 0) {
        fam->label_names = calloc(n_labels, sizeof(*fam->label_names));
        if (fam->label_names == NULL)
            goto nomem;
        fam->n_labels = n_labels;
        for (size_t i = 0; i < n_labels; i++) {
            fam->label_names[i] = strdup(label_names[i]);
            if (fam->label_names[i] == NULL)
                goto nomem;
        }
    }
    if (type == DUET_METRIC_HISTOGRAM && n_buckets > 0) {
        fam->bounds = malloc(n_buckets * sizeof(*fam->bounds));
        if (fam->bounds == NULL)
            goto nomem;
        memcpy(fam->bounds, buckets, n_buckets * sizeof(*fam->bounds));
        fam->n_bounds = n_buckets;
    }
    if (n_labels == 0) {
        duet_metric_t *m = metric_new(fam, NULL);
        if (m == NULL)
            goto nomem;
        fam->head = m;
        fam->tail = &m->next;
        fam->n_children = 1;
    }

    pthread_mutex_lock(&reg->mu);
    for (duet_metric_family_t *f = reg->head; f != NULL; f = f->next) {
        if (strcmp(f->name, name) == 0) {
            pthread_mutex_unlock(&reg->mu);
            st = duet_error_set(DUET_ERR_INVALID, "metrics: %s: already registered", name);
            goto fail;
        }
    }
    *reg->tail = fam;
    reg->tail = &fam->next;
    pthread_mutex_unlock(&reg->mu);
    *fam_p = fam;
    return DUET_OK;

nomem:
    st = duet_error_set(DUET_ERR_NOMEM, "metrics: out of memory");
fail:
    family_free(fam);
    return st;
}

duet_status_t duet_metrics_counter_new(duet_metrics_t *reg, const char *name, const char *help,
                                       const char *const *label_names, size_t n_labels,
                                       duet_metric_family_t **fam_p)
{
    return family_register(reg, DUET_METRIC_COUNTER, name, help, label_names, n_labels, NULL, 0,
                           fam_p);
}

duet_status_t duet_metrics_gauge_new(duet_metrics_t *reg, const char *name, const char *help,
                                     const char *const *label_names, size_t n_labels,
                                     duet_metric_family_t **fam_p)
{
    return family_register(reg, DUET_METRIC_GAUGE, name, help, label_names, n_labels, NULL, 0,
                           fam_p);
}

duet_status_t duet_metrics_histogram_new(duet_metrics_t *reg, const char *name, const char *help,
                                         const char *const *label_names, size_t n_labels,
                                         const double *buckets, size_t n_buckets,
                                         duet_metric_family_t **fam_p)
{
    return family_register(reg, DUET_METRIC_HISTOGRAM, name, help, label_names, n_labels, buckets,
                           n_buckets, fam_p);
}

duet_status_t duet_metrics_child(duet_metric_family_t *fam, const char *const *values,
                                 size_t n_values, duet_metric_t **m_p)
{
    DUET_ASSERT(n_values == fam->n_labels);
    for (size_t i = 0; i < n_values; i++)
        DUET_ASSERT(values[i] != NULL);

    duet_status_t st = DUET_OK;
    pthread_mutex_lock(&fam->mu);
    for (duet_metric_t *m = fam->head; m != NULL; m = m->next) {
        size_t i = 0;
        while (i < n_values && strcmp(m->values[i], values[i]) == 0)
            i++;
        if (i == n_values) {
            *m_p = m;
            goto out;
        }
    }
    if (fam->n_children >= DUET_METRICS_MAX_CHILDREN) {
        st = duet_error_set(DUET_ERR_NO_SPACE, "metrics: %s: more than %d label combinations",
                            fam->name, DUET_METRICS_MAX_CHILDREN);
        goto out;
    }
    duet_metric_t *m = metric_new(fam, values);
    if (m == NULL) {
        st = duet_error_set(DUET_ERR_NOMEM, "metrics: out of memory");
        goto out;
    }
    *fam->tail = m;
    fam->tail = &m->next;
    fam->n_children++;
    *m_p = m;
out:
    pthread_mutex_unlock(&fam->mu);
    return st;
}

duet_metric_t *duet_metrics_single(duet_metric_family_t *fam)
{
    DUET_ASSERT(fam->n_labels == 0 && fam->head != NULL);
    return fam->head;
}

/* ---------------------------------------------------------------- updates */

void duet_metrics_counter_add(duet_metric_t *m, double v)
{
    DUET_ASSERT(m->fam->type == DUET_METRIC_COUNTER && v >= 0);
    atomic_add_double(&m->value_bits, v);
}

void duet_metrics_counter_inc(duet_metric_t *m)
{
    duet_metrics_counter_add(m, 1.0);
}

void duet_metrics_gauge_set(duet_metric_t *m, double v)
{
    DUET_ASSERT(m->fam->type == DUET_METRIC_GAUGE);
    atomic_store_explicit(&m->value_bits, double_to_bits(v), memory_order_relaxed);
}

void duet_metrics_gauge_add(duet_metric_t *m, double v)
{
    DUET_ASSERT(m->fam->type == DUET_METRIC_GAUGE);
    atomic_add_double(&m->value_bits, v);
}

void duet_metrics_gauge_inc(duet_metric_t *m)
{
    duet_metrics_gauge_add(m, 1.0);
}

void duet_metrics_gauge_dec(duet_metric_t *m)
{
    duet_metrics_gauge_add(m, -1.0);
}

void duet_metrics_histogram_observe(duet_metric_t *m, double v)
{
    duet_metrics_histogram_observe_n(m, v, 1);
}

void duet_metrics_histogram_observe_n(duet_metric_t *m, double v, uint64_t n)
{
    const duet_metric_family_t *fam = m->fam;
    DUET_ASSERT(fam->type == DUET_METRIC_HISTOGRAM);
    /* Bucket lists are short (tens); a binary search finds the first bound >= v. */
    size_t lo = 0, hi = fam->n_bounds;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (v <= fam->bounds[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    if (n == 0)
        return;
    atomic_fetch_add_explicit(&m->buckets[lo], n, memory_order_relaxed);
    atomic_add_double(&m->value_bits, v * (double)n);
}

double duet_metrics_value(const duet_metric_t *m)
{
    return bits_to_double(
        atomic_load_explicit(&((duet_metric_t *)m)->value_bits, memory_order_relaxed));
}

uint64_t duet_metrics_histogram_count(const duet_metric_t *m)
{
    DUET_ASSERT(m->fam->type == DUET_METRIC_HISTOGRAM);
    uint64_t n = 0;
    for (size_t i = 0; i <= m->fam->n_bounds; i++)
        n += atomic_load_explicit(&m->buckets[i], memory_order_relaxed);
    return n;
}

void duet_metrics_buckets_linear(double start, double width, size_t count, double *out)
{
    DUET_ASSERT(width > 0);
    for (size_t i = 0; i < count; i++)
        out[i] = start + width * (double)i;
}

void duet_metrics_buckets_exponential(double start, double factor, size_t count, double *out)
{
    DUET_ASSERT(start > 0 && factor > 1);
    double v = start;
    for (size_t i = 0; i < count; i++) {
        out[i] = v;
        v *= factor;
    }
}

/* ---------------------------------------------------------------- exposition */

/*
 * Shortest decimal that reads back as the same double (so 0.005 prints as "0.005", not
 * "0.0050000000000000001"), "+Inf"/"-Inf"/"NaN" as Prometheus spells them.
 */
static void format_double(double v, char *buf, size_t cap)
{
    if (isnan(v)) {
        snprintf(buf, cap, "NaN");
        return;
    }
    if (isinf(v)) {
        snprintf(buf, cap, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    if (v == floor(v) && fabs(v) < 1e15) { /* counts and round bounds: plain integers */
        snprintf(buf, cap, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            return;
    }
}

static void put_escaped(duet_strbuf_t *sb, const char *s, bool quote)
{
    for (; *s != '\0'; s++) {
        if (*s == '\\')
            duet_strbuf_puts(sb, "\\\\");
        else if (*s == '\n')
            duet_strbuf_puts(sb, "\\n");
        else if (quote && *s == '"')
            duet_strbuf_puts(sb, "\\\"");
        else
            duet_strbuf_append(sb, s, 1);
    }
}

/* `{a="x",b="y"` plus an optional extra le label, then `}`; nothing when there are no labels. */
static void put_labels(duet_strbuf_t *sb, const duet_metric_t *m, const char *le)
{
    const duet_metric_family_t *fam = m->fam;
    if (fam->n_labels == 0 && le == NULL)
        return;
    duet_strbuf_puts(sb, "{");
    for (size_t i = 0; i < fam->n_labels; i++) {
        duet_strbuf_printf(sb, "%s%s=\"", i > 0 ? "," : "", fam->label_names[i]);
        put_escaped(sb, m->values[i], true);
        duet_strbuf_puts(sb, "\"");
    }
    if (le != NULL)
        duet_strbuf_printf(sb, "%sle=\"%s\"", fam->n_labels > 0 ? "," : "", le);
    duet_strbuf_puts(sb, "}");
}

static void render_family(duet_strbuf_t *sb, duet_metric_family_t *fam)
{
    static const char *const type_names[] = {"counter", "gauge", "histogram"};
    char num[64];

    duet_strbuf_printf(sb, "# HELP %s ", fam->name);
    put_escaped(sb, fam->help, false);
    duet_strbuf_printf(sb, "\n# TYPE %s %s\n", fam->name, type_names[fam->type]);

    pthread_mutex_lock(&fam->mu);
    for (duet_metric_t *m = fam->head; m != NULL; m = m->next) {
        if (fam->type != DUET_METRIC_HISTOGRAM) {
            format_double(duet_metrics_value(m), num, sizeof(num));
            duet_strbuf_puts(sb, fam->name);
            put_labels(sb, m, NULL);
            duet_strbuf_printf(sb, " %s\n", num);
            continue;
        }
        uint64_t cum = 0;
        char le[64];
        for (size_t i = 0; i <= fam->n_bounds; i++) {
            cum += atomic_load_explicit(&m->buckets[i], memory_order_relaxed);
            if (i < fam->n_bounds)
                format_double(fam->bounds[i], le, sizeof(le));
            else
                snprintf(le, sizeof(le), "+Inf");
            duet_strbuf_printf(sb, "%s_bucket", fam->name);
            put_labels(sb, m, le);
            duet_strbuf_printf(sb, " %llu\n", (unsigned long long)cum);
        }
        format_double(duet_metrics_value(m), num, sizeof(num));
        duet_strbuf_printf(sb, "%s_sum", fam->name);
        put_labels(sb, m, NULL);
        duet_strbuf_printf(sb, " %s\n", num);
        duet_strbuf_printf(sb, "%s_count", fam->name);
        put_labels(sb, m, NULL);
        duet_strbuf_printf(sb, " %llu\n", (unsigned long long)cum);
    }
    pthread_mutex_unlock(&fam->mu);
}

duet_status_t duet_metrics_render(duet_metrics_t *reg, duet_strbuf_t *sb)
{
    pthread_mutex_lock(&reg->mu);
    for (duet_metric_family_t *fam = reg->head; fam != NULL; fam = fam->next)
        render_family(sb, fam);
    pthread_mutex_unlock(&reg->mu);
    if (duet_strbuf_status(sb) != DUET_OK)
        return duet_error_set(DUET_ERR_NOMEM, "metrics: out of memory rendering exposition");
    return DUET_OK;
}

duet_status_t duet_metrics_render_buf(duet_metrics_t *reg, char *buf, size_t cap, size_t *len_p)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_status_t st = duet_metrics_render(reg, &sb);
    if (st != DUET_OK)
        goto out;
    *len_p = sb.len;
    if (sb.len + 1 > cap) {
        st = duet_error_set(DUET_ERR_NO_SPACE,
                            "metrics: exposition needs %zu bytes, buffer has %zu", sb.len + 1, cap);
        goto out;
    }
    memcpy(buf, sb.data != NULL ? sb.data : "", sb.len + 1);
out:
    duet_strbuf_free(&sb);
    return st;
}
