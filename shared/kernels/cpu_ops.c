/* Small CPU kernels for pdmesh's cpu backend, loaded with ctypes (shared/kernels/cpu.py).
 * Not a Python module: plain C functions on float32 buffers. Built by setup.py as an
 * optional extension; without a C compiler the backend runs the same math as torch ops.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* -- Paged decode attention ----------------------------------------------------------
 *
 * One new query token per sequence, over the keys and values its block table points to,
 * read from the paged caches [num_blocks, block_size, KVH, D]: no gathered copy of the
 * sequence, no padding to the longest one, no mask. The G query heads that share a KV
 * head go together, so each K / V row is read once for all of them. Online softmax a
 * chunk of up to 128 keys at a time (FlashAttention's recurrence): the chunk's scores,
 * the running maximum and sum rescaled, then the chunk's values accumulated. A float32 cache
 * is read in place, a chunk being rows of one block (rows a fixed stride apart); a
 * bfloat16 or float16 cache is widened, and an int8 one (a float32 scale per token and
 * head, [num_blocks, block_size, KVH, 1]) dequantized, a chunk at a time into the task's
 * scratch. MLA's absorbed form is the case KVH = 1 with the values the first vd dims of
 * the same rows.
 */

enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_F16 = 3 };

typedef struct {
    const float *q;              /* [B, H, D] float32, a head's D contiguous, heads D apart */
    const void *k, *v;           /* [num_blocks, block_size, KVH, D] / [..., VD_ROW] */
    const float *k_scale, *v_scale; /* int8 caches: [num_blocks, block_size, KVH, 1] */
    const int32_t *tables;       /* [B, table_stride] block ids */
    const int32_t *lens;         /* [B] keys of each sequence */
    float *out;                  /* [B, H, VD] float32 */
    int64_t b, h, kvh, d;        /* sequences, query heads, KV heads, key dims */
    int64_t v_row, vd;           /* the value cache's row length; values read (<= v_row) */
    int64_t block_size, table_stride;
    int64_t dtype;               /* KV_F32, KV_BF16, KV_INT8 or KV_F16 */
    int64_t q_stride;            /* floats from one sequence's query row to the next */
    int64_t portable;            /* 1: the portable path even where AVX-512 is (tests) */
    float scale;
} paged_decode_args;

/* Row `row` of a cache (row = slot * KVH + head, `n` numbers of a row of `len`) widened
 * or dequantized into buf (a float32 cache: copied). */
static inline void widen_row(const void *cache, const float *scales, int64_t dtype,
                             int64_t row, int64_t len, int64_t n, float *buf) {
    if (dtype == KV_F32) {
        const float *src = (const float *)cache + row * len;
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            buf[i] = src[i];
    } else if (dtype == KV_BF16) {
        const uint16_t *src = (const uint16_t *)cache + row * len;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            union { uint32_t u; float f; } c = {(uint32_t)src[i] << 16};
            buf[i] = c.f;
        }
    } else if (dtype == KV_F16) {
        const uint16_t *src = (const uint16_t *)cache + row * len;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            /* exponent and mantissa moved into place, then rebiased by 2^(127 - 15):
             * exact for normal and subnormal halves; infinities and NaNs kept */
            const uint32_t em = src[i] & 0x7fffu;
            union { uint32_t u; float f; } c = {em << 13};
            c.f *= 0x1.0p112f;
            if (em >= 0x7c00u)
                c.u |= 0x7f800000u;
            c.u |= (uint32_t)(src[i] & 0x8000u) << 16;
            buf[i] = c.f;
        }
    } else {
        const int8_t *src = (const int8_t *)cache + row * len;
        const float s = scales[row];
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            buf[i] = (float)src[i] * s;
    }
}

/* Keys the softmax update takes together at most (its reductions and rescaling are paid
 * once per chunk; a whole block of 128 read in place is one chunk, and the next block is
 * fetched while it is computed). 128 against 64, decode alone, 64 sequences x 1,000
 * keys: 11-13% less time with 8 / 2 x 32 heads (float32, bfloat16; 1 and 2 threads),
 * 1-3% with 16 / 2 x 128 and 8 / 8 x 64; prefill level; 32: 2-4% more. */
#define CHUNK_KEYS 128

/* A chunk of one KV head's keys: row t of K at element t * ks from k, of V at t * vs from
 * v, of `dtype` (a block's rows in the cache itself, or rows widened into scratch:
 * KV_F32); an int8 chunk's scales at t * ss from k_scale / v_scale; `pos`: its first
 * key's position in the sequence. */
typedef struct {
    const void *k, *v;
    const float *k_scale, *v_scale;
    int64_t ks, vs, ss, n, dtype, pos;
} kv_chunk;

/* A task's scratch: per query head the chunk's scores, an accumulator, the running
 * maximum, sum and last rescaling; then a chunk's K and V rows where they are widened.
 * `lim`: NULL, or per query row the keys it sees (a causal prefill row: the keys before
 * it and its own), for a chunk that some row stops inside. */
typedef struct {
    float *s, *acc, *m, *l, *alpha, *kbuf, *vbuf;
    const int64_t *lim;
} decode_scratch;

/* Floats of scratch a task needs. */
static int64_t decode_work(const paged_decode_args *a) {
    return a->h * (CHUNK_KEYS + a->vd + 3) + CHUNK_KEYS * (a->d + a->vd);
}

static decode_scratch scratch(const paged_decode_args *a, float *work) {
    decode_scratch w;
    w.s = work;
    w.acc = w.s + a->h * CHUNK_KEYS;
    w.m = w.acc + a->h * a->vd;
    w.l = w.m + a->h;
    w.alpha = w.l + a->h;
    w.kbuf = w.alpha + a->h;
    w.vbuf = w.kbuf + CHUNK_KEYS * a->d;
    w.lim = NULL;
    return w;
}

static void start_heads(const paged_decode_args *a, decode_scratch *w, int64_t j0,
                        int64_t j1) {
    for (int64_t j = j0; j < j1; j++) {
        w->m[j] = -INFINITY;
        w->l[j] = 0.0f;
        for (int64_t i = 0; i < a->vd; i++)
            w->acc[j * a->vd + i] = 0.0f;
    }
}

static void finish_heads(const paged_decode_args *a, const decode_scratch *w, int64_t seq,
                         int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++) {
        float *dst = a->out + (seq * a->h + j) * a->vd;
        const float inv = 1.0f / w->l[j];
        for (int64_t i = 0; i < a->vd; i++)
            dst[i] = w->acc[j * a->vd + i] * inv;
    }
}

/* Keys of chunk c that query row j sees (all n but where w->lim stops it inside). */
static inline int64_t seen(const decode_scratch *w, const kv_chunk *c, int64_t j) {
    if (w->lim == NULL)
        return c->n;
    const int64_t k = w->lim[j] - c->pos;
    return k < 0 ? 0 : k < c->n ? k : c->n;
}

/* One chunk of one KV head: its keys' scores for the G query heads j0.. of the head, the
 * running maxima and sums brought up to date, the values added into the accumulators.
 * Each ISA path is one of these, with the cache dtypes it reads in place. */
typedef void (*chunk_step)(const paged_decode_args *a, const decode_scratch *w,
                           const kv_chunk *c, const float *q, int64_t j0);

/* The portable path (any x86-64; AVX2 where the CPU has it, by target clones): float32
 * rows (the others are widened for it). */
__attribute__((target_clones("avx2", "default")))
static void chunk_portable(const paged_decode_args *a, const decode_scratch *w,
                           const kv_chunk *c, const float *q, int64_t j0) {
    const int64_t g = a->h / a->kvh, d = a->d, vd = a->vd, n = c->n;
    const float *kc = (const float *)c->k, *vc = (const float *)c->v;
    for (int64_t j = j0; j < j0 + g; j++) {
        const float *qj = q + j * d;
        float *sj = w->s + j * CHUNK_KEYS, *aj = w->acc + j * vd, top = w->m[j], sum = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            const float *k = kc + t * c->ks;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; i++)
                dot += qj[i] * k[i];
            sj[t] = dot * a->scale;
            top = sj[t] > top ? sj[t] : top;
        }
        const float alpha = expf(w->m[j] - top); /* 0 at the first chunk (m = -inf) */
        for (int64_t t = 0; t < n; t++) {
            sj[t] = expf(sj[t] - top);
            sum += sj[t];
        }
        w->l[j] = w->l[j] * alpha + sum;
        w->m[j] = top;
#pragma omp simd
        for (int64_t i = 0; i < vd; i++)
            aj[i] *= alpha;
        for (int64_t t = 0; t < n; t++) {
            const float pt = sj[t], *v = vc + t * c->vs;
#pragma omp simd
            for (int64_t i = 0; i < vd; i++)
                aj[i] += pt * v[i];
        }
    }
}

static int64_t dtype_bytes(int64_t dtype) {
    return dtype == KV_F32 ? 4 : dtype == KV_INT8 ? 1 : 2;
}

/* Keys [start, start + n) of KV head `head` where they lie in the cache: n within one
 * block (the caller's). */
static kv_chunk cache_chunk(const paged_decode_args *a, const int32_t *table, int64_t start,
                            int64_t n, int64_t head) {
    const int64_t bs = a->block_size, e = dtype_bytes(a->dtype);
    const int64_t row = ((int64_t)table[start / bs] * bs + start % bs) * a->kvh + head;
    const kv_chunk c = {(const char *)a->k + row * a->d * e,
                        (const char *)a->v + row * a->v_row * e,
                        a->k_scale ? a->k_scale + row : NULL,
                        a->v_scale ? a->v_scale + row : NULL,
                        a->kvh * a->d, a->kvh * a->v_row, a->kvh, n, a->dtype, start};
    return c;
}

/* Keys [start, start + n) of KV head `head` widened into the scratch as float32 (a
 * dtype the path does not read in place, or blocks under 16 keys). */
static kv_chunk widened_chunk(const paged_decode_args *a, const decode_scratch *w,
                              const int32_t *table, int64_t start, int64_t n,
                              int64_t head) {
    const int64_t bs = a->block_size;
    const int shared = a->k == a->v && a->v_row == a->d; /* MLA: values in the key rows */
    for (int64_t t = 0, pos = start; t < n; t++, pos++) {
        const int64_t row = ((int64_t)table[pos / bs] * bs + pos % bs) * a->kvh + head;
        widen_row(a->k, a->k_scale, a->dtype, row, a->d, a->d, w->kbuf + t * a->d);
        if (!shared)
            widen_row(a->v, a->v_scale, a->dtype, row, a->v_row, a->vd,
                      w->vbuf + t * a->vd);
    }
    const kv_chunk c = {w->kbuf, shared ? w->kbuf : w->vbuf, NULL, NULL,
                        a->d, shared ? a->d : a->vd, 0, n, KV_F32, start};
    return c;
}

/* KV heads [h0, h1) of a chunk at `start` asked of the memory system ahead of use (the
 * rows of those heads lie together, slot after slot). Inlined: a function of prefetches
 * alone is one GCC takes for side-effect free, and drops its calls. */
__attribute__((always_inline))
static inline void prefetch_chunk(const paged_decode_args *a, const int32_t *table, int64_t start,
                           int64_t n, int64_t h0, int64_t h1) {
    const kv_chunk c = cache_chunk(a, table, start, n, h0);
    const int64_t e = dtype_bytes(a->dtype), span = (n - 1) * a->kvh + (h1 - h0);
    const int shared = a->k == a->v;
    for (int64_t o = 0; o < span * a->d * e; o += 64)
        __builtin_prefetch((const char *)c.k + o, 0, 3);
    for (int64_t o = 0; !shared && o < span * a->v_row * e; o += 64)
        __builtin_prefetch((const char *)c.v + o, 0, 3);
}

/* The rows of KV head `head` alone of a chunk at `start` asked for ahead of use (a
 * prefill tile's: one head's rows lie KVH rows apart). */
__attribute__((always_inline))
static inline void prefetch_rows(const paged_decode_args *a, const int32_t *table,
                                 int64_t start, int64_t n, int64_t head) {
    const kv_chunk c = cache_chunk(a, table, start, n, head);
    const int64_t e = dtype_bytes(a->dtype);
    for (int64_t t = 0; t < n; t++) {
        for (int64_t o = 0; o < a->d * e; o += 64)
            __builtin_prefetch((const char *)c.k + t * c.ks * e + o, 0, 3);
        for (int64_t o = 0; c.k != c.v && o < a->vd * e; o += 64)
            __builtin_prefetch((const char *)c.v + t * c.vs * e + o, 0, 3);
    }
}

/* Keys of the chunk at `start`: up to CHUNK_KEYS, within one block when read in place. */
static int64_t chunk_len(const paged_decode_args *a, int64_t start, int64_t len,
                         int in_place) {
    int64_t n = len - start < CHUNK_KEYS ? len - start : CHUNK_KEYS;
    const int64_t in_block = a->block_size - start % a->block_size;
    return in_place && in_block < n ? in_block : n;
}

/* KV heads [h0, h1) of one sequence, a chunk at a time (all the task's heads of a chunk
 * before the next one, whose rows are fetched meanwhile). `in_place`: the step reads the
 * cache's dtype and blocks hold 16 keys or more; else chunks are widened into scratch. */
static void decode_task(const paged_decode_args *a, chunk_step step, int in_place,
                        int64_t seq, int64_t h0, int64_t h1, float *work) {
    const int64_t g = a->h / a->kvh, len = a->lens[seq];
    const int32_t *table = a->tables + seq * a->table_stride;
    const float *q = a->q + seq * a->q_stride; /* [H, d] */
    decode_scratch w = scratch(a, work);
    if (in_place && len > 0)
        prefetch_chunk(a, table, 0, chunk_len(a, 0, len, 1), h0, h1);
    start_heads(a, &w, h0 * g, h1 * g);
    for (int64_t start = 0, n; start < len; start += n) {
        n = chunk_len(a, start, len, in_place);
        if (in_place && start + n < len)
            prefetch_chunk(a, table, start + n, chunk_len(a, start + n, len, 1), h0, h1);
        for (int64_t head = h0; head < h1; head++) {
            const kv_chunk c = in_place ? cache_chunk(a, table, start, n, head)
                                        : widened_chunk(a, &w, table, start, n, head);
            step(a, &w, &c, q, head * g);
        }
    }
    finish_heads(a, &w, seq, h0 * g, h1 * g);
}

/* -- the AVX-512 path: 16 lanes, masked tails, exp as a polynomial in registers; float32,
 * bfloat16, float16 and int8 rows read in place, widened in registers -- */

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define AVX512_INLINE __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))

/* e^x for x <= 0 (a score less the running maximum): 2^n * p(r), x = n ln2 + r, with
 * Cephes' expf polynomial for p; ~1 ulp; below -87 it gives ~1e-38 rather than 0. */
AVX512_INLINE
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* The first `left` of 16 lanes (none when left <= 0). */
static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF
                      : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* 16 numbers of a row from element `at` of base as float32 (lanes outside mk: 0). */
AVX512_INLINE
static inline __m512 load16(const void *base, int64_t at, __mmask16 mk, const int64_t dtype,
                            const int full) {
    if (dtype == KV_F32)
        return full ? _mm512_loadu_ps((const float *)base + at)
                    : _mm512_maskz_loadu_ps(mk, (const float *)base + at);
    if (dtype == KV_INT8) {
        const __m128i b = full ? _mm_loadu_si128((const __m128i *)((const int8_t *)base + at))
                               : _mm_maskz_loadu_epi8(mk, (const int8_t *)base + at);
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    }
    const __m256i h = full ? _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at))
                           : _mm256_maskz_loadu_epi16(mk, (const uint16_t *)base + at);
    if (dtype == KV_F16)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Lane t of the result: the sum of v[t]'s 16 lanes (halves added, then quarters, then
 * a 4 x 4 transpose-add within each quarter; the lanes come out as 4c + m for vector
 * 4m + c, which the last permutation puts back). */
AVX512_INLINE
static inline __m512 sum16(const __m512 *v) {
    __m512 r[8], s[4];
    for (int k = 0; k < 8; k++)
        r[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; k++)
        s[k] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], 0xDD));
    const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(s[0], s[1]),
                                    _mm512_unpackhi_ps(s[0], s[1]));
    const __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(s[2], s[3]),
                                    _mm512_unpackhi_ps(s[2], s[3]));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(u0, u1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(u0, u1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512i back = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7,
                                           11, 15);
    return _mm512_permutexvar_ps(back, t);
}

/* q . k for 16 key rows k + t * ks (d numbers each): lane t. Sixteen dot
 * products in their own registers across d, summed across lanes together. `full`: 16
 * real rows and d a multiple of 16 (no masks); else rows from cnt on read nothing. */
AVX512_INLINE
static inline __m512 dots16(const float *q, const void *k, int64_t ks, int64_t d,
                            int64_t cnt, const int64_t dtype, const int full) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++)
        acc[t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 mk = full ? (__mmask16)0xFFFF : lanes(d - i);
        const __m512 qv = _mm512_maskz_loadu_ps(mk, q + i);
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) {
            const int64_t row = full || t < cnt ? t : 0;
            const __m512 kv = load16(k, row * ks + i, full || t < cnt ? mk : 0, dtype, full);
            acc[t] = _mm512_fmadd_ps(qv, kv, acc[t]);
        }
    }
    return sum16(acc);
}

/* acc[j] = acc[j] * alpha[j] + sum_t p[j][t] v[t] for HEADS query heads from j and the
 * VECS x 16 value dims from i: HEADS x VECS accumulators in registers, each V row piece
 * loaded once for all the heads. */
AVX512_INLINE
static inline void values_tile(const decode_scratch *w, const kv_chunk *c, int64_t vd,
                               int64_t j, int64_t i, const int64_t dtype, const int heads,
                               const int vecs) {
    __m512 acc[4][4];
    __mmask16 mv[4];
#pragma GCC unroll 4
    for (int u = 0; u < vecs; u++)
        mv[u] = lanes(vd - i - 16 * u);
#pragma GCC unroll 4
    for (int r = 0; r < heads; r++)
#pragma GCC unroll 4
        for (int u = 0; u < vecs; u++)
            acc[r][u] = _mm512_mul_ps(
                _mm512_maskz_loadu_ps(mv[u], w->acc + (j + r) * vd + i + 16 * u),
                _mm512_set1_ps(w->alpha[j + r]));
    for (int64_t t = 0; t < c->n; t++) {
        __m512 vt[4];
#pragma GCC unroll 4
        for (int u = 0; u < vecs; u++)
            vt[u] = load16(c->v, t * c->vs + i + 16 * u, mv[u], dtype, 0);
#pragma GCC unroll 4
        for (int r = 0; r < heads; r++) {
            const __m512 p = _mm512_set1_ps(w->s[(j + r) * CHUNK_KEYS + t]);
#pragma GCC unroll 4
            for (int u = 0; u < vecs; u++)
                acc[r][u] = _mm512_fmadd_ps(p, vt[u], acc[r][u]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < heads; r++)
#pragma GCC unroll 4
        for (int u = 0; u < vecs; u++)
            _mm512_mask_storeu_ps(w->acc + (j + r) * vd + i + 16 * u, mv[u], acc[r][u]);
}

/* The scores of the chunk's keys for query heads [j0, j0 + g), scaled (an int8 chunk's
 * by its keys' scales too), into w->s. */
AVX512_INLINE
static inline void chunk_scores(const paged_decode_args *a, const decode_scratch *w,
                                const kv_chunk *c, const float *q, int64_t j0, int64_t g,
                                const int64_t dtype) {
    const int64_t d = a->d, n = c->n;
    for (int64_t t0 = 0; t0 < n; t0 += 16) { /* 16 keys, every head's scores for them */
        const int64_t cnt = n - t0 < 16 ? n - t0 : 16;
        __m512 scale = _mm512_set1_ps(a->scale);
        if (dtype == KV_INT8)
            scale = _mm512_mul_ps(scale, _mm512_mask_i32gather_ps(
                _mm512_setzero_ps(), lanes(cnt),
                _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                     12, 13, 14, 15),
                                   _mm512_set1_epi32((int)c->ss)),
                c->k_scale + t0 * c->ss, 4));
        const void *k = (const char *)c->k + t0 * c->ks * dtype_bytes(dtype);
        for (int64_t j = j0; j < j0 + g; j++) {
            const __m512 dots = cnt == 16 && (d & 15) == 0
                                    ? dots16(q + j * d, k, c->ks, d, 16, dtype, 1)
                                    : dots16(q + j * d, k, c->ks, d, cnt, dtype, 0);
            _mm512_mask_storeu_ps(w->s + j * CHUNK_KEYS + t0, lanes(cnt),
                                  _mm512_mul_ps(dots, scale));
        }
    }
}

/* The running maximum and sum of heads [j0, j0 + g) brought up to date with the chunk's
 * n scores, which become their exponentials (times an int8 chunk's value scales: the
 * weights its values are added with). */
AVX512_INLINE
static inline void chunk_softmax(const decode_scratch *w, const kv_chunk *c, int64_t j0,
                                 int64_t g) {
    const int64_t n = c->n;
    for (int64_t j = j0; j < j0 + g; j++) {
        float *sj = w->s + j * CHUNK_KEYS;
        const int64_t nv = seen(w, c, j); /* (the scores past it weigh 0) */
        __m512 top16 = _mm512_set1_ps(w->m[j]);
        for (int64_t t = 0; t < nv; t += 16)
            top16 = _mm512_mask_max_ps(top16, lanes(nv - t), top16,
                                       _mm512_maskz_loadu_ps(lanes(nv - t), sj + t));
        const float top = _mm512_reduce_max_ps(top16);
        const float alpha = expf(w->m[j] - top); /* 0 at the first chunk (m = -inf) */
        __m512 total = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 mt = lanes(n - t), mv = lanes(nv - t);
            const __m512 e = _mm512_maskz_mov_ps(
                mv, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mt, sj + t),
                                         _mm512_set1_ps(top))));
            _mm512_mask_storeu_ps(sj + t, mt, e);
            total = _mm512_add_ps(total, e);
        }
        w->l[j] = w->l[j] * alpha + _mm512_reduce_add_ps(total);
        w->m[j] = top;
        w->alpha[j] = alpha;
    }
    if (c->dtype == KV_INT8)
        for (int64_t t = 0; t < n; t++)
            for (int64_t j = j0; j < j0 + g; j++)
                w->s[j * CHUNK_KEYS + t] *= c->v_scale[t * c->ss];
}

/* A chunk of one dtype: scores, softmax, then the values four heads x 32 dims at a time
 * (a head left over: 64 dims at a time). */
AVX512_INLINE
static inline void chunk_typed(const paged_decode_args *a, const decode_scratch *w,
                               const kv_chunk *c, const float *q, int64_t j0,
                               const int64_t dtype) {
    const int64_t g = a->h / a->kvh, vd = a->vd;
    chunk_scores(a, w, c, q, j0, g, dtype);
    chunk_softmax(w, c, j0, g);
    int64_t j = j0;
    for (; j + 4 <= j0 + g; j += 4)
        for (int64_t i = 0; i < vd; i += 32)
            values_tile(w, c, vd, j, i, dtype, 4, 2);
    for (; j < j0 + g; j++)
        for (int64_t i = 0; i < vd; i += 64)
            values_tile(w, c, vd, j, i, dtype, 1, 4);
}

/* The chunk's rows as float32 in the scratch (an int8 chunk's scaled), each widened once
 * for all the heads that read it. */
AVX512_INLINE
static inline kv_chunk widen_typed(const paged_decode_args *a, const decode_scratch *w,
                                   const kv_chunk *c, const int64_t dtype) {
    const int shared = c->k == c->v;
    for (int64_t t = 0; t < c->n; t++) {
        const __m512 ks = _mm512_set1_ps(dtype == KV_INT8 ? c->k_scale[t * c->ss] : 1.0f);
        for (int64_t i = 0; i < a->d; i += 16) {
            const __mmask16 mk = lanes(a->d - i);
            _mm512_mask_storeu_ps(w->kbuf + t * a->d + i, mk,
                                  _mm512_mul_ps(load16(c->k, t * c->ks + i, mk, dtype, 0), ks));
        }
        if (shared)
            continue;
        const __m512 vs = _mm512_set1_ps(dtype == KV_INT8 ? c->v_scale[t * c->ss] : 1.0f);
        for (int64_t i = 0; i < a->vd; i += 16) {
            const __mmask16 mv = lanes(a->vd - i);
            _mm512_mask_storeu_ps(w->vbuf + t * a->vd + i, mv,
                                  _mm512_mul_ps(load16(c->v, t * c->vs + i, mv, dtype, 0), vs));
        }
    }
    const kv_chunk f = {w->kbuf, shared ? w->kbuf : w->vbuf, NULL, NULL,
                        a->d, shared ? a->d : a->vd, 0, c->n, KV_F32, c->pos};
    return f;
}

/* Query heads per KV head above which a chunk of bfloat16 / float16 / int8 rows is
 * widened into scratch first (below it, widening in registers as each head reads a row
 * costs less than the copy). */
#ifndef WIDEN_ABOVE_G
#define WIDEN_ABOVE_G 8
#endif

AVX512
static void chunk_avx512(const paged_decode_args *a, const decode_scratch *w,
                         const kv_chunk *c, const float *q, int64_t j0) {
    if (c->dtype != KV_F32 && a->h / a->kvh > WIDEN_ABOVE_G) {
        kv_chunk f;
        switch (c->dtype) {
        case KV_BF16: f = widen_typed(a, w, c, KV_BF16); break;
        case KV_F16: f = widen_typed(a, w, c, KV_F16); break;
        default: f = widen_typed(a, w, c, KV_INT8); break;
        }
        chunk_typed(a, w, &f, q, j0, KV_F32);
        return;
    }
    switch (c->dtype) {
    case KV_F32: chunk_typed(a, w, c, q, j0, KV_F32); break;
    case KV_BF16: chunk_typed(a, w, c, q, j0, KV_BF16); break;
    case KV_F16: chunk_typed(a, w, c, q, j0, KV_F16); break;
    default: chunk_typed(a, w, c, q, j0, KV_INT8); break;
    }
}

/* The AVX-512 chunk steps run here (not asked for the portable ones, the CPU has them). */
static int avx512_path(int64_t portable) {
    __builtin_cpu_init();
    return !portable && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

/* Tasks shared out over OpenMP's threads (torch's pool): a sequence each when there are
 * twice as many as threads, else a (sequence, KV head) each. Returns 0, or -1 when a
 * thread's scratch could not be allocated (out not written). */
int pdmesh_paged_decode(const paged_decode_args *a) {
    const int64_t per_seq = a->b >= 2 * omp_get_max_threads();
    const int64_t tasks = per_seq ? a->b : a->b * a->kvh, need = decode_work(a);
    const int avx512 = avx512_path(a->portable);
    const chunk_step step = avx512 ? chunk_avx512 : chunk_portable;
    const int in_place = a->block_size >= 16 && (avx512 || a->dtype == KV_F32);
    int failed = 0;
#pragma omp parallel if (tasks > 1) reduction(| : failed)
    {
        float *work = (float *)malloc((size_t)need * sizeof(float));
        failed = work == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (work == NULL)
                continue;
            if (per_seq)
                decode_task(a, step, in_place, t, 0, a->kvh, work);
            else
                decode_task(a, step, in_place, t / a->kvh, t % a->kvh, t % a->kvh + 1,
                            work);
        }
        free(work);
    }
    return failed ? -1 : 0;
}

/* -- prompt chunks after their context ------------------------------------------------
 *
 * Chunked prefill, a prompt whose prefix was cached, speculative verification: query i
 * of a sequence with `len` keys and `ql` queries sees keys [0, len - ql + i] (causal; its
 * own K / V are in the cache already). A task is a tile of a sequence's consecutive
 * queries for one KV head: their query heads of that KV head, about PREFILL_ROWS rows,
 * go through the decode chunk steps as one KV head's query heads would, so each K / V
 * chunk is read from the cache once for the whole tile; in the chunks where some row's
 * keys end, the keys past its own weigh nothing.
 */
#ifndef PREFILL_ROWS
#define PREFILL_ROWS 64
#endif

typedef struct {
    paged_decode_args base; /* q [T, H, D] (rows q_stride apart), out [T, H, VD]; b, tables
                             * and lens: the listed sequences */
    const int32_t *qstart;  /* [b] each listed sequence's first row of q and out */
    const int32_t *qlens;   /* [b] its queries */
} paged_prefill_args;

/* Queries a tile takes. */
static int64_t tile_queries(const paged_decode_args *a) {
    const int64_t g = a->h / a->kvh;
    return g >= PREFILL_ROWS ? 1 : PREFILL_ROWS / g;
}

/* A tile of `rows` query rows as the chunk steps see them: one KV head's query heads. */
static paged_decode_args tile_view(const paged_decode_args *a, int64_t rows) {
    paged_decode_args v = *a;
    v.h = rows;
    v.kvh = 1;
    return v;
}

/* A tile's query rows rounded up to whole vectors of 16 (the AVX-512 path's lanes). */
static int64_t tile_lanes(int64_t rows) {
    return (rows + 15) / 16 * 16;
}

/* Floats of scratch a task needs, for either path: each row's key limit (an int64_t, two
 * floats' room), then the chunk steps' scratch and the tile's query rows (portable), or
 * the AVX-512 path's transposed tiles (prefill_tile_avx512). */
static int64_t prefill_work(const paged_decode_args *a) {
    const int64_t rows = tile_queries(a) * (a->h / a->kvh), lanes16 = tile_lanes(rows);
    const paged_decode_args v = tile_view(a, rows);
    const int64_t portable = decode_work(&v) + rows * a->d;
    const int64_t avx512 = (a->d + CHUNK_KEYS + a->vd + 3) * lanes16
                           + CHUNK_KEYS * (a->d + a->vd);
    return 2 * lanes16 + (portable > avx512 ? portable : avx512);
}

/* The keys a task's tile reads (its last query's), and the key limit of each of its
 * rows (row r: query p0 + r / g); pad rows up to `upto` see every key. */
static int64_t tile_limits(const paged_prefill_args *p, int64_t seq, int64_t p0, int64_t p1,
                           int64_t upto, int64_t *lim) {
    const paged_decode_args *a = &p->base;
    const int64_t g = a->h / a->kvh, ctx = a->lens[seq] - p->qlens[seq];
    for (int64_t r = 0; r < upto; r++)
        lim[r] = r < (p1 - p0) * g ? ctx + p0 + r / g + 1 : ctx + p1;
    return ctx + p1;
}

/* A tile of few rows (under LANES_FROM_ROWS): queries [p0, p1) of listed sequence `seq`,
 * KV head `head`, through the decode kernel's AVX-512 chunk steps. */
static void prefill_task(const paged_prefill_args *p, int in_place, int64_t seq,
                         int64_t head, int64_t p0, int64_t p1, float *work) {
    const paged_decode_args *a = &p->base;
    const int64_t g = a->h / a->kvh, d = a->d, vd = a->vd, rows = (p1 - p0) * g;
    const int32_t *table = a->tables + seq * a->table_stride;
    const paged_decode_args v = tile_view(a, rows);
    int64_t *lim = (int64_t *)work;
    const int64_t keys = tile_limits(p, seq, p0, p1, rows, lim);
    decode_scratch w = scratch(&v, work + 2 * tile_lanes(rows));
    float *q = (float *)w.vbuf + CHUNK_KEYS * vd; /* [rows, d]: query i's heads, i + 1's */
    for (int64_t r = 0; r < rows; r++)
        memcpy(q + r * d, a->q + (p->qstart[seq] + p0 + r / g) * a->q_stride
                              + (head * g + r % g) * d, (size_t)d * sizeof(float));
    start_heads(&v, &w, 0, rows);
    const int64_t every_row = lim[0]; /* keys the tile's first row sees, and so all */
    if (in_place && keys > 0)
        prefetch_chunk(a, table, 0, chunk_len(a, 0, keys, 1), head, head + 1);
    for (int64_t start = 0, n; start < keys; start += n) {
        n = chunk_len(a, start, keys, in_place);
        if (in_place && start + n < keys)
            prefetch_chunk(a, table, start + n, chunk_len(a, start + n, keys, 1), head,
                           head + 1);
        const kv_chunk c = in_place ? cache_chunk(a, table, start, n, head)
                                    : widened_chunk(a, &w, table, start, n, head);
        w.lim = start + n > every_row ? lim : NULL;
        chunk_avx512(&v, &w, &c, q, 0);
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = a->out + ((p->qstart[seq] + p0 + r / g) * a->h + head * g + r % g) * vd;
        const float inv = 1.0f / w.l[r];
        for (int64_t i = 0; i < vd; i++)
            dst[i] = w.acc[r * vd + i] * inv;
    }
}

/* -- the AVX-512 path: the tile's rows in the lanes ---------------------------------
 * The tile's queries transposed, qt [d][L] (L: rows rounded up to 16, scaled by the
 * softmax scale), so a chunk's scores are st [t][L] = sum_i k[t][i] qt[i][*]: a key's
 * number broadcast against 16 rows at a time, no reduction across lanes; the running
 * maximum, sum and the output ot [vd][L] are per row, so the softmax is 16 rows a vector
 * too. K / V rows are read in place (float32) or widened a chunk at a time. */

/* st[t][c..] for keys [t0, t0 + KB) and row vectors [c, c + RV x 16). (tile_values below
 * is the same outer product with the roles turned; one function for both, its strides
 * given at run time, measured 1.2-1.3x slower: GCC kept the rows' pointers in memory.) */
AVX512_INLINE
static inline void tile_scores(const kv_chunk *c, const float *qt, int64_t d, int64_t l,
                               float *st, int64_t t0, int64_t col, const int kb,
                               const int rv) {
    __m512 acc[4][4];
    const float *k[4];
#pragma GCC unroll 4
    for (int t = 0; t < kb; t++) {
        k[t] = (const float *)c->k + (t0 + t) * c->ks;
#pragma GCC unroll 4
        for (int u = 0; u < rv; u++)
            acc[t][u] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < d; i++) {
        __m512 q[4];
#pragma GCC unroll 4
        for (int u = 0; u < rv; u++)
            q[u] = _mm512_loadu_ps(qt + i * l + col + 16 * u);
#pragma GCC unroll 4
        for (int t = 0; t < kb; t++) {
            const __m512 kt = _mm512_set1_ps(k[t][i]);
#pragma GCC unroll 4
            for (int u = 0; u < rv; u++)
                acc[t][u] = _mm512_fmadd_ps(kt, q[u], acc[t][u]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < kb; t++)
#pragma GCC unroll 4
        for (int u = 0; u < rv; u++)
            _mm512_storeu_ps(st + (t0 + t) * l + col + 16 * u, acc[t][u]);
}

/* ot[i..][c..] = ot * alpha + sum_t v[t][i] st[t][c..] for value dims [i0, i0 + DB) and
 * row vectors [c, c + RV x 16). */
AVX512_INLINE
static inline void tile_values(const kv_chunk *c, const float *st, const float *alpha,
                               int64_t l, float *ot, int64_t i0, int64_t col, const int db,
                               const int rv) {
    __m512 acc[4][4], al[4];
#pragma GCC unroll 4
    for (int u = 0; u < rv; u++)
        al[u] = _mm512_loadu_ps(alpha + col + 16 * u);
#pragma GCC unroll 4
    for (int i = 0; i < db; i++)
#pragma GCC unroll 4
        for (int u = 0; u < rv; u++)
            acc[i][u] = _mm512_mul_ps(_mm512_loadu_ps(ot + (i0 + i) * l + col + 16 * u), al[u]);
    const float *v = (const float *)c->v + i0;
    for (int64_t t = 0; t < c->n; t++, v += c->vs) {
        __m512 p[4];
#pragma GCC unroll 4
        for (int u = 0; u < rv; u++)
            p[u] = _mm512_loadu_ps(st + t * l + col + 16 * u);
#pragma GCC unroll 4
        for (int i = 0; i < db; i++) {
            const __m512 vi = _mm512_set1_ps(v[i]);
#pragma GCC unroll 4
            for (int u = 0; u < rv; u++)
                acc[i][u] = _mm512_fmadd_ps(vi, p[u], acc[i][u]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < db; i++)
#pragma GCC unroll 4
        for (int u = 0; u < rv; u++)
            _mm512_storeu_ps(ot + (i0 + i) * l + col + 16 * u, acc[i][u]);
}

/* The row vectors [col, col + rv x 16) of a chunk: scores, softmax, values. */
AVX512_INLINE
static inline void tile_chunk(const kv_chunk *c, const float *qt, int64_t d, int64_t vd,
                              int64_t l, float *st, float *ot, float *m, float *sum,
                              float *alpha, const int32_t *lim, int64_t col, const int rv) {
    const int64_t n = c->n;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4)
        tile_scores(c, qt, d, l, st, t, col, 4, rv);
    for (; t < n; t++)
        tile_scores(c, qt, d, l, st, t, col, 1, rv);
    for (int u = 0; u < rv; u++) {
        const int64_t at = col + 16 * u;
        const __m512i lim16 = _mm512_loadu_si512(lim + at);
        const __m512 old = _mm512_loadu_ps(m + at);
        __m512 top = old;
        for (t = 0; t < n; t++) {
            const __mmask16 seen = _mm512_cmpgt_epi32_mask(lim16,
                                                           _mm512_set1_epi32((int)(c->pos + t)));
            top = _mm512_mask_max_ps(top, seen, top, _mm512_loadu_ps(st + t * l + at));
        }
        __m512 total = _mm512_setzero_ps();
        for (t = 0; t < n; t++) {
            const __mmask16 seen = _mm512_cmpgt_epi32_mask(lim16,
                                                           _mm512_set1_epi32((int)(c->pos + t)));
            const __m512 e = _mm512_maskz_mov_ps(
                seen, exp512(_mm512_sub_ps(_mm512_loadu_ps(st + t * l + at), top)));
            _mm512_storeu_ps(st + t * l + at, e);
            total = _mm512_add_ps(total, e);
        }
        /* (the first chunk: old is -inf, alpha ~0 against an accumulator of 0) */
        const __m512 a16 = exp512(_mm512_sub_ps(old, top));
        _mm512_storeu_ps(alpha + at, a16);
        _mm512_storeu_ps(sum + at, _mm512_fmadd_ps(_mm512_loadu_ps(sum + at), a16, total));
        _mm512_storeu_ps(m + at, top);
    }
    int64_t i = 0;
    for (; i + 4 <= vd; i += 4)
        tile_values(c, st, alpha, l, ot, i, col, 4, rv);
    for (; i < vd; i++)
        tile_values(c, st, alpha, l, ot, i, col, 1, rv);
}

AVX512
static void prefill_task_avx512(const paged_prefill_args *p, int64_t seq, int64_t head,
                                int64_t p0, int64_t p1, float *work) {
    const paged_decode_args *a = &p->base;
    const int64_t g = a->h / a->kvh, d = a->d, vd = a->vd, rows = (p1 - p0) * g;
    const int64_t l = tile_lanes(rows);
    const int32_t *table = a->tables + seq * a->table_stride;
    int64_t *lim64 = (int64_t *)work;
    const int64_t keys = tile_limits(p, seq, p0, p1, l, lim64);
    int32_t *lim = (int32_t *)lim64; /* (narrowed in place: a key count fits) */
    for (int64_t r = 0; r < l; r++)
        lim[r] = (int32_t)lim64[r];
    float *qt = work + 2 * l, *st = qt + d * l, *ot = st + CHUNK_KEYS * l, *m = ot + vd * l;
    float *sum = m + l, *alpha = sum + l;
    decode_scratch w = {0};
    w.kbuf = alpha + l;
    w.vbuf = w.kbuf + CHUNK_KEYS * d;
    for (int64_t r = 0; r < l; r++) {
        const float *src = a->q + (p->qstart[seq] + p0 + r / g) * a->q_stride
                           + (head * g + r % g) * d;
        for (int64_t i = 0; i < d; i++)
            qt[i * l + r] = r < rows ? src[i] * a->scale : 0.0f;
        m[r] = -INFINITY;
        sum[r] = 0.0f;
    }
    memset(ot, 0, (size_t)(vd * l) * sizeof(float));
    /* float32 rows read in place; others widened a block's chunk at a time (blocks
     * under 16 keys: gathered into chunks of CHUNK_KEYS) */
    const int by_block = a->block_size >= 16, in_place = by_block && a->dtype == KV_F32;
    for (int64_t start = 0, n; start < keys; start += n) {
        n = chunk_len(a, start, keys, by_block);
        if (in_place && start + n < keys)
            prefetch_rows(a, table, start + n, chunk_len(a, start + n, keys, 1), head);
        kv_chunk c = cache_chunk(a, table, start, n, head);
        if (!by_block) {
            c = widened_chunk(a, &w, table, start, n, head);
        } else if (!in_place) {
            if (a->dtype == KV_BF16)
                c = widen_typed(a, &w, &c, KV_BF16);
            else if (a->dtype == KV_F16)
                c = widen_typed(a, &w, &c, KV_F16);
            else
                c = widen_typed(a, &w, &c, KV_INT8);
        }
        int64_t col = 0;
        for (; col + 64 <= l; col += 64)
            tile_chunk(&c, qt, d, vd, l, st, ot, m, sum, alpha, lim, col, 4);
        for (; col < l; col += 16)
            tile_chunk(&c, qt, d, vd, l, st, ot, m, sum, alpha, lim, col, 1);
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = a->out + ((p->qstart[seq] + p0 + r / g) * a->h + head * g + r % g) * vd;
        const float inv = 1.0f / sum[r];
        for (int64_t i = 0; i < vd; i++)
            dst[i] = ot[i * l + r] * inv;
    }
}

/* Rows from which a tile goes through the AVX-512 path's lanes (fewer: a few queries of
 * few query heads, as speculative verification's, which would leave most of 16 lanes
 * empty, take the decode chunk steps; measured: 8 rows 0.8-1.2x the decode rows' time,
 * 4 rows 1.4-1.6x, 16 rows 0.5-0.6x). */
#ifndef LANES_FROM_ROWS
#define LANES_FROM_ROWS 12
#endif

/* The CPU runs this kernel (AVX-512: its lanes path; without it, the decode chunk steps
 * alone measured 2.7-5x torch's SDPA, so the caller keeps torch's path there). */
int pdmesh_paged_prefill_supported(void) {
    return avx512_path(0);
}

/* Tasks over OpenMP's threads, each tile's KV heads one after another, a sequence's last
 * tiles (most keys) first. Returns 0, -1 when scratch could not be allocated, or -2 on a
 * CPU without AVX-512 (pdmesh_paged_prefill_supported); out not written then. */
int pdmesh_paged_prefill(const paged_prefill_args *p) {
    const paged_decode_args *a = &p->base;
    if (!avx512_path(0))
        return -2;
    const int64_t tq = tile_queries(a), need = prefill_work(a);
    int64_t *first = (int64_t *)malloc((size_t)(a->b + 1) * sizeof(int64_t));
    if (first == NULL)
        return -1;
    first[0] = 0; /* task numbers of each sequence's tiles */
    for (int64_t s = 0; s < a->b; s++)
        first[s + 1] = first[s] + (p->qlens[s] + tq - 1) / tq * a->kvh;
    const int64_t tasks = first[a->b];
    const int in_place = a->block_size >= 16;
    int failed = 0;
#pragma omp parallel if (tasks > 1) reduction(| : failed)
    {
        float *work = (float *)malloc((size_t)need * sizeof(float));
        failed = work == NULL;
        int64_t seq = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (work == NULL)
                continue;
            while (t >= first[seq + 1] || t < first[seq]) /* (dynamic: t only grows) */
                seq = t >= first[seq + 1] ? seq + 1 : 0;
            const int64_t k = t - first[seq], tiles = (first[seq + 1] - first[seq]) / a->kvh;
            const int64_t p0 = (tiles - 1 - k / a->kvh) * tq;
            const int64_t p1 = p0 + tq < p->qlens[seq] ? p0 + tq : p->qlens[seq];
            if ((p1 - p0) * (a->h / a->kvh) >= LANES_FROM_ROWS)
                prefill_task_avx512(p, seq, k % a->kvh, p0, p1, work);
            else
                prefill_task(p, in_place, seq, k % a->kvh, p0, p1, work);
        }
        free(work);
    }
    free(first);
    return failed ? -1 : 0;
}

/* -- DeepSeek-V4's decode attention --------------------------------------------------
 *
 * One query token per sequence over keys that are also the values (one shared K = V
 * head, the model's D), listed row by row: a sequence's window keys, then the compressed
 * entries its indexer chose, each a row of its cache ([N, D] rows: float32, bfloat16,
 * float16, or int8 with a float32 scale per row), -1 where the query does not see it. A
 * learned sink logit per head joins each softmax and carries no value. The rows are
 * widened a chunk at a time into scratch (they lie anywhere) and go through the same
 * chunk steps as the paged kernel, every head of the task together.
 */

typedef struct {
    const void *rows;      /* [N, D] cache rows */
    const float *scales;   /* int8: [N] */
    const int64_t *slots;  /* [B, n] the row of each listed key, -1: not seen */
    int64_t n;             /* keys listed per sequence */
} slot_source;

typedef struct {
    const float *q;        /* [B, H, D] float32 */
    slot_source src[2];
    int64_t nsrc;
    const float *sinks;    /* [H] float32 */
    float *out;            /* [B, H, D] float32 */
    int64_t b, h, d, dtype, portable;
    float scale;
} sink_decode_args;

/* The chunk steps' view of `heads` query heads over one K = V head of a->d dims. */
static paged_decode_args sink_view(const sink_decode_args *a, int64_t heads) {
    paged_decode_args v = {0};
    v.h = heads;
    v.kvh = 1;
    v.d = v.v_row = v.vd = a->d;
    v.dtype = KV_F32;
    v.scale = a->scale;
    return v;
}

/* Query heads [j0, j1) of one sequence. */
static void sink_task(const sink_decode_args *a, chunk_step step, int64_t seq, int64_t j0,
                      int64_t j1, float *work) {
    const int64_t d = a->d, g = j1 - j0;
    const paged_decode_args v = sink_view(a, g);
    decode_scratch w = scratch(&v, work);
    start_heads(&v, &w, 0, g);
    const float *q = a->q + (seq * a->h + j0) * d;
    for (int64_t s = 0; s < a->nsrc; s++) {
        const slot_source *src = &a->src[s];
        const int64_t *slots = src->slots + seq * src->n;
        for (int64_t i = 0; i < src->n;) {
            int64_t n = 0;
            for (; n < CHUNK_KEYS && i < src->n; i++)
                if (slots[i] >= 0)
                    widen_row(src->rows, src->scales, a->dtype, slots[i], d, d,
                              w.kbuf + n++ * d);
            if (n == 0)
                continue;
            const kv_chunk c = {w.kbuf, w.kbuf, NULL, NULL, d, d, 0, n, KV_F32};
            step(&v, &w, &c, q, 0);
        }
    }
    for (int64_t j = 0; j < g; j++) { /* the sink joins the denominator */
        const float m = w.m[j], sink = a->sinks[j0 + j], top = m > sink ? m : sink;
        const float keep = expf(m - top); /* 0 when no key was seen (m = -inf) */
        const float inv = keep / (w.l[j] * keep + expf(sink - top));
        float *dst = a->out + (seq * a->h + j0 + j) * d;
        for (int64_t i = 0; i < d; i++)
            dst[i] = w.acc[j * d + i] * inv;
    }
}

/* Tasks over OpenMP's threads: a sequence each when there are twice as many as threads,
 * else the heads split so every thread has some. Returns 0, or -1 when a thread's
 * scratch could not be allocated (out not written). */
int pdmesh_sink_decode(const sink_decode_args *a) {
    const int64_t threads = omp_get_max_threads();
    int64_t parts = a->b >= 2 * threads ? 1 : (2 * threads + a->b - 1) / a->b;
    parts = parts > a->h ? a->h : parts;
    const int64_t per = (a->h + parts - 1) / parts, tasks = a->b * parts;
    const paged_decode_args most = sink_view(a, per); /* (the largest task's scratch) */
    const int64_t need = decode_work(&most);
    const int avx512 = avx512_path(a->portable);
    const chunk_step step = avx512 ? chunk_avx512 : chunk_portable;
    int failed = 0;
#pragma omp parallel if (tasks > 1) reduction(| : failed)
    {
        float *work = (float *)malloc((size_t)need * sizeof(float));
        failed = work == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t j0 = (t % parts) * per, j1 = j0 + per < a->h ? j0 + per : a->h;
            if (work != NULL && j0 < j1)
                sink_task(a, step, t / parts, j0, j1, work);
        }
        free(work);
    }
    return failed ? -1 : 0;
}
