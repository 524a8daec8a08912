/* Paged attention on the CPU over the block-first KV cache, read in place (no gather).

   One call runs one layer for every sequence of a step: decodes (one query) and prompt chunks
   (several queries, causal, after any cached prefix) alike. A work item is one sequence and one
   KV head; its query heads (GQA) share every K and V row it loads. Keys are taken a block at a
   time: the block's scores, then one online-softmax rescale, then the weighted V rows. fp32
   accumulation; the cache may be fp32 or bf16; queries and output are fp32.

   Built by cpu_paged_attention.py with the system's C compiler for the machine it runs on. */

#include <float.h>
#include <stdint.h>
#include <string.h>

#define MAX_TILE 32    /* query vectors (query rows x the query heads of one KV head) per tile */
#define MAX_DIM 256    /* head_dim */
#define MAX_BLOCK 256  /* block_size */

/* A K or V row as fp32: in place for an fp32 cache, converted into `buf` for bf16. */
static inline __attribute__((always_inline)) const float *row_at(const void *cache, int64_t offset, float *buf,
                                                                 const int dim, const int bf16) {
    if (!bf16) return (const float *)cache + offset;
    const uint16_t *s = (const uint16_t *)cache + offset;
#pragma omp simd
    for (int d = 0; d < dim; ++d) {
        const uint32_t bits = (uint32_t)s[d] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        buf[d] = f;
    }
    return buf;
}

/* GCC/Clang vector extensions: 8 floats, lowered to whatever SIMD the target has (AVX2 or
   AVX-512 halves, NEON pairs). The compiler leaves short dots and exp loops scalar otherwise. */
#define LANES 8
typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vfloat vload(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vfloat v) { memcpy(p, &v, sizeof v); }

static inline float vsum(vfloat v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}

/* a . b, `dim` a multiple of 2 * LANES. */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b, const int dim) {
    vfloat even = {0}, odd = {0};
    for (int d = 0; d < dim; d += 2 * LANES) {
        even += vload(a + d) * vload(b + d);
        odd += vload(a + d + LANES) * vload(b + d + LANES);
    }
    return vsum(even + odd);
}

/* Lanes of `a` where `mask` is set (all ones), of `b` elsewhere. */
static inline vfloat vselect(vint mask, vfloat a, vfloat b) { return (vfloat)(((vint)a & mask) | ((vint)b & ~mask)); }

/* e^x lane by lane for x <= 0 (scores minus the running maximum), to float precision: x =
   (n + f) ln 2 with n an integer and |f| <= 1/2, 2^n built in the exponent bits, e^(f ln 2) by its
   Taylor series to the 7th term (truncation error below 2e-7 relative). libm's expf would not
   vectorize. */
static inline vfloat vexp_nonpositive(vfloat x) {
    const vfloat floor = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    const vfloat t = vselect(x < floor, floor, x) * 1.4426950408889634f;
    const vint n = __builtin_convertvector(t - 0.5f, vint); /* t <= 0: truncation rounds to nearest */
    const vfloat y = (t - __builtin_convertvector(n, vfloat)) * 0.6931471805599453f;
    vfloat p = y * (1.0f / 5040.0f) + 1.0f / 720.0f;
    p = p * y + 1.0f / 120.0f;
    p = p * y + 1.0f / 24.0f;
    p = p * y + 1.0f / 6.0f;
    p = p * y + 0.5f;
    p = p * y + 1.0f;
    p = p * y + 1.0f;
    const vint bits = (n + 127) << 23;
    vfloat scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Attention of `m` query vectors (query rows x query heads) of one sequence over `heads` KV heads
   from `heads_offset`: vector r reads KV head head[r] of them and sees keys 0..last[r]. `dim` and `bf16` are constants where
   attend_tile is inlined, so the inner loops unroll. */
static inline __attribute__((always_inline)) void attend_tile(
    const float *const *q, float *const *out, const int *last, const int *head, int m, const void *cache,
    const int bf16, int64_t block_stride, int64_t v_offset, int64_t slot_stride, int64_t heads_offset, int heads,
    const int32_t *table, const int dim, int block_size, float scale) {
    float acc[MAX_TILE][MAX_DIM];
    float scores[MAX_TILE][MAX_BLOCK];
    float row_max[MAX_TILE], row_sum[MAX_TILE], block_max[MAX_TILE];
    float kbuf[MAX_TILE * MAX_DIM], vbuf[MAX_TILE * MAX_DIM];
    const int row_elems = heads * dim; /* the tile's KV heads of one slot: contiguous */
    int num_keys = 0;
    for (int r = 0; r < m; ++r) {
        row_max[r] = -FLT_MAX;
        row_sum[r] = 0.0f;
        memset(acc[r], 0, (size_t)dim * sizeof(float));
        if (last[r] + 1 > num_keys) num_keys = last[r] + 1;
    }
    for (int start = 0, b = 0; start < num_keys; start += block_size, ++b) {
        const int n = num_keys - start < block_size ? num_keys - start : block_size;
        const int64_t k_base = (int64_t)table[b] * block_stride + heads_offset;
        const int64_t v_base = k_base + v_offset;
        /* The next block's rows are asked for slot by slot as this block's are read (blocks lie
           anywhere: the hardware prefetcher cannot see the next one coming; asking for a whole
           block at once overflows the core's miss queue, and most of it is dropped). */
        const int elem = bf16 ? 2 : 4;
        const char *next_k = start + block_size < num_keys
                                 ? (const char *)cache + ((int64_t)table[b + 1] * block_stride + heads_offset) * elem
                                 : NULL;
        for (int r = 0; r < m; ++r) block_max[r] = -FLT_MAX;
        for (int j = 0; j < n; ++j) {
            if (next_k)
                for (int at = 0; at < row_elems * elem; at += 64) __builtin_prefetch(next_k + j * slot_stride * elem + at);
            const float *keys = row_at(cache, k_base + j * slot_stride, kbuf, row_elems, bf16);
            for (int r = 0; r < m; ++r) {
                if (start + j > last[r]) {
                    scores[r][j] = -FLT_MAX;
                    continue;
                }
                const float s = dot(q[r], keys + head[r] * dim, dim) * scale;
                scores[r][j] = s;
                if (s > block_max[r]) block_max[r] = s;
            }
        }
        for (int r = 0; r < m; ++r) {
            const float new_max = block_max[r] > row_max[r] ? block_max[r] : row_max[r];
            const float rescale = vexp_nonpositive((vfloat){0} + (row_max[r] - new_max))[0];
            const int visible = last[r] - start + 1; /* keys of this block row r sees */
            row_sum[r] *= rescale;
#pragma omp simd
            for (int d = 0; d < dim; ++d) acc[r][d] *= rescale;
            const int seen = visible < n ? visible : n;
            vfloat sum = {0};
            for (int j = 0; j < n; j += LANES) { /* lanes past `seen` (hidden keys, or past n) get 0 */
                const vint index = (vint){0, 1, 2, 3, 4, 5, 6, 7} + j;
                const vfloat p = vexp_nonpositive(vload(&scores[r][j]) - new_max);
                const vfloat kept = vselect(index < seen, p, (vfloat){0});
                vstore(&scores[r][j], kept);
                sum += kept;
            }
            row_sum[r] += vsum(sum);
            row_max[r] = new_max;
        }
        for (int j = 0; j < n; ++j) {
            if (next_k)
                for (int at = 0; at < row_elems * elem; at += 64)
                    __builtin_prefetch(next_k + (v_offset + j * slot_stride) * elem + at);
            const float *values = row_at(cache, v_base + j * slot_stride, vbuf, row_elems, bf16);
            for (int r = 0; r < m; ++r) {
                const float p = scores[r][j];
                const float *value = values + head[r] * dim;
                float *a = acc[r];
#pragma omp simd
                for (int d = 0; d < dim; ++d) a[d] += p * value[d];
            }
        }
    }
    for (int r = 0; r < m; ++r) {
        const float inv = 1.0f / row_sum[r];
        float *o = out[r];
#pragma omp simd
        for (int d = 0; d < dim; ++d) o[d] = acc[r][d] * inv;
    }
}

/* Limits the Python side checks before calling. */
int max_group(void) { return MAX_TILE; }
int max_dim(void) { return MAX_DIM; }
int max_block(void) { return MAX_BLOCK; }
int lanes(void) { return LANES; }

#define ATTEND(DIM, BF16)                                                                                   \
    attend_tile(qs, outs, last, head, m, cache, BF16, block_stride, v_offset, slot_stride, (int64_t)h0 * dim, \
                heads, table, DIM, block_size, scale)

/* q, out: [tokens, q_heads, dim] fp32, contiguous. cache: the layer's first element (block 0,
   K); blocks `block_stride` elements apart, V `v_offset` after K, slots `slot_stride` apart,
   KV heads `dim` apart. spans: [num_spans][4] = first row, rows, context length (keys seen by the
   last row), offset of the block table in `tables`. A work item is one span and a group of its
   KV heads (all of them when their query heads fit a tile), taken a tile of rows at a time: each
   slot's K and V rows of those heads are one contiguous read serving every query vector. */
void paged_attention(const float *q, float *out, const void *cache, int bf16, int64_t block_stride,
                     int64_t v_offset, int64_t slot_stride, const int32_t *tables, const int32_t *spans,
                     int num_spans, int q_heads, int kv_heads, int dim, int block_size, float scale,
                     int num_threads) {
    const int group = q_heads / kv_heads; /* <= MAX_TILE: the caller checks */
    const int tile_heads = MAX_TILE / group < kv_heads ? MAX_TILE / group : kv_heads;
    const int tile_rows = MAX_TILE / (group * tile_heads);
    const int head_groups = (kv_heads + tile_heads - 1) / tile_heads;
    const int64_t items = (int64_t)num_spans * head_groups;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t item = 0; item < items; ++item) {
        const int32_t *span = spans + (item / head_groups) * 4;
        const int h0 = (int)(item % head_groups) * tile_heads;
        const int heads = kv_heads - h0 < tile_heads ? kv_heads - h0 : tile_heads;
        const int row = span[0], rows = span[1], context = span[2];
        const int32_t *table = tables + span[3];
        for (int i0 = 0; i0 < rows; i0 += tile_rows) {
            const float *qs[MAX_TILE];
            float *outs[MAX_TILE];
            int last[MAX_TILE], head[MAX_TILE];
            int m = 0;
            for (int i = i0; i < rows && i < i0 + tile_rows; ++i) {
                for (int qh = h0 * group; qh < (h0 + heads) * group; ++qh, ++m) {
                    const int64_t at = ((int64_t)(row + i) * q_heads + qh) * dim;
                    qs[m] = q + at;
                    outs[m] = out + at;
                    last[m] = context - rows + i;
                    head[m] = qh / group - h0;
                }
            }
            if (dim == 64 && !bf16) ATTEND(64, 0);
            else if (dim == 64) ATTEND(64, 1);
            else if (dim == 128 && !bf16) ATTEND(128, 0);
            else if (dim == 128) ATTEND(128, 1);
            else if (!bf16) ATTEND(dim, 0);
            else ATTEND(dim, 1);
        }
    }
}
