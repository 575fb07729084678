/* One fused pass over a float32 tensor: every per-unit reduction of spec/trace-v1.md §Columns and
 * the fixed histogram, with no temporaries. Called through ctypes (which releases the GIL, so two
 * tensors reduce at once on two cores); actrace/kernel.py owns the tables and the fallback.
 * The tensor is viewed as (before, units, after): the unit axis in the middle, contiguous.
 * Optionally the same pass also gives the sums and zero counts of relu(x), so a ReLU that reads a
 * recorded tensor needs no pass of its own. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 64      /* rows summed in float before the running sums take them in double */
#define RUN 1024     /* values of one unit summed in float before the running sums take them */
#define BIG 1.0e18f  /* above this, float squares can overflow: such a block is summed in double */
#define MAX_BINS 160 /* at least the spec's 141 */
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const int16_t *key_bin;   /* per key (float bits >> shift): its bin, -1 if the key straddles an edge */
    int shift;
    const double *edges;      /* the spec's magnitude edges, ascending */
    int n_edges;
    int zero_bin, n_bins;
} Bins;

typedef struct { /* per-unit outputs, initialized by the caller; the r* (relu(x)) ones may be NULL */
    double *sum, *sumsq, *rsum, *rsumsq;
    float *mn, *mx, *mindev;
    int64_t *zero, *finite, *rzero;
} Out;

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

/* Double sums of a block whose float squares could overflow (values above BIG). */
static void sums_in_double(const float *p, int64_t n, int64_t stride, double *s, double *ss, double *rs,
                           double *rss) {
    for (int64_t k = 0; k < n; k++) {
        double v = is_finite(p[k * stride]) ? p[k * stride] : 0.0, vp = v > 0 ? v : 0.0;
        *s += v; *ss += v * v;
        if (rs) { *rs += vp; *rss += vp * vp; }
    }
}

/* Dense [rows, units]: blocks of ROWS rows, float partials in L1, then double. `relu` is a
 * constant at each call, so the compiler makes a loop without the relu sums. */
INLINE int dense(const Bins *b, int64_t (*part)[MAX_BINS], int hist, const float *x, int64_t before,
                 int64_t units, float centre, const Out *o, const int relu, int64_t *nan) {
    float *ps = malloc(units * sizeof(float) * 4);
    int32_t *pz = malloc(units * sizeof(int32_t) * 3);
    if (!ps || !pz) { free(ps); free(pz); return -1; }
    float *pss = ps + units, *prs = ps + 2 * units, *prss = ps + 3 * units;
    int32_t *pf = pz + units, *prz = pz + 2 * units;
    for (int64_t i0 = 0; i0 < before; i0 += ROWS) {
        int64_t i1 = i0 + ROWS < before ? i0 + ROWS : before;
        memset(ps, 0, units * sizeof(float) * 4);
        memset(pz, 0, units * sizeof(int32_t) * 3);
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
                o->mn[u] = (f & (v < o->mn[u])) ? v : o->mn[u];
                o->mx[u] = (f & (v > o->mx[u])) ? v : o->mx[u];
                o->mindev[u] = (f & (d < o->mindev[u])) ? d : o->mindev[u];
                pz[u] += v == 0.0f;
                pf[u] += f;
                if (relu) {
                    float vp = vf > 0.0f ? vf : 0.0f;
                    prs[u] += vp;
                    prss[u] += vp * vp;
                    prz[u] += f & (v <= 0.0f);
                }
            }
            if (hist) *nan += count_bins(b, part, row, units);
        }
        for (int64_t u = 0; u < units; u++) {
            if (big) {
                double r0 = 0, r1 = 0;
                sums_in_double(x + i0 * units + u, i1 - i0, units, &o->sum[u], &o->sumsq[u], relu ? &r0 : NULL, &r1);
                if (relu) { o->rsum[u] += r0; o->rsumsq[u] += r1; }
            } else {
                o->sum[u] += ps[u]; o->sumsq[u] += pss[u];
                if (relu) { o->rsum[u] += prs[u]; o->rsumsq[u] += prss[u]; }
            }
            o->zero[u] += pz[u]; o->finite[u] += pf[u];
            if (relu) o->rzero[u] += prz[u];
        }
    }
    free(ps); free(pz);
    return 0;
}

typedef struct { float s, ss, rs, rss, lo, hi, dev; int32_t z, fin, rz, big; } Acc;

#ifdef __SSE2__
#include <emmintrin.h>
static float hsum(__m128 v) { float t[4]; _mm_storeu_ps(t, v); return (t[0] + t[1]) + (t[2] + t[3]); }
static int32_t hsum_i(__m128i v) { int32_t t[4]; _mm_storeu_si128((__m128i *)t, v); return t[0] + t[1] + t[2] + t[3]; }
static float hmin(__m128 v) { float t[4]; _mm_storeu_ps(t, v); float m = t[0]; for (int i = 1; i < 4; i++) m = t[i] < m ? t[i] : m; return m; }
static float hmax(__m128 v) { float t[4]; _mm_storeu_ps(t, v); float m = t[0]; for (int i = 1; i < 4; i++) m = t[i] > m ? t[i] : m; return m; }

/* The run loop four values at a time (the compiler does not vectorize its masked min/max):
 * non-finite lanes are replaced before every sum, min and max. Returns where the scalar tail starts. */
INLINE int64_t run_sse2(const float *p, int64_t a0, int64_t a1, float centre, Acc *acc, const int relu) {
    const __m128i exp = _mm_set1_epi32(0x7f800000), absmask = _mm_set1_epi32(0x7fffffff);
    const __m128 c4 = _mm_set1_ps(centre), huge = _mm_set1_ps(FLT_MAX), zero = _mm_setzero_ps();
    __m128 s4 = zero, ss4 = zero, rs4 = zero, rss4 = zero, big4 = zero;
    __m128 lo4 = _mm_set1_ps(acc->lo), hi4 = _mm_set1_ps(acc->hi), dev4 = _mm_set1_ps(acc->dev);
    __m128i z4 = _mm_setzero_si128(), f4 = _mm_setzero_si128(), rz4 = _mm_setzero_si128();
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
        if (relu) {
            __m128 vp = _mm_max_ps(vf, zero);
            rs4 = _mm_add_ps(rs4, vp);
            rss4 = _mm_add_ps(rss4, _mm_mul_ps(vp, vp));
            rz4 = _mm_sub_epi32(rz4, _mm_castps_si128(_mm_andnot_ps(bad, _mm_cmple_ps(v, zero))));
        }
    }
    acc->s += hsum(s4); acc->ss += hsum(ss4); acc->rs += hsum(rs4); acc->rss += hsum(rss4);
    acc->lo = fminf(acc->lo, hmin(lo4)); acc->hi = fmaxf(acc->hi, hmax(hi4)); acc->dev = fminf(acc->dev, hmin(dev4));
    acc->big |= hmax(big4) > BIG;
    acc->z += hsum_i(z4); acc->fin += hsum_i(f4); acc->rz += hsum_i(rz4);
    return a;
}
#endif

/* [before, units, after] with after > 1 (NCHW and the like): runs along `after`. */
INLINE void runs(const Bins *b, int64_t (*part)[MAX_BINS], int hist, const float *x, int64_t before,
                 int64_t units, int64_t after, float centre, const Out *o, const int relu, int64_t *nan) {
    for (int64_t i = 0; i < before; i++) {
        for (int64_t u = 0; u < units; u++) {
            const float *p = x + (i * units + u) * after;
            Acc acc = {.lo = o->mn[u], .hi = o->mx[u], .dev = o->mindev[u]};
            for (int64_t a0 = 0; a0 < after; a0 += RUN) { /* float partials per run, then double */
                int64_t a1 = a0 + RUN < after ? a0 + RUN : after;
                acc.s = acc.ss = acc.rs = acc.rss = 0;
                acc.big = 0;
                int64_t a = a0;
#ifdef __SSE2__
                a = run_sse2(p, a0, a1, centre, &acc, relu);
#endif
                for (; a < a1; a++) {
                    float v = p[a];
                    int f = is_finite(v);
                    float vf = f ? v : 0.0f, vp = vf > 0.0f ? vf : 0.0f;
                    float d = fabsf(v - centre);
                    acc.s += vf; acc.ss += vf * vf;
                    if (relu) { acc.rs += vp; acc.rss += vp * vp; acc.rz += f & (v <= 0.0f); }
                    acc.big |= fabsf(vf) > BIG;
                    acc.lo = (f & (v < acc.lo)) ? v : acc.lo;
                    acc.hi = (f & (v > acc.hi)) ? v : acc.hi;
                    acc.dev = (f & (d < acc.dev)) ? d : acc.dev;
                    acc.z += v == 0.0f;
                    acc.fin += f;
                }
                if (acc.big) {
                    double r0 = 0, r1 = 0;
                    sums_in_double(p + a0, a1 - a0, 1, &o->sum[u], &o->sumsq[u], relu ? &r0 : NULL, &r1);
                    if (relu) { o->rsum[u] += r0; o->rsumsq[u] += r1; }
                } else {
                    o->sum[u] += acc.s; o->sumsq[u] += acc.ss;
                    if (relu) { o->rsum[u] += acc.rs; o->rsumsq[u] += acc.rss; }
                }
            }
            o->zero[u] += acc.z; o->finite[u] += acc.fin;
            if (relu) o->rzero[u] += acc.rz;
            o->mn[u] = acc.lo; o->mx[u] = acc.hi; o->mindev[u] = acc.dev;
            if (hist) *nan += count_bins(b, part, p, after);
        }
    }
}

/* Outputs are per unit, initialized by the caller: sums 0, min +inf, max -inf, mindev +inf.
 * Non-finite values are kept out of every statistic (branch-free, so the loops vectorize);
 * nan_inf[0] gets the NaN count and nan_inf[1] the ±inf count. rsum, rsumsq and rzero (the sums
 * of relu(x) over finite values, and how many finite values are <= 0) are filled when not NULL. */
int actrace_reduce_f32(const float *x, int64_t before, int64_t units, int64_t after, float centre,
                       const int16_t *key_bin, int shift, const double *edges, int n_edges, int zero_bin,
                       int n_bins, double *sum, double *sumsq, float *mn, float *mx, float *mindev,
                       int64_t *zero, int64_t *finite, int64_t *hist, int64_t *nan_inf, double *rsum,
                       double *rsumsq, int64_t *rzero) {
    Bins b = {key_bin, shift, edges, n_edges, zero_bin, n_bins};
    Out o = {sum, sumsq, rsum, rsumsq, mn, mx, mindev, zero, finite, rzero};
    int64_t nan = 0;
    int64_t part[4][MAX_BINS];
    memset(part, 0, sizeof part);
    int h = hist != NULL;
    if (after == 1) {
        int err = rsum ? dense(&b, part, h, x, before, units, centre, &o, 1, &nan)
                       : dense(&b, part, h, x, before, units, centre, &o, 0, &nan);
        if (err) return err;
    } else if (rsum) {
        runs(&b, part, h, x, before, units, after, centre, &o, 1, &nan);
    } else {
        runs(&b, part, h, x, before, units, after, centre, &o, 0, &nan);
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
