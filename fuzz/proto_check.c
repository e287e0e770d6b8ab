/* See proto_check.h. */
#include "fuzz/proto_check.h"

#include <stddef.h>
#include <stdint.h>

bool fuzz_proto_has_unknown(const ProtobufCMessage *m)
{
    if (m == NULL)
        return false;
    if (m->n_unknown_fields > 0)
        return true;
    const ProtobufCMessageDescriptor *d = m->descriptor;
    const char *base = (const char *)m;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            /* the members of a oneof share one pointer: only the set one may be read */
            if (*(const uint32_t *)(base + f->quantifier_offset) != f->id)
                continue;
        }
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)(base + f->quantifier_offset);
            ProtobufCMessage *const *arr = *(ProtobufCMessage *const *const *)(base + f->offset);
            for (size_t k = 0; k < n; k++)
                if (fuzz_proto_has_unknown(arr[k]))
                    return true;
        } else if (fuzz_proto_has_unknown(*(ProtobufCMessage *const *)(base + f->offset))) {
            return true;
        }
    }
    return false;
}
