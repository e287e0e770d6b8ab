/*
 * Envelope constructors: one per body of proto/duet.proto's `Envelope.body` oneof, so that a
 * sender writes `Duet__Envelope env = duet_envelope_cancel(&c);` instead of setting the version,
 * the body case and the body pointer by hand at every send. The Envelope borrows the body (it is
 * usually a stack struct of the caller's): keep the body alive until the frame is encoded.
 */
#ifndef DUET_PROTO_ENVELOPE_H
#define DUET_PROTO_ENVELOPE_H

#include "proto/duet.pb-c.h"
#include "proto/frame.h" /* DUET_PROTO_VERSION */

/* X(field, CASE, Type): every body the oneof has, in field-number order. */
#define DUET_ENVELOPE_BODIES(X)                                                                    \
    X(register_, REGISTER, Register)                                                               \
    X(register_ack, REGISTER_ACK, RegisterAck)                                                     \
    X(heartbeat, HEARTBEAT, Heartbeat)                                                             \
    X(deregister, DEREGISTER, Deregister)                                                          \
    X(drain, DRAIN, Drain)                                                                         \
    X(undrain, UNDRAIN, Undrain)                                                                   \
    X(set_log_level, SET_LOG_LEVEL, SetLogLevel)                                                   \
    X(reserve, RESERVE, Reserve)                                                                   \
    X(reserved, RESERVED, Reserved)                                                                \
    X(refused, REFUSED, Refused)                                                                   \
    X(prefill, PREFILL, Prefill)                                                                   \
    X(generate, GENERATE, Generate)                                                                \
    X(tokens, TOKENS, Tokens)                                                                      \
    X(cancel, CANCEL, Cancel)                                                                      \
    X(prefill_done, PREFILL_DONE, PrefillDone)                                                     \
    X(reservation, RESERVATION, Reservation)                                                       \
    X(xfer_done, XFER_DONE, XferDone)                                                              \
    X(xfer_abort, XFER_ABORT, XferAbort)                                                           \
    X(move_pause, MOVE_PAUSE, MovePause)                                                           \
    X(move_paused, MOVE_PAUSED, MovePaused)                                                        \
    X(move_out, MOVE_OUT, MoveOut)                                                                 \
    X(move_cancel, MOVE_CANCEL, MoveCancel)                                                        \
    X(moved, MOVED, Moved)

/* duet_envelope_<field>(body): an Envelope of this build's version carrying `body`. */
#define DUET__ENVELOPE_CTOR(field, CASE, Type)                                                     \
    static inline Duet__Envelope duet_envelope_##field(Duet__##Type *body)                         \
    {                                                                                              \
        Duet__Envelope env = DUET__ENVELOPE__INIT;                                                 \
        env.version = DUET_PROTO_VERSION;                                                          \
        env.body_case = DUET__ENVELOPE__BODY_##CASE;                                               \
        env.field = body;                                                                          \
        return env;                                                                                \
    }
DUET_ENVELOPE_BODIES(DUET__ENVELOPE_CTOR)
#undef DUET__ENVELOPE_CTOR

#endif
