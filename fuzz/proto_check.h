/*
 * For the protobuf targets (fuzz_frame, fuzz_envelope): whether a decoded message carries fields
 * this build does not know. protobuf-c keeps those and packs them again, and it reads a key of
 * field 0 when it is spelt as a long varint but refuses the one-byte spelling it packs; so a
 * message with unknown fields need not unpack again after a pack. duet never re-packs what it
 * received (reservations travel as opaque bytes), so the round-trip invariant is checked on
 * messages without them.
 */
#ifndef DUET_FUZZ_PROTO_CHECK_H
#define DUET_FUZZ_PROTO_CHECK_H

#include <stdbool.h>

#include <protobuf-c/protobuf-c.h>

/* True when m or a message inside it holds unknown fields. */
bool fuzz_proto_has_unknown(const ProtobufCMessage *m);

#endif
