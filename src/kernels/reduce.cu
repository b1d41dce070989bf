// The reduction kernel of the CUDA peer backend (src/kernels/reduce.hpp): VectorReduceSlice
// (mgpu/core/detail/reduce_slice.hpp) over a grid, reading every rank's input through peer or
// same-GPU pointers, 16 bytes at a time where they line up.
#include "kernels/reduce.hpp"

#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/detail/reduce_slice.hpp>

#include "kernels/elementwise.cuh"

namespace mgpu::kernels {

namespace {
using mgpu::detail::ReduceSlice;
using mgpu::detail::VectorReduceSlice;
}  // namespace

void reduce_slice(DType dtype, ReduceOp op, void const* const* inputs, int input_count, void* const* outputs,
                  int output_count, std::int64_t begin, std::int64_t end, void* stream) {
  mgpu::detail::visit_dtype(dtype, [&]<class T>(std::type_identity<T>) {
    mgpu::detail::visit_reduce_op(op, [&]<ReduceOp O>(std::integral_constant<ReduceOp, O>) {
      ReduceSlice<T, O> slice{};
      slice.inputs = input_count;
      slice.outputs = output_count;
      for (int p = 0; p < input_count; ++p) slice.in[p] = static_cast<T const*>(inputs[p]);
      for (int q = 0; q < output_count; ++q) slice.out[q] = static_cast<T*>(outputs[q]);
      // 16-byte loads and stores where every rank's pointers line up, element by element elsewhere.
      VectorReduceSlice<T, O> const k(slice, begin, end);
      for_each_index(k.count(), k, static_cast<cudaStream_t>(stream));
    });
  });
}

}  // namespace mgpu::kernels
