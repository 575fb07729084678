/* One fused pass over a float32 tensor: every per-unit reduction of spec/trace-v1.md §Columns and
 * the fixed histogram, with no temporaries. Called through ctypes (which releases the GIL, so two
 * tensors reduce at once on two cores); actrace/fastreduce.py owns the tables and the fallback.
 * The tensor is viewed as (before, units, after): the unit axis in the middle, contiguous. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 64      /* rows summed in float before the running sums take them in double */
#define RUN 1024     /* values of one unit summed in float before the running sums take them */
#define BIG 1.0e18f
#define MAX_BINS 160 /* at least the spec's 141 */  /* above this, float squares can overflow: such a block is summed in double */

typedef struct {
    const int16_t *key_bin;   /* per key (float bits >> shift): its bin, -1 if the key straddles an edge */
    int shift;
    const double *edges;      /* the spec's magnitude edges, ascending */
    int n_edges;
    int zero_bin, n_bins;
} Bins;

static int exact_bin(const Bins *b, float v) {
    if (isnan(v)) return -1;
    if (v == 0.0f) return b->zero_bin;
    if (isinf(v)) return v > 0 ? b->n_bins - 1 : 0;
    double m = fabs((double)v);
    int lo = 0, hi = b->n_edges; /* number of edges <= m (searchsorted side=right) */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (b->edges[mid] <= m) lo = mid + 1; else hi = mid;
    }
    return v > 0 ? b->zero_bin + 1 + lo : b->zero_bin - 1 - lo;
}

/* Exponent bits not all ones: a test without a branch or a library call, so loops vectorize. */
static inline int is_finite(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    return (bits & 0x7f800000u) != 0x7f800000u;
}

/* Histogram of n contiguous values; returns how many were NaN. The table maps zero's keys to the
 * zero bin, so the common path has no data-dependent branch; subnormals (which share zero's keys),
 * keys that straddle an edge, and NaN/Inf take the exact path. Four interleaved copies of the
 * histogram keep runs of equal values (zeros of a ReLU) from waiting on each other's stores. */
static int64_t count_bins(const Bins *b, int64_t (*part)[MAX_BINS], const float *p, int64_t n) {
    int64_t nan = 0;
    for (int64_t a = 0; a < n; a++) {
        float v = p[a];
        uint32_t bits;
        memcpy(&bits, &v, 4);
        int bin = b->key_bin[bits >> b->shift];
        int subnormal = ((bits & 0x7f800000u) == 0) & ((bits & 0x007fffffu) != 0); /* & not &&: no branch */
        if (__builtin_expect((bin < 0) | subnormal, 0)) {
            bin = exact_bin(b, v);
            if (bin < 0) { nan++; continue; }
        }
        part[a & 3][bin]++;
    }
    return nan;
}

#ifdef __SSE2__
#include <emmintrin.h>
/* The run loop four values at a time (the compiler does not vectorize its masked min/max):
 * non-finite lanes are replaced before every sum, min and max. Returns where the scalar tail starts. */
static int64_t run_sse2(const float *p, int64_t a0, int64_t a1, float centre, float *s, float *ss, float *lo,
                        float *hi, float *dev, int32_t *z, int32_t *fin, int32_t *big) {
    const __m128i exp = _mm_set1_epi32(0x7f800000), absmask = _mm_set1_epi32(0x7fffffff);
    const __m128 c4 = _mm_set1_ps(centre), huge = _mm_set1_ps(FLT_MAX), zero = _mm_setzero_ps();
    __m128 s4 = zero, ss4 = zero, lo4 = _mm_set1_ps(*lo), hi4 = _mm_set1_ps(*hi), dev4 = _mm_set1_ps(*dev);
    __m128 big4 = zero;
    __m128i z4 = _mm_setzero_si128(), f4 = _mm_setzero_si128();
    int64_t a = a0;
    for (; a + 4 <= a1; a += 4) {
        __m128 v = _mm_loadu_ps(p + a);
        __m128i bits = _mm_castps_si128(v);
        __m128 bad = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(bits, exp), exp)); /* NaN or Inf */
        __m128 vf = _mm_andnot_ps(bad, v);
        s4 = _mm_add_ps(s4, vf);
        ss4 = _mm_add_ps(ss4, _mm_mul_ps(vf, vf));
        big4 = _mm_max_ps(big4, _mm_and_ps(vf, _mm_castsi128_ps(absmask)));
        lo4 = _mm_min_ps(lo4, _mm_or_ps(_mm_and_ps(bad, huge), vf));
        hi4 = _mm_max_ps(hi4, _mm_or_ps(_mm_and_ps(bad, _mm_sub_ps(zero, huge)), vf));
        __m128 d = _mm_and_ps(_mm_sub_ps(v, c4), _mm_castsi128_ps(absmask));
        dev4 = _mm_min_ps(dev4, _mm_or_ps(_mm_and_ps(bad, huge), _mm_andnot_ps(bad, d)));
        z4 = _mm_sub_epi32(z4, _mm_castps_si128(_mm_cmpeq_ps(v, zero)));
        f4 = _mm_sub_epi32(f4, _mm_xor_si128(_mm_castps_si128(bad), _mm_set1_epi32(-1)));
    }
    float t[4];
    int32_t k[4];
    _mm_storeu_ps(t, s4); *s += (t[0] + t[1]) + (t[2] + t[3]);
    _mm_storeu_ps(t, ss4); *ss += (t[0] + t[1]) + (t[2] + t[3]);
    _mm_storeu_ps(t, lo4); for (int i = 0; i < 4; i++) *lo = t[i] < *lo ? t[i] : *lo;
    _mm_storeu_ps(t, hi4); for (int i = 0; i < 4; i++) *hi = t[i] > *hi ? t[i] : *hi;
    _mm_storeu_ps(t, dev4); for (int i = 0; i < 4; i++) *dev = t[i] < *dev ? t[i] : *dev;
    _mm_storeu_ps(t, big4); for (int i = 0; i < 4; i++) *big |= t[i] > BIG;
    _mm_storeu_si128((__m128i *)k, z4); *z += k[0] + k[1] + k[2] + k[3];
    _mm_storeu_si128((__m128i *)k, f4); *fin += k[0] + k[1] + k[2] + k[3];
    return a;
}
#endif

/* Outputs are per unit, initialized by the caller: sums 0, min +inf, max -inf, mindev +inf.
 * Non-finite values are kept out of every statistic (branch-free, so the loops vectorize);
 * nan_inf[0] gets the NaN count and nan_inf[1] the ±inf count. */
int actrace_reduce_f32(const float *x, int64_t before, int64_t units, int64_t after, float centre,
                       const int16_t *key_bin, int shift, const double *edges, int n_edges, int zero_bin,
                       int n_bins, double *restrict sum, double *restrict sumsq, float *restrict mn,
                       float *restrict mx, float *restrict mindev, int64_t *restrict zero,
                       int64_t *restrict finite, int64_t *restrict hist, int64_t *restrict nan_inf) {
    Bins b = {key_bin, shift, edges, n_edges, zero_bin, n_bins};
    int64_t nan = 0;
    int64_t part[4][MAX_BINS];
    memset(part, 0, sizeof part);
    if (after == 1) { /* dense [rows, units]: blocks of rows, float partials in L1, then double */
        float *ps = malloc(units * sizeof(float)), *pss = malloc(units * sizeof(float));
        int32_t *pz = malloc(units * sizeof(int32_t)), *pf = malloc(units * sizeof(int32_t));
        if (!ps || !pss || !pz || !pf) { free(ps); free(pss); free(pz); free(pf); return -1; }
        for (int64_t i0 = 0; i0 < before; i0 += ROWS) {
            int64_t i1 = i0 + ROWS < before ? i0 + ROWS : before;
            memset(ps, 0, units * sizeof(float)); memset(pss, 0, units * sizeof(float));
            memset(pz, 0, units * sizeof(int32_t)); memset(pf, 0, units * sizeof(int32_t));
            int big = 0;
            for (int64_t i = i0; i < i1; i++) {
                const float *row = x + i * units;
                for (int64_t u = 0; u < units; u++) {
                    float v = row[u];
                    int f = is_finite(v);
                    float vf = f ? v : 0.0f;
                    float d = fabsf(v - centre);
                    ps[u] += vf;
                    pss[u] += vf * vf;
                    big |= fabsf(vf) > BIG;
                    mn[u] = (f & (v < mn[u])) ? v : mn[u];
                    mx[u] = (f & (v > mx[u])) ? v : mx[u];
                    mindev[u] = (f & (d < mindev[u])) ? d : mindev[u];
                    pz[u] += v == 0.0f;
                    pf[u] += f;
                }
                if (hist) nan += count_bins(&b, part, row, units);
            }
            if (big) { /* float squares could overflow: this block's sums again, in double */
                for (int64_t i = i0; i < i1; i++) {
                    const float *row = x + i * units;
                    for (int64_t u = 0; u < units; u++) {
                        double v = is_finite(row[u]) ? row[u] : 0.0;
                        sum[u] += v;
                        sumsq[u] += v * v;
                    }
                }
            } else {
                for (int64_t u = 0; u < units; u++) { sum[u] += ps[u]; sumsq[u] += pss[u]; }
            }
            for (int64_t u = 0; u < units; u++) { zero[u] += pz[u]; finite[u] += pf[u]; }
        }
        free(ps); free(pss); free(pz); free(pf);
    } else { /* [before, units, after] with after > 1 (NCHW and the like): runs along `after` */
        for (int64_t i = 0; i < before; i++) {
            for (int64_t u = 0; u < units; u++) {
                const float *p = x + (i * units + u) * after;
                float lo = mn[u], hi = mx[u], dev = mindev[u];
                for (int64_t a0 = 0; a0 < after; a0 += RUN) { /* float partials per run, then double */
                    int64_t a1 = a0 + RUN < after ? a0 + RUN : after;
                    float s = 0, ss = 0;
                    int32_t z = 0, fin = 0, big = 0;
                    int64_t a = a0;
#ifdef __SSE2__
                    a = run_sse2(p, a0, a1, centre, &s, &ss, &lo, &hi, &dev, &z, &fin, &big);
#endif
                    for (; a < a1; a++) {
                        float v = p[a];
                        int f = is_finite(v);
                        float vf = f ? v : 0.0f;
                        float d = fabsf(v - centre);
                        s += vf;
                        ss += vf * vf;
                        big |= fabsf(vf) > BIG;
                        lo = (f & (v < lo)) ? v : lo;
                        hi = (f & (v > hi)) ? v : hi;
                        dev = (f & (d < dev)) ? d : dev;
                        z += v == 0.0f;
                        fin += f;
                    }
                    if (big) { /* float squares could overflow: this run's sums again, in double */
                        double ds = 0, dss = 0;
                        for (int64_t a = a0; a < a1; a++) {
                            double v = is_finite(p[a]) ? p[a] : 0.0;
                            ds += v;
                            dss += v * v;
                        }
                        sum[u] += ds; sumsq[u] += dss;
                    } else {
                        sum[u] += s; sumsq[u] += ss;
                    }
                    zero[u] += z; finite[u] += fin;
                }
                mn[u] = lo; mx[u] = hi; mindev[u] = dev;
                if (hist) nan += count_bins(&b, part, p, after);
            }
        }
    }
    if (hist)
        for (int k = 0; k < n_bins; k++) hist[k] += part[0][k] + part[1][k] + part[2][k] + part[3][k];
    int64_t total = before * units * after, fin_total = 0;
    for (int64_t u = 0; u < units; u++) fin_total += finite[u];
    if (!hist) { /* NaN and Inf apart need a look at the non-finite values */
        for (int64_t k = 0; k < total && fin_total + nan < total; k++) nan += isnan(x[k]);
    }
    nan_inf[0] = nan;
    nan_inf[1] = total - fin_total - nan;
    return 0;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernel", "actrace's fused reduction kernel", -1, NULL};

PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&module); }
