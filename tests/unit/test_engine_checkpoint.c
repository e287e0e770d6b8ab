/*
 * test_engine_checkpoint.c: safetensors loading (engine/checkpoint.c) and weight binding
 * (engine/weights.c).
 *
 * Checkpoints are written from C into temporary folders with tests/unit/st_writer. Valid single
 * and sharded loads must give back every byte; each kind of malformed file must be refused with a
 * status and a detail naming the file and the tensor; a fixed-seed fuzz loop mutates a valid
 * header and only asks that open returns (OK or an error) without crashing.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/checkpoint.h"
#include "engine/model_config.h"
#include "engine/weights.h"
#include "kernels/kernels.h"
#include "st_writer.h"

/* ---- temp folders --------------------------------------------------------------------------- */

static void make_dir(char *tmpl)
{
    strcpy(tmpl, "/tmp/duet_ck_XXXXXX");
    cr_assert_not_null(mkdtemp(tmpl));
}

static void remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        char p[512];
        snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static void file_path(char *buf, size_t cap, const char *dir, const char *name)
{
    snprintf(buf, cap, "%s/%s", dir, name);
}

/* Open `dir` expecting failure `want` with a detail containing every non-NULL needle. */
static void expect_open_fails(const char *dir, duet_status_t want, const char *n1, const char *n2)
{
    duet_checkpoint_t *ck = (duet_checkpoint_t *)0x1;
    duet_error_clear();
    duet_status_t st = duet_checkpoint_open(dir, &ck);
    cr_assert_eq(st, want, "got %s (%s), want %s", duet_status_name(st), duet_error_last(),
                 duet_status_name(want));
    cr_assert_eq(ck, (duet_checkpoint_t *)0x1, "ck_p written on failure");
    if (n1 != NULL)
        cr_assert_not_null(strstr(duet_error_last(), n1), "detail \"%s\" lacks \"%s\"",
                           duet_error_last(), n1);
    if (n2 != NULL)
        cr_assert_not_null(strstr(duet_error_last(), n2), "detail \"%s\" lacks \"%s\"",
                           duet_error_last(), n2);
}

/* Write a single-file checkpoint whose only header is `header` and data area `data_len` bytes. */
static void write_raw_single(const char *dir, const char *header, size_t data_len)
{
    char path[512];
    file_path(path, sizeof(path), dir, "model.safetensors");
    uint8_t *data = calloc(1, data_len + 1);
    cr_assert_eq(st_write_raw(path, strlen(header), header, data, data_len), 0);
    free(data);
}

/* ---- a small mixed-dtype set of tensors ----------------------------------------------------- */

typedef struct {
    const char *name;
    const char *dtype;
    int ndim;
    int64_t shape[4];
    size_t nbytes;
    uint8_t bytes[256];
} sample_t;

static sample_t g_samples[6];
static int g_n_samples;

static void make_samples(void)
{
    static const struct {
        const char *name, *dtype;
        int ndim;
        int64_t shape[4];
    } spec[] = {
        {"model.embed_tokens.weight", "BF16", 2, {4, 6}},
        {"model.norm.weight", "F32", 1, {6}},
        {"a.f16", "F16", 3, {2, 3, 5}},
        {"layers.0.A_log", "F32", 4, {1, 1, 3, 1}},
        {"scalar", "F32", 0, {0}},
        {"empty", "BF16", 2, {0, 7}},
    };
    uint32_t s = 12345;
    g_n_samples = (int)(sizeof(spec) / sizeof(spec[0]));
    for (int i = 0; i < g_n_samples; i++) {
        sample_t *t = &g_samples[i];
        t->name = spec[i].name;
        t->dtype = spec[i].dtype;
        t->ndim = spec[i].ndim;
        size_t ne = 1;
        for (int d = 0; d < t->ndim; d++) {
            t->shape[d] = spec[i].shape[d];
            ne *= (size_t)spec[i].shape[d];
        }
        t->nbytes = ne * st_dtype_size(t->dtype);
        cr_assert_leq(t->nbytes, sizeof(t->bytes));
        for (size_t b = 0; b < t->nbytes; b++) {
            s = s * 1103515245u + 12345u;
            t->bytes[b] = (uint8_t)(s >> 16); /* any bit pattern, NaNs included: bit-exact */
        }
    }
}

static st_writer_t *samples_writer(void)
{
    make_samples();
    st_writer_t *w = st_writer_new();
    for (int i = 0; i < g_n_samples; i++) {
        const sample_t *t = &g_samples[i];
        cr_assert_eq(st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->bytes), 0);
    }
    return w;
}

static void check_samples(duet_checkpoint_t *ck)
{
    cr_assert_eq(duet_checkpoint_n_tensors(ck), g_n_samples);
    for (int64_t i = 1; i < duet_checkpoint_n_tensors(ck); i++)
        cr_assert_lt(
            strcmp(duet_checkpoint_tensor_name(ck, i - 1), duet_checkpoint_tensor_name(ck, i)), 0,
            "names not in sorted order");
    cr_assert_null(duet_checkpoint_tensor_name(ck, g_n_samples));
    for (int i = 0; i < g_n_samples; i++) {
        const sample_t *s = &g_samples[i];
        duet_tensor_t t;
        cr_assert_eq(duet_checkpoint_get(ck, s->name, &t), DUET_OK, "%s", duet_error_last());
        cr_assert_str_eq(duet_dtype_name(t.dtype), s->dtype);
        cr_assert_eq(t.ndim, s->ndim, "%s", s->name);
        for (int d = 0; d < s->ndim; d++)
            cr_assert_eq(t.shape[d], s->shape[d]);
        cr_assert_eq(t.device, DUET_DEVICE_CPU);
        if (s->nbytes > 0) {
            cr_assert_eq(memcmp(t.data, s->bytes, s->nbytes), 0, "%s: bytes differ", s->name);
            cr_assert_eq((uintptr_t)t.data % duet_dtype_size(t.dtype), 0, "%s misaligned", s->name);
        }
    }
}

/* ---- valid loads ---------------------------------------------------------------------------- */

Test(engine_checkpoint, single_file_bit_exact, .timeout = 10)
{
    char dir[64], path[512];
    make_dir(dir);
    st_writer_t *w = samples_writer();
    file_path(path, sizeof(path), dir, "model.safetensors");
    cr_assert_eq(st_writer_write(w, path), 0);
    st_writer_free(w);

    duet_checkpoint_t *ck;
    cr_assert_eq(duet_checkpoint_open(dir, &ck), DUET_OK, "%s", duet_error_last());
    check_samples(ck);
    cr_assert_str_eq(duet_checkpoint_tensor_file(ck, "a.f16"), path);
    cr_assert_null(duet_checkpoint_tensor_file(ck, "nope"));
    cr_assert_eq(duet_checkpoint_n_unused(ck), g_n_samples);

    duet_tensor_t t;
    cr_assert_eq(duet_checkpoint_get(ck, "nope", &t), DUET_ERR_NOT_FOUND);
    cr_assert_not_null(strstr(duet_error_last(), "nope"));

    int64_t want[] = {6};
    cr_assert_eq(duet_checkpoint_get_shaped(ck, "model.norm.weight", 1, want, &t), DUET_OK);
    cr_assert_eq(duet_checkpoint_n_unused(ck), g_n_samples - 1);
    cr_assert_str_neq(duet_checkpoint_unused_name(ck, 0), "model.norm.weight");

    int64_t bad[] = {4, 5};
    cr_assert_eq(duet_checkpoint_get_shaped(ck, "model.embed_tokens.weight", 2, bad, &t),
                 DUET_ERR_FORMAT);
    cr_assert_not_null(strstr(duet_error_last(), "model.embed_tokens.weight"));
    cr_assert_not_null(strstr(duet_error_last(), "[4, 6]"), "%s", duet_error_last());
    cr_assert_not_null(strstr(duet_error_last(), "[4, 5]"), "%s", duet_error_last());
    cr_assert_not_null(strstr(duet_error_last(), "model.safetensors"));
    duet_checkpoint_close(ck);
    duet_checkpoint_close(NULL);
    remove_dir(dir);
}

Test(engine_checkpoint, sharded_bit_exact, .timeout = 10)
{
    char dir[64];
    make_dir(dir);
    st_writer_t *w = samples_writer();
    cr_assert_eq(st_writer_write_sharded(w, dir, 3), 0);
    st_writer_free(w);

    duet_checkpoint_t *ck;
    cr_assert_eq(duet_checkpoint_open(dir, &ck), DUET_OK, "%s", duet_error_last());
    check_samples(ck);
    /* Two tensors per shard, in the order added: a.f16 is the third → shard 2. */
    cr_assert_not_null(
        strstr(duet_checkpoint_tensor_file(ck, "a.f16"), "model-00002-of-00003.safetensors"));
    duet_checkpoint_close(ck);
    remove_dir(dir);
}

/* ---- malformed files ------------------------------------------------------------------------ */

Test(engine_checkpoint, refuses_missing_folder_contents, .timeout = 10)
{
    char dir[64];
    make_dir(dir);
    expect_open_fails(dir, DUET_ERR_NOT_FOUND, "model.safetensors", NULL);
    remove_dir(dir);
}

Test(engine_checkpoint, refuses_truncated_files, .timeout = 10)
{
    char dir[64], path[512];
    make_dir(dir);
    file_path(path, sizeof(path), dir, "model.safetensors");
    st_writer_t *w = samples_writer();
    uint8_t *buf;
    size_t len;
    cr_assert_eq(st_writer_serialize(w, &buf, &len), 0);
    st_writer_free(w);
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++)
        hl |= (uint64_t)buf[i] << (8 * i);

    /* Cut the data area: the last tensor's offsets run past the end. */
    FILE *f = fopen(path, "wb");
    fwrite(buf, 1, len - 3, f);
    fclose(f);
    expect_open_fails(dir, DUET_ERR_FORMAT, "model.safetensors", "data area");

    /* Cut the header. */
    f = fopen(path, "wb");
    fwrite(buf, 1, 8 + hl / 2, f);
    fclose(f);
    expect_open_fails(dir, DUET_ERR_FORMAT, "model.safetensors", "header length");

    /* Shorter than the length field itself. */
    f = fopen(path, "wb");
    fwrite(buf, 1, 5, f);
    fclose(f);
    expect_open_fails(dir, DUET_ERR_FORMAT, "model.safetensors", "too short");
    free(buf);
    remove_dir(dir);
}

Test(engine_checkpoint, refuses_bad_header_lengths, .timeout = 10)
{
    char dir[64], path[512];
    make_dir(dir);
    file_path(path, sizeof(path), dir, "model.safetensors");
    const char *h = "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    uint8_t data[4] = {0};

    cr_assert_eq(st_write_raw(path, strlen(h) + 100, h, data, 4), 0);
    expect_open_fails(dir, DUET_ERR_FORMAT, "model.safetensors", "header length");
    cr_assert_eq(st_write_raw(path, 1, h, data, 4), 0);
    expect_open_fails(dir, DUET_ERR_FORMAT, "model.safetensors", "header length");
    cr_assert_eq(st_write_raw(path, (uint64_t)200 << 20, h, data, 4), 0);
    expect_open_fails(dir, DUET_ERR_FORMAT, "model.safetensors", "header length");
    cr_assert_eq(st_write_raw(path, UINT64_MAX, h, data, 4), 0);
    expect_open_fails(dir, DUET_ERR_FORMAT, "model.safetensors", "header length");
    remove_dir(dir);
}

Test(engine_checkpoint, refuses_bad_headers, .timeout = 10)
{
    char dir[64];
    make_dir(dir);
    static const struct {
        const char *header;
        size_t data_len;
        duet_status_t want;
        const char *needle;
    } cases[] = {
        {"this is not json", 0, DUET_ERR_FORMAT, "not valid JSON"},
        {"[1, 2, 3]", 0, DUET_ERR_FORMAT, "not a JSON object"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         8, DUET_ERR_FORMAT, "not valid JSON"},
        /* wrong shape vs data size */
        {"{\"w.bad\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}", 16,
         DUET_ERR_FORMAT, "w.bad"},
        /* overlapping tensors */
        {"{\"w.a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
         "\"w.b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}",
         24, DUET_ERR_FORMAT, "overlap"},
        /* dtypes we do not run */
        {"{\"w.f64\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[0,16]}}", 16,
         DUET_ERR_UNSUPPORTED, "w.f64"},
        {"{\"w.i64\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[0,16]}}", 16,
         DUET_ERR_UNSUPPORTED, "w.i64"},
        {"{\"w.f8\":{\"dtype\":\"F8_E4M3\",\"shape\":[2],\"data_offsets\":[0,2]}}", 8,
         DUET_ERR_UNSUPPORTED, "w.f8"},
        {"{\"w.q\":{\"dtype\":\"Q4_K\",\"shape\":[2],\"data_offsets\":[0,2]}}", 8,
         DUET_ERR_UNSUPPORTED, "w.q"},
        /* structural errors in an entry */
        {"{\"w.n\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 8, DUET_ERR_FORMAT,
         "w.n"},
        {"{\"w.s\":{\"dtype\":\"F32\",\"shape\":\"4\",\"data_offsets\":[0,16]}}", 16,
         DUET_ERR_FORMAT, "w.s"},
        {"{\"w.o\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 8, DUET_ERR_FORMAT,
         "w.o"},
        {"{\"w.o3\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8,
         DUET_ERR_FORMAT, "w.o3"},
        {"{\"w.od\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0.0,4]}}", 8,
         DUET_ERR_FORMAT, "w.od"},
        {"{\"w.nd\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 8, DUET_ERR_FORMAT, "w.nd"},
        {"{\"w.e\":7}", 8, DUET_ERR_FORMAT, "w.e"},
        {"{\"__metadata__\":[1]}", 8, DUET_ERR_FORMAT, "__metadata__"},
        /* shape product overflows 64 bits */
        {"{\"w.big\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],"
         "\"data_offsets\":[0,4]}}",
         8, DUET_ERR_FORMAT, "w.big"},
        /* an f32 that starts 2 bytes into the data area */
        {"{\"w.h\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[0,2]},"
         "\"w.mis\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[2,6]}}",
         8, DUET_ERR_UNSUPPORTED, "w.mis"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        /* Pad the header so the data area is 8-aligned and alignment is not what fails. */
        char header[512];
        snprintf(header, sizeof(header), "%s", cases[i].header);
        while (strlen(header) % 8 != 0)
            strcat(header, " ");
        write_raw_single(dir, header, cases[i].data_len);
        cr_log_info("case %zu", i);
        expect_open_fails(dir, cases[i].want, "model.safetensors", cases[i].needle);
    }
    remove_dir(dir);
}

/* ---- sharded sets gone wrong ---------------------------------------------------------------- */

static void write_shard(const char *dir, const char *name, const char *tensor)
{
    char path[512];
    st_writer_t *w = st_writer_new();
    int64_t shape = 2;
    float v[2] = {1.0f, 2.0f};
    cr_assert_eq(st_writer_add(w, tensor, "F32", 1, &shape, v), 0);
    file_path(path, sizeof(path), dir, name);
    cr_assert_eq(st_writer_write(w, path), 0);
    st_writer_free(w);
}

Test(engine_checkpoint, refuses_bad_indexes, .timeout = 10)
{
    char dir[64];
    make_dir(dir);
    write_shard(dir, "s1.safetensors", "t.one");
    write_shard(dir, "s2.safetensors", "t.two");

    st_write_text(dir, "model.safetensors.index.json",
                  "{\"weight_map\":{\"t.one\":\"s1.safetensors\",\"t.two\":\"s9.safetensors\"}}");
    expect_open_fails(dir, DUET_ERR_NOT_FOUND, "s9.safetensors", NULL);

    st_write_text(dir, "model.safetensors.index.json",
                  "{\"weight_map\":{\"t.one\":\"../s1.safetensors\"}}");
    expect_open_fails(dir, DUET_ERR_FORMAT, "t.one", "../s1.safetensors");
    st_write_text(dir, "model.safetensors.index.json",
                  "{\"weight_map\":{\"t.one\":\"/etc/passwd\"}}");
    expect_open_fails(dir, DUET_ERR_FORMAT, "t.one", "/etc/passwd");
    st_write_text(dir, "model.safetensors.index.json",
                  "{\"weight_map\":{\"t.one\":\"sub/s1.safetensors\"}}");
    expect_open_fails(dir, DUET_ERR_FORMAT, "t.one", NULL);
    st_write_text(dir, "model.safetensors.index.json", "{\"weight_map\":{\"t.one\":3}}");
    expect_open_fails(dir, DUET_ERR_FORMAT, "t.one", NULL);
    st_write_text(dir, "model.safetensors.index.json", "{\"weight_map\":{}}");
    expect_open_fails(dir, DUET_ERR_FORMAT, "weight_map", NULL);
    st_write_text(dir, "model.safetensors.index.json", "{\"weight_map\":");
    expect_open_fails(dir, DUET_ERR_FORMAT, "model.safetensors.index.json", NULL);

    /* The index places a tensor in a shard that does not hold it. */
    st_write_text(dir, "model.safetensors.index.json",
                  "{\"weight_map\":{\"t.one\":\"s1.safetensors\",\"t.two\":\"s1.safetensors\","
                  "\"t.x\":\"s2.safetensors\"}}");
    expect_open_fails(dir, DUET_ERR_FORMAT, "t.two", "s1.safetensors");

    /* The same name in two shards. */
    write_shard(dir, "s2.safetensors", "t.one");
    st_write_text(dir, "model.safetensors.index.json",
                  "{\"weight_map\":{\"t.one\":\"s1.safetensors\",\"t.z\":\"s2.safetensors\"}}");
    expect_open_fails(dir, DUET_ERR_FORMAT, "t.one", "appears in both");

    /* And a good index over the two shards loads. */
    write_shard(dir, "s2.safetensors", "t.two");
    st_write_text(dir, "model.safetensors.index.json",
                  "{\"weight_map\":{\"t.one\":\"s1.safetensors\",\"t.two\":\"s2.safetensors\"}}");
    duet_checkpoint_t *ck;
    cr_assert_eq(duet_checkpoint_open(dir, &ck), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_checkpoint_n_tensors(ck), 2);
    duet_checkpoint_close(ck);
    remove_dir(dir);
}

/* ---- weights -------------------------------------------------------------------------------- */

/* 4 layers: KDA, KDA, MLA (q_lora), KDA; layer 0 dense, the rest MoE with 4 experts. */
static const char *TINY_CFG =
    "{\"model_type\":\"kimi_linear\",\"vocab_size\":32,\"hidden_size\":16,\"num_hidden_layers\":4,"
    "\"linear_attn_config\":{\"kda_layers\":[1,2,4],\"full_attn_layers\":[3],\"head_dim\":8,"
    "\"num_heads\":2,\"short_conv_kernel_size\":4},"
    "\"num_attention_heads\":2,\"qk_nope_head_dim\":8,\"qk_rope_head_dim\":4,\"v_head_dim\":6,"
    "\"kv_lora_rank\":12,\"q_lora_rank\":10,\"intermediate_size\":24,\"moe_intermediate_size\":8,"
    "\"num_experts\":4,\"num_experts_per_token\":2,\"num_shared_experts\":2,"
    "\"first_k_dense_replace\":1,\"eos_token_id\":1,\"tie_word_embeddings\":%s}";

static void tiny_config(int tied, duet_model_config_t *cfg)
{
    char text[2048];
    snprintf(text, sizeof(text), TINY_CFG, tied ? "true" : "false");
    cr_assert_eq(duet_model_config_parse(text, strlen(text), "tiny.json", cfg), DUET_OK, "%s",
                 duet_error_last());
}

static duet_status_t bind_dir(const char *dir, const duet_model_config_t *cfg,
                              duet_checkpoint_t **ck_p, duet_weights_t *w)
{
    duet_status_t st = duet_checkpoint_open(dir, ck_p);
    cr_assert_eq(st, DUET_OK, "%s", duet_error_last());
    return duet_weights_bind(*ck_p, cfg, w);
}

static void write_model(const char *dir, st_writer_t *w, int sharded)
{
    char path[512];
    if (sharded) {
        cr_assert_eq(st_writer_write_sharded(w, dir, 4), 0);
    } else {
        file_path(path, sizeof(path), dir, "model.safetensors");
        cr_assert_eq(st_writer_write(w, path), 0);
    }
}

Test(engine_checkpoint, weights_bind_tiny_model, .timeout = 20)
{
    const char *dtypes[3] = {"BF16", "F16", "F32"};
    for (int k = 0; k < 3; k++) {
        char dir[64];
        make_dir(dir);
        duet_model_config_t cfg;
        tiny_config(0, &cfg);
        st_writer_t *sw = st_writer_new();
        cr_assert_eq(st_writer_add_model(sw, &cfg, dtypes[k], 42), 0);
        write_model(dir, sw, k == 1);
        st_writer_free(sw);

        duet_checkpoint_t *ck;
        duet_weights_t w;
        cr_assert_eq(bind_dir(dir, &cfg, &ck, &w), DUET_OK, "%s", duet_error_last());
        cr_assert_eq(duet_checkpoint_n_unused(ck), 0);
        cr_assert_eq(w.embed_tokens.shape[0], 32);
        cr_assert_neq(w.lm_head.data, w.embed_tokens.data);
        cr_assert_str_eq(duet_dtype_name(w.embed_tokens.dtype), dtypes[k]);

        const duet_layer_weights_t *l0 = &w.layers[0], *l1 = &w.layers[1], *l2 = &w.layers[2];
        cr_assert_eq(l0->mixer, DUET_MIXER_KDA);
        cr_assert_eq(l0->ffn, DUET_FFN_DENSE);
        cr_assert_eq(l0->mlp.gate_proj.shape[0], 24);
        cr_assert_eq(l0->kda.q_conv.ndim, 3);
        cr_assert_eq(l0->kda.q_conv.shape[0], 16);
        cr_assert_eq(l0->kda.q_conv.shape[2], 4);
        cr_assert_eq(l0->kda.A_log.ndim, 4);
        cr_assert_eq(l0->kda.A_log.shape[2], 2);
        cr_assert_eq(l2->mixer, DUET_MIXER_MLA);
        cr_assert_null(l2->mla.q_proj.data);
        cr_assert_eq(l2->mla.q_b_proj.shape[0], 2 * 12);
        cr_assert_eq(l2->mla.q_b_proj.shape[1], 10);
        cr_assert_eq(l2->mla.kv_a_proj_with_mqa.shape[0], 16);
        cr_assert_eq(l2->mla.kv_b_proj.shape[0], 2 * 14);
        cr_assert_eq(l1->ffn, DUET_FFN_MOE);
        cr_assert_eq(l1->moe.shared.gate_proj.shape[0], 16);
        for (int l = 1; l < 4; l++)
            for (int e = 0; e < 4; e++) {
                const duet_moe_weights_t *m = &w.layers[l].moe;
                cr_assert_not_null(m->w1[e].data);
                cr_assert_eq(m->w2[e].shape[0], 16);
                cr_assert_eq(m->w2[e].shape[1], 8);
                cr_assert_eq(m->w3[e].shape[0], 8);
                /* each expert's arrays come from the one slab */
                cr_assert(m->w1 >= w.expert_slab && m->w3 + 4 <= w.expert_slab + 3 * 3 * 4);
            }
        /* The same name fetched again is the same bytes (views, not copies). */
        duet_tensor_t t;
        cr_assert_eq(
            duet_checkpoint_get(ck, "model.layers.3.block_sparse_moe.experts.2.w2.weight", &t),
            DUET_OK);
        cr_assert_eq(t.data, w.layers[3].moe.w2[2].data);
        duet_weights_free(&w);
        duet_weights_free(&w);
        duet_weights_free(NULL);
        duet_checkpoint_close(ck);
        remove_dir(dir);
    }
}

Test(engine_checkpoint, weights_tied_and_unused, .timeout = 10)
{
    char dir[64];
    make_dir(dir);
    duet_model_config_t cfg;
    tiny_config(1, &cfg);
    st_writer_t *sw = st_writer_new();
    cr_assert_eq(st_writer_add_model(sw, &cfg, "BF16", 7), 0);
    int64_t s = 3;
    cr_assert_eq(st_writer_add(sw, "model.mtp.extra", "F32", 1, &s, NULL), 0);
    write_model(dir, sw, 0);
    st_writer_free(sw);

    duet_checkpoint_t *ck;
    duet_weights_t w;
    cr_assert_eq(bind_dir(dir, &cfg, &ck, &w), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(w.lm_head.data, w.embed_tokens.data);
    cr_assert_eq(duet_checkpoint_n_unused(ck), 1);
    cr_assert_str_eq(duet_checkpoint_unused_name(ck, 0), "model.mtp.extra");
    cr_assert_null(duet_checkpoint_unused_name(ck, 1));
    duet_weights_free(&w);
    duet_checkpoint_close(ck);
    remove_dir(dir);
}

/* A file with only __metadata__ (found by fuzz_safetensors: the empty entry table reached qsort
 * and bsearch as NULL) opens, and every lookup says the tensor is not there. */
Test(engine_checkpoint, file_without_tensors_finds_none, .timeout = 10)
{
    char dir[64];
    make_dir(dir);
    write_raw_single(dir, "{\"__metadata__\":{\"format\":\"pt\"}}", 0);
    duet_checkpoint_t *ck = NULL;
    cr_assert_eq(duet_checkpoint_open(dir, &ck), DUET_OK, "%s", duet_error_last());
    duet_tensor_t t;
    cr_assert_eq(duet_checkpoint_get(ck, "lm_head.weight", &t), DUET_ERR_NOT_FOUND);
    cr_assert_not_null(strstr(duet_error_last(), "lm_head.weight"), "%s", duet_error_last());
    duet_checkpoint_close(ck);
    remove_dir(dir);
}

Test(engine_checkpoint, weights_missing_tensor_is_named, .timeout = 10)
{
    static const char *victims[] = {
        "model.layers.1.self_attn.k_conv1d.weight",
        "model.layers.2.self_attn.q_a_layernorm.weight",
        "model.layers.3.block_sparse_moe.experts.3.w3.weight",
        "model.layers.2.block_sparse_moe.gate.e_score_correction_bias",
        "model.layers.0.mlp.down_proj.weight",
        "lm_head.weight",
    };
    for (size_t i = 0; i < sizeof(victims) / sizeof(victims[0]); i++) {
        char dir[64];
        make_dir(dir);
        duet_model_config_t cfg;
        tiny_config(0, &cfg);
        st_writer_t *sw = st_writer_new();
        cr_assert_eq(st_writer_add_model(sw, &cfg, "BF16", 1), 0);
        cr_assert_eq(st_writer_remove(sw, victims[i]), 1, "%s", victims[i]);
        write_model(dir, sw, 0);
        st_writer_free(sw);

        duet_checkpoint_t *ck;
        duet_weights_t w, untouched;
        memset(&untouched, 0xab, sizeof(untouched));
        w = untouched;
        cr_assert_eq(bind_dir(dir, &cfg, &ck, &w), DUET_ERR_NOT_FOUND, "%s", victims[i]);
        cr_assert_not_null(strstr(duet_error_last(), victims[i]), "%s", duet_error_last());
        cr_assert_eq(memcmp(&w, &untouched, sizeof(w)), 0, "w_p written on failure");
        duet_checkpoint_close(ck);
        remove_dir(dir);
    }
}

Test(engine_checkpoint, weights_wrong_shape_names_both_shapes, .timeout = 10)
{
    char dir[64];
    make_dir(dir);
    duet_model_config_t cfg;
    tiny_config(0, &cfg);
    st_writer_t *sw = st_writer_new();
    cr_assert_eq(st_writer_add_model(sw, &cfg, "F32", 1), 0);
    const char *name = "model.layers.1.self_attn.A_log";
    cr_assert_eq(st_writer_remove(sw, name), 1);
    int64_t shape[1] = {2}; /* flattened instead of (1, 1, H, 1) */
    cr_assert_eq(st_writer_add(sw, name, "F32", 1, shape, NULL), 0);
    write_model(dir, sw, 1);
    st_writer_free(sw);

    duet_checkpoint_t *ck;
    duet_weights_t w;
    cr_assert_eq(bind_dir(dir, &cfg, &ck, &w), DUET_ERR_FORMAT);
    cr_assert_not_null(strstr(duet_error_last(), name), "%s", duet_error_last());
    cr_assert_not_null(strstr(duet_error_last(), "[2]"), "%s", duet_error_last());
    cr_assert_not_null(strstr(duet_error_last(), "[1, 1, 2, 1]"), "%s", duet_error_last());
    cr_assert_not_null(strstr(duet_error_last(), ".safetensors"), "%s", duet_error_last());
    duet_checkpoint_close(ck);
    remove_dir(dir);
}

/* ---- transformers' spellings ---------------------------------------------------------------- */

/*
 * What transformers 5.17 writes or loads besides Moonshot's names (its conversion_mapping.py,
 * "kimi_linear"; tools/make_fixtures.py --save-pretrained shows save_pretrained's output):
 *   SP_SAVE_PRETRAINED  what save_pretrained writes: Moonshot's names, but the dense layers'
 *                       MLP under block_sparse_moe.
 *   SP_INTERNAL         the module's own state_dict: self_attn.forget_gate.*, one fused
 *                       self_attn.conv1d.weight (q, k, v rows), mlp.* in every layer, experts
 *                       fused into experts.gate_up_proj (E, 2I, D: w1 rows then w3 rows per
 *                       expert) and experts.down_proj (E, D, I)
 *   SP_MIXED            tensor by tensor, the other prefix for some (transformers renames each
 *                       tensor on its own, so it loads such a file too)
 */
enum { SP_SAVE_PRETRAINED, SP_INTERNAL, SP_MIXED };

/* Bytes of checkpoint tensor `name` (asserted present). */
static const void *ck_bytes(const duet_checkpoint_t *ck, const char *name, size_t *n_p,
                            duet_tensor_t *t_p)
{
    cr_assert_eq(duet_checkpoint_get(ck, name, t_p), DUET_OK, "%s", duet_error_last());
    *n_p = (size_t)duet_tensor_numel(t_p) * duet_dtype_size(t_p->dtype);
    return t_p->data;
}

/* Concatenate tensors names[0..n) (same dtype) into one tensor `out` of shape[0..ndim). */
static void add_concat(st_writer_t *sw, const duet_checkpoint_t *ck, const char *out, int n,
                       char names[][160], int ndim, const int64_t *shape)
{
    size_t total = 0, off = 0;
    duet_tensor_t t;
    for (int i = 0; i < n; i++) {
        size_t b;
        ck_bytes(ck, names[i], &b, &t);
        total += b;
    }
    uint8_t *buf = malloc(total);
    for (int i = 0; i < n; i++) {
        size_t b;
        const void *src = ck_bytes(ck, names[i], &b, &t);
        memcpy(buf + off, src, b);
        off += b;
    }
    cr_assert_eq(st_writer_add(sw, out, duet_dtype_name(t.dtype), ndim, shape, buf), 0);
    free(buf);
}

/* Rewrite the Moonshot-named checkpoint `ck` of `cfg` (TINY_CFG) in spelling `sp` into sw. */
static void respell(const duet_checkpoint_t *ck, const duet_model_config_t *cfg, int sp,
                    st_writer_t *sw)
{
    const int64_t E = cfg->n_experts, I = cfg->moe_intermediate, D = cfg->hidden_size;
    const int64_t HK = cfg->kda_heads * cfg->kda_head_dim, W = cfg->conv_kernel;
    for (int64_t i = 0; i < duet_checkpoint_n_tensors(ck); i++) {
        const char *name = duet_checkpoint_tensor_name(ck, i);
        char out[160];
        int l, at = 0;
        snprintf(out, sizeof(out), "%s", name);
        if (sscanf(name, "model.layers.%d.%n", &l, &at) == 1 && at > 0) {
            const char *rest = name + at;
            const char *fg[4] = {"self_attn.f_a_proj.weight", "self_attn.f_b_proj.weight",
                                 "self_attn.dt_bias", "self_attn.A_log"};
            int is_fg = 0;
            for (int k = 0; k < 4; k++)
                is_fg |= strcmp(rest, fg[k]) == 0;
            int e = -1;
            sscanf(rest, "block_sparse_moe.experts.%d.", &e);
            if (sp == SP_INTERNAL && is_fg) {
                snprintf(out, sizeof(out), "model.layers.%d.self_attn.forget_gate.%s", l,
                         rest + strlen("self_attn."));
            } else if (sp == SP_INTERNAL && strstr(rest, "_conv1d.weight") != NULL) {
                if (strcmp(rest, "self_attn.q_conv1d.weight") != 0)
                    continue; /* k and v go into the fused tensor with q */
                char parts[3][160];
                for (int k = 0; k < 3; k++)
                    snprintf(parts[k], sizeof(parts[k]),
                             "model.layers.%d.self_attn.%c_conv1d.weight", l, "qkv"[k]);
                snprintf(out, sizeof(out), "model.layers.%d.self_attn.conv1d.weight", l);
                add_concat(sw, ck, out, 3, parts, 3, (int64_t[]){3 * HK, 1, W});
                continue;
            } else if (sp == SP_INTERNAL && e >= 0) {
                if (e != 0 || strstr(rest, ".w3.") != NULL)
                    continue; /* every expert goes into the two fused tensors */
                int down = strstr(rest, ".w2.") != NULL;
                char(*parts)[160] = malloc(sizeof(*parts) * (size_t)(2 * E));
                int n = 0;
                for (int64_t x = 0; x < E; x++)
                    for (int k = 0; k < (down ? 1 : 2); k++)
                        snprintf(parts[n++], 160,
                                 "model.layers.%d.block_sparse_moe.experts.%lld.w%d.weight", l,
                                 (long long)x, down ? 2 : (k == 0 ? 1 : 3));
                snprintf(out, sizeof(out), "model.layers.%d.mlp.experts.%s", l,
                         down ? "down_proj" : "gate_up_proj");
                add_concat(sw, ck, out, n, parts, 3,
                           down ? (int64_t[]){E, D, I} : (int64_t[]){E, 2 * I, D});
                free(parts);
                continue;
            } else if (strncmp(rest, "mlp.", 4) == 0) { /* a dense layer */
                int other =
                    sp == SP_SAVE_PRETRAINED || (sp == SP_MIXED && strstr(rest, "up_proj") != NULL);
                if (other)
                    snprintf(out, sizeof(out), "model.layers.%d.block_sparse_moe.%s", l, rest + 4);
            } else if (strncmp(rest, "block_sparse_moe.", 17) == 0) {
                int other = sp == SP_INTERNAL ||
                            (sp == SP_MIXED && (e % 2 == 1 || strstr(rest, "gate.weight")));
                if (other)
                    snprintf(out, sizeof(out), "model.layers.%d.mlp.%s", l, rest + 17);
            }
        }
        duet_tensor_t t;
        size_t b;
        const void *src = ck_bytes(ck, name, &b, &t);
        cr_assert_eq(st_writer_add(sw, out, duet_dtype_name(t.dtype), t.ndim, t.shape, src), 0);
    }
}

/* A Moonshot-named tiny model in dir0 and the same weights in spelling `sp` in sw. */
static void write_spelled(const char *dir0, int sp, const char *dtype, st_writer_t *sw,
                          duet_model_config_t *cfg)
{
    tiny_config(0, cfg);
    st_writer_t *ms = st_writer_new();
    cr_assert_eq(st_writer_add_model(ms, cfg, dtype, 99), 0);
    write_model(dir0, ms, 0);
    st_writer_free(ms);
    duet_checkpoint_t *ck;
    cr_assert_eq(duet_checkpoint_open(dir0, &ck), DUET_OK, "%s", duet_error_last());
    respell(ck, cfg, sp, sw);
    duet_checkpoint_close(ck);
}

static void same_tensor(const duet_tensor_t *a, const duet_tensor_t *b, const char *what, int l)
{
    cr_assert_eq(a->dtype, b->dtype, "layer %d %s: dtype", l, what);
    cr_assert_eq(a->ndim, b->ndim, "layer %d %s: ndim %d vs %d", l, what, a->ndim, b->ndim);
    for (int i = 0; i < a->ndim; i++)
        cr_assert_eq(a->shape[i], b->shape[i], "layer %d %s: dim %d", l, what, i);
    size_t n = (size_t)duet_tensor_numel(a) * duet_dtype_size(a->dtype);
    cr_assert_not_null(b->data, "layer %d %s unbound", l, what);
    cr_assert_eq(memcmp(a->data, b->data, n), 0, "layer %d %s: bytes differ", l, what);
}

/* Every weight of two bindings of one model: same dtype, shape and bytes. */
static void same_weights(const duet_model_config_t *c, const duet_weights_t *a,
                         const duet_weights_t *b)
{
    same_tensor(&a->embed_tokens, &b->embed_tokens, "embed_tokens", -1);
    same_tensor(&a->norm, &b->norm, "norm", -1);
    same_tensor(&a->lm_head, &b->lm_head, "lm_head", -1);
    for (int l = 0; l < (int)c->num_layers; l++) {
        const duet_layer_weights_t *x = &a->layers[l], *y = &b->layers[l];
#define SAME(f) same_tensor(&x->f, &y->f, #f, l)
        SAME(input_layernorm);
        SAME(post_attention_layernorm);
        if (x->mixer == DUET_MIXER_KDA) {
            SAME(kda.q_proj), SAME(kda.k_proj), SAME(kda.v_proj), SAME(kda.q_conv);
            SAME(kda.k_conv), SAME(kda.v_conv), SAME(kda.f_a_proj), SAME(kda.f_b_proj);
            SAME(kda.dt_bias), SAME(kda.A_log), SAME(kda.b_proj), SAME(kda.g_a_proj);
            SAME(kda.g_b_proj), SAME(kda.o_norm), SAME(kda.o_proj);
        } else {
            SAME(mla.q_a_proj), SAME(mla.q_a_layernorm), SAME(mla.q_b_proj);
            SAME(mla.kv_a_proj_with_mqa), SAME(mla.kv_a_layernorm), SAME(mla.kv_b_proj);
            SAME(mla.o_proj);
        }
        if (x->ffn == DUET_FFN_DENSE) {
            SAME(mlp.gate_proj), SAME(mlp.up_proj), SAME(mlp.down_proj);
        } else {
            SAME(moe.gate), SAME(moe.gate_bias), SAME(moe.shared.gate_proj);
            SAME(moe.shared.up_proj), SAME(moe.shared.down_proj);
            for (int64_t e = 0; e < c->n_experts; e++) {
                SAME(moe.w1[e]), SAME(moe.w2[e]), SAME(moe.w3[e]);
            }
        }
#undef SAME
    }
}

Test(engine_checkpoint, weights_transformers_spellings_bind_the_same_bytes, .timeout = 20)
{
    const char *dtypes[2] = {"BF16", "F32"};
    for (int sp = SP_SAVE_PRETRAINED; sp <= SP_MIXED; sp++)
        for (int k = 0; k < 2; k++) {
            char dir0[64], dir1[64];
            make_dir(dir0);
            make_dir(dir1);
            duet_model_config_t cfg;
            st_writer_t *sw = st_writer_new();
            write_spelled(dir0, sp, dtypes[k], sw, &cfg);
            write_model(dir1, sw, sp == SP_MIXED);
            st_writer_free(sw);

            duet_checkpoint_t *ck0, *ck1;
            duet_weights_t w0, w1;
            cr_assert_eq(bind_dir(dir0, &cfg, &ck0, &w0), DUET_OK, "%s", duet_error_last());
            cr_assert_eq(bind_dir(dir1, &cfg, &ck1, &w1), DUET_OK, "spelling %d: %s", sp,
                         duet_error_last());
            if (sp == SP_INTERNAL) /* 3 convs → 1 and 4 experts x 3 → 2 per layer */
                cr_assert_eq(duet_checkpoint_n_tensors(ck1),
                             duet_checkpoint_n_tensors(ck0) - 3 * 2 - 3 * (12 - 2));
            else
                cr_assert_eq(duet_checkpoint_n_tensors(ck1), duet_checkpoint_n_tensors(ck0));
            cr_assert_eq(duet_checkpoint_n_unused(ck1), 0, "spelling %d: %s unused", sp,
                         duet_checkpoint_unused_name(ck1, 0));
            same_weights(&cfg, &w0, &w1);
            duet_weights_free(&w0);
            duet_weights_free(&w1);
            duet_checkpoint_close(ck0);
            duet_checkpoint_close(ck1);
            remove_dir(dir0);
            remove_dir(dir1);
        }
}

/* A Moonshot-named tiny model, changed by `edit`, must fail binding with `want` and a detail
 * holding needles[0..n) (NULL-terminated). */
typedef void (*spell_edit_fn)(st_writer_t *sw, const duet_checkpoint_t *ck0);

static void expect_bind_fails(int sp, spell_edit_fn edit, duet_status_t want,
                              const char *const *needles)
{
    char dir0[64], dir1[64];
    make_dir(dir0);
    make_dir(dir1);
    duet_model_config_t cfg;
    st_writer_t *sw = st_writer_new();
    write_spelled(dir0, sp, "BF16", sw, &cfg);
    duet_checkpoint_t *ck0;
    cr_assert_eq(duet_checkpoint_open(dir0, &ck0), DUET_OK);
    edit(sw, ck0);
    duet_checkpoint_close(ck0);
    write_model(dir1, sw, 1);
    st_writer_free(sw);
    duet_checkpoint_t *ck;
    duet_weights_t w, untouched;
    memset(&untouched, 0xab, sizeof(untouched));
    w = untouched;
    duet_error_clear();
    duet_status_t st = bind_dir(dir1, &cfg, &ck, &w);
    cr_assert_eq(st, want, "got %s (%s)", duet_status_name(st), duet_error_last());
    cr_assert_eq(memcmp(&w, &untouched, sizeof(w)), 0, "w_p written on failure");
    for (int i = 0; needles[i] != NULL; i++)
        cr_assert_not_null(strstr(duet_error_last(), needles[i]), "detail \"%s\" lacks \"%s\"",
                           duet_error_last(), needles[i]);
    duet_checkpoint_close(ck);
    remove_dir(dir0);
    remove_dir(dir1);
}

/* Add a copy of ck0's tensor `from` under the name `to`. */
static void add_copy(st_writer_t *sw, const duet_checkpoint_t *ck0, const char *from,
                     const char *to)
{
    duet_tensor_t t;
    size_t b;
    const void *src = ck_bytes(ck0, from, &b, &t);
    cr_assert_eq(st_writer_add(sw, to, duet_dtype_name(t.dtype), t.ndim, t.shape, src), 0);
}

static void edit_dense_twice(st_writer_t *sw, const duet_checkpoint_t *ck0)
{
    /* save_pretrained's block_sparse_moe.gate_proj and the hub's mlp.gate_proj, both */
    add_copy(sw, ck0, "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight");
}

static void edit_forget_gate_twice(st_writer_t *sw, const duet_checkpoint_t *ck0)
{
    (void)ck0;
    int64_t shape[4] = {1, 1, 2, 1};
    cr_assert_eq(st_writer_add(sw, "model.layers.1.self_attn.A_log", "BF16", 4, shape, NULL), 0);
}

static void edit_conv_fused_and_split(st_writer_t *sw, const duet_checkpoint_t *ck0)
{
    add_copy(sw, ck0, "model.layers.3.self_attn.v_conv1d.weight",
             "model.layers.3.self_attn.v_conv1d.weight");
}

static void edit_experts_fused_and_split(st_writer_t *sw, const duet_checkpoint_t *ck0)
{
    add_copy(sw, ck0, "model.layers.2.block_sparse_moe.experts.2.w3.weight",
             "model.layers.2.mlp.experts.2.w3.weight");
}

static void edit_experts_fused_twice(st_writer_t *sw, const duet_checkpoint_t *ck0)
{
    (void)ck0;
    int64_t shape[3] = {4, 16, 8};
    cr_assert_eq(st_writer_add(sw, "model.layers.1.block_sparse_moe.experts.down_proj", "BF16", 3,
                               shape, NULL),
                 0);
}

static void edit_drop_v_conv(st_writer_t *sw, const duet_checkpoint_t *ck0)
{
    (void)ck0;
    cr_assert_eq(st_writer_remove(sw, "model.layers.3.self_attn.v_conv1d.weight"), 1);
}

static void edit_drop_expert(st_writer_t *sw, const duet_checkpoint_t *ck0)
{
    (void)ck0;
    cr_assert_eq(st_writer_remove(sw, "model.layers.2.mlp.experts.3.w2.weight"), 1);
}

static void edit_fused_wrong_shape(st_writer_t *sw, const duet_checkpoint_t *ck0)
{
    (void)ck0;
    cr_assert_eq(st_writer_remove(sw, "model.layers.3.mlp.experts.gate_up_proj"), 1);
    int64_t shape[3] = {4, 8, 16}; /* w1 only: (E, I, D) instead of (E, 2I, D) */
    cr_assert_eq(
        st_writer_add(sw, "model.layers.3.mlp.experts.gate_up_proj", "BF16", 3, shape, NULL), 0);
}

Test(engine_checkpoint, weights_spellings_mixed_inconsistently_are_refused, .timeout = 20)
{
    /* a weight under two spellings: both tensors and their files named */
    expect_bind_fails(SP_SAVE_PRETRAINED, edit_dense_twice, DUET_ERR_FORMAT,
                      (const char *[]){"model.layers.0.mlp.gate_proj.weight",
                                       "model.layers.0.block_sparse_moe.gate_proj.weight",
                                       "two spellings", ".safetensors", NULL});
    expect_bind_fails(SP_INTERNAL, edit_forget_gate_twice, DUET_ERR_FORMAT,
                      (const char *[]){"model.layers.1.self_attn.A_log",
                                       "model.layers.1.self_attn.forget_gate.A_log", NULL});
    expect_bind_fails(SP_INTERNAL, edit_experts_fused_twice, DUET_ERR_FORMAT,
                      (const char *[]){"model.layers.1.block_sparse_moe.experts.down_proj",
                                       "model.layers.1.mlp.experts.down_proj", NULL});
    /* a fused tensor next to one of the split tensors it stands for */
    expect_bind_fails(SP_INTERNAL, edit_conv_fused_and_split, DUET_ERR_FORMAT,
                      (const char *[]){"model.layers.3.self_attn.v_conv1d.weight",
                                       "model.layers.3.self_attn.conv1d.weight", NULL});
    expect_bind_fails(SP_INTERNAL, edit_experts_fused_and_split, DUET_ERR_FORMAT,
                      (const char *[]){"model.layers.2.mlp.experts.2.w3.weight",
                                       "model.layers.2.mlp.experts.gate_up_proj", NULL});
    /* a fused tensor of the wrong shape: both shapes named */
    expect_bind_fails(SP_INTERNAL, edit_fused_wrong_shape, DUET_ERR_FORMAT,
                      (const char *[]){"model.layers.3.mlp.experts.gate_up_proj", "[4, 8, 16]",
                                       "[4, 16, 16]", ".safetensors", NULL});
}

Test(engine_checkpoint, weights_missing_under_every_spelling_is_named, .timeout = 20)
{
    /* the missing tensor, its other spellings, and the index that lists the checkpoint */
    expect_bind_fails(SP_SAVE_PRETRAINED, edit_drop_v_conv, DUET_ERR_NOT_FOUND,
                      (const char *[]){"model.layers.3.self_attn.v_conv1d.weight",
                                       "nor model.layers.3.self_attn.conv1d.weight",
                                       "model.safetensors.index.json", NULL});
    expect_bind_fails(SP_MIXED, edit_drop_expert, DUET_ERR_NOT_FOUND,
                      (const char *[]){"model.layers.2.block_sparse_moe.experts.3.w2.weight",
                                       "model.layers.2.mlp.experts.3.w2.weight",
                                       "model.layers.2.block_sparse_moe.experts.down_proj", NULL});
}

Test(engine_checkpoint, dtype_is_the_one_holding_most_bytes, .timeout = 10)
{
    const char *dtypes[3] = {"F32", "BF16", "F16"};
    const duet_dtype_t want[3] = {DUET_DTYPE_F32, DUET_DTYPE_BF16, DUET_DTYPE_F16};
    for (int k = 0; k < 3; k++) {
        char dir[64];
        make_dir(dir);
        duet_model_config_t cfg;
        tiny_config(0, &cfg);
        st_writer_t *sw = st_writer_new();
        cr_assert_eq(st_writer_add_model(sw, &cfg, dtypes[k], 5), 0);
        /* a few small tensors in another dtype (as bf16 models keep biases in f32) */
        int64_t s = 64;
        cr_assert_eq(st_writer_add(sw, "extra.a", k == 0 ? "BF16" : "F32", 1, &s, NULL), 0);
        cr_assert_eq(st_writer_add(sw, "extra.b", k == 2 ? "BF16" : "F16", 1, &s, NULL), 0);
        write_model(dir, sw, k == 1);
        st_writer_free(sw);
        duet_checkpoint_t *ck;
        cr_assert_eq(duet_checkpoint_open(dir, &ck), DUET_OK);
        cr_assert_eq(duet_checkpoint_dtype(ck), want[k], "%s model: got %s", dtypes[k],
                     duet_dtype_name(duet_checkpoint_dtype(ck)));
        duet_checkpoint_close(ck);
        remove_dir(dir);
    }
    /* a big F32 tensor outweighs a BF16 model */
    char dir[64];
    make_dir(dir);
    duet_model_config_t cfg;
    tiny_config(0, &cfg);
    st_writer_t *sw = st_writer_new();
    cr_assert_eq(st_writer_add_model(sw, &cfg, "BF16", 5), 0);
    int64_t big = 1 << 16;
    cr_assert_eq(st_writer_add(sw, "extra.big", "F32", 1, &big, NULL), 0);
    write_model(dir, sw, 0);
    st_writer_free(sw);
    duet_checkpoint_t *ck;
    cr_assert_eq(duet_checkpoint_open(dir, &ck), DUET_OK);
    cr_assert_eq(duet_checkpoint_dtype(ck), DUET_DTYPE_F32);
    duet_checkpoint_close(ck);
    remove_dir(dir);
}

/* ---- fuzz ----------------------------------------------------------------------------------- */

static uint64_t xorshift(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

Test(engine_checkpoint, fuzz_header_bytes, .timeout = 120, .init = cr_redirect_stderr)
{
    char dir[64], path[512];
    make_dir(dir);
    file_path(path, sizeof(path), dir, "model.safetensors");
    st_writer_t *w = samples_writer();
    uint8_t *orig;
    size_t len;
    cr_assert_eq(st_writer_serialize(w, &orig, &len), 0);
    st_writer_free(w);
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++)
        hl |= (uint64_t)orig[i] << (8 * i);

    static const char interesting[] = "{}[]\",:0123456789-. FBI";
    uint8_t *buf = malloc(len);
    uint64_t s = 0x0ddba11cafeull;
    int n_ok = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(buf, orig, len);
        size_t n = len;
        int mut = 1 + (int)(xorshift(&s) % 3);
        for (int m = 0; m < mut; m++) {
            /* Mostly the header; now and then the length field or the file's end. */
            uint64_t r = xorshift(&s) % 16;
            size_t pos = r == 0 ? (size_t)(xorshift(&s) % 8) : 8 + (size_t)(xorshift(&s) % hl);
            if (r == 1) {
                n = 1 + (size_t)(xorshift(&s) % len);
                continue;
            }
            if (pos >= n)
                continue;
            buf[pos] = (xorshift(&s) & 1)
                           ? (uint8_t)(xorshift(&s) & 0xff)
                           : (uint8_t)interesting[xorshift(&s) % (sizeof(interesting) - 1)];
        }
        FILE *f = fopen(path, "wb");
        /* Plain checks: ctest runs with --full-stats, which ships every assertion. */
        if (f == NULL || fwrite(buf, 1, n, f) != n)
            cr_assert_fail("iteration %d: cannot write %s", it, path);
        fclose(f);
        duet_checkpoint_t *ck = NULL;
        duet_status_t st = duet_checkpoint_open(dir, &ck);
        if (!(st == DUET_OK || st == DUET_ERR_FORMAT || st == DUET_ERR_UNSUPPORTED))
            cr_assert_fail("iteration %d: unexpected %s (%s)", it, duet_status_name(st),
                           duet_error_last());
        if (st != DUET_OK && strstr(duet_error_last(), "model.safetensors") == NULL)
            cr_assert_fail("iteration %d: detail \"%s\" lacks the file", it, duet_error_last());
        if (st == DUET_OK) {
            n_ok++;
            /* Whatever loaded must be readable end to end. */
            for (int64_t i = 0; i < duet_checkpoint_n_tensors(ck); i++) {
                duet_tensor_t t;
                if (duet_checkpoint_get(ck, duet_checkpoint_tensor_name(ck, i), &t) != DUET_OK)
                    continue;
                size_t nb = (size_t)duet_tensor_numel(&t) * duet_dtype_size(t.dtype);
                uint64_t sum = 0;
                for (size_t b = 0; b < nb; b++)
                    sum += ((const uint8_t *)t.data)[b];
                (void)sum;
            }
            duet_checkpoint_close(ck);
        }
    }
    free(buf);
    free(orig);
    cr_log_info("fuzz: %d of 3000 mutants opened", n_ok);
    remove_dir(dir);
}
