/* The fused mask step on the CPU: one pass over a weight in forward, one in backward.
 *
 * The same arithmetic as patchc/masking/fused.py (forward_core / backward_core) for a contiguous (N, K)
 * weight in fp32 or bf16, fp32 logits (groups, 6) or scores (groups, 4), fp32 Gumbel noise (groups, 6)
 * and an fp32 (Tn, Tk) tile mask. Built and loaded by patchc/masking/native.py.
 *
 * Speed: 8 groups at a time in GCC/Clang vector types (one AVX2 register per pattern; plain SSE or NEON
 * pairs elsewhere), with a polynomial exp (Cephes expf, ~2 ulp) instead of a libm call per value; the
 * layout choices (scores or pattern logits, hard, tile mask, bf16, frozen) are compile-time constants of
 * `always_inline` functions, so the specialised loops do not branch. Rows are split across OpenMP
 * threads in whole tile rows, so each thread owns the tiles it accumulates into. Results match the torch
 * path to a few fp32 ulps (products round as torch's: -ffp-contract=off).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Flush denormals to zero inside the loops: late in training the softmax saturates, its products fall
 * below 1e-38, and denormal arithmetic ran the whole step ~5x slower. Values that small are 0 to Adam. */
#if defined(__x86_64__) || defined(__SSE__)
#include <xmmintrin.h>
#define FTZ_ON const unsigned int csr_ = _mm_getcsr(); _mm_setcsr(csr_ | 0x8040u);
#define FTZ_OFF _mm_setcsr(csr_);
#else
#define FTZ_ON
#define FTZ_OFF
#endif

#define INLINE static inline __attribute__((always_inline))
#define L 8 /* groups per vector */

typedef float v8f __attribute__((vector_size(4 * L)));
typedef int32_t v8i __attribute__((vector_size(4 * L)));

/* Pattern p keeps positions PA(p), PB(p); position i is kept by the 3 patterns COVER[i]. */
#define PA(p) ((p) < 3 ? 0 : (p) < 5 ? 1 : 2)
#define PB(p) ((p) == 0 ? 1 : (p) == 1 || (p) == 3 ? 2 : 3)
static const int COVER[4][3] = {{0, 1, 2}, {0, 3, 4}, {1, 3, 5}, {2, 4, 5}};

INLINE v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
INLINE v8f pick(v8i m, v8f a, v8f b) { return (v8f)((m & (v8i)a) | (~m & (v8i)b)); }

INLINE v8f vexp(v8f x) { /* x <= 0: Cephes expf; 0 below -87 (the fp32 exp underflows near -103) */
    const v8i under = x < splat(-87.0f);
    const v8f z = pick(under, splat(-87.0f), x);
    const v8f n = (z * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    v8f r = z - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v8f p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    return pick(under, splat(0.0f), p * (v8f)e);
}

INLINE float load_w(const void *w, const int bf16, int64_t i) {
    if (!bf16) return ((const float *)w)[i];
    union { uint32_t u; float f; } v = {(uint32_t)((const uint16_t *)w)[i] << 16};
    return v.f;
}

INLINE void store_w(void *w, const int bf16, int64_t i, float x) {
    if (!bf16) { ((float *)w)[i] = x; return; }
    union { float f; uint32_t u; } v = {x};
    ((uint16_t *)w)[i] = (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16); /* nearest even */
}

/* Lane q = p[q * stride] (groups are rows of `stride` values). */
INLINE v8f gather(const float *p, const int stride) {
    v8f v;
    for (int q = 0; q < L; q++) v[q] = p[q * stride];
    return v;
}

INLINE v8f gather_w(const void *w, const int bf16, int64_t base) {
    v8f v;
    for (int q = 0; q < L; q++) v[q] = load_w(w, bf16, base + 4 * q);
    return v;
}

/* Soft pattern probabilities s[6] of 8 groups and their forward 2:4 mask m24[4] (one-hot argmax if hard). */
INLINE void sample8(const float *lg, const float *gu, const int ncols, float kappa, float tau, const int hard,
                    v8f s[6], v8f m24[4]) {
    v8f y[6], mx, arg = splat(0.0f), total = splat(0.0f);
    for (int j = 0; j < 6; j++) {
        const v8f p = ncols == 4 ? gather(lg + PA(j), 4) + gather(lg + PB(j), 4) : gather(lg + j, 6);
        y[j] = (p * kappa + gather(gu + j, 6)) / tau;
    }
    mx = y[0];
    for (int j = 1; j < 6; j++) { /* first index of the max, like torch.argmax */
        const v8i gt = y[j] > mx;
        arg = pick(gt, splat((float)j), arg);
        mx = pick(gt, y[j], mx);
    }
    for (int j = 0; j < 6; j++) {
        s[j] = vexp(y[j] - mx);
        total += s[j];
    }
    const v8f inv = 1.0f / total;
    for (int j = 0; j < 6; j++) s[j] *= inv;
    for (int i = 0; i < 4; i++) {
        const int a = COVER[i][0], b = COVER[i][1], c = COVER[i][2];
        if (hard) {
            const v8i kept = (arg == splat((float)a)) | (arg == splat((float)b)) | (arg == splat((float)c));
            m24[i] = pick(kept, splat(1.0f), splat(0.0f));
        } else {
            m24[i] = s[a] + s[b] + s[c];
        }
    }
}

INLINE void keep8(const uint8_t *keep, v8f m24[4]) {
    for (int i = 0; i < 4; i++)
        for (int q = 0; q < L; q++) m24[i][q] = (float)keep[4 * q + i];
}

/* Pointers of 8 groups: logits, noise, keep, weight, grad / out at group g (offsets in elements). */
typedef struct {
    const float *lg, *gu;
    const uint8_t *keep;
    const void *w, *go;
    void *out;
    float *dl;
    int64_t wi; /* element index of the group's first weight in w / go / out */
} Block;

INLINE v8f forward8(Block b, v8f t, float kappa, float tau, const int ncols, const int hard, const int has_mt,
                    const int bf16, const int frozen) {
    v8f s[6], m24[4], sq = splat(0.0f);
    if (frozen) keep8(b.keep, m24);
    else sample8(b.lg, b.gu, ncols, kappa, tau, hard, s, m24);
    for (int i = 0; i < 4; i++) {
        const v8f m = has_mt ? t + (1.0f - t) * m24[i] : m24[i];
        const v8f x = gather_w(b.w, bf16, b.wi + i) * m;
        for (int q = 0; q < L; q++) store_w(b.out, bf16, b.wi + i + 4 * q, x[q]);
        sq += x * x;
    }
    return sq;
}

/* Returns sum_i d_m * (1 - m24) per group (the tile gradient's part); writes the logit gradients. */
INLINE v8f backward8(Block b, v8f t, float two_gsq, float kappa, float tau, const int ncols, const int hard,
                     const int has_mt, const int bf16, const int frozen) {
    v8f s[6], m24[4], d[4], part = splat(0.0f);
    if (frozen) keep8(b.keep, m24);
    else sample8(b.lg, b.gu, ncols, kappa, tau, hard, s, m24);
    for (int i = 0; i < 4; i++) {
        const v8f wf = gather_w(b.w, bf16, b.wi + i);
        const v8f m = has_mt ? t + (1.0f - t) * m24[i] : m24[i];
        d[i] = gather_w(b.go, bf16, b.wi + i) * wf + two_gsq * wf * wf * m;
        part += d[i] * (1.0f - m24[i]);
    }
    if (frozen) return part;
    v8f ds[6], dot = splat(0.0f);
    for (int j = 0; j < 6; j++) {
        ds[j] = has_mt ? d[PA(j)] * (1.0f - t) + d[PB(j)] * (1.0f - t) : d[PA(j)] + d[PB(j)];
        dot += s[j] * ds[j];
    }
    const float scale = kappa / tau;
    for (int j = 0; j < 6; j++) ds[j] = s[j] * (ds[j] - dot) * scale; /* the pattern-logit gradient */
    if (ncols == 4) {
        for (int i = 0; i < 4; i++) {
            const v8f g = ds[COVER[i][0]] + ds[COVER[i][1]] + ds[COVER[i][2]];
            for (int q = 0; q < L; q++) b.dl[4 * q + i] = g[q];
        }
    } else {
        for (int j = 0; j < 6; j++)
            for (int q = 0; q < L; q++) b.dl[6 * q + j] = ds[j][q];
    }
    return part;
}

/* A row's last nb < 8 groups: copied into zero-padded buffers, run as 8, copied back. */
typedef struct {
    float lg[6 * L], gu[6 * L], w[4 * L], go[4 * L], out[4 * L], dl[6 * L];
    uint8_t keep[4 * L];
} Tail;

INLINE Block pad(Block b, Tail *t, int nb, const int ncols, const int bf16, const int frozen, const int want_go) {
    const size_t ws = bf16 ? 2 : 4;
    memset(t, 0, sizeof *t);
    if (frozen) memcpy(t->keep, b.keep, (size_t)4 * nb);
    else { memcpy(t->lg, b.lg, sizeof(float) * ncols * nb); memcpy(t->gu, b.gu, sizeof(float) * 6 * nb); }
    memcpy(t->w, (const char *)b.w + ws * b.wi, ws * 4 * nb);
    if (want_go) memcpy(t->go, (const char *)b.go + ws * b.wi, ws * 4 * nb);
    return (Block){t->lg, t->gu, t->keep, t->w, t->go, t->out, t->dl, 0};
}

/* tcol[c] = the tile mask value of column group c of row r (0 without a tile mask, and in the padding). */
static void tile_row(const float *mt, int64_t r, int64_t kg, int64_t tk, int64_t b1, int64_t b2, float *tcol) {
    memset(tcol + kg, 0, L * sizeof(float));
    if (!mt) { memset(tcol, 0, (size_t)kg * sizeof(float)); return; }
    const float *row = mt + (r / b1) * tk;
    for (int64_t c = 0, per = b2 / 4; c < kg; c += per) /* b2 is a multiple of 4: a tile holds whole groups */
        for (int64_t q = c; q < c + per && q < kg; q++) tcol[q] = row[c / per];
}

INLINE v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE double forward_row(const void *w, const float *logits, const uint8_t *keep, const float *gumbel,
                          const float *tcol, void *out, int64_t r, int64_t kg, float kappa, float tau, const int ncols,
                          const int hard, const int has_mt, const int bf16, const int frozen) {
    v8f sq = splat(0.0f);
    int64_t c = 0;
    for (; c + L <= kg; c += L) {
        const int64_t g = r * kg + c;
        const Block b = {logits + g * ncols, gumbel + 6 * g, keep + 4 * g, w, NULL, out, NULL, 4 * g};
        sq += forward8(b, load8(tcol + c), kappa, tau, ncols, hard, has_mt, bf16, frozen);
    }
    if (c < kg) {
        const int nb = (int)(kg - c);
        const int64_t g = r * kg + c;
        Tail t;
        const Block b = pad((Block){logits + g * ncols, gumbel + 6 * g, keep + 4 * g, w, NULL, out, NULL, 4 * g},
                            &t, nb, ncols, bf16, frozen, 0);
        sq += forward8(b, load8(tcol + c), kappa, tau, ncols, hard, has_mt, bf16, frozen); /* padding: w = 0 */
        memcpy((char *)out + (bf16 ? 2 : 4) * 4 * g, t.out, (size_t)(bf16 ? 2 : 4) * 4 * nb);
    }
    double total = 0.0;
    for (int q = 0; q < L; q++) total += sq[q];
    return total;
}

INLINE void backward_row(const void *grad_out, float two_gsq, const void *w, const float *logits, const uint8_t *keep,
                         const float *gumbel, const float *tcol, float *part, float *d_logits, int64_t r, int64_t kg,
                         float kappa, float tau, const int ncols, const int hard, const int has_mt, const int bf16,
                         const int frozen) {
    int64_t c = 0;
    for (; c + L <= kg; c += L) {
        const int64_t g = r * kg + c;
        const Block b = {logits + g * ncols, gumbel + 6 * g, keep + 4 * g, w, grad_out, NULL,
                         frozen ? NULL : d_logits + g * ncols, 4 * g};
        const v8f p = backward8(b, load8(tcol + c), two_gsq, kappa, tau, ncols, hard, has_mt, bf16, frozen);
        memcpy(part + c, &p, sizeof p);
    }
    if (c < kg) {
        const int nb = (int)(kg - c);
        const int64_t g = r * kg + c;
        Tail t;
        const Block b = pad((Block){logits + g * ncols, gumbel + 6 * g, keep + 4 * g, w, grad_out, NULL, NULL, 4 * g},
                            &t, nb, ncols, bf16, frozen, 1);
        const v8f p = backward8(b, load8(tcol + c), two_gsq, kappa, tau, ncols, hard, has_mt, bf16, frozen);
        for (int q = 0; q < nb; q++) part[c + q] = p[q];
        if (!frozen) memcpy(d_logits + g * ncols, t.dl, sizeof(float) * ncols * nb);
    }
}

/* One specialised row function per (ncols, hard, has_mt, bf16), or per (has_mt, bf16) for the frozen
 * tile-only mask: the flags become constants. */
#define SPECIALISE(CALL)                                                                                   \
    if (keep) {                                                                                            \
        switch (has_mt | bf16 << 1) {                                                                      \
        case 0: CALL(6, 0, 0, 0, 1); break; case 1: CALL(6, 0, 1, 0, 1); break;                           \
        case 2: CALL(6, 0, 0, 1, 1); break; default: CALL(6, 0, 1, 1, 1); break;                          \
        }                                                                                                  \
    } else {                                                                                               \
        switch ((ncols == 4) | hard << 1 | has_mt << 2 | bf16 << 3) {                                      \
        case 0: CALL(6, 0, 0, 0, 0); break;  case 1: CALL(4, 0, 0, 0, 0); break;                          \
        case 2: CALL(6, 1, 0, 0, 0); break;  case 3: CALL(4, 1, 0, 0, 0); break;                          \
        case 4: CALL(6, 0, 1, 0, 0); break;  case 5: CALL(4, 0, 1, 0, 0); break;                          \
        case 6: CALL(6, 1, 1, 0, 0); break;  case 7: CALL(4, 1, 1, 0, 0); break;                          \
        case 8: CALL(6, 0, 0, 1, 0); break;  case 9: CALL(4, 0, 0, 1, 0); break;                          \
        case 10: CALL(6, 1, 0, 1, 0); break; case 11: CALL(4, 1, 0, 1, 0); break;                         \
        case 12: CALL(6, 0, 1, 1, 0); break; case 13: CALL(4, 0, 1, 1, 0); break;                         \
        case 14: CALL(6, 1, 1, 1, 0); break; default: CALL(4, 1, 1, 1, 0); break;                         \
        }                                                                                                  \
    }

/* out = W * (mt + (1 - mt) * m24); *sq = ||out||^2 (before rounding to W's dtype). `keep` (the frozen 0/1
 * 2:4 mask of the tile-only variant) replaces logits and noise when not NULL. */
void mask_forward(const void *w, int bf16, const float *logits, int ncols, const uint8_t *keep, const float *gumbel,
                  const float *mt, int64_t n, int64_t k, int64_t b1, int64_t b2, float kappa, float tau, int hard,
                  void *out, double *sq, int threads) {
    const int64_t kg = k / 4, tk = (k + b2 - 1) / b2, rows_per = mt ? b1 : 16;
    const int64_t blocks = (n + rows_per - 1) / rows_per;
    const int has_mt = mt != NULL;
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        FTZ_ON
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            float *tcol = malloc((size_t)(kg + L) * sizeof(float));
            const int64_t r_end = (blk + 1) * rows_per < n ? (blk + 1) * rows_per : n;
            for (int64_t r = blk * rows_per; r < r_end; r++) {
                tile_row(mt, r, kg, tk, b1, b2, tcol);
#define FWD(NC, H, M, B, F) total += forward_row(w, logits, keep, gumbel, tcol, out, r, kg, kappa, tau, NC, H, M, B, F)
                SPECIALISE(FWD)
#undef FWD
            }
            free(tcol);
        }
        FTZ_OFF
    }
    if (sq) *sq = total;
}

/* d_logits (groups, ncols) and d_mt (Tn, Tk) of the draw mask_forward made (either may be NULL). */
void mask_backward(const void *grad_out, float grad_sq, const void *w, int bf16, const float *logits, int ncols,
                   const uint8_t *keep, const float *gumbel, const float *mt, int64_t n, int64_t k, int64_t b1, int64_t b2,
                   float kappa, float tau, int hard, float *d_logits, float *d_mt, int threads) {
    const int64_t kg = k / 4, tk = (k + b2 - 1) / b2, rows_per = mt ? b1 : 16;
    const int64_t blocks = (n + rows_per - 1) / rows_per;
    const int has_mt = mt != NULL;
    const float two_gsq = 2.0f * grad_sq;
#pragma omp parallel num_threads(threads)
    {
        FTZ_ON
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            float *tcol = malloc((size_t)(2 * kg + L) * sizeof(float)), *part = tcol + kg + L;
            double *acc = calloc((size_t)tk, sizeof(double));
            const int64_t r_end = (blk + 1) * rows_per < n ? (blk + 1) * rows_per : n;
            for (int64_t r = blk * rows_per; r < r_end; r++) {
                tile_row(mt, r, kg, tk, b1, b2, tcol);
#define BWD(NC, H, M, B, F) \
    backward_row(grad_out, two_gsq, w, logits, keep, gumbel, tcol, part, d_logits, r, kg, kappa, tau, NC, H, M, B, F)
                SPECIALISE(BWD)
#undef BWD
                for (int64_t c = 0, per = b2 / 4, j = 0; c < kg; c += per, j++)
                    for (int64_t q = c; q < c + per && q < kg; q++) acc[j] += part[q];
            }
            if (d_mt) /* this block is exactly tile row `blk` */
                for (int64_t j = 0; j < tk; j++) d_mt[blk * tk + j] = (float)acc[j];
            free(acc);
            free(tcol);
        }
        FTZ_OFF
    }
}
