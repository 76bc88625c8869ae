/* Native CPU loops of clustered and improved clustered attention (Vyas et al. 2020), of
 * SMYRF (Daras et al. 2020), of banded attention and of rotary positions.
 *
 * The PyTorch reference in clustered.py, kmeans.py and smyrf.py defines what every function
 * here computes; these loops do the same work without materialising the (N, C) score
 * matrices, (C, M) probabilities and per-round cluster tensors that make the reference slow on
 * a CPU. setup.py builds this file once per x86-64 level at install; native.py loads the best
 * level the CPU runs and calls it through ctypes (which releases the GIL), one range of
 * (batch, head) slices, or of rows, per thread.
 *
 * Layouts: every tensor is contiguous; "bh" indexes the flattened (batch, head) dimension,
 * and masks are per batch row (bh / heads). Assignments are int64 in [0, C], C = padded.
 *
 * Element types: q, k and v (and the outputs written in their type) are float32 or bfloat16,
 * named by a `dtype` argument (F32, BF16). A bfloat16 is the upper half of a float32, so
 * widening one is exact: the loops widen each row or vector of keys as they read it and compute
 * in float32, which gives bit for bit what they compute on the same values in float32.
 * Everything else (centroids, planes, probabilities, hashes) is float32.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* GCC vector extensions: LANES floats per vector, lowered to whatever the CPU has. */
#define LANES 16
typedef float floats __attribute__((vector_size(4 * LANES)));
typedef int32_t ints __attribute__((vector_size(4 * LANES)));

/* expf of every lane (a loop of LANES the compiler hands to the vector expf of -ffast-math). */
static inline floats exp_lanes(floats x) {
    float in[LANES], out[LANES];
    memcpy(in, &x, sizeof in);
    for (int l = 0; l < LANES; l++) out[l] = expf(in[l]);
    memcpy(&x, out, sizeof out);
    return x;
}

/* The largest lane, by halving (plain loops: any compiler with vector extensions). */
static inline float max_lanes(floats x) {
    float m[LANES];
    memcpy(m, &x, sizeof m);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) m[l] = m[l] > m[l + width] ? m[l] : m[l + width];
    return m[0];
}

/* ---- Element types ------------------------------------------------------------------ */

enum { F32 = 0, BF16 = 1 };
typedef uint16_t halves __attribute__((vector_size(2 * LANES)));

/* Bytes per element of q, k, v. */
static inline int64_t element_size(int64_t dtype) { return dtype == BF16 ? 2 : 4; }

/* `count` elements of x from element `at`, widened to float32 into dst. */
static inline void widen_into(float *dst, const void *x, int64_t dtype, int64_t at, int64_t count) {
    if (dtype == F32) {
        memcpy(dst, (const float *)x + at, count * sizeof *dst);
        return;
    }
    const uint16_t *h = (const uint16_t *)x + at;
    for (int64_t i = 0; i < count; i++) {
        const uint32_t bits = (uint32_t)h[i] << 16;
        memcpy(dst + i, &bits, sizeof bits);
    }
}

/* `count` elements of x from element `at` as float32: x itself when it is float32, else
 * widened into scratch. */
static inline const float *row_floats(const void *x, int64_t dtype, int64_t at, int64_t count, float *scratch) {
    if (dtype == F32) return (const float *)x + at;
    widen_into(scratch, x, dtype, at, count);
    return scratch;
}

/* LANES elements of x from element `at` (any alignment), widened to float32. */
static inline floats load_lanes(const void *x, int64_t dtype, int64_t at) {
    floats out;
    if (dtype == F32) {
        memcpy(&out, (const float *)x + at, sizeof out);
    } else {
        halves h;
        memcpy(&h, (const uint16_t *)x + at, sizeof h);
        const ints wide = __builtin_convertvector(h, ints) << 16;
        memcpy(&out, &wide, sizeof out);
    }
    return out;
}

/* x rounded to bfloat16 to nearest even, as torch's .to(torch.bfloat16) (a NaN to 0x7fc0).
 * On the bits, because -ffast-math lets the compiler assume that no float is NaN. */
static inline uint16_t bf16_rounded(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Writes `count` floats of row into out from element `at`, in dtype. */
static inline void store_row(void *out, int64_t dtype, int64_t at, const float *row, int64_t count) {
    if (dtype == F32) {
        memcpy((float *)out + at, row, count * sizeof *row);
        return;
    }
    uint16_t *h = (uint16_t *)out + at;
    for (int64_t i = 0; i < count; i++) h[i] = bf16_rounded(row[i]);
}

/* ---- Hashing ------------------------------------------------------------------------ */

/* Queries hashed together: independent FMA chains hide their latency. */
#define HASH_GROUP 4

/* hashing.hash_codes for slices [bh0, bh1): x (BH, N, D) in dtype; planes (H, D + 1, 64),
 * 64-byte aligned, row D the bias, columns past `bits` zero; codes (BH, N) out, bit b set
 * where the projection on plane b is positive. */
void hash_codes(const void *x, int64_t dtype, const float *planes, int64_t heads, int64_t n, int64_t d, int64_t bits,
                uint64_t *codes, int64_t bh0, int64_t bh1) {
    const uint64_t keep = bits == 64 ? ~0ULL : (1ULL << bits) - 1;
    float *rows = malloc(HASH_GROUP * d * sizeof *rows);
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const float *p = planes + (bh % heads) * (d + 1) * 64;
        for (int64_t i0 = 0; i0 < n; i0 += HASH_GROUP) {
            floats acc[HASH_GROUP][64 / LANES];
            const float *row[HASH_GROUP];
            for (int g = 0; g < HASH_GROUP; g++) {
                const int64_t i = i0 + g < n ? i0 + g : n - 1; /* a short tail repeats */
                row[g] = row_floats(x, dtype, (bh * n + i) * d, d, rows + g * d);
                for (int v = 0; v < 64 / LANES; v++) acc[g][v] = *(const floats *)(p + d * 64 + v * LANES);
            }
            for (int64_t t = 0; t < d; t++)
                for (int v = 0; v < 64 / LANES; v++) {
                    const floats plane = *(const floats *)(p + t * 64 + v * LANES);
                    for (int g = 0; g < HASH_GROUP; g++) acc[g][v] += row[g][t] * plane;
                }
            for (int g = 0; g < HASH_GROUP && i0 + g < n; g++) {
                uint64_t code = 0;
                for (int v = 0; v < 64 / LANES; v++)
                    for (int l = 0; l < LANES; l++) code |= (uint64_t)(acc[g][v][l] > 0.0f) << (v * LANES + l);
                codes[bh * n + i0 + g] = code & keep;
            }
        }
    }
    free(rows);
}

/* ---- Re-seeding empty clusters ------------------------------------------------------ */

typedef struct {
    float dist;
    int64_t pos;
} ranked;

/* Farthest first, lower position first among equals. */
static inline int ranks_before(ranked a, ranked b) { return a.dist > b.dist || (a.dist == b.dist && a.pos < b.pos); }

/* kmeans._reseed_empty's rule: the e-th empty cluster (members 0) takes the e-th query in
 * the order real queries farthest from their centroid first (dist), then padded queries by
 * position; past the end, the last one. Sets donor[j] for the empty clusters j only. Only
 * the first `empty` places of that order are needed, so they are kept by insertion in one
 * pass instead of sorting every query. */
static void pick_donors(const float *dist, const uint8_t *real, int64_t n, const int64_t *members, int64_t c,
                        int64_t *donor) {
    int64_t empty = 0;
    for (int64_t j = 0; j < c; j++) empty += members[j] == 0;
    if (empty == 0 || n == 0) return;
    const int64_t places = empty < n ? empty : n; /* places e >= n read place n - 1 */
    ranked *order = malloc(places * sizeof *order);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!real[i]) continue;
        const ranked r = {dist[i], i};
        if (kept == places && !ranks_before(r, order[places - 1])) continue;
        int64_t at = kept < places ? kept++ : places - 1;
        for (; at > 0 && ranks_before(r, order[at - 1]); at--) order[at] = order[at - 1];
        order[at] = r;
    }
    for (int64_t i = 0; i < n && kept < places; i++) /* then padded queries by position */
        if (!real[i]) order[kept++] = (ranked){0.0f, i};
    int64_t e = 0;
    for (int64_t j = 0; j < c; j++)
        if (members[j] == 0) {
            donor[j] = order[e < places ? e : places - 1].pos;
            e++;
        }
    free(order);
}

/* ---- Hamming K-means ---------------------------------------------------------------- */

/* Nearest centroid of every real query, ties to the lowest index (padded queries are left
 * alone). dist[i] is the Hamming distance to that centroid. keys: 256 scratch slots. */
static void hamming_nearest_portable(const uint64_t *codes, const uint8_t *real, int64_t n, const uint64_t *cent,
                                     int64_t c, int64_t *assign, float *dist, uint16_t *keys) {
    for (int64_t i = 0; i < n; i++) {
        if (!real[i]) continue; /* hamming_nearest sets padded queries */
        const uint64_t x = codes[i];
        int32_t best_d = 1 << 30;
        int64_t best = 0;
        /* (distance << 8 | offset) in blocks of 256 centroids: one min gives both, and the
         * lower offset wins a tie. */
        for (int64_t base = 0; base < c; base += 256) {
            const int64_t len = c - base < 256 ? c - base : 256;
            for (int64_t j = 0; j < len; j++)
                keys[j] = (uint16_t)((__builtin_popcountll(x ^ cent[base + j]) << 8) | j);
            uint16_t low = 0xFFFF;
            for (int64_t j = 0; j < len; j++) low = keys[j] < low ? keys[j] : low;
            if ((low >> 8) < best_d) {
                best_d = low >> 8;
                best = base + (low & 0xFF);
            }
        }
        assign[i] = best;
        dist[i] = (float)best_d;
    }
}

#if defined(__AVX512F__)
/* With AVX512-VPOPCNTDQ (Ice Lake, Zen 4 and later) one instruction counts the bits of eight
 * codes: the AVX-512 build scores eight centroids per step where the CPU has it (1.6-1.7x the
 * portable loop at 200-800 clusters on a Zen 4; without it, bit counting by shifts and adds
 * in vectors measured slower than the portable loop on AVX2). */
#include <immintrin.h>
/* Queries scored together by hamming_nearest_vpopcnt: each block of centroid codes is read
 * once for all of them, and their minima are independent chains. */
#define HAMMING_GROUP 4

/* hamming_nearest_portable's result: each lane keeps the least key distance << 16 | index
 * over the centroids it sees, so one minimum gives both and the lower index wins a tie. */
__attribute__((target("avx512vpopcntdq"))) static void hamming_nearest_vpopcnt(
    const uint64_t *codes, const uint8_t *real, int64_t n, const uint64_t *cent, int64_t c, int64_t *assign,
    float *dist) {
    const int64_t full = c - c % 8;
    const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t i0 = 0; i0 < n; i0 += HAMMING_GROUP) {
        __m512i x[HAMMING_GROUP], least[HAMMING_GROUP];
        for (int g = 0; g < HAMMING_GROUP; g++) { /* a short tail repeats its last query */
            x[g] = _mm512_set1_epi64((long long)codes[i0 + g < n ? i0 + g : n - 1]);
            least[g] = _mm512_set1_epi64(-1);
        }
        for (int64_t j = 0; j < full; j += 8) {
            const __m512i block = _mm512_loadu_si512(cent + j);
            const __m512i index = _mm512_add_epi64(lane, _mm512_set1_epi64(j));
            for (int g = 0; g < HAMMING_GROUP; g++) {
                const __m512i count = _mm512_popcnt_epi64(_mm512_xor_si512(block, x[g]));
                least[g] = _mm512_min_epu64(least[g], _mm512_or_si512(_mm512_slli_epi64(count, 16), index));
            }
        }
        for (int g = 0; g < HAMMING_GROUP && i0 + g < n; g++) {
            const int64_t i = i0 + g;
            if (!real[i]) continue; /* hamming_nearest sets padded queries */
            uint64_t best = _mm512_reduce_min_epu64(least[g]);
            for (int64_t j = full; j < c; j++) {
                const uint64_t key = (uint64_t)__builtin_popcountll(codes[i] ^ cent[j]) << 16 | (uint64_t)j;
                best = key < best ? key : best;
            }
            assign[i] = (int64_t)(best & 0xFFFF);
            dist[i] = (float)(best >> 16);
        }
    }
}
#endif

static void hamming_nearest(const uint64_t *codes, const uint8_t *real, int64_t n, const uint64_t *cent, int64_t c,
                            int64_t *assign, float *dist, uint16_t *keys) {
    for (int64_t i = 0; i < n; i++) {
        if (real[i]) continue;
        assign[i] = c; /* padded queries: no cluster, distance 0 */
        dist[i] = 0.0f;
    }
#if defined(__AVX512F__)
    if (__builtin_cpu_supports("avx512vpopcntdq")) {
        hamming_nearest_vpopcnt(codes, real, n, cent, c, assign, dist);
        return;
    }
#endif
    hamming_nearest_portable(codes, real, n, cent, c, assign, dist, keys);
}

/* One (batch, head) slice of kmeans.hamming_kmeans, from the initial centroid codes. */
static void hamming_kmeans_one(const uint64_t *codes, const uint8_t *real, int64_t n, int64_t bits, uint64_t *cent,
                               int64_t c, int64_t iterations, int64_t *assign) {
    if (n == 0) return;
    float *dist = malloc(n * sizeof *dist);
    uint16_t *keys = malloc(256 * sizeof *keys);
    int64_t *members = malloc(c * sizeof *members);
    int32_t *ones = malloc(c * 64 * sizeof *ones);
    ints lane_index;
    for (int l = 0; l < LANES; l++) lane_index[l] = l;
    uint64_t *updated = malloc(c * sizeof *updated);
    int64_t *donor = malloc(c * sizeof *donor);
    for (int64_t it = 0; it < iterations; it++) {
        hamming_nearest(codes, real, n, cent, c, assign, dist, keys);
        memset(members, 0, c * sizeof *members);
        memset(ones, 0, c * 64 * sizeof *ones);
        for (int64_t i = 0; i < n; i++) {
            if (assign[i] == c) continue;
            members[assign[i]]++;
            int32_t *row = ones + assign[i] * 64;
            const uint64_t x = codes[i];
            for (int part = 0; part < 64; part += LANES) { /* LANES bits at a time, in vectors */
                ints sum, bit = (ints){0} + (int32_t)((x >> part) & ((1u << LANES) - 1));
                memcpy(&sum, row + part, sizeof sum);
                sum += (bit >> lane_index) & 1;
                memcpy(row + part, &sum, sizeof sum);
            }
        }
        int64_t empty = 0;
        for (int64_t j = 0; j < c; j++) {
            uint64_t code = 0;
            for (int64_t b = 0; b < bits; b++) code |= (uint64_t)(2 * (int64_t)ones[j * 64 + b] > members[j]) << b;
            updated[j] = code;
            empty += members[j] == 0;
        }
        if (empty) {
            pick_donors(dist, real, n, members, c, donor);
            for (int64_t j = 0; j < c; j++)
                if (members[j] == 0) updated[j] = codes[donor[j]];
        }
        const int same = memcmp(updated, cent, c * sizeof *cent) == 0;
        memcpy(cent, updated, c * sizeof *cent);
        if (same) break;
    }
    hamming_nearest(codes, real, n, cent, c, assign, dist, keys);
    free(dist), free(keys), free(members), free(ones), free(updated), free(donor);
}

/* kmeans.hamming_kmeans for slices [bh0, bh1): codes (BH, N), real (B, N), centroids
 * (BH, C) initial codes, overwritten with the final ones; assign (BH, N) out. */
void hamming_kmeans(const uint64_t *codes, const uint8_t *real, int64_t heads, int64_t n, int64_t bits, uint64_t *centroids,
                    int64_t c, int64_t iterations, int64_t *assign, int64_t bh0, int64_t bh1) {
    for (int64_t bh = bh0; bh < bh1; bh++)
        hamming_kmeans_one(codes + bh * n, real + (bh / heads) * n, n, bits, centroids + bh * c, c, iterations,
                           assign + bh * n);
}

/* ---- Euclidean refinement ----------------------------------------------------------- */

/* Means of the member rows of q (N, D) in dtype, from element q0, per cluster into cent
 * (C, D); members (C). scratch: D floats. */
static void cluster_means_one(const void *q, int64_t dtype, int64_t q0, const int64_t *assign, int64_t n, int64_t d,
                              int64_t c, float *cent, int64_t *members, float *scratch) {
    memset(cent, 0, c * d * sizeof *cent);
    memset(members, 0, c * sizeof *members);
    for (int64_t i = 0; i < n; i++) {
        if (assign[i] == c) continue;
        members[assign[i]]++;
        float *row = cent + assign[i] * d;
        const float *x = row_floats(q, dtype, q0 + i * d, d, scratch);
        for (int64_t t = 0; t < d; t++) row[t] += x[t];
    }
    for (int64_t j = 0; j < c; j++) {
        const float count = (float)(members[j] > 0 ? members[j] : 1);
        for (int64_t t = 0; t < d; t++) cent[j * d + t] /= count;
    }
}

/* Queries scored together by euclid_nearest: independent FMA chains hide their latency. */
#define GROUP 8

/* For the GROUP queries x[g] (D floats each): argmax_j (x . 2c_j - |c_j|^2), the lowest j
 * among equals, into arg[g]. cent_t (D, CP) holds the centroids doubled (exact: a power of
 * two, so x . 2c_j is 2 x . c_j bit for bit) and neg_norm (CP) their -|c_j|^2, both 64-byte
 * aligned, CP a multiple of LANES (padding slots hold -FLT_MAX). Each lane keeps its own best
 * over the blocks of LANES clusters; the lanes are reduced once at the end. */
static void euclid_nearest(const float *const *x, const float *cent_t, const float *neg_norm, int64_t d, int64_t cp,
                           int64_t *arg) {
    floats best[GROUP], acc[GROUP];
    ints best_j[GROUP];
    for (int64_t jb = 0; jb < cp; jb += LANES) {
        for (int g = 0; g < GROUP; g++) acc[g] = *(const floats *)(neg_norm + jb);
        for (int64_t t = 0; t < d; t++) {
            const floats col = *(const floats *)(cent_t + t * cp + jb);
            for (int g = 0; g < GROUP; g++) acc[g] += x[g][t] * col;
        }
        ints j;
        for (int l = 0; l < LANES; l++) j[l] = (int32_t)(jb + l);
        for (int g = 0; g < GROUP; g++) {
            const ints wins = jb == 0 ? (ints){0} - 1 : acc[g] > best[g]; /* every lane on the first block */
            best[g] = (floats)(((ints)acc[g] & wins) | ((ints)best[g] & ~wins));
            best_j[g] = (j & wins) | (best_j[g] & ~wins);
        }
    }
    for (int g = 0; g < GROUP; g++) {
        float top = best[g][0];
        int32_t win = best_j[g][0];
        for (int l = 1; l < LANES; l++)
            if (best[g][l] > top || (best[g][l] == top && best_j[g][l] < win)) top = best[g][l], win = best_j[g][l];
        arg[g] = win;
    }
}

/* kmeans.cluster_means for slices [bh0, bh1): x (BH, N, D) in dtype, assign (BH, N) ->
 * means (BH, C, D), 0 for an empty cluster. */
void cluster_means(const void *x, int64_t dtype, const int64_t *assign, int64_t n, int64_t d, int64_t c, float *means,
                   int64_t bh0, int64_t bh1) {
    int64_t *members = malloc(c * sizeof *members);
    float *scratch = malloc(d * sizeof *scratch);
    for (int64_t bh = bh0; bh < bh1; bh++)
        cluster_means_one(x, dtype, bh * n * d, assign + bh * n, n, d, c, means + bh * c * d, members, scratch);
    free(members), free(scratch);
}

/* One (batch, head) slice of kmeans.refine_clusters: q (N, D) in dtype from element q0;
 * assign is updated in place. */
static void refine_one(const void *q, int64_t dtype, int64_t q0, const uint8_t *real, int64_t n, int64_t d, int64_t c,
                       int64_t iterations, int64_t *assign) {
    if (n == 0) return;
    float *rows = malloc(GROUP * d * sizeof *rows); /* rows of q widened to float32 */
    const int64_t cp = (c + LANES - 1) / LANES * LANES;
    float *cent = malloc(c * d * sizeof *cent);
    float *cent_t = aligned_alloc(64, d * cp * sizeof *cent_t); /* (D, C) padded to whole vectors */
    float *neg_norm = aligned_alloc(64, cp * sizeof *neg_norm);
    int64_t *members = malloc(c * sizeof *members);
    int64_t *updated = malloc(n * sizeof *updated);
    float *dist = malloc(n * sizeof *dist);
    int64_t *donor = malloc(c * sizeof *donor);
    for (int64_t it = 0; it < iterations; it++) {
        cluster_means_one(q, dtype, q0, assign, n, d, c, cent, members, rows);
        int64_t empty = 0;
        for (int64_t j = 0; j < c; j++) empty += members[j] == 0;
        if (empty) {
            for (int64_t i = 0; i < n; i++) { /* each real query's distance to its mean */
                const float *row = cent + (real[i] ? assign[i] : 0) * d;
                const float *x = real[i] ? row_floats(q, dtype, q0 + i * d, d, rows) : row;
                float s = 0.0f;
                for (int64_t t = 0; real[i] && t < d; t++) s += (x[t] - row[t]) * (x[t] - row[t]);
                dist[i] = s;
            }
            pick_donors(dist, real, n, members, c, donor);
            for (int64_t j = 0; j < c; j++)
                if (members[j] == 0) widen_into(cent + j * d, q, dtype, q0 + donor[j] * d, d);
        }
        for (int64_t j = 0; j < cp; j++) {
            float s = 0.0f;
            for (int64_t t = 0; t < d; t++) {
                const float x = j < c ? cent[j * d + t] : 0.0f;
                s += x * x;
                cent_t[t * cp + j] = 2.0f * x;
            }
            neg_norm[j] = j < c ? -s : -FLT_MAX; /* padding slots never win */
        }
        int changed = 0;
        for (int64_t i0 = 0; i0 < n; i0 += GROUP) {
            const float *x[GROUP];
            int64_t arg[GROUP];
            for (int g = 0; g < GROUP; g++) /* a short tail repeats */
                x[g] = row_floats(q, dtype, q0 + (i0 + g < n ? i0 + g : n - 1) * d, d, rows + g * d);
            euclid_nearest(x, cent_t, neg_norm, d, cp, arg);
            for (int64_t i = i0; i < n && i < i0 + GROUP; i++) {
                updated[i] = real[i] ? arg[i - i0] : c;
                changed |= updated[i] != assign[i];
            }
        }
        memcpy(assign, updated, n * sizeof *assign);
        if (!changed) break;
    }
    free(rows), free(cent), free(cent_t), free(neg_norm), free(members), free(updated), free(dist), free(donor);
}

/* kmeans.refine_clusters for slices [bh0, bh1): q (BH, N, D) in dtype, real (B, N), assign (BH, N). */
void refine_clusters(const void *q, int64_t dtype, const uint8_t *real, int64_t heads, int64_t n, int64_t d, int64_t c,
                     int64_t iterations, int64_t *assign, int64_t bh0, int64_t bh1) {
    for (int64_t bh = bh0; bh < bh1; bh++)
        refine_one(q, dtype, bh * n * d, real + (bh / heads) * n, n, d, c, iterations, assign + bh * n);
}

/* ---- Centroid attention: softmax and top-k of each row ------------------------------ */

/* Insert (value, index) into the k best so far, kept sorted descending; a later index loses
 * a tie. */
static void topk_insert(float *vals, int64_t *idx, int64_t *count, int64_t k, float value, int64_t index) {
    int64_t pos = *count < k ? (*count)++ : k - 1;
    while (pos > 0 && vals[pos - 1] < value) {
        vals[pos] = vals[pos - 1];
        idx[pos] = idx[pos - 1];
        pos--;
    }
    vals[pos] = value;
    idx[pos] = index;
}

/* Centroid rows scored together by centroid_attention. */
#define CROWS 16

/* One row's running state in centroid_attention: the largest real logit so far, the softmax
 * denominator relative to it and how many of the k best logits are kept (the unnormalised
 * A^c V row and those logits live in the function's acc_v and best). */
typedef struct {
    float top;
    floats total; /* per lane, summed at the end */
    int64_t count;
} running;

/* The centroid pass of improved clustered attention in one sweep over the keys (the online
 * softmax of flash attention): for each centroid row, A^c = softmax(scale * c . k_j) over the
 * real keys, values = A^c V, and the k most probable real keys, highest first, their indices,
 * probabilities and validity (index 0, probability 0 and not valid where fewer than k keys are
 * real; rows of 0 where none is). A key's rank by probability is its rank by logit, so the
 * top k are kept as logits and turned into probabilities at the end; the (C, M) matrix of
 * probabilities is never formed.
 *
 * cent (BH, C, D) float32; kt (BH, MP / LANES, D, LANES) the keys in blocks of LANES, each
 * block dimension by dimension (a block is one contiguous stretch: rows of MP keys would put
 * a block's D vectors a power of two apart at the usual lengths, all in the same cache sets),
 * MP a multiple of LANES; v (BH, M, DV); kt and v in dtype; keymask (B, M); values (BH, C,
 * DV), top_* (BH, C, K)
 * out. Rows [r0, r1) of the flattened (BH, C). Inlined once per dtype, so that the loads of
 * keys and values are compiled for one element type. */
static inline __attribute__((always_inline)) void centroid_rows(
    const float *cent, const void *kt, const void *v, const int64_t dtype, const uint8_t *keymask, int64_t heads,
    int64_t c, int64_t d, int64_t m, int64_t mp, int64_t dv, float scale, int64_t k, float *values, int64_t *top_index,
    float *top_prob, uint8_t *top_valid, int64_t r0, int64_t r1) {
    const int64_t dvp = (dv + LANES - 1) / LANES * LANES; /* acc_v rows in whole vectors */
    float *best = malloc(CROWS * (k > 0 ? k : 1) * sizeof *best);
    int64_t *best_j = malloc(CROWS * (k > 0 ? k : 1) * sizeof *best_j);
    float *acc_v = malloc(CROWS * dvp * sizeof *acc_v);
    float *vtail = calloc(LANES * dvp, sizeof *vtail); /* a block's value rows, padded or widened */
    const floats lowest = (floats){0} - FLT_MAX;
    for (int64_t r = r0; r < r1;) {
        const int64_t bh = r / c, rows = r1 - r < CROWS ? r1 - r : CROWS;
        const int64_t g_end = (bh + 1) * c - r < rows ? (bh + 1) * c - r : rows; /* stay in one (b, h) */
        const int64_t ktb = bh * d * mp, vb = bh * m * dv; /* this slice's first elements */
        const uint8_t *real = keymask + (bh / heads) * m;
        const float *row[CROWS];
        running run[CROWS];
        for (int g = 0; g < CROWS; g++) {
            row[g] = cent + (r + (g < g_end ? g : g_end - 1)) * d; /* a short group repeats its last row */
            run[g] = (running){-FLT_MAX, (floats){0}, 0};
        }
        memset(acc_v, 0, CROWS * dvp * sizeof *acc_v);
        for (int64_t jb = 0; jb < m; jb += LANES) {
            const int64_t len = m - jb < LANES ? m - jb : LANES;
            ints live = {0};
            int any = 0;
            for (int l = 0; l < len; l++) any |= live[l] = real[jb + l] ? -1 : 0;
            if (!any) continue;
            floats acc[CROWS], p[CROWS];
            for (int g = 0; g < CROWS; g++) acc[g] = (floats){0};
            for (int64_t t = 0; t < d; t++) {
                const floats col = load_lanes(kt, dtype, ktb + jb * d + t * LANES);
                for (int g = 0; g < CROWS; g++) acc[g] += row[g][t] * col;
            }
            for (int g = 0; g < CROWS; g++) {
                p[g] = (floats){0};
                if (g >= g_end) continue;
                const floats logit = acc[g] * scale;
                const float block = max_lanes((floats)(((ints)logit & live) | ((ints)lowest & ~live)));
                if (block > run[g].top) { /* a new maximum: rescale what was summed so far */
                    const float shrink = run[g].top == -FLT_MAX ? 0.0f : expf(run[g].top - block);
                    run[g].total *= shrink;
                    for (int64_t e = 0; e < dvp; e++) acc_v[g * dvp + e] *= shrink;
                    run[g].top = block;
                }
                p[g] = (floats)((ints)exp_lanes(logit - run[g].top) & live);
                run[g].total += p[g];
                float *vals = best + g * k;
                int64_t *idx = best_j + g * k;
                if (k == 0 || (run[g].count == k && block <= vals[k - 1])) continue;
                for (int l = 0; l < len; l++)
                    if (live[l] && (run[g].count < k || logit[l] > vals[k - 1]))
                        topk_insert(vals, idx, &run[g].count, k, logit[l], jb + l);
            }
            /* acc_v += p V for the block: one vector of value columns at a time, every row's
             * sum in its own register. */
            const float *vblock = dtype == F32 ? (const float *)v + vb + jb * dv : vtail;
            if (dtype != F32 || len < LANES || dv != dvp) { /* widened, a short last block, or rows not in whole vectors */
                if (len < LANES) memset(vtail, 0, LANES * dvp * sizeof *vtail); /* columns past dv stay 0 */
                for (int l = 0; l < len; l++) widen_into(vtail + l * dvp, v, dtype, vb + (jb + l) * dv, dv);
                vblock = vtail;
            }
            const int64_t vstride = vblock == vtail ? dvp : dv;
            for (int64_t w = 0; w < dvp; w += LANES) {
                floats sum[CROWS];
                for (int g = 0; g < CROWS; g++) memcpy(&sum[g], acc_v + g * dvp + w, sizeof sum[g]);
                for (int l = 0; l < LANES; l++) {
                    floats vrow;
                    memcpy(&vrow, vblock + l * vstride + w, sizeof vrow);
                    for (int g = 0; g < CROWS; g++) sum[g] += p[g][l] * vrow;
                }
                for (int g = 0; g < CROWS; g++) memcpy(acc_v + g * dvp + w, &sum[g], sizeof sum[g]);
            }
        }
        for (int g = 0; g < g_end; g++) {
            float total = 0.0f;
            for (int l = 0; l < LANES; l++) total += run[g].total[l];
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            for (int64_t e = 0; e < dv; e++) values[(r + g) * dv + e] = acc_v[g * dvp + e] * inv;
            for (int64_t t = 0; t < k; t++) {
                const int kept = t < run[g].count;
                top_prob[(r + g) * k + t] = kept ? expf(best[g * k + t] - run[g].top) * inv : 0.0f;
                top_index[(r + g) * k + t] = kept ? best_j[g * k + t] : 0;
                top_valid[(r + g) * k + t] = kept;
            }
        }
        r += g_end;
    }
    free(best), free(best_j), free(acc_v), free(vtail);
}

void centroid_attention(const float *cent, const void *kt, const void *v, int64_t dtype, const uint8_t *keymask,
                        int64_t heads, int64_t c, int64_t d, int64_t m, int64_t mp, int64_t dv, float scale, int64_t k,
                        float *values, int64_t *top_index, float *top_prob, uint8_t *top_valid, int64_t r0, int64_t r1) {
    if (dtype == BF16)
        centroid_rows(cent, kt, v, BF16, keymask, heads, c, d, m, mp, dv, scale, k, values, top_index, top_prob,
                      top_valid, r0, r1);
    else
        centroid_rows(cent, kt, v, F32, keymask, heads, c, d, m, mp, dv, scale, k, values, top_index, top_prob,
                      top_valid, r0, r1);
}

/* ---- Clustered attention: the centroid pass in bfloat16 (AVX512-BF16) --------------- */

int bf16_dot(void);

#if defined(__AVX512F__)
/* Centroid rows worked on together: each block of keys and of values is loaded once for all. */
#define VROWS 16
/* How far a row's logits may rise above the reference its exponentials are taken from before
 * the reference moves up to them (and what was summed is rescaled): exp(8) keeps every term
 * and the sums well inside float32 and bfloat16, and most blocks skip the horizontal maximum. */
#define REFERENCE_SLACK 8.0f

/* exp of every lane, as 2^n 2^f with n = round(x log2 e) and |f| <= 1/2: 2^f by its Taylor
 * polynomial of degree 5 (relative error below 3e-6, far under the bfloat16 rounding the
 * probabilities take next), 2^n by vscalefps, which gives 0 where x is very negative. */
static inline __m512 exp_bf16_lanes(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f)); /* in [-ln2 / 2, ln2 / 2] */
    __m512 p = _mm512_set1_ps(1.0f / 120);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One (batch, head) slice's keys and values laid out for vdpbf16ps. kw (MB, D / 2, 16): for
 * each block of 16 keys and pair of dimensions s, the 16 keys' words (dimensions 2s, 2s + 1);
 * vw (MB * 8, DV): for each pair of keys i, per value column e the word (v[2i][e],
 * v[2i + 1][e]); live (MB): each block's real keys as a 16-bit mask. Keys past M are 0 and
 * not live. k and v: the slice's first bfloat16 key and value rows, k_row and v_row elements
 * apart. */
__attribute__((target("avx512bf16"))) static void lay_out_slice(const uint16_t *k, const uint16_t *v,
                                                                const uint8_t *real, int64_t m, int64_t d, int64_t dv,
                                                                int64_t k_row, int64_t v_row, uint32_t *kw,
                                                                uint32_t *vw, uint16_t *live) {
    const int64_t pairs = d / 2, mb = (m + 15) / 16;
    for (int64_t blk = 0; blk < mb; blk++) {
        const int64_t j0 = blk * 16, len = m - j0 < 16 ? m - j0 : 16;
        const __mmask16 inside = (__mmask16)(len == 16 ? 0xffff : (1u << len) - 1);
        const __m128i bytes = _mm_maskz_loadu_epi8(inside, real + j0);
        live[blk] = _mm_mask_test_epi8_mask(inside, bytes, bytes);
        uint32_t *block = kw + blk * pairs * 16;
        for (int64_t l = 0; l < 16; l++) {
            if (l < len) {
                const uint16_t *key = k + (j0 + l) * k_row;
                for (int64_t s = 0; s < pairs; s++) memcpy(block + s * 16 + l, key + 2 * s, sizeof *block);
            } else {
                for (int64_t s = 0; s < pairs; s++) block[s * 16 + l] = 0;
            }
        }
        for (int64_t i = 0; i < 8; i++) {
            const int64_t even = j0 + 2 * i, odd = even + 1;
            for (int64_t e = 0; e < dv; e += 16) {
                const __m256i lo = even < m ? _mm256_loadu_si256((const __m256i *)(v + even * v_row + e)) : _mm256_setzero_si256();
                const __m256i hi = odd < m ? _mm256_loadu_si256((const __m256i *)(v + odd * v_row + e)) : _mm256_setzero_si256();
                const __m512i words = _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
                _mm512_storeu_si512(vw + (blk * 8 + i) * dv + e, words);
            }
        }
    }
}

/* centroid_values_bf16 for rows [r0, r1) of the flattened (BH, C). */
__attribute__((target("avx512bf16"))) static void centroid_values_rows(
    const uint32_t *cent, const uint16_t *k, const uint16_t *v, const uint8_t *keymask, int64_t heads, int64_t c,
    int64_t d, int64_t m, int64_t dv, int64_t k_batch, int64_t k_head, int64_t k_row, int64_t v_batch,
    int64_t v_head, int64_t v_row, float *values, int64_t r0, int64_t r1) {
    const int64_t pairs = d / 2, mb = (m + 15) / 16;
    uint32_t *kw = aligned_alloc(64, mb * pairs * 16 * sizeof *kw);
    uint32_t *vw = aligned_alloc(64, mb * 8 * dv * sizeof *vw);
    uint16_t *live = malloc(mb * sizeof *live);
    float *acc = aligned_alloc(64, VROWS * dv * sizeof *acc); /* each row's unnormalised A^c V */
    int64_t laid_out = -1;
    for (int64_t r = r0; r < r1;) {
        const int64_t bh = r / c, rows = r1 - r < VROWS ? r1 - r : VROWS;
        const int64_t g_end = (bh + 1) * c - r < rows ? (bh + 1) * c - r : rows; /* stay in one (b, h) */
        if (bh != laid_out) {
            const int64_t b = bh / heads, h = bh % heads;
            lay_out_slice(k + b * k_batch + h * k_head, v + b * v_batch + h * v_head, keymask + b * m, m, d, dv, k_row,
                          v_row, kw, vw, live);
            laid_out = bh;
        }
        const uint32_t *row[VROWS];
        float ref[VROWS];
        __m512 total[VROWS];
        for (int g = 0; g < VROWS; g++) {
            row[g] = cent + (r + (g < g_end ? g : g_end - 1)) * pairs; /* a short group repeats its last row */
            ref[g] = -FLT_MAX;
            total[g] = _mm512_setzero_ps();
        }
        memset(acc, 0, VROWS * dv * sizeof *acc);
        for (int64_t blk = 0; blk < mb; blk++) {
            const __mmask16 real = live[blk];
            if (!real) continue;
            __m512 logit[VROWS];
            for (int g = 0; g < VROWS; g++) logit[g] = _mm512_setzero_ps();
            for (int64_t s = 0; s < pairs; s++) {
                const __m512bh col = (__m512bh)_mm512_load_si512(kw + (blk * pairs + s) * 16);
                for (int g = 0; g < VROWS; g++)
                    logit[g] = _mm512_dpbf16_ps(logit[g], col, (__m512bh)_mm512_set1_epi32((int)row[g][s]));
            }
            uint32_t weights[VROWS][8] __attribute__((aligned(32))); /* each row's probabilities by pairs of keys */
            for (int g = 0; g < VROWS; g++) {
                if (_mm512_mask_cmp_ps_mask(real, logit[g], _mm512_set1_ps(ref[g] + REFERENCE_SLACK), _CMP_GT_OQ)) {
                    const float top = _mm512_mask_reduce_max_ps(real, logit[g]);
                    const float shrink = ref[g] == -FLT_MAX ? 0.0f : expf(ref[g] - top);
                    total[g] = _mm512_mul_ps(total[g], _mm512_set1_ps(shrink));
                    for (int64_t e = 0; e < dv; e++) acc[g * dv + e] *= shrink;
                    ref[g] = top;
                }
                const __m512 p = exp_bf16_lanes(_mm512_sub_ps(logit[g], _mm512_set1_ps(ref[g])));
                const __m256bh rounded = _mm512_maskz_cvtneps_pbh(real, p);
                total[g] = _mm512_add_ps(total[g], _mm512_cvtpbh_ps(rounded)); /* the weights V is summed with */
                _mm256_store_si256((__m256i *)weights[g], (__m256i)rounded);
            }
            const uint32_t *vblock = vw + blk * 8 * dv;
            for (int64_t e = 0; e < dv; e += 16) {
                __m512 sum[VROWS];
                for (int g = 0; g < VROWS; g++) sum[g] = _mm512_load_ps(acc + g * dv + e);
                for (int i = 0; i < 8; i++) {
                    const __m512bh col = (__m512bh)_mm512_load_si512(vblock + i * dv + e);
                    for (int g = 0; g < VROWS; g++)
                        sum[g] = _mm512_dpbf16_ps(sum[g], col, (__m512bh)_mm512_set1_epi32((int)weights[g][i]));
                }
                for (int g = 0; g < VROWS; g++) _mm512_store_ps(acc + g * dv + e, sum[g]);
            }
        }
        for (int g = 0; g < g_end; g++) {
            const float sum = _mm512_reduce_add_ps(total[g]);
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            for (int64_t e = 0; e < dv; e++) values[(r + g) * dv + e] = acc[g * dv + e] * inv;
        }
        r += g_end;
    }
    free(kw), free(vw), free(live), free(acc);
}
#endif

/* The centroid pass of clustered attention (no top-k) on bfloat16 keys and values by
 * AVX512-BF16's vdpbf16ps, as a bfloat16 SDPA computes it: the logits of the centroids, scaled
 * and rounded to bfloat16 by the caller, summed in float32 from exact products, the softmax in
 * float32, and V summed in float32 with the probabilities rounded to bfloat16 (the denominator
 * sums the same rounded probabilities). values = A^c V (BH, C, DV) float32, rows of 0 where no
 * key is real.
 *
 * cent (BH, C, D / 2) words (pairs of bfloat16 dimensions); k (B, H, M, D) and v (B, H, M, DV)
 * bfloat16 at the given element strides of batch, head and row (each row contiguous, strides
 * of k even); keymask (B, M). D even, DV a multiple of 16. Rows [r0, r1) of the flattened
 * (BH, C). Only called where bf16_dot(): elsewhere it writes nothing. */
void centroid_values_bf16(const uint32_t *cent, const uint16_t *k, const uint16_t *v, const uint8_t *keymask,
                          int64_t heads, int64_t c, int64_t d, int64_t m, int64_t dv, int64_t k_batch, int64_t k_head,
                          int64_t k_row, int64_t v_batch, int64_t v_head, int64_t v_row, float *values, int64_t r0,
                          int64_t r1) {
#if defined(__AVX512F__)
    if (bf16_dot())
        centroid_values_rows(cent, k, v, keymask, heads, c, d, m, dv, k_batch, k_head, k_row, v_batch, v_head, v_row,
                             values, r0, r1);
#else
    (void)cent, (void)k, (void)v, (void)keymask, (void)heads, (void)c, (void)d, (void)m, (void)dv, (void)k_batch;
    (void)k_head, (void)k_row, (void)v_batch, (void)v_head, (void)v_row, (void)values, (void)r0, (void)r1;
#endif
}

/* ---- Improved clustered attention: the per-query sparse part (eq. 15) --------------- */

/* Queries of improved_sparse worked on together: each one's sums over D and over the top k
 * run in its own registers, a vector at a time, so the queries' chains of FMAs overlap (sums
 * kept in rows of memory would wait on their own stores). */
#define SPARSE_GROUP 4

/* For every real query i of cluster j = assign[i]:
 *   out_i = mass_j * softmax(scale * q_i . keys_j[t], valid t) @ values_j + bottom_j
 * q (BH, N, D) and out (BH, N, Dv) in dtype; keys_t (BH, C, D, KP): each cluster's top-k
 * keys, transposed, rows padded to KP = K rounded up to whole vectors; values (BH, C, K, Dv);
 * valid (BH, C, K) uint8; mass (BH, C); bottom
 * (BH, C, Dv). Padded queries get 0 rows. Slices [bh0, bh1). */
void improved_sparse(const void *q, int64_t dtype, const int64_t *assign, const float *keys_t, const float *values,
                     const uint8_t *valid, const float *mass, const float *bottom, int64_t n, int64_t d, int64_t dv,
                     int64_t c, int64_t k, float scale, void *out, int64_t bh0, int64_t bh1) {
    const int64_t kp = (k + LANES - 1) / LANES * LANES;
    float *logits = malloc(SPARSE_GROUP * kp * sizeof *logits);
    float *rows = malloc(SPARSE_GROUP * (d + dv) * sizeof *rows); /* widened queries, then output rows */
    for (int64_t bh = bh0; bh < bh1; bh++) {
        for (int64_t i0 = 0; i0 < n; i0 += SPARSE_GROUP) {
            /* The group's real queries: their cluster, query row and output row (out itself in
             * float32, else a row rounded to dtype at the end). */
            int64_t cj[SPARSE_GROUP], at[SPARSE_GROUP];
            const float *qi[SPARSE_GROUP];
            float *o[SPARSE_GROUP];
            int count = 0;
            for (int64_t i = i0; i < n && i < i0 + SPARSE_GROUP; i++) {
                const int64_t j = assign[bh * n + i];
                if (j == c) {
                    memset((char *)out + (bh * n + i) * dv * element_size(dtype), 0, dv * element_size(dtype));
                    continue;
                }
                cj[count] = bh * c + j;
                qi[count] = row_floats(q, dtype, (bh * n + i) * d, d, rows + count * d);
                at[count] = (bh * n + i) * dv;
                o[count] = dtype == F32 ? (float *)out + at[count] : rows + SPARSE_GROUP * d + count * dv;
                count++;
            }
            if (count == 0) continue;
            for (int g = count; g < SPARSE_GROUP; g++) /* a short group repeats its last query */
                cj[g] = cj[count - 1], qi[g] = qi[count - 1];
            /* A vector of LANES keys at a time, every query's sum over D in its own register. */
            for (int64_t tb = 0; tb < kp; tb += LANES) {
                floats acc[SPARSE_GROUP];
                for (int g = 0; g < SPARSE_GROUP; g++) acc[g] = (floats){0};
                for (int64_t s = 0; s < d; s++)
                    for (int g = 0; g < SPARSE_GROUP; g++) {
                        floats col;
                        memcpy(&col, keys_t + (cj[g] * d + s) * kp + tb, sizeof col);
                        acc[g] += qi[g][s] * col;
                    }
                for (int g = 0; g < SPARSE_GROUP; g++) memcpy(logits + g * kp + tb, &acc[g], sizeof acc[g]);
            }
            for (int g = 0; g < count; g++) {
                float *logit = logits + g * kp;
                const uint8_t *ok = valid + cj[g] * k;
                float top = -FLT_MAX;
                for (int64_t t = 0; t < k; t++) {
                    logit[t] = ok[t] ? logit[t] * scale : -FLT_MAX;
                    top = logit[t] > top ? logit[t] : top;
                }
                float total = 0.0f;
                for (int64_t t = 0; t < k; t++) {
                    logit[t] = ok[t] ? expf(logit[t] - top) : 0.0f;
                    total += logit[t];
                }
                const float weight = total > 0.0f ? mass[cj[g]] / total : 0.0f;
                for (int64_t t = 0; t < k; t++) logit[t] *= weight; /* now the probability */
            }
            /* bottom + p V: a vector of value columns at a time, every query's in its own
             * register (a repeated query's sums are dropped); columns past the last whole
             * vector one by one. */
            const int64_t whole = dv / LANES * LANES;
            for (int64_t e0 = 0; e0 < whole; e0 += LANES) {
                floats acc[SPARSE_GROUP];
                for (int g = 0; g < SPARSE_GROUP; g++) memcpy(&acc[g], bottom + cj[g] * dv + e0, sizeof acc[g]);
                for (int64_t t = 0; t < k; t++)
                    for (int g = 0; g < SPARSE_GROUP; g++) {
                        floats vrow;
                        memcpy(&vrow, values + (cj[g] * k + t) * dv + e0, sizeof vrow);
                        acc[g] += logits[g * kp + t] * vrow;
                    }
                for (int g = 0; g < count; g++) memcpy(o[g] + e0, &acc[g], sizeof acc[g]);
            }
            for (int g = 0; g < count; g++)
                for (int64_t e = whole; e < dv; e++) {
                    float sum = bottom[cj[g] * dv + e];
                    for (int64_t t = 0; t < k; t++) sum += logits[g * kp + t] * values[(cj[g] * k + t) * dv + e];
                    o[g][e] = sum;
                }
            if (dtype != F32)
                for (int g = 0; g < count; g++) store_row(out, dtype, at[g], o[g], dv);
        }
    }
    free(logits), free(rows);
}

/* ---- SMYRF: attention inside balanced clusters, rounds merged by softmax mass ------- */

/* Queries of one cluster scored together: independent FMA chains over each key block. */
#define SMYRF_GROUP 8

/* Rank `c` of the cuts that split `count` sorted tokens into `clusters` balanced clusters:
 * ceil(c count / clusters), the first rank of cluster c (smyrf.cluster_slots). */
static int64_t cluster_start(int64_t c, int64_t count, int64_t clusters) {
    return (c * count + clusters - 1) / clusters;
}

/* The logits of a group of queries against a cluster's keys, logits (SMYRF_GROUP, SP) =
 * scale * x[g] . key t: x[g] the D floats of query g, kt (D, SP) the keys transposed, SP a
 * whole number of vectors, 64-byte aligned. */
static void group_logits(const float *const *x, const float *kt, int64_t d, int64_t sp, float scale, float *logits) {
    for (int64_t tb = 0; tb < sp; tb += LANES) {
        floats acc[SMYRF_GROUP];
        for (int g = 0; g < SMYRF_GROUP; g++) acc[g] = (floats){0};
        for (int64_t s = 0; s < d; s++) {
            const floats col = *(const floats *)(kt + s * sp + tb);
            for (int g = 0; g < SMYRF_GROUP; g++) acc[g] += x[g][s] * col;
        }
        for (int g = 0; g < SMYRF_GROUP; g++) *(floats *)(logits + g * sp + tb) = acc[g] * scale;
    }
}

#if defined(__AVX512F__)
/* group_logits on bfloat16 queries and keys by AVX512-BF16's vdpbf16ps, which multiplies two
 * pairs of bfloat16 exactly and adds both products to a float32 sum: half the instructions of
 * widening and multiplying. Only where both sides are bfloat16 already (no float32 operand is
 * rounded); the sums differ from the float32 loop's by their order, within float32 rounding
 * (and bfloat16 subnormals count as 0). x[g]: the D bfloat16 of query g; kw (D / 2, SP) the
 * keys transposed by pairs of dimensions, one 32-bit word holding dimensions 2s and 2s + 1. */
__attribute__((target("avx512bf16"))) static void group_logits_bf16(const uint16_t *const *x, const uint32_t *kw,
                                                                    int64_t d, int64_t sp, float scale, float *logits) {
    for (int64_t tb = 0; tb < sp; tb += 16) {
        __m512 acc[SMYRF_GROUP];
        for (int g = 0; g < SMYRF_GROUP; g++) acc[g] = _mm512_setzero_ps();
        for (int64_t s = 0; s < d / 2; s++) {
            const __m512bh col = (__m512bh)_mm512_load_si512(kw + s * sp + tb);
            for (int g = 0; g < SMYRF_GROUP; g++) {
                int32_t pair;
                memcpy(&pair, x[g] + 2 * s, sizeof pair);
                acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_set1_epi32(pair), col);
            }
        }
        for (int g = 0; g < SMYRF_GROUP; g++) _mm512_store_ps(logits + g * sp + tb, _mm512_mul_ps(acc[g], _mm512_set1_ps(scale)));
    }
}
#endif

/* Whether the bfloat16 logits run on vdpbf16ps: the AVX-512 library on a CPU with AVX512-BF16. */
int bf16_dot(void) {
#if defined(__AVX512F__)
    return __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* One cluster of one round: keys (D, SP) transposed and values vals (SK, DVP) already gathered
 * (SP and DVP whole vectors, 64-byte aligned, the padding 0), the keys as floats, or with
 * `pairs` as the words of group_logits_bf16; the SQ queries whose positions are qpos in q
 * (N, D), in dtype from element q0. Each query's logits over the SK keys join its running
 * softmax: mx (the largest logit so far), den (the sum of exp(logit - mx)) and its Dv row of
 * out (the sum of exp(logit - mx) v). logits: SMYRF_GROUP * SP floats, 64-byte aligned; rows:
 * SMYRF_GROUP * D floats. */
static void smyrf_cluster(const void *q, int64_t dtype, int64_t q0, const int64_t *qpos, int64_t sq, const void *keys,
                          int pairs, const float *vals, int64_t sk, int64_t sp, int64_t d, int64_t dv, int64_t dvp,
                          float scale, float *out, float *mx, float *den, float *logits, float *rows) {
    for (int64_t i0 = 0; i0 < sq; i0 += SMYRF_GROUP) {
        float keep[SMYRF_GROUP];
        int64_t at[SMYRF_GROUP]; /* a short tail repeats */
        for (int g = 0; g < SMYRF_GROUP; g++) at[g] = q0 + qpos[i0 + g < sq ? i0 + g : sq - 1] * d;
        if (pairs) { /* only set where the AVX-512 library runs on a CPU with AVX512-BF16 */
#if defined(__AVX512F__)
            const uint16_t *x[SMYRF_GROUP];
            for (int g = 0; g < SMYRF_GROUP; g++) x[g] = (const uint16_t *)q + at[g];
            group_logits_bf16(x, keys, d, sp, scale, logits);
#endif
        } else {
            const float *x[SMYRF_GROUP];
            for (int g = 0; g < SMYRF_GROUP; g++) x[g] = row_floats(q, dtype, at[g], d, rows + g * d);
            group_logits(x, keys, d, sp, scale, logits);
        }
        for (int64_t g = 0; g < SMYRF_GROUP; g++) {
            float *row = logits + g * sp;
            if (i0 + g >= sq) break; /* the repeated tail: its sums are computed and dropped */
            const int64_t i = qpos[i0 + g];
            float top = row[0];
            for (int64_t t = 1; t < sk; t++) top = row[t] > top ? row[t] : top;
            /* The first round that reaches query i starts its sums; later ones rescale them. */
            const float grow = den[i] > 0.0f && mx[i] > top ? mx[i] : top;
            keep[g] = den[i] > 0.0f ? expf(mx[i] - grow) : 0.0f;
            float total = 0.0f;
            for (int64_t t = 0; t < sk; t++) {
                row[t] = expf(row[t] - grow);
                total += row[t];
            }
            den[i] = den[i] * keep[g] + total;
            mx[i] = grow;
        }
        for (int64_t eb = 0; eb < dvp; eb += LANES) {
            floats acc[SMYRF_GROUP];
            for (int g = 0; g < SMYRF_GROUP; g++) acc[g] = (floats){0};
            for (int64_t t = 0; t < sk; t++) {
                const floats val = *(const floats *)(vals + t * dvp + eb);
                for (int g = 0; g < SMYRF_GROUP; g++) acc[g] += logits[g * sp + t] * val;
            }
            const int64_t width = dv - eb < LANES ? dv - eb : LANES;
            for (int64_t g = 0; g < SMYRF_GROUP && i0 + g < sq; g++) {
                float *o = out + qpos[i0 + g] * dv + eb;
                for (int64_t e = 0; e < width; e++) o[e] = o[e] * keep[g] + acc[g][e];
            }
        }
    }
}

/* smyrf.cluster_attention for slices [bh0, bh1), all rounds: q (BH, N, D), k (BH, M, D),
 * v (BH, M, Dv) and out (BH, N, Dv) in dtype; q_orders (R, BH, N) and k_orders (R, BH, M),
 * positions in hash order with the real tokens first; n_real, m_real, n_clusters (B) the real
 * queries, real keys and L of each batch row. Per round, the sorted ranks are cut into L balanced clusters (rank r of
 * count in cluster floor(r L / count)) and each query attends to its cluster's keys.
 * out (BH, N, Dv) gets the attention over all rounds merged by softmax mass (eq. 15): the
 * sums of exp(logit) v over every (round, key) pair a query met, over the sums of exp(logit);
 * mx and den (BH, N) get each query's largest logit and sum of exp(logit - mx), den 0 for a
 * query that met no key (its row of out is 0). */
void smyrf_attention(const void *q, const void *k, const void *v, int64_t dtype, const int64_t *q_orders,
                     const int64_t *k_orders, const int64_t *n_real, const int64_t *m_real, const int64_t *n_clusters,
                     int64_t bh_total, int64_t heads, int64_t n, int64_t m, int64_t d, int64_t dv, int64_t rounds,
                     float scale, void *out, float *mx, float *den, int64_t bh0, int64_t bh1) {
    float *acc = dtype == F32 ? NULL : malloc(n * dv * sizeof *acc); /* a slice's sums, then rounded to dtype */
    float *rows = malloc(SMYRF_GROUP * d * sizeof *rows); /* rows of q or k widened to float32 */
    const int pairs = dtype == BF16 && d % 2 == 0 && bf16_dot(); /* logits by group_logits_bf16 */
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const int64_t b = bh / heads, nr = n_real[b], mr = m_real[b], lc = n_clusters[b];
        float *o = dtype == F32 ? (float *)out + bh * n * dv : acc, *mxs = mx + bh * n, *dens = den + bh * n;
        memset(o, 0, n * dv * sizeof *o);
        memset(mxs, 0, n * sizeof *mxs);
        memset(dens, 0, n * sizeof *dens);
        if (nr > 0 && mr > 0) { /* else no query, or no key to attend to: rows of 0 */
            const int64_t sk_max = (mr + lc - 1) / lc;
            const int64_t sp = (sk_max + LANES - 1) / LANES * LANES;
            float *kt = aligned_alloc(64, d * sp * sizeof *kt); /* floats, or with pairs half of it in words */
            uint32_t *kw = (uint32_t *)kt;
            const int64_t dvp = (dv + LANES - 1) / LANES * LANES;
            float *vals = aligned_alloc(64, sk_max * dvp * sizeof *vals);
            float *logits = aligned_alloc(64, SMYRF_GROUP * sp * sizeof *logits);
            memset(kt, 0, d * sp * sizeof *kt); /* key slots past a cluster's end stay 0 */
            memset(vals, 0, sk_max * dvp * sizeof *vals); /* and the value columns past Dv */
            for (int64_t r = 0; r < rounds; r++) {
                const int64_t *qo = q_orders + (r * bh_total + bh) * n, *ko = k_orders + (r * bh_total + bh) * m;
                for (int64_t c = 0; c < lc; c++) {
                    const int64_t q0 = cluster_start(c, nr, lc), q1 = cluster_start(c + 1, nr, lc);
                    const int64_t k0 = cluster_start(c, mr, lc), k1 = cluster_start(c + 1, mr, lc);
                    for (int64_t t = 0; t < k1 - k0; t++) {
                        const int64_t key = (bh * m + ko[k0 + t]) * d;
                        if (pairs) { /* the row's bfloat16 pairs as they are */
                            for (int64_t s = 0; s < d / 2; s++)
                                memcpy(kw + s * sp + t, (const uint16_t *)k + key + 2 * s, sizeof *kw);
                        } else {
                            const float *kr = row_floats(k, dtype, key, d, rows);
                            for (int64_t s = 0; s < d; s++) kt[s * sp + t] = kr[s];
                        }
                        widen_into(vals + t * dvp, v, dtype, (bh * m + ko[k0 + t]) * dv, dv);
                    }
                    for (int64_t t = k1 - k0; t < sk_max; t++) { /* slots past the cluster's end: 0 */
                        for (int64_t s = 0; pairs && s < d / 2; s++) kw[s * sp + t] = 0;
                        for (int64_t s = 0; !pairs && s < d; s++) kt[s * sp + t] = 0.0f;
                    }
                    smyrf_cluster(q, dtype, bh * n * d, qo + q0, q1 - q0, pairs ? (const void *)kw : kt, pairs, vals,
                                  k1 - k0, sp, d, dv, dvp, scale, o, mxs, dens, logits, rows);
                }
            }
            free(kt), free(vals), free(logits);
        }
        for (int64_t i = 0; i < n; i++) {
            const float inv = dens[i] > 0.0f ? 1.0f / dens[i] : 0.0f;
            for (int64_t e = 0; e < dv; e++) o[i * dv + e] *= inv;
            if (dtype != F32) store_row(out, dtype, (bh * n + i) * dv, o + i * dv, dv);
        }
    }
    free(acc), free(rows);
}

/* ---- SMYRF: hashing and sorting ----------------------------------------------------- */

/* The bits of +inf: padded tokens hash to it and sort last. Stored as an integer, because
 * -ffast-math lets the compiler assume that no float is infinite. */
static const uint32_t INF_BITS = 0x7f800000u;

/* Hashes of one side's tokens (smyrf.asymmetric_hashes) for one slice and every round:
 * x (T, D), real (T); radius = max |q|^2 + max |k|^2 over the real tokens; projections
 * (R, H, D + 2) at this slice's head; extra: the coordinate of the transformed vector that
 * holds sqrt(radius - |x|^2) (D + 1 for queries, D for keys). hashes (R, BH, T) at this slice. */
static void smyrf_side(const void *x, int64_t dtype, int64_t x0, const uint8_t *real, int64_t t_count, int64_t d,
                       float radius, const float *proj, int64_t proj_round, int64_t extra, int64_t rounds, float *hashes,
                       int64_t hash_round, float *scratch) {
    for (int64_t i = 0; i < t_count; i++) {
        if (!real[i]) {
            for (int64_t r = 0; r < rounds; r++) memcpy(hashes + r * hash_round + i, &INF_BITS, sizeof INF_BITS);
            continue;
        }
        const float *row = row_floats(x, dtype, x0 + i * d, d, scratch);
        float sq = 0.0f;
        for (int64_t s = 0; s < d; s++) sq += row[s] * row[s];
        const float lift = radius > sq ? sqrtf(radius - sq) : 0.0f;
        for (int64_t r = 0; r < rounds; r++) {
            const float *a = proj + r * proj_round;
            float h = lift * a[extra];
            for (int64_t s = 0; s < d; s++) h += row[s] * a[s];
            hashes[r * hash_round + i] = h;
        }
    }
}

/* Largest squared norm of the real rows of x (T, D) in dtype from element x0; 0 if none.
 * scratch: D floats. */
static float max_sq_norm(const void *x, int64_t dtype, int64_t x0, const uint8_t *real, int64_t t_count, int64_t d,
                         float *scratch) {
    float best = 0.0f;
    for (int64_t i = 0; i < t_count; i++) {
        if (!real[i]) continue;
        const float *row = row_floats(x, dtype, x0 + i * d, d, scratch);
        float sq = 0.0f;
        for (int64_t s = 0; s < d; s++) sq += row[s] * row[s];
        best = sq > best ? sq : best;
    }
    return best;
}

/* smyrf.asymmetric_hashes for slices [bh0, bh1): q (BH, N, D), k (BH, M, D) in dtype,
 * q_real (B, N), k_real (B, M), projections (R, H, D + 2) -> q_hashes (R, BH, N), k_hashes
 * (R, BH, M), +inf for padded tokens. */
void smyrf_hashes(const void *q, const void *k, int64_t dtype, const uint8_t *q_real, const uint8_t *k_real,
                  const float *projections, int64_t bh_total, int64_t heads, int64_t n, int64_t m, int64_t d, int64_t rounds,
                  float *q_hashes, float *k_hashes, int64_t bh0, int64_t bh1) {
    float *scratch = malloc(d * sizeof *scratch);
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const int64_t b = bh / heads, qs = bh * n * d, ks = bh * m * d;
        const float radius = max_sq_norm(q, dtype, qs, q_real + b * n, n, d, scratch) +
                             max_sq_norm(k, dtype, ks, k_real + b * m, m, d, scratch);
        const float *proj = projections + (bh % heads) * (d + 2);
        smyrf_side(q, dtype, qs, q_real + b * n, n, d, radius, proj, heads * (d + 2), d + 1, rounds, q_hashes + bh * n,
                   bh_total * n, scratch);
        smyrf_side(k, dtype, ks, k_real + b * m, m, d, radius, proj, heads * (d + 2), d, rounds, k_hashes + bh * m,
                   bh_total * m, scratch);
    }
    free(scratch);
}

/* Radix sort digits: 11 bits, three passes over 32-bit keys. */
#define RADIX_BITS 11
#define RADIX (1 << RADIX_BITS)

/* Positions of the floats `values` (T) in ascending order, equal values by position (a
 * stable argsort; -0 equals +0, +inf last), into order (T). LSD radix sort on the floats'
 * bits mapped to unsigned integers of the same order. keys, other: T scratch each. */
static void argsort_one(const float *values, int64_t t_count, int64_t *order, uint32_t *keys, uint32_t *other_keys,
                        int64_t *other, int64_t *count) {
    for (int64_t i = 0; i < t_count; i++) {
        uint32_t bits;
        memcpy(&bits, values + i, sizeof bits);
        bits = bits == 0x80000000u ? 0u : bits; /* -0 sorts with +0 */
        keys[i] = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
        order[i] = i;
    }
    for (int shift = 0; shift < 32; shift += RADIX_BITS) {
        memset(count, 0, RADIX * sizeof *count);
        for (int64_t i = 0; i < t_count; i++) count[(keys[i] >> shift) & (RADIX - 1)]++;
        if (count[(keys[0] >> shift) & (RADIX - 1)] == t_count) continue; /* one digit: nothing moves */
        int64_t sum = 0;
        for (int64_t j = 0; j < RADIX; j++) {
            const int64_t c = count[j];
            count[j] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < t_count; i++) {
            const int64_t to = count[(keys[i] >> shift) & (RADIX - 1)]++;
            other_keys[to] = keys[i];
            other[to] = order[i];
        }
        memcpy(keys, other_keys, t_count * sizeof *keys);
        memcpy(order, other, t_count * sizeof *order);
    }
}

/* A stable argsort of every row of values (rows, T) into order (rows, T); rows [r0, r1). */
void argsort_rows(const float *values, int64_t t_count, int64_t *order, int64_t r0, int64_t r1) {
    if (t_count == 0) return;
    uint32_t *keys = malloc(t_count * sizeof *keys), *other_keys = malloc(t_count * sizeof *other_keys);
    int64_t *other = malloc(t_count * sizeof *other), *count = malloc(RADIX * sizeof *count);
    for (int64_t r = r0; r < r1; r++) argsort_one(values + r * t_count, t_count, order + r * t_count, keys, other_keys, other, count);
    free(keys), free(other_keys), free(other), free(count);
}

/* ---- Banded attention ---------------------------------------------------------------- */

/* The banded loop's vectors: one register wide (8 floats on AVX2, 16 on AVX-512), and its
 * register tile: BANDED_ROWS queries by two vectors (of keys, or of value elements), each
 * broadcast query element or weight feeding two FMAs. AVX-512's 32 registers hold 8 rows'
 * 16 sums; AVX2's 16 hold 4 rows'. */
#if defined(__AVX512F__)
#define BANDED_LANES 16
#define BANDED_ROWS 8
#else
#define BANDED_LANES 8
#define BANDED_ROWS 4
#endif
typedef float bfloats __attribute__((vector_size(4 * BANDED_LANES)));
/* Queries whose logits are computed together: a pair of key panels, read once from memory,
 * meets all of them from L1. */
#define BANDED_GROUP 16
/* Keys a tile covers: spans are whole multiples of it. */
#define BANDED_WIDE (2 * BANDED_LANES)
/* The bias of a position that stands for no key: its weight comes out exactly 0. */
#define BANDED_NONE (-1e30f)

/* Keys and values are packed in panels of BANDED_LANES, as a GEMM packs its operands, so that
 * the inner loops read memory in order: key o's dimension s at keys[(o / lanes * D + s) *
 * lanes + o % lanes], value o's element e at values[e / lanes * plane + o * lanes + e %
 * lanes]. A head's keys and values are packed once; a span is a run of BANDED_WIDE-aligned
 * keys of them (the band, a far block) or of the block's gathered extras (sinks, pooled keys). */
typedef struct {
    const float *keys, *values;
    int64_t plane, count; /* floats between value planes; keys, a multiple of BANDED_WIDE */
    const uint32_t *words; /* the keys as bfloat16 pairs (banded_logits_bf16), or NULL */
    const uint32_t *value_words; /* and the values as pairs of keys (banded_values_bf16) */
} banded_span;

/* A key row and its value row (float32) as key `at` of panels laid out as above, the value's
 * elements from dv to the next whole tile zeros. */
static void banded_put(float *keys, float *values, int64_t plane, int64_t at, const float *key, const float *value,
                       int64_t d, int64_t dv) {
    float *to = keys + (at / BANDED_LANES * d) * BANDED_LANES + at % BANDED_LANES;
    for (int64_t s = 0; s < d; s++) to[s * BANDED_LANES] = key[s];
    const int64_t dvp = (dv + BANDED_WIDE - 1) / BANDED_WIDE * BANDED_WIDE;
    for (int64_t e0 = 0; e0 < dvp; e0 += BANDED_LANES) { /* a panel's row: contiguous, not a scatter */
        float *row = values + e0 / BANDED_LANES * plane + at * BANDED_LANES;
        for (int64_t l = 0; l < BANDED_LANES; l++) row[l] = e0 + l < dv ? value[e0 + l] : 0.0f;
    }
}

/* logits (BANDED_GROUP rows of `stride`) = scale * query g . key o + bias[o] over a span,
 * for the group's queries laid out by dimension, xq (D, BANDED_GROUP). */
static void banded_logits(const float *xq, const banded_span *span, int64_t d, float scale, const float *bias,
                          float *logits, int64_t stride) {
    for (int64_t tb = 0; tb < span->count; tb += BANDED_WIDE) {
        const float *panel = span->keys + tb * d, *next = panel + BANDED_LANES * d;
        const bfloats b0 = *(const bfloats *)(bias + tb), b1 = *(const bfloats *)(bias + tb + BANDED_LANES);
        for (int g0 = 0; g0 < BANDED_GROUP; g0 += BANDED_ROWS) {
            bfloats a0[BANDED_ROWS], a1[BANDED_ROWS];
            for (int r = 0; r < BANDED_ROWS; r++) a0[r] = a1[r] = (bfloats){0};
            for (int64_t s = 0; s < d; s++) {
                const bfloats c0 = *(const bfloats *)(panel + s * BANDED_LANES);
                const bfloats c1 = *(const bfloats *)(next + s * BANDED_LANES);
                for (int r = 0; r < BANDED_ROWS; r++) {
                    const float x = xq[s * BANDED_GROUP + g0 + r];
                    a0[r] += x * c0;
                    a1[r] += x * c1;
                }
            }
            for (int r = 0; r < BANDED_ROWS; r++) {
                *(bfloats *)(logits + (g0 + r) * stride + tb) = a0[r] * scale + b0;
                *(bfloats *)(logits + (g0 + r) * stride + tb + BANDED_LANES) = a1[r] * scale + b1;
            }
        }
    }
}

#if defined(__AVX512F__)
/* banded_logits on bfloat16 queries and keys by AVX512-BF16's vdpbf16ps, as SMYRF's
 * group_logits_bf16: two exact products a step added to a float32 sum, half the instructions
 * of widening and multiplying; the sums differ from banded_logits' by their order, within
 * float32 rounding (bfloat16 subnormals count as 0). Only for keys that are bfloat16 rows as
 * they are (the band, the far blocks), not the gathered extras (pooled keys are float32).
 * words: a span's keys by panels and pairs of dimensions, word (o / BANDED_LANES * D / 2 + s) *
 * BANDED_LANES + o % BANDED_LANES holding key o's dimensions 2s and 2s + 1; xw (D / 2,
 * BANDED_GROUP) the group's queries' words. */
__attribute__((target("avx512bf16"))) static void banded_logits_bf16(const uint32_t *xw, const uint32_t *words,
                                                                     int64_t count, int64_t pairs, float scale,
                                                                     const float *bias, float *logits, int64_t stride) {
    for (int64_t tb = 0; tb < count; tb += BANDED_WIDE) {
        const uint32_t *panel = words + tb * pairs, *next = panel + BANDED_LANES * pairs;
        const __m512 b0 = _mm512_loadu_ps(bias + tb), b1 = _mm512_loadu_ps(bias + tb + BANDED_LANES);
        for (int g0 = 0; g0 < BANDED_GROUP; g0 += BANDED_ROWS) {
            __m512 a0[BANDED_ROWS], a1[BANDED_ROWS];
            for (int r = 0; r < BANDED_ROWS; r++) a0[r] = a1[r] = _mm512_setzero_ps();
            for (int64_t s = 0; s < pairs; s++) {
                const __m512bh c0 = (__m512bh)_mm512_load_si512(panel + s * BANDED_LANES);
                const __m512bh c1 = (__m512bh)_mm512_load_si512(next + s * BANDED_LANES);
                for (int r = 0; r < BANDED_ROWS; r++) {
                    const __m512bh x = (__m512bh)_mm512_set1_epi32((int)xw[s * BANDED_GROUP + g0 + r]);
                    a0[r] = _mm512_dpbf16_ps(a0[r], x, c0);
                    a1[r] = _mm512_dpbf16_ps(a1[r], x, c1);
                }
            }
            const __m512 scaled = _mm512_set1_ps(scale);
            for (int r = 0; r < BANDED_ROWS; r++) {
                _mm512_storeu_ps(logits + (g0 + r) * stride + tb, _mm512_add_ps(_mm512_mul_ps(a0[r], scaled), b0));
                _mm512_storeu_ps(logits + (g0 + r) * stride + tb + BANDED_LANES,
                                 _mm512_add_ps(_mm512_mul_ps(a1[r], scaled), b1));
            }
        }
    }
}
#endif

typedef int32_t bints __attribute__((vector_size(4 * BANDED_LANES)));

/* e^x for x in [-87, 0], a vector at a time, inline: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2
 * in two parts), e^r = 1 + r + r^2 P(r) with Cephes' degree-5 P (about 1 ulp, as the vector
 * expf), 2^n written into the exponent bits. The vector expf is a call, around which the
 * softmax loop spills its registers. */
static inline bfloats banded_exp(bfloats x) {
    const bints n = __builtin_convertvector(x * 1.44269504f - 0.5f, bints); /* nearest, for x <= 0 */
    const bfloats f = __builtin_convertvector(n, bfloats);
    const bfloats r = x - f * 0.693359375f - f * -2.12194440e-4f;
    bfloats poly = r * 1.9875691500e-4f + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    return (poly * (r * r) + r + 1.0f) * (bfloats)((n + 127) << 23);
}

/* A row's logits (p of them, a multiple of BANDED_WIDE) to its softmax weights, unnormalised,
 * in place: e^(logit - max), 0 at biased-out positions; returns 1 / their sum. */
static float banded_softmax(float *row, int64_t p) {
    /* the max in four vectors' lanes at a time: four chains, not one, wait on vmaxps' latency */
    float tops[4 * BANDED_LANES];
    for (int l = 0; l < 4 * BANDED_LANES; l++) tops[l] = -FLT_MAX;
    int64_t j = 0;
    for (; j + 4 * BANDED_LANES <= p; j += 4 * BANDED_LANES)
        for (int l = 0; l < 4 * BANDED_LANES; l++) tops[l] = row[j + l] > tops[l] ? row[j + l] : tops[l];
    for (; j < p; j++) tops[0] = row[j] > tops[0] ? row[j] : tops[0];
    float top = -FLT_MAX;
    for (int l = 0; l < 4 * BANDED_LANES; l++) top = tops[l] > top ? tops[l] : top;
    bfloats total = {0};
    for (j = 0; j < p; j += BANDED_LANES) {
        bfloats *at = (bfloats *)(row + j);
        const bfloats x = *at - top, floor = (bfloats){0} - 87.0f;
        /* clamped to e^-87's normal range; the biased positions' weights are then made 0 */
        const bints low = x < floor;
        const bfloats w = banded_exp((bfloats)(((bints)x & ~low) | ((bints)floor & low)));
        *at = (bfloats)((bints)w & (*at > 0.5f * BANDED_NONE));
        total += *at;
    }
    float sum = 0.0f;
    for (int l = 0; l < BANDED_LANES; l++) sum += total[l];
    return 1.0f / sum;
}

/* acc (BANDED_GROUP rows of dvp) = weights (rows of `stride`) @ the spans' values, each row
 * times its inv. */
static void banded_values(const float *weights, int64_t stride, const banded_span *spans, int64_t n_spans,
                          const float *inv, int64_t dvp, float *acc) {
    for (int64_t eb = 0; eb < dvp; eb += BANDED_WIDE) { /* two value vectors meet BANDED_ROWS rows */
        for (int g0 = 0; g0 < BANDED_GROUP; g0 += BANDED_ROWS) {
            bfloats s0[BANDED_ROWS], s1[BANDED_ROWS];
            for (int r = 0; r < BANDED_ROWS; r++) s0[r] = s1[r] = (bfloats){0};
            const float *w = weights + g0 * stride;
            for (int64_t i = 0; i < n_spans; i++) {
                const float *v0 = spans[i].values + eb / BANDED_LANES * spans[i].plane;
                const float *v1 = v0 + spans[i].plane;
                for (int64_t o = 0; o < spans[i].count; o++) {
                    const bfloats x0 = *(const bfloats *)(v0 + o * BANDED_LANES);
                    const bfloats x1 = *(const bfloats *)(v1 + o * BANDED_LANES);
                    for (int r = 0; r < BANDED_ROWS; r++) {
                        const float wr = w[r * stride + o];
                        s0[r] += wr * x0;
                        s1[r] += wr * x1;
                    }
                }
                w += spans[i].count;
            }
            for (int r = 0; r < BANDED_ROWS; r++) {
                *(bfloats *)(acc + (g0 + r) * dvp + eb) = s0[r] * inv[g0 + r];
                *(bfloats *)(acc + (g0 + r) * dvp + eb + BANDED_LANES) = s1[r] * inv[g0 + r];
            }
        }
    }
}

#if defined(__AVX512F__)
/* banded_values with the spans that have words on vdpbf16ps, from their weights rounded to
 * bfloat16 and paired by banded_round_weights into ww (rows of stride / 2 words); a pair of
 * keys' values is one word a value element, word (e / BANDED_LANES * plane + o / 2 *
 * BANDED_LANES + e % BANDED_LANES) of value_words holding keys o and o + 1 (plane: words
 * between planes, half the float panels'). The other spans (the gathered extras) take
 * banded_values' float32 arithmetic on `weights`. acc as banded_values'. */
__attribute__((target("avx512bf16"))) static void banded_values_bf16(const float *weights, uint32_t *ww, int64_t stride,
                                                                     const banded_span *spans, int64_t n_spans,
                                                                     const float *inv, int64_t dvp, float *acc) {
    for (int64_t eb = 0; eb < dvp; eb += BANDED_WIDE) {
        for (int g0 = 0; g0 < BANDED_GROUP; g0 += BANDED_ROWS) {
            __m512 s0[BANDED_ROWS], s1[BANDED_ROWS];
            for (int r = 0; r < BANDED_ROWS; r++) s0[r] = s1[r] = _mm512_setzero_ps();
            for (int64_t i = 0, at = 0; i < n_spans; at += spans[i++].count) {
                const int64_t count = spans[i].count;
                if (spans[i].value_words) {
                    const int64_t plane = spans[i].plane / 2;
                    const uint32_t *u0 = spans[i].value_words + eb / BANDED_LANES * plane, *u1 = u0 + plane;
                    for (int64_t o = 0; o < count; o += 2) {
                        const __m512bh x0 = (__m512bh)_mm512_load_si512(u0 + o / 2 * BANDED_LANES);
                        const __m512bh x1 = (__m512bh)_mm512_load_si512(u1 + o / 2 * BANDED_LANES);
                        for (int r = 0; r < BANDED_ROWS; r++) {
                            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)ww[(g0 + r) * (stride / 2) + (at + o) / 2]);
                            s0[r] = _mm512_dpbf16_ps(s0[r], w, x0);
                            s1[r] = _mm512_dpbf16_ps(s1[r], w, x1);
                        }
                    }
                } else {
                    const float *v0 = spans[i].values + eb / BANDED_LANES * spans[i].plane;
                    const float *v1 = v0 + spans[i].plane;
                    for (int64_t o = 0; o < count; o++) {
                        const __m512 x0 = _mm512_load_ps(v0 + o * BANDED_LANES);
                        const __m512 x1 = _mm512_load_ps(v1 + o * BANDED_LANES);
                        for (int r = 0; r < BANDED_ROWS; r++) {
                            const __m512 w = _mm512_set1_ps(weights[(g0 + r) * stride + at + o]);
                            s0[r] = _mm512_fmadd_ps(w, x0, s0[r]);
                            s1[r] = _mm512_fmadd_ps(w, x1, s1[r]);
                        }
                    }
                }
            }
            for (int r = 0; r < BANDED_ROWS; r++) {
                const __m512 scaled = _mm512_set1_ps(inv[g0 + r]);
                _mm512_storeu_ps(acc + (g0 + r) * dvp + eb, _mm512_mul_ps(s0[r], scaled));
                _mm512_storeu_ps(acc + (g0 + r) * dvp + eb + BANDED_LANES, _mm512_mul_ps(s1[r], scaled));
            }
        }
    }
}

/* A row's weights (p of them) over the spans with words rounded to bfloat16 (as flash
 * attention's probabilities are before they meet bfloat16 values), in place and paired into
 * words (word o / 2: positions o, o + 1); returns 1 / the sum of the row's weights as rounded,
 * so that the row is divided by the sum of the weights its values meet (positions of spans
 * without words keep their float32 weight). */
__attribute__((target("avx512bf16"))) static float banded_round_weights(float *row, uint32_t *words,
                                                                        const banded_span *spans, int64_t n_spans) {
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0, at = 0; i < n_spans; at += spans[i++].count) {
        for (int64_t o = at; o < at + spans[i].count; o += 2 * BANDED_LANES) {
            __m512 lo = _mm512_loadu_ps(row + o), hi = _mm512_loadu_ps(row + o + BANDED_LANES);
            if (spans[i].value_words) {
                /* positions o .. o + 31 rounded, in order: word j holds o + 2j (low) and o + 2j + 1 */
                const __m512i rounded = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
                _mm512_storeu_si512(words + o / 2, rounded);
                lo = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(rounded));
                hi = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(rounded, 1));
                _mm512_storeu_ps(row + o, lo), _mm512_storeu_ps(row + o + BANDED_LANES, hi);
            }
            total = _mm512_add_ps(total, _mm512_add_ps(lo, hi));
        }
    }
    const float sum = _mm512_reduce_add_ps(total);
    return 1.0f / sum;
}
#endif

/* The span of keys [lo, hi) of a head packed whole (keys, values: panels of `plane` keys),
 * widened to whole tiles from lo rounded down, with its bias at `bias`: 0 where `take` (a
 * row's flags, per key) and the key is in [lo, hi), BANDED_NONE elsewhere. */
static banded_span banded_run(const float *keys, const float *values, const uint32_t *words,
                              const uint32_t *value_words, int64_t plane, int64_t d, int64_t lo, int64_t hi,
                              const uint8_t *take, float *bias) {
    const int64_t first = lo / BANDED_LANES * BANDED_LANES;
    const int64_t count = (hi - first + BANDED_WIDE - 1) / BANDED_WIDE * BANDED_WIDE;
    for (int64_t o = 0; o < count; o++) {
        const int64_t j = first + o;
        bias[o] = j >= lo && j < hi && take[j] ? 0.0f : BANDED_NONE;
    }
    return (banded_span){keys + first * d, values + first * BANDED_LANES, plane, count,
                         words ? words + first * (d / 2) : NULL,
                         value_words ? value_words + first / 2 * BANDED_LANES : NULL};
}

/* banded.attend for slices [bh0, bh1): q, k (BH, N, D), v (BH, N, Dv) and out (BH, N, Dv) in
 * dtype; pkeys (BH, NB, D) and pvals (BH, NB, Dv) float32, each block's mean real non-sink key
 * and value; plog (B, NB) the log of how many there are, pooled_real (B, NB) whether there are
 * any (-inf is not passed: -ffast-math assumes finite floats); sinks (B, S) positions
 * and sink_real (B, S); key_real (B, N); counted (B, N) the real non-sink keys; chosen
 * (BH, NB, R) the far blocks each query block attends exactly (-1: none). A query of block t
 * gets one softmax over the real keys of blocks t - band .. t + band, the real sinks whose
 * block is outside that band, the counted keys of its chosen blocks, and the pooled keys of
 * the other blocks outside the band (logit raised by plog); padded queries get 0.
 *
 * Each head's keys and values are packed once; a query block's band and far blocks are spans
 * of them, its sinks and pooled keys are gathered into one more span, and positions a span
 * covers past its keys (tile alignment, padding) are biased out. */
void banded_attention(const void *q, const void *k, const void *v, int64_t dtype, const float *pkeys,
                      const float *pvals, const float *plog, const uint8_t *pooled_real, const int64_t *sinks, const uint8_t *sink_real,
                      const uint8_t *key_real, const uint8_t *counted, const int64_t *chosen, int64_t r_count,
                      int64_t heads, int64_t n, int64_t d, int64_t dv, int64_t block,
                      int64_t band, int64_t s_count, float scale, void *out, int64_t bh0, int64_t bh1) {
    const int64_t nb = (n + block - 1) / block;
    if (band > nb - 1) band = nb - 1;
    const int64_t dvp = (dv + BANDED_WIDE - 1) / BANDED_WIDE * BANDED_WIDE;
    /* a head's packed keys: a span may reach a tile past the last key */
    const int64_t np = (n + 2 * BANDED_WIDE) / BANDED_LANES * BANDED_LANES;
    const int64_t extras = (s_count + nb + BANDED_WIDE - 1) / BANDED_WIDE * BANDED_WIDE;
    const int64_t plane = np * BANDED_LANES, extra_plane = extras * BANDED_LANES; /* floats a value plane */
    const int64_t run = block + 2 * BANDED_WIDE; /* a far block's span, at most */
    const int64_t p_max = (2 * band + 1) * block + 2 * BANDED_WIDE + r_count * run + extras;
    float *keys = aligned_alloc(64, np * d * sizeof *keys);
    float *values = aligned_alloc(64, dvp * np * sizeof *values);
    float *xkeys = aligned_alloc(64, extras * d * sizeof *xkeys);
    float *xvalues = aligned_alloc(64, dvp * extras * sizeof *xvalues);
    float *bias = aligned_alloc(64, p_max * sizeof *bias);
    float *logits = aligned_alloc(64, BANDED_GROUP * p_max * sizeof *logits);
    float *acc = aligned_alloc(64, BANDED_GROUP * dvp * sizeof *acc);
    float *xq = malloc(BANDED_GROUP * d * sizeof *xq);
    float *scratch = malloc((d + dv) * sizeof *scratch); /* a widened key row, then its value row */
    float *zeros = calloc(d > dv ? d : dv, sizeof *zeros); /* the rows past the last key */
    banded_span *spans = malloc((r_count + 2) * sizeof *spans);
    /* bfloat16 rows on a CPU with vdpbf16ps: the band's and far blocks' logits by
     * banded_logits_bf16, from the head's keys as words (kw) and the group's queries' (xw) */
    const int64_t pairs = d / 2;
    const int by_words = dtype == BF16 && d % 2 == 0 && bf16_dot();
    uint32_t *kw = by_words ? aligned_alloc(64, np * pairs * sizeof *kw) : NULL;
    uint32_t *xw = by_words ? malloc(BANDED_GROUP * pairs * sizeof *xw) : NULL;
    /* and the values by pairs of keys (vw), the weights by pairs (ww) */
    uint32_t *vw = by_words ? aligned_alloc(64, dvp * np / 2 * sizeof *vw) : NULL;
    uint32_t *ww = by_words ? malloc(BANDED_GROUP * (p_max / 2 + 1) * sizeof *ww) : NULL;
    /* positions past a block's extras are biased out, but read: finite (stale or 0) */
    memset(xkeys, 0, extras * d * sizeof *xkeys);
    memset(xvalues, 0, dvp * extras * sizeof *xvalues);
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const int64_t b = bh / heads;
        const uint8_t *real = key_real + b * n, *count_row = counted + b * n;
        for (int64_t j = 0; !by_words && j < np; j++) /* the head's keys and values, zeros past the last */
            banded_put(keys, values, plane, j, j < n ? row_floats(k, dtype, (bh * n + j) * d, d, scratch) : zeros,
                       j < n ? row_floats(v, dtype, (bh * n + j) * dv, dv, scratch + d) : zeros, d, dv);
        for (int64_t j = 0; vw && j < np; j += 2) { /* the values as words */
            const uint16_t *even = (const uint16_t *)v + (bh * n + j) * dv, *odd = even + dv;
            for (int64_t e0 = 0; e0 < dvp; e0 += BANDED_LANES) { /* a panel's row: contiguous */
                uint32_t *row = vw + e0 / BANDED_LANES * (plane / 2) + j / 2 * BANDED_LANES;
                for (int64_t l = 0, e = e0; l < BANDED_LANES; l++, e++) {
                    const uint32_t lo = j < n && e < dv ? even[e] : 0, hi = j + 1 < n && e < dv ? odd[e] : 0;
                    row[l] = lo | hi << 16;
                }
            }
        }
        for (int64_t j = 0; kw && j < np; j++) { /* and the keys as words */
            uint32_t *to = kw + (j / BANDED_LANES * pairs) * BANDED_LANES + j % BANDED_LANES;
            const uint16_t *key = (const uint16_t *)k + (bh * n + j) * d;
            for (int64_t s = 0; s < pairs; s++) {
                uint32_t word = 0;
                if (j < n) memcpy(&word, key + 2 * s, sizeof word);
                to[s * BANDED_LANES] = word;
            }
        }
        for (int64_t t = 0; t < nb; t++) {
            int64_t n_spans = 0, p = 0;
            const int64_t lo = (t - band) * block < 0 ? 0 : (t - band) * block;
            const int64_t hi = (t + band + 1) * block > n ? n : (t + band + 1) * block;
            spans[n_spans] = banded_run(keys, values, kw, vw, plane, d, lo, hi, real, bias + p);
            p += spans[n_spans++].count;
            const int64_t *picked = chosen + (bh * nb + t) * r_count;
            for (int64_t r = 0; r < r_count; r++) {
                if (picked[r] < 0) continue;
                const int64_t j1 = (picked[r] + 1) * block > n ? n : (picked[r] + 1) * block;
                spans[n_spans] = banded_run(keys, values, kw, vw, plane, d, picked[r] * block, j1, count_row,
                                            bias + p);
                p += spans[n_spans++].count;
            }
            int64_t e = 0; /* the extras: sinks outside the band, then the other pooled blocks */
            for (int64_t s = 0; s < s_count; s++) {
                const int64_t j = sinks[b * s_count + s], sb = j / block;
                if (!sink_real[b * s_count + s] || (sb >= t - band && sb <= t + band)) continue;
                banded_put(xkeys, xvalues, extra_plane, e, row_floats(k, dtype, (bh * n + j) * d, d, scratch),
                           row_floats(v, dtype, (bh * n + j) * dv, dv, scratch + d), d, dv);
                bias[p + e++] = 0.0f;
            }
            for (int64_t c = 0; c < nb; c++) {
                if ((c >= t - band && c <= t + band) || !pooled_real[b * nb + c]) continue;
                int hit = 0;
                for (int64_t r = 0; r < r_count; r++) hit |= picked[r] == c;
                if (hit) continue;
                banded_put(xkeys, xvalues, extra_plane, e, pkeys + (bh * nb + c) * d, pvals + (bh * nb + c) * dv, d, dv);
                bias[p + e++] = plog[b * nb + c];
            }
            if (e > 0) {
                const int64_t count = (e + BANDED_WIDE - 1) / BANDED_WIDE * BANDED_WIDE;
                for (int64_t o = e; o < count; o++) bias[p + o] = BANDED_NONE;
                spans[n_spans++] = (banded_span){xkeys, xvalues, extra_plane, count, NULL, NULL};
                p += count;
            }
            const int64_t q0 = t * block, q1 = q0 + block > n ? n : q0 + block;
            for (int64_t i0 = q0; i0 < q1; i0 += BANDED_GROUP) {
                for (int g = 0; g < BANDED_GROUP; g++) { /* the group's rows, by dimension */
                    const int64_t i = i0 + g < q1 ? i0 + g : q1 - 1; /* a short tail repeats */
                    const float *x = row_floats(q, dtype, (bh * n + i) * d, d, scratch);
                    for (int64_t s = 0; s < d; s++) xq[s * BANDED_GROUP + g] = x[s];
                    for (int64_t s = 0; xw && s < pairs; s++)
                        memcpy(xw + s * BANDED_GROUP + g, (const uint16_t *)q + (bh * n + i) * d + 2 * s, sizeof *xw);
                }
                for (int64_t i = 0, at = 0; i < n_spans; at += spans[i++].count) {
#if defined(__AVX512F__)
                    if (spans[i].words) {
                        banded_logits_bf16(xw, spans[i].words, spans[i].count, pairs, scale, bias + at, logits + at, p);
                        continue;
                    }
#endif
                    banded_logits(xq, &spans[i], d, scale, bias + at, logits + at, p);
                }
                float inv[BANDED_GROUP];
                for (int g = 0; g < BANDED_GROUP; g++) {
                    if (i0 + g >= q1 || !real[i0 + g]) { /* no output: its weights 0 */
                        memset(logits + g * p, 0, p * sizeof *logits);
                        inv[g] = 0.0f;
                    } else {
                        inv[g] = banded_softmax(logits + g * p, p);
                    }
                }
#if defined(__AVX512F__)
                if (ww) {
                    for (int g = 0; g < BANDED_GROUP; g++) {
                        if (inv[g] == 0.0f) memset(ww + g * (p / 2), 0, p / 2 * sizeof *ww);
                        else inv[g] = banded_round_weights(logits + g * p, ww + g * (p / 2), spans, n_spans);
                    }
                    banded_values_bf16(logits, ww, p, spans, n_spans, inv, dvp, acc);
                } else
#endif
                banded_values(logits, p, spans, n_spans, inv, dvp, acc);
                for (int g = 0; g < BANDED_GROUP && i0 + g < q1; g++) {
                    if (dtype == F32) memcpy((float *)out + (bh * n + i0 + g) * dv, acc + g * dvp, dv * sizeof(float));
                    else store_row(out, dtype, (bh * n + i0 + g) * dv, acc + g * dvp, dv);
                }
            }
        }
    }
    free(keys), free(values), free(xkeys), free(xvalues), free(bias), free(logits), free(acc), free(xq), free(scratch);
    free(zeros), free(spans), free(kw), free(xw), free(vw), free(ww);
}

/* ---- Banded attention: the far blocks' choice logits --------------------------------- */

/* Queries scored together by banded_block_max: each vector of pooled keys read from L1 feeds
 * that many FMA chains. */
#define CHOICE_GROUP 8

/* banded.block_max_logits for slices [bh0, bh1): q (BH, N, D) in dtype; keys_t (BH, D, NBP)
 * float32, 64-byte aligned, each head's pooled keys dimension by dimension, NBP a multiple of
 * LANES (padding columns finite); real (B, N) the real queries -> out (BH, NB, NB) float32:
 * for query block t (`size` queries) and block c, the largest q . key_c over t's real
 * queries, each dot summed over D in order. A query block with no real query gets -FLT_MAX
 * (-ffast-math assumes finite floats; the caller masks it). */
void banded_block_max(const void *q, int64_t dtype, const float *keys_t, const uint8_t *real, int64_t h, int64_t n,
                      int64_t d, int64_t blocks, int64_t nbp, int64_t size, float *out, int64_t bh0, int64_t bh1) {
    float *rows = malloc(CHOICE_GROUP * d * sizeof *rows); /* the group's queries, widened */
    floats *best = aligned_alloc(64, nbp * sizeof(float));
    const float *x[CHOICE_GROUP];
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const uint8_t *mask = real + bh / h * n;
        const float *kt = keys_t + bh * d * nbp;
        for (int64_t t = 0; t < blocks; t++) {
            for (int64_t jb = 0; jb < nbp / LANES; jb++) best[jb] = (floats){0} - FLT_MAX;
            const int64_t stop = (t + 1) * size < n ? (t + 1) * size : n;
            for (int64_t i = t * size; i < stop;) {
                int g = 0;
                for (; i < stop && g < CHOICE_GROUP; i++)
                    if (mask[i]) x[g] = row_floats(q, dtype, (bh * n + i) * d, d, rows + g * d), g++;
                if (g == 0) break;
                for (int r = g; r < CHOICE_GROUP; r++) x[r] = x[0]; /* a short group repeats a query: same max */
                for (int64_t jb = 0; jb < nbp; jb += LANES) {
                    floats acc[CHOICE_GROUP] = {0};
                    for (int64_t s = 0; s < d; s++) {
                        const floats col = *(const floats *)(kt + s * nbp + jb);
                        for (int r = 0; r < CHOICE_GROUP; r++) acc[r] += x[r][s] * col;
                    }
                    floats top = best[jb / LANES];
                    for (int r = 0; r < CHOICE_GROUP; r++) {
                        const ints wins = acc[r] > top;
                        top = (floats)(((ints)acc[r] & wins) | ((ints)top & ~wins));
                    }
                    best[jb / LANES] = top;
                }
            }
            memcpy(out + (bh * blocks + t) * blocks, best, blocks * sizeof *out);
        }
    }
    free(rows), free(best);
}

/* ---- Rotary positions ------------------------------------------------------------------ */

/* kernels.reference.rotary.apply_rotary_torch for tokens [t0, t1): x and out (T, H, D) in dtype,
 * cos and sin float32, token t's row at t * cs_stride (shared by its heads). Each element is
 * x * cos + rotated * sin in float32, each product and the sum rounded as PyTorch's separate
 * multiplies and add round them, then rounded once to dtype; rotated is (-x[D/2:], x[:D/2]),
 * or with `interleaved` (-x[2i+1], x[2i]) in each pair. The products go through memory before
 * the sum (the empty asm below): -ffast-math would otherwise fuse a product into the add, whose
 * single rounding differs from PyTorch's two. */
void rotary(const void *x, int64_t dtype, const float *cos, const float *sin, int64_t cs_stride, int64_t heads,
            int64_t d, int64_t interleaved, void *out, int64_t t0, int64_t t1) {
    float *row = malloc(4 * d * sizeof *row), *turned = row + d, *straight = row + 2 * d, *across = row + 3 * d;
    const int64_t half = d / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = (t * heads + h) * d;
            widen_into(row, x, dtype, at, d);
            if (interleaved) {
                for (int64_t i = 0; i + 1 < d; i += 2) turned[i] = -row[i + 1], turned[i + 1] = row[i];
            } else {
                for (int64_t i = 0; i < half; i++) turned[i] = -row[half + i], turned[half + i] = row[i];
            }
            for (int64_t i = 0; i < d; i++) straight[i] = row[i] * c[i], across[i] = turned[i] * s[i];
            __asm__ volatile("" : : : "memory");
            for (int64_t i = 0; i < d; i++) row[i] = straight[i] + across[i];
            store_row(out, dtype, at, row, d);
        }
    }
    free(row);
}
