// Record types in checkpoint files: their sizes, names and the type of a tensor's dtype, shared by
// the single-file and the sharded checkpoints. Internal: not installed.
#pragma once

#include <cstddef>
#include <string>

#include <mgpu/core/dtype.hpp>
#include <mgpu/io/checkpoint.hpp>

namespace mgpu::io::detail {

/// Bytes per element; 0 for a value that names no type (read from a damaged file).
std::size_t type_size(RecordType type);
/// "float32", "bytes", ... or "unknown type N".
std::string type_name(RecordType type);
/// The record type that holds `dtype`'s elements.
RecordType record_type(DType dtype);

}  // namespace mgpu::io::detail
