/*
 * dtype.c: element types of weights and the exact conversions between them.
 *
 * IEEE binary16 is converted with integer arithmetic rather than F16C so that the results are
 * the same on every x86-64 (and other) CPU, including subnormals, infinities and NaN payloads;
 * the matmul's vector paths use F16C, which is exact too, so the two agree bit for bit.
 */
#include "kernels/kernels.h"

#include "common/log.h"

size_t duet_dtype_size(duet_dtype_t dt)
{
    switch (dt) {
    case DUET_DTYPE_F32:
        return 4;
    case DUET_DTYPE_BF16:
    case DUET_DTYPE_F16:
        return 2;
    }
    return 0;
}

const char *duet_dtype_name(duet_dtype_t dt)
{
    switch (dt) {
    case DUET_DTYPE_F32:
        return "F32";
    case DUET_DTYPE_BF16:
        return "BF16";
    case DUET_DTYPE_F16:
        return "F16";
    }
    return "?";
}

int64_t duet_tensor_numel(const duet_tensor_t *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

float duet_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    uint32_t u;
    float f;

    if (e == 0) {
        /* zero or subnormal: m * 2^-24, exact in fp32 */
        f = (float)m * 0x1p-24f;
        return sign != 0 ? -f : f;
    }
    if (e == 31)
        u = sign | 0x7f800000u | (m << 13); /* inf, or NaN keeping its payload */
    else
        u = sign | ((e + 112u) << 23) | (m << 13);
    memcpy(&f, &u, sizeof(f));
    return f;
}

uint16_t duet_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;

    if (a >= 0x7f800000u) {
        if (a == 0x7f800000u)
            return (uint16_t)(sign | 0x7c00u);
        /* NaN: keep the top payload bits, force quiet so it cannot become inf */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    }
    if (a >= 0x477ff000u) /* >= 65520 rounds to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {
        /* result is subnormal (or zero, or rounds up to the smallest normal) */
        if (a < 0x33000000u) /* < 2^-25: rounds to zero */
            return (uint16_t)sign;
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14..24 */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u) != 0))
            q++;
        return (uint16_t)(sign | q);
    }
    uint32_t r = a - 0x38000000u; /* rebias the exponent from 127 to 15 */
    uint32_t q = r >> 13;
    uint32_t rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u) != 0))
        q++; /* a carry into the exponent is the correct result */
    return (uint16_t)(sign | q);
}

void duet_convert_to_f32(float *dst, const void *src, duet_dtype_t dt, int64_t n)
{
    switch (dt) {
    case DUET_DTYPE_F32:
        if ((const void *)dst != src)
            memmove(dst, src, (size_t)n * sizeof(float));
        return;
    case DUET_DTYPE_BF16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = duet_bf16_to_f32(s[i]);
        return;
    }
    case DUET_DTYPE_F16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = duet_f16_to_f32(s[i]);
        return;
    }
    }
    DUET_ASSERT(!"unknown dtype");
}
