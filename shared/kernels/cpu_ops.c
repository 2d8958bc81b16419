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
