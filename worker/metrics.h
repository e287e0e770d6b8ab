/*
 * A worker's own /metrics (docs/observability.md): a small HTTP listener on the worker's loop
 * (the router's HTTP core, router/http) that answers GET /metrics with the worker's figures in
 * Prometheus text: its cache (KV pages, KDA state slots), its load, its work counters and
 * speculation figures (the same numbers its heartbeats carry, read when scraped), and the
 * transfer layer's duet_xfer_* series. Off unless metrics.port is set (0 = an ephemeral port);
 * the port is reported to the router in Register, which lists it at GET /metrics/targets.
 *
 * A scrape is answered from the loop, so one that arrives during a forward step waits for the
 * step's end.
 */
#ifndef DUET_WORKER_METRICS_H
#define DUET_WORKER_METRICS_H

#include <stdint.h>

#include "common/metrics.h"
#include "common/status.h"

typedef struct duet_worker duet_worker_t;
typedef struct duet_worker_metrics duet_worker_metrics_t;

/*
 * Register the worker's series in reg (which the transfer context also fills) and listen on
 * host:port (port 0 = ephemeral) on w->loop. reg and w must outlive the server. DUET_ERR_IO (with
 * detail) when the address cannot be bound.
 */
duet_status_t duet_worker_metrics_start(duet_worker_t *w, duet_metrics_t *reg, const char *host,
                                        uint16_t port, duet_worker_metrics_t **wm_p);

/* The bound port. */
uint16_t duet_worker_metrics_port(const duet_worker_metrics_t *wm);

/* Close the listener (connections end with the loop); frees wm once closed. Accepts NULL. */
void duet_worker_metrics_close(duet_worker_metrics_t *wm);

#endif
