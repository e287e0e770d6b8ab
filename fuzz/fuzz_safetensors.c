/*
 * Fuzz target: safetensors checkpoints (engine/checkpoint.c: duet_checkpoint_open) and the weight
 * binding that follows at load (engine/weights.c: duet_weights_bind against a tiny config).
 *
 * Input: a control byte, then the payload.
 *  mode 0: the payload is DIR/model.safetensors (8-byte header length, header JSON, data);
 *  mode 1: the payload is split at "\n--file--\n" into DIR/model.safetensors.index.json,
 *          DIR/model-00001-of-00002.safetensors and DIR/model-00002-of-00002.safetensors.
 * Checked besides no crash / sanitizer report:
 *  - a refusal sets a detail and gives no checkpoint;
 *  - an opened checkpoint lists its tensors sorted and unique, and each view has a supported
 *    dtype, at most DUET_TENSOR_MAX_DIMS dimensions and data whenever it has bytes;
 *  - mode 0, against an independent reading of the header (jansson on the input): every tensor
 *    the loader accepted is in the header, and its view holds exactly the bytes the header's
 *    data_offsets name in the input;
 *  - binding either succeeds or fails with a detail (shapes are checked against the config).
 */
#include "fuzz/fuzz.h"

#include <jansson.h>

#include "common/status.h"
#include "engine/checkpoint.h"
#include "engine/model_config.h"
#include "engine/weights.h"
#include "fuzz/tiny_config.h"

static const char tiny_config[] = FUZZ_TINY_CONFIG;

static duet_model_config_t cfg;
static bool have_cfg;

static void check_against_header(const duet_checkpoint_t *ck, const uint8_t *p, size_t n)
{
    FUZZ_CHECK(n >= 8, "a file under 8 bytes opened");
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++)
        hl |= (uint64_t)p[i] << (8 * i);
    FUZZ_CHECK(hl <= n - 8, "header length %llu past the end", (unsigned long long)hl);
    json_error_t e;
    json_t *root = json_loadb((const char *)p + 8, (size_t)hl, 0, &e);
    FUZZ_CHECK(json_is_object(root), "the loader accepted a header jansson does not read");
    const uint8_t *data = p + 8 + hl;
    for (int64_t i = 0; i < duet_checkpoint_n_tensors(ck); i++) {
        const char *name = duet_checkpoint_tensor_name(ck, i);
        const json_t *ent = json_object_get(root, name);
        FUZZ_CHECK(json_is_object(ent) && strcmp(name, "__metadata__") != 0,
                   "tensor %s is not in the header", name);
        const json_t *off = json_object_get(ent, "data_offsets");
        json_int_t b = json_integer_value(json_array_get(off, 0)),
                   en = json_integer_value(json_array_get(off, 1));
        FUZZ_CHECK(b >= 0 && en >= b && (uint64_t)en <= n - 8 - hl, "tensor %s: offsets", name);
        duet_tensor_t t;
        if (duet_checkpoint_get(ck, name, &t) != DUET_OK)
            continue; /* more dimensions than a view holds: refused at get, with a detail */
        size_t bytes = (size_t)duet_tensor_numel(&t) * duet_dtype_size(t.dtype);
        FUZZ_CHECK(bytes == (size_t)(en - b), "tensor %s: %zu bytes, offsets span %lld", name,
                   bytes, (long long)(en - b));
        FUZZ_CHECK(bytes == 0 || memcmp(t.data, data + b, bytes) == 0,
                   "tensor %s: the view is not the bytes at its offsets", name);
    }
    json_decref(root);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    if (!have_cfg) {
        FUZZ_CHECK(duet_model_config_parse(tiny_config, sizeof(tiny_config) - 1, "tiny", &cfg) ==
                       DUET_OK,
                   "tiny config: %s", duet_error_last());
        have_cfg = true;
    }
    static const char *const files[] = {"model.safetensors", "model.safetensors.index.json",
                                        "model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors"};
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++)
        fuzz_remove_file(files[i]);
    fuzz_in_t in = {data, size};
    unsigned mode = fuzz_byte(&in) & 1;
    const uint8_t *single = in.p;
    size_t single_len = in.n;
    if (mode == 0) {
        fuzz_write_file(files[0], in.p, in.n);
    } else {
        for (size_t i = 1; i < 4; i++) {
            size_t len;
            bool more = in.n > 0;
            const uint8_t *p = fuzz_piece(&in, "\n--file--\n", &len);
            if (more || i == 1)
                fuzz_write_file(files[i], p, len);
        }
    }
    duet_checkpoint_t *ck = NULL;
    duet_error_clear();
    duet_status_t st = duet_checkpoint_open(fuzz_tmpdir(), &ck);
    if (st != DUET_OK) {
        FUZZ_CHECK(st < 0 && ck == NULL && duet_error_last()[0] != '\0',
                   "refusal %d without a detail", (int)st);
        return 0;
    }
    int64_t n = duet_checkpoint_n_tensors(ck);
    FUZZ_CHECK(n >= 0, "count");
    for (int64_t i = 0; i < n; i++) {
        const char *name = duet_checkpoint_tensor_name(ck, i);
        FUZZ_CHECK(name != NULL, "name %lld", (long long)i);
        FUZZ_CHECK(i == 0 || strcmp(duet_checkpoint_tensor_name(ck, i - 1), name) < 0,
                   "names not sorted and unique at %s", name);
        FUZZ_CHECK(duet_checkpoint_tensor_file(ck, name) != NULL, "file of %s", name);
        duet_tensor_t t;
        duet_error_clear();
        if (duet_checkpoint_get(ck, name, &t) != DUET_OK) {
            FUZZ_CHECK(duet_error_last()[0] != '\0', "get %s refused without a detail", name);
            continue;
        }
        FUZZ_CHECK(t.dtype == DUET_DTYPE_F32 || t.dtype == DUET_DTYPE_BF16 ||
                       t.dtype == DUET_DTYPE_F16,
                   "dtype %d", (int)t.dtype);
        FUZZ_CHECK(t.ndim >= 0 && t.ndim <= DUET_TENSOR_MAX_DIMS, "ndim %d", t.ndim);
        FUZZ_CHECK(duet_tensor_numel(&t) == 0 || t.data != NULL, "%s has bytes but no data", name);
    }
    if (mode == 0)
        check_against_header(ck, single, single_len);
    duet_weights_t w;
    duet_error_clear();
    st = duet_weights_bind(ck, &cfg, &w);
    if (st == DUET_OK)
        duet_weights_free(&w);
    else
        FUZZ_CHECK(st < 0 && duet_error_last()[0] != '\0', "bind refused without a detail");
    FUZZ_CHECK(duet_checkpoint_dtype(ck) == DUET_DTYPE_F32 ||
                   duet_checkpoint_dtype(ck) == DUET_DTYPE_BF16 ||
                   duet_checkpoint_dtype(ck) == DUET_DTYPE_F16,
               "checkpoint dtype");
    duet_checkpoint_close(ck);
    return 0;
}
