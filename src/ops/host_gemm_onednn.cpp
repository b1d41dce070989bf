// The host GEMM's oneDNN backend: one matmul primitive per (shape, transposes, dtype, alpha, beta,
// epilogue), created on first use and cached per thread (least recently used out beyond a bound),
// with the bias and ReLU as post-ops of the matmul and 16-bit inputs accumulated in float32 (a GELU
// epilogue is the dispatcher's, host_gemm.cpp).
// oneDNN runs on the calling thread only: its OpenMP runtime gets one thread for this thread, and
// its scratchpad is the thread's own, so host devices on their worker threads never share one.
#include "ops/host_gemm.hpp"

#include <oneapi/dnnl/dnnl.hpp>

#include <mgpu/core/error.hpp>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if MGPU_ONEDNN_OPENMP
#include <omp.h>
#endif

namespace mgpu::ops::host {
namespace {

using dnnl::memory;

// Everything a primitive depends on; pointers are bound per call.
struct Key {
  DType dtype;
  bool transpose_a, transpose_b, bias, relu;
  std::int64_t m, n, k;
  std::uint32_t alpha_bits, beta_bits;
  bool operator==(Key const&) const = default;
};

struct KeyHash {
  std::size_t operator()(Key const& key) const noexcept {
    std::size_t h = static_cast<std::size_t>(key.dtype) | (std::size_t{key.transpose_a} << 2) | (std::size_t{key.transpose_b} << 3) |
                    (std::size_t{key.bias} << 4) | (std::size_t{key.relu} << 5);
    for (std::uint64_t v : {std::uint64_t(key.m), std::uint64_t(key.n), std::uint64_t(key.k), std::uint64_t{key.alpha_bits} << 32 | key.beta_bits})
      h = (h ^ v) * 0x100000001B3ull + (h >> 29);
    return h;
  }
};

std::uint32_t bits(float v) {
  std::uint32_t b = 0;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

memory::data_type onednn_type(DType dtype) {
  switch (dtype) {
    case DType::bfloat16: return memory::data_type::bf16;
    case DType::float16: return memory::data_type::f16;
    case DType::int32: return memory::data_type::s32;
    case DType::float32: break;
  }
  return memory::data_type::f32;
}

// A cached primitive with its argument memories (their data handles are set per call); none when
// oneDNN does not implement the key on this CPU.
struct Entry {
  bool implemented = false;
  dnnl::matmul primitive;
  std::unordered_map<int, memory> args;
};

// Creating engines and primitives reads and writes oneDNN's process-wide state (its primitive cache
// and CPU dispatch), whose locks are set up inside oneDNN where ThreadSanitizer cannot see them; one
// lock around creation (rare: on a cache miss) makes that order visible. Execution takes no lock.
std::mutex& creation_mutex() {
  static std::mutex mutex;
  return mutex;
}

dnnl::engine make_engine() {
  std::lock_guard const lock(creation_mutex());
  return dnnl::engine(dnnl::engine::kind::cpu, 0);
}

// The calling thread's engine, stream, scratchpad and primitive cache.
class ThreadContext {
 public:
  ThreadContext() {
#if MGPU_ONEDNN_OPENMP
    omp_set_num_threads(1);  // this thread's OpenMP regions (oneDNN's) run on this thread alone
#endif
  }

  bool run(GemmCall const& g) {
    Key const key{g.dtype, g.transpose_a, g.transpose_b, g.bias != nullptr, g.relu, g.m, g.n, g.k, bits(g.alpha), bits(g.beta)};
    Entry& entry = find_or_create(key);
    if (!entry.implemented) return false;
    entry.args.at(DNNL_ARG_SRC).set_data_handle(const_cast<void*>(g.a));
    entry.args.at(DNNL_ARG_WEIGHTS).set_data_handle(const_cast<void*>(g.b));
    entry.args.at(DNNL_ARG_DST).set_data_handle(g.c);
    if (g.bias != nullptr) entry.args.at(DNNL_ARG_BIAS).set_data_handle(const_cast<void*>(g.bias));
    memory& scratch = entry.args.at(DNNL_ARG_SCRATCHPAD);
    std::size_t const need = scratch.get_desc().get_size();
    if (scratchpad_size_ < need) {
      std::size_t const size = (need + 4095) / 4096 * 4096;
      scratchpad_.reset(static_cast<std::byte*>(std::aligned_alloc(4096, size)));
      if (!scratchpad_) throw Error(Errc::out_of_memory, "host GEMM: a oneDNN scratchpad of " + std::to_string(size) + " bytes");
      scratchpad_size_ = size;
    }
    scratch.set_data_handle(need > 0 ? scratchpad_.get() : nullptr);
    try {
      entry.primitive.execute(stream_, entry.args);
      stream_.wait();
    } catch (dnnl::error const& e) {
      throw Error(Errc::device, std::string("host GEMM: oneDNN's matmul failed: ") + e.what());
    }
    return true;
  }

 private:
  static constexpr std::size_t capacity = 64;

  Entry& find_or_create(Key const& key) {
    if (auto it = index_.find(key); it != index_.end()) {
      entries_.splice(entries_.begin(), entries_, it->second);  // most recently used first
      return it->second->second;
    }
    if (entries_.size() == capacity) {
      index_.erase(entries_.back().first);
      entries_.pop_back();
    }
    entries_.emplace_front(key, create(key));
    index_.emplace(key, entries_.begin());
    return entries_.front().second;
  }

  Entry create(Key const& key) const {
    memory::data_type const type = onednn_type(key.dtype);
    // Row-major [rows, cols] (transposed: the same memory read as the transpose of [cols, rows]).
    auto const matrix = [&](std::int64_t rows, std::int64_t cols, bool transposed) {
      return memory::desc({rows, cols}, type, transposed ? memory::dims{1, rows} : memory::dims{cols, 1});
    };
    memory::desc const a = matrix(key.m, key.k, key.transpose_a);
    memory::desc const b = matrix(key.k, key.n, key.transpose_b);
    memory::desc const c = matrix(key.m, key.n, false);
    memory::desc const bias = matrix(1, key.n, false);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (key.alpha_bits != bits(1.0f)) {
      float alpha = 0;
      std::memcpy(&alpha, &key.alpha_bits, sizeof alpha);
      attr.set_output_scales(0, {alpha});
    }
    dnnl::post_ops post;
    if (key.beta_bits != bits(0.0f)) {
      float beta = 0;
      std::memcpy(&beta, &key.beta_bits, sizeof beta);
      post.append_sum(beta);
    }
    if (key.relu) post.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
    attr.set_post_ops(post);
    Entry entry;
    std::lock_guard const lock(creation_mutex());
    try {
      dnnl::matmul::primitive_desc const pd(key.bias ? dnnl::matmul::desc(a, b, bias, c) : dnnl::matmul::desc(a, b, c), attr, engine_);
      entry.primitive = dnnl::matmul(pd);
      entry.args = {{DNNL_ARG_SRC, memory(a, engine_, nullptr)},
                    {DNNL_ARG_WEIGHTS, memory(b, engine_, nullptr)},
                    {DNNL_ARG_DST, memory(c, engine_, nullptr)},
                    {DNNL_ARG_SCRATCHPAD, memory(pd.scratchpad_desc(), engine_, nullptr)}};
      if (key.bias) entry.args.emplace(DNNL_ARG_BIAS, memory(bias, engine_, nullptr));
      entry.implemented = true;
    } catch (dnnl::error const& e) {
      if (e.status != dnnl_unimplemented)
        throw Error(Errc::device, std::string("host GEMM: oneDNN could not create a matmul primitive: ") + e.what());
    }
    return entry;
  }

  dnnl::engine engine_ = make_engine();
  dnnl::stream stream_{engine_};
  struct Free {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<std::byte[], Free> scratchpad_;
  std::size_t scratchpad_size_ = 0;
  std::list<std::pair<Key, Entry>> entries_;
  std::unordered_map<Key, std::list<std::pair<Key, Entry>>::iterator, KeyHash> index_;
};

}  // namespace

bool onednn_gemm(GemmCall const& call) {
  if (call.m == 0 || call.n == 0 || call.k == 0) return false;  // oneDNN wants every dimension
  thread_local ThreadContext context;
  return context.run(call);
}

}  // namespace mgpu::ops::host
