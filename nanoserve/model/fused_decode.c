/* fused_decode.c: every decoder layer of a decode step (one query per sequence, a few sequences) in
 * one call, inside one OpenMP parallel region, for a plain Llama whose four matmuls per layer are in
 * blockdot's panels (blockdot.c).
 *
 * Why: at one sequence the linears of the default model take 8-10 ms a step when called back to back,
 * but 15 ms when each follows the Python glue between them (norms, rope, the cache write, attention:
 * ~25 small torch operations a layer); a call after a gap of ~100 us runs slower (notes/blockdot.md).
 * Here the glue is a few microseconds of C between the matmuls and the threads never leave.
 *
 * The arithmetic is llama.py's decoder_layer, with the activations in float32 throughout (the
 * matmuls read the blocks' codes and fp16 scales exactly, as blockdot does), and the K/V written to
 * and read from the paged cache in its own dtype (float32 or bf16, rounded to nearest even as torch
 * rounds). Softmax is the one-pass (online) form. Per layer, for rows r of T:
 *   x = rms_norm(h) * input_norm;  q, k, v = x @ qkv^T;  q, k rotated (rotate-half, cos/sin of r's
 *   position);  k, v written to the cache at slot_mapping[r];  a = softmax(scale q . K^T) V over the
 *   r's context (positions 0 .. position[r], through its block table);  h += a @ o^T;
 *   x = rms_norm(h) * post_norm;  g, u = x @ gate_up^T;  h += (silu(g) u) @ down^T.
 * fused_decode.py decides when this applies (no biases, no per-head norms, no window, no softcap).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "blockdot.h"

struct fused_layer {  /* one layer's weights and cache, as fused_decode.py lays them out */
  const float *input_norm, *post_norm;           /* [E] float32 */
  const uint8_t *qkv, *o, *gate_up, *down;       /* blockdot panels */
  int64_t qkv_planes, o_planes, gate_up_planes, down_planes;
  void *k_cache, *v_cache;                       /* [slots, Hkv, D] float32, or bf16 where kv_bf16 */
};

struct fused_shape {
  int64_t E, H, Hkv, D, I, block_size, kv_bf16;
  float eps, scale;
};

static void rms_norm(const float *x, const float *w, float *out, int64_t n, float eps) {
  float ss = 0;
  #pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
  const float inv = 1.0f / sqrtf(ss / n + eps);
  for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* rotate-half rope of one head x [D] in place, cos and sin [D] of its position */
static void rope(float *x, const float *cos, const float *sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i++) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

static inline float load_kv(const void *cache, int64_t at, int bf16) {
  return bf16 ? bf16_to_f32(((const uint16_t *)cache)[at]) : ((const float *)cache)[at];
}

static void store_kv(void *cache, int64_t at, const float *x, int64_t D, int bf16) {
  for (int64_t i = 0; i < D; i++) {
    if (bf16) ((uint16_t *)cache)[at + i] = f32_to_bf16(x[i]);
    else ((float *)cache)[at + i] = x[i];
  }
}

/* One row's query heads of kv head g: out[h] = softmax over its L keys of scale q_h . k_j, times V.
   One pass: the running maximum rescales what has been summed so far. */
static void attend(const struct fused_shape *s, const float *q, const void *k_cache, const void *v_cache,
                   const int64_t *table, int64_t L, int64_t g, float *out) {
  const int64_t D = s->D, group = s->H / s->Hkv, bs = s->block_size;
  float m[group], total[group], k[D], v[D];
  for (int64_t h = 0; h < group; h++) {
    m[h] = -INFINITY;
    total[h] = 0;
    for (int64_t i = 0; i < D; i++) out[h * D + i] = 0;
  }
  for (int64_t j = 0; j < L; j++) {
    const int64_t at = ((table[j / bs] * bs + j % bs) * s->Hkv + g) * D;
    for (int64_t i = 0; i < D; i++) k[i] = load_kv(k_cache, at + i, (int)s->kv_bf16);
    for (int64_t i = 0; i < D; i++) v[i] = load_kv(v_cache, at + i, (int)s->kv_bf16);
    for (int64_t h = 0; h < group; h++) {
      float score = 0;
      #pragma omp simd reduction(+ : score)
      for (int64_t i = 0; i < D; i++) score += q[h * D + i] * k[i];
      score *= s->scale;
      float *o = out + h * D;
      if (score > m[h]) {  /* a new maximum: what was summed against the old one shrinks */
        const float shrink = expf(m[h] - score);
        total[h] *= shrink;
        for (int64_t i = 0; i < D; i++) o[i] *= shrink;
        m[h] = score;
      }
      const float p = expf(score - m[h]);
      total[h] += p;
      for (int64_t i = 0; i < D; i++) o[i] += p * v[i];
    }
  }
  for (int64_t h = 0; h < group; h++)
    for (int64_t i = 0; i < D; i++) out[h * D + i] /= total[h];
}

/* A decode step's attention for one layer, inside a parallel region (an `omp for` over rows and kv
   heads): each row's q and k [T, (H + 2 Hkv) D] rotated in place, its new k and v written to the
   cache at its slot, then its query heads attended over its context into att [T, H D]. */
static void attention(const struct fused_shape *s, void *k_cache, void *v_cache, float *qkv, float *att, int64_t T,
                      const int64_t *positions, const int64_t *slot_mapping, const int64_t *tables, int64_t nb,
                      const float *cos, const float *sin) {
  const int64_t H = s->H, Hkv = s->Hkv, D = s->D, group = H / Hkv, NQKV = (H + 2 * Hkv) * D;
  #pragma omp for schedule(static)
  for (int64_t task = 0; task < T * Hkv; task++) {
    const int64_t r = task / Hkv, g = task % Hkv, pos = positions[r];
    float *row = qkv + r * NQKV, *q = row + g * group * D, *k = row + (H + g) * D, *v = row + (H + Hkv + g) * D;
    for (int64_t j = 0; j < group; j++) rope(q + j * D, cos + pos * D, sin + pos * D, D);
    rope(k, cos + pos * D, sin + pos * D, D);
    const int64_t at = (slot_mapping[r] * Hkv + g) * D;
    store_kv(k_cache, at, k, D, (int)s->kv_bf16);
    store_kv(v_cache, at, v, D, (int)s->kv_bf16);
    attend(s, q, k_cache, v_cache, tables + r * nb, pos + 1, g, att + r * H * D + g * group * D);
  }
}

/* h [T, E] float32, updated in place through every layer. positions, slot_mapping [T]; tables
   [T, nb] block ids; cos, sin [positions, D] float32. Returns 0, or -1 when out of memory. */
int fused_decode(const struct fused_shape *s, const struct fused_layer *layers, int64_t num_layers, float *h,
                 int64_t T, const int64_t *positions, const int64_t *slot_mapping, const int64_t *tables, int64_t nb,
                 const float *cos, const float *sin, int nthreads) {
  const int64_t E = s->E, H = s->H, Hkv = s->Hkv, D = s->D, I = s->I;
  const int64_t NQKV = (H + 2 * Hkv) * D, K_MAX = I > E ? (I > H * D ? I : H * D) : (E > H * D ? E : H * D);
  const int64_t sizes[] = {T * K_MAX, blockdot_scratch_floats(T, K_MAX), T * NQKV, T * H * D, T * E, T * 2 * I};
  int64_t total = 0;
  for (int i = 0; i < 6; i++) total += sizes[i];
  float *scratch = malloc(sizeof(float) * total);
  if (!scratch) return -1;
  float *x = scratch, *prep = x + sizes[0], *qkv = prep + sizes[1], *att = qkv + sizes[2], *out = att + sizes[3],
        *gu = out + sizes[4];
  struct xin in;  /* shared: written in `single`, read by every thread after its barrier */

  #pragma omp parallel num_threads(nthreads)
  for (int64_t l = 0; l < num_layers; l++) {
    const struct fused_layer *w = &layers[l];
    #pragma omp single
    {
      for (int64_t r = 0; r < T; r++) rms_norm(h + r * E, w->input_norm, x + r * E, E, s->eps);
      blockdot_prepare(x, T, E, (int)w->qkv_planes, prep, &in);
    }
    blockdot_tasks(&in, T, E, NQKV, w->qkv, (int)w->qkv_planes, qkv, 0);
    attention(s, w->k_cache, w->v_cache, qkv, att, T, positions, slot_mapping, tables, nb, cos, sin);
    #pragma omp single
    blockdot_prepare(att, T, H * D, (int)w->o_planes, prep, &in);
    blockdot_tasks(&in, T, H * D, E, w->o, (int)w->o_planes, out, 0);
    #pragma omp single
    {
      for (int64_t i = 0; i < T * E; i++) h[i] += out[i];
      for (int64_t r = 0; r < T; r++) rms_norm(h + r * E, w->post_norm, x + r * E, E, s->eps);
      blockdot_prepare(x, T, E, (int)w->gate_up_planes, prep, &in);
    }
    blockdot_tasks(&in, T, E, 2 * I, w->gate_up, (int)w->gate_up_planes, gu, 0);
    #pragma omp single
    {
      for (int64_t r = 0; r < T; r++)
        for (int64_t i = 0; i < I; i++) {
          const float gate = gu[r * 2 * I + i], up = gu[r * 2 * I + I + i];
          x[r * I + i] = gate / (1.0f + expf(-gate)) * up;
        }
      blockdot_prepare(x, T, I, (int)w->down_planes, prep, &in);
    }
    blockdot_tasks(&in, T, I, E, w->down, (int)w->down_planes, out, 0);
    #pragma omp single
    for (int64_t i = 0; i < T * E; i++) h[i] += out[i];
  }
  free(scratch);
  return 0;
}

/* The same step with the matmuls left to the caller (fused_decode.py's wide steps: torch's dense
   or quantized linears between these calls), activations in float32 or bf16 (io_bf16) as the
   linears give and take them. */

static void widen(const void *x, float *out, int64_t n, int bf16) {
  if (bf16) for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(((const uint16_t *)x)[i]);
  else memcpy(out, x, sizeof(float) * n);
}

static void narrow(const float *x, void *out, int64_t n, int bf16) {
  if (bf16) for (int64_t i = 0; i < n; i++) ((uint16_t *)out)[i] = f32_to_bf16(x[i]);
  else memcpy(out, x, sizeof(float) * n);
}

/* One layer's attention: qkv [T, (H + 2 Hkv) D] -> att [T, H D], the new K/V written to the cache.
   Returns 0, or -1 when out of memory. */
int fused_attention(const struct fused_shape *s, void *k_cache, void *v_cache, const void *qkv, void *att,
                    int io_bf16, int64_t T, const int64_t *positions, const int64_t *slot_mapping,
                    const int64_t *tables, int64_t nb, const float *cos, const float *sin, int nthreads) {
  const int64_t NQKV = (s->H + 2 * s->Hkv) * s->D, HD = s->H * s->D;
  float *scratch = malloc(sizeof(float) * T * (NQKV + HD));
  if (!scratch) return -1;
  widen(qkv, scratch, T * NQKV, io_bf16);
  #pragma omp parallel num_threads(nthreads)
  attention(s, k_cache, v_cache, scratch, scratch + T * NQKV, T, positions, slot_mapping, tables, nb, cos, sin);
  narrow(scratch + T * NQKV, att, T * HD, io_bf16);
  free(scratch);
  return 0;
}

/* h [T, E] float32 += add (float32 or bf16; NULL: nothing), then x = rms_norm(h) * w in float32
   or bf16 (w NULL: no norm, x untouched). */
void fused_add_norm(float *h, const void *add, const float *w, void *x, int io_bf16, int64_t T, int64_t E, float eps) {
  float normed[E];
  for (int64_t r = 0; r < T; r++) {
    float *row = h + r * E;
    if (add)
      for (int64_t i = 0; i < E; i++)
        row[i] += io_bf16 ? bf16_to_f32(((const uint16_t *)add)[r * E + i]) : ((const float *)add)[r * E + i];
    if (!w) continue;
    rms_norm(row, w, normed, E, eps);
    narrow(normed, io_bf16 ? (void *)((uint16_t *)x + r * E) : (void *)((float *)x + r * E), E, io_bf16);
  }
}

/* gu [T, 2 I] (gate, then up) -> out [T, I] = silu(gate) up, in float32 or bf16. */
void fused_silu_mul(const void *gu, void *out, int io_bf16, int64_t T, int64_t I) {
  for (int64_t r = 0; r < T; r++)
    for (int64_t i = 0; i < I; i++) {
      float gate, up;
      if (io_bf16) {
        gate = bf16_to_f32(((const uint16_t *)gu)[r * 2 * I + i]);
        up = bf16_to_f32(((const uint16_t *)gu)[r * 2 * I + I + i]);
      } else {
        gate = ((const float *)gu)[r * 2 * I + i];
        up = ((const float *)gu)[r * 2 * I + I + i];
      }
      const float y = gate / (1.0f + expf(-gate)) * up;
      if (io_bf16) ((uint16_t *)out)[r * I + i] = f32_to_bf16(y);
      else ((float *)out)[r * I + i] = y;
    }
}
