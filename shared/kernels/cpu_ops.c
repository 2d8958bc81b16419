/* Small CPU kernels for pdmesh's cpu backend, loaded with ctypes (shared/kernels/cpu.py).
 * Not a Python module: plain C functions on float32 buffers. Built by setup.py as an
 * optional extension; without a C compiler the backend runs the same math as torch ops.
 */

#include <stdint.h>

/* Normalise each row (sum over j) of an n x n matrix a: a / (sum + eps). */
static void rows_f32(float *a, int64_t n, float eps) {
    for (int64_t i = 0; i < n; i++) {
        float *row = a + i * n;
        float sum = row[0];
        for (int64_t j = 1; j < n; j++)
            sum += row[j];
        const float d = sum + eps;
        for (int64_t j = 0; j < n; j++)
            row[j] = row[j] / d;
    }
}

/* Normalise each column (sum over i). */
static void cols_f32(float *a, int64_t n, float eps) {
    for (int64_t j = 0; j < n; j++) {
        float sum = a[j];
        for (int64_t i = 1; i < n; i++)
            sum += a[i * n + j];
        const float d = sum + eps;
        for (int64_t i = 0; i < n; i++)
            a[i * n + j] = a[i * n + j] / d;
    }
}

/* Sinkhorn-Knopp on t matrices n x n (contiguous, in place): columns first, then
 * iters - 1 rounds of rows and columns; the order of DeepSeek-V4's hyper-connections. */
void pdmesh_hc_sinkhorn_f32(float *m, int64_t t, int64_t n, int64_t iters, float eps) {
    for (int64_t r = 0; r < t; r++) {
        float *a = m + r * n * n;
        cols_f32(a, n, eps);
        for (int64_t it = 1; it < iters; it++) {
            rows_f32(a, n, eps);
            cols_f32(a, n, eps);
        }
    }
}

/* -- W8A8 / W4A8 dynamic: int8 x int8 with AVX-512 VNNI -------------------------------
 *
 * The weight [K, N] int8 is packed once (pdmesh_int8_pack) into N tiles of 64 outputs,
 * each tile's K in groups of 4: byte (k, n) at
 *     tile n / 64, group k / 4, lane n % 64, byte k % 4      (K, N padded with zeros)
 * so one 64-byte load holds 4 consecutive k of 16 outputs, and vpdpbusd adds the four
 * products of 16 outputs at once from one broadcast of 4 activation bytes. VNNI takes
 * unsigned activations: each row is quantized symmetric per token (scale = max|x| / 127,
 * q = round(x / scale), as npu_dynamic_quant) and stored as q + 128; the 128 * column
 * sum it adds comes off in the epilogue (colsum, computed at packing). Rows go four at a
 * time over each tile, so a batch of M reads the weight ceil(M / 4) times.
 *
 *     y[r, n] = s_x[r] * s_w[n] * (sum_k q[r, k] w[k, n] - offset[n] * sum_k q[r, k])
 */

#define TILE 64

int pdmesh_int8_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

/* w [K, N] int8 (row-major) -> packed [N_pad / 64][K_pad / 4][64][4], colsum [N_pad]. */
void pdmesh_int8_pack(const int8_t *w, int64_t k, int64_t n, int8_t *packed,
                      int32_t *colsum) {
    const int64_t kp = (k + 3) / 4 * 4, np = (n + TILE - 1) / TILE * TILE;
    for (int64_t j = 0; j < np; j++)
        colsum[j] = 0;
    for (int64_t t = 0; t < np / TILE; t++)
        for (int64_t g = 0; g < kp / 4; g++)
            for (int64_t lane = 0; lane < TILE; lane++)
                for (int64_t b = 0; b < 4; b++) {
                    const int64_t kk = 4 * g + b, nn = t * TILE + lane;
                    const int8_t v = (kk < k && nn < n) ? w[kk * n + nn] : 0;
                    packed[((t * (kp / 4) + g) * TILE + lane) * 4 + b] = v;
                    colsum[nn] += v;
                }
}

/* Per row of x [m, k] float32: scale [m] = max|x| / 127, q = round(x / scale) (as
 * npu_dynamic_quant), qsum [m] = sum of q; out [m, k_pad] holds q ^ flip, zero-padded:
 * flip 0 keeps q signed, 0x80 stores the unsigned q + 128 (padding then reads 128). */
static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t kp, uint8_t *out,
                          float *scale, int32_t *qsum, uint8_t flip) {
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * k;
        float amax = 0.0f;
        for (int64_t i = 0; i < k; i++) {
            const float a = row[i] < 0 ? -row[i] : row[i];
            amax = a > amax ? a : amax;
        }
        float s = amax / 127.0f;
        if (s < 1e-12f / 127.0f)
            s = 1e-12f / 127.0f;
        scale[r] = s;
        int32_t sum = 0;
        for (int64_t i = 0; i < k; i++) {
            float q = __builtin_nearbyintf(row[i] / s);
            q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
            sum += (int32_t)q;
            out[r * kp + i] = (uint8_t)(int8_t)q ^ flip;
        }
        for (int64_t i = k; i < kp; i++)
            out[r * kp + i] = flip;
        qsum[r] = sum;
    }
}

#include <immintrin.h>

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void gemm_tile(const uint8_t *u, int64_t rows, int64_t kp, const int8_t *tile,
                      __m512i acc[4][4]) {
    for (int64_t r = 0; r < 4; r++)
        for (int64_t j = 0; j < 4; j++)
            acc[r][j] = _mm512_setzero_si512();
    for (int64_t g = 0; g < kp / 4; g++) {
        const int8_t *wp = tile + g * TILE * 4;
        const __m512i w0 = _mm512_loadu_si512((const void *)(wp));
        const __m512i w1 = _mm512_loadu_si512((const void *)(wp + 64));
        const __m512i w2 = _mm512_loadu_si512((const void *)(wp + 128));
        const __m512i w3 = _mm512_loadu_si512((const void *)(wp + 192));
        for (int64_t r = 0; r < rows; r++) {
            int32_t four;
            __builtin_memcpy(&four, u + r * kp + 4 * g, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
            acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], xb, w2);
            acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], xb, w3);
        }
    }
}

/* One tile's rows r0 .. r0 + rows - 1 of y from their int32 sums: what the unsigned
 * operand added comes off (int8: 128 * colsum, the activations were q + 128; int4, colsum
 * NULL: 8 * qsum, the weights were w + 8), then the zero points and both scales. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void dynamic_epilogue(__m512i acc[4][4], int64_t rows, int64_t r0, int64_t t,
                             int64_t n, const int32_t *colsum, const int32_t *qsum,
                             const float *x_scale, const float *w_scale,
                             const float *offset, float *y) {
    for (int64_t r = 0; r < rows; r++) {
        const __m512 sx = _mm512_set1_ps(x_scale[r0 + r]);
        const __m512 qs = _mm512_set1_ps((float)qsum[r0 + r]);
        const __m512i shift = _mm512_set1_epi32(8 * qsum[r0 + r]);
        for (int64_t j = 0; j < 4; j++) {
            const int64_t n0 = t * TILE + 16 * j;
            if (n0 >= n)
                break;
            const __mmask16 keep = n - n0 >= 16 ? (__mmask16)0xFFFF
                                                : (__mmask16)((1u << (n - n0)) - 1);
            const __m512i added = colsum ? _mm512_slli_epi32(
                _mm512_loadu_si512((const void *)(colsum + n0)), 7) : shift;
            __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], added));
            if (offset) {
                const __m512 off = _mm512_maskz_loadu_ps(keep, offset + n0);
                v = _mm512_fnmadd_ps(off, qs, v);
            }
            const __m512 ws = _mm512_maskz_loadu_ps(keep, w_scale + n0);
            v = _mm512_mul_ps(_mm512_mul_ps(v, sx), ws);
            _mm512_mask_storeu_ps(y + (r0 + r) * n + n0, keep, v);
        }
    }
}

/* y [m, n] float32 = the W8A8_DYNAMIC product of x [m, k] float32 and the packed weight
 * (per-channel scale w_scale [n], zero points offset [n] or NULL). work: m * k_pad bytes.
 * The output tiles are shared out over OpenMP's threads (torch's own runtime: the
 * libgomp torch loads is the one this library binds to), as many as torch uses. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void pdmesh_int8_linear(const float *x, int64_t m, int64_t k, int64_t n,
                        const int8_t *packed, const int32_t *colsum, const float *w_scale,
                        const float *offset, float *y, uint8_t *work, float *x_scale,
                        int32_t *qsum) {
    const int64_t kp = (k + 3) / 4 * 4, tiles = (n + TILE - 1) / TILE;
    quantize_rows(x, m, k, kp, work, x_scale, qsum, 0x80);
#pragma omp parallel for schedule(static) if (tiles >= 8)
    for (int64_t t = 0; t < tiles; t++) {
        __m512i acc[4][4];
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const int64_t rows = m - r0 < 4 ? m - r0 : 4;
            gemm_tile(work + r0 * kp, rows, kp, packed + t * (kp / 4) * TILE * 4, acc);
            dynamic_epilogue(acc, rows, r0, t, n, colsum, qsum, x_scale, w_scale, offset, y);
        }
    }
}

/* -- W4A8 dynamic: int4 weights, two to a byte, with AVX-512 VNNI ---------------------
 *
 * Weights are stored as unsigned nibbles u = w + 8 (0..15), so vpdpbusd takes them as
 * its unsigned operand and the activations (q, signed int8, not shifted) as its signed
 * one: sum_k u q = sum_k w q + 8 sum_k q, and 8 * qsum comes off in the epilogue. A tile
 * of 64 outputs keeps 8 consecutive k in 256 bytes: byte (lane, b) holds k = 8h + b in
 * its low nibble and k = 8h + 4 + b in its high one, half the int8 layout's bytes.
 */

/* w [K, N] int4 values in int8 -> packed [N_pad / 64][K_pad8 / 8][64][4] bytes. */
void pdmesh_int4_pack(const int8_t *w, int64_t k, int64_t n, uint8_t *packed) {
    const int64_t kp = (k + 7) / 8 * 8, np = (n + TILE - 1) / TILE * TILE;
    for (int64_t t = 0; t < np / TILE; t++)
        for (int64_t h = 0; h < kp / 8; h++)
            for (int64_t lane = 0; lane < TILE; lane++)
                for (int64_t b = 0; b < 4; b++) {
                    const int64_t nn = t * TILE + lane, k0 = 8 * h + b, k1 = k0 + 4;
                    const int lo = (k0 < k && nn < n) ? w[k0 * n + nn] + 8 : 8;
                    const int hi = (k1 < k && nn < n) ? w[k1 * n + nn] + 8 : 8;
                    packed[((t * (kp / 8) + h) * TILE + lane) * 4 + b] =
                        (uint8_t)((lo & 0x0F) | ((hi & 0x0F) << 4));
                }
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void gemm_tile_int4(const int8_t *q, int64_t rows, int64_t kp, const uint8_t *tile,
                           __m512i acc[4][4]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t r = 0; r < 4; r++)
        for (int64_t j = 0; j < 4; j++)
            acc[r][j] = _mm512_setzero_si512();
    for (int64_t h = 0; h < kp / 8; h++) {
        const uint8_t *wp = tile + h * TILE * 4;
        __m512i lo[4], hi[4];
        for (int64_t j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512((const void *)(wp + 64 * j));
            lo[j] = _mm512_and_si512(v, low);
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        for (int64_t r = 0; r < rows; r++) {
            int32_t first, second;
            __builtin_memcpy(&first, q + r * kp + 8 * h, 4);
            __builtin_memcpy(&second, q + r * kp + 8 * h + 4, 4);
            const __m512i x0 = _mm512_set1_epi32(first), x1 = _mm512_set1_epi32(second);
            for (int64_t j = 0; j < 4; j++) {
                acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], lo[j], x0);
                acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], hi[j], x1);
            }
        }
    }
}

/* y [m, n] float32 = the W4A8_DYNAMIC product of x [m, k] and the packed int4 weight.
 * work: m * k_pad8 bytes. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void pdmesh_int4_linear(const float *x, int64_t m, int64_t k, int64_t n,
                        const uint8_t *packed, const float *w_scale, const float *offset,
                        float *y, int8_t *work, float *x_scale, int32_t *qsum) {
    const int64_t kp = (k + 7) / 8 * 8, tiles = (n + TILE - 1) / TILE;
    quantize_rows(x, m, k, kp, (uint8_t *)work, x_scale, qsum, 0);
#pragma omp parallel for schedule(static) if (tiles >= 8)
    for (int64_t t = 0; t < tiles; t++) {
        __m512i acc[4][4];
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const int64_t rows = m - r0 < 4 ? m - r0 : 4;
            gemm_tile_int4(work + r0 * kp, rows, kp, packed + t * (kp / 8) * TILE * 4, acc);
            dynamic_epilogue(acc, rows, r0, t, n, NULL, qsum, x_scale, w_scale, offset, y);
        }
    }
}

/* -- W8A8 static: per-tensor activation scale and zero point ---------------------------
 * q = clamp(round(x * (1 / input_scale) + input_offset), -128, 127), as npu_quantize; the
 * same packed int8 weight and tiles as the dynamic kernel;
 *     y[r, n] = deq_scale[n] * (sum_k q[r, k] w[k, n] + quant_bias[n])              */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void pdmesh_int8_static_linear(const float *x, int64_t m, int64_t k, int64_t n,
                               const int8_t *packed, const int32_t *colsum, float inv_scale,
                               float in_offset, const int32_t *quant_bias,
                               const float *deq_scale, float *y, uint8_t *work) {
    const int64_t kp = (k + 3) / 4 * 4, tiles = (n + TILE - 1) / TILE;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < k; i++) {
            const float scaled = x[r * k + i] * inv_scale;
            float q = __builtin_nearbyintf(scaled + in_offset);
            q = q > 127.0f ? 127.0f : (q < -128.0f ? -128.0f : q);
            work[r * kp + i] = (uint8_t)((int32_t)q + 128);
        }
        for (int64_t i = k; i < kp; i++)
            work[r * kp + i] = 128;
    }
#pragma omp parallel for schedule(static) if (tiles >= 8)
    for (int64_t t = 0; t < tiles; t++) {
        __m512i acc[4][4];
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const int64_t rows = m - r0 < 4 ? m - r0 : 4;
            gemm_tile(work + r0 * kp, rows, kp, packed + t * (kp / 4) * TILE * 4, acc);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < 4; j++) {
                    const int64_t n0 = t * TILE + 16 * j;
                    if (n0 >= n)
                        break;
                    const __mmask16 keep = n - n0 >= 16 ? (__mmask16)0xFFFF
                                                        : (__mmask16)((1u << (n - n0)) - 1);
                    const __m512i cs = _mm512_loadu_si512((const void *)(colsum + n0));
                    const __m512i qb = _mm512_maskz_loadu_epi32(keep, quant_bias + n0);
                    const __m512i exact = _mm512_add_epi32(
                        _mm512_sub_epi32(acc[r][j], _mm512_slli_epi32(cs, 7)), qb);
                    const __m512 deq = _mm512_maskz_loadu_ps(keep, deq_scale + n0);
                    _mm512_mask_storeu_ps(y + (r0 + r) * n + n0, keep,
                                          _mm512_mul_ps(_mm512_cvtepi32_ps(exact), deq));
                }
        }
    }
}
