/* What the engine's C kernels share: their status codes and a vectorisable e^x.
 *
 * Included by each kernel's source (a kernel is one translation unit, built by
 * native_build.py); the guard lets a kernel include two sources that both include it.
 */
#ifndef SLUICE_KERNEL_COMMON
#define SLUICE_KERNEL_COMMON

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Status bits a kernel returns (native_build.py's check_status reads them). */
#define SLUICE_BAD_BLOCK 1
#define SLUICE_BAD_SHAPE 2
#define SLUICE_NO_MEMORY 4

/* e^x for x <= 0 (a score minus its row's maximum), vectorisable: x = n ln 2 + r with
 * |r| <= ln 2 / 2, e^r by Cephes' expf polynomial, 2^n put into the exponent bits. Within
 * 2 ulp of expf over [-87, 0]; below -87 (e^x < 2^-125, nothing beside e^0 = 1) it is 0. */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(clamped * 1.44269504088896341f);
    const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return x < -87.0f ? 0.0f : p * scale.f;
}

#endif
