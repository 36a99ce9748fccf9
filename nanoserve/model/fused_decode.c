/* fused_decode.c: every decoder layer of a step in one call (fused_decode), inside one OpenMP parallel
 * region, for a Llama-family model whose four matmuls per layer are in blockdot's panels (blockdot.c)
 * or dense panels of float32 or bf16 (blockdot.c's dense_tasks): a decode step's rows (one query per
 * sequence), and on the batch-invariant plan every step, each prompt token a row like a decode's.
 * And the same glue in three calls a layer (fused_attention, fused_add_norm, fused_gate_mul) for
 * steps whose matmuls run outside it: the weights' own linears (decode steps wider than the one call
 * takes, forms C does not read), or a tensor-parallel rank's slices on blockdot's or dense panels, whose o
 * and down are summed over the ranks between the calls (the plan's c-per-layer and
 * c-tensor-parallel drivers, nanoserve/model/plan.py).
 *
 * Why: at one sequence the linears of the default model take 8-10 ms a step when called back to back,
 * but 15 ms when each follows the Python glue between them (norms, rope, the cache write, attention:
 * ~25 small torch operations a layer); a call after a gap of ~100 us runs slower (notes/blockdot.md).
 * Here the glue is a few microseconds of C between the matmuls and the threads never leave; the
 * work between matmuls is split over the team by rows (on one thread, the other waiting, it cost
 * ~3 ms a 16-row step on a Zen 5).
 *
 * The arithmetic is llama.py's decoder_layer, with the activations in float32 throughout (the
 * matmuls read the blocks' codes and scales, fp16 or float32 heads, exactly, as blockdot does,
 * rounding x to int16 per block where the shape's int16_rows says; dense panels are read as stored),
 * and the K/V written to and read from the paged cache in its own dtype (float32, bf16 or fp16,
 * rounded to nearest even as torch rounds; or llama.cpp's q8_0 / q4_0 blocks of 32 values, quantized
 * as ggml-quants.c's reference rounds: the bytes nanoserve/model/kv_quant.py writes, q, k and v
 * turned first by a Walsh-Hadamard matrix as llama.cpp turns them, the output back: turn). Each row's
 * context is cut into parts (parts_of) by its own length; each part's softmax is two-pass,
 * over a per-thread scratch of the scores, and the parts are merged in order. Per layer, for rows r of T:
 *   x = rms_norm(h) * input_norm;  q, k, v = x @ qkv^T (+ qkv_bias);  q, k heads normed (q_norm,
 *   k_norm) and rotated (rotate-half, cos/sin of r's position: the layer's own table where it has
 *   one);  k, v written to the cache at slot_mapping[r];  a = softmax(scale q . K^T) V over r's
 *   context (positions 0 .. position[r], the last W of them in a windowed layer, through its block
 *   table);  h += a @ o^T (normed first where the layer has attn_out_norm);
 *   x = rms_norm(h) * post_norm;  g, u = x @ gate_up^T;  h += (act(g) u) @ down^T (act SiLU or GELU's
 *   tanh form; the sum normed first where the layer has mlp_out_norm);
 * or, in a sparse layer (a mixture of experts, nanoserve/model/moe.py), h += moe_mlp(x): the router's
 * softmax and top k in float32, each expert some row chose multiplied once over its rows, each row's
 * k outputs summed in rank order by its routing weights (and a shared expert's, by its sigmoid gate).
 * The execution plan decides which steps run here; fused_decode.py's why_not, which families can
 * (no o bias, no softcap, rope on whole heads in every layer).
 */
#include <math.h>
#include <omp.h>
#if (defined(__F16C__) && defined(__AVX__)) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "blockdot.h"

struct fused_layer {  /* one layer's weights and cache, as fused_decode.py lays them out */
  const float *input_norm, *post_norm;           /* [E] float32 */
  const uint8_t *qkv, *o, *gate_up, *down;       /* blockdot panels or dense panels (NULL where torch's linears run) */
  int64_t qkv_planes, o_planes, gate_up_planes, down_planes;  /* panels: blockdot's planes; dense: DENSE_F32, DENSE_BF16 */
  void *k_cache, *v_cache;                       /* [slots, Hkv, D] in the shape's kv_kind */
  /* the family's switches, NULL or 0 where it has none */
  const float *qkv_bias;                         /* [(H + 2 Hkv) D] float32 (Qwen2) */
  const float *q_norm, *k_norm;                  /* [D] float32: RMSNorm of each q and k head before rope (Qwen3) */
  int64_t window;                                /* W: a query at position p sees keys p - W + 1 .. p (Mistral) */
  const struct fused_moe *moe;                   /* a sparse layer's MLP in place of gate_up and down; NULL: dense */
  const float *attn_out_norm, *mlp_out_norm;     /* [E] float32: RMSNorm of attention's and the MLP's outputs
                                                    before their residual adds (Gemma 2 and 3's sandwich norms) */
  const float *cos, *sin;                        /* [positions, rot] float32: this layer's own rope table (Gemma 3's
                                                    windowed layers); NULL: the step's */
};

/* A sparse layer's mixture of experts (nanoserve/model/moe.py), as fused_decode.py lays it out: each
   matrix in blockdot's panels or dense panels, its planes code as a fused_layer's. */
struct fused_moe {
  const uint8_t *router;                         /* [X, E] */
  const uint8_t *const *gate_up;                 /* X matrices [2 Ie, E]: each expert's gate, then up */
  const uint8_t *const *down;                    /* X matrices [E, Ie] */
  const int64_t *gate_up_planes, *down_planes;   /* [X] */
  const uint8_t *shared_gate_up, *shared_down;   /* [2 Is, E], [E, Is]: the expert every row runs (NULL: none) */
  const uint8_t *shared_gate;                    /* [1, E]: the shared expert scaled by sigmoid(this . x) */
  int64_t router_planes, shared_gate_up_planes, shared_down_planes, shared_gate_planes;
  int64_t X, k, Ie, Is;                          /* experts, a row's top k, an expert's width, the shared one's */
  int64_t norm_topk_prob;                        /* a row's k weights renormalised to sum to 1 */
};

struct fused_shape {
  int64_t E, H, Hkv, D, I, block_size;
  int64_t kv_kind;     /* the K/V cache's dtype: KV_F32, KV_BF16, KV_F16, KV_Q8_0 or KV_Q4_0 */
  int64_t int16_rows;  /* from this many rows the matmuls take blockdot's int16 path (0: never) */
  int64_t amx_rows;    /* from this many rows file-bit panels multiply on AMX tiles (0: never) */
  int64_t activation;  /* the MLP gate's: ACT_SILU or ACT_GELU_TANH */
  int64_t rot;         /* rope's dimensions of each head, the first rot of D (Phi-3's partial rotary), even */
  float eps, scale;
};

/* The layout of every struct Python mirrors with ctypes (nanoserve/model/cabi.py) as this compiler
   laid it out: cabi.py compares each struct's size and each field's offset and size with its
   mirror's when it loads the library, and refuses a library that disagrees. An entry with no field
   gives the struct's size. */
struct layout_entry {
  const char *type, *field;
  int64_t offset, size;
};
#define LAYOUT_STRUCT(S) {#S, NULL, 0, sizeof(struct S)}
#define LAYOUT_FIELD(S, F) {#S, #F, offsetof(struct S, F), sizeof(((struct S *)0)->F)}
static const struct layout_entry layout[] = {
  LAYOUT_STRUCT(layout_entry), LAYOUT_FIELD(layout_entry, type), LAYOUT_FIELD(layout_entry, field),
  LAYOUT_FIELD(layout_entry, offset), LAYOUT_FIELD(layout_entry, size),
  LAYOUT_STRUCT(fused_shape), LAYOUT_FIELD(fused_shape, E), LAYOUT_FIELD(fused_shape, H),
  LAYOUT_FIELD(fused_shape, Hkv), LAYOUT_FIELD(fused_shape, D), LAYOUT_FIELD(fused_shape, I),
  LAYOUT_FIELD(fused_shape, block_size), LAYOUT_FIELD(fused_shape, kv_kind), LAYOUT_FIELD(fused_shape, int16_rows),
  LAYOUT_FIELD(fused_shape, amx_rows), LAYOUT_FIELD(fused_shape, activation), LAYOUT_FIELD(fused_shape, rot),
  LAYOUT_FIELD(fused_shape, eps), LAYOUT_FIELD(fused_shape, scale),
  LAYOUT_STRUCT(fused_layer), LAYOUT_FIELD(fused_layer, input_norm), LAYOUT_FIELD(fused_layer, post_norm),
  LAYOUT_FIELD(fused_layer, qkv), LAYOUT_FIELD(fused_layer, o), LAYOUT_FIELD(fused_layer, gate_up),
  LAYOUT_FIELD(fused_layer, down), LAYOUT_FIELD(fused_layer, qkv_planes), LAYOUT_FIELD(fused_layer, o_planes),
  LAYOUT_FIELD(fused_layer, gate_up_planes), LAYOUT_FIELD(fused_layer, down_planes),
  LAYOUT_FIELD(fused_layer, k_cache), LAYOUT_FIELD(fused_layer, v_cache), LAYOUT_FIELD(fused_layer, qkv_bias),
  LAYOUT_FIELD(fused_layer, q_norm), LAYOUT_FIELD(fused_layer, k_norm), LAYOUT_FIELD(fused_layer, window),
  LAYOUT_FIELD(fused_layer, moe), LAYOUT_FIELD(fused_layer, attn_out_norm), LAYOUT_FIELD(fused_layer, mlp_out_norm),
  LAYOUT_FIELD(fused_layer, cos), LAYOUT_FIELD(fused_layer, sin),
  LAYOUT_STRUCT(fused_moe), LAYOUT_FIELD(fused_moe, router), LAYOUT_FIELD(fused_moe, gate_up),
  LAYOUT_FIELD(fused_moe, down), LAYOUT_FIELD(fused_moe, gate_up_planes), LAYOUT_FIELD(fused_moe, down_planes),
  LAYOUT_FIELD(fused_moe, shared_gate_up), LAYOUT_FIELD(fused_moe, shared_down), LAYOUT_FIELD(fused_moe, shared_gate),
  LAYOUT_FIELD(fused_moe, router_planes), LAYOUT_FIELD(fused_moe, shared_gate_up_planes),
  LAYOUT_FIELD(fused_moe, shared_down_planes), LAYOUT_FIELD(fused_moe, shared_gate_planes), LAYOUT_FIELD(fused_moe, X),
  LAYOUT_FIELD(fused_moe, k), LAYOUT_FIELD(fused_moe, Ie), LAYOUT_FIELD(fused_moe, Is),
  LAYOUT_FIELD(fused_moe, norm_topk_prob),
};
#undef LAYOUT_STRUCT
#undef LAYOUT_FIELD

/* The table above and (in *count) its entries. */
const struct layout_entry *fused_layout(int64_t *count) {
  *count = (int64_t)(sizeof layout / sizeof layout[0]);
  return layout;
}

static void rms_norm(const float *x, const float *w, float *out, int64_t n, float eps) {
  float ss = 0;
  #pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
  const float inv = 1.0f / sqrtf(ss / n + eps);
  for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* rotate-half rope of the first D values of a head x in place (the whole head, or Phi-3's partial
   rotary's first dimensions; the rest are left as they are), cos and sin [D] of its position */
static void rope(float *x, const float *cos, const float *sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i++) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

#define KV_F32 0
#define KV_BF16 1
#define KV_F16 2 /* IEEE binary16 in uint16_t: converted with F16C's instructions where the build has them,
                    in software elsewhere (blockdot.h); to nearest even, as torch rounds */
#if defined(__F16C__) && defined(__AVX__)
#define F16C 1
static inline float kv_f16(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t kv_to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
#define F16C 0
static inline float kv_f16(uint16_t h) { return f16_to_f32(h); }
static inline uint16_t kv_to_f16(float f) { return f32_to_f16(f); }
#endif

#define KV_Q8_0 3 /* llama.cpp's block_q8_0 and block_q4_0, a block for each 32 values of a head: a cache */
#define KV_Q4_0 4 /* row of Hkv D values is Hkv D / 32 blocks of 34 or 18 bytes (nanoserve/model/kv_quant.py) */
#define QK 32

/* the bytes n values take in a cache of `kind` (n a multiple of QK in a block kind) */
static inline int64_t kv_bytes(int64_t n, const int kind) {
  if (kind == KV_Q8_0) return n / QK * 34;
  if (kind == KV_Q4_0) return n / QK * 18;
  return n * (kind == KV_F32 ? 4 : 2);
}

static inline void put_f16(uint8_t *at, uint16_t h) { at[0] = (uint8_t)h, at[1] = (uint8_t)(h >> 8); }
static inline float get_f16(const uint8_t *at) { return kv_f16((uint16_t)(at[0] | at[1] << 8)); }

/* x id + 8.5 with x id rounded to float first, as the reference's two operations: a fused
   multiply-add, which gcc's default -ffp-contract=fast would make of them, rounds once */
static inline float shifted(float x, float id) {
  volatile float product = x * id;
  return product + 8.5f;
}

/* D values quantized into D / QK blocks at `out`, as quantize_row_q8_0_ref / quantize_row_q4_0_ref
   round them: in float32, x times the float32 1 / d (not the fp16 d stored), q8_0's codes roundf'ed
   (half away from zero), q4_0's truncated from x / d + 8.5 and capped at 15, d to fp16 last. */
static void store_blocks(uint8_t *out, const float *x, int64_t D, int kind) {
  for (int64_t b = 0; b < D / QK; b++, x += QK) {
    float amax = 0, max = 0;  /* the largest |x|, and (q4_0) the signed value of the first that holds it */
    for (int i = 0; i < QK; i++)
      if (amax < fabsf(x[i])) amax = fabsf(x[i]), max = x[i];
    const float d = kind == KV_Q8_0 ? amax / 127 : max / -8, id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(out, kv_to_f16(d));
    if (kind == KV_Q8_0) {
      for (int i = 0; i < QK; i++) ((int8_t *)out)[2 + i] = (int8_t)roundf(x[i] * id);
      out += 34;
    } else {
      for (int i = 0; i < QK / 2; i++) {
        const int lo = (int)shifted(x[i], id), hi = (int)shifted(x[i + QK / 2], id);
        out[2 + i] = (uint8_t)((lo < 15 ? lo : 15) | (hi < 15 ? hi : 15) << 4);
      }
      out += 18;
    }
  }
}

/* D values of x written at value offset `at` of the cache (a multiple of D: one head's place) */
static void store_kv(void *cache, int64_t at, const float *x, int64_t D, int kind) {
  if (kind == KV_Q8_0 || kind == KV_Q4_0) {
    store_blocks((uint8_t *)cache + kv_bytes(at, kind), x, D, kind);
    return;
  }
  for (int64_t i = 0; i < D; i++) {
    if (kind == KV_BF16) ((uint16_t *)cache)[at + i] = f32_to_bf16(x[i]);
    else if (kind == KV_F16) ((uint16_t *)cache)[at + i] = kv_to_f16(x[i]);
    else ((float *)cache)[at + i] = x[i];
  }
}

/* The Walsh-Hadamard runs a quantized cache turns a head of D values by, as nanoserve/model/kv_quant.py's
   rotations (llama.cpp's attn_rot_k / attn_rot_v): q and k by the largest power of two dividing D, v
   and the attention's output back by 64; 0 (not turned) for a float cache or a D not a multiple of 64 */
static inline int64_t turn_qk(int64_t D, int kind) {
  return (kind == KV_Q8_0 || kind == KV_Q4_0) && D % 64 == 0 ? D & -D : 0;
}
static inline int64_t turn_v(int64_t D, int kind) { return turn_qk(D, kind) ? 64 : 0; }

/* x [D] in place: each run of n values times Sylvester's H_n / sqrt(n), a fast Walsh-Hadamard
   transform (H_n is its own inverse); n 0: untouched */
static void turn(float *x, int64_t D, int64_t n) {
  if (!n) return;
  const float scale = 1.0f / sqrtf((float)n);
  for (float *y = x; y < x + D; y += n) {
    for (int64_t h = 1; h < n; h *= 2)
      for (int64_t i = 0; i < n; i += 2 * h)
        for (int64_t j = i; j < i + h; j++) {
          const float a = y[j], b = y[j + h];
          y[j] = a + b, y[j + h] = a - b;
        }
    for (int64_t i = 0; i < n; i++) y[i] *= scale;
  }
}

#define INLINE static inline __attribute__((always_inline))

/* e^x within about 1 ulp (1.02 measured over every float of -87..88 against double exp), as Cephes' expf
   computes it: 2^n p(r), r = x - n ln 2 in two parts, p of degree 7; x clamped to -87..88. Unlike
   libm's expf, a call per element, it vectorizes inside an `omp simd` loop (blockdot.py builds with
   -fno-trapping-math, without which gcc kept the clamps as branches): the softmax's and the gate's
   exponentials, ~2 M a 32-row step of SmolLM, took ~5 ms of it on a Zen 3 as calls. */
static inline float exp_fast(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* nearest integer, as in blockdot */
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
  return p * two_n.f;
}

/* The MLP's gate, act(gate) up. GELU's tanh form is gate sigmoid(2 y), y = sqrt(2 / pi) (gate + 0.044715 gate^3),
   since (1 + tanh y) / 2 = sigmoid(2 y): both it and SiLU are gate / (1 + e^(a gate (1 + c gate^2))) up, SiLU with
   a = -1, c = 0 (exactly silu's gate / (1 + e^-gate)), GELU with a = -2 sqrt(2 / pi), c = 0.044715 (gate_of). */
#define ACT_SILU 0
#define ACT_GELU_TANH 1
struct gate { float a, c; };
static struct gate gate_of(int64_t activation) {
  return activation == ACT_GELU_TANH ? (struct gate){-1.5957691216057308f, 0.044715f} : (struct gate){-1.0f, 0.0f};
}
static inline float gated(float gate, float up, struct gate g) {
  return gate / (1.0f + exp_fast(g.a * gate * (1.0f + g.c * gate * gate))) * up;
}

/* A layer's matmul y = x @ w^T on blockdot's panels (`planes` > 0: 1 or 2 with blockdot.c's F32_HEADS,
   G16 and G16M flags; blockdot_prepare_rows for each row of x, then blockdot_tasks), or on dense
   panels of a float32 or bf16 [N, K] (dense_tasks). */
#define DENSE_F32 (-1)
#define DENSE_BF16 (-2)
static void prepare_row(const struct xin *in, int64_t K, int64_t planes, int64_t r) {
  if (planes > 0) blockdot_prepare_rows(in, K, r, r + 1);
}
static void matmul(const struct xin *in, const float *x, int64_t T, int64_t K, int64_t N, const uint8_t *w,
                   int64_t planes, float *y) {
  if (planes > 0) blockdot_tasks(in, T, K, N, w, (int)planes, y, 0);
  else dense_tasks(x, T, K, N, w, planes == DENSE_BF16, y);
}

/* element i of a cache in its kind: `kind` is a constant wherever this is inlined, so each loop below
   is compiled once per cache dtype */
INLINE float kv(const void *cache, int64_t i, const int kind) {
  if (kind == KV_BF16) return bf16_to_f32(((const uint16_t *)cache)[i]);
  if (kind == KV_F16) return kv_f16(((const uint16_t *)cache)[i]);
  return ((const float *)cache)[i];
}

#if defined(__AVX2__) && defined(__FMA__)
#define SCORES8 1
/* scores[0..7] = scale q . k_j for 8 float32 keys k_j = k + j stride, D a multiple of 8: each key's
   products summed in eight lanes, then the eight keys' lanes added pairwise across registers
   (hadd, then the two halves), every key by the same instructions */
static inline void scores8(const float *q, const float *k, int64_t stride, int64_t D, float scale, float *scores) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 x = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + stride + i), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * stride + i), a2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * stride + i), a3);
    a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * stride + i), a4);
    a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * stride + i), a5);
    a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * stride + i), a6);
    a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * stride + i), a7);
  }
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  /* keys 0-3, each half's */
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));  /* keys 4-7 */
  const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
  _mm256_storeu_ps(scores, _mm256_mul_ps(_mm256_set1_ps(scale), sum));
}
#else
#define SCORES8 0
#endif

/* scores[j] = scale q . k_j for n keys at cache offsets at + j stride: eight float32 keys at a time
   where the build has AVX2 and FMA, else (and for the rest) four at a time, so four independent sums
   are in flight rather than one chain of D / lanes dependent additions */
INLINE void scores_run(const float *q, const void *cache, int64_t at, int64_t stride, int64_t n, int64_t D,
                       float scale, float *scores, const int kind) {
  int64_t j = 0;
#if SCORES8
  if (kind == KV_F32 && D % 8 == 0)
    for (; j + 8 <= n; j += 8) scores8(q, (const float *)cache + at + j * stride, stride, D, scale, scores + j);
#endif
  for (; j + 4 <= n; j += 4) {
    const int64_t k = at + j * stride;
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    #pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < D; i++) {
      s0 += q[i] * kv(cache, k + i, kind);
      s1 += q[i] * kv(cache, k + stride + i, kind);
      s2 += q[i] * kv(cache, k + 2 * stride + i, kind);
      s3 += q[i] * kv(cache, k + 3 * stride + i, kind);
    }
    scores[j] = scale * s0, scores[j + 1] = scale * s1, scores[j + 2] = scale * s2, scores[j + 3] = scale * s3;
  }
  for (; j < n; j++) {
    float sum = 0;
    #pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < D; i++) sum += q[i] * kv(cache, at + j * stride + i, kind);
    scores[j] = scale * sum;
  }
}

#if SCORES8
/* out [D] += sum_j p[j] v_j over n float32 values v_j = v + j stride, D a multiple of 64: 64 of out
   held in eight registers while every value adds its share, one multiply-add each, in key order */
static inline void values64(float *out, const float *p, const float *v, int64_t stride, int64_t n, int64_t D) {
  for (int64_t i = 0; i < D; i += 64) {
    __m256 o[8];
    for (int c = 0; c < 8; c++) o[c] = _mm256_loadu_ps(out + i + 8 * c);
    for (int64_t j = 0; j < n; j++) {
      const __m256 weight = _mm256_set1_ps(p[j]);
      for (int c = 0; c < 8; c++) o[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + j * stride + i + 8 * c), o[c]);
    }
    for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + i + 8 * c, o[c]);
  }
}
#endif

#if defined(__AVX512F__)
#define GROUP16 1
/* within each 128 bits, [a0 + a1, a2 + a3, b0 + b1, b2 + b3] (AVX's hadd, which AVX-512 lacks) */
static inline __m512 hadd16(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* The sums of the 16 lanes of each of a[0..15] in one register, element 4 key + h the sum of
   a[4 h + key]: halves of 256, then of 128 bits folded across pairs of registers (permutex2var),
   then twice pairs within 128-bit lanes (hadd16); every sum by the same instructions whichever slot
   it is in */
static inline __m512 sum16(const __m512 *a) {
  const __m512i lo256 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i hi256 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i even128 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i odd128 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  __m512 t[8], u[4];
  for (int i = 0; i < 8; i++)
    t[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], lo256, a[2 * i + 1]),
                         _mm512_permutex2var_ps(a[2 * i], hi256, a[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    u[i] = _mm512_add_ps(_mm512_permutex2var_ps(t[2 * i], even128, t[2 * i + 1]),
                         _mm512_permutex2var_ps(t[2 * i], odd128, t[2 * i + 1]));
  const __m512 v0 = hadd16(u[0], u[1]), v1 = hadd16(u[2], u[3]);
  return hadd16(v0, v1);
}

/* 16 values of a float32, float16, q8_0 or q4_0 (kind) run from element i (in a block kind, i a multiple
   of 16: half a block), widened as they are loaded: a block's values as widen_q8_0 and widen_q4_0 make
   them, d times the code (less 8) by the same instructions, so the same bits */
INLINE __m512 load16(const void *p, int64_t i, const int kind) {
  if (kind == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
  if (kind == KV_Q8_0 || kind == KV_Q4_0) {
    const uint8_t *block = (const uint8_t *)p + kv_bytes(i & -QK, kind);
    const __m512 d = _mm512_set1_ps(get_f16(block));
    if (kind == KV_Q8_0)
      return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                  _mm_loadu_si128((const __m128i *)(block + 2 + i % QK)))));
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 2));  /* value v's code in byte v % 16 */
    const __m128i codes = _mm_and_si128(i % QK ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(15));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(codes), _mm512_set1_epi32(8))));
  }
  return _mm512_loadu_ps((const float *)p + i);
}

/* scores[h n + j] = scale q_h . k_j for nh <= 4 query heads q_h = q + h D (one kv head's group, or
   part of it) and n keys k_j at offset at + j stride of k, float32 or float16 (kind), D a multiple of
   16: four keys at a time, each 16 values of a key read once for every head, the 16 dot products of 4
   heads by 4 keys folded together (sum16); the keys of n % 4 as scores_run does them in float32 */
INLINE void scores_heads(const float *q, int nh, const void *k, int64_t at, int64_t stride, int64_t n, int64_t D,
                         float scale, float *scores, int64_t sstride, const int kind) {
  const __m512i head_major = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
    const int64_t key = at + j * stride;
    for (int64_t i = 0; i < D; i += 16) {
      const __m512 k0 = load16(k, key + i, kind), k1 = load16(k, key + stride + i, kind);
      const __m512 k2 = load16(k, key + 2 * stride + i, kind), k3 = load16(k, key + 3 * stride + i, kind);
      for (int h = 0; h < 4; h++) {
        if (h >= nh) break;
        const __m512 x = _mm512_loadu_ps(q + h * D + i);
        a[4 * h] = _mm512_fmadd_ps(x, k0, a[4 * h]);
        a[4 * h + 1] = _mm512_fmadd_ps(x, k1, a[4 * h + 1]);
        a[4 * h + 2] = _mm512_fmadd_ps(x, k2, a[4 * h + 2]);
        a[4 * h + 3] = _mm512_fmadd_ps(x, k3, a[4 * h + 3]);
      }
    }
    const __m512 sums = _mm512_mul_ps(vscale, _mm512_permutexvar_ps(head_major, sum16(a)));
    float out[16];
    _mm512_storeu_ps(out, sums);
    for (int h = 0; h < nh; h++) memcpy(scores + h * sstride + j, out + 4 * h, 4 * sizeof(float));
  }
  if (j == n) return;
  if (kind == KV_F32) {
    for (int h = 0; h < nh; h++)
      scores_run(q + h * D, k, at + j * stride, stride, n - j, D, scale, scores + h * sstride + j, KV_F32);
    return;
  }
  float rest[3 * D];  /* the last keys widened, so that they are summed as float32's are */
  for (int64_t key = 0; key < n - j; key++)
    for (int64_t i = 0; i < D; i += 16) _mm512_storeu_ps(rest + key * D + i, load16(k, at + (j + key) * stride + i, kind));
  for (int h = 0; h < nh; h++) scores_run(q + h * D, rest, 0, D, n - j, D, scale, scores + h * sstride + j, KV_F32);
}

/* out_h [D] += sum_j p_h[j] v_j for nh <= 4 heads (out_h = out + h D, p_h = p + h pstride) over n
   values v_j at offset at + j stride of v, float32 or float16 (kind), D a multiple of 64: each 64
   values of v_j read once for every head, 64 of each head's out held in registers, one multiply-add
   an element and value, in key order (the same sums as values64's) */
INLINE void values_heads(float *out, int nh, const float *p, int64_t pstride, const void *v, int64_t at,
                         int64_t stride, int64_t n, int64_t D, const int kind) {
  for (int64_t i = 0; i < D; i += 64) {
    __m512 o[4][4];
    for (int h = 0; h < nh; h++)
      for (int c = 0; c < 4; c++) o[h][c] = _mm512_loadu_ps(out + h * D + i + 16 * c);
    for (int64_t j = 0; j < n; j++) {
      __m512 x[4];
      for (int c = 0; c < 4; c++) x[c] = load16(v, at + j * stride + i + 16 * c, kind);
      for (int h = 0; h < 4; h++) {
        if (h >= nh) break;
        const __m512 weight = _mm512_set1_ps(p[h * pstride + j]);
        for (int c = 0; c < 4; c++) o[h][c] = _mm512_fmadd_ps(weight, x[c], o[h][c]);
      }
    }
    for (int h = 0; h < nh; h++)
      for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + h * D + i + 16 * c, o[h][c]);
  }
}
#else
#define GROUP16 0
#endif

/* out += sum_j p[j] v_j over n values at cache offsets at + j stride: float32 values with AVX2 and FMA
   and D a multiple of 64 in values64, else four at a time */
INLINE void values_run(float *out, const float *p, const void *cache, int64_t at, int64_t stride, int64_t n,
                       int64_t D, const int kind) {
#if SCORES8
  if (kind == KV_F32 && D % 64 == 0) {
    values64(out, p, (const float *)cache + at, stride, n, D);
    return;
  }
#endif
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const int64_t v = at + j * stride;
    #pragma omp simd
    for (int64_t i = 0; i < D; i++)
      out[i] += p[j] * kv(cache, v + i, kind) + p[j + 1] * kv(cache, v + stride + i, kind)
                + p[j + 2] * kv(cache, v + 2 * stride + i, kind) + p[j + 3] * kv(cache, v + 3 * stride + i, kind);
  }
  for (; j < n; j++) {
    #pragma omp simd
    for (int64_t i = 0; i < D; i++) out[i] += p[j] * kv(cache, at + j * stride + i, kind);
  }
}

/* A row's query heads h0 .. h1 - 1 of q [H, D], over keys first .. L - 1 (through the block table), one
   part of its context (parts_of): out [H, D] = sum_j e^(s_j - m) v_j per head (each head's the same loops
   whichever others are done with it), unnormalized, s_j = scale q . k_j, head h
   reading kv head h / (H / Hkv), and part [H, 2] each head's m (the part's largest score; -inf for no
   keys) and sum_j e^(s_j - m), for `merge` to combine the parts; the scores kept in `scores`
   [H, L - first] between the two passes. The keys are walked a run of one block at a time (a block's
   slots are consecutive, one cache row Hkv D apart), every head meeting a run while it is in L1: one
   contiguous read of each block's K and V; the blocks ahead are fetched up to `end`, the row's whole
   context (a part's own end stopped it short: parts of two blocks read every block cold). */
/* Keys k0 .. k1 - 1 (those before L) of the block `PREFETCH_BLOCKS` after the one holding key j, on
   their way to L2: of each key's cache row the `width` values from `from` (the heads a loop is about
   to read; the row's other heads are other tasks' and would be fetched for nothing). A context's
   blocks lie anywhere in the pool, so the hardware's prefetcher, which follows a run of addresses,
   meets each block cold. The block ahead is asked for a little at a time, between the loads of the
   run at hand: a kv head's share before that head's loops read the run in place, a key's row before
   it is widened. Asked for at once at the start of a run (a float16 block of Llama-3.2-1B's 8 kv
   heads of 64 is 256 lines), the prefetches filled the line-fill buffers and stalled the thread until
   most of them had arrived, the memory then idle through the run's arithmetic: spread, the attention
   of one row at 16384 keys of a float16 cache took 17% less time (notes/depth.md). */
#define PREFETCH_BLOCKS 2
INLINE void prefetch_ahead(const void *cache, const int64_t *table, int64_t j, int64_t k0, int64_t k1, int64_t L,
                           int64_t bs, int64_t row, int64_t from, int64_t width, const int kind) {
  const int64_t b = j / bs + PREFETCH_BLOCKS, keys = L - b * bs < bs ? L - b * bs : bs;
  if (k1 > keys) k1 = keys;
  if (k0 >= k1) return;
  const char *at = (const char *)cache + kv_bytes((table[b] * bs + k0) * row + from, kind);
  for (int64_t key = k0; key < k1; key++, at += kv_bytes(row, kind))
    for (int64_t byte = 0; byte < kv_bytes(width, kind); byte += 64) __builtin_prefetch(at + byte, 0, 2);
}

/* n float16 values widened to float32: eight an instruction where the build has F16C (read in place,
   one value at a time, a float16 cache's attention ran 1.3-1.4x slower than float32's), one at a
   time elsewhere */
static void widen_f16(const uint16_t *x, float *out, int64_t n) {
  int64_t i = 0;
#if F16C
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
#endif
  for (; i < n; i++) out[i] = kv_f16(x[i]);
}

/* n values of q8_0 or q4_0 blocks (n a multiple of QK) widened to float32, d q and (q - 8) d exact:
   a block's 32 codes in two sixteens an instruction with AVX-512, in eights with AVX2, one at a time elsewhere */
static void widen_q8_0(const uint8_t *x, float *out, int64_t n) {
  for (int64_t b = 0; b < n / QK; b++, x += 34, out += QK) {
    const float d = get_f16(x);
    const int8_t *q = (const int8_t *)(x + 2);
#if defined(__AVX512F__)
    const __m512 vd = _mm512_set1_ps(d);
    for (int i = 0; i < QK; i += 16)
      _mm512_storeu_ps(out + i, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                   _mm_loadu_si128((const __m128i *)(q + i))))));
#elif defined(__AVX2__)
    const __m256 vd = _mm256_set1_ps(d);
    for (int i = 0; i < QK; i += 8)
      _mm256_storeu_ps(out + i, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                   _mm_loadl_epi64((const __m128i *)(q + i))))));
#else
    for (int i = 0; i < QK; i++) out[i] = d * q[i];
#endif
  }
}

static void widen_q4_0(const uint8_t *x, float *out, int64_t n) {
  for (int64_t b = 0; b < n / QK; b++, x += 18, out += QK) {
    const float d = get_f16(x);
    const uint8_t *q = x + 2;  /* byte i: value i's code in its low nibble, value i + 16's in its high */
#if defined(__AVX512F__) || defined(__AVX2__)
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
#endif
#if defined(__AVX512F__)
    const __m512 vd = _mm512_set1_ps(d);
    const __m512i eight = _mm512_set1_epi32(8);
    _mm512_storeu_ps(out, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(lo), eight))));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(hi), eight))));
#elif defined(__AVX2__)
    const __m256 vd = _mm256_set1_ps(d);
    const __m256i eight = _mm256_set1_epi32(8);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++)
      _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_sub_epi32(
                                                       _mm256_cvtepu8_epi32(parts[i]), eight))));
#else
    for (int i = 0; i < QK / 2; i++) out[i] = d * ((q[i] & 15) - 8), out[i + QK / 2] = d * ((q[i] >> 4) - 8);
#endif
  }
}

/* Whether the loops read a cache of `kind` from a float32 scratch a run at a time, its keys copied or
   widened there first: every kind but bf16's, where the four-head loops do not read it in place
   (attend). The heads' loops then read one contiguous run from L1 where in place they read a head's
   few lines of each key, a pattern the hardware's prefetchers do not follow (a 4-layer model in
   Llama-3.2-1B's attention shape at 4096 keys, float32 and float16 caches read in place: attention 1.2-1.3x the time of a float16 cache widened first); and float16
   read one value at a time ran 1.3-1.4x slower than float32. */
#define WIDENED(kind) ((kind) != KV_BF16)

/* n values of a cache of a widened kind from value offset `at`, widened to float32 */
static void widen_kv(const void *cache, int64_t at, float *out, int64_t n, int kind) {
  if (kind == KV_F32) memcpy(out, (const float *)cache + at, n * sizeof(float));
  else if (kind == KV_F16) widen_f16((const uint16_t *)cache + at, out, n);
  else if (kind == KV_Q8_0) widen_q8_0((const uint8_t *)cache + kv_bytes(at, KV_Q8_0), out, n);
  else widen_q4_0((const uint8_t *)cache + kv_bytes(at, KV_Q4_0), out, n);
}

/* The keys of a run of one block that start at j, up to L; a widened kind's at most RUN_WIDE keys,
   widened key by key into a float32 scratch on the stack before its heads read it. */
#define RUN_WIDE 16
INLINE int64_t run_at(int64_t j, int64_t L, int64_t bs, const int widened) {
  const int64_t run = bs - j % bs < L - j ? bs - j % bs : L - j;
  return widened && run > RUN_WIDE ? RUN_WIDE : run;
}

/* The `run` keys from j of kv heads g0 .. g0 + ng - 1: where the loops read them, from cache offset
   *at with keys *stride values apart, or, in a widened kind, widened into `wide` [run, ng D] (offset 0,
   stride ng D) a key at a time, the same key of the block ahead prefetched before each: only the
   heads the task reads. Read in place, the loops prefetch the block ahead themselves, a kv head at a time. */
INLINE const void *run_rows(const void *cache, const int64_t *table, int64_t j, int64_t run, int64_t end, int64_t bs,
                            int64_t row, int64_t g0, int64_t ng, int64_t D, float *wide, int64_t *at, int64_t *stride,
                            const int kind, const int widened) {
  *at = (table[j / bs] * bs + j % bs) * row + g0 * D, *stride = row;
  if (!widened) return cache;
  for (int64_t key = 0; key < run; key++) {
    prefetch_ahead(cache, table, j, j % bs + key, j % bs + key + 1, end, bs, row, g0 * D, ng * D, kind);
    widen_kv(cache, *at + key * row, wide + key * ng * D, ng * D, kind);
  }
  *at = 0, *stride = ng * D;
  return wide;
}

/* For loops that read a run in place: the block ahead's share of head h's kv head, asked for as
   the loops reach the first of the task's heads that read it */
INLINE void prefetch_head(const void *cache, const int64_t *table, int64_t j, int64_t end, int64_t bs, int64_t row,
                          int64_t h, int64_t h0, int64_t group, int64_t D, const int kind) {
  if (h == h0 || h % group == 0) prefetch_ahead(cache, table, j, 0, bs, end, bs, row, h / group * D, D, kind);
}

/* heads from h (of h .. h1 - 1) that share its kv head, four at most */
static inline int64_t heads4(int64_t h, int64_t h1, int64_t group) {
  const int64_t end = (h / group + 1) * group < h1 ? (h / group + 1) * group : h1;
  return end - h < 4 ? end - h : 4;
}

INLINE void attend_as(const struct fused_shape *s, const float *q, const void *k_cache, const void *v_cache,
                      const int64_t *table, int64_t first, int64_t L, int64_t end, int64_t h0, int64_t h1,
                      float *scores, float *out, float *part, const int kind, const int direct) {
  const int64_t D = s->D, bs = s->block_size, row = s->Hkv * D, n = L - first, H = s->H, group = H / s->Hkv;
  const int64_t g0 = h0 / group, ng = (h1 - 1) / group + 1 - g0;  /* the kv heads heads h0 .. h1 - 1 read */
  /* what the loops read: a widened run as float32, or float16, q8_0 or q4_0 in place where `direct` (the four-head
     loops, which widen 16 values as they load them) */
  const int widened = WIDENED(kind) && !direct, read = widened ? KV_F32 : kind;
  float wide[widened ? RUN_WIDE * row : 1];
  for (int64_t j = first, run, at, stride; j < L; j += run) {
    run = run_at(j, L, bs, widened);
    const void *keys = run_rows(k_cache, table, j, run, end, bs, row, g0, ng, D, wide, &at, &stride, kind, widened);
#if GROUP16
    if (read != KV_BF16 && D % 64 == 0) {  /* a kv head's key read once for four of its heads */
      for (int64_t h = h0; h < h1; h += heads4(h, h1, group)) {
        if (!widened) prefetch_head(k_cache, table, j, end, bs, row, h, h0, group, D, kind);
        scores_heads(q + h * D, (int)heads4(h, h1, group), keys, at + (h / group - g0) * D, stride, run, D, s->scale,
                     scores + h * n + j - first, n, read);
      }
      continue;
    }
#endif
    for (int64_t h = h0; h < h1; h++) {
      if (!widened) prefetch_head(k_cache, table, j, end, bs, row, h, h0, group, D, kind);
      scores_run(q + h * D, keys, at + (h / group - g0) * D, stride, run, D, s->scale, scores + h * n + j - first,
                 read);
    }
  }
  for (int64_t h = h0; h < h1; h++) {
    float *p = scores + h * n, max = -INFINITY, total = 0;
    #pragma omp simd reduction(max : max)
    for (int64_t j = 0; j < n; j++) max = p[j] > max ? p[j] : max;
    #pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; j++) {
      p[j] = exp_fast(p[j] - max);
      total += p[j];
    }
    part[2 * h] = max, part[2 * h + 1] = total;
  }
  for (int64_t i = h0 * D; i < h1 * D; i++) out[i] = 0;
  for (int64_t j = first, run, at, stride; j < L; j += run) {
    run = run_at(j, L, bs, widened);
    const void *values = run_rows(v_cache, table, j, run, end, bs, row, g0, ng, D, wide, &at, &stride, kind, widened);
#if GROUP16
    if (read != KV_BF16 && D % 64 == 0) {  /* a kv head's value read once for four of its heads */
      for (int64_t h = h0; h < h1; h += heads4(h, h1, group)) {
        if (!widened) prefetch_head(v_cache, table, j, end, bs, row, h, h0, group, D, kind);
        values_heads(out + h * D, (int)heads4(h, h1, group), scores + h * n + j - first, n, values,
                     at + (h / group - g0) * D, stride, run, D, read);
      }
      continue;
    }
#endif
    for (int64_t h = h0; h < h1; h++) {
      if (!widened) prefetch_head(v_cache, table, j, end, bs, row, h, h0, group, D, kind);
      values_run(out + h * D, scores + h * n + j - first, values, at + (h / group - g0) * D, stride, run, D, read);
    }
  }
}

/* A float16, q8_0 or q4_0 cache (kind): read in place by the four-head loops (AVX-512, D a multiple of
   64), else widened a run at a time; in place, a q8_0 cache's attention at 8192 keys took about a
   tenth less time */
INLINE void attend_widenable(const struct fused_shape *s, const float *q, const void *k_cache, const void *v_cache,
                             const int64_t *table, int64_t first, int64_t L, int64_t end, int64_t h0, int64_t h1,
                             float *scores, float *out, float *part, const int kind) {
  if (GROUP16 && s->D % 64 == 0)
    attend_as(s, q, k_cache, v_cache, table, first, L, end, h0, h1, scores, out, part, kind, 1);
  else
    attend_as(s, q, k_cache, v_cache, table, first, L, end, h0, h1, scores, out, part, kind, 0);
}

/* One compiled copy of each (noinline): a row's attention is the same instructions whichever loop
   below calls it, so its bits cannot depend on the step around it. */
__attribute__((noinline)) static void attend(const struct fused_shape *s, const float *q, const void *k_cache,
                                             const void *v_cache, const int64_t *table, int64_t first, int64_t L,
                                             int64_t end, int64_t h0, int64_t h1, float *scores, float *out,
                                             float *part) {
  switch (s->kv_kind) {
    case KV_BF16: attend_as(s, q, k_cache, v_cache, table, first, L, end, h0, h1, scores, out, part, KV_BF16, 0); break;
    case KV_F16:
      attend_widenable(s, q, k_cache, v_cache, table, first, L, end, h0, h1, scores, out, part, KV_F16);
      break;
    case KV_Q8_0:
      attend_widenable(s, q, k_cache, v_cache, table, first, L, end, h0, h1, scores, out, part, KV_Q8_0);
      break;
    case KV_Q4_0:
      attend_widenable(s, q, k_cache, v_cache, table, first, L, end, h0, h1, scores, out, part, KV_Q4_0);
      break;
    default: attend_as(s, q, k_cache, v_cache, table, first, L, end, h0, h1, scores, out, part, KV_F32, 0);
  }
}

/* out [D] = softmax attention of one head over a context in S parts, from each part's unnormalized
   out (o [S] at a stride of `stride` floats) and its m and sum (part [S] at a stride of `pstride`):
   sum_s e^(m_s - m) o_s / sum_s e^(m_s - m) sum_s, m the largest m_s; a part with no keys weighs 0. */
__attribute__((noinline)) static void merge(float *out, const float *o, int64_t stride, const float *part,
                                            int64_t pstride, int64_t S, int64_t D) {
  float m = -INFINITY, total = 0;
  for (int64_t t = 0; t < S; t++) m = part[t * pstride] > m ? part[t * pstride] : m;
  for (int64_t i = 0; i < D; i++) out[i] = 0;
  for (int64_t t = 0; t < S; t++) {
    if (part[t * pstride] == -INFINITY) continue;
    const float weight = exp_fast(part[t * pstride] - m);
    total += weight * part[t * pstride + 1];
    #pragma omp simd
    for (int64_t i = 0; i < D; i++) out[i] += weight * o[t * stride + i];
  }
  #pragma omp simd
  for (int64_t i = 0; i < D; i++) out[i] /= total;
}

/* How a row's n visible keys (first .. L - 1) are cut into parts_of(n) parts, as even as they go, part
   t from first + n t / S to first + n (t + 1) / S, each part's softmax taken alone and the parts
   merged in order (flash-decoding's split): where the cuts fall depends on the row's own context and
   nothing else, so a row's result is the same bits in a step of one row or of hundreds, as a decode
   or as a prompt's token, and whichever thread runs it. (Split by the step's width, as before, a
   row's sums changed with the rows beside it.) Parts also give one row's attention to every thread
   (a one-row step's tasks are its parts times its kv heads); each costs a merge, so they are not
   smaller than they need be.
   A context is cut into PARTS parts of at least PART keys (fewer parts where it is shorter), a long
   one into parts of at most PART_MAX. Against the split by threads, on a 2-core Zen 4-class EPYC:
   parts of 32 keys cut from the start (a last part of a few keys) cost 1-2.5% of a decode step at
   16-32 rows of 64-token contexts; parts of 128 from the start ran a one-row decode of a few hundred
   keys 1.07x slower (three parts over two threads); parts of at most 64, even, measured within 2% at
   1, 16 and 32 rows. At depth the parts grow: one row of 8192 keys in parts of 64 read a float16
   cache at about half the machine's bandwidth, each thread's run of blocks broken every 64 keys by
   the other's (notes/depth.md); parts of 256-512 took 19-23% off the attention at 4096-16384 keys. */
#define PART 64
#define PART_MAX 512
#define PARTS 16
static inline int64_t parts_of(int64_t n) {
  const int64_t even = (n + PARTS - 1) / PARTS, keys = even < PART ? PART : even > PART_MAX ? PART_MAX : even;
  return (n + keys - 1) / keys;
}
/* parts_of(m) <= parts_bound(n) for every m <= n: what a step's scratch is laid out for */
static inline int64_t parts_bound(int64_t n) {
  return n <= PART * PARTS ? (n + PART - 1) / PART : n <= PART_MAX * PARTS ? PARTS : (n + PART_MAX - 1) / PART_MAX;
}
/* keys first + n t / S .. first + n (t + 1) / S of a row's n from `first`, S = parts_of(n) */
static inline void part_bounds(int64_t first, int64_t n, int64_t t, int64_t *lo, int64_t *hi) {
  const int64_t S = parts_of(n);
  *lo = first + n * t / S, *hi = first + n * (t + 1) / S;
}

/* A row's first visible key in layer w, its context keys 0 .. L - 1: the last W of them in a windowed layer */
static inline int64_t first_visible(const struct fused_layer *w, int64_t L) {
  return w->window && L > w->window ? L - w->window : 0;
}

/* Floats of scratch `attention` needs for T rows, the longest context max_len, on nthreads threads:
   each thread's scores [H PART_MAX] and one row's parts [parts, H, D + 2]; and, where the step has fewer
   than four rows a thread, every row's parts [T, parts, H, D + 2]. */
static int64_t attention_scratch(const struct fused_shape *s, int64_t T, int64_t max_len, int64_t nthreads) {
  const int64_t part = s->H * (s->D + 2), parts = parts_bound(max_len);
  return nthreads * (s->H * PART_MAX + parts * part) + (T < 4 * nthreads ? T * parts * part : 0);
}

/* A step's attention for one layer w, inside a parallel region: each row's q, k, v
   [T, (H + 2 Hkv) D] biased, its q and k heads normed and rotated in place (over a quantized cache q,
   k and v then turned, and the output turned back: turn), its new k and v written
   to the cache at its slot (an `omp for` over rows and kv heads; its barrier puts every key of the
   step in the cache before any is read, so a prompt's token reads the tokens before it as a decode
   does), then each row's query heads attended over its context (the last W keys of it in a windowed
   layer) into att [T, H D], part by part (parts_of). With at least four rows a thread, an `omp for` over
   rows, each row's parts in turn; with fewer, one over every row's parts and kv heads (a one-row
   step of 80 keys is six such tasks for two threads, not two parts), then one over rows and
   heads to merge them: the same calls on the same keys either way. scratch: attention_scratch's
   floats, max_len the step's longest context. */
static void attention(const struct fused_shape *s, const struct fused_layer *w, float *qkv, float *att, int64_t T,
                      const int64_t *positions, const int64_t *slot_mapping, const int64_t *tables, int64_t nb,
                      const float *cos, const float *sin, float *scratch, int64_t max_len) {
  const int64_t H = s->H, Hkv = s->Hkv, D = s->D, R = s->rot, group = H / Hkv, NQKV = (H + 2 * Hkv) * D;
  if (w->cos) cos = w->cos, sin = w->sin;  /* the layer's own table */
  #pragma omp for schedule(static)
  for (int64_t task = 0; task < T * Hkv; task++) {
    const int64_t r = task / Hkv, g = task % Hkv, pos = positions[r];
    float *row = qkv + r * NQKV, *q = row + g * group * D, *k = row + (H + g) * D, *v = row + (H + Hkv + g) * D;
    if (w->qkv_bias) {
      const float *bias = w->qkv_bias;
      for (int64_t i = 0; i < group * D; i++) q[i] += bias[g * group * D + i];
      for (int64_t i = 0; i < D; i++) k[i] += bias[(H + g) * D + i], v[i] += bias[(H + Hkv + g) * D + i];
    }
    for (int64_t j = 0; j < group; j++) {
      if (w->q_norm) rms_norm(q + j * D, w->q_norm, q + j * D, D, s->eps);
      rope(q + j * D, cos + pos * R, sin + pos * R, R);
    }
    if (w->k_norm) rms_norm(k, w->k_norm, k, D, s->eps);
    rope(k, cos + pos * R, sin + pos * R, R);
    for (int64_t j = 0; j < group; j++) turn(q + j * D, D, turn_qk(D, (int)s->kv_kind));
    turn(k, D, turn_qk(D, (int)s->kv_kind)), turn(v, D, turn_v(D, (int)s->kv_kind));
    const int64_t at = (slot_mapping[r] * Hkv + g) * D;
    store_kv(w->k_cache, at, k, D, (int)s->kv_kind);
    store_kv(w->v_cache, at, v, D, (int)s->kv_kind);
  }
  const int64_t S = omp_get_num_threads(), thread = omp_get_thread_num();
  const int64_t part = H * (D + 2), maxparts = parts_bound(max_len);
  float *mine = scratch + thread * (H * PART_MAX + maxparts * part), *own = mine + H * PART_MAX;
  float *parts = scratch + S * (H * PART_MAX + maxparts * part);  /* [T, maxparts, H, D + 2] */
  if (T >= 4 * S) {
    #pragma omp for schedule(static, 1)  /* a prompt's rows grow longer down the step: dealt round */
    for (int64_t r = 0; r < T; r++) {
      const int64_t L = positions[r] + 1, first = first_visible(w, L);
      const int64_t n = parts_of(L - first);
      for (int64_t t = 0; t < n; t++) {
        int64_t lo, hi;
        part_bounds(first, L - first, t, &lo, &hi);
        attend(s, qkv + r * NQKV, w->k_cache, w->v_cache, tables + r * nb, lo, hi, L, 0, H, mine, own + t * part,
               own + t * part + H * D);
      }
      for (int64_t h = 0; h < H; h++) {
        merge(att + (r * H + h) * D, own + h * D, part, own + H * D + 2 * h, part, n, D);
        turn(att + (r * H + h) * D, D, turn_v(D, (int)s->kv_kind));
      }
    }
    return;
  }
  /* a task: one part of one row, the query heads of one kv head; or, in a row of at least two parts a
     thread, all of them (its blocks read whole, one contiguous run a block; a kv head's share of a
     block is a few lines a key apart, which the hardware's prefetcher does not follow): a head's
     loops are the same whichever others share its task */
  #pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < T * maxparts * Hkv; task++) {
    const int64_t r = task / (maxparts * Hkv), t = task / Hkv % maxparts, g = task % Hkv;
    const int64_t L = positions[r] + 1, first = first_visible(w, L), n = parts_of(L - first);
    const int whole = n >= 2 * S;
    if (t >= n || (whole && g > 0)) continue;
    int64_t lo, hi;
    part_bounds(first, L - first, t, &lo, &hi);
    float *mine_part = parts + (r * maxparts + t) * part;
    attend(s, qkv + r * NQKV, w->k_cache, w->v_cache, tables + r * nb, lo, hi, L, whole ? 0 : g * group,
           whole ? H : (g + 1) * group, mine, mine_part, mine_part + H * D);
  }
  #pragma omp for schedule(static)
  for (int64_t task = 0; task < T * H; task++) {
    const int64_t r = task / H, h = task % H;
    const int64_t L = positions[r] + 1, first = first_visible(w, L);
    const float *row = parts + r * maxparts * part;
    merge(att + task * D, row + h * D, part, row + H * D + 2 * h, part, parts_of(L - first), D);
    turn(att + task * D, D, turn_v(D, (int)s->kv_kind));
  }
}

/* the longest context of the step: its last position + 1 */
static int64_t longest(const int64_t *positions, int64_t T) {
  int64_t max = 0;
  for (int64_t r = 0; r < T; r++) max = positions[r] + 1 > max ? positions[r] + 1 : max;
  return max;
}

/* A sparse layer's MLP (moe_mlp) for a step of T rows: its scratch, laid out over `moe_floats` floats. */
struct moe_work {
  float *probs;     /* [T, X]: the router's logits, then each row's softmax over them */
  float *weights;   /* [T, k]: each row's routing weights, best first */
  float *xg;        /* [T k, E]: x's rows gathered by expert, expert j's at order's start[j] */
  float *prep;      /* blockdot's preparation of xg's rows, then act's, then the shared expert's act */
  float *gu;        /* [T k, 2 Ie] */
  float *act;       /* [T k, Ie] */
  float *eo;        /* [T k, E]: each (row, rank)'s expert output, in order's order */
  float *shared;    /* [T, 2 Is] gate and up, [T, Is] act, [T, E] out, [T] gate (a shared expert's) */
  int64_t *chosen;  /* [T k]: each row's k experts, best first */
  int64_t *order;   /* [T k]: the slots t k + r grouped by expert, rows ascending within each */
  int64_t *at;      /* [T k]: where slot t k + r is in order */
  int64_t *start;   /* [X + 1]: expert j's slots are order[start[j] .. start[j + 1] - 1] */
};

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Floats of scratch moe_mlp needs for T rows of a layer of hidden size E (its int64 arrays two floats each). */
static int64_t moe_floats(const struct fused_moe *m, int64_t T, int64_t E) {
  const int64_t Tk = T * m->k;
  const int64_t prep = max3(blockdot_scratch_floats(Tk, E), blockdot_scratch_floats(Tk, m->Ie),
                            m->shared_gate_up ? blockdot_scratch_floats(T, m->Is) : 0);
  return T * m->X + Tk + Tk * E + prep + Tk * 3 * m->Ie + Tk * E + (m->shared_gate_up ? T * (3 * m->Is + E + 1) : 0)
         + 2 * (3 * Tk + m->X + 1) + 1;  /* and one to align the int64 arrays to 8 bytes */
}

static struct moe_work moe_work(const struct fused_moe *m, int64_t T, int64_t E, float *scratch) {
  const int64_t Tk = T * m->k;
  const int64_t prep = max3(blockdot_scratch_floats(Tk, E), blockdot_scratch_floats(Tk, m->Ie),
                            m->shared_gate_up ? blockdot_scratch_floats(T, m->Is) : 0);
  struct moe_work w;
  w.probs = scratch, w.weights = w.probs + T * m->X, w.xg = w.weights + Tk, w.prep = w.xg + Tk * E;
  w.gu = w.prep + prep, w.act = w.gu + Tk * 2 * m->Ie, w.eo = w.act + Tk * m->Ie, w.shared = w.eo + Tk * E;
  const uintptr_t ints = (uintptr_t)(w.shared + (m->shared_gate_up ? T * (3 * m->Is + E + 1) : 0));
  w.chosen = (int64_t *)((ints + 7) & ~(uintptr_t)7);
  w.order = w.chosen + Tk, w.at = w.order + Tk, w.start = w.at + Tk;
  return w;
}

/* Expert j's rows of `rows` [T k, K] as blockdot reads them: its share of the preparation scratch
   (blockdot_scratch_floats is linear in the rows, so the experts' shares lie side by side). */
static void expert_inputs(const float *rows, const int64_t *start, int64_t j, int64_t K, int q16_rows, int64_t amx_rows,
                          float *prep, struct xin *in) {
  const int64_t first = start[j], count = start[j + 1] - first;
  blockdot_inputs(rows + first * K, count, K, q16_rows > 0 && count >= q16_rows, prep + blockdot_scratch_floats(first, K),
                  in);
  in->amx_rows = amx_rows;
}

/* Each chosen expert j's rows of `rows` [T k, K] (gathered by expert, prepared) times its matrix
   weights[j] [N, K] into out [T k, N], inside a parallel region. On file-bit panels the experts'
   matmuls are one pass over the team (blockdot_group: each thread a run of consecutive panels across
   the experts, one barrier); otherwise one matmul an expert, each split over the team. */
static void experts_matmul(const uint8_t *const *weights, const int64_t *planes, const float *rows, const int64_t *start,
                           int64_t X, int64_t K, int64_t N, int q16_rows, int64_t amx_rows, float *prep, float *out) {
  enum { MOST = 256 };  /* experts in one pass; a layer with more runs them one matmul each */
  struct xin ins[MOST];
  const uint8_t *ws[MOST];
  int64_t Ms[MOST];
  int ps[MOST];
  float *ys[MOST];
  if (X <= MOST) {
    int n = 0;
    for (int64_t j = 0; j < X; j++) {
      const int64_t first = start[j], count = start[j + 1] - first;
      if (!count) continue;
      expert_inputs(rows, start, j, K, q16_rows, amx_rows, prep, &ins[n]);
      ws[n] = weights[j], Ms[n] = count, ps[n] = (int)planes[j], ys[n] = out + first * N;
      n++;
    }
    if (blockdot_group(ins, Ms, K, N, ws, ps, ys, n)) return;
  }
  for (int64_t j = 0; j < X; j++) {  /* every thread the same experts, each matmul split over the team */
    const int64_t first = start[j], count = start[j + 1] - first;
    if (!count) continue;
    struct xin in;
    expert_inputs(rows, start, j, K, q16_rows, amx_rows, prep, &in);
    matmul(&in, rows + first * K, count, K, N, weights[j], planes[j], out + first * N);
  }
}

/* One sparse layer's MLP inside a parallel region: x [T, E] float32 (prepared for blockdot in in_x)
   -> out [T, E] float32, moe.py's arithmetic. Routing in float32: the router's logits, a softmax over
   the X experts, each row's top k (the largest first, a tie to the lower index), renormalised to sum
   to 1 where norm_topk_prob. The experts' matmuls grouped by expert: each expert some row chose reads
   its weights once for all its rows, gathered from x, and its outputs land at those rows' slots; then
   each row sums its k slots in rank order by its own weights (and adds its shared expert's output
   times sigmoid(shared_gate . x)), so a row's result depends on its own x alone whichever rows share
   its experts. q16_rows: a matmul rounds x to int16 from this many rows (0: never), each expert's by
   its own row count, as its linear would; amx_rows as blockdot's. */
static void moe_mlp(const struct fused_moe *m, const float *x, const struct xin *in_x, int64_t T, int64_t E,
                    int q16_rows, int64_t amx_rows, struct moe_work w, float *out) {
  const int64_t X = m->X, k = m->k, Ie = m->Ie, Tk = T * k;
  matmul(in_x, x, T, E, X, m->router, m->router_planes, w.probs);
  #pragma omp for schedule(static)
  for (int64_t r = 0; r < T; r++) {
    float *p = w.probs + r * X, max = p[0], sum = 0;
    for (int64_t j = 1; j < X; j++) max = p[j] > max ? p[j] : max;
    for (int64_t j = 0; j < X; j++) p[j] = expf(p[j] - max), sum += p[j];
    for (int64_t j = 0; j < X; j++) p[j] /= sum;
    int64_t *chosen = w.chosen + r * k;
    float *weights = w.weights + r * k, total = 0;
    for (int64_t i = 0; i < k; i++) {  /* the best not yet chosen: k passes over X */
      int64_t best = -1;
      for (int64_t j = 0; j < X; j++) {
        int taken = 0;
        for (int64_t c = 0; c < i; c++) taken |= chosen[c] == j;
        if (!taken && (best < 0 || p[j] > p[best])) best = j;
      }
      chosen[i] = best, weights[i] = p[best], total += p[best];
    }
    if (m->norm_topk_prob)
      for (int64_t i = 0; i < k; i++) weights[i] /= total;
  }
  #pragma omp single
  {  /* a counting sort of the slots by expert, rows ascending within each; start[j] serves as expert
        j's cursor, left at start[j + 1], then moved back */
    for (int64_t j = 0; j <= X; j++) w.start[j] = 0;
    for (int64_t slot = 0; slot < Tk; slot++) w.start[w.chosen[slot] + 1]++;
    for (int64_t j = 0; j < X; j++) w.start[j + 1] += w.start[j];
    for (int64_t slot = 0; slot < Tk; slot++) w.order[w.start[w.chosen[slot]]++] = slot;
    for (int64_t j = X; j > 0; j--) w.start[j] = w.start[j - 1];
    w.start[0] = 0;
    for (int64_t p = 0; p < Tk; p++) w.at[w.order[p]] = p;
  }
  #pragma omp for schedule(static)
  for (int64_t p = 0; p < Tk; p++) {
    memcpy(w.xg + p * E, x + w.order[p] / k * E, sizeof(float) * E);
    struct xin in;
    const int64_t j = w.chosen[w.order[p]];
    expert_inputs(w.xg, w.start, j, E, q16_rows, amx_rows, w.prep, &in);
    prepare_row(&in, E, m->gate_up_planes[j], p - w.start[j]);
  }
  experts_matmul(m->gate_up, m->gate_up_planes, w.xg, w.start, X, E, 2 * Ie, q16_rows, amx_rows, w.prep, w.gu);
  #pragma omp for schedule(static)
  for (int64_t p = 0; p < Tk; p++) {
    #pragma omp simd
    for (int64_t i = 0; i < Ie; i++) {
      const float gate = w.gu[p * 2 * Ie + i], up = w.gu[p * 2 * Ie + Ie + i];
      w.act[p * Ie + i] = gate / (1.0f + exp_fast(-gate)) * up;
    }
    struct xin in;
    const int64_t j = w.chosen[w.order[p]];
    expert_inputs(w.act, w.start, j, Ie, q16_rows, amx_rows, w.prep, &in);
    prepare_row(&in, Ie, m->down_planes[j], p - w.start[j]);
  }
  experts_matmul(m->down, m->down_planes, w.act, w.start, X, Ie, E, q16_rows, amx_rows, w.prep, w.eo);
  float *gate = NULL, *shared = NULL;
  if (m->shared_gate_up) {  /* every row's shared expert, as a dense layer's MLP of width Is */
    const int64_t Is = m->Is;
    float *sgu = w.shared, *sact = sgu + T * 2 * Is;
    shared = sact + T * Is, gate = shared + T * E;
    matmul(in_x, x, T, E, 2 * Is, m->shared_gate_up, m->shared_gate_up_planes, sgu);
    matmul(in_x, x, T, E, 1, m->shared_gate, m->shared_gate_planes, gate);
    struct xin in;
    blockdot_inputs(sact, T, Is, q16_rows > 0 && T >= q16_rows, w.prep, &in);
    in.amx_rows = amx_rows;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < T; r++) {
      #pragma omp simd
      for (int64_t i = 0; i < Is; i++) {
        const float g = sgu[r * 2 * Is + i], up = sgu[r * 2 * Is + Is + i];
        sact[r * Is + i] = g / (1.0f + exp_fast(-g)) * up;
      }
      prepare_row(&in, Is, m->shared_down_planes, r);
    }
    matmul(&in, sact, T, Is, E, m->shared_down, m->shared_down_planes, shared);
  }
  #pragma omp for schedule(static)
  for (int64_t r = 0; r < T; r++) {  /* a row's k outputs in rank order, by its own weights */
    float *o = out + r * E;
    const float *first = w.eo + w.at[r * k] * E, w0 = w.weights[r * k];
    for (int64_t i = 0; i < E; i++) o[i] = first[i] * w0;
    for (int64_t c = 1; c < k; c++) {
      const float *e = w.eo + w.at[r * k + c] * E, wc = w.weights[r * k + c];
      for (int64_t i = 0; i < E; i++) o[i] += e[i] * wc;
    }
    if (shared) {
      const float g = 1.0f / (1.0f + expf(-gate[r]));
      for (int64_t i = 0; i < E; i++) o[i] += g * shared[r * E + i];
    }
  }
}

/* h [T, E] float32, updated in place through every layer. positions, slot_mapping [T]; tables
   [T, nb] block ids; cos, sin [positions, rot] float32 (rope.rope_table). Returns 0, or -1 when out of memory (the
   thread's scratch, blockdot_scratch). */
int fused_decode(const struct fused_shape *s, const struct fused_layer *layers, int64_t num_layers, float *h,
                 int64_t T, const int64_t *positions, const int64_t *slot_mapping, const int64_t *tables, int64_t nb,
                 const float *cos, const float *sin, int nthreads) {
  const int64_t E = s->E, H = s->H, Hkv = s->Hkv, D = s->D, I = s->I;
  const int64_t NQKV = (H + 2 * Hkv) * D, K_MAX = I > E ? (I > H * D ? I : H * D) : (E > H * D ? E : H * D);
  const int64_t max_len = longest(positions, T);
  int64_t moe_max = 0;  /* the widest sparse layer's scratch */
  for (int64_t l = 0; l < num_layers; l++)
    if (layers[l].moe && moe_floats(layers[l].moe, T, E) > moe_max) moe_max = moe_floats(layers[l].moe, T, E);
  const int64_t sizes[] = {T * K_MAX, blockdot_scratch_floats(T, K_MAX), T * NQKV, T * H * D, T * E, T * 2 * I,
                           attention_scratch(s, T, max_len, nthreads), moe_max};
  int64_t total = 0;
  for (int i = 0; i < 8; i++) total += sizes[i];
  float *scratch = blockdot_scratch(sizeof(float) * total);
  if (!scratch) return -1;
  float *x = scratch, *prep = x + sizes[0], *qkv = prep + sizes[1], *att = qkv + sizes[2], *out = att + sizes[3],
        *gu = out + sizes[4], *scores = gu + sizes[5], *moe_scratch = scores + sizes[6];
  const int q16 = s->int16_rows > 0 && T >= s->int16_rows;
  const int64_t amx_rows = s->amx_rows > 0 && blockdot_amx() ? s->amx_rows : 0;  /* asked before the team starts */
  const struct gate act = gate_of(s->activation);

  /* Between the matmuls every row's work (norms, residual adds, the gate, blockdot's preparation of
     x) is split over the team by rows: at 16 rows the gate's 24,576 expf a layer alone took ~3 ms a
     step on one thread while the other waited (Zen 5). */
  #pragma omp parallel num_threads(nthreads)
  {
    struct xin in_e, in_att, in_i;  /* each thread's own copies of the same pointers (blockdot_inputs) */
    blockdot_inputs(x, T, E, q16, prep, &in_e);
    blockdot_inputs(att, T, H * D, q16, prep, &in_att);
    blockdot_inputs(x, T, I, q16, prep, &in_i);
    in_e.amx_rows = in_att.amx_rows = in_i.amx_rows = amx_rows;
    for (int64_t l = 0; l < num_layers; l++) {
      const struct fused_layer *w = &layers[l];
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < T; r++) {
        rms_norm(h + r * E, w->input_norm, x + r * E, E, s->eps);
        prepare_row(&in_e, E, w->qkv_planes, r);
      }
      matmul(&in_e, x, T, E, NQKV, w->qkv, w->qkv_planes, qkv);
      attention(s, w, qkv, att, T, positions, slot_mapping, tables, nb, cos, sin, scores, max_len);
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < T; r++) prepare_row(&in_att, H * D, w->o_planes, r);
      matmul(&in_att, att, T, H * D, E, w->o, w->o_planes, out);
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < T; r++) {
        if (w->attn_out_norm) rms_norm(out + r * E, w->attn_out_norm, out + r * E, E, s->eps);
        for (int64_t i = r * E; i < (r + 1) * E; i++) h[i] += out[i];
        rms_norm(h + r * E, w->post_norm, x + r * E, E, s->eps);
        prepare_row(&in_e, E, w->moe ? 1 : w->gate_up_planes, r);  /* a sparse layer: for any of its matrices */
      }
      if (w->moe) {
        moe_mlp(w->moe, x, &in_e, T, E, (int)s->int16_rows, amx_rows, moe_work(w->moe, T, E, moe_scratch), out);
      } else {
        matmul(&in_e, x, T, E, 2 * I, w->gate_up, w->gate_up_planes, gu);
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < T; r++) {
          #pragma omp simd
          for (int64_t i = 0; i < I; i++) x[r * I + i] = gated(gu[r * 2 * I + i], gu[r * 2 * I + I + i], act);
          prepare_row(&in_i, I, w->down_planes, r);
        }
        matmul(&in_i, x, T, I, E, w->down, w->down_planes, out);
      }
      if (w->mlp_out_norm) {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < T; r++) rms_norm(out + r * E, w->mlp_out_norm, out + r * E, E, s->eps);
      }
      #pragma omp for schedule(static)
      for (int64_t i = 0; i < T * E; i++) h[i] += out[i];
    }
  }
  return 0;
}

/* The same step with the matmuls left to the caller (fused_decode.py's three calls a layer: torch's
   dense or quantized linears between these calls, or a tensor-parallel rank's panels and the sum of
   its o and down over the ranks), activations in float32 or bf16 (io_bf16) as the linears give and
   take them. */

static void widen(const void *x, float *out, int64_t n, int bf16) {
  if (bf16) for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(((const uint16_t *)x)[i]);
  else memcpy(out, x, sizeof(float) * n);
}

static void narrow(const float *x, void *out, int64_t n, int bf16) {
  if (bf16) for (int64_t i = 0; i < n; i++) ((uint16_t *)out)[i] = f32_to_bf16(x[i]);
  else memcpy(out, x, sizeof(float) * n);
}

/* One layer's attention: qkv [T, (H + 2 Hkv) D] -> att [T, H D], the new K/V written to the cache
   of layer w (its panels unused). Returns 0, or -1 when out of memory. */
int fused_attention(const struct fused_shape *s, const struct fused_layer *w, const void *qkv, void *att, int io_bf16,
                    int64_t T, const int64_t *positions, const int64_t *slot_mapping, const int64_t *tables, int64_t nb,
                    const float *cos, const float *sin, int nthreads) {
  const int64_t NQKV = (s->H + 2 * s->Hkv) * s->D, HD = s->H * s->D;
  const int64_t max_len = longest(positions, T);
  float *scratch = blockdot_scratch(sizeof(float) * (T * (NQKV + HD) + attention_scratch(s, T, max_len, nthreads)));
  if (!scratch) return -1;
  widen(qkv, scratch, T * NQKV, io_bf16);
  #pragma omp parallel num_threads(nthreads)
  attention(s, w, scratch, scratch + T * NQKV, T, positions, slot_mapping, tables, nb, cos, sin,
            scratch + T * (NQKV + HD), max_len);
  narrow(scratch + T * NQKV, att, T * HD, io_bf16);
  return 0;
}

/* h [T, E] float32 += add (float32 or bf16; NULL: nothing), normed first where add_norm is given
   (rms_norm(add) * add_norm: Gemma's sandwich norms), then x = rms_norm(h) * w in float32 or bf16 (w
   NULL: no norm, x untouched); the rows split over nthreads threads. */
void fused_add_norm(float *h, const void *add, const float *add_norm, const float *w, void *x, int io_bf16, int64_t T,
                    int64_t E, float eps, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 1)
  for (int64_t r = 0; r < T; r++) {
    float normed[E];
    float *row = h + r * E;
    if (add) {
      widen(io_bf16 ? (const void *)((const uint16_t *)add + r * E) : (const void *)((const float *)add + r * E),
            normed, E, io_bf16);
      if (add_norm) rms_norm(normed, add_norm, normed, E, eps);
      for (int64_t i = 0; i < E; i++) row[i] += normed[i];
    }
    if (!w) continue;
    rms_norm(row, w, normed, E, eps);
    narrow(normed, io_bf16 ? (void *)((uint16_t *)x + r * E) : (void *)((float *)x + r * E), E, io_bf16);
  }
}

/* gu [T, 2 I] (gate, then up) -> out [T, I] = act(gate) up (activation: ACT_SILU or ACT_GELU_TANH), in
   float32 or bf16; the rows split over nthreads threads (at 16 rows, 24,576 exponentials a layer: ~150 us
   on one thread on the Zen 5 as expf calls). */
void fused_gate_mul(const void *gu, void *out, int io_bf16, int64_t T, int64_t I, int64_t activation, int nthreads) {
  const struct gate act = gate_of(activation);
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 1)
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
      const float y = gated(gate, up, act);
      if (io_bf16) ((uint16_t *)out)[r * I + i] = f32_to_bf16(y);
      else ((float *)out)[r * I + i] = y;
    }
}

/* One sparse layer's MLP for steps whose other matmuls run outside C: x [T, E] (float32 or bf16,
   io_bf16) -> out [T, E] in the same dtype, moe_mlp's arithmetic in float32. Returns 0, or -1 when out
   of memory. */
int fused_moe(const struct fused_shape *s, const struct fused_moe *m, const void *x, void *out, int io_bf16, int64_t T,
              int nthreads) {
  const int64_t E = s->E;
  float *scratch = blockdot_scratch(sizeof(float) * (2 * T * E + blockdot_scratch_floats(T, E) + moe_floats(m, T, E)));
  if (!scratch) return -1;
  float *x32 = scratch, *out32 = x32 + T * E, *prep = out32 + T * E, *work = prep + blockdot_scratch_floats(T, E);
  widen(x, x32, T * E, io_bf16);
  const int q16 = s->int16_rows > 0 && T >= s->int16_rows;
  const int64_t amx_rows = s->amx_rows > 0 && blockdot_amx() ? s->amx_rows : 0;
  #pragma omp parallel num_threads(nthreads)
  {
    struct xin in;
    blockdot_inputs(x32, T, E, q16, prep, &in);
    in.amx_rows = amx_rows;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < T; r++) prepare_row(&in, E, 1, r);
    moe_mlp(m, x32, &in, T, E, (int)s->int16_rows, amx_rows, moe_work(m, T, E, work), out32);
  }
  narrow(out32, out, T * E, io_bf16);
  return 0;
}

/* n float32 values rounded into a cache of `kind` as a decode step writes K and V (one head of n
   values: n a multiple of QK in a block kind), and read back as its attention reads them: for the
   tests (every build's float16 rounding against torch's, its blocks' bytes against gguf-py's). */
void fused_kv_store(const float *x, void *cache, int64_t n, int kind) { store_kv(cache, 0, x, n, kind); }
void fused_kv_widen(const void *cache, float *out, int64_t n, int kind) {
  if (WIDENED(kind)) widen_kv(cache, 0, out, n, kind);
  else for (int64_t i = 0; i < n; i++) out[i] = kind == KV_BF16 ? kv(cache, i, KV_BF16) : kv(cache, i, KV_F32);
}
