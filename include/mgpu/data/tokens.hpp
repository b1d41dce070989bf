// Token data for language models: llm.c's token shards, the byte tokenizer, and a loader of
// (block + 1)-token windows as int32 ids x and targets y. Guide: docs/getting-started.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <mgpu/core/memory.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::data {

/// A token shard's header: 256 int32, [0] the magic, [1] the version, [2] the token count, the
/// rest zero; token_shard_header_bytes bytes, then the count's uint16 tokens.
inline constexpr std::int32_t token_shard_magic = 20240520;
inline constexpr std::int32_t token_shard_version = 1;
inline constexpr std::size_t token_shard_header_bytes = 256 * 4;

/// Writes `tokens` as a shard at `path`, atomically; threads may write different paths at once.
/// Throws Error(invalid_argument) for no tokens or more than 2^31 - 1, Error(io) when it cannot.
void write_token_shard(std::filesystem::path const& path, std::span<std::uint16_t const> tokens);

/// Reads and verifies a shard (any thread). Throws Error(invalid_argument) for a vocab outside [1,
/// 65536], Error(io), and Error(corrupt_data) naming the file and byte offset for a bad magic,
/// version or size, a truncated file, no tokens, or a token >= vocab.
std::vector<std::uint16_t> read_token_shard(std::filesystem::path const& path, std::int64_t vocab);

/// Text to tokens and back, one token per byte (vocab 256), lossless; stateless, any thread.
class ByteTokenizer {
 public:
  [[nodiscard]] static constexpr std::int64_t vocab() noexcept { return 256; }
  [[nodiscard]] std::vector<std::uint16_t> encode(std::string_view text) const;
  /// Throws Error(invalid_argument) naming the first token >= 256 and its index.
  [[nodiscard]] std::string decode(std::span<std::uint16_t const> tokens) const;
};

struct TokenLoaderOptions {
  /// Rows of a step's global batch (B >= 1), split among data-parallel ranks.
  std::int64_t batch = 8;
  /// Tokens per row (T >= 1); a row reads T + 1 tokens: ids x, and targets y shifted by one.
  std::int64_t block = 64;
  /// Seeds the sampled windows' positions.
  std::uint64_t seed = 0;
  /// Instead of sampling: window i starts at token i * T of the shards in order (never spanning
  /// two; starting over after the last), and step s reads windows s * B to s * B + B - 1.
  bool sequential = false;
};

/// Where a window starts: a shard (index into the loader's shards) and a token offset in it.
struct TokenWindow {
  std::int64_t shard = 0;
  std::int64_t offset = 0;
};

/// Rows [first_row, first_row + x.dim(0)) of a step's global batch: int32 token ids x [rows, T]
/// and targets y [rows, T], y[r][t] = x[r][t + 1] within the row's window.
struct TokenBatch {
  Tensor x;
  Tensor y;
  std::int64_t step = 0;
  std::int64_t first_row = 0;
};

/// Draws (T + 1)-token windows from shards in memory, each a function of (options, shards, step,
/// row) only. rows() may run on several threads at once; next() and seek() alongside nothing.
class TokenLoader {
 public:
  /// Reads every shard (read_token_shard). Throws Error(invalid_argument) for no shards, batch or
  /// block < 1, or a shard shorter than block + 1 tokens (naming it), and the reader's errors.
  TokenLoader(std::vector<std::filesystem::path> const& shards, std::int64_t vocab, TokenLoaderOptions options);
  /// The same over shards already in memory ("shard i" in messages); a shard without tokens or
  /// with a token >= vocab throws Error(invalid_argument).
  TokenLoader(std::vector<std::vector<std::uint16_t>> shards, std::int64_t vocab, TokenLoaderOptions options);

  [[nodiscard]] TokenLoaderOptions const& options() const noexcept { return options_; }
  [[nodiscard]] std::vector<std::vector<std::uint16_t>> const& shards() const noexcept { return shards_; }
  /// Distinct windows: start positions when sampling, non-overlapping windows when sequential.
  [[nodiscard]] std::int64_t windows() const noexcept { return total_; }

  /// Where row `row` of step `step`'s global batch starts. Throws Error(invalid_argument) for a
  /// row outside [0, batch) or a step outside [0, max_step()].
  [[nodiscard]] TokenWindow window(std::int64_t step, std::int64_t row) const;
  /// The largest step the loader can address (step * batch + row must fit in int64).
  [[nodiscard]] std::int64_t max_step() const noexcept;

  /// Rows [first_row, first_row + rows) of step `step`'s global batch as host int32 tensors from
  /// `allocator`. Throws Error(invalid_argument) for a range outside [0, batch).
  [[nodiscard]] TokenBatch rows(std::int64_t step, std::int64_t first_row, std::int64_t rows,
                                Allocator& allocator) const;

  /// The next step's whole global batch; advances position() by one.
  TokenBatch next(Allocator& allocator);
  /// The next step's batch split in order into parts of `rows[i]` rows (>= 0, summing to batch;
  /// else Error(invalid_argument)); advances position() by one.
  std::vector<TokenBatch> next(std::span<std::int64_t const> rows, Allocator& allocator);

  /// The step next() reads: with the seed, what a checkpoint stores to resume on the same windows.
  [[nodiscard]] std::int64_t position() const noexcept { return position_; }
  /// Makes next() continue at `step` (0 to max_step()); throws Error(invalid_argument) otherwise.
  void seek(std::int64_t step);

 private:
  void check_shards(std::vector<std::string> const& names);
  TokenLoaderOptions options_;
  std::vector<std::vector<std::uint16_t>> shards_;
  std::vector<std::int64_t> first_window_;  // per shard: the index of its first window
  std::int64_t total_ = 0;
  std::int64_t position_ = 0;
};

}  // namespace mgpu::data
