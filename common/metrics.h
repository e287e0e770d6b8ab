/*
 * Prometheus metrics registry: counters, gauges and histograms with labels, rendered in the text
 * exposition format 0.0.4 for the router's /metrics endpoint, which also carries the workers'
 * counters from their heartbeats (docs/architecture.md, "... metrics": names duet_*, output must
 * pass `promtool check metrics`).
 *
 * Model. A registry holds families (one name, help text, type and fixed label names). A family
 * holds children, one per distinct tuple of label values; a child is the time series that hot
 * paths update. Looking a child up takes the family's mutex and a linear search, so callers look
 * it up once (at start-up, or once per new label value) and keep the duet_metric_t pointer;
 * updates through the pointer are lock-free atomics and never allocate. Children live until the
 * registry is destroyed, so a kept pointer stays valid.
 *
 * Values are doubles stored as atomic 64-bit words (add is a compare-and-swap loop), so counters
 * count exactly up to 2^53. Histograms keep one non-cumulative atomic count per bucket; the
 * renderer accumulates them, and derives _count from the same bucket counts so that _count always
 * equals the +Inf bucket even while observations race with a scrape.
 *
 * Names are checked at registration against the Prometheus grammar ([a-zA-Z_:][a-zA-Z0-9_:]*
 * for metrics, [a-zA-Z_][a-zA-Z0-9_]* without a leading "__" for labels); counters must end in
 * "_total"; histograms may not use the label "le". These are programming errors in our own code
 * but are reported as DUET_ERR_INVALID (with detail) so a test can check them.
 */
#ifndef DUET_COMMON_METRICS_H
#define DUET_COMMON_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/strbuf.h"

typedef struct duet_metrics duet_metrics_t;             /* a registry */
typedef struct duet_metric_family duet_metric_family_t; /* one metric name + label names */
typedef struct duet_metric duet_metric_t;               /* one child: a labelled time series */

typedef enum {
    DUET_METRIC_COUNTER = 0,
    DUET_METRIC_GAUGE = 1,
    DUET_METRIC_HISTOGRAM = 2,
} duet_metric_type_t;

/* Upper bound of children per family: label values may come from outside (paths, status codes). */
#define DUET_METRICS_MAX_CHILDREN 4096
/* Upper bound of label names per family and of buckets per histogram (excluding +Inf). */
#define DUET_METRICS_MAX_LABELS  16
#define DUET_METRICS_MAX_BUCKETS 64

/* An empty registry. */
duet_status_t duet_metrics_create(duet_metrics_t **reg_p);

/* Free the registry with all its families and children. Accepts NULL. No update may race it. */
void duet_metrics_destroy(duet_metrics_t *reg);

/*
 * Register a counter family. `name` must match the metric grammar and end in "_total"; `help` is
 * free text (escaped on output); `label_names` has n_labels entries (NULL when 0). Strings are
 * copied. A family without labels gets its single child at once, so it is exported as 0 before
 * the first update. DUET_ERR_INVALID for bad names, a duplicate family name or duplicate labels.
 */
duet_status_t duet_metrics_counter_new(duet_metrics_t *reg, const char *name, const char *help,
                                       const char *const *label_names, size_t n_labels,
                                       duet_metric_family_t **fam_p);

/* Register a gauge family; as duet_metrics_counter_new without the "_total" rule. */
duet_status_t duet_metrics_gauge_new(duet_metrics_t *reg, const char *name, const char *help,
                                     const char *const *label_names, size_t n_labels,
                                     duet_metric_family_t **fam_p);

/*
 * Register a histogram family with upper bounds buckets[0..n_buckets) (strictly increasing,
 * finite; a trailing +Inf is accepted and dropped, +Inf is always implied). buckets == NULL
 * selects the Prometheus defaults (.005 .01 .025 .05 .1 .25 .5 1 2.5 5 10). The label "le" is
 * reserved.
 */
duet_status_t duet_metrics_histogram_new(duet_metrics_t *reg, const char *name, const char *help,
                                         const char *const *label_names, size_t n_labels,
                                         const double *buckets, size_t n_buckets,
                                         duet_metric_family_t **fam_p);

/*
 * The child for label values values[0..n_values), created on first use (values copied).
 * n_values must equal the family's label count (asserted). Takes the family mutex: call it once
 * and keep the pointer. DUET_ERR_NO_SPACE past DUET_METRICS_MAX_CHILDREN children.
 */
duet_status_t duet_metrics_child(duet_metric_family_t *fam, const char *const *values,
                                 size_t n_values, duet_metric_t **m_p);

/* The single child of a family without labels (asserts the family has none). */
duet_metric_t *duet_metrics_single(duet_metric_family_t *fam);

/* Counter: add v >= 0 (asserted; a counter never goes down). Lock-free. */
void duet_metrics_counter_add(duet_metric_t *m, double v);
/* Counter: add 1. */
void duet_metrics_counter_inc(duet_metric_t *m);

/* Gauge: set, add (v may be negative), add 1, subtract 1. Lock-free. */
void duet_metrics_gauge_set(duet_metric_t *m, double v);
void duet_metrics_gauge_add(duet_metric_t *m, double v);
void duet_metrics_gauge_inc(duet_metric_t *m);
void duet_metrics_gauge_dec(duet_metric_t *m);

/* Histogram: record one observation (lands in the first bucket with v <= le). Lock-free. */
void duet_metrics_histogram_observe(duet_metric_t *m, double v);
/* Histogram: record n observations of the same value v at once (counts a worker reports in bulk,
 * e.g. its verify steps by tokens emitted); n = 0 records nothing. Lock-free. */
void duet_metrics_histogram_observe_n(duet_metric_t *m, double v, uint64_t n);

/* Current value of a counter or gauge; for a histogram, the sum of observations. */
double duet_metrics_value(const duet_metric_t *m);
/* Number of observations of a histogram (asserts m is a histogram child). */
uint64_t duet_metrics_histogram_count(const duet_metric_t *m);

/*
 * Fill out[0..count) with start, start+width, ... (width > 0) or start, start*factor, ...
 * (start > 0, factor > 1): bucket helpers for duet_metrics_histogram_new.
 */
void duet_metrics_buckets_linear(double start, double width, size_t count, double *out);
void duet_metrics_buckets_exponential(double start, double factor, size_t count, double *out);

/*
 * Append the whole registry in text exposition format 0.0.4 to sb: per family "# HELP",
 * "# TYPE", then one line per child (histograms: cumulative _bucket{le=...} ending in +Inf,
 * _sum, _count). Families in registration order, children in creation order. Safe to call while
 * other threads update. DUET_ERR_NOMEM if sb cannot grow.
 */
duet_status_t duet_metrics_render(duet_metrics_t *reg, duet_strbuf_t *sb);

/*
 * Same into a caller buffer of `cap` bytes, NUL-terminated. *len_p receives the text length
 * (without NUL). DUET_ERR_NO_SPACE if it does not fit; *len_p then holds the length needed.
 */
duet_status_t duet_metrics_render_buf(duet_metrics_t *reg, char *buf, size_t cap, size_t *len_p);

/* Content-Type header value for the output above. */
#define DUET_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

#endif
