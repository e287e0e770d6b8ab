/*
 * shard.h: what one rank of a Helix generation group holds and computes (docs/architecture.md,
 * "Generation groups"), and the cut of the checkpoint's weights into that rank's share.
 *
 * A group is cp * tp ranks; rank = c * tp + t (c: its place among the context-parallel ranks, t:
 * among the tensor-parallel ones). Each rank holds:
 *  - MLA: the KV pages of global page index j with j % cp == c (transfer/plan.c deals the pages
 *    that way when the group is the destination), as a dense run of local pages; it attends with
 *    the query heads of t, [t*n/tp, (t+1)*n/tp), over those pages only, and after the all-to-all
 *    among the ranks of its t merges, projects (W_UV, o_proj's columns) and owns its share of t's
 *    heads: the c-th of cp equal cuts. The latent projection (kv_a) is computed by every rank;
 *    a new token's KV is stored by the ranks of its page's c.
 *  - KDA: heads [rank*H/N, (rank+1)*H/N) of every KDA layer (transfer/plan.c's cut of the state)
 *    and the matching rows / columns of the projections.
 *  - FFN: rows [rank*I/N, ..) of the dense MLP's and the shared expert's intermediate, and the
 *    routed experts [rank*E/N, ..) whole (expert parallel); routing is computed by every rank.
 *  - Embedding, norms, the router's gate: every rank. The LM head: rank 0 only (it samples).
 * KDA heads divide evenly; every rank attends with at least one MLA
 * head, but may own no MLA head after the merge, no expert or no FFN row (it adds zeros).
 */
#ifndef DUET_ENGINE_SHARD_H
#define DUET_ENGINE_SHARD_H

#include <stdint.h>

#include "common/status.h"
#include "engine/model_config.h"
#include "engine/weights.h"

#define DUET_SHARD_MAX_RANKS 64 /* transfer/plan.h's DUET_XFER_MAX_RANKS */

typedef struct {
    int rank, size; /* size = cp * tp */
    int cp, tp;
    int c, t;               /* rank = c * tp + t */
    int64_t kda_h0, kda_h1; /* KDA heads held */
    int64_t att_h0, att_h1; /* MLA query heads attended (those of t) */
    int64_t own_h0, own_h1; /* MLA heads merged and projected here (within att) */
    int64_t mlp_i0, mlp_i1; /* dense MLP intermediate rows */
    int64_t shr_i0, shr_i1; /* shared expert intermediate rows */
    int64_t exp_e0, exp_e1; /* routed experts held */
} duet_shard_t;

/* [i*n/parts, (i+1)*n/parts): the cut every shard uses (the same formula as transfer/plan.c). */
static inline int64_t duet_shard_cut(int64_t n, int64_t parts, int64_t i)
{
    return n * i / parts;
}

/*
 * The shard of `rank` in a group of cp * tp ranks for config c. DUET_ERR_INVALID for cp or tp
 * < 1, more than DUET_SHARD_MAX_RANKS ranks, a rank outside the group, KDA heads that do not
 * divide evenly over the ranks (transfer/plan.c deals them evenly) or tp above the MLA heads.
 * Other cuts may be uneven.
 */
duet_status_t duet_shard_make(const duet_model_config_t *c, int cp, int tp, int rank,
                              duet_shard_t *s);

/* Local KV pages of a sequence holding `global_pages` pages (its share of them). */
static inline int64_t duet_shard_local_pages(const duet_shard_t *s, int64_t global_pages)
{
    return global_pages > s->c ? (global_pages - s->c - 1) / s->cp + 1 : 0;
}

/* The rank's copy of the config: heads, intermediate sizes as it holds them (for its pools and
 * its backend); experts stay E (routing is over all of them). */
void duet_shard_config(const duet_model_config_t *full, const duet_shard_t *s,
                       duet_model_config_t *local);

/* The rank's weights: views of contiguous row ranges of w (which must outlive them), copies of
 * column ranges (o_proj, down_proj) in local->copies; experts outside the rank's range have data
 * NULL. Free with duet_weights_free. DUET_ERR_NOMEM. */
duet_status_t duet_shard_weights(const duet_model_config_t *full, const duet_weights_t *w,
                                 const duet_shard_t *s, duet_weights_t *local);

#endif /* DUET_ENGINE_SHARD_H */
