/*
 * Safetensors checkpoints: a folder with model.safetensors, or model.safetensors.index.json
 * plus shards. Files are mmapped read-only; tensors are views into the mapping (no copies).
 *
 * Every header is validated before use: 8-byte length within the file and under a cap, JSON
 * well-formed, every entry a known dtype (F32, BF16, F16) with a shape whose byte size equals its
 * data_offsets span, offsets inside the data area, no overlaps, no duplicate names across shards,
 * index entries pointing at shards that exist and contain the tensor. Errors name the file and
 * the tensor.
 */
#ifndef DUET_ENGINE_CHECKPOINT_H
#define DUET_ENGINE_CHECKPOINT_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/kernels.h"

typedef struct duet_checkpoint duet_checkpoint_t;

/* Open every safetensors file of checkpoint folder `dir`. Logs a progress line per shard. */
duet_status_t duet_checkpoint_open(const char *dir, duet_checkpoint_t **ck_p);
void duet_checkpoint_close(duet_checkpoint_t *ck); /* accepts NULL */

/* Number of tensors and the i-th name (stable order), for iteration. */
int64_t duet_checkpoint_n_tensors(const duet_checkpoint_t *ck);
const char *duet_checkpoint_tensor_name(const duet_checkpoint_t *ck, int64_t i);

/*
 * Find tensor `name`. DUET_ERR_NOT_FOUND (detail names the checkpoint's file or index and the
 * tensor) when absent. The view lives as long as the checkpoint.
 */
duet_status_t duet_checkpoint_get(const duet_checkpoint_t *ck, const char *name,
                                  duet_tensor_t *t_p);

/*
 * Find tensor `name` and check its shape is exactly dims[0..ndim). On mismatch returns
 * DUET_ERR_FORMAT with a detail like
 *   "ckpt/model-00001-of-00002.safetensors: tensor model.layers.3.self_attn.q_proj.weight:
 *    shape [64, 32] does not match the config's [64, 48]".
 * Marks the tensor as used (see duet_checkpoint_n_unused).
 */
duet_status_t duet_checkpoint_get_shaped(duet_checkpoint_t *ck, const char *name, int ndim,
                                         const int64_t *dims, duet_tensor_t *t_p);

/* Tensors never fetched with duet_checkpoint_get_shaped (logged as warnings by the loader). */
int64_t duet_checkpoint_n_unused(const duet_checkpoint_t *ck);
const char *duet_checkpoint_unused_name(const duet_checkpoint_t *ck, int64_t i);

/* The file a tensor lives in (for messages); NULL when the checkpoint has no such tensor. */
const char *duet_checkpoint_tensor_file(const duet_checkpoint_t *ck, const char *name);

/*
 * The file that lists the checkpoint's tensors, for messages about a tensor that is absent:
 * DIR/model.safetensors or DIR/model.safetensors.index.json.
 */
const char *duet_checkpoint_where(const duet_checkpoint_t *ck);

/*
 * The checkpoint's dtype: the one that holds most of its tensor bytes (BF16 for a bf16 model
 * that keeps a few small tensors in F32). F32 for a checkpoint without tensor bytes. What
 * `--dtype auto` follows (duet_model_dtype_resolve).
 */
duet_dtype_t duet_checkpoint_dtype(const duet_checkpoint_t *ck);

#endif
