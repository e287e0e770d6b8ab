/*
 * test_engine_config.c: config.json parsing (engine/model_config.c).
 *
 * The 48B model's config is checked in both spellings (hub and transformers) against each other
 * and against its known parameter count; small configs made by patching a base object check
 * 1-based layer lists, precedence, defaults, and every refusal together with the field its
 * message must name. A fixed-seed fuzz loop mutates config.json bytes and only asks that the
 * parser returns (OK or an error status) without crashing.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/model_config.h"

#define DATA_DIR DUET_SOURCE_DIR "/tests/unit/data"

static char *read_all(const char *path, size_t *len_p)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    buf[n] = '\0';
    *len_p = (size_t)n;
    return buf;
}

static duet_status_t parse_file(const char *path, duet_model_config_t *cfg)
{
    size_t len;
    char *text = read_all(path, &len);
    duet_status_t st = duet_model_config_parse(text, len, path, cfg);
    free(text);
    return st;
}

/* A 4-layer model in the hub spelling: layers 1-3 KDA, layer 4 MLA (1-based), layer 0 dense. */
static const char *BASE =
    "{\"model_type\":\"kimi_linear\",\"vocab_size\":64,\"hidden_size\":16,\"num_hidden_layers\":4,"
    "\"linear_attn_config\":{\"kda_layers\":[1,2,3],\"full_attn_layers\":[4],\"head_dim\":8,"
    "\"num_heads\":2,\"short_conv_kernel_size\":4},"
    "\"num_attention_heads\":2,\"num_key_value_heads\":2,\"qk_nope_head_dim\":8,"
    "\"qk_rope_head_dim\":4,\"v_head_dim\":8,\"kv_lora_rank\":16,\"intermediate_size\":32,"
    "\"moe_intermediate_size\":8,\"num_experts\":8,\"num_experts_per_token\":2,"
    "\"num_shared_experts\":1,\"num_expert_group\":1,\"topk_group\":1,"
    "\"first_k_dense_replace\":1,\"eos_token_id\":1,\"bos_token_id\":0,"
    "\"tie_word_embeddings\":false}";

/*
 * Parse BASE with the keys of `patch` (a JSON object) merged in; a patch value "__delete__"
 * removes the key instead.
 */
static duet_status_t parse_patched(const char *patch, duet_model_config_t *cfg)
{
    json_error_t err;
    json_t *base = json_loads(BASE, 0, &err);
    cr_assert_not_null(base, "BASE: %s", err.text);
    json_t *p = json_loads(patch, 0, &err);
    cr_assert_not_null(p, "patch %s: %s", patch, err.text);
    const char *key;
    json_t *v;
    json_object_foreach(p, key, v)
    {
        if (json_is_string(v) && strcmp(json_string_value(v), "__delete__") == 0)
            json_object_del(base, key);
        else
            json_object_set(base, key, v);
    }
    char *text = json_dumps(base, JSON_COMPACT);
    duet_status_t st = duet_model_config_parse(text, strlen(text), "test.json", cfg);
    free(text);
    json_decref(p);
    json_decref(base);
    return st;
}

/* Expect `patch` to be refused with `want`, and the detail to contain `needle`. */
static void expect_refused(const char *patch, duet_status_t want, const char *needle)
{
    duet_model_config_t cfg;
    duet_error_clear();
    duet_status_t st = parse_patched(patch, &cfg);
    cr_assert_eq(st, want, "patch %s: got %s (%s), want %s", patch, duet_status_name(st),
                 duet_error_last(), duet_status_name(want));
    cr_assert_not_null(strstr(duet_error_last(), needle), "patch %s: detail \"%s\" lacks \"%s\"",
                       patch, duet_error_last(), needle);
    cr_assert_not_null(strstr(duet_error_last(), "test.json"), "detail \"%s\" lacks the file",
                       duet_error_last());
}

/* ---- the 48B model -------------------------------------------------------------------------- */

static void assert_same_config(const duet_model_config_t *a, const duet_model_config_t *b)
{
#define EQ(f) cr_assert_eq(a->f, b->f, "field " #f " differs")
    EQ(vocab_size);
    EQ(hidden_size);
    EQ(num_layers);
    EQ(rms_norm_eps);
    EQ(tie_word_embeddings);
    EQ(mla_heads);
    EQ(qk_nope_head_dim);
    EQ(qk_rope_head_dim);
    EQ(v_head_dim);
    EQ(kv_lora_rank);
    EQ(q_lora_rank);
    EQ(kda_heads);
    EQ(kda_head_dim);
    EQ(conv_kernel);
    EQ(dense_intermediate);
    EQ(n_experts);
    EQ(top_k);
    EQ(moe_intermediate);
    EQ(n_shared_experts);
    EQ(n_group);
    EQ(topk_group);
    EQ(moe_renormalize);
    EQ(routed_scaling_factor);
    EQ(act);
    EQ(situ_beta);
    EQ(situ_linear_beta);
    EQ(bos_token_id);
    EQ(pad_token_id);
    EQ(n_kda_layers);
    EQ(n_mla_layers);
    EQ(n_moe_layers);
#undef EQ
    cr_assert_str_eq(a->model_type, b->model_type);
    cr_assert_eq(memcmp(a->mixer, b->mixer, sizeof(a->mixer[0]) * a->num_layers), 0,
                 "layer types differ");
    cr_assert_eq(memcmp(a->ffn, b->ffn, sizeof(a->ffn[0]) * a->num_layers), 0,
                 "mlp layer types differ");
}

Test(engine_config, kimi_48b_both_spellings_agree, .timeout = 10)
{
    duet_model_config_t hub, tf;
    cr_assert_eq(parse_file(DATA_DIR "/kimi_linear_48b_hub.json", &hub), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(parse_file(DATA_DIR "/kimi_linear_48b_transformers.json", &tf), DUET_OK, "%s",
                 duet_error_last());
    assert_same_config(&hub, &tf);

    cr_assert_eq(hub.num_layers, 27);
    cr_assert_eq(hub.n_kda_layers, 20);
    cr_assert_eq(hub.n_mla_layers, 7);
    cr_assert_eq(hub.n_moe_layers, 26);
    cr_assert_eq(hub.ffn[0], DUET_FFN_DENSE);
    cr_assert_eq(hub.ffn[1], DUET_FFN_MOE);
    /* 1-based full_attn_layers 4, 8, ..., 24, 27 → 0-based 3, 7, ..., 23, 26. */
    for (int i = 0; i < 27; i++) {
        int mla = (i + 1) % 4 == 0 || i == 26;
        cr_assert_eq(hub.mixer[i], mla ? DUET_MIXER_MLA : DUET_MIXER_KDA, "layer %d", i);
    }
    cr_assert_eq(hub.q_lora_rank, 0);
    cr_assert_eq(hub.bos_token_id, 163584);
    cr_assert_eq(hub.pad_token_id, 163839);
    cr_assert_float_eq(hub.routed_scaling_factor, 2.446f, 1e-6f);
    cr_assert_float_eq(hub.rms_norm_eps, 1e-5f, 1e-12f);

    int64_t n = duet_model_config_n_params(&hub);
    double rel = ((double)n - 49.12e9) / 49.12e9;
    cr_log_info("48B config: %lld parameters (%.4f%% from 49.12e9)", (long long)n, rel * 100.0);
    cr_assert(rel < 0.005 && rel > -0.005, "n_params %lld is not within 0.5%% of 49.12e9",
              (long long)n);

    char buf[512];
    duet_model_config_describe(&hub, buf, sizeof(buf));
    cr_assert_not_null(strstr(buf, "27 layers (20 KDA, 7 MLA"), "%s", buf);
    cr_assert_not_null(strstr(buf, "D=2304"), "%s", buf);
}

/* The benchmarks' --layers N: the first N layers of the 48B plan, with the counts recomputed;
 * N <= 0 or N >= the layer count keeps everything. */
Test(engine_config, keep_layers_recounts_the_kinds, .timeout = 10)
{
    duet_model_config_t c;
    cr_assert_eq(parse_file(DATA_DIR "/kimi_linear_48b_hub.json", &c), DUET_OK, "%s",
                 duet_error_last());
    const duet_model_config_t full = c;
    duet_model_config_keep_layers(&c, 0);
    duet_model_config_keep_layers(&c, 27);
    duet_model_config_keep_layers(&c, 40);
    cr_assert_eq(memcmp(&c, &full, sizeof(c)), 0, "a no-op N changed the config");
    /* layers 0..7: dense 0, MoE 1..7; MLA at 3 and 7 */
    duet_model_config_keep_layers(&c, 8);
    cr_assert_eq(c.num_layers, 8);
    cr_assert_eq(c.n_kda_layers, 6);
    cr_assert_eq(c.n_mla_layers, 2);
    cr_assert_eq(c.n_moe_layers, 7);
    cr_assert_eq(memcmp(c.mixer, full.mixer, sizeof(c.mixer)), 0, "the layer plan changed");
    duet_model_config_keep_layers(&c, 1);
    cr_assert_eq(c.num_layers, 1);
    cr_assert_eq(c.n_kda_layers, 1);
    cr_assert_eq(c.n_mla_layers, 0);
    cr_assert_eq(c.n_moe_layers, 0);
}

Test(engine_config, load_from_dir, .timeout = 10)
{
    char dir[] = "/tmp/duet_cfg_XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[256];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    fputs(BASE, f);
    fclose(f);
    duet_model_config_t cfg;
    cr_assert_eq(duet_model_config_load(dir, &cfg), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(cfg.num_layers, 4);
    unlink(path);
    cr_assert_eq(duet_model_config_load(dir, &cfg), DUET_ERR_NOT_FOUND);
    cr_assert_not_null(strstr(duet_error_last(), "config.json"));
    rmdir(dir);
}

/* ---- layer plans ---------------------------------------------------------------------------- */

Test(engine_config, hub_lists_are_one_based, .timeout = 10)
{
    duet_model_config_t c;
    cr_assert_eq(parse_patched("{\"num_hidden_layers\":3,\"linear_attn_config\":"
                               "{\"kda_layers\":[1,3],\"full_attn_layers\":[2]}}",
                               &c),
                 DUET_OK, "%s", duet_error_last());
    cr_assert_eq(c.mixer[0], DUET_MIXER_KDA);
    cr_assert_eq(c.mixer[1], DUET_MIXER_MLA);
    cr_assert_eq(c.mixer[2], DUET_MIXER_KDA);
    cr_assert_eq(c.n_kda_layers, 2);
    cr_assert_eq(c.n_mla_layers, 1);
    /* linear_attn_config sizes were absent here: the flat keys' defaults apply. */
    cr_assert_eq(c.kda_heads, 32);
    cr_assert_eq(c.kda_head_dim, 128);
    cr_assert_eq(c.conv_kernel, 4);
}

Test(engine_config, defaults_when_keys_absent, .timeout = 10)
{
    duet_model_config_t c;
    const char *text = "{\"vocab_size\":100,\"hidden_size\":32,\"num_hidden_layers\":9}";
    cr_assert_eq(duet_model_config_parse(text, strlen(text), "min.json", &c), DUET_OK, "%s",
                 duet_error_last());
    /* Default layer types: full attention at 4 and 8 (0-based), never at 0. */
    for (int i = 0; i < 9; i++)
        cr_assert_eq(c.mixer[i], (i == 4 || i == 8) ? DUET_MIXER_MLA : DUET_MIXER_KDA, "layer %d",
                     i);
    /* first_k_dense_replace defaults to 1. */
    cr_assert_eq(c.ffn[0], DUET_FFN_DENSE);
    for (int i = 1; i < 9; i++)
        cr_assert_eq(c.ffn[i], DUET_FFN_MOE);
    cr_assert_eq(c.n_mla_layers, 2);
    cr_assert_eq(c.n_moe_layers, 8);
    cr_assert_str_eq(c.model_type, "kimi_linear");
    cr_assert_eq(c.mla_heads, 32);
    cr_assert_eq(c.qk_nope_head_dim, 128);
    cr_assert_eq(c.qk_rope_head_dim, 64);
    cr_assert_eq(c.v_head_dim, 128);
    cr_assert_eq(c.kv_lora_rank, 512);
    cr_assert_eq(c.q_lora_rank, 0);
    cr_assert_eq(c.kda_heads, 32);
    cr_assert_eq(c.kda_head_dim, 128);
    cr_assert_eq(c.conv_kernel, 4);
    cr_assert_eq(c.dense_intermediate, 9216);
    cr_assert_eq(c.moe_intermediate, 1024);
    cr_assert_eq(c.n_experts, 256);
    cr_assert_eq(c.top_k, 8);
    cr_assert_eq(c.n_shared_experts, 1);
    cr_assert_eq(c.n_group, 1);
    cr_assert_eq(c.topk_group, 1);
    cr_assert_eq(c.moe_renormalize, 1);
    cr_assert_float_eq(c.routed_scaling_factor, 2.446f, 1e-6f);
    cr_assert_float_eq(c.rms_norm_eps, 1e-5f, 1e-12f);
    cr_assert_eq(c.act, DUET_ACT_SILU);
    cr_assert_eq(c.tie_word_embeddings, 0);
    cr_assert_eq(c.bos_token_id, -1);
    cr_assert_eq(c.pad_token_id, -1);
}

Test(engine_config, explicit_layer_types_win, .timeout = 10)
{
    duet_model_config_t c;
    cr_assert_eq(parse_patched("{\"layer_types\":[\"full_attention\",\"linear_attention\","
                               "\"linear_attention\",\"full_attention\"],"
                               "\"mlp_layer_types\":[\"sparse\",\"dense\",\"sparse\",\"dense\"]}",
                               &c),
                 DUET_OK, "%s", duet_error_last());
    cr_assert_eq(c.mixer[0], DUET_MIXER_MLA);
    cr_assert_eq(c.mixer[1], DUET_MIXER_KDA);
    cr_assert_eq(c.mixer[3], DUET_MIXER_MLA);
    cr_assert_eq(c.ffn[0], DUET_FFN_MOE);
    cr_assert_eq(c.ffn[1], DUET_FFN_DENSE);
    cr_assert_eq(c.n_moe_layers, 2);
}

Test(engine_config, moe_layer_freq_and_first_k_dense, .timeout = 10)
{
    duet_model_config_t c;
    cr_assert_eq(parse_patched("{\"first_k_dense_replace\":2,\"moe_layer_freq\":3,"
                               "\"num_hidden_layers\":4,\"linear_attn_config\":\"__delete__\"}",
                               &c),
                 DUET_OK, "%s", duet_error_last());
    /* sparse iff i >= 2 and i % 3 == 0 → only layer 3. */
    cr_assert_eq(c.ffn[0], DUET_FFN_DENSE);
    cr_assert_eq(c.ffn[1], DUET_FFN_DENSE);
    cr_assert_eq(c.ffn[2], DUET_FFN_DENSE);
    cr_assert_eq(c.ffn[3], DUET_FFN_MOE);
    cr_assert_eq(c.n_moe_layers, 1);
}

Test(engine_config, situ_and_aliases, .timeout = 10)
{
    duet_model_config_t c;
    cr_assert_eq(parse_patched("{\"eos_token_id\":[3,5,7],\"hidden_act\":\"situ\","
                               "\"activation_situ_beta\":2.5,\"situ_linear_beta\":4,"
                               "\"num_experts\":\"__delete__\",\"num_local_experts\":16,"
                               "\"n_group\":4,\"num_expert_group\":4,\"topk_group\":2,"
                               "\"norm_topk_prob\":false,\"q_lora_rank\":12}",
                               &c),
                 DUET_OK, "%s", duet_error_last());
    cr_assert_eq(c.act, DUET_ACT_SITU);
    cr_assert_float_eq(c.situ_beta, 2.5f, 1e-7f);
    cr_assert_float_eq(c.situ_linear_beta, 4.0f, 1e-7f);
    cr_assert_eq(c.n_experts, 16);
    cr_assert_eq(c.n_group, 4);
    cr_assert_eq(c.topk_group, 2);
    cr_assert_eq(c.moe_renormalize, 0);
    cr_assert_eq(c.q_lora_rank, 12);
}

/* ---- refusals ------------------------------------------------------------------------------- */

Test(engine_config, refuses_unsupported_features, .timeout = 10)
{
    expect_refused("{\"model_type\":\"llama\"}", DUET_ERR_UNSUPPORTED, "model_type");
    expect_refused("{\"mla_use_output_gate\":true}", DUET_ERR_UNSUPPORTED, "mla_use_output_gate");
    expect_refused("{\"attn_res_block_size\":8}", DUET_ERR_UNSUPPORTED, "attn_res_block_size");
    expect_refused("{\"num_key_value_heads\":1}", DUET_ERR_UNSUPPORTED, "num_key_value_heads");
    expect_refused("{\"hidden_act\":\"gelu\"}", DUET_ERR_UNSUPPORTED, "hidden_act");
    expect_refused("{\"moe_router_activation_func\":\"softmax\"}", DUET_ERR_UNSUPPORTED,
                   "moe_router_activation_func");
    /* Off/zero values of the refused features are fine. */
    duet_model_config_t c;
    cr_assert_eq(parse_patched("{\"mla_use_output_gate\":false,\"attn_res_block_size\":0}", &c),
                 DUET_OK, "%s", duet_error_last());
}

Test(engine_config, refuses_wrong_types_naming_the_field, .timeout = 10)
{
    expect_refused("{\"hidden_size\":\"16\"}", DUET_ERR_FORMAT, "\"hidden_size\"");
    expect_refused("{\"hidden_size\":16.0}", DUET_ERR_FORMAT, "\"hidden_size\"");
    expect_refused("{\"rms_norm_eps\":\"1e-5\"}", DUET_ERR_FORMAT, "\"rms_norm_eps\"");
    expect_refused("{\"tie_word_embeddings\":1}", DUET_ERR_FORMAT, "\"tie_word_embeddings\"");
    expect_refused("{\"model_type\":7}", DUET_ERR_FORMAT, "\"model_type\"");
    expect_refused("{\"linear_attn_config\":[1]}", DUET_ERR_FORMAT, "linear_attn_config");
    expect_refused("{\"linear_attn_config\":{\"num_heads\":\"2\",\"kda_layers\":[1,2,3],"
                   "\"full_attn_layers\":[4]}}",
                   DUET_ERR_FORMAT, "linear_attn_config.num_heads");
    expect_refused("{\"linear_attn_config\":{\"kda_layers\":[1,\"2\",3],\"full_attn_layers\":[4]}}",
                   DUET_ERR_FORMAT, "linear_attn_config.kda_layers[1]");
    expect_refused("{\"layer_types\":\"linear_attention\"}", DUET_ERR_FORMAT, "layer_types");
    expect_refused("{\"layer_types\":[\"linear_attention\",\"linear_attention\","
                   "\"linear_attention\",\"mla\"]}",
                   DUET_ERR_FORMAT, "layer_types[3]");
    expect_refused("{\"layer_types\":[\"linear_attention\"]}", DUET_ERR_FORMAT, "layer_types");
    expect_refused("{\"mlp_layer_types\":[\"dense\",\"moe\",\"dense\",\"dense\"]}", DUET_ERR_FORMAT,
                   "mlp_layer_types[1]");
    expect_refused("{\"vocab_size\":\"__delete__\"}", DUET_ERR_FORMAT, "vocab_size");
    expect_refused("{\"hidden_size\":\"__delete__\"}", DUET_ERR_FORMAT, "hidden_size");
    expect_refused("{\"num_hidden_layers\":\"__delete__\"}", DUET_ERR_FORMAT, "num_hidden_layers");
    expect_refused("{\"num_experts_per_tok\":3}", DUET_ERR_FORMAT, "num_experts_per_tok");
}

Test(engine_config, refuses_out_of_range, .timeout = 10)
{
    expect_refused("{\"hidden_size\":0}", DUET_ERR_RANGE, "hidden_size");
    expect_refused("{\"vocab_size\":-4}", DUET_ERR_RANGE, "vocab_size");
    expect_refused("{\"num_hidden_layers\":257,\"linear_attn_config\":\"__delete__\"}",
                   DUET_ERR_RANGE, "num_hidden_layers");
    expect_refused("{\"rms_norm_eps\":0}", DUET_ERR_RANGE, "rms_norm_eps");
    expect_refused("{\"bos_token_id\":-2}", DUET_ERR_RANGE, "bos_token_id");
    expect_refused("{\"num_expert_group\":3}", DUET_ERR_RANGE, "n_group");
    expect_refused("{\"num_expert_group\":2,\"topk_group\":3}", DUET_ERR_RANGE, "topk_group");
    expect_refused("{\"num_experts_per_token\":9}", DUET_ERR_RANGE, "num_experts_per_tok");
    /* 8 experts in 4 groups of 2, keep 1 group → at most 2 experts per token. */
    expect_refused("{\"num_expert_group\":4,\"topk_group\":1,\"num_experts_per_token\":3}",
                   DUET_ERR_RANGE, "kept groups");
}

Test(engine_config, refuses_bad_layer_lists, .timeout = 10)
{
    expect_refused("{\"linear_attn_config\":{\"kda_layers\":[0,1,2],\"full_attn_layers\":[4]}}",
                   DUET_ERR_RANGE, "linear_attn_config.kda_layers[0]");
    expect_refused("{\"linear_attn_config\":{\"kda_layers\":[1,2,3],\"full_attn_layers\":[5]}}",
                   DUET_ERR_RANGE, "linear_attn_config.full_attn_layers[0]");
    expect_refused("{\"linear_attn_config\":{\"kda_layers\":[1,2,3,4],\"full_attn_layers\":[4]}}",
                   DUET_ERR_FORMAT, "more than once");
    expect_refused("{\"linear_attn_config\":{\"kda_layers\":[1,2],\"full_attn_layers\":[4]}}",
                   DUET_ERR_FORMAT, "layer 3 (1-based)");
    expect_refused("{\"linear_attn_config\":{\"kda_layers\":[1,2,3]}}", DUET_ERR_FORMAT,
                   "full_attn_layers");
}

Test(engine_config, refuses_conflicting_aliases, .timeout = 10)
{
    expect_refused("{\"n_group\":2}", DUET_ERR_FORMAT, "num_expert_group");
    expect_refused("{\"num_local_experts\":16}", DUET_ERR_FORMAT, "num_local_experts");
    expect_refused("{\"norm_topk_prob\":false,\"moe_renormalize\":true}", DUET_ERR_FORMAT,
                   "moe_renormalize");
}

Test(engine_config, refuses_bad_json, .timeout = 10)
{
    duet_model_config_t c;
    const char *texts[] = {
        "", "{", "[1,2]", "{\"vocab_size\":1,\"vocab_size\":2}", "nul", "{\"a\":1} trailing"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        duet_status_t st = duet_model_config_parse(texts[i], strlen(texts[i]), "bad.json", &c);
        cr_assert_eq(st, DUET_ERR_FORMAT, "text %zu: %s", i, duet_status_name(st));
        cr_assert_not_null(strstr(duet_error_last(), "bad.json"), "%s", duet_error_last());
    }
}

/* ---- fuzz ----------------------------------------------------------------------------------- */

static uint64_t xorshift(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

Test(engine_config, fuzz_config_bytes, .timeout = 60, .init = cr_redirect_stderr)
{
    size_t len;
    char *orig = read_all(DATA_DIR "/kimi_linear_48b_hub.json", &len);
    char *buf = malloc(len + 1);
    uint64_t s = 0x5eed1234abcdull;
    int n_ok = 0;
    static const char interesting[] = "{}[]\",:0123456789-.eE \ttruefalsnul\\";
    for (int it = 0; it < 4000; it++) {
        memcpy(buf, orig, len);
        size_t n = len;
        int mut = 1 + (int)(xorshift(&s) % 4);
        for (int m = 0; m < mut; m++) {
            size_t pos = (size_t)(xorshift(&s) % n);
            switch (xorshift(&s) % 4) {
            case 0: /* random byte */
                buf[pos] = (char)(xorshift(&s) & 0xff);
                break;
            case 1: /* a JSON-ish byte */
                buf[pos] = interesting[xorshift(&s) % (sizeof(interesting) - 1)];
                break;
            case 2: /* truncate */
                n = pos + 1;
                break;
            case 3: /* delete a byte */
                memmove(buf + pos, buf + pos + 1, n - pos - 1);
                n = n > 1 ? n - 1 : 1;
                break;
            }
        }
        duet_model_config_t c;
        duet_status_t st = duet_model_config_parse(buf, n, "fuzz.json", &c);
        /* Plain checks: ctest runs with --full-stats, which ships every assertion. */
        if (!(st == DUET_OK || st == DUET_ERR_FORMAT || st == DUET_ERR_RANGE ||
              st == DUET_ERR_UNSUPPORTED))
            cr_assert_fail("iteration %d: unexpected status %s", it, duet_status_name(st));
        if (st != DUET_OK && strstr(duet_error_last(), "fuzz.json") == NULL)
            cr_assert_fail("iteration %d: detail \"%s\" lacks the file", it, duet_error_last());
        if (st == DUET_OK) {
            n_ok++;
            if (c.num_layers < 1 || c.num_layers > DUET_MAX_LAYERS ||
                c.n_kda_layers + c.n_mla_layers != c.num_layers)
                cr_assert_fail("iteration %d: accepted an inconsistent config", it);
        }
    }
    free(buf);
    free(orig);
    cr_log_info("fuzz: %d of 4000 mutants parsed", n_ok);
}
