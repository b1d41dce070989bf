// The CUDA runtime calls the core needs, behind plain C++ signatures. cuda_backend.cpp implements
// them with CUDA; no_cuda_backend.cpp, for builds without CUDA, reports no GPU and throws. The
// core's kernels are launched through src/core/convert_kernels.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <mgpu/core/device.hpp>
#include <mgpu/core/dtype.hpp>

namespace mgpu::detail::cuda {

int device_count() noexcept;
DeviceProperties properties(int ordinal);
std::string pci_bus_id(int ordinal);  // "0000:3b:00.0" (cudaDeviceGetPCIBusId), for NVML's metrics
bool can_access_peer(int ordinal, int peer);
void set_device(int ordinal);

void* stream_create(int ordinal);
void stream_destroy(void* stream) noexcept;
void stream_synchronize(void* stream);
bool stream_query(void* stream);
// Runs fn(arg) in stream order on a CUDA-owned thread; fn must not call CUDA.
void launch_host_func(void* stream, void (*fn)(void*), void* arg);

void* event_create(int ordinal);
// An event without timing, cheaper to record: for ordering and completion only.
void* event_create_untimed(int ordinal);
void event_destroy(void* event) noexcept;
void event_record(void* event, void* stream);
void stream_wait_event(void* stream, void* event);
void event_synchronize(void* event);
bool event_query(void* event);
float event_elapsed_ms(void* start, void* end);

// A 32-bit word (set to 0) in page-locked host memory that every GPU can read and write: the host
// or a stream raises it, streams wait for it without a host thread (see stream_wait_word).
// host_word_destroy makes no CUDA call (the word is kept for reuse), so it is safe in callbacks.
std::uint32_t* host_word_create();
void host_word_destroy(std::uint32_t* word) noexcept;
// Returns `words` to the pool once every event in `after` (of any GPUs, recorded after the last
// stream work that waits on or writes the words) has completed; takes the events and destroys
// them then. Until then the words keep their values, so no stream wait on them can stall.
void host_words_destroy_after(std::vector<std::uint32_t*> words, std::vector<void*> after) noexcept;
// Makes later work on `stream` wait until (int32_t)(*word - value) >= 0 (wrap-around safe).
void stream_wait_word(void* stream, std::uint32_t const* word, std::uint32_t value);
// Sets *word = value once earlier work on `stream` has finished (a GPU-side write, in stream order).
void stream_write_word(void* stream, std::uint32_t* word, std::uint32_t value);

// nullptr when the device is out of memory.
void* device_malloc(int ordinal, std::size_t bytes);
void device_free(int ordinal, void* data) noexcept;
void* pinned_malloc(std::size_t bytes);
void pinned_free(void* data) noexcept;
// Free and total bytes of the GPU.
void memory_info(int ordinal, std::size_t& free, std::size_t& total);

// A copy on a stream of GPU `ordinal`; the calling thread's current device is left as it was.
void memcpy_async(int ordinal, void* dst, void const* src, std::size_t bytes, void* stream);

std::string error_string(int status);
std::string nccl_error_string(int status);
std::string cublas_error_string(int status);
// The runtime's code for "out of memory", to map it onto Errc::out_of_memory.
bool is_out_of_memory(int status);

}  // namespace mgpu::detail::cuda
