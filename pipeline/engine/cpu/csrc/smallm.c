/* A small-M linear kernel: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32, for a few rows of input.
 *
 * The weight is packed once (smallm_pack) into panels of 16 output columns laid out K-major:
 * packed[p][k][j] = W[16 p + j][k] (zero past N), N rounded up to a multiple of 32.  A call walks the
 * panels two at a time; for each chunk of rows it runs k = 0 .. K-1 once, loading the panels' W[k]
 * vectors, broadcasting x[m, k] and FMA-ing into each row's accumulators.  The panels (32 K floats) stay
 * in the L1/L2 cache across row chunks, so a call reads the weight from memory once whatever M.
 *
 * Batch invariance: every output element is one FMA lane accumulating over k = 0 .. K-1 in order from 0,
 * then + bias: the result is bitwise the same for every M, every chunking, and the AVX2 and AVX-512
 * paths alike.
 *
 * Built by pipeline/engine/cpu/smallm.py with gcc -O3 -mavx2 -mfma -shared -fPIC; the AVX-512 path
 * is compiled through a target attribute and taken where the CPU has AVX-512F.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16

int smallm_abi(void) { return 1; }

int smallm_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 1 : 0;
}

/* Floats of the packed weight of an n x k matrix. */
int64_t smallm_packed_size(int64_t n, int64_t k) { return ((n + 31) / 32) * 32 * k; }

/* w: n x k row-major (row stride ldw) -> packed (smallm_packed_size floats). */
void smallm_pack(const float *w, int64_t ldw, int64_t n, int64_t k, float *packed) {
    int64_t panels = (n + 31) / 32 * 2;
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * PANEL;
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < PANEL; j++) {
                int64_t col = p * PANEL + j;
                dst[kk * PANEL + j] = col < n ? w[col * ldw + kk] : 0.0f;
            }
    }
}

static inline void store_cols(float *y, const float *acc, const float *bias, int64_t col, int64_t n) {
    int64_t cnt = n - col < PANEL ? n - col : PANEL;
    for (int64_t j = 0; j < cnt; j++)
        y[j] = bias ? acc[j] + bias[col + j] : acc[j];
}

/* ---- AVX-512: two panels (32 columns) x R rows (R <= 8): 2 R zmm accumulators ---- */

#define R_MAX_512 8

__attribute__((target("avx512f"), always_inline)) static inline void
block512(const float *x, int64_t ldx, const float *w0, const float *w1, int64_t k, int R, float *y, int64_t ldy,
         const float *bias, int64_t col, int64_t n) {
    __m512 a0[R_MAX_512], a1[R_MAX_512];
    for (int r = 0; r < R; r++) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 v0 = _mm512_loadu_ps(w0 + kk * PANEL), v1 = _mm512_loadu_ps(w1 + kk * PANEL);
        for (int r = 0; r < R; r++) {
            __m512 b = _mm512_set1_ps(x[r * ldx + kk]);
            a0[r] = _mm512_fmadd_ps(b, v0, a0[r]);
            a1[r] = _mm512_fmadd_ps(b, v1, a1[r]);
        }
    }
    float buf[2 * PANEL];
    for (int r = 0; r < R; r++) {
        float *yr = y + r * ldy;
        if (bias == 0 && col + 2 * PANEL <= n) {
            _mm512_storeu_ps(yr + col, a0[r]);
            _mm512_storeu_ps(yr + col + PANEL, a1[r]);
        } else if (col + 2 * PANEL <= n) {
            _mm512_storeu_ps(yr + col, _mm512_add_ps(a0[r], _mm512_loadu_ps(bias + col)));
            _mm512_storeu_ps(yr + col + PANEL, _mm512_add_ps(a1[r], _mm512_loadu_ps(bias + col + PANEL)));
        } else {
            _mm512_storeu_ps(buf, a0[r]);
            _mm512_storeu_ps(buf + PANEL, a1[r]);
            store_cols(yr + col, buf, bias, col, n);
            if (col + PANEL < n) store_cols(yr + col + PANEL, buf + PANEL, bias, col + PANEL, n);
        }
    }
}

#define DEF512(R)                                                                                              \
    __attribute__((target("avx512f"))) static void block512_##R(const float *x, int64_t ldx, const float *w0,  \
                                                                const float *w1, int64_t k, float *y,          \
                                                                int64_t ldy, const float *bias, int64_t col,   \
                                                                int64_t n) {                                   \
        block512(x, ldx, w0, w1, k, R, y, ldy, bias, col, n);                                                  \
    }
DEF512(1) DEF512(2) DEF512(3) DEF512(4) DEF512(5) DEF512(6) DEF512(7) DEF512(8)

typedef void (*block_fn)(const float *, int64_t, const float *, const float *, int64_t, float *, int64_t,
                         const float *, int64_t, int64_t);
static const block_fn BLOCKS512[R_MAX_512 + 1] = {0, block512_1, block512_2, block512_3, block512_4,
                                                  block512_5, block512_6, block512_7, block512_8};

/* ---- AVX2: one panel (16 columns, 2 ymm) x R rows (R <= 6): 2 R ymm accumulators ---- */

#define R_MAX_256 6

static inline __attribute__((always_inline)) void
block256(const float *x, int64_t ldx, const float *w0, int64_t k, int R, float *y, int64_t ldy, const float *bias,
         int64_t col, int64_t n) {
    __m256 a0[R_MAX_256], a1[R_MAX_256];
    for (int r = 0; r < R; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 v0 = _mm256_loadu_ps(w0 + kk * PANEL), v1 = _mm256_loadu_ps(w0 + kk * PANEL + 8);
        for (int r = 0; r < R; r++) {
            __m256 b = _mm256_broadcast_ss(x + r * ldx + kk);
            a0[r] = _mm256_fmadd_ps(b, v0, a0[r]);
            a1[r] = _mm256_fmadd_ps(b, v1, a1[r]);
        }
    }
    float buf[PANEL];
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(buf, a0[r]);
        _mm256_storeu_ps(buf + 8, a1[r]);
        store_cols(y + r * ldy + col, buf, bias, col, n);
    }
}

#define DEF256(R)                                                                                              \
    static void block256_##R(const float *x, int64_t ldx, const float *w0, const float *w1, int64_t k,         \
                             float *y, int64_t ldy, const float *bias, int64_t col, int64_t n) {              \
        (void)w1;                                                                                              \
        block256(x, ldx, w0, k, R, y, ldy, bias, col, n);                                                      \
    }
DEF256(1) DEF256(2) DEF256(3) DEF256(4) DEF256(5) DEF256(6)

static const block_fn BLOCKS256[R_MAX_256 + 1] = {0, block256_1, block256_2, block256_3,
                                                  block256_4, block256_5, block256_6};

/* y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ W^T (+ bias[n] unless bias is NULL), W packed by
 * smallm_pack.  wide: 1 = the AVX-512 path (the caller checked smallm_has_avx512), 0 = AVX2. */
void smallm_linear(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                   int64_t m, int64_t n, int64_t k, int wide) {
    int64_t panels = (n + 31) / 32 * 2;
    if (wide) {
        for (int64_t p = 0; p < panels; p += 2) {
            const float *w0 = packed + p * k * PANEL, *w1 = w0 + k * PANEL;
            for (int64_t r = 0; r < m; r += R_MAX_512) {
                int64_t rows = m - r < R_MAX_512 ? m - r : R_MAX_512;
                BLOCKS512[rows](x + r * ldx, ldx, w0, w1, k, y + r * ldy, ldy, bias, p * PANEL, n);
            }
        }
    } else {
        for (int64_t p = 0; p < panels; p++) {
            if (p * PANEL >= n) break;
            const float *w0 = packed + p * k * PANEL;
            for (int64_t r = 0; r < m; r += R_MAX_256) {
                int64_t rows = m - r < R_MAX_256 ? m - r : R_MAX_256;
                BLOCKS256[rows](x + r * ldx, ldx, w0, 0, k, y + r * ldy, ldy, bias, p * PANEL, n);
            }
        }
    }
}
