// Token data for language models: shards in llm.c's format (a header of 256 little-endian int32,
// then uint16 token ids), the byte-level tokenizer, and a loader that draws (block + 1)-token
// windows from shards, as int32 tensors of ids x and targets y, for every data-parallel rank.
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

/// Writes `tokens` as a shard at `path`, atomically (a temporary file renamed into place, so a
/// reader never sees half a shard). Throws Error(invalid_argument) for no tokens or more than
/// 2^31 - 1, Error(io) when the file cannot be written. Threads may write different paths at once.
void write_token_shard(std::filesystem::path const& path, std::span<std::uint16_t const> tokens);

/// Reads and verifies the shard at `path`: every token must be below `vocab` (1 to 65536). Throws
/// Error(invalid_argument) for a bad vocab, Error(io) when the file cannot be read, and
/// Error(corrupt_data) naming the file and the byte offset for a bad magic or version, a truncated
/// header or body, a count that disagrees with the file's size, no tokens, or a token >= vocab.
/// Safe to call from any thread.
std::vector<std::uint16_t> read_token_shard(std::filesystem::path const& path, std::int64_t vocab);

/// Text to tokens and back, one token per byte (vocab 256): lossless for any bytes, UTF-8 or not.
/// Stateless; safe to use from any thread.
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
  /// Tokens per row (T >= 1); a row reads a window of T + 1 tokens: ids x, then targets y = the
  /// same window shifted by one.
  std::int64_t block = 64;
  /// Seeds the sampled windows' positions.
  std::uint64_t seed = 0;
  /// Instead of sampling: window i of the walk starts at token i * T of the shards taken in order
  /// (windows never span two shards; the walk starts over after the last), and step s reads
  /// windows s * B to s * B + B - 1. Over a validation split this makes the first K windows, and
  /// so the loss over them, well defined.
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

/// Draws (T + 1)-token windows from token shards held in memory. Every window is a function of
/// (options, shards, step, row) only: a loader built alike and seek()-ed to a step yields the same
/// batches, and ranks that build their rows of one step get disjoint rows of the same global
/// batch. rows() is const and may run on several threads at once; next() and seek() may not run
/// alongside anything else.
class TokenLoader {
 public:
  /// Reads every shard with read_token_shard(path, vocab). Throws Error(invalid_argument) for no
  /// shards, batch or block < 1, or a shard shorter than block + 1 tokens (naming it), and the
  /// reader's errors.
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
  /// The next step's global batch split in order into one part per rank of `rows[i]` rows (the
  /// way DataParallel shards rows; a part may be empty); advances position() by one. Throws
  /// Error(invalid_argument) unless the counts are >= 0 and add up to batch.
  std::vector<TokenBatch> next(std::span<std::int64_t const> rows, Allocator& allocator);

  /// The step next() reads. With the seed, the one thing a checkpoint must store (for example as
  /// io::TrainingState::step and data_seed) for a resumed run to continue on the same windows.
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
