// Two-phase depth attention on the CPU: Phase 1 over the sources, and the Phase-2 merge fused with the RMSNorm
// the sublayer applies next (plus that RMSNorm alone, so PreNorm's reads run the same code), forward and backward.
//
// attnres/ops/two_phase/cpu.py compiles this file on first use (a plain C ABI called through ctypes, no torch
// headers, so it builds in about a second) and falls back to the torch formulation when no compiler is there.
//
// Phase 1. The math is fused.phase1_forward / fused.phase1_backward's (read those first); here a token's n source
// rows, its S query outputs and its S x H statistics stay in cache while they are used, so each source row is
// read from memory once per direction and each gradient row written once. The PyTorch products it replaces run
// [B*T] batches of tiny n x D by D x S matrices and materialise every [B*T, n, S, H] intermediate.
// Layout: source i of token x is src[i] + x * src_stride (x = b * T + t; the caller checks that B and T flatten
// with one stride), D contiguous values; its inverse RMS is rinv[i][x * rinv_stride] (rinv null: no key norm).
// u [S, D] = queries * key_weights. Head h of H owns channels [h * D / H, (h + 1) * D / H).
// Outputs: h [N, S, D], lse [N, S, H] (zero for the sigmoid kernel); backward gv [N, n, D] and du [S, D].
//
// Merge + norm (MergeNorm). fused.merge_partial's math (the online-softmax merge of the running partial sum
// into Phase 1's h and lse) followed by an optional RMSNorm, in one pass per token: it reads the partial row and
// the Phase-1 row (h1_stride apart per token, so a strided slice of Phase 1's [N, S, D] output is read in place)
// and writes h and norm(h). The backward recomputes h from the saved per-token scalars instead of storing it.
// RMSNorm alone (RMSNorm) is the same norm over a strided input, saving the inverse RMS for its backward.
// Per-thread partial sums of the weight gradients are added in a fixed order, so results do not depend on timing.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

namespace {

// Explicit 64-byte vectors (GCC/Clang vector extensions: one AVX-512 register, two AVX2 or four NEON ones), two
// per chunk. A chunk's partial sums stay in registers while the terms stream past, and the two partial sums
// keep the multiply-adds from waiting on one another. The compiler's own vectoriser did neither here.
typedef float vfloat __attribute__((vector_size(64)));
typedef double vdouble __attribute__((vector_size(64)));
template <typename T>
struct Vector;
template <>
struct Vector<float> {
  using type = vfloat;
};
template <>
struct Vector<double> {
  using type = vdouble;
};
template <typename T>
using vec = typename Vector<T>::type;
template <typename T>
constexpr int64_t WIDTH = sizeof(vec<T>) / sizeof(T);

template <typename T>
inline vec<T> load(const T* p) {
  vec<T> v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
template <typename T>
inline void store(T* p, vec<T> v) {
  __builtin_memcpy(p, &v, sizeof v);
}
// Half-width vectors for the horizontal sum, which halves the width log2(WIDTH) times instead of adding the
// lanes one after another (a chain of WIDTH dependent additions per dot product, slower than the products)
typedef float vfloat8 __attribute__((vector_size(32)));
typedef float vfloat4 __attribute__((vector_size(16)));
typedef double vdouble4 __attribute__((vector_size(32)));
typedef double vdouble2 __attribute__((vector_size(16)));

template <typename Half, typename Full>
inline Half fold(Full v) {
  Half lo, hi;
  __builtin_memcpy(&lo, &v, sizeof lo);
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  return lo + hi;
}

inline float total(vfloat v) {
  const vfloat4 q = fold<vfloat4>(fold<vfloat8>(v));
  return (q[0] + q[2]) + (q[1] + q[3]);
}
inline double total(vdouble v) {
  const vdouble2 q = fold<vdouble2>(fold<vdouble4>(v));
  return q[0] + q[1];
}

// exp over a contiguous array in place. float32: a vectorised exp (2^k times a degree-7 Taylor polynomial on
// |r| <= ln2 / 2, relative error below 2e-7, flushing below exp(-87.3)); the scalar std::exp of the softmax
// was most of the forward's time. float64, the reference precision, keeps std::exp.
typedef int32_t vint __attribute__((vector_size(64)));

inline vfloat vexp(vfloat x) {
  const vfloat zero{};
  x = x < zero - 87.33654f ? zero - 87.33654f : x;
  x = x > zero + 88.37626f ? zero + 88.37626f : x;
  const vfloat kf = x * 1.44269504f + 0.5f;  // round(x / ln 2) = floor(kf)
  vint k = __builtin_convertvector(kf, vint);
  k += (__builtin_convertvector(k, vfloat) > kf);  // truncation rounded up negatives: -1 where so
  const vfloat kk = __builtin_convertvector(k, vfloat);
  const vfloat r = x - kk * 0.693359375f + kk * 2.12194440e-4f;  // x - k ln 2 in two parts
  vfloat p = zero + 1.98412698e-4f;
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vint bits = (k + 127) << 23;
  vfloat scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline void exp_inplace(float* a, int64_t len) {
  constexpr int64_t W = WIDTH<float>;
  int64_t c = 0;
  for (; c + W <= len; c += W) store(a + c, vexp(load(a + c)));
  if (c < len) {
    float tail[W] = {};
    std::copy(a + c, a + len, tail);
    const vfloat y = vexp(load(tail));
    for (int64_t j = 0; c + j < len; ++j) a[c + j] = y[j];
  }
}

inline void exp_inplace(double* a, int64_t len) {
  for (int64_t c = 0; c < len; ++c) a[c] = std::exp(a[c]);
}

// (a . b1, a . b2) over len values, reading a once
template <typename T>
inline void dot2(const T* a, const T* b1, const T* b2, int64_t len, T& out1, T& out2) {
  constexpr int64_t W = WIDTH<T>;
  vec<T> p1{}, p2{}, q1{}, q2{};
  int64_t c = 0;
  for (; c + 2 * W <= len; c += 2 * W) {
    const vec<T> x = load(a + c), y = load(a + c + W);
    p1 += x * load(b1 + c);
    q1 += y * load(b1 + c + W);
    p2 += x * load(b2 + c);
    q2 += y * load(b2 + c + W);
  }
  for (; c + W <= len; c += W) {
    const vec<T> x = load(a + c);
    p1 += x * load(b1 + c);
    p2 += x * load(b2 + c);
  }
  T s1 = total(p1 + q1), s2 = total(p2 + q2);
  for (; c < len; ++c) s1 += a[c] * b1[c], s2 += a[c] * b2[c];
  out1 = s1;
  out2 = s2;
}

template <typename T>
inline T dot(const T* a, const T* b, int64_t len) {
  constexpr int64_t W = WIDTH<T>;
  vec<T> p{}, q{};
  int64_t c = 0;
  for (; c + 2 * W <= len; c += 2 * W) {
    p += load(a + c) * load(b + c);
    q += load(a + c + W) * load(b + c + W);
  }
  for (; c + W <= len; c += W) p += load(a + c) * load(b + c);
  T acc = total(p + q);
  for (; c < len; ++c) acc += a[c] * b[c];
  return acc;
}

// sum a b c over len values
template <typename T>
inline T dot3(const T* a, const T* b, const T* c3, int64_t len) {
  constexpr int64_t W = WIDTH<T>;
  vec<T> p{};
  int64_t c = 0;
  for (; c + W <= len; c += W) p += load(a + c) * load(b + c) * load(c3 + c);
  T acc = total(p);
  for (; c < len; ++c) acc += a[c] * b[c] * c3[c];
  return acc;
}

// out[0:len] (+)= sum_k w_k x_k[0:len] for the `count` terms term(k) = (w_k, x_k), one chunk of out at a time
template <typename T, typename Terms>
inline void combine(T* out, int64_t len, int64_t count, bool accumulate, Terms term) {
  constexpr int64_t W = WIDTH<T>;
  int64_t c = 0;
  for (; c + 2 * W <= len; c += 2 * W) {
    vec<T> a0{}, a1{};
    if (accumulate) a0 = load(out + c), a1 = load(out + c + W);
    for (int64_t k = 0; k < count; ++k) {
      const auto [w, x] = term(k);
      a0 += w * load(x + c);
      a1 += w * load(x + c + W);
    }
    store(out + c, a0);
    store(out + c + W, a1);
  }
  for (; c + W <= len; c += W) {
    vec<T> a0{};
    if (accumulate) a0 = load(out + c);
    for (int64_t k = 0; k < count; ++k) {
      const auto [w, x] = term(k);
      a0 += w * load(x + c);
    }
    store(out + c, a0);
  }
  for (; c < len; ++c) {
    T acc = accumulate ? out[c] : T(0);
    for (int64_t k = 0; k < count; ++k) {
      const auto [w, x] = term(k);
      acc += w * x[c];
    }
    out[c] = acc;
  }
}

template <typename T>
struct Phase1 {
  const T* const* src;
  int64_t src_stride;
  const T* const* rinv;  // null: no key norm
  int64_t rinv_stride;
  const T* u;
  int64_t n, S, H, D;
  bool softmax;

  int64_t width() const { return D / H; }
  const T* row(int64_t i, int64_t x) const { return src[i] + x * src_stride; }
  T inv(int64_t i, int64_t x) const { return rinv ? rinv[i][x * rinv_stride] : T(1); }

  // dots[(i * S + s) * H + h] = v_i . u_s over head h's channels
  void dots(int64_t x, T* out) const {
    const int64_t e = width();
    for (int64_t i = 0; i < n; ++i) {
      const T* v = row(i, x);
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h) out[(i * S + s) * H + h] = dot(v + h * e, u + s * D + h * e, e);
    }
  }

  void forward(int64_t x0, int64_t x1, T* h_out, T* lse_out) const {
    const int64_t SH = S * H, e = width();
    std::vector<T> a(n * SH), m(SH), l(SH);
    for (int64_t x = x0; x < x1; ++x) {
      dots(x, a.data());
      for (int64_t i = 0; i < n; ++i) {
        const T r = inv(i, x);
        for (int64_t k = 0; k < SH; ++k) a[i * SH + k] *= r;
      }
      T* lse = lse_out + x * SH;
      // the logits become the weights, in place, with one vectorised pass of exp over all n x S x H of them
      if (softmax) {  // e_i = exp(z_i - max), alpha_i = e_i / sum e
        std::copy(a.begin(), a.begin() + SH, m.begin());
        for (int64_t i = 1; i < n; ++i)
          for (int64_t k = 0; k < SH; ++k) m[k] = std::max(m[k], a[i * SH + k]);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t k = 0; k < SH; ++k) a[i * SH + k] -= m[k];
        exp_inplace(a.data(), n * SH);
        std::fill(l.begin(), l.end(), T(0));
        for (int64_t i = 0; i < n; ++i)
          for (int64_t k = 0; k < SH; ++k) l[k] += a[i * SH + k];
        for (int64_t k = 0; k < SH; ++k) {
          lse[k] = m[k] + std::log(l[k]);
          l[k] = T(1) / l[k];
        }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t k = 0; k < SH; ++k) a[i * SH + k] *= l[k];
      } else {  // sigmoid(z) = 1 / (1 + exp(-z))
        for (int64_t j = 0; j < n * SH; ++j) a[j] = -a[j];
        exp_inplace(a.data(), n * SH);
        for (int64_t j = 0; j < n * SH; ++j) a[j] = T(1) / (T(1) + a[j]);
        std::fill(lse, lse + SH, T(0));
      }
      T* hx = h_out + x * S * D;
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h)
          combine(hx + s * D + h * e, e, n, false, [&](int64_t i) {
            return std::pair<T, const T*>(a[(i * S + s) * H + h], row(i, x) + h * e);
          });
    }
  }

  // gv [N, n, D]; du_part [S, D] accumulates this range's share (null: not wanted)
  void backward(int64_t x0, int64_t x1, const T* lse_in, const T* gh_in, const T* glse_in, T* gv_out,
                T* du_part) const {
    const int64_t SH = S * H, e = width();
    std::vector<T> dot_vu(n * SH), alpha(n * SH), gz(n * SH);
    for (int64_t x = x0; x < x1; ++x) {
      const T* lse = lse_in + x * SH;
      const T* gh = gh_in + x * S * D;
      for (int64_t i = 0; i < n; ++i) {  // the weights again, and dL/dalpha = gh_s . v_i per head
        const T* v = row(i, x);
        const T r = inv(i, x);
        for (int64_t s = 0; s < S; ++s)
          for (int64_t h = 0; h < H; ++h) {
            const int64_t k = (i * S + s) * H + h;
            dot2(v + h * e, u + s * D + h * e, gh + s * D + h * e, e, dot_vu[k], gz[k]);
            alpha[k] = softmax ? r * dot_vu[k] - lse[s * H + h] : -r * dot_vu[k];  // its exp, below
          }
      }
      exp_inplace(alpha.data(), n * SH);
      if (!softmax)
        for (int64_t k = 0; k < n * SH; ++k) alpha[k] = T(1) / (T(1) + alpha[k]);
      for (int64_t k = 0; k < SH; ++k) {  // dL/dz
        if (softmax) {
          T mean = 0;
          for (int64_t i = 0; i < n; ++i) mean += alpha[i * SH + k] * gz[i * SH + k];
          const T g_lse = glse_in ? glse_in[x * SH + k] : T(0);
          for (int64_t i = 0; i < n; ++i) gz[i * SH + k] = alpha[i * SH + k] * (gz[i * SH + k] - mean + g_lse);
        } else {
          for (int64_t i = 0; i < n; ++i) {
            const T a = alpha[i * SH + k];
            gz[i * SH + k] *= a * (1 - a);
          }
        }
      }
      // dv_i = sum_s alpha_si gh_s + r_i gz_si u_s, plus the key norm's -r_i^3 / D (sum_s gz_si dot_si) v_i
      for (int64_t i = 0; i < n; ++i) {
        const T* v = row(i, x);
        const T r = inv(i, x);
        T norm_term = 0;
        for (int64_t k = i * SH; k < (i + 1) * SH; ++k) norm_term += gz[k] * dot_vu[k];
        const T c_norm = rinv ? -norm_term * r * r * r / T(D) : T(0);
        T* gv = gv_out + (x * n + i) * D;
        for (int64_t h = 0; h < H; ++h)
          combine(gv + h * e, e, 2 * S + 1, false, [&](int64_t k) {
            if (k < S) return std::pair<T, const T*>(alpha[(i * S + k) * H + h], gh + k * D + h * e);
            if (k < 2 * S) return std::pair<T, const T*>(gz[(i * S + k - S) * H + h] * r, u + (k - S) * D + h * e);
            return std::pair<T, const T*>(c_norm, v + h * e);
          });
      }
      if (du_part)  // du_s = sum over tokens and sources of r_i gz_si v_i
        for (int64_t s = 0; s < S; ++s)
          for (int64_t h = 0; h < H; ++h)
            combine(du_part + s * D + h * e, e, n, true, [&](int64_t i) {
              return std::pair<T, const T*>(gz[(i * S + s) * H + h] * inv(i, x), row(i, x) + h * e);
            });
    }
  }
};

// Decoding: one token per sequence, no gradients. A read of two-phase's buffer (rows [K, D] per sequence, the
// inverse RMS [K] beside them) in one call, which at T = 1 costs less than the dozen small torch ops it replaces:
// optionally store a vector as row m (the partial sum, with its inverse RMS), then attend over the first
// `rows` rows with u [D] (query * key weight) per head and write the weighted sum. The math is the two-phase
// read's: z_i = r_i (v_i . u) per head, softmax over i (or sigmoid), out = sum_i alpha_i v_i.
template <typename T>
struct DecodeBuffer {
  T* buf;
  int64_t buf_stride, row_stride;  // between sequences, between rows
  T* rinv;                         // null: no key norm
  int64_t rinv_stride, rinv_row_stride;
  int64_t B, H, D;

  // row `row` of every sequence := v (sequences v_stride apart), and its inverse RMS 1 / sqrt(eps + |v|^2 / D)
  void store(int64_t row, const T* v, int64_t v_stride, T eps) const {
    for (int64_t b = 0; b < B; ++b) {
      const T* x = v + b * v_stride;
      std::copy(x, x + D, buf + b * buf_stride + row * row_stride);
      if (rinv) rinv[b * rinv_stride + row * rinv_row_stride] = T(1) / std::sqrt(eps + dot(x, x, D) / T(D));
    }
  }

  void read(int64_t rows, const T* u, bool softmax, T* out, int64_t out_stride) const {
    const int64_t e = D / H;
    std::vector<T> w(rows);
    for (int64_t b = 0; b < B; ++b) {
      const T* base = buf + b * buf_stride;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < rows; ++i) {
          const T r = rinv ? rinv[b * rinv_stride + i * rinv_row_stride] : T(1);
          w[i] = r * dot(base + i * row_stride + h * e, u + h * e, e);
        }
        if (softmax) {
          const T top = *std::max_element(w.begin(), w.end());
          T sum = 0;
          for (auto& z : w) sum += (z = std::exp(z - top));
          for (auto& z : w) z /= sum;
        } else {
          for (auto& z : w) z = T(1) / (T(1) + std::exp(-z));
        }
        combine(out + b * out_stride + h * e, e, rows, false,
                [&](int64_t i) { return std::pair<T, const T*>(w[i], base + i * row_stride + h * e); });
      }
    }
  }
};

// Phase 2 fused with the pre-norm of the sublayer that reads it: per token one call merges the partial sum p into
// the Phase-1 result (h1, lse) and, with `norm`, applies the RMSNorm that follows, so h itself is never written:
//   s = p . u, r = 1 / sqrt(key_eps + |p|^2 / D), w = sigmoid(r s - lse), h = h1 + w (p - h1)
//   x = h rho g with rho = 1 / sqrt(norm_eps + |h|^2 / D) and g the norm's weight (null: ones); without norm x = h.
// The math is fused._MergePartial's followed by nn.RMSNorm (read those first). One head, softmax, key norm.
// With lse2 the second operand is not a raw partial sum but another depth attention's result (h2 = p, with its
// log-sum-exp lse2: Full AttnRes' sources completed inside a Phase-1 group): w = sigmoid(lse2 - lse), no key norm
// and no query (u unused, du untouched), reference.merge's math; the caller takes dlse2 = -dlse.
// The forward keeps [N, 4] scalars (s, r, w, rho); the backward recomputes h from h1, p and w (two passes over a
// token's row, which stays in cache) and writes dh1 and dp once each, with dlse [N], du [D] and dg [D].
template <typename T>
struct MergeNorm {
  const T *h1, *lse, *p, *u, *g;  // g null: no weight
  int64_t h1_stride, D;             // h1's rows are h1_stride apart (a query's slice of Phase 1's output)
  T key_eps, norm_eps;
  bool norm;
  const T* lse2 = nullptr;  // set: p is a merged result with this log-sum-exp (see above)

  void forward(int64_t x0, int64_t x1, T* out, T* saved) const {
    constexpr int64_t W = WIDTH<T>;
    for (int64_t x = x0; x < x1; ++x) {
      const T *a = h1 + x * h1_stride, *b = p + x * D;
      T* o = out + x * D;
      T s = T(0), r = T(0), w;
      if (lse2) {
        w = T(1) / (T(1) + std::exp(lse[x] - lse2[x]));
      } else {
        T pp;
        dot2(b, u, b, D, s, pp);
        r = T(1) / std::sqrt(key_eps + pp / T(D));
        w = T(1) / (T(1) + std::exp(lse[x] - r * s));
      }
      vec<T> hh{};
      int64_t c = 0;
      for (; c + W <= D; c += W) {
        const vec<T> av = load(a + c), h = av + w * (load(b + c) - av);
        store(o + c, h);
        hh += h * h;
      }
      T sum = total(hh);
      for (; c < D; ++c) {
        o[c] = a[c] + w * (b[c] - a[c]);
        sum += o[c] * o[c];
      }
      T rho = T(1);
      if (norm) {
        rho = T(1) / std::sqrt(norm_eps + sum / T(D));
        c = 0;
        if (g) {
          for (; c + W <= D; c += W) store(o + c, load(o + c) * rho * load(g + c));
          for (; c < D; ++c) o[c] *= rho * g[c];
        } else {
          for (; c + W <= D; c += W) store(o + c, load(o + c) * rho);
          for (; c < D; ++c) o[c] *= rho;
        }
      }
      T* k = saved + 4 * x;
      k[0] = s, k[1] = r, k[2] = w, k[3] = rho;
    }
  }

  // gx [N, D] in; gh1, gp [N, D], glse [N] out; du, dg [D] accumulated (the caller's per-thread partials)
  void backward(int64_t x0, int64_t x1, const T* gx, const T* saved, T* gh1, T* gp, T* glse, T* du, T* dg) const {
    constexpr int64_t W = WIDTH<T>;
    for (int64_t x = x0; x < x1; ++x) {
      const T *a = h1 + x * h1_stride, *b = p + x * D, *gr = gx + x * D;
      const T* k = saved + 4 * x;
      const T s = k[0], r = k[1], w = k[2], rho = k[3];
      // pass 1: c1 = (g gx) . h, e1 = (g gx) . (p - h1), e2 = h . (p - h1); then dL/dh = rho g gx - beta h
      vec<T> vc1{}, ve1{}, ve2{};
      int64_t c = 0;
      for (; c + W <= D; c += W) {
        const vec<T> av = load(a + c), diff = load(b + c) - av, h = av + w * diff;
        const vec<T> gg = g ? load(gr + c) * load(g + c) : load(gr + c);
        vc1 += gg * h;
        ve1 += gg * diff;
        ve2 += h * diff;
      }
      T c1 = total(vc1), e1 = total(ve1), e2 = total(ve2);
      for (; c < D; ++c) {
        const T diff = b[c] - a[c], h = a[c] + w * diff, gg = g ? gr[c] * g[c] : gr[c];
        c1 += gg * h, e1 += gg * diff, e2 += h * diff;
      }
      const T beta = norm ? rho * rho * rho * c1 / T(D) : T(0);
      const T scale = norm ? rho : T(1);
      const T gw = scale * e1 - beta * e2;  // dL/dw = dL/dh . (p - h1)
      const T gz = gw * w * (T(1) - w), gs = gz * r;
      const T kp = -(gz * s) * r * r * r / T(D);  // the key norm's term on p (zero with lse2: s = r = 0)
      glse[x] = -gz;
      // pass 2: dh1 = (1 - w) dh, dp = w dh + gs u + kp p; du += gs p, dg += gx h rho
      T *o1 = gh1 + x * D, *op = gp + x * D;
      c = 0;
      for (; c + W <= D; c += W) {
        const vec<T> av = load(a + c), bv = load(b + c), h = av + w * (bv - av), gv = load(gr + c);
        const vec<T> gh = scale * (g ? gv * load(g + c) : gv) - beta * h;
        store(o1 + c, (T(1) - w) * gh);
        if (lse2) {
          store(op + c, w * gh);
        } else {
          store(op + c, w * gh + gs * load(u + c) + kp * bv);
          store(du + c, load(du + c) + gs * bv);
        }
        if (norm && dg) store(dg + c, load(dg + c) + rho * gv * h);
      }
      for (; c < D; ++c) {
        const T h = a[c] + w * (b[c] - a[c]), gh = scale * (g ? gr[c] * g[c] : gr[c]) - beta * h;
        o1[c] = (T(1) - w) * gh;
        op[c] = lse2 ? w * gh : w * gh + gs * u[c] + kp * b[c];
        if (!lse2) du[c] += gs * b[c];
        if (norm && dg) dg[c] += rho * gr[c] * h;
      }
    }
  }
};

// The pre-norm of a sublayer whose stream has no merge to fuse it with (PreNorm's running sum, a block's first
// read): x = h rho g, rho = 1 / sqrt(eps + |h|^2 / D), as nn.RMSNorm; the forward keeps rho [N], the backward
// writes dh = rho g gx - rho^3 / D ((g gx) . h) h and accumulates dg += rho gx h. The same arithmetic as
// MergeNorm's norm, so every scheme's pre-norm costs the same (the baseline is timed with this kernel too).
template <typename T>
struct RMSNorm {
  const T *h, *g;            // g null: no weight
  int64_t h_stride, D;       // h's rows are h_stride apart
  T eps;

  void forward(int64_t x0, int64_t x1, T* out, T* rho_out) const {
    constexpr int64_t W = WIDTH<T>;
    for (int64_t x = x0; x < x1; ++x) {
      const T* a = h + x * h_stride;
      T* o = out + x * D;
      const T rho = T(1) / std::sqrt(eps + dot(a, a, D) / T(D));
      int64_t c = 0;
      if (g) {
        for (; c + W <= D; c += W) store(o + c, load(a + c) * rho * load(g + c));
        for (; c < D; ++c) o[c] = a[c] * rho * g[c];
      } else {
        for (; c + W <= D; c += W) store(o + c, load(a + c) * rho);
        for (; c < D; ++c) o[c] = a[c] * rho;
      }
      rho_out[x] = rho;
    }
  }

  void backward(int64_t x0, int64_t x1, const T* gx, const T* rho_in, T* gh, T* dg) const {
    constexpr int64_t W = WIDTH<T>;
    for (int64_t x = x0; x < x1; ++x) {
      const T *a = h + x * h_stride, *gr = gx + x * D;
      const T rho = rho_in[x];
      const T c1 = g ? dot3(gr, g, a, D) : dot(gr, a, D);
      const T beta = rho * rho * rho * c1 / T(D);
      T* o = gh + x * D;
      int64_t c = 0;
      for (; c + W <= D; c += W) {
        const vec<T> av = load(a + c), gv = load(gr + c);
        store(o + c, rho * (g ? gv * load(g + c) : gv) - beta * av);
        if (dg) store(dg + c, load(dg + c) + rho * gv * av);
      }
      for (; c < D; ++c) {
        o[c] = rho * (g ? gr[c] * g[c] : gr[c]) - beta * a[c];
        if (dg) dg[c] += rho * gr[c] * a[c];
      }
    }
  }
};

// Runs body(x0, x1, part) over `threads` contiguous token ranges (one in this thread when threads <= 1).
template <typename F>
void split_tokens(int64_t N, int threads, F body) {
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, N));
  if (t == 1) {
    body(0, N, 0);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (N + t - 1) / t;
  for (int64_t p = 1; p < t; ++p)
    pool.emplace_back([=] { body(std::min(N, p * chunk), std::min(N, (p + 1) * chunk), p); });
  body(0, std::min(N, chunk), 0);
  for (auto& th : pool) th.join();
}

template <typename T>
void run_forward(const Phase1<T>& op, int64_t N, int threads, T* h, T* lse) {
  split_tokens(N, threads, [&](int64_t x0, int64_t x1, int64_t) { op.forward(x0, x1, h, lse); });
}

template <typename T>
void run_backward(const Phase1<T>& op, int64_t N, int threads, const T* lse, const T* gh, const T* glse, T* gv,
                  T* du) {
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, N));
  // one [S, D] partial per range, summed in a fixed order: the result does not depend on scheduling
  std::vector<T> parts(du ? t * op.S * op.D : 0, T(0));
  split_tokens(N, static_cast<int>(t), [&](int64_t x0, int64_t x1, int64_t p) {
    op.backward(x0, x1, lse, gh, glse, gv, du ? parts.data() + p * op.S * op.D : nullptr);
  });
  if (du) {
    std::fill(du, du + op.S * op.D, T(0));
    for (int64_t p = 0; p < t; ++p)
      for (int64_t c = 0; c < op.S * op.D; ++c) du[c] += parts[p * op.S * op.D + c];
  }
}

}  // namespace

#define ATTNRES_PHASE1(T, SUFFIX)                                                                              \
  extern "C" void attnres_phase1_forward_##SUFFIX(const T* const* src, int64_t src_stride, const T* const* rinv, \
                                                  int64_t rinv_stride, const T* u, int64_t N, int64_t n,       \
                                                  int64_t S, int64_t H, int64_t D, int softmax, T* h, T* lse,   \
                                                  int threads) {                                               \
    const Phase1<T> op{src, src_stride, rinv, rinv_stride, u, n, S, H, D, softmax != 0};                       \
    run_forward(op, N, threads, h, lse);                                                                       \
  }                                                                                                            \
  extern "C" void attnres_phase1_backward_##SUFFIX(                                                            \
      const T* const* src, int64_t src_stride, const T* const* rinv, int64_t rinv_stride, const T* u,           \
      int64_t N, int64_t n, int64_t S, int64_t H, int64_t D, int softmax, const T* lse, const T* gh,            \
      const T* glse, T* gv, T* du, int threads) {                                                              \
    const Phase1<T> op{src, src_stride, rinv, rinv_stride, u, n, S, H, D, softmax != 0};                       \
    run_backward(op, N, threads, lse, gh, glse, gv, du);                                                       \
  }

ATTNRES_PHASE1(float, f32)
ATTNRES_PHASE1(double, f64)

#define ATTNRES_DECODE(T, SUFFIX)                                                                              \
  extern "C" void attnres_decode_read_##SUFFIX(T* buf, int64_t buf_stride, int64_t row_stride, T* rinv,        \
                                               int64_t rinv_stride, int64_t rinv_row_stride, int64_t B,       \
                                               int64_t H, int64_t D, const T* store, int64_t store_stride,    \
                                               int64_t store_row, double eps, int64_t rows, const T* u,       \
                                               int softmax, T* out, int64_t out_stride) {                     \
    const DecodeBuffer<T> db{buf, buf_stride, row_stride, rinv, rinv_stride, rinv_row_stride, B, H, D};         \
    if (store) db.store(store_row, store, store_stride, T(eps));                                               \
    if (u) db.read(rows, u, softmax != 0, out, out_stride);                                                    \
  }

ATTNRES_DECODE(float, f32)
ATTNRES_DECODE(double, f64)

#define ATTNRES_MERGE_NORM(T, SUFFIX)                                                                          \
  extern "C" void attnres_merge_norm_forward_##SUFFIX(const T* h1, int64_t h1_stride, const T* lse, const T* p, \
                                                     const T* lse2, const T* u, const T* g, int64_t N,        \
                                                     int64_t D, double key_eps, double norm_eps, int norm,    \
                                                     T* out, T* saved, int threads) {                         \
    const MergeNorm<T> op{h1, lse, p, u, g, h1_stride, D, T(key_eps), T(norm_eps), norm != 0, lse2};             \
    split_tokens(N, threads, [&](int64_t x0, int64_t x1, int64_t) { op.forward(x0, x1, out, saved); });        \
  }                                                                                                            \
  extern "C" void attnres_merge_norm_backward_##SUFFIX(                                                        \
      const T* h1, int64_t h1_stride, const T* lse, const T* p, const T* lse2, const T* u, const T* g,         \
      int64_t N, int64_t D, double key_eps, double norm_eps, int norm, const T* gx, const T* saved, T* gh1,      \
      T* gp, T* glse, T* du, T* dg, int threads) {                                                             \
    const MergeNorm<T> op{h1, lse, p, u, g, h1_stride, D, T(key_eps), T(norm_eps), norm != 0, lse2};             \
    const int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, N));                                     \
    /* one [2, D] partial (du, dg) per range, summed in a fixed order: the result does not depend on scheduling */ \
    std::vector<T> parts(t * 2 * D, T(0));                                                                     \
    split_tokens(N, static_cast<int>(t), [&](int64_t x0, int64_t x1, int64_t part) {                           \
      T* mine = parts.data() + part * 2 * D;                                                                   \
      op.backward(x0, x1, gx, saved, gh1, gp, glse, mine, dg ? mine + D : nullptr);                            \
    });                                                                                                        \
    std::fill(du, du + D, T(0));                                                                               \
    if (dg) std::fill(dg, dg + D, T(0));                                                                       \
    for (int64_t part = 0; part < t; ++part)                                                                   \
      for (int64_t c = 0; c < D; ++c) {                                                                        \
        du[c] += parts[part * 2 * D + c];                                                                      \
        if (dg) dg[c] += parts[part * 2 * D + D + c];                                                          \
      }                                                                                                        \
  }

#define ATTNRES_RMS_NORM(T, SUFFIX)                                                                            \
  extern "C" void attnres_rms_norm_forward_##SUFFIX(const T* h, int64_t h_stride, const T* g, int64_t N,      \
                                                   int64_t D, double eps, T* out, T* rho, int threads) {       \
    const RMSNorm<T> op{h, g, h_stride, D, T(eps)};                                                            \
    split_tokens(N, threads, [&](int64_t x0, int64_t x1, int64_t) { op.forward(x0, x1, out, rho); });          \
  }                                                                                                            \
  extern "C" void attnres_rms_norm_backward_##SUFFIX(const T* h, int64_t h_stride, const T* g, int64_t N,     \
                                                    int64_t D, const T* gx, const T* rho, T* gh, T* dg,        \
                                                    int threads) {                                             \
    const RMSNorm<T> op{h, g, h_stride, D, T(0)};                                                              \
    const int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, N));                                     \
    std::vector<T> parts(dg ? t * D : 0, T(0));                                                                \
    split_tokens(N, static_cast<int>(t), [&](int64_t x0, int64_t x1, int64_t part) {                           \
      op.backward(x0, x1, gx, rho, gh, dg ? parts.data() + part * D : nullptr);                                \
    });                                                                                                        \
    if (dg) {                                                                                                  \
      std::fill(dg, dg + D, T(0));                                                                             \
      for (int64_t part = 0; part < t; ++part)                                                                 \
        for (int64_t c = 0; c < D; ++c) dg[c] += parts[part * D + c];                                          \
    }                                                                                                          \
  }

ATTNRES_RMS_NORM(float, f32)
ATTNRES_RMS_NORM(double, f64)

ATTNRES_MERGE_NORM(float, f32)
ATTNRES_MERGE_NORM(double, f64)

extern "C" int attnres_phase1_abi() { return 4; }
