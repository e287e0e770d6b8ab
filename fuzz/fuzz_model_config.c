/*
 * Fuzz target: a model folder's config.json (engine/model_config.c, duet_model_config_parse).
 *
 * Input: the file's bytes. Checked besides no crash / sanitizer report:
 *  - failure leaves the caller's struct untouched and sets an error detail;
 *  - a parsed config is within the documented caps (vocab 1..2^24, hidden 1..2^16, layers
 *    1..DUET_MAX_LAYERS), every layer is KDA or MLA and dense or MoE, the layer counts add up,
 *    the MoE cross-field rules hold (top_k <= experts, topk_group <= n_group, n_group divides the
 *    experts) and token ids are -1 or inside the vocabulary;
 *  - the parameter count (whose products the caps keep inside int64) is positive, and describe
 *    and keep_layers work on it.
 */
#include "fuzz/fuzz.h"

#include "common/status.h"
#include "engine/model_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    duet_model_config_t cfg, before;
    memset(&cfg, 0xa5, sizeof(cfg));
    before = cfg;
    duet_error_clear();
    duet_status_t st = duet_model_config_parse((const char *)data, size, "config.json", &cfg);
    if (st != DUET_OK) {
        FUZZ_CHECK(st < 0, "status %d", (int)st);
        FUZZ_CHECK(memcmp(&cfg, &before, sizeof(cfg)) == 0, "config written on failure");
        FUZZ_CHECK(duet_error_last()[0] != '\0', "failure without a detail");
        return 0;
    }
    FUZZ_CHECK(cfg.vocab_size >= 1 && cfg.vocab_size <= (1 << 24), "vocab %lld",
               (long long)cfg.vocab_size);
    FUZZ_CHECK(cfg.hidden_size >= 1 && cfg.hidden_size <= (1 << 16), "hidden %lld",
               (long long)cfg.hidden_size);
    FUZZ_CHECK(cfg.num_layers >= 1 && cfg.num_layers <= DUET_MAX_LAYERS, "layers %lld",
               (long long)cfg.num_layers);
    int64_t kda = 0, mla = 0, moe = 0;
    for (int64_t i = 0; i < cfg.num_layers; i++) {
        FUZZ_CHECK(cfg.mixer[i] == DUET_MIXER_KDA || cfg.mixer[i] == DUET_MIXER_MLA, "mixer %d",
                   (int)cfg.mixer[i]);
        FUZZ_CHECK(cfg.ffn[i] == DUET_FFN_DENSE || cfg.ffn[i] == DUET_FFN_MOE, "ffn %d",
                   (int)cfg.ffn[i]);
        kda += cfg.mixer[i] == DUET_MIXER_KDA;
        mla += cfg.mixer[i] == DUET_MIXER_MLA;
        moe += cfg.ffn[i] == DUET_FFN_MOE;
    }
    FUZZ_CHECK(kda == cfg.n_kda_layers && mla == cfg.n_mla_layers && moe == cfg.n_moe_layers,
               "layer counts %lld/%lld/%lld vs %lld/%lld/%lld", (long long)kda, (long long)mla,
               (long long)moe, (long long)cfg.n_kda_layers, (long long)cfg.n_mla_layers,
               (long long)cfg.n_moe_layers);
    FUZZ_CHECK(cfg.n_group >= 1 && cfg.n_experts % cfg.n_group == 0, "n_group %lld experts %lld",
               (long long)cfg.n_group, (long long)cfg.n_experts);
    FUZZ_CHECK(cfg.top_k >= 1 && cfg.top_k <= cfg.n_experts, "top_k %lld", (long long)cfg.top_k);
    FUZZ_CHECK(cfg.topk_group >= 1 && cfg.topk_group <= cfg.n_group, "topk_group %lld",
               (long long)cfg.topk_group);
    FUZZ_CHECK(cfg.bos_token_id >= -1 && cfg.bos_token_id < cfg.vocab_size, "bos %d",
               (int)cfg.bos_token_id);
    FUZZ_CHECK(cfg.pad_token_id >= -1 && cfg.pad_token_id < cfg.vocab_size, "pad %d",
               (int)cfg.pad_token_id);
    FUZZ_CHECK(cfg.rms_norm_eps > 0.0f, "eps %g", (double)cfg.rms_norm_eps);
    FUZZ_CHECK(duet_model_config_n_params(&cfg) > 0, "parameter count %lld",
               (long long)duet_model_config_n_params(&cfg));
    char line[512];
    duet_model_config_describe(&cfg, line, sizeof(line));
    FUZZ_CHECK(strlen(line) < sizeof(line), "describe");
    duet_model_config_keep_layers(&cfg, 1);
    FUZZ_CHECK(cfg.num_layers == 1 && cfg.n_kda_layers + cfg.n_mla_layers == 1, "keep_layers");
    return 0;
}
