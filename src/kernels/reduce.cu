// The reduction kernel of the CUDA peer backend (src/kernels/reduce.hpp): ReduceSlice
// (mgpu/core/detail/reduce_slice.hpp) over a grid, reading every rank's input through peer or
// same-GPU pointers.
#include "kernels/reduce.hpp"

#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/detail/reduce_slice.hpp>

#include "kernels/elementwise.cuh"

namespace mgpu::kernels {

namespace {
using mgpu::detail::ReduceSlice;

template <Element T, ReduceOp O>
struct OffsetReduce {
  ReduceSlice<T, O> slice;
  std::int64_t begin;
  __device__ void operator()(std::int64_t i) const { slice(begin + i); }
};
}  // namespace

void reduce_slice(DType dtype, ReduceOp op, void const* const* inputs, int input_count, void* const* outputs,
                  int output_count, std::int64_t begin, std::int64_t end, void* stream) {
  mgpu::detail::visit_dtype(dtype, [&]<class T>(std::type_identity<T>) {
    mgpu::detail::visit_reduce_op(op, [&]<ReduceOp O>(std::integral_constant<ReduceOp, O>) {
      OffsetReduce<T, O> k{};
      k.slice.inputs = input_count;
      k.slice.outputs = output_count;
      for (int p = 0; p < input_count; ++p) k.slice.in[p] = static_cast<T const*>(inputs[p]);
      for (int q = 0; q < output_count; ++q) k.slice.out[q] = static_cast<T*>(outputs[q]);
      k.begin = begin;
      for_each_index(end - begin, k, static_cast<cudaStream_t>(stream));
    });
  });
}

}  // namespace mgpu::kernels
