// One pass of Adam / AdamW over a chunk of a stage slab: the host optimizer's kernel.
//
// XLA's CPU backend compiles optax's AdamW into three loop fusions (mu, nu, params) and
// a cast, so every parameter's bytes cross memory about 46 times where one pass needs
// 30 (read master, mu, nu, grad; write master, mu, nu and the compute-dtype copy). This
// kernel is that one pass, split over XLA's intra-op thread pool. It computes optax's
// formulas in optax's operation order in float32, each operation rounded as written
// (built with -ffp-contract=off): mu and nu equal those formulas evaluated op by op in
// float32 bit for bit. Against optax's jitted update they differ by one rounding a step:
// XLA's CPU backend fuses one of the two products of ``(1 - b) * g + b * m`` into an
// FMA, and which one varies between fusions of the same update. The params agree to
// within a few ulps (tests/test_native.py). Built on first use by hetjax/optimizer/native.py.
//
// Two entry points: ``HetjaxAdam`` (an XLA FFI handler) and ``HetjaxAdamHost`` (plain
// C, for buffers outside XLA: see the end of this file); and two more of the same pass
// over int8 moments, ``HetjaxAdamInt8`` and ``HetjaxAdamInt8Host`` (see "int8 moments").
//
// Operands: master (f32[n]), mu, nu (f32[n] or bf16[n]: the moments' dtype,
// ``optimizer.state_dtype``; a bf16 moment is widened exactly as it is read, updated in
// float32 and rounded to nearest even as it is written), coef (f32[10]):
//   [clip scale, 1 - b1, b1, 1 - b2, b2, bias correction 1, bias correction 2, eps,
//    eps_root, step size (-lr)]
// and the gradient as pages of one size covering n (f32 or bf16: a bf16 element is
// widened exactly as it is read), so a gradient is read where it landed on the host,
// never concatenated into one slab nor copied to float32 first.
// Attributes: num_decay (elements [0, num_decay) get weight decay), weight_decay.
// Results: master, mu, nu (as the operands) and the new params in the compute dtype (f32, bf16
// or f16) as n / page_elems pages.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline uint16_t to_bf16(float x) {  // round to nearest even, as XLA's convert
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline uint16_t to_f16(float x) {
  _Float16 h = static_cast<_Float16>(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

template <int kGrad>  // 0: f32, 1: bf16 (the high half of an f32: widened exactly)
inline float load(const void* g, int64_t j) {
  if constexpr (kGrad == 0) {
    return static_cast<const float*>(g)[j];
  } else {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(g)[j]) << 16;
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
  }
}

struct Coef {
  float scale, c1, b1, c2, b2, bc1, bc2, eps, eps_root, step, wd;
};

template <int kKind>
inline void store(void* out, int64_t j, float x) {
  if constexpr (kKind == 0) {
    static_cast<float*>(out)[j] = x;
  } else if constexpr (kKind == 1) {
    static_cast<uint16_t*>(out)[j] = to_bf16(x);
  } else {
    static_cast<uint16_t*>(out)[j] = to_f16(x);
  }
}

// ``len`` elements within one page of the params and one of the gradient, all decayed
// or none: a branch-free loop the compiler vectorizes. Every pointer starts at the
// first element (``g`` in the gradient's dtype, ``out`` in the compute dtype).
// The results may be the operands themselves (an update in place): element i reads
// and writes index i only, so the loop has no dependence between iterations (ivdep).
// ``kMom``: the moments' dtype (0: f32, 1: bf16).
template <int kKind, int kGrad, int kMom, bool kDecay>
void adam_loop(const Coef& c, const float* p, const void* m, const void* v, const void* g,
               float* po, void* mo, void* vo, void* out, int64_t len) {
#pragma GCC ivdep
  for (int64_t i = 0; i < len; ++i) {
    const float gi = load<kGrad>(g, i) * c.scale;
    const float mi = c.c1 * gi + c.b1 * load<kMom>(m, i);
    const float vi = c.c2 * (gi * gi) + c.b2 * load<kMom>(v, i);
    float u = (mi / c.bc1) / (std::sqrt(vi / c.bc2 + c.eps_root) + c.eps);
    if constexpr (kDecay) u = u + c.wd * p[i];
    const float pi = p[i] + c.step * u;
    store<kMom>(mo, i, mi);
    store<kMom>(vo, i, vi);
    po[i] = pi;
    store<kKind>(out, i, pi);
  }
}

struct Chunk {
  const float* p;
  const void *m, *v;         // the moments, in their dtype
  const void* const* grads;  // the gradient's pages
  int64_t grad_page;         // elements per gradient page
  float* po;
  void *mo, *vo;
  void* const* pages;  // the compute-dtype params' pages
  int64_t page, num_decay;
};

constexpr int64_t kOutBytes[3] = {4, 2, 2};
constexpr int64_t kGradBytes[2] = {4, 2};

// Elements [lo, hi) of the chunk, split at the pages (params' and gradient's) and at
// num_decay.
template <int kKind, int kGrad, int kMom>
void adam_range(const Coef& c, const Chunk& k, int64_t lo, int64_t hi) {
  constexpr int64_t mb = kOutBytes[kMom];  // bytes of a moment element (f32 or bf16)
  const char *m = static_cast<const char*>(k.m), *v = static_cast<const char*>(k.v);
  char *mo = static_cast<char*>(k.mo), *vo = static_cast<char*>(k.vo);
  while (lo < hi) {
    const int64_t page = lo / k.page, grad_page = lo / k.grad_page;
    int64_t end = std::min({hi, (page + 1) * k.page, (grad_page + 1) * k.grad_page});
    const bool decay = lo < k.num_decay;
    if (decay) end = std::min(end, k.num_decay);
    auto loop = decay ? adam_loop<kKind, kGrad, kMom, true> : adam_loop<kKind, kGrad, kMom, false>;
    const void* g =
        static_cast<const char*>(k.grads[grad_page]) + (lo - grad_page * k.grad_page) * kGradBytes[kGrad];
    void* out = static_cast<char*>(k.pages[page]) + (lo - page * k.page) * kOutBytes[kKind];
    loop(c, k.p + lo, m + lo * mb, v + lo * mb, g, k.po + lo, mo + lo * mb, vo + lo * mb, out,
         end - lo);
    lo = end;
  }
}

template <int kGrad, int kMom>
void adam_range(int kind, const Coef& c, const Chunk& k, int64_t lo, int64_t hi) {
  if (kind == 0) adam_range<0, kGrad, kMom>(c, k, lo, hi);
  else if (kind == 1) adam_range<1, kGrad, kMom>(c, k, lo, hi);
  else adam_range<2, kGrad, kMom>(c, k, lo, hi);
}

template <int kMom>
void adam_range(int kind, int grad_kind, const Coef& c, const Chunk& k, int64_t lo, int64_t hi) {
  if (grad_kind == 0) adam_range<0, kMom>(kind, c, k, lo, hi);
  else adam_range<1, kMom>(kind, c, k, lo, hi);
}

void adam_range(int kind, int grad_kind, int mom_kind, const Coef& c, const Chunk& k,
                int64_t lo, int64_t hi) {
  if (mom_kind == 0) adam_range<0>(kind, grad_kind, c, k, lo, hi);
  else adam_range<1>(kind, grad_kind, c, k, lo, hi);
}

// The kind (0: f32, 1: bf16, 2: f16; -1: another) of an FFI buffer's elements.
int kind_of(ffi::DataType t) {
  return t == ffi::DataType::F32 ? 0 : t == ffi::DataType::BF16 ? 1 : t == ffi::DataType::F16 ? 2 : -1;
}

constexpr size_t kMaxPages = 4096;

ffi::Error AdamImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::AnyBuffer m,
                    ffi::AnyBuffer v, ffi::Buffer<ffi::F32> coef, ffi::RemainingArgs grads,
                    ffi::ResultBuffer<ffi::F32> po, ffi::Result<ffi::AnyBuffer> mo,
                    ffi::Result<ffi::AnyBuffer> vo, ffi::RemainingRets pages, int64_t num_decay,
                    float weight_decay) {
  const int64_t n = p.element_count();
  if (static_cast<int64_t>(m.element_count()) != n ||
      static_cast<int64_t>(v.element_count()) != n || coef.element_count() != 10) {
    return ffi::Error::InvalidArgument("hetjax adam: operand sizes differ");
  }
  const int mom_kind = kind_of(m.element_type());
  if (mom_kind < 0 || mom_kind > 1 || kind_of(v.element_type()) != mom_kind ||
      kind_of(mo->element_type()) != mom_kind || kind_of(vo->element_type()) != mom_kind) {
    return ffi::Error::InvalidArgument("hetjax adam: the moments must be all f32 or all bf16");
  }
  const size_t num_pages = pages.size(), num_grad_pages = grads.size();
  if (num_pages == 0 || num_pages > kMaxPages || num_grad_pages == 0 ||
      num_grad_pages > kMaxPages) {
    return ffi::Error::InvalidArgument("hetjax adam: 1 to 4096 pages");
  }
  void* page_data[kMaxPages];
  int out_kind = -1;
  int64_t page = 0;
  for (size_t k = 0; k < num_pages; ++k) {
    auto r = pages.get<ffi::AnyBuffer>(k);
    if (!r.has_value()) return r.error();
    ffi::AnyBuffer b = **r;
    const int kind = kind_of(b.element_type());
    if (kind < 0 || (out_kind >= 0 && kind != out_kind)) {
      return ffi::Error::InvalidArgument("hetjax adam: pages must be f32, bf16 or f16");
    }
    if (k == 0) page = static_cast<int64_t>(b.element_count());
    if (static_cast<int64_t>(b.element_count()) != page) {
      return ffi::Error::InvalidArgument("hetjax adam: pages of different sizes");
    }
    out_kind = kind;
    page_data[k] = b.untyped_data();
  }
  if (page * static_cast<int64_t>(num_pages) != n) {
    return ffi::Error::InvalidArgument("hetjax adam: pages do not cover the chunk");
  }
  const void* grad_data[kMaxPages];
  int grad_kind = -1;
  int64_t grad_page = 0;
  for (size_t k = 0; k < num_grad_pages; ++k) {
    auto r = grads.get<ffi::AnyBuffer>(k);
    if (!r.has_value()) return r.error();
    ffi::AnyBuffer b = *r;
    const int kind = kind_of(b.element_type());
    if (kind < 0 || kind > 1 || (grad_kind >= 0 && kind != grad_kind)) {
      return ffi::Error::InvalidArgument("hetjax adam: gradient pages must be f32 or bf16");
    }
    if (k == 0) grad_page = static_cast<int64_t>(b.element_count());
    if (static_cast<int64_t>(b.element_count()) != grad_page) {
      return ffi::Error::InvalidArgument("hetjax adam: gradient pages of different sizes");
    }
    grad_kind = kind;
    grad_data[k] = b.untyped_data();
  }
  if (grad_page * static_cast<int64_t>(num_grad_pages) != n) {
    return ffi::Error::InvalidArgument("hetjax adam: gradient pages do not cover the chunk");
  }
  const float* k = coef.typed_data();
  const Coef c{k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7], k[8], k[9], weight_decay};
  const Chunk chunk{p.typed_data(),     m.untyped_data(),   v.untyped_data(),
                    grad_data,          grad_page,          po->typed_data(),
                    mo->untyped_data(), vo->untyped_data(), page_data,
                    page,               num_decay};

  // Split over the intra-op pool: parts of whole cache lines, the last one run here.
  int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), n / 65536));
  const int64_t step = ((n + parts - 1) / parts + 15) / 16 * 16;
  parts = (n + step - 1) / step;
  std::mutex mu;
  std::condition_variable cv;
  int64_t left = parts - 1;
  for (int64_t t = 0; t + 1 < parts; ++t) {
    const int64_t lo = t * step, hi = std::min(n, lo + step);
    pool.Schedule([&, lo, hi] {
      adam_range(out_kind, grad_kind, mom_kind, c, chunk, lo, hi);
      std::lock_guard<std::mutex> lock(mu);
      if (--left == 0) cv.notify_one();
    });
  }
  adam_range(out_kind, grad_kind, mom_kind, c, chunk, (parts - 1) * step, n);
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return left == 0; });
  return ffi::Error::Success();
}


// -- int8 moments (``optimizer.state_dtype=int8``, hetjax/optimizer/moments.py) --------
//
// mu and nu as blocks of kBlock elements from each page's start, each block its codes
// (one byte an element) and an f32 scale, its absolute maximum. A signed code (mu) c
// stands for sign(c) * 2**((|c| - 127) / 8) * scale (c = 0: 0); an unsigned one (nu,
// the byte k) for 2**((k - 255) / 8) * scale (k = 0: 0). A block is dequantized as it is
// read, updated in float32 as above (each element's new moments kept in a block-sized
// buffer, the params' update from the unrounded new moments), and requantized as it is
// written: |x| / scale (scale 0: 1) to the nearest code entry, ties to the smaller (the
// number of midpoints between neighbouring entries below it), a positive nu at least
// code 1. One pass over memory: the block's buffers stay in L1.

constexpr int64_t kBlock = 2048;

struct Code {
  float values[256];  // magnitude by index (index 0: 0)
  float mids[255];    // mids[i]: between values[i] and values[i + 1]
  int8_t octave[256];  // round(8 log2(1 + m)) by the top 8 bits of a mantissa m
  int top;
  explicit Code(int t) : top(t) {
    double v[256];
    for (int k = 0; k <= t; ++k) v[k] = k == 0 ? 0.0 : std::pow(2.0, (k - t) / 8.0);
    for (int k = 0; k <= t; ++k) values[k] = static_cast<float>(v[k]);
    for (int k = 0; k < t; ++k) mids[k] = static_cast<float>((v[k] + v[k + 1]) / 2);
    for (int i = 0; i < 256; ++i) octave[i] = std::lround(8 * std::log2(1 + (i + 0.5) / 256));
  }
  // The number of midpoints below y (0 <= y <= 1): estimated from y's exponent and the
  // top of its mantissa (8 entries an octave), then moved until
  // mids[k - 1] < y <= mids[k]: the midpoints decide, the estimate only saves steps.
  int nearest(float y) const {
    uint32_t bits;
    std::memcpy(&bits, &y, 4);
    const int exponent = static_cast<int>(bits >> 23) - 127;
    int k = bits == 0 ? 0 : top + 8 * exponent + octave[(bits >> 15) & 0xff];
    k = std::min(std::max(k, 0), top);
    k += k < top && y > mids[k];  // the estimate is within one entry: one step each way
    k -= k > 0 && y <= mids[k - 1];
    while (k < top && y > mids[k]) ++k;  // (never taken: the guarantee, not the work)
    while (k > 0 && y <= mids[k - 1]) --k;
    return k;
  }
};

const Code kSigned(127), kUnsigned(255);

inline float dequant_signed(int8_t c, float scale) {
  const float value = (c < 0 ? -1.0f : 1.0f) * kSigned.values[c < 0 ? -c : c];
  return value * scale;
}

inline float dequant_unsigned(uint8_t c, float scale) { return kUnsigned.values[c] * scale; }

struct Int8Chunk {
  float* p;
  int8_t* m;
  float* ms;
  uint8_t* v;
  float* vs;
  const void* const* grads;
  int64_t grad_page;
  void* const* pages;
  int64_t page, num_decay;
};

// Elements [lo, hi) of one block (hi - lo <= kBlock, within one page), its scales the
// b-th, in place: the update over runs that lie in one gradient page each (no division
// an element), keeping the new moments and their maxima, then the requantization.
template <int kKind, int kGrad>
void int8_block(const Coef& c, const Int8Chunk& k, int64_t lo, int64_t hi, int64_t b) {
  float mnew[kBlock], vnew[kBlock];
  const float ms = k.ms[b], vs = k.vs[b];
  const int64_t op = lo / k.page;
  void* out = static_cast<char*>(k.pages[op]) + (lo - op * k.page) * kOutBytes[kKind];
  float mmax = 0, vmax = 0;
  for (int64_t run = lo; run < hi;) {
    const int64_t gp = run / k.grad_page;
    const int64_t end = std::min(hi, (gp + 1) * k.grad_page);
    const void* g = static_cast<const char*>(k.grads[gp]) + (run - gp * k.grad_page) * kGradBytes[kGrad];
    const int64_t len = end - run, at = run - lo, decayed = std::max<int64_t>(0, std::min(end, k.num_decay) - run);
    float* p = k.p + run;
    const int8_t* m = k.m + run;
    const uint8_t* v = k.v + run;
    for (int64_t i = 0; i < len; ++i) {
      const float gi = load<kGrad>(g, i) * c.scale;
      const float mi = c.c1 * gi + c.b1 * dequant_signed(m[i], ms);
      const float vi = c.c2 * (gi * gi) + c.b2 * dequant_unsigned(v[i], vs);
      float u = (mi / c.bc1) / (std::sqrt(vi / c.bc2 + c.eps_root) + c.eps);
      if (i < decayed) u = u + c.wd * p[i];
      const float pi = p[i] + c.step * u;
      p[i] = pi;
      store<kKind>(out, at + i, pi);
      mnew[at + i] = mi;
      vnew[at + i] = vi;
      mmax = std::max(mmax, std::fabs(mi));
      vmax = std::max(vmax, std::fabs(vi));
    }
    run = end;
  }
  k.ms[b] = mmax;
  k.vs[b] = vmax;
  const float msafe = mmax == 0 ? 1.0f : mmax, vsafe = vmax == 0 ? 1.0f : vmax;
  int8_t* m = k.m + lo;
  uint8_t* v = k.v + lo;
  for (int64_t i = 0; i < hi - lo; ++i) {
    const float mi = mnew[i];
    const int km = kSigned.nearest(std::fabs(mi) / msafe);
    m[i] = static_cast<int8_t>(mi < 0 ? -km : km);
    const float yv = std::fabs(vnew[i]) / vsafe;
    const int kv = kUnsigned.nearest(yv);
    v[i] = static_cast<uint8_t>(yv > 0 ? std::max(kv, 1) : 0);
  }
}

// Blocks per page: from each page's first element, a short last one where the page is
// not whole blocks (so a page's blocks do not depend on where the chunk starts).
inline int64_t page_blocks(int64_t page) { return (page + kBlock - 1) / kBlock; }

// Pages [lo, hi) (elements, whole pages) of the chunk.
template <int kKind, int kGrad>
void int8_range(const Coef& c, const Int8Chunk& k, int64_t lo, int64_t hi) {
  for (int64_t start = lo; start < hi; start += k.page) {
    int64_t b = start / k.page * page_blocks(k.page);
    for (int64_t a = start; a < start + k.page; a += kBlock, ++b) {
      int8_block<kKind, kGrad>(c, k, a, std::min(start + k.page, a + kBlock), b);
    }
  }
}

void int8_range(int kind, int grad_kind, const Coef& c, const Int8Chunk& k, int64_t lo,
                int64_t hi) {
  if (grad_kind == 0) {
    if (kind == 0) int8_range<0, 0>(c, k, lo, hi);
    else if (kind == 1) int8_range<1, 0>(c, k, lo, hi);
    else int8_range<2, 0>(c, k, lo, hi);
  } else {
    if (kind == 0) int8_range<0, 1>(c, k, lo, hi);
    else if (kind == 1) int8_range<1, 1>(c, k, lo, hi);
    else int8_range<2, 1>(c, k, lo, hi);
  }
}

// How many runs of whole pages (``*step`` elements each, the last shorter) the chunk
// splits into for ``threads`` threads.
int64_t int8_parts(int64_t n, int64_t page, int64_t threads, int64_t* step) {
  int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, n / 65536));
  *step = ((n + parts - 1) / parts + page - 1) / page * page;
  return (n + *step - 1) / *step;
}

// Pages of one f32/bf16/f16 kind from remaining FFI arguments or results: their data,
// kind and size (all equal), or an error.
template <typename Get>
ffi::Error page_list(size_t count, Get get, void** data, int* kind, int64_t* size, int max_kind) {
  if (count == 0 || count > kMaxPages) return ffi::Error::InvalidArgument("hetjax adam: 1 to 4096 pages");
  *kind = -1;
  for (size_t i = 0; i < count; ++i) {
    std::optional<ffi::AnyBuffer> got = get(i);
    if (!got) return ffi::Error::InvalidArgument("hetjax adam: a page is not a buffer");
    ffi::AnyBuffer b = *got;
    const int k = kind_of(b.element_type());
    if (k < 0 || k > max_kind || (*kind >= 0 && k != *kind)) {
      return ffi::Error::InvalidArgument("hetjax adam: pages of one dtype, f32, bf16 (or f16)");
    }
    if (i == 0) *size = static_cast<int64_t>(b.element_count());
    if (static_cast<int64_t>(b.element_count()) != *size) {
      return ffi::Error::InvalidArgument("hetjax adam: pages of different sizes");
    }
    *kind = k;
    data[i] = b.untyped_data();
  }
  return ffi::Error::Success();
}

// The int8 update through XLA: operands master, mu codes, mu scales, nu codes, nu
// scales, coef and the gradient's pages; results master, mu codes, mu scales, nu codes,
// nu scales (aliased to the operands or not: copied first where not) and the params'
// pages.
ffi::Error AdamInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::AnyBuffer m,
                        ffi::Buffer<ffi::F32> ms, ffi::AnyBuffer v, ffi::Buffer<ffi::F32> vs,
                        ffi::Buffer<ffi::F32> coef, ffi::RemainingArgs grads,
                        ffi::ResultBuffer<ffi::F32> po, ffi::Result<ffi::AnyBuffer> mo,
                        ffi::ResultBuffer<ffi::F32> mso, ffi::Result<ffi::AnyBuffer> vo,
                        ffi::ResultBuffer<ffi::F32> vso, ffi::RemainingRets pages,
                        int64_t num_decay, float weight_decay) {
  const int64_t n = p.element_count();
  if (static_cast<int64_t>(m.element_count()) != n || static_cast<int64_t>(v.element_count()) != n ||
      coef.element_count() != 10 ||
      m.element_type() != ffi::DataType::S8 || v.element_type() != ffi::DataType::S8) {
    return ffi::Error::InvalidArgument("hetjax adam int8: operand sizes or dtypes");
  }
  void* page_data[kMaxPages];
  void* grad_data[kMaxPages];
  int out_kind, grad_kind;
  int64_t page, grad_page;
  auto out = [&](size_t i) -> std::optional<ffi::AnyBuffer> {
    auto r = pages.get<ffi::AnyBuffer>(i);
    if (!r.has_value()) return std::nullopt;
    return **r;
  };
  auto in = [&](size_t i) -> std::optional<ffi::AnyBuffer> {
    auto r = grads.get<ffi::AnyBuffer>(i);
    if (!r.has_value()) return std::nullopt;
    return *r;
  };
  if (auto e = page_list(pages.size(), out, page_data, &out_kind, &page, 2); e.failure()) return e;
  if (auto e = page_list(grads.size(), in, grad_data, &grad_kind, &grad_page, 1); e.failure()) return e;
  if (page * static_cast<int64_t>(pages.size()) != n ||
      grad_page * static_cast<int64_t>(grads.size()) != n) {
    return ffi::Error::InvalidArgument("hetjax adam int8: pages do not cover the chunk");
  }
  const int64_t blocks = n / page * page_blocks(page);
  if (static_cast<int64_t>(ms.element_count()) != blocks ||
      static_cast<int64_t>(vs.element_count()) != blocks) {
    return ffi::Error::InvalidArgument("hetjax adam int8: a scale per block of each page");
  }
  // the update runs in place on the results: the operands copied there unless aliased
  auto copy = [](void* to, const void* from, size_t bytes) {
    if (to != from) std::memcpy(to, from, bytes);
  };
  copy(po->typed_data(), p.typed_data(), n * 4);
  copy(mo->untyped_data(), m.untyped_data(), n);
  copy(vo->untyped_data(), v.untyped_data(), n);
  copy(mso->typed_data(), ms.typed_data(), blocks * 4);
  copy(vso->typed_data(), vs.typed_data(), blocks * 4);
  const float* k = coef.typed_data();
  const Coef c{k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7], k[8], k[9], weight_decay};
  const Int8Chunk chunk{po->typed_data(), static_cast<int8_t*>(mo->untyped_data()),
                        mso->typed_data(), static_cast<uint8_t*>(vo->untyped_data()),
                        vso->typed_data(), const_cast<const void* const*>(grad_data),
                        grad_page, page_data, page, num_decay};
  int64_t step;
  const int64_t parts = int8_parts(n, page, pool.num_threads(), &step);
  std::mutex mu;
  std::condition_variable cv;
  int64_t left = parts - 1;
  for (int64_t t = 0; t + 1 < parts; ++t) {
    const int64_t lo = t * step, hi = std::min(n, lo + step);
    pool.Schedule([&, lo, hi] {
      int8_range(out_kind, grad_kind, c, chunk, lo, hi);
      std::lock_guard<std::mutex> lock(mu);
      if (--left == 0) cv.notify_one();
    });
  }
  int8_range(out_kind, grad_kind, c, chunk, (parts - 1) * step, n);
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return left == 0; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HetjaxAdam, AdamImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_decay")
                                  .Attr<float>("weight_decay"));

// The same pass called directly on host buffers (ctypes; no XLA buffers): the update of
// a streamed stage in the NVMe tier's pooled I/O buffers, in place. ``p`` is the fp32
// master; ``state_kind`` the dtype of mu and nu (the optimizer's state format): 0, f32,
// or 1, bf16; another is refused (3). ``grads`` holds
// ``n / grad_page`` pointers to the gradient's pages (``grad_kind`` 0: f32, 1: bf16),
// ``pages`` ``n / page`` pointers to the compute-dtype pages (``out_kind`` 0: f32, 1:
// bf16, 2: f16); the work is split over ``threads`` threads, the last part run by the
// caller.
extern "C" int HetjaxAdamHost(float* p, void* m, void* v, int state_kind,
                              const void* const* grads, int64_t grad_page, int grad_kind,
                              const float* coef, float weight_decay, int64_t n,
                              int64_t num_decay, int64_t page, int out_kind, void* const* pages,
                              int threads) {
  if (state_kind < 0 || state_kind > 1) return 3;
  if (n <= 0 || page <= 0 || n % page != 0 || out_kind < 0 || out_kind > 2) return 1;
  if (grad_page <= 0 || n % grad_page != 0 || grad_kind < 0 || grad_kind > 1) return 2;
  const float* k = coef;
  const Coef c{k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7], k[8], k[9], weight_decay};
  const Chunk chunk{p, m, v, grads, grad_page, p, m, v, pages, page, num_decay};
  int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, n / 65536));
  const int64_t step = ((n + parts - 1) / parts + 15) / 16 * 16;
  parts = (n + step - 1) / step;
  std::vector<std::thread> workers;
  for (int64_t t = 0; t + 1 < parts; ++t) {
    const int64_t lo = t * step, hi = std::min(n, lo + step);
    workers.emplace_back(
        [&, lo, hi] { adam_range(out_kind, grad_kind, state_kind, c, chunk, lo, hi); });
  }
  adam_range(out_kind, grad_kind, state_kind, c, chunk, (parts - 1) * step, n);
  for (auto& w : workers) w.join();
  return 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HetjaxAdamInt8, AdamInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_decay")
                                  .Attr<float>("weight_decay"));

// The int8 pass on host buffers, in place (``HetjaxAdamHost``'s, with each moment's
// codes and its scales: ceil(page / kBlock) a page, blocks from each page's first
// element).
extern "C" int HetjaxAdamInt8Host(float* p, int8_t* m, float* ms, uint8_t* v, float* vs,
                                  const void* const* grads, int64_t grad_page, int grad_kind,
                                  const float* coef, float weight_decay, int64_t n,
                                  int64_t num_decay, int64_t page, int out_kind,
                                  void* const* pages, int threads) {
  if (n <= 0 || page <= 0 || n % page != 0 || out_kind < 0 || out_kind > 2) return 1;
  if (grad_page <= 0 || n % grad_page != 0 || grad_kind < 0 || grad_kind > 1) return 2;
  const float* k = coef;
  const Coef c{k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7], k[8], k[9], weight_decay};
  const Int8Chunk chunk{p, m, ms, v, vs, grads, grad_page, pages, page, num_decay};
  int64_t step;
  const int64_t parts = int8_parts(n, page, threads, &step);
  std::vector<std::thread> workers;
  for (int64_t t = 0; t + 1 < parts; ++t) {
    const int64_t lo = t * step, hi = std::min(n, lo + step);
    workers.emplace_back([&, lo, hi] { int8_range(out_kind, grad_kind, c, chunk, lo, hi); });
  }
  int8_range(out_kind, grad_kind, c, chunk, (parts - 1) * step, n);
  for (auto& w : workers) w.join();
  return 0;
}
