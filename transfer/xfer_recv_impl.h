/*
 * The receiver's state machine (xfer_recv.c) as the context drives it: the sweep steps each live
 * receive, the active-message handler hands over hello / done / abort, destruction aborts what
 * is still live. Why this is a header of its own: xfer_impl.h.
 */
#ifndef DUET_TRANSFER_XFER_RECV_IMPL_H
#define DUET_TRANSFER_XFER_RECV_IMPL_H

#include "transfer/xfer_impl.h"

void duet__xfer_recv_step(duet_xfer_ctx_t *ctx, duet__xfer_t *x, uint64_t now_ns);
void duet__xfer_recv_abort(duet_xfer_ctx_t *ctx, duet__xfer_t *x, duet_xfer_reason_t reason,
                           bool tell_peer);
/* AM to a receiver's transfer (called inside the UCX AM callback). */
void duet__xfer_recv_on_am(duet_xfer_ctx_t *ctx, const uint8_t *hdr, const void *data, size_t len,
                           ucp_ep_h reply_ep);

#endif
