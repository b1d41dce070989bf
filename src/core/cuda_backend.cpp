// The CUDA runtime calls behind cuda_backend.hpp.
#include "core/cuda_backend.hpp"
#include "core/cuda_device_scope.hpp"

#include <cuda.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include <mgpu/config.hpp>
#include <mgpu/core/error.hpp>

#if MGPU_NCCL_ENABLED
#include <nccl.h>
#endif

namespace mgpu::detail::cuda {
namespace {
cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }
cudaEvent_t as_event(void* event) { return static_cast<cudaEvent_t>(event); }

}  // namespace

int device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no GPU: clear the sticky status, report none
    return 0;
  }
  return count;
}

DeviceProperties properties(int ordinal) {
  cudaDeviceProp prop{};
  MGPU_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal));
  int clock_khz = 0;
  MGPU_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, ordinal));
  DeviceProperties out;
  out.name = prop.name;
  out.memory_bytes = prop.totalGlobalMem;
  out.compute_units = prop.multiProcessorCount;
  // 128 float32 lanes per SM issuing one FMA (2 FLOP) per clock: the usual peak estimate.
  out.throughput_gflops = 2.0 * 128.0 * prop.multiProcessorCount * (clock_khz * 1e-6);
  return out;
}

std::string pci_bus_id(int ordinal) {
  char id[32] = {};
  MGPU_CUDA_CHECK(cudaDeviceGetPCIBusId(id, static_cast<int>(sizeof id), ordinal));
  return id;
}

bool can_access_peer(int ordinal, int peer) {
  int can = 0;
  MGPU_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, ordinal, peer));
  return can != 0;
}

void set_device(int ordinal) { MGPU_CUDA_CHECK(cudaSetDevice(ordinal)); }

void* stream_create(int ordinal) {
  DeviceScope scope(ordinal);
  cudaStream_t stream = nullptr;
  MGPU_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return stream;
}

void stream_destroy(void* stream) noexcept {
  MGPU_CUDA_CHECK_NO_THROW(cudaStreamSynchronize(as_stream(stream)));
  MGPU_CUDA_CHECK_NO_THROW(cudaStreamDestroy(as_stream(stream)));
}

void stream_synchronize(void* stream) { MGPU_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream))); }

bool stream_query(void* stream) {
  cudaError_t const status = cudaStreamQuery(as_stream(stream));
  if (status == cudaErrorNotReady) return false;
  MGPU_CUDA_CHECK(status);
  return true;
}

void launch_host_func(void* stream, void (*fn)(void*), void* arg) {
  MGPU_CUDA_CHECK(cudaLaunchHostFunc(as_stream(stream), fn, arg));
}

void* event_create(int ordinal) {
  DeviceScope scope(ordinal);
  cudaEvent_t event = nullptr;
  MGPU_CUDA_CHECK(cudaEventCreate(&event));
  return event;
}

void* event_create_untimed(int ordinal) {
  DeviceScope scope(ordinal);
  cudaEvent_t event = nullptr;
  MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

namespace {
// Released words are kept for reuse instead of freed: a word's last owner may go inside a CUDA
// host callback, where no CUDA call is allowed. Words released while streams may still use them
// are held with events after that use, and become spare once the events have completed.
struct HeldWords {
  std::vector<std::uint32_t*> words;
  std::vector<void*> after;
};
struct HostWordPool {
  std::mutex mutex;
  std::vector<std::uint32_t*> spare;
  std::vector<HeldWords> held;
};
HostWordPool& host_words() {
  static auto* const pool = new HostWordPool;  // never destroyed: callbacks may run at exit
  return *pool;
}

// True once no stream work before the events can still touch the words (a failed GPU runs none).
bool events_completed(std::vector<void*> const& events) noexcept {
  return std::all_of(events.begin(), events.end(), [](void* event) {
    cudaError_t const status = cudaEventQuery(as_event(event));
    if (status == cudaErrorNotReady) return false;
    if (status != cudaSuccess) (void)cudaGetLastError();
    return true;
  });
}

// Moves the held words whose streams are past them to the spare words; `pool.mutex` is held.
void reclaim_held_words(HostWordPool& pool) {
  for (auto it = pool.held.begin(); it != pool.held.end();) {
    if (!events_completed(it->after)) {
      ++it;
      continue;
    }
    for (void* event : it->after) MGPU_CUDA_CHECK_NO_THROW(cudaEventDestroy(as_event(event)));
    pool.spare.insert(pool.spare.end(), it->words.begin(), it->words.end());
    it = pool.held.erase(it);
  }
}
}  // namespace

std::uint32_t* host_word_create() {
  std::uint32_t* word = nullptr;
  {
    std::lock_guard lock(host_words().mutex);
    if (host_words().spare.empty()) reclaim_held_words(host_words());
    if (!host_words().spare.empty()) {
      word = host_words().spare.back();
      host_words().spare.pop_back();
    }
  }
  if (word == nullptr) {
    void* fresh = nullptr;
    MGPU_CUDA_CHECK(cudaHostAlloc(&fresh, sizeof(std::uint32_t), cudaHostAllocMapped | cudaHostAllocPortable));
    word = static_cast<std::uint32_t*>(fresh);
  }
  std::atomic_ref(*word).store(0, std::memory_order_release);
  return word;
}

void host_word_destroy(std::uint32_t* word) noexcept {
  try {
    std::lock_guard lock(host_words().mutex);
    host_words().spare.push_back(word);
  } catch (...) {  // out of memory for the list: the word is lost, never freed in a callback
  }
}

void host_words_destroy_after(std::vector<std::uint32_t*> words, std::vector<void*> after) noexcept {
  try {
    std::lock_guard lock(host_words().mutex);
    host_words().held.push_back({std::move(words), std::move(after)});
  } catch (...) {  // out of memory for the list: the words and events are lost, never reused early
  }
}

namespace {
// The stream memory operations, cuStreamWaitValue32 and cuStreamWriteValue32, through the runtime's
// driver entry points, so the library needs no link to the driver library.
using StreamValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

StreamValue32 driver_function(char const* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  MGPU_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr)
    throw Error(Errc::device, std::string("the CUDA driver lacks ") + name + " (expected a driver for CUDA 12 or newer)");
  return reinterpret_cast<StreamValue32>(fn);
}

void stream_value32(StreamValue32 fn, char const* name, void* stream, std::uint32_t const* word, std::uint32_t value,
                    unsigned flags) {
  void* device_word = nullptr;
  MGPU_CUDA_CHECK(cudaHostGetDevicePointer(&device_word, const_cast<std::uint32_t*>(word), 0));
  CUresult const status = fn(as_stream(stream), reinterpret_cast<CUdeviceptr>(device_word), value, flags);
  if (status != CUDA_SUCCESS)
    throw Error(Errc::device, std::string(name) + " failed with driver status " + std::to_string(static_cast<int>(status)) +
                                  " (expected a GPU that supports stream memory operations)");
}
}  // namespace

void stream_wait_word(void* stream, std::uint32_t const* word, std::uint32_t value) {
  static StreamValue32 const wait = driver_function("cuStreamWaitValue32");
  stream_value32(wait, "cuStreamWaitValue32", stream, word, value, CU_STREAM_WAIT_VALUE_GEQ);
}

void stream_write_word(void* stream, std::uint32_t* word, std::uint32_t value) {
  static StreamValue32 const write = driver_function("cuStreamWriteValue32");
  stream_value32(write, "cuStreamWriteValue32", stream, word, value, CU_STREAM_WRITE_VALUE_DEFAULT);
}

void event_destroy(void* event) noexcept { MGPU_CUDA_CHECK_NO_THROW(cudaEventDestroy(as_event(event))); }
void event_record(void* event, void* stream) { MGPU_CUDA_CHECK(cudaEventRecord(as_event(event), as_stream(stream))); }
void stream_wait_event(void* stream, void* event) {
  MGPU_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0));
}
void event_synchronize(void* event) { MGPU_CUDA_CHECK(cudaEventSynchronize(as_event(event))); }

bool event_query(void* event) {
  cudaError_t const status = cudaEventQuery(as_event(event));
  if (status == cudaErrorNotReady) return false;
  MGPU_CUDA_CHECK(status);
  return true;
}

float event_elapsed_ms(void* start, void* end) {
  float ms = 0;
  MGPU_CUDA_CHECK(cudaEventElapsedTime(&ms, as_event(start), as_event(end)));
  return ms;
}

void* device_malloc(int ordinal, std::size_t bytes) {
  DeviceScope scope(ordinal);
  void* data = nullptr;
  cudaError_t const status = cudaMalloc(&data, bytes);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  MGPU_CUDA_CHECK(status);
  return data;
}

void device_free(int ordinal, void* data) noexcept {
  int previous = 0;
  MGPU_CUDA_CHECK_NO_THROW(cudaGetDevice(&previous));
  MGPU_CUDA_CHECK_NO_THROW(cudaSetDevice(ordinal));
  MGPU_CUDA_CHECK_NO_THROW(cudaFree(data));
  MGPU_CUDA_CHECK_NO_THROW(cudaSetDevice(previous));
}

void* pinned_malloc(std::size_t bytes) {
  void* data = nullptr;
  MGPU_CUDA_CHECK(cudaMallocHost(&data, bytes));
  return data;
}

void pinned_free(void* data) noexcept { MGPU_CUDA_CHECK_NO_THROW(cudaFreeHost(data)); }

void memory_info(int ordinal, std::size_t& free, std::size_t& total) {
  DeviceScope scope(ordinal);
  MGPU_CUDA_CHECK(cudaMemGetInfo(&free, &total));
}

void memcpy_async(int ordinal, void* dst, void const* src, std::size_t bytes, void* stream) {
  DeviceScope scope(ordinal);
  MGPU_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)));
}

std::string error_string(int status) {
  auto const error = static_cast<cudaError_t>(status);
  return std::string(cudaGetErrorName(error)) + " (" + cudaGetErrorString(error) + ")";
}

std::string nccl_error_string(int status) {
#if MGPU_NCCL_ENABLED
  return std::string("NCCL status ") + std::to_string(status) + " (" +
         ncclGetErrorString(static_cast<ncclResult_t>(status)) + ")";
#else
  return "NCCL status " + std::to_string(status);
#endif
}

std::string cublas_error_string(int status) {
  return std::string(cublasGetStatusName(static_cast<cublasStatus_t>(status))) + " (" +
         cublasGetStatusString(static_cast<cublasStatus_t>(status)) + ")";
}

bool is_out_of_memory(int status) { return status == cudaErrorMemoryAllocation; }

}  // namespace mgpu::detail::cuda
