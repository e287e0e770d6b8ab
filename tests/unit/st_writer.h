/*
 * st_writer: a tiny safetensors writer for tests (checkpoint loader, weights, forward pass).
 *
 * Collect tensors with st_writer_add (data is copied; dtype is any safetensors dtype string, so
 * tests can also write ones the loader refuses, such as "F64"), then write one file or a sharded
 * set with its index. Tensors are laid out by decreasing element size, so every tensor is aligned
 * to its element size and the data area has no holes, as the safetensors library does it.
 * st_writer_add_model adds every tensor a config asks for, with deterministic pseudo-random
 * values, so a test can make a loadable tiny model in a few lines.
 *
 * All functions return 0 on success and -1 on failure (tests assert on it).
 */
#ifndef DUET_TESTS_ST_WRITER_H
#define DUET_TESTS_ST_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model_config.h"

typedef struct st_writer st_writer_t;

st_writer_t *st_writer_new(void);
void st_writer_free(st_writer_t *w); /* accepts NULL */

/* Bytes per element of a safetensors dtype string ("F32" → 4, "F8_E4M3" → 1); 0 if unknown. */
size_t st_dtype_size(const char *dtype);

/*
 * Add tensor `name` of `dtype` and shape[0..ndim); `data` holds numel × st_dtype_size bytes (NULL
 * = zeros). Unknown dtypes are written with 1-byte elements. Names are not checked for
 * duplicates (so tests can write them).
 */
int st_writer_add(st_writer_t *w, const char *name, const char *dtype, int ndim,
                  const int64_t *shape, const void *data);

/* Drop tensor `name` (every copy); returns the number removed. */
int st_writer_remove(st_writer_t *w, const char *name);

/* Number of tensors added so far. */
int st_writer_count(const st_writer_t *w);

/* The whole file in memory (*buf_p is malloc'ed; free it). */
int st_writer_serialize(const st_writer_t *w, uint8_t **buf_p, size_t *len_p);

/* Write everything as one safetensors file. */
int st_writer_write(const st_writer_t *w, const char *path);

/*
 * Write DIR/model-0000i-of-0000n.safetensors (tensors split into n_shards contiguous runs in the
 * order they were added) and DIR/model.safetensors.index.json.
 */
int st_writer_write_sharded(const st_writer_t *w, const char *dir, int n_shards);

/* Write a file: 8-byte little-endian `len_field`, `header` (strlen bytes), then `data`. */
int st_write_raw(const char *path, uint64_t len_field, const char *header, const void *data,
                 size_t data_len);

/* Write `text` to DIR/NAME (config.json, index files). */
int st_write_text(const char *dir, const char *name, const char *text);

/*
 * Add every tensor `cfg` requires (Moonshot names, docs/model.md shapes) in `dtype` ("F32", "BF16"
 * or "F16"), with values from a fixed-seed generator: matrices uniform in ±1/sqrt(fan_in), norm
 * weights near 1, A_log and dt_bias small. Same seed → same bytes.
 */
int st_writer_add_model(st_writer_t *w, const duet_model_config_t *cfg, const char *dtype,
                        uint64_t seed);

#endif
