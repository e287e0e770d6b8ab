/* st_writer.c: see st_writer.h. Test helper: simple over fast, and no dependence on the loader. */
#include "st_writer.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

typedef struct {
    char *name;
    char dtype[16];
    int ndim;
    int64_t shape[8];
    uint8_t *data;
    size_t nbytes;
    size_t esize;
} st_tensor_t;

struct st_writer {
    st_tensor_t *t;
    int n, cap;
};

st_writer_t *st_writer_new(void)
{
    return calloc(1, sizeof(st_writer_t));
}

void st_writer_free(st_writer_t *w)
{
    if (w == NULL)
        return;
    for (int i = 0; i < w->n; i++) {
        free(w->t[i].name);
        free(w->t[i].data);
    }
    free(w->t);
    free(w);
}

size_t st_dtype_size(const char *dtype)
{
    static const struct {
        const char *name;
        size_t size;
    } tab[] = {{"F64", 8}, {"I64", 8},  {"U64", 8},  {"F32", 4},     {"I32", 4},
               {"U32", 4}, {"BF16", 2}, {"F16", 2},  {"I16", 2},     {"U16", 2},
               {"I8", 1},  {"U8", 1},   {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
    for (size_t i = 0; i < sizeof(tab) / sizeof(tab[0]); i++)
        if (strcmp(tab[i].name, dtype) == 0)
            return tab[i].size;
    return 0;
}

int st_writer_remove(st_writer_t *w, const char *name)
{
    int k = 0, removed = 0;
    for (int i = 0; i < w->n; i++) {
        if (strcmp(w->t[i].name, name) == 0) {
            free(w->t[i].name);
            free(w->t[i].data);
            removed++;
        } else {
            w->t[k++] = w->t[i];
        }
    }
    w->n = k;
    return removed;
}

int st_writer_count(const st_writer_t *w)
{
    return w->n;
}

int st_writer_add(st_writer_t *w, const char *name, const char *dtype, int ndim,
                  const int64_t *shape, const void *data)
{
    if (ndim < 0 || ndim > 8 || strlen(dtype) >= 16)
        return -1;
    if (w->n == w->cap) {
        int cap = w->cap ? w->cap * 2 : 64;
        st_tensor_t *nt = realloc(w->t, (size_t)cap * sizeof(*nt));
        if (nt == NULL)
            return -1;
        w->t = nt;
        w->cap = cap;
    }
    st_tensor_t *t = &w->t[w->n];
    memset(t, 0, sizeof(*t));
    snprintf(t->dtype, sizeof(t->dtype), "%s", dtype);
    t->ndim = ndim;
    t->esize = st_dtype_size(dtype) ? st_dtype_size(dtype) : 1;
    size_t ne = 1;
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        ne *= (size_t)shape[i];
    }
    t->nbytes = ne * t->esize;
    t->name = strdup(name);
    t->data = malloc(t->nbytes ? t->nbytes : 1);
    if (t->name == NULL || t->data == NULL) {
        free(t->name);
        free(t->data);
        return -1;
    }
    if (data != NULL)
        memcpy(t->data, data, t->nbytes);
    else
        memset(t->data, 0, t->nbytes);
    w->n++;
    return 0;
}

/* Growable text buffer for the JSON header. */
typedef struct {
    char *s;
    size_t len, cap;
} sbuf_t;

static int sb_printf(sbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int sb_printf(sbuf_t *b, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0)
            return -1;
        if (b->s != NULL && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return 0;
        }
        size_t cap = (b->cap + (size_t)n + 1) * 2;
        char *ns = realloc(b->s, cap);
        if (ns == NULL)
            return -1;
        b->s = ns;
        b->cap = cap;
    }
}

static int cmp_esize_desc(const void *a, const void *b)
{
    const st_tensor_t *x = *(const st_tensor_t *const *)a, *y = *(const st_tensor_t *const *)b;
    if (x->esize != y->esize)
        return x->esize > y->esize ? -1 : 1;
    return x < y ? -1 : x > y; /* stable: keep insertion order */
}

/* Serialize tensors [first, first+count). */
static int serialize_range(const st_writer_t *w, int first, int count, uint8_t **buf_p,
                           size_t *len_p)
{
    const st_tensor_t **order = malloc((size_t)(count ? count : 1) * sizeof(*order));
    if (order == NULL)
        return -1;
    for (int i = 0; i < count; i++)
        order[i] = &w->t[first + i];
    qsort(order, (size_t)count, sizeof(*order), cmp_esize_desc);

    sbuf_t b = {0};
    int rc = sb_printf(&b, "{\"__metadata__\":{\"format\":\"pt\"}");
    size_t off = 0;
    for (int i = 0; i < count && rc == 0; i++) {
        const st_tensor_t *t = order[i];
        rc = sb_printf(&b, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t->name, t->dtype);
        for (int d = 0; d < t->ndim && rc == 0; d++)
            rc = sb_printf(&b, "%s%" PRId64, d ? "," : "", t->shape[d]);
        if (rc == 0)
            rc = sb_printf(&b, "],\"data_offsets\":[%zu,%zu]}", off, off + t->nbytes);
        off += t->nbytes;
    }
    if (rc == 0)
        rc = sb_printf(&b, "}");
    while (rc == 0 && b.len % 8 != 0)
        rc = sb_printf(&b, " "); /* pad so the data area starts 8-aligned */
    if (rc != 0) {
        free(b.s);
        free(order);
        return -1;
    }
    size_t total = 8 + b.len + off;
    uint8_t *buf = malloc(total);
    if (buf == NULL) {
        free(b.s);
        free(order);
        return -1;
    }
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)((uint64_t)b.len >> (8 * i));
    memcpy(buf + 8, b.s, b.len);
    size_t pos = 8 + b.len;
    for (int i = 0; i < count; i++) {
        memcpy(buf + pos, order[i]->data, order[i]->nbytes);
        pos += order[i]->nbytes;
    }
    free(b.s);
    free(order);
    *buf_p = buf;
    *len_p = total;
    return 0;
}

int st_writer_serialize(const st_writer_t *w, uint8_t **buf_p, size_t *len_p)
{
    return serialize_range(w, 0, w->n, buf_p, len_p);
}

static int write_file(const char *path, const void *buf, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL)
        return -1;
    int ok = fwrite(buf, 1, len, f) == len;
    ok = (fclose(f) == 0) && ok;
    return ok ? 0 : -1;
}

int st_writer_write(const st_writer_t *w, const char *path)
{
    uint8_t *buf;
    size_t len;
    if (st_writer_serialize(w, &buf, &len) != 0)
        return -1;
    int rc = write_file(path, buf, len);
    free(buf);
    return rc;
}

int st_writer_write_sharded(const st_writer_t *w, const char *dir, int n_shards)
{
    if (n_shards < 1)
        return -1;
    sbuf_t idx = {0};
    int rc = sb_printf(&idx, "{\"metadata\":{\"total_size\":0},\"weight_map\":{");
    int per = (w->n + n_shards - 1) / n_shards, first_entry = 1;
    for (int s = 0; s < n_shards && rc == 0; s++) {
        int first = s * per, count = w->n - first < per ? w->n - first : per;
        if (count < 0)
            count = 0;
        char name[64], path[4096];
        snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        snprintf(path, sizeof(path), "%s/%s", dir, name);
        uint8_t *buf;
        size_t len;
        rc = serialize_range(w, first, count, &buf, &len);
        if (rc != 0)
            break;
        rc = write_file(path, buf, len);
        free(buf);
        for (int i = 0; i < count && rc == 0; i++) {
            rc = sb_printf(&idx, "%s\"%s\":\"%s\"", first_entry ? "" : ",", w->t[first + i].name,
                           name);
            first_entry = 0;
        }
    }
    if (rc == 0)
        rc = sb_printf(&idx, "}}\n");
    if (rc == 0)
        rc = st_write_text(dir, "model.safetensors.index.json", idx.s);
    free(idx.s);
    return rc;
}

int st_write_raw(const char *path, uint64_t len_field, const char *header, const void *data,
                 size_t data_len)
{
    size_t hl = strlen(header);
    uint8_t *buf = malloc(8 + hl + data_len);
    if (buf == NULL)
        return -1;
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(len_field >> (8 * i));
    memcpy(buf + 8, header, hl);
    if (data_len > 0)
        memcpy(buf + 8 + hl, data, data_len);
    int rc = write_file(path, buf, 8 + hl + data_len);
    free(buf);
    return rc;
}

int st_write_text(const char *dir, const char *name, const char *text)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    return write_file(path, text, strlen(text));
}

/* ---- tiny models ---------------------------------------------------------------------------- */

typedef struct {
    st_writer_t *w;
    const char *dtype;
    uint64_t rng;
    int rc;
} model_ctx_t;

static float next_uniform(uint64_t *s) /* splitmix64 → [-1, 1) */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) * 0x1p-53 * 2.0 - 1.0);
}

/* Add a tensor with values center + scale·U(-1,1). */
static void add_filled(model_ctx_t *m, const char *name, int ndim, const int64_t *shape,
                       float center, float scale)
{
    if (m->rc != 0)
        return;
    size_t ne = 1;
    for (int i = 0; i < ndim; i++)
        ne *= (size_t)shape[i];
    size_t es = st_dtype_size(m->dtype);
    void *buf = malloc(ne * es + 1);
    if (buf == NULL) {
        m->rc = -1;
        return;
    }
    for (size_t i = 0; i < ne; i++) {
        float v = center + scale * next_uniform(&m->rng);
        if (es == 4) {
            memcpy((uint8_t *)buf + 4 * i, &v, 4);
        } else {
            uint16_t h = strcmp(m->dtype, "BF16") == 0 ? duet_f32_to_bf16(v) : duet_f32_to_f16(v);
            memcpy((uint8_t *)buf + 2 * i, &h, 2);
        }
    }
    m->rc = st_writer_add(m->w, name, m->dtype, ndim, shape, buf);
    free(buf);
}

// clang-format off
#define SHAPE(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}
// clang-format on

static void add_mat(model_ctx_t *m, const char *name, int64_t out, int64_t in)
{
    add_filled(m, name, SHAPE(out, in), 0.0f, 1.0f / sqrtf((float)in));
}

static void add_norm(model_ctx_t *m, const char *name, int64_t n)
{
    add_filled(m, name, SHAPE(n), 1.0f, 0.1f);
}

int st_writer_add_model(st_writer_t *w, const duet_model_config_t *c, const char *dtype,
                        uint64_t seed)
{
    if (strcmp(dtype, "F32") != 0 && strcmp(dtype, "BF16") != 0 && strcmp(dtype, "F16") != 0)
        return -1;
    model_ctx_t m = {w, dtype, seed, 0};
    const int64_t D = c->hidden_size, V = c->vocab_size;
    char n[256];

    add_filled(&m, "model.embed_tokens.weight", SHAPE(V, D), 0.0f, 1.0f);
    add_norm(&m, "model.norm.weight", D);
    if (!c->tie_word_embeddings)
        add_mat(&m, "lm_head.weight", V, D);
    for (int l = 0; l < (int)c->num_layers; l++) {
#define NAME(...) (snprintf(n, sizeof(n), __VA_ARGS__), n)
        add_norm(&m, NAME("model.layers.%d.input_layernorm.weight", l), D);
        add_norm(&m, NAME("model.layers.%d.post_attention_layernorm.weight", l), D);
        const char *a = "model.layers.%d.self_attn.%s";
        if (c->mixer[l] == DUET_MIXER_KDA) {
            const int64_t H = c->kda_heads, K = c->kda_head_dim, HK = H * K, W = c->conv_kernel;
            add_mat(&m, NAME(a, l, "q_proj.weight"), HK, D);
            add_mat(&m, NAME(a, l, "k_proj.weight"), HK, D);
            add_mat(&m, NAME(a, l, "v_proj.weight"), HK, D);
            add_filled(&m, NAME(a, l, "q_conv1d.weight"), SHAPE(HK, 1, W), 0.0f, 0.5f);
            add_filled(&m, NAME(a, l, "k_conv1d.weight"), SHAPE(HK, 1, W), 0.0f, 0.5f);
            add_filled(&m, NAME(a, l, "v_conv1d.weight"), SHAPE(HK, 1, W), 0.0f, 0.5f);
            add_mat(&m, NAME(a, l, "f_a_proj.weight"), K, D);
            add_mat(&m, NAME(a, l, "f_b_proj.weight"), HK, K);
            add_filled(&m, NAME(a, l, "dt_bias"), SHAPE(HK), 0.0f, 0.5f);
            add_filled(&m, NAME(a, l, "A_log"), SHAPE(1, 1, H, 1), 0.0f, 0.5f);
            add_mat(&m, NAME(a, l, "b_proj.weight"), H, D);
            add_mat(&m, NAME(a, l, "g_a_proj.weight"), K, D);
            add_mat(&m, NAME(a, l, "g_b_proj.weight"), HK, K);
            add_norm(&m, NAME(a, l, "o_norm.weight"), K);
            add_mat(&m, NAME(a, l, "o_proj.weight"), D, HK);
        } else {
            const int64_t nh = c->mla_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
            const int64_t dv = c->v_head_dim, r = c->kv_lora_rank, ql = c->q_lora_rank;
            if (ql > 0) {
                add_mat(&m, NAME(a, l, "q_a_proj.weight"), ql, D);
                add_norm(&m, NAME(a, l, "q_a_layernorm.weight"), ql);
                add_mat(&m, NAME(a, l, "q_b_proj.weight"), nh * (dn + dr), ql);
            } else {
                add_mat(&m, NAME(a, l, "q_proj.weight"), nh * (dn + dr), D);
            }
            add_mat(&m, NAME(a, l, "kv_a_proj_with_mqa.weight"), r + dr, D);
            add_norm(&m, NAME(a, l, "kv_a_layernorm.weight"), r);
            add_mat(&m, NAME(a, l, "kv_b_proj.weight"), nh * (dn + dv), r);
            add_mat(&m, NAME(a, l, "o_proj.weight"), D, nh * dv);
        }
        if (c->ffn[l] == DUET_FFN_DENSE) {
            const int64_t I = c->dense_intermediate;
            add_mat(&m, NAME("model.layers.%d.mlp.gate_proj.weight", l), I, D);
            add_mat(&m, NAME("model.layers.%d.mlp.up_proj.weight", l), I, D);
            add_mat(&m, NAME("model.layers.%d.mlp.down_proj.weight", l), D, I);
        } else {
            const int64_t E = c->n_experts, I = c->moe_intermediate, Is = I * c->n_shared_experts;
            const char *b = "model.layers.%d.block_sparse_moe.%s";
            add_mat(&m, NAME(b, l, "gate.weight"), E, D);
            add_filled(&m, NAME(b, l, "gate.e_score_correction_bias"), SHAPE(E), 0.0f, 0.1f);
            for (int64_t e = 0; e < E; e++) {
                const char *x = "model.layers.%d.block_sparse_moe.experts.%" PRId64 ".%s";
                add_mat(&m, NAME(x, l, e, "w1.weight"), I, D);
                add_mat(&m, NAME(x, l, e, "w2.weight"), D, I);
                add_mat(&m, NAME(x, l, e, "w3.weight"), I, D);
            }
            if (Is > 0) {
                add_mat(&m, NAME(b, l, "shared_experts.gate_proj.weight"), Is, D);
                add_mat(&m, NAME(b, l, "shared_experts.up_proj.weight"), Is, D);
                add_mat(&m, NAME(b, l, "shared_experts.down_proj.weight"), D, Is);
            }
        }
#undef NAME
    }
    return m.rc;
}
