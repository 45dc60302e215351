"""The C source of the invariant mode's CPU row sums: one pass per row computing each element's
u = (x - shift)·scale2 (fp32, as the torch tiles), e = 2^u by a fixed polynomial, and adding e and
e·max(u, floor) rounded to 64-bit fixed point (units of 2^-44) into integer sums.

Each element goes through one function made of IEEE +, -, ·, comparisons and bit operations only,
compiled without contraction (``-ffp-contract=off``): a vector lane and the scalar remainder loop
give it the same bits wherever it sits, whatever the instruction set; integer sums ignore order.
The marked columns' terms are subtracted after the row by the same function (exact). The rows
are split over torch's thread count (OpenMP), each row one thread's whole, so the split never shows.
"""

SOURCE = r"""
#include <stdint.h>
#include <string.h>

#define GRAIN 65536 /* elements per thread, at least */

#define MAGIC 384.0 /* v in [-1, 1] plus 1.5 * 2^8: doubles stepping by 2^-44 */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint64_t d2u(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }

/* 2^u for u <= 0: u = n + f, f in [-1/2, 1/2], a degree-7 polynomial times 2^n (u clamped to
   -100, whose 2^u rounds to 0 in fixed point anyway) */
static inline float exp2_neg(float u) {
    u = u < -100.0f ? -100.0f : u;
    float t = u + 12582912.0f;
    float n = t - 12582912.0f;
    float f = u - n;
    float p = 1.5252734e-05f;
    p = p * f + 1.5403530e-04f;
    p = p * f + 1.3333558e-03f;
    p = p * f + 9.6181291e-03f;
    p = p * f + 5.5504109e-02f;
    p = p * f + 2.4022651e-01f;
    p = p * f + 6.9314718e-01f;
    p = p * f + 1.0f;
    uint32_t ni = f2u(t) - f2u(12582912.0f);
    return p * u2f((ni + 127u) << 23);
}

/* one element's two terms, as the doubles' bits (MAGIC + value in units of 2^-44) */
static inline void terms(float x, float m, float s, float lo, uint64_t *e_bits, uint64_t *m_bits) {
    float u = (x - m) * s;
    float e = exp2_neg(u);
    float uc = u < lo ? lo : u;
    *e_bits = d2u((double)e + MAGIC);
    *m_bits = d2u((double)(e * uc) + MAGIC);
}

static inline float at(const void *row, int bf16, int64_t j) {
    if (bf16) return u2f((uint32_t)((const uint16_t *)row)[j] << 16);
    return ((const float *)row)[j];
}

/* rows of x (fp32, or bf16 when bf16 != 0; row_stride elements apart, cols real columns):
   rest[r] += sum of e, moment[r] += sum of e * max(u, lo) (NULL: not wanted), in units of 2^-44,
   over the columns not marked: local [rows, k] columns, counted where inside [rows, k] != 0
   (a column marked twice counts once) */
static void row_range(const void *x, int bf16, int64_t row_stride, int64_t first, int64_t rows, int64_t cols,
                      const float *shift, const float *scale2, float lo, const int64_t *local,
                      const uint8_t *inside, int64_t k, int64_t *rest, int64_t *moment) {
    const uint64_t offset = d2u(MAGIC);
    for (int64_t r = first; r < rows; r++) {
        const float m = shift[r], s = scale2[r];
        uint64_t acc = 0, acc_m = 0, a, b;
        if (bf16) {
            const uint16_t *row = (const uint16_t *)x + r * row_stride;
            for (int64_t j = 0; j < cols; j++) {
                terms(u2f((uint32_t)row[j] << 16), m, s, lo, &a, &b);
                acc += a;
                acc_m += b;
            }
        } else {
            const float *row = (const float *)x + r * row_stride;
            for (int64_t j = 0; j < cols; j++) {
                terms(row[j], m, s, lo, &a, &b);
                acc += a;
                acc_m += b;
            }
        }
        uint64_t counted = (uint64_t)cols;
        const void *row = bf16 ? (const void *)((const uint16_t *)x + r * row_stride)
                               : (const void *)((const float *)x + r * row_stride);
        for (int64_t i = 0; i < k; i++) {
            int64_t c = local[r * k + i];
            int seen = !inside[r * k + i];
            for (int64_t p = 0; p < i && !seen; p++)
                seen = inside[r * k + p] && local[r * k + p] == c;
            if (seen) continue;
            terms(at(row, bf16, c), m, s, lo, &a, &b);
            acc -= a;
            acc_m -= b;
            counted -= 1;
        }
        rest[r] += (int64_t)(acc - counted * offset);
        if (moment) moment[r] += (int64_t)(acc_m - counted * offset);
    }
}

/* rows split over up to `threads` OpenMP threads (torch's own pool: libgomp.so.1 is already loaded by
   torch), each row one thread's whole, so its bits do not see the split; serial when built without
   OpenMP */
void invariant_row_sums(const void *x, int bf16, int64_t row_stride, int64_t rows, int64_t cols,
                        const float *shift, const float *scale2, float lo, const int64_t *local,
                        const uint8_t *inside, int64_t k, int64_t *rest, int64_t *moment, int threads) {
    int64_t n = threads < 1 ? 1 : threads;
    int64_t most = rows * cols / GRAIN; /* threads only for work worth one */
    if (n > most) n = most > 0 ? most : 1;
    if (n > rows) n = rows > 0 ? rows : 1;
    if (n == 1) {
        row_range(x, bf16, row_stride, 0, rows, cols, shift, scale2, lo, local, inside, k, rest, moment);
        return;
    }
    #pragma omp parallel for num_threads(n) schedule(static, 1)
    for (int64_t t = 0; t < n; t++)
        row_range(x, bf16, row_stride, rows * t / n, rows * (t + 1) / n, cols, shift, scale2, lo, local, inside,
                  k, rest, moment);
}
"""
