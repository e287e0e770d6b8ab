/* Transfer plans (see plan.h). Placeholder until the builder lands. */
#include "transfer/plan.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

uint64_t duet_xfer_layout_kv_page_bytes(const duet_xfer_layout_t *l)
{
    return (uint64_t)l->page_tokens * l->n_mla_layers * l->token_bytes;
}

uint64_t duet_xfer_layout_kda_slot_bytes(const duet_xfer_layout_t *l)
{
    uint64_t hk = (uint64_t)l->kda_heads * l->kda_head_dim;
    return l->n_kda_layers * (hk * l->kda_head_dim + 3 * hk * (l->conv_kernel - 1)) * l->state_elem;
}

duet_status_t duet_xfer_plan_build(const duet_xfer_layout_t *src_layout, const duet_xfer_src_t *src,
                                   const duet_xfer_layout_t *dst_layout, const duet_xfer_dest_t *dst,
                                   uint32_t n_ranks, duet_xfer_plan_t *plan_p)
{
    return DUET_FAIL(DUET_ERR_UNSUPPORTED, "xfer plan: not implemented yet");
}

void duet_xfer_plan_free(duet_xfer_plan_t *plan)
{
    if (plan == NULL)
        return;
    free(plan->entries);
    free(plan->layer_first);
    memset(plan, 0, sizeof(*plan));
}
