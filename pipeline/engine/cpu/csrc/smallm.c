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

int smallm_abi(void) { return 2; }

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

/* ---- Attention of a short query block over a KV cache (AVX2 + FMA), grouped KV heads read once ----
 *
 * out[b, hq, t, :] = softmax_j(scale q[b, hq, t] . K[b, hq / g, j] + mask[b, t, j]) V[b, hq / g, j]
 * for every query head hq (g = heads / kv heads) and token t.  Per (row, KV head): pass 1 scores the
 * group's g * nq query vectors against the keys, a block of positions at a time (the block stays in L1
 * while every query vector reads it), 4 positions per reduction; the softmax (max, exp, sum); pass 2 sums
 * the values the same blocked way.  Keys and values are read from memory once per (row, KV head).
 * D8 = head_dim / 8 is a compile-time constant (head_dim 32, 64, 128).
 */

#define JBLOCK 64
#define QMAX 64 /* query vectors per (row, KV head): g * nq */

/* exp(x) for x <= 0 (0 below -87.3), |relative error| ~ 2 ulp: Cephes' expf polynomial */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}

static inline __attribute__((always_inline)) void
attend_head(const float *const *qv, int nv, const float *k, int64_t k_ss, const float *v, int64_t v_ss,
            const float *const *mrow, int64_t s, float scale, float *sc, float *const *ov, const int D8) {
    /* pass 1: sc[i * s + j] = scale q_i . k_j + mask */
    for (int64_t j0 = 0; j0 < s; j0 += JBLOCK) {
        int64_t j1 = j0 + JBLOCK < s ? j0 + JBLOCK : s;
        for (int i = 0; i < nv; i++) {
            __m256 q[16];
            for (int c = 0; c < D8; c++) q[c] = _mm256_loadu_ps(qv[i] + 8 * c);
            float *out = sc + (int64_t)i * s;
            int64_t j = j0;
            for (; j + 4 <= j1; j += 4) {
                const float *k0 = k + j * k_ss;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int c = 0; c < D8; c++) {
                    a0 = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(k0 + 8 * c), a0);
                    a1 = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(k0 + k_ss + 8 * c), a1);
                    a2 = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(k0 + 2 * k_ss + 8 * c), a2);
                    a3 = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(k0 + 3 * k_ss + 8 * c), a3);
                }
                __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
                __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                r = _mm_mul_ps(r, _mm_set1_ps(scale));
                if (mrow[i]) r = _mm_add_ps(r, _mm_loadu_ps(mrow[i] + j));
                _mm_storeu_ps(out + j, r);
            }
            for (; j < j1; j++) {
                const float *k0 = k + j * k_ss;
                __m256 a0 = _mm256_setzero_ps();
                for (int c = 0; c < D8; c++) a0 = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(k0 + 8 * c), a0);
                __m128 r = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
                r = _mm_hadd_ps(r, r);
                r = _mm_hadd_ps(r, r);
                out[j] = _mm_cvtss_f32(r) * scale + (mrow[i] ? mrow[i][j] : 0.0f);
            }
        }
    }
    /* the softmax of each query vector's scores (unnormalised here; 1 / sum applied at the end) */
    float inv[QMAX];
    for (int i = 0; i < nv; i++) {
        float *row = sc + (int64_t)i * s;
        float mx = -__builtin_inff();
        for (int64_t j = 0; j < s; j++) mx = row[j] > mx ? row[j] : mx;
        __m256 m = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= s; j += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + j), m));
            _mm256_storeu_ps(row + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        float tail[8] = {0}, total;
        if (j < s) {
            float in[8];
            for (int t = 0; t < 8; t++) in[t] = j + t < s ? row[j + t] - mx : -1e30f;
            _mm256_storeu_ps(tail, exp256(_mm256_loadu_ps(in)));
            for (int t = 0; j + t < s; t++) row[j + t] = tail[t];
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, sum);
        total = 0.0f;
        for (int t = 0; t < 8; t++) total += lanes[t] + tail[t];
        inv[i] = 1.0f / total;
    }
    /* pass 2: ov[i] = sum_j p_ij v_j, a block of positions at a time */
    for (int i = 0; i < nv; i++)
        for (int c = 0; c < 8 * D8; c++) ov[i][c] = 0.0f;
    for (int64_t j0 = 0; j0 < s; j0 += JBLOCK) {
        int64_t j1 = j0 + JBLOCK < s ? j0 + JBLOCK : s;
        for (int i = 0; i < nv; i++) {
            __m256 o[16];
            for (int c = 0; c < D8; c++) o[c] = _mm256_loadu_ps(ov[i] + 8 * c);
            const float *p = sc + (int64_t)i * s;
            for (int64_t j = j0; j < j1; j++) {
                __m256 pj = _mm256_broadcast_ss(p + j);
                const float *v0 = v + j * v_ss;
                for (int c = 0; c < D8; c++) o[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v0 + 8 * c), o[c]);
            }
            for (int c = 0; c < D8; c++) _mm256_storeu_ps(ov[i] + 8 * c, o[c]);
        }
    }
    for (int i = 0; i < nv; i++) {
        __m256 f = _mm256_set1_ps(inv[i]);
        for (int c = 0; c < D8; c++) _mm256_storeu_ps(ov[i] + 8 * c, _mm256_mul_ps(f, _mm256_loadu_ps(ov[i] + 8 * c)));
    }
}

#define DEFHEAD(D8)                                                                                           \
    static void attend_head_##D8(const float *const *qv, int nv, const float *k, int64_t k_ss, const float *v, \
                                 int64_t v_ss, const float *const *mrow, int64_t s, float scale, float *sc,   \
                                 float *const *ov) {                                                          \
        attend_head(qv, nv, k, k_ss, v, v_ss, mrow, s, scale, sc, ov, D8);                                    \
    }
DEFHEAD(4) DEFHEAD(8) DEFHEAD(16)

/* q (b, hq, nq, d), k and v (b, hkv, s, d) with unit last stride (strides in floats: sb, sh, and st / ss for
 * the token / position), mask (b or 1 via m_sb = 0, 1, nq, s) with unit last stride or NULL, out (b, hq, nq, d)
 * contiguous; sc: scratch of g * nq * s floats.  d in {32, 64, 128}, g * nq <= QMAX (the caller checks).
 * Returns 0, or -1 for a shape it does not serve. */
int smallq_attention(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_st, const float *k, int64_t k_sb,
                     int64_t k_sh, int64_t k_ss, const float *v, int64_t v_sb, int64_t v_sh, int64_t v_ss,
                     const float *mask, int64_t m_sb, int64_t m_sq, float *out, int64_t b, int64_t hq, int64_t hkv,
                     int64_t nq, int64_t s, int64_t d, float scale, float *sc) {
    int64_t g = hq / hkv;
    if (hkv <= 0 || hq % hkv || g * nq > QMAX || s <= 0) return -1;
    void (*head)(const float *const *, int, const float *, int64_t, const float *, int64_t, const float *const *,
                 int64_t, float, float *, float *const *) =
        d == 32 ? attend_head_4 : d == 64 ? attend_head_8 : d == 128 ? attend_head_16 : 0;
    if (!head) return -1;
    const float *qv[QMAX], *mrow[QMAX];
    float *ov[QMAX];
    for (int64_t bi = 0; bi < b; bi++)
        for (int64_t h = 0; h < hkv; h++) {
            int nv = 0;
            for (int64_t gi = 0; gi < g; gi++)
                for (int64_t t = 0; t < nq; t++, nv++) {
                    int64_t head_q = h * g + gi;
                    qv[nv] = q + bi * q_sb + head_q * q_sh + t * q_st;
                    ov[nv] = out + ((bi * hq + head_q) * nq + t) * d;
                    mrow[nv] = mask ? mask + bi * m_sb + t * m_sq : 0;
                }
            head(qv, nv, k + bi * k_sb + h * k_sh, k_ss, v + bi * v_sb + h * v_sh, v_ss, mrow, s, scale, sc, ov);
        }
    return 0;
}
