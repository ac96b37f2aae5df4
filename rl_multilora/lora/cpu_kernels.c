/* The LoRA's rank-wide products on an x86-64 CPU (AVX2 + FMA), float32: `rl_multilora/lora/cpu_kernels.py` builds
 * this file with the system's C compiler on first use and calls it through ctypes.
 *
 * Every product of a LoRA Linear is thin (one side is the rank, 8 to 64 wide), where the BLAS kernels run at a third
 * to a half of the base GEMM's rate on a CPU core. These kernels keep the rank-wide side in registers and stream the
 * activation once, in the layouts the caller passes:
 *
 *   shrink: z[t, :] = s * x[t, :] @ w           x (T, K), w (K, R)   (the LoRA's x @ A.T, and grad @ B)
 *   expand: y[t, :] += z[t, :] @ v              z (T, R), v (R, O)   (xa @ B.T into the output, g_xa @ A into dx)
 *   outer:  g[:, c] += z.T @ x[:, c]            z (T, R), x (T, K)   (the weight gradients, column range c)
 *
 * R is a multiple of 8 (the caller zero-pads a lower rank: zeros add exact zeros). Rows of a batch use their own
 * slot's weights (`idx`: each row's index into the per-slot arrays) and scale. Every output value is a fixed sequence
 * of fused multiply-adds (shrink: over k in order; expand: over the rank in order, starting from y; outer: over the
 * batch's tokens in order), whatever the thread count, the row's length or the rows around it: a tenant's numbers
 * do not follow who shares its batch. Threads (OpenMP) split tokens (the forward) or columns (the backward), never a
 * sum.
 */
#include <immintrin.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>

/* z[t, j] = s * sum_k x[t, k] * w[k, j] for tokens [t0, t1) of one row; w (K, R), R % 8 == 0. */
static void shrink_rows(const float *x, const float *w, float *z, long t0, long t1, long K, long R, float s) {
    const __m256 vs = _mm256_set1_ps(s);
    for (long j0 = 0; j0 < R; j0 += 8) {
        long t = t0;
        for (; t + 8 <= t1; t += 8) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            const float *x0 = x + t * K;
            for (long k = 0; k < K; k++) {
                const __m256 wk = _mm256_loadu_ps(w + k * R + j0);
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + k), wk, a0);
                a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + K + k), wk, a1);
                a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + 2 * K + k), wk, a2);
                a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + 3 * K + k), wk, a3);
                a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + 4 * K + k), wk, a4);
                a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + 5 * K + k), wk, a5);
                a6 = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + 6 * K + k), wk, a6);
                a7 = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + 7 * K + k), wk, a7);
            }
            float *o = z + t * R + j0;
            _mm256_storeu_ps(o, _mm256_mul_ps(a0, vs));
            _mm256_storeu_ps(o + R, _mm256_mul_ps(a1, vs));
            _mm256_storeu_ps(o + 2 * R, _mm256_mul_ps(a2, vs));
            _mm256_storeu_ps(o + 3 * R, _mm256_mul_ps(a3, vs));
            _mm256_storeu_ps(o + 4 * R, _mm256_mul_ps(a4, vs));
            _mm256_storeu_ps(o + 5 * R, _mm256_mul_ps(a5, vs));
            _mm256_storeu_ps(o + 6 * R, _mm256_mul_ps(a6, vs));
            _mm256_storeu_ps(o + 7 * R, _mm256_mul_ps(a7, vs));
        }
        for (; t < t1; t++) { /* the same fused multiply-adds in the same order, one token at a time */
            __m256 a = _mm256_setzero_ps();
            const float *xt = x + t * K;
            for (long k = 0; k < K; k++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(xt + k), _mm256_loadu_ps(w + k * R + j0), a);
            _mm256_storeu_ps(z + t * R + j0, _mm256_mul_ps(a, vs));
        }
    }
}

/* y[t, c] += z[t, :] @ v[:, c] for tokens [t0, t1) and columns [c0, c1); y (T, O), z (T, R), v (R, O). `fresh`: y is
 * written, not read (y = z @ v: the sums start at zero), for a caller that adds the base's product onto it after. */
static void expand_rows(float *y, const float *z, const float *v, long t0, long t1, long O, long R, long c0, long c1,
                        int fresh) {
    const __m256 zero = _mm256_setzero_ps();
#define LOAD_Y(p) (fresh ? zero : _mm256_loadu_ps(p))
    long t = t0;
    for (; t + 4 <= t1; t += 4) {
        float *y0 = y + t * O;
        const float *z0 = z + t * R;
        long o = c0;
        for (; o + 16 <= c1; o += 16) {
            __m256 a00 = LOAD_Y(y0 + o), a01 = LOAD_Y(y0 + o + 8);
            __m256 a10 = LOAD_Y(y0 + O + o), a11 = LOAD_Y(y0 + O + o + 8);
            __m256 a20 = LOAD_Y(y0 + 2 * O + o), a21 = LOAD_Y(y0 + 2 * O + o + 8);
            __m256 a30 = LOAD_Y(y0 + 3 * O + o), a31 = LOAD_Y(y0 + 3 * O + o + 8);
            for (long j = 0; j < R; j++) {
                const __m256 v0 = _mm256_loadu_ps(v + j * O + o), v1 = _mm256_loadu_ps(v + j * O + o + 8);
                __m256 b = _mm256_broadcast_ss(z0 + j);
                a00 = _mm256_fmadd_ps(b, v0, a00);
                a01 = _mm256_fmadd_ps(b, v1, a01);
                b = _mm256_broadcast_ss(z0 + R + j);
                a10 = _mm256_fmadd_ps(b, v0, a10);
                a11 = _mm256_fmadd_ps(b, v1, a11);
                b = _mm256_broadcast_ss(z0 + 2 * R + j);
                a20 = _mm256_fmadd_ps(b, v0, a20);
                a21 = _mm256_fmadd_ps(b, v1, a21);
                b = _mm256_broadcast_ss(z0 + 3 * R + j);
                a30 = _mm256_fmadd_ps(b, v0, a30);
                a31 = _mm256_fmadd_ps(b, v1, a31);
            }
            _mm256_storeu_ps(y0 + o, a00);
            _mm256_storeu_ps(y0 + o + 8, a01);
            _mm256_storeu_ps(y0 + O + o, a10);
            _mm256_storeu_ps(y0 + O + o + 8, a11);
            _mm256_storeu_ps(y0 + 2 * O + o, a20);
            _mm256_storeu_ps(y0 + 2 * O + o + 8, a21);
            _mm256_storeu_ps(y0 + 3 * O + o, a30);
            _mm256_storeu_ps(y0 + 3 * O + o + 8, a31);
        }
        for (long u = 0; u < 4; u++) { /* columns past the last 16: one value at a time, the same order */
            for (long c = o; c < c1; c++) {
                float acc = fresh ? 0.0f : y0[u * O + c];
                for (long j = 0; j < R; j++) acc = fmaf(z0[u * R + j], v[j * O + c], acc);
                y0[u * O + c] = acc;
            }
        }
    }
    for (; t < t1; t++) {
        float *yt = y + t * O;
        const float *zt = z + t * R;
        long o = c0;
        for (; o + 8 <= c1; o += 8) {
            __m256 a = LOAD_Y(yt + o);
            for (long j = 0; j < R; j++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(zt + j), _mm256_loadu_ps(v + j * O + o), a);
            _mm256_storeu_ps(yt + o, a);
        }
        for (; o < c1; o++) {
            float acc = fresh ? 0.0f : yt[o];
            for (long j = 0; j < R; j++) acc = fmaf(zt[j], v[j * O + o], acc);
            yt[o] = acc;
        }
    }
}

#undef LOAD_Y

/* g[j, c] += sum_t z[t, j] * x[t, c] for columns [c0, c1) and tokens [0, T) in order; g (R, K), z (T, R), x (T, K).
 * Tokens in blocks of 16, and within a block 4 ranks by 24 columns held in registers (12 sums: each token loads 3
 * vectors of x and broadcasts 4 of z for 12 fused multiply-adds), then 8 columns, then one at a time. The rows of a
 * block are read front to back (a few sequential streams, which the prefetcher follows) instead of column by column
 * down the whole activation, which waited on memory for every line of a cold input. */
#define OUTER_BLOCK 16
static void outer_cols(float *g, const float *z, const float *x, long T, long K, long R, long c0, long c1) {
    for (long t0 = 0; t0 < T; t0 += OUTER_BLOCK) {
        const long t1 = t0 + OUTER_BLOCK < T ? t0 + OUTER_BLOCK : T;
        for (long j0 = 0; j0 < R; j0 += 4) {
            float *g0 = g + j0 * K, *g1 = g0 + K, *g2 = g1 + K, *g3 = g2 + K;
            long c = c0;
            for (; c + 24 <= c1; c += 24) {
                __m256 a00 = _mm256_loadu_ps(g0 + c), a01 = _mm256_loadu_ps(g0 + c + 8), a02 = _mm256_loadu_ps(g0 + c + 16);
                __m256 a10 = _mm256_loadu_ps(g1 + c), a11 = _mm256_loadu_ps(g1 + c + 8), a12 = _mm256_loadu_ps(g1 + c + 16);
                __m256 a20 = _mm256_loadu_ps(g2 + c), a21 = _mm256_loadu_ps(g2 + c + 8), a22 = _mm256_loadu_ps(g2 + c + 16);
                __m256 a30 = _mm256_loadu_ps(g3 + c), a31 = _mm256_loadu_ps(g3 + c + 8), a32 = _mm256_loadu_ps(g3 + c + 16);
                for (long t = t0; t < t1; t++) {
                    const float *xt = x + t * K + c, *zt = z + t * R + j0;
                    const __m256 x0 = _mm256_loadu_ps(xt), x1 = _mm256_loadu_ps(xt + 8), x2 = _mm256_loadu_ps(xt + 16);
                    __m256 b = _mm256_broadcast_ss(zt);
                    a00 = _mm256_fmadd_ps(b, x0, a00);
                    a01 = _mm256_fmadd_ps(b, x1, a01);
                    a02 = _mm256_fmadd_ps(b, x2, a02);
                    b = _mm256_broadcast_ss(zt + 1);
                    a10 = _mm256_fmadd_ps(b, x0, a10);
                    a11 = _mm256_fmadd_ps(b, x1, a11);
                    a12 = _mm256_fmadd_ps(b, x2, a12);
                    b = _mm256_broadcast_ss(zt + 2);
                    a20 = _mm256_fmadd_ps(b, x0, a20);
                    a21 = _mm256_fmadd_ps(b, x1, a21);
                    a22 = _mm256_fmadd_ps(b, x2, a22);
                    b = _mm256_broadcast_ss(zt + 3);
                    a30 = _mm256_fmadd_ps(b, x0, a30);
                    a31 = _mm256_fmadd_ps(b, x1, a31);
                    a32 = _mm256_fmadd_ps(b, x2, a32);
                }
                _mm256_storeu_ps(g0 + c, a00);
                _mm256_storeu_ps(g0 + c + 8, a01);
                _mm256_storeu_ps(g0 + c + 16, a02);
                _mm256_storeu_ps(g1 + c, a10);
                _mm256_storeu_ps(g1 + c + 8, a11);
                _mm256_storeu_ps(g1 + c + 16, a12);
                _mm256_storeu_ps(g2 + c, a20);
                _mm256_storeu_ps(g2 + c + 8, a21);
                _mm256_storeu_ps(g2 + c + 16, a22);
                _mm256_storeu_ps(g3 + c, a30);
                _mm256_storeu_ps(g3 + c + 8, a31);
                _mm256_storeu_ps(g3 + c + 16, a32);
            }
            for (; c + 8 <= c1; c += 8) {
                __m256 a0 = _mm256_loadu_ps(g0 + c), a1 = _mm256_loadu_ps(g1 + c), a2 = _mm256_loadu_ps(g2 + c),
                       a3 = _mm256_loadu_ps(g3 + c);
                for (long t = t0; t < t1; t++) {
                    const __m256 xv = _mm256_loadu_ps(x + t * K + c);
                    const float *zt = z + t * R + j0;
                    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(zt), xv, a0);
                    a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(zt + 1), xv, a1);
                    a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(zt + 2), xv, a2);
                    a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(zt + 3), xv, a3);
                }
                _mm256_storeu_ps(g0 + c, a0);
                _mm256_storeu_ps(g1 + c, a1);
                _mm256_storeu_ps(g2 + c, a2);
                _mm256_storeu_ps(g3 + c, a3);
            }
            for (; c < c1; c++) {
                for (long j = j0; j < j0 + 4; j++) {
                    float acc = g[j * K + c];
                    for (long t = t0; t < t1; t++) acc = fmaf(z[t * R + j], x[t * K + c], acc);
                    g[j * K + c] = acc;
                }
            }
        }
    }
}

/* ---- one call per LoRA Linear and direction; `threads` workers split the tokens or the columns ---- */

typedef struct {
    int backward; /* 0: the forward (`lora_forward`), 1: the backward (`lora_backward`) */
    long n, L, K, O, R;
    const float *x, *grad, *w, *v, *scale, *w2;
    const int64_t *idx;
    float *y, *z, *g, *g2;
    long part, parts;
    int fresh; /* y (forward) or dx (backward) is written, not added to */
} job_t;

static void range_of(long total, long step, long part, long parts, long *lo, long *hi) {
    long blocks = (total + step - 1) / step;
    long b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
    *lo = b0 * step < total ? b0 * step : total;
    *hi = b1 * step < total ? b1 * step : total;
}

/* The backward, a row at a time: the row's rank-wide gradient g_xa from its output gradient, B's gradient from the
 * same rows while they are in cache, then A's gradient and the input gradient from the row's input. With several
 * threads each takes a range of B's and of A's columns (and dx's) for every row, and computes the row's g_xa itself
 * (the same values on every thread: one fixed sum per token), so no thread waits for another and no sum is split. */
static void backward_rows(const job_t *j, float *gz) {
    const long L = j->L, R = j->R, K = j->K, O = j->O;
    long o0, o1, k0, k1;
    range_of(O, 8, j->part, j->parts, &o0, &o1);
    range_of(K, 8, j->part, j->parts, &k0, &k1);
    for (long row = 0; row < j->n; row++) {
        const int64_t u = j->idx[row];
        const float *grad = j->grad + row * L * O, *x = j->x + row * L * K;
        shrink_rows(grad, j->w2 + u * O * R, gz, 0, L, O, R, j->scale[row]);  /* gz: this row's g_xa (L, R) */
        if (o0 < o1) outer_cols(j->g + u * R * O, j->z + row * L * R, grad, L, O, R, o0, o1);
        if (k0 < k1) {
            outer_cols(j->g2 + u * R * K, gz, x, L, K, R, k0, k1);
            if (j->y) expand_rows(j->y + row * L * K, gz, j->w + u * R * K, 0, L, K, R, k0, k1, j->fresh);
        }
    }
}

static int run_job(const job_t *j) {
    const long N = j->n * j->L, L = j->L, R = j->R;
    if (!j->backward) { /* forward: xa = s * x @ at[idx], y += xa @ bt[idx], a range of tokens per thread */
        long lo, hi;
        range_of(N, 8, j->part, j->parts, &lo, &hi);
        while (lo < hi) {
            const long row = lo / L, end = (row + 1) * L < hi ? (row + 1) * L : hi;
            const int64_t u = j->idx[row];
            shrink_rows(j->x, j->w + u * j->K * R, j->z, lo, end, j->K, R, j->scale[row]);
            expand_rows(j->y, j->z, j->v + u * R * j->O, lo, end, j->O, R, 0, j->O, j->fresh);
            lo = end;
        }
        return 0;
    }
    float *gz = (float *)malloc(sizeof(float) * (size_t)(L * R));
    if (!gz) return 1;
    backward_rows(j, gz);
    free(gz);
    return 0;
}

static int run_parallel(job_t *proto, int threads) {
    if (threads < 1) threads = 1;
    int failed = 0;
    /* OpenMP: built with -fopenmp and loaded after torch, this is torch's own runtime and thread pool (the same
     * libgomp.so.1), so the workers are torch's, already running; without OpenMP one thread does every part. */
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        job_t j = *proto;
#ifdef _OPENMP
        j.part = omp_get_thread_num();
        j.parts = omp_get_num_threads();
#else
        j.part = 0;
        j.parts = 1;
#endif
        failed |= run_job(&j);
    }
    return failed;
}

/* Forward of n rows of L tokens: xa = scale * x @ at[idx] (at: (U, K, R)), y += xa @ bt[idx] (bt: (U, R, O)). */
int lora_forward(const float *x, float *y, float *xa, const float *at, const float *bt, const int64_t *idx,
                 const float *scale, long n, long L, long K, long O, long R, int fresh, int threads) {
    job_t j = {.backward = 0, .n = n, .L = L, .K = K, .O = O, .R = R, .x = x, .w = at, .v = bt, .scale = scale, .idx = idx,
               .y = y, .z = xa, .fresh = fresh};
    return run_parallel(&j, threads);
}

/* Backward: per row g_xa = scale * grad @ b[idx] (b: (U, O, R)), then gb[idx] (U, R, O) += xa.T @ grad,
 * ga[idx] (U, R, K) += g_xa.T @ x, and dx (may be NULL) += g_xa @ a[idx] (a: (U, R, K)). Returns non-zero when a
 * thread could not allocate its g_xa scratch (L x R floats). */
int lora_backward(const float *x, const float *grad, const float *xa, const float *a, const float *b,
                  const int64_t *idx, const float *scale, float *dx, float *ga, float *gb, long n, long L, long K,
                  long O, long R, int fresh, int threads) {
    job_t j = {.backward = 1, .n = n, .L = L, .K = K, .O = O, .R = R, .x = x, .grad = grad, .w = a, .w2 = b,
               .scale = scale, .idx = idx, .y = dx, .z = (float *)xa, .g = gb, .g2 = ga, .fresh = fresh};
    return run_parallel(&j, threads);
}
