/*
 * The model fingerprint: what a worker presents in Register and the router compares
 * (docs/architecture.md, "The wire"), so that a router never serves tokens from a worker holding
 * another model.
 */
#ifndef DUET_COMMON_FINGERPRINT_H
#define DUET_COMMON_FINGERPRINT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define DUET_FINGERPRINT_LEN 72 /* "sha256:" + 64 hex digits + NUL, rounded */

/*
 * The fingerprint of model folder `dir`: "sha256:" + 64 hex digits over the bytes of config.json,
 * then "\n--\n", then model.safetensors.index.json when present, else the JSON header of
 * model.safetensors. Written to out (cap >= DUET_FINGERPRINT_LEN). DUET_ERR_IO /
 * DUET_ERR_NOT_FOUND / DUET_ERR_FORMAT with detail naming the file.
 */
duet_status_t duet_model_fingerprint(const char *dir, char *out, size_t cap);

/* SHA-256 (FIPS 180-4) of data[0..len); exposed for the unit test's NIST vectors. */
void duet__sha256(const void *data, size_t len, uint8_t out[32]);

#endif
