/*
 * The sender's state machine (xfer_send.c) as the context drives it: the sweep steps each live
 * send, the active-message handler hands over a receiver's abort, destruction aborts what is
 * still live. Why this is a header of its own: xfer_impl.h.
 */
#ifndef DUET_TRANSFER_XFER_SEND_IMPL_H
#define DUET_TRANSFER_XFER_SEND_IMPL_H

#include "transfer/xfer_impl.h"

void duet__xfer_send_step(duet_xfer_ctx_t *ctx, duet__xfer_t *x, uint64_t now_ns);
void duet__xfer_send_abort_x(duet_xfer_ctx_t *ctx, duet__xfer_t *x, duet_xfer_reason_t reason);
/* AM to a sender's transfer (an abort from a receiver; called inside the UCX AM callback). */
void duet__xfer_send_on_am(duet_xfer_ctx_t *ctx, const uint8_t *hdr, const void *data, size_t len);

#endif
