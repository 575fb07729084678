/* One fused pass over a float32 tensor: every per-unit reduction of spec/trace-v1.md §Columns and
 * the fixed histogram, with no temporaries. Called through ctypes by actrace/kernel.py, which runs
 * a batch on every thread and owns the tables and the fallback.
 * The tensor is viewed as (before, units, after): the unit axis in the middle, contiguous.
 * Optionally the same pass also gives the sums and zero counts of relu(x), so a ReLU that reads a
 * recorded tensor needs no pass of its own. Also: an attention's per-head numbers from its scores
 * (`actrace_scores`, spec §Derived readings), in one read of them. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 64      /* rows summed in float before the running sums take them in double */
#define RUN 512      /* values of one unit summed in float lanes (64 a lane) before double takes them */
#define MAX_BINS 160 /* at least the spec's 141 */
#define F64_ROWS 8   /* double outputs per unit: sum, sumsq, rsum, rsumsq, cube, quart, rcube, rquart */
#define TOTALS 9     /* a job's whole-tensor totals: sum, sumsq, cube, quart, min, max, zeros, NaN, inf */
#define KEY_SHIFT 14 /* key = float32 bits >> KEY_SHIFT: 2^18 keys, a 256 KiB table of bins */
#define EXACT 255    /* a key whose values take the exact path (a byte: the table stays small in cache) */
#define CARRY (256 - MAX_BINS) /* bin + CARRY reaches 256 (bit 8) for EXACT only: one test for four bins */
#define INLINE static inline __attribute__((always_inline))
/* Built for x86-64-v4 (AVX-512's 32 vector registers hold both column groups' sums), v3 (AVX2,
 * FMA, BMI2's shifts) and plain x86-64 where the compiler can, the loader picking what the CPU runs. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONED __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONED
#endif

typedef struct {
    const uint8_t *key_bin;   /* per key (float bits >> KEY_SHIFT): its bin, EXACT if the key straddles an edge */
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

/* Whether any of n values is subnormal: a vectorized look that spares the histogram's loop its
 * test in the usual case of none. */
INLINE int any_subnormal(const float *p, int64_t n) {
    int any = 0;
    for (int64_t a = 0; a < n; a++) {
        uint32_t bits;
        memcpy(&bits, p + a, 4);
        any |= ((bits & 0x7f800000u) == 0) & ((bits & 0x007fffffu) != 0); /* & not &&: no branch */
    }
    return any;
}

/* A value's bin from the key table; EXACT where it must take the exact path: keys that straddle an
 * edge, NaN and ±inf, and (with `subnormals`) the subnormals that share a key with ±0. No branch:
 * zeros and other values mix at random in a ReLU's output. */
INLINE int fast_bin(const Bins *b, uint32_t bits, const int subnormals) {
    int bin = b->key_bin[bits >> KEY_SHIFT];
    if (!subnormals) return bin;
    int subnormal = ((bits & 0x7f800000u) == 0) & ((bits & 0x007fffffu) != 0);
    return bin | (-subnormal & EXACT);
}

/* Count one value whose fast bin is `bin` (EXACT: the exact path); returns 1 for a NaN. */
INLINE int count_one(const Bins *b, int64_t *part, float v, int bin) {
    if (bin == EXACT) bin = exact_bin(b, v);
    if (bin < 0) return 1;
    part[bin]++;
    return 0;
}

/* Histogram of n contiguous values; returns how many were NaN. The table maps zero's keys to the
 * zero bin, so the common path has no data-dependent branch. Four copies of the histogram, one
 * per value of a group of four, keep runs of equal values (zeros of a ReLU) from waiting on each
 * other's stores. `subnormals` is a constant at each call: the compiler makes a loop without the
 * subnormal test. */
INLINE int64_t count_loop(const Bins *b, int64_t (*part)[MAX_BINS], const float *p, int64_t n,
                          const int subnormals) {
    int64_t nan = 0, a = 0;
    for (; a + 4 <= n; a += 4) {
        uint32_t w[4];
        memcpy(w, p + a, sizeof w);
        int k0 = fast_bin(b, w[0], subnormals), k1 = fast_bin(b, w[1], subnormals),
            k2 = fast_bin(b, w[2], subnormals), k3 = fast_bin(b, w[3], subnormals);
        if (__builtin_expect(((k0 + CARRY) | (k1 + CARRY) | (k2 + CARRY) | (k3 + CARRY)) & 256, 0)) {
            for (int j = 0; j < 4; j++) {
                uint32_t bits;
                memcpy(&bits, p + a + j, 4);
                nan += count_one(b, part[j], p[a + j], fast_bin(b, bits, 1));
            }
        } else {
            part[0][k0]++; part[1][k1]++; part[2][k2]++; part[3][k3]++;
        }
    }
    for (; a < n; a++) {
        uint32_t bits;
        memcpy(&bits, p + a, 4);
        nan += count_one(b, part[a & 3], p[a], fast_bin(b, bits, 1));
    }
    return nan;
}

/* A function of its own, not inlined: inlined at its four call sites it slowed the whole
 * reduction by 15-20 % (measured), the big function's registers spread thinner. */
CLONED __attribute__((noinline)) static int64_t count_bins(const Bins *b, int64_t (*part)[MAX_BINS], const float *p,
                                                           int64_t n) {
    return any_subnormal(p, n) ? count_loop(b, part, p, n, 1) : count_loop(b, part, p, n, 0);
}

typedef struct { /* per-unit outputs; the r* (relu(x)) ones are unused without relu */
    double *sum, *sumsq, *rsum, *rsumsq;
    float *mn, *mx, *mindev;
    int64_t *zero, *finite, *rzero;
    double *cube, *quart, *rcube, *rquart; /* sums of x^3 and x^4 (relu(x)'s): kurtosis (spec 1.2) */
} Out;

typedef struct { const Bins *b; int64_t (*part)[MAX_BINS]; int on; int64_t nan; } Hist;

/* Unit u's n values p[0], p[stride], ... one at a time, sums in double, non-finite values left
 * out: the rare block whose float lanes met a NaN or an Inf, or whose squares overflowed float. */
static void exact_values(const float *p, int64_t n, int64_t stride, float centre, const Out *o, int64_t u,
                         const int relu) {
    for (int64_t k = 0; k < n; k++) {
        float v = p[k * stride];
        if (!is_finite(v)) continue;
        double dv = v, vp = dv > 0 ? dv : 0.0, d2 = dv * dv;
        o->sum[u] += dv; o->sumsq[u] += d2; o->cube[u] += d2 * dv; o->quart[u] += d2 * d2;
        o->mn[u] = fminf(o->mn[u], v); o->mx[u] = fmaxf(o->mx[u], v);
        o->mindev[u] = fminf(o->mindev[u], fabsf(v - centre));
        o->zero[u] += v == 0.0f; o->finite[u]++;
        if (relu) {
            o->rsum[u] += vp; o->rsumsq[u] += vp * vp; o->rzero[u] += v <= 0.0f;
            o->rcube[u] += vp * vp * vp; o->rquart[u] += vp * vp * vp * vp;
        }
    }
}

typedef float v8f __attribute__((vector_size(32))); /* GCC/Clang vectors: AVX2 or SSE2 pairs */
typedef int32_t v8i __attribute__((vector_size(32)));
typedef struct { v8f s, ss, s3, s4, rs, rss, rs3, rs4, lo, hi, dev; v8i z, rz; } Lanes;

#define PICK(m, a, b) ((v8f)(((m) & (v8i)(a)) | (~(m) & (v8i)(b)))) /* lanes of a where m, else of b */

/* Eight values into the lane accumulators; lanes outside `valid` (a tail) count as nothing. No test
 * for NaN or Inf: they make the sum of squares NaN or Inf, and a lane whose sum of squares is not
 * finite is done again by `exact_values`, so the common loop stays short. Comparisons give -1 per
 * true lane, hence the subtractions. (Pointers, not vector arguments: the default-target build has no vector registers
 * of this size to pass them in.) */
INLINE void lanes_step(Lanes *l, const float *src, const v8i *validp, float centre, const int relu) {
    v8f v, c = {0}, zero = {0};
    v8i valid = *validp;
    memcpy(&v, src, sizeof v);
    c += centre;
    v8f vs = (v8f)((v8i)v & valid), d = (v8f)((v8i)(v - c) & 0x7fffffff);
    v8f sq = vs * vs;
    l->s += vs;
    l->ss += sq;
    l->s3 += sq * vs;
    l->s4 += sq * sq;
    l->lo = PICK(valid & (v < l->lo), v, l->lo);
    l->hi = PICK(valid & (v > l->hi), v, l->hi);
    l->dev = PICK(valid & (d < l->dev), d, l->dev);
    l->z -= (v == zero) & valid;
    if (relu) {
        v8f vp = PICK(vs > zero, vs, zero), vq = vp * vp;
        l->rs += vp;
        l->rss += vq;
        l->rs3 += vq * vp;
        l->rs4 += vq * vq;
        l->rz -= (v <= zero) & valid;
    }
}

/* Whether lane j's float sums stand: a finite sum of fourth powers means no NaN or Inf was met
 * and no power overflowed (above 4e9 in magnitude: those values are summed in double). */
INLINE int lane_ok(const Lanes *r, int j) {
    return is_finite(r->s4[j]);
}

/* [before, units, after] with after > 1 (NCHW and the like, and whole tensors as one unit): each
 * unit's contiguous runs in float lanes, at most 64 values a lane before their sums go to double:
 * 512 values of one run at a time, or a short run (a small feature map) over a block of rows at
 * once. Runs of 128 values or more are histogrammed each after its sums, while in cache;
 * shorter ones a block of rows at a time, first, in one go (which also brings the block into
 * cache). Extremes and zero counts stay in the lanes for the whole block, taken out once per unit. */
INLINE void runs(Hist *h, const float *x, int64_t before, int64_t units, int64_t after, float centre,
                 const Out *o, const int relu) {
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7}, all = lane >= 0;
    const int64_t span = after < RUN ? after : RUN, rows = 64 / ((span + 7) / 8); /* rows a block */
    const int each = span >= 128;
    for (int64_t i0 = 0; i0 < before; i0 += rows) {
        int64_t i1 = i0 + rows < before ? i0 + rows : before, row = units * after;
        if (h->on && !each) h->nan += count_bins(h->b, h->part, x + i0 * row, (i1 - i0) * row);
        for (int64_t u = 0; u < units; u++) {
            const float *p = x + i0 * row + u * after; /* unit u's run in row i0; row i is (i - i0) * row on */
            Lanes l = {.lo = {0}, .hi = {0}, .dev = {0}};
            l.lo += o->mn[u]; l.hi += o->mx[u]; l.dev += o->mindev[u];
            double s = 0, ss = 0, s3 = 0, s4 = 0, rs = 0, rss = 0, rs3 = 0, rs4 = 0;
            int64_t z = 0, rz = 0, finite = 0;
            for (int64_t a0 = 0; a0 < after; a0 += RUN) {
                int64_t n = a0 + RUN < after ? RUN : after - a0;
                const Lanes before_run = l; /* to go back to if these values must be done one by one */
                const v8f zero = {0};
                const v8i none = {0};
                l.s = l.ss = l.s3 = l.s4 = l.rs = l.rss = l.rs3 = l.rs4 = zero;
                l.z = l.rz = none;
                for (int64_t i = 0; i < i1 - i0; i++) {
                    const float *q = p + i * row + a0;
                    int64_t k = 0;
                    for (; k + 8 <= n; k += 8) lanes_step(&l, q + k, &all, centre, relu);
                    if (k < n) { /* the tail: a partial vector */
                        float t[8] = {0};
                        v8i valid = lane < (int32_t)(n - k);
                        memcpy(t, q + k, (n - k) * sizeof(float));
                        lanes_step(&l, t, &valid, centre, relu);
                    }
                }
                for (int64_t i = 0; h->on && each && i < i1 - i0; i++)
                    h->nan += count_bins(h->b, h->part, p + i * row + a0, n);
                const Lanes r = l; /* read lane by lane: a copy keeps l itself in registers */
                int ok = 1;
                for (int j = 0; j < 8; j++) ok &= lane_ok(&r, j);
                if (!ok) {
                    l = before_run;
                    for (int64_t i = 0; i < i1 - i0; i++) exact_values(p + i * row + a0, n, 1, centre, o, u, relu);
                    continue;
                }
                finite += n * (i1 - i0);
                for (int j = 0; j < 8; j++) {
                    s += r.s[j]; ss += r.ss[j]; s3 += r.s3[j]; s4 += r.s4[j]; z += r.z[j];
                    if (relu) { rs += r.rs[j]; rss += r.rss[j]; rs3 += r.rs3[j]; rs4 += r.rs4[j]; rz += r.rz[j]; }
                }
            }
            const Lanes r = l;
            for (int j = 0; j < 8; j++) {
                o->mn[u] = fminf(o->mn[u], r.lo[j]); o->mx[u] = fmaxf(o->mx[u], r.hi[j]);
                o->mindev[u] = fminf(o->mindev[u], r.dev[j]);
            }
            o->sum[u] += s; o->sumsq[u] += ss; o->cube[u] += s3; o->quart[u] += s4;
            o->zero[u] += z; o->finite[u] += finite;
            if (relu) {
                o->rsum[u] += rs; o->rsumsq[u] += rss; o->rzero[u] += rz; o->rcube[u] += rs3; o->rquart[u] += rs4;
            }
        }
    }
}

/* Lanes for columns u0 .. u0 + m - 1 (m <= 8) that start from those columns' extremes so far. */
INLINE Lanes lanes_from(const Out *o, int64_t u0, int m) {
    float t[3][8] = {{0}};
    Lanes l = {.lo = {0}};
    memcpy(t[0], o->mn + u0, m * sizeof(float));
    memcpy(t[1], o->mx + u0, m * sizeof(float));
    memcpy(t[2], o->mindev + u0, m * sizeof(float));
    memcpy(&l.lo, t[0], sizeof l.lo); memcpy(&l.hi, t[1], sizeof l.hi); memcpy(&l.dev, t[2], sizeof l.dev);
    return l;
}

/* Columns u0 .. u0 + m - 1 (m <= 8) of rows i0 .. i1 - 1, summed in the lanes `l`, into the outputs. */
INLINE void fold_columns(const Lanes *l, const float *x, int64_t i0, int64_t i1, int64_t units, int64_t u0, int m,
                         float centre, const Out *o, const int relu) {
    const Lanes r = *l; /* read lane by lane: a copy keeps the caller's lanes in registers */
    for (int j = 0; j < m; j++) {
        int64_t u = u0 + j;
        if (!lane_ok(&r, j)) {
            exact_values(x + i0 * units + u, i1 - i0, units, centre, o, u, relu);
            continue;
        }
        o->mn[u] = r.lo[j]; o->mx[u] = r.hi[j]; o->mindev[u] = r.dev[j];
        o->zero[u] += r.z[j]; o->finite[u] += i1 - i0;
        o->sum[u] += r.s[j]; o->sumsq[u] += r.ss[j]; o->cube[u] += r.s3[j]; o->quart[u] += r.s4[j];
        if (relu) {
            o->rzero[u] += r.rz[j]; o->rsum[u] += r.rs[j]; o->rsumsq[u] += r.rss[j];
            o->rcube[u] += r.rs3[j]; o->rquart[u] += r.rs4[j];
        }
    }
}

/* Dense [rows, units] (the unit axis last), a block of ROWS rows at a time: the block, contiguous,
 * is histogrammed in one call (which also brings it into cache), then sixteen columns at a time (a
 * cache line) walk down it with their sums in vector registers, a lane per column, then in double.
 * `relu` is a constant at each call. */
INLINE void dense(Hist *h, const float *x, int64_t rows, int64_t units, float centre, const Out *o,
                  const int relu) {
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7}, all = lane >= 0;
    for (int64_t i0 = 0; i0 < rows; i0 += ROWS) {
        int64_t i1 = i0 + ROWS < rows ? i0 + ROWS : rows;
        if (h->on) h->nan += count_bins(h->b, h->part, x + i0 * units, (i1 - i0) * units); /* the block is contiguous */
        else for (int64_t v = i0 * units; v < i1 * units; v += 16) __builtin_prefetch(x + v);
        for (int64_t u0 = 0; u0 < units; u0 += 16) {
            int left = units - u0 < 16 ? (int)(units - u0) : 16, m0 = left < 8 ? left : 8, m1 = left - m0;
            v8i valid0 = lane < m0, valid1 = lane < m1;
            Lanes a = lanes_from(o, u0, m0), b = lanes_from(o, u0 + m0, m1);
            for (int64_t i = i0; i < i1; i++) {
                const float *row = x + i * units + u0;
                if (left == 16) {
                    lanes_step(&a, row, &all, centre, relu);
                    lanes_step(&b, row + 8, &all, centre, relu);
                } else { /* the last columns: partial vectors */
                    float t[16] = {0};
                    memcpy(t, row, left * sizeof(float));
                    lanes_step(&a, t, &valid0, centre, relu);
                    lanes_step(&b, t + 8, &valid1, centre, relu);
                }
            }
            fold_columns(&a, x, i0, i1, units, u0, m0, centre, o, relu);
            fold_columns(&b, x, i0, i1, units, u0 + m0, m1, centre, o, relu);
        }
    }
}

typedef struct { /* one tensor's reduction, cut into `pieces` along `before` (or along `after` when
                  * before and units are 1) that threads take apart; outputs have a row per piece */
    const float *x;
    int64_t before, units, after;
    float centre;
    int32_t pieces, relu, hist;
    int32_t done;     /* pieces finished: the last one merges the rows into row 0 */
    double *f64;      /* per piece: sum, sumsq, rsum, rsumsq, cube, quart, rcube, rquart (each `units` long) */
    float *f32;       /* per piece: min, max, min |x - centre| */
    int64_t *i64;     /* per piece: zero, finite, rzero, then hist (n_bins, untouched without it) and nan, inf */
    double *totals;   /* or NULL: the whole tensor's TOTALS */
} Job;

typedef struct { Bins bins; Job *jobs; int64_t n, next; } Batch;

/* One piece of a job into its row. Non-finite values are kept out of every statistic and counted
 * as NaN or ±inf; rsum, rsumsq and rzero are the sums of relu(x) over finite values and how many
 * finite values are <= 0. */
CLONED static void reduce_piece(const Bins *b, const Job *j, int64_t k) {
    int64_t units = j->units, wide = 3 * units + b->n_bins + 2;
    int along_before = j->before >= j->pieces;
    int64_t span = along_before ? j->before : j->after, lo = span * k / j->pieces, hi = span * (k + 1) / j->pieces;
    int64_t before = along_before ? hi - lo : j->before, after = along_before ? j->after : hi - lo;
    const float *x = j->x + lo * (along_before ? units * j->after : 1);
    double *d = j->f64 + F64_ROWS * units * k;
    float *f = j->f32 + 3 * units * k;
    int64_t *i = j->i64 + wide * k, *hist = j->hist ? i + 3 * units : NULL, *nan_inf = i + wide - 2;
    for (int64_t u = 0; u < units; u++) { f[u] = INFINITY; f[units + u] = -INFINITY; f[2 * units + u] = INFINITY; }
    memset(d, 0, sizeof *d * F64_ROWS * units); /* the row is this piece's own: the caller need not zero it */
    memset(i, 0, sizeof *i * 3 * units);
    Out o = {d, d + units, d + 2 * units, d + 3 * units, f, f + units, f + 2 * units, i, i + units, i + 2 * units,
             d + 4 * units, d + 5 * units, d + 6 * units, d + 7 * units};
    int64_t part[4][MAX_BINS];
    if (hist) memset(part, 0, sizeof part); /* 5 KiB: untouched without a histogram */
    Hist h = {b, part, hist != NULL, 0};
    int64_t total = before * units * after, fin_total = 0, nan;
    if (after == 1 && j->relu) {
        dense(&h, x, before, units, j->centre, &o, 1);
    } else if (after == 1) {
        dense(&h, x, before, units, j->centre, &o, 0);
    } else if (j->relu) {
        runs(&h, x, before, units, after, j->centre, &o, 1);
    } else {
        runs(&h, x, before, units, after, j->centre, &o, 0);
    }
    nan = h.nan;
    if (hist)
        for (int bin = 0; bin < b->n_bins; bin++) hist[bin] = part[0][bin] + part[1][bin] + part[2][bin] + part[3][bin];
    for (int64_t u = 0; u < units; u++) fin_total += o.finite[u];
    if (!hist) { /* NaN and Inf apart need a look at the non-finite values */
        for (int64_t v = 0; v < total && fin_total + nan < total; v++) nan += isnan(x[v]);
    }
    nan_inf[0] = nan;
    nan_inf[1] = total - fin_total - nan;
}

/* Row 0 takes every piece's row (sums and counts add, extremes take the extreme); a unit with no
 * finite value gets NaN extremes (spec). */
static void merge_rows(const Bins *b, Job *j) {
    int64_t units = j->units, wide = 3 * units + b->n_bins + 2;
    for (int64_t k = 1; k < j->pieces; k++) {
        const double *d = j->f64 + F64_ROWS * units * k;
        const float *f = j->f32 + 3 * units * k;
        const int64_t *i = j->i64 + wide * k;
        for (int64_t u = 0; u < F64_ROWS * units; u++) j->f64[u] += d[u];
        for (int64_t u = 0; u < units; u++) {
            j->f32[u] = fminf(j->f32[u], f[u]);
            j->f32[units + u] = fmaxf(j->f32[units + u], f[units + u]);
            j->f32[2 * units + u] = fminf(j->f32[2 * units + u], f[2 * units + u]);
        }
        for (int64_t u = 0; u < wide; u++) /* without a histogram, its bins hold what they held */
            if (j->hist || u < 3 * units || u >= wide - 2) j->i64[u] += i[u];
    }
    for (int64_t u = 0; u < units; u++)
        if (j->i64[units + u] == 0) j->f32[u] = j->f32[units + u] = j->f32[2 * units + u] = NAN;
    if (j->totals) { /* the layer's totals, so the caller need not reduce every column again */
        double t[TOTALS] = {0, 0, 0, 0, NAN, NAN, 0, (double)j->i64[wide - 2], (double)j->i64[wide - 1]};
        for (int64_t u = 0; u < units; u++) {
            t[0] += j->f64[u]; t[1] += j->f64[units + u]; t[2] += j->f64[4 * units + u]; t[3] += j->f64[5 * units + u];
            t[4] = fmin(t[4], j->f32[u]); t[5] = fmax(t[5], j->f32[units + u]); /* a unit's NaN is passed over */
            t[6] += (double)j->i64[u];
        }
        memcpy(j->totals, t, sizeof t);
    }
}

/* Take pieces of jobs until none is left. Any number of threads may run it on one batch at once:
 * a framework's OpenMP team (through GOMP_parallel, whose signature this has) or Python threads. */
void actrace_run_batch(void *data) {
    Batch *batch = data;
    int64_t job = 0, before = 0; /* the job of this thread's last piece and the pieces of the jobs before it */
    for (;;) {
        int64_t i = __atomic_fetch_add(&batch->next, 1, __ATOMIC_RELAXED); /* never before the last one taken */
        while (job < batch->n && i - before >= batch->jobs[job].pieces) before += batch->jobs[job++].pieces;
        if (job >= batch->n) return;
        Job *j = &batch->jobs[job];
        reduce_piece(&batch->bins, j, i - before);
        if (__atomic_add_fetch(&j->done, 1, __ATOMIC_ACQ_REL) == j->pieces) merge_rows(&batch->bins, j);
    }
}

/* An attention's scores [B, H, Q, K], contiguous: per query and head its largest logit over the
 * keys it may attend (a key past `reach` keys after the query's own position, or one any head
 * scores at or below `lowest`, is left out for every head), the entropy of its softmax over them
 * over ln(keys) (in nats, log Z minus the expected logit, both about the peak; 2 keys or more), and
 * its softmax's mass on the first key it may attend, each [B, Q, H]; per query, how many keys it
 * may attend. A NaN score makes its query and head NaN, as the numpy definition
 * (actrace/reduce/derived.py). `reach` 0 is SDPA's causal mask; K or more, none. */
typedef struct {
    const float *x;
    int64_t batch, heads, queries, keys, reach;
    float lowest;
    float *peak, *entropy, *sink; /* [B, Q, H] */
    int64_t *n;                   /* [B, Q] */
    int64_t next;                 /* queries taken by the threads so far (QUERIES at a time) */
} Scores;

/* e^x for x in [-87.3, 0], eight at a time, into *y: Cephes' expf (a degree-6 polynomial about
 * the nearest power of two), within 2 float ulps, and no library call, so it stays in vector
 * registers. (Pointers, as `lanes_step`.) */
INLINE void exp_lanes(const v8f *xp, v8f *out) {
    const v8f zero = {0}, x = *xp;
    v8f t = x * 1.44269504088896341f - 0.5f; /* x <= 0: truncating x·log2(e) - 1/2 rounds it */
    v8i n = __builtin_convertvector(t, v8i);
    v8f fn = __builtin_convertvector(n, v8f);
    v8f r = x - fn * 0.693359375f - fn * -2.12194440e-4f;
    v8f p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v8f y = p * r * r + r + 1.0f;
    *out = y * (v8f)((n + 127) << 23);
}

/* Eight scores of a row from k on into *v, and in *live which of them count: those `keep` marks,
 * within the row's K. */
INLINE void load_scores(const float *row, const int32_t *keep, int64_t k, int64_t K, v8f *v, v8i *live) {
    if (k + 8 <= K) {
        memcpy(v, row + k, sizeof *v);
        memcpy(live, keep + k, sizeof *live);
        return;
    }
    float t[8] = {0};
    int32_t m[8] = {0};
    memcpy(t, row + k, (K - k) * sizeof(float));
    memcpy(m, keep + k, (K - k) * sizeof(int32_t));
    memcpy(v, t, sizeof *v);
    memcpy(live, m, sizeof *live);
}

/* One query of one sequence: its keys' mask from every head, then each head's row in two passes
 * (the peak, then the exponentials' sums), the row in cache the second time. `keep` holds K ints. */
CLONED static void score_query(const Scores *s, int64_t b, int64_t q, int32_t *keep) {
    const int64_t K = s->keys, H = s->heads, Q = s->queries, last = q + s->reach; /* the last key it may attend */
    const int64_t span = last + 1 < K ? last + 1 : K; /* keys past `last` are never kept: not read */
    const float lowest = s->lowest;
    int64_t n = 0, first = -1;
    for (int64_t k = 0; k < K; k++) keep[k] = -(int32_t)(k <= last);
    for (int64_t h = 0; h < H; h++) {
        const float *row = s->x + ((b * H + h) * Q + q) * K;
        for (int64_t k = 0; k < K; k++) keep[k] &= -(int32_t)!(row[k] <= lowest); /* NaN is kept: it is read */
    }
    for (int64_t k = 0; k < K; k++) n -= keep[k];
    for (int64_t k = 0; k < K && first < 0; k++) first = keep[k] ? k : -1;
    s->n[b * Q + q] = n;
    for (int64_t h = 0; h < H; h++) {
        const float *row = s->x + ((b * H + h) * Q + q) * K;
        const int64_t out = (b * Q + q) * H + h;
        v8f hi = {0}, sum = {0}, dot = {0}, floor = {0}, v;
        v8i bad = {0}, live;
        hi -= INFINITY;
        floor -= 87.0f; /* e^-87 adds nothing, and stays a normal float */
        for (int64_t k = 0; k < span; k += 8) {
            load_scores(row, keep, k, K, &v, &live);
            bad |= live & (v != v);
            hi = PICK(live & (v > hi), v, hi);
        }
        float peak = -INFINITY;
        int nan = 0;
        for (int j = 0; j < 8; j++) { peak = hi[j] > peak ? hi[j] : peak; nan |= bad[j] != 0; }
        s->peak[out] = nan ? NAN : peak;
        if (nan || n == 0 || !is_finite(peak)) {
            s->entropy[out] = s->sink[out] = NAN;
            continue;
        }
        for (int64_t k = 0; k < span; k += 8) {
            v8f d, e;
            load_scores(row, keep, k, K, &v, &live);
            d = v - peak;
            d = PICK(d > floor, d, floor);
            exp_lanes(&d, &e);
            e = (v8f)((v8i)e & live);
            sum += e;
            dot += e * d;
        }
        double total = 0, expected = 0;
        for (int j = 0; j < 8; j++) { total += sum[j]; expected += dot[j]; }
        float d0 = row[first] - peak;
        double nats = log(total) - expected / total; /* log Z - E[x], both about the peak */
        s->entropy[out] = (float)((nats > 0 ? nats : 0) / log(n < 2 ? 2.0 : (double)n));
        s->sink[out] = (float)(exp(d0 > -87.0f ? d0 : -87.0f) / total);
    }
}

#define QUERIES 16 /* queries a thread takes at once: a shared counter bumped per query kept the two
                     * threads waiting on its cache line (2 threads 1.3x one; 1.9x taking 16) */
/* Take queries until none is left; any number of threads at once, as `actrace_run_batch`. */
void actrace_scores(void *data) {
    Scores *s = data;
    const int64_t total = s->batch * s->queries;
    int32_t *keep = malloc(s->keys * sizeof(int32_t));
    if (!keep) return;
    for (;;) {
        int64_t i = __atomic_fetch_add(&s->next, QUERIES, __ATOMIC_RELAXED);
        if (i >= total) break;
        for (int64_t end = i + QUERIES < total ? i + QUERIES : total; i < end; i++)
            score_query(s, i / s->queries, i % s->queries, keep);
    }
    free(keep);
}

/* What kernel.py's ctypes mirror must match, checked there at import: the constants, then the size
 * and field offsets of Bins, Job and Batch in declaration order. */
static const int64_t layout[] = {
    KEY_SHIFT, EXACT, MAX_BINS, F64_ROWS, TOTALS,
    sizeof(Bins), offsetof(Bins, key_bin), offsetof(Bins, edges), offsetof(Bins, n_edges), offsetof(Bins, zero_bin),
    offsetof(Bins, n_bins),
    sizeof(Job), offsetof(Job, x), offsetof(Job, before), offsetof(Job, units), offsetof(Job, after),
    offsetof(Job, centre), offsetof(Job, pieces), offsetof(Job, relu), offsetof(Job, hist), offsetof(Job, done),
    offsetof(Job, f64), offsetof(Job, f32), offsetof(Job, i64), offsetof(Job, totals),
    sizeof(Batch), offsetof(Batch, bins), offsetof(Batch, jobs), offsetof(Batch, n), offsetof(Batch, next),
    sizeof(Scores), offsetof(Scores, x), offsetof(Scores, batch), offsetof(Scores, heads), offsetof(Scores, queries),
    offsetof(Scores, keys), offsetof(Scores, reach), offsetof(Scores, lowest), offsetof(Scores, peak), offsetof(Scores, entropy),
    offsetof(Scores, sink), offsetof(Scores, n), offsetof(Scores, next),
};

const int64_t *actrace_layout(int64_t *n) {
    *n = sizeof layout / sizeof *layout;
    return layout;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernel", "actrace's fused reduction kernel", -1, NULL};

PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&module); }
