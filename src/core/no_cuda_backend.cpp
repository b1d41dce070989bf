// The CUDA backend of a build without CUDA: no GPU is visible and every CUDA operation throws,
// kernel launchers of the core (src/core/convert_kernels.hpp) included.
#include <string>

#include <mgpu/core/error.hpp>

#include "core/cuda_backend.hpp"
#include "core/convert_kernels.hpp"

namespace mgpu::detail::cuda {

[[noreturn]] void unavailable(char const* operation) {
  throw Error(Errc::device, std::string("cannot ") + operation +
                                ": mgpu was built without its CUDA backend (configure with MGPU_WITH_CUDA=ON)");
}

int device_count() noexcept { return 0; }
DeviceProperties properties(int) { unavailable("read GPU properties"); }
std::string pci_bus_id(int) { unavailable("read a GPU's PCI bus id"); }
bool can_access_peer(int, int) { unavailable("query peer access"); }
void set_device(int) { unavailable("select a GPU"); }
void* stream_create(int) { unavailable("create a CUDA stream"); }
void stream_destroy(void*) noexcept {}
void stream_synchronize(void*) { unavailable("synchronize a CUDA stream"); }
bool stream_query(void*) { unavailable("query a CUDA stream"); }
void launch_host_func(void*, void (*)(void*), void*) { unavailable("enqueue on a CUDA stream"); }
void* event_create(int) { unavailable("create a CUDA event"); }
void* event_create_untimed(int) { unavailable("create a CUDA event"); }
void event_destroy(void*) noexcept {}
std::uint32_t* host_word_create() { unavailable("allocate pinned memory"); }
void host_word_destroy(std::uint32_t*) noexcept {}
void host_words_destroy_after(std::vector<std::uint32_t*>, std::vector<void*>) noexcept {}
void stream_wait_word(void*, std::uint32_t const*, std::uint32_t) { unavailable("wait on a CUDA stream"); }
void stream_write_word(void*, std::uint32_t*, std::uint32_t) { unavailable("write from a CUDA stream"); }
void event_record(void*, void*) { unavailable("record a CUDA event"); }
void stream_wait_event(void*, void*) { unavailable("wait on a CUDA event"); }
void event_synchronize(void*) { unavailable("synchronize a CUDA event"); }
bool event_query(void*) { unavailable("query a CUDA event"); }
float event_elapsed_ms(void*, void*) { unavailable("time CUDA events"); }
void* device_malloc(int, std::size_t) { unavailable("allocate GPU memory"); }
void device_free(int, void*) noexcept {}
void* pinned_malloc(std::size_t) { unavailable("allocate pinned memory"); }
void pinned_free(void*) noexcept {}
void memory_info(int, std::size_t&, std::size_t&) { unavailable("read GPU memory"); }
void memcpy_async(int, void*, void const*, std::size_t, void*) { unavailable("copy GPU memory"); }
std::string error_string(int status) { return "CUDA status " + std::to_string(status); }
std::string nccl_error_string(int status) { return "NCCL status " + std::to_string(status); }
std::string cublas_error_string(int status) { return "cuBLAS status " + std::to_string(status); }
bool is_out_of_memory(int status) { return status == 2; }  // cudaErrorMemoryAllocation

}  // namespace mgpu::detail::cuda

namespace mgpu::kernels {
void convert_async(int, void*, DType, void const*, DType, std::int64_t, void*) { detail::cuda::unavailable("run a CUDA kernel"); }
void fill_async(int, void*, DType, float, std::int64_t, void*) { detail::cuda::unavailable("run a CUDA kernel"); }
}  // namespace mgpu::kernels
