// The first pass of Haar GWT with the built-in Adam, as an XLA FFI custom call
// for the CPU (see optax_gwt/kernels/cpu_ffi.py, which compiles and registers it).
//
// G is viewed as (outer, n, inner) and cut along n into blocks of B rows (the
// last one may be short: zero padding). For each block row r of the
// approximation, with coefficients c = (1 - b1, b1, 1 - b2, b2, eps, 1/sqrt(B)):
//   a  = (sum of the block's rows of G) / sqrt(B)
//   m' = (1 - b1) a + b1 m,   v' = (1 - b2) a^2 + b2 v
//   sq = sum over everything of (m' / (sqrt(v') + eps))^2
// in one read of G, which XLA on the CPU needs three passes for (m and v are
// two fusions that each read G; the norm is a separate reduction).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 256;               // columns kept in registers/L1 at once
constexpr int64_t kChunkElements = 1 << 16;  // work per task on the thread pool

template <typename T>
struct Job {
  const T* g;
  const T* m_in;
  const T* v_in;
  T* m_out;
  T* v_out;
  int64_t n, inner, block, blocks;
  T c[6];
};

// The moments of `w` consecutive approximation entries from `at` on, given
// their block sums `a`; adds each entry's squared step to `acc`.
template <typename T>
inline void Moments(const Job<T>& job, const T* a, int64_t w, int64_t at, T* acc) {
  const T one_minus_b1 = job.c[0], b1 = job.c[1], one_minus_b2 = job.c[2], b2 = job.c[3];
  const T eps = job.c[4], scale = job.c[5];
  const T* m_in = job.m_in + at;
  const T* v_in = job.v_in + at;
  T* m_out = job.m_out + at;
  T* v_out = job.v_out + at;
  for (int64_t j = 0; j < w; ++j) {
    const T x = a[j] * scale;
    const T m = one_minus_b1 * x + b1 * m_in[j];
    const T v = one_minus_b2 * (x * x) + b2 * v_in[j];
    m_out[j] = m;
    v_out[j] = v;
    const T u = m / (std::sqrt(v) + eps);
    acc[j] += u * u;
  }
}

// Block rows [begin, end) of the (outer * blocks) rows; returns their sum of squares.
template <typename T>
double RunRows(const Job<T>& job, int64_t begin, int64_t end) {
  T a[kTile];
  T acc[kTile];
  for (int64_t j = 0; j < kTile; ++j) acc[j] = 0;
  if (job.inner == 1) {
    // The transform axis is the last one: a tile is consecutive blocks of one row.
    for (int64_t r = begin; r < end;) {
      const int64_t o = r / job.blocks, b = r % job.blocks;
      const int64_t w = std::min({kTile, end - r, job.blocks - b});
      const T* g = job.g + o * job.n;
      for (int64_t t = 0; t < w; ++t) {
        const int64_t row0 = (b + t) * job.block;
        const int64_t rows = std::min(job.block, job.n - row0);
        T sum = g[row0];
        for (int64_t k = 1; k < rows; ++k) sum += g[row0 + k];
        a[t] = sum;
      }
      Moments(job, a, w, r, acc);
      r += w;
    }
  } else {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t o = r / job.blocks;
      const int64_t row0 = (r % job.blocks) * job.block;
      const int64_t rows = std::min(job.block, job.n - row0);
      const T* g = job.g + (o * job.n + row0) * job.inner;
      for (int64_t j0 = 0; j0 < job.inner; j0 += kTile) {
        const int64_t w = std::min(kTile, job.inner - j0);
        const T* g0 = g + j0;
        for (int64_t j = 0; j < w; ++j) a[j] = g0[j];
        for (int64_t k = 1; k < rows; ++k) {
          const T* gk = g0 + k * job.inner;
          for (int64_t j = 0; j < w; ++j) a[j] += gk[j];
        }
        Moments(job, a, w, r * job.inner + j0, acc);
      }
    }
  }
  double total = 0;
  for (int64_t j = 0; j < kTile; ++j) total += acc[j];
  return total;
}

// Runs RunRows over all rows in chunks, on the caller and the pool's threads;
// the chunks' sums are added in chunk order, so the result does not depend on
// which thread ran what, nor on how many threads there are.
template <typename T>
double RunAll(const Job<T>& job, int64_t total_rows, ffi::ThreadPool& pool) {
  const int64_t rows_per_chunk = std::max<int64_t>(1, kChunkElements / std::max<int64_t>(1, job.inner * job.block));
  const int64_t chunks = (total_rows + rows_per_chunk - 1) / rows_per_chunk;
  const int64_t threads = std::min<int64_t>(pool.num_threads(), chunks - 1);
  if (threads <= 0) {
    double total = 0;
    for (int64_t begin = 0; begin < total_rows; begin += rows_per_chunk) {
      total += RunRows(job, begin, std::min(total_rows, begin + rows_per_chunk));
    }
    return total;
  }

  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
    std::vector<double> partial;
  };
  auto shared = std::make_shared<Shared>();
  shared->partial.assign(chunks, 0.0);
  auto work = [shared, job, rows_per_chunk, chunks, total_rows]() {
    for (int64_t c; (c = shared->next.fetch_add(1)) < chunks;) {
      const int64_t begin = c * rows_per_chunk;
      shared->partial[c] = RunRows(job, begin, std::min(total_rows, begin + rows_per_chunk));
      if (shared->done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->cv.notify_all();
      }
    }
  };
  for (int64_t t = 0; t < threads; ++t) pool.Schedule([work] { work(); });
  work();  // a task that never gets a thread finds no chunk left and does nothing
  {
    std::unique_lock<std::mutex> lock(shared->mu);
    shared->cv.wait(lock, [&] { return shared->done.load() == chunks; });
  }
  double total = 0;
  for (double p : shared->partial) total += p;
  return total;
}

template <ffi::DataType D>
ffi::Error HaarAdamMoments(ffi::ThreadPool pool, ffi::Buffer<D> g, ffi::Buffer<D> m, ffi::Buffer<D> v,
                           ffi::Buffer<D> coefficients, ffi::ResultBuffer<D> m_out, ffi::ResultBuffer<D> v_out,
                           ffi::ResultBuffer<D> sq, int64_t outer, int64_t n, int64_t inner,
                           int64_t block) {
  using T = ffi::NativeType<D>;
  // G is (outer, n, inner) and the moments (outer, ceil(n / block), inner) in
  // row-major order, whatever their rank: the transform axis and the sizes
  // before and after it are given as attributes.
  const int64_t blocks = (n + block - 1) / block;
  if (block < 1 || n < 1 || outer < 0 || inner < 0 || g.element_count() != static_cast<size_t>(outer * n * inner) ||
      m.element_count() != static_cast<size_t>(outer * blocks * inner) || v.element_count() != m.element_count() ||
      coefficients.element_count() != 6) {
    return ffi::Error::InvalidArgument(
        "gwt_haar_adam_moments: expected G of outer * n * inner entries, moments of outer * ceil(n / block) * inner, "
        "6 coefficients");
  }
  Job<T> job{g.typed_data(), m.typed_data(), v.typed_data(), m_out->typed_data(), v_out->typed_data(),
             n, inner, block, blocks, {}};
  for (int i = 0; i < 6; ++i) job.c[i] = coefficients.typed_data()[i];
  *sq->typed_data() = static_cast<T>(RunAll(job, outer * blocks, pool));
  return ffi::Error::Success();
}

}  // namespace

#define GWT_DEFINE(NAME, D)                                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, HaarAdamMoments<D>,                                    \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<D>>()                                   \
                                    .Arg<ffi::Buffer<D>>()                                   \
                                    .Arg<ffi::Buffer<D>>()                                   \
                                    .Arg<ffi::Buffer<D>>()                                   \
                                    .Ret<ffi::Buffer<D>>()                                   \
                                    .Ret<ffi::Buffer<D>>()                                   \
                                    .Ret<ffi::Buffer<D>>()                                   \
                                    .Attr<int64_t>("outer")                                  \
                                    .Attr<int64_t>("n")                                      \
                                    .Attr<int64_t>("inner")                                  \
                                    .Attr<int64_t>("block"));

GWT_DEFINE(GwtHaarAdamMomentsF32, ffi::F32)
GWT_DEFINE(GwtHaarAdamMomentsF64, ffi::F64)
