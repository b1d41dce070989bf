// Token shards (llm.c's format), the byte tokenizer and the token loader.
#include <mgpu/data/tokens.hpp>

#include <algorithm>
#include <bit>
#include <fstream>
#include <limits>
#include <numeric>

#include <mgpu/core/error.hpp>

#include "core/atomic_file.hpp"

namespace mgpu::data {
namespace {

[[noreturn]] void corrupt(std::filesystem::path const& path, std::uint64_t byte, std::string const& what) {
  throw Error(Errc::corrupt_data, path.string() + ":byte " + std::to_string(byte) + ": " + what);
}

void check_vocab(std::int64_t vocab) {
  if (vocab < 1 || vocab > 65536)
    throw Error(Errc::invalid_argument, "vocab " + std::to_string(vocab) + " (expected 1 to 65536: token shards hold uint16 ids)");
}

// The little-endian int32 at byte `at` of the header.
std::int32_t header_field(unsigned char const* header, std::size_t at) {
  return static_cast<std::int32_t>(std::uint32_t{header[at]} | (std::uint32_t{header[at + 1]} << 8) | (std::uint32_t{header[at + 2]} << 16) |
                                   (std::uint32_t{header[at + 3]} << 24));
}

void put_field(std::byte* header, std::size_t at, std::int32_t value) {
  auto const bits = static_cast<std::uint32_t>(value);
  for (std::size_t i = 0; i < 4; ++i) header[at + i] = static_cast<std::byte>((bits >> (8 * i)) & 0xffu);
}

// Splitmix64's finalizer: a bijection of 64-bit words that mixes every input bit into every output bit.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

void write_token_shard(std::filesystem::path const& path, std::span<std::uint16_t const> tokens) {
  if (tokens.empty()) throw Error(Errc::invalid_argument, "a token shard of 0 tokens for " + path.string() + " (expected at least one)");
  if (tokens.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    throw Error(Errc::invalid_argument, "a token shard of " + std::to_string(tokens.size()) + " tokens for " + path.string() +
                                            " (expected at most 2^31 - 1: the header's count is an int32)");
  std::vector<std::byte> out(token_shard_header_bytes + 2 * tokens.size());
  put_field(out.data(), 0, token_shard_magic);
  put_field(out.data(), 4, token_shard_version);
  put_field(out.data(), 8, static_cast<std::int32_t>(tokens.size()));
  std::byte* body = out.data() + token_shard_header_bytes;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    body[2 * i] = static_cast<std::byte>(tokens[i] & 0xffu);
    body[2 * i + 1] = static_cast<std::byte>(tokens[i] >> 8);
  }
  mgpu::detail::write_file_atomically(path, out);
}

std::vector<std::uint16_t> read_token_shard(std::filesystem::path const& path, std::int64_t vocab) {
  check_vocab(vocab);
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw Error(Errc::io, "cannot open " + path.string() + " (expected a readable token shard)");
  auto const size = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0);
  unsigned char header[token_shard_header_bytes] = {};
  in.read(reinterpret_cast<char*>(header), static_cast<std::streamsize>(std::min<std::uint64_t>(size, token_shard_header_bytes)));
  if (!in) throw Error(Errc::io, "cannot read " + path.string() + " (expected a readable token shard)");
  if (size >= 4 && header_field(header, 0) != token_shard_magic)
    corrupt(path, 0, "magic " + std::to_string(header_field(header, 0)) + " (expected " + std::to_string(token_shard_magic) +
                         ": a token shard as llm.c writes it)");
  if (size < token_shard_header_bytes)
    corrupt(path, size, "truncated header: the file has " + std::to_string(size) + " bytes (expected at least " +
                            std::to_string(token_shard_header_bytes) + ", 256 int32)");
  if (header_field(header, 4) != token_shard_version)
    corrupt(path, 4, "version " + std::to_string(header_field(header, 4)) + " (expected " + std::to_string(token_shard_version) + ": uint16 tokens)");
  std::int32_t const count = header_field(header, 8);
  if (count < 1) corrupt(path, 8, "a token count of " + std::to_string(count) + " (expected at least one token)");
  std::uint64_t const body = size - token_shard_header_bytes;
  std::uint64_t const expected = 2 * static_cast<std::uint64_t>(count);
  if (body < expected)
    corrupt(path, size, "truncated: the header promises " + std::to_string(count) + " tokens (" + std::to_string(expected) + " bytes from byte " +
                            std::to_string(token_shard_header_bytes) + "), the file ends after " + std::to_string(body));
  if (body > expected)
    corrupt(path, token_shard_header_bytes + expected, std::to_string(body - expected) + " bytes after the " + std::to_string(count) +
                                                           " tokens the header promises (expected the file to end here)");
  std::vector<std::uint16_t> tokens(static_cast<std::size_t>(count));
  in.read(reinterpret_cast<char*>(tokens.data()), static_cast<std::streamsize>(expected));
  if (!in) throw Error(Errc::io, "cannot read " + path.string() + " (expected " + std::to_string(expected) + " bytes of tokens)");
  if constexpr (std::endian::native == std::endian::big)
    for (std::uint16_t& t : tokens) t = static_cast<std::uint16_t>((t >> 8) | (t << 8));
  auto const bad = std::find_if(tokens.begin(), tokens.end(), [vocab](std::uint16_t t) { return t >= vocab; });
  if (bad != tokens.end()) {
    auto const index = static_cast<std::uint64_t>(bad - tokens.begin());
    corrupt(path, token_shard_header_bytes + 2 * index,
            "token " + std::to_string(*bad) + " at index " + std::to_string(index) + " (expected below the vocab, " + std::to_string(vocab) + ")");
  }
  return tokens;
}

std::vector<std::uint16_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<std::uint16_t> tokens(text.size());
  std::transform(text.begin(), text.end(), tokens.begin(), [](char c) { return static_cast<std::uint16_t>(static_cast<unsigned char>(c)); });
  return tokens;
}

std::string ByteTokenizer::decode(std::span<std::uint16_t const> tokens) const {
  std::string text(tokens.size(), '\0');
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= vocab())
      throw Error(Errc::invalid_argument, "token " + std::to_string(tokens[i]) + " at index " + std::to_string(i) + " (expected below " +
                                              std::to_string(vocab()) + " for the byte tokenizer)");
    text[i] = static_cast<char>(static_cast<unsigned char>(tokens[i]));
  }
  return text;
}

TokenLoader::TokenLoader(std::vector<std::filesystem::path> const& shards, std::int64_t vocab, TokenLoaderOptions options) : options_(options) {
  check_vocab(vocab);
  std::vector<std::string> names;
  for (auto const& path : shards) {
    shards_.push_back(read_token_shard(path, vocab));
    names.push_back(path.string());
  }
  check_shards(names);
}

TokenLoader::TokenLoader(std::vector<std::vector<std::uint16_t>> shards, std::int64_t vocab, TokenLoaderOptions options)
    : options_(options), shards_(std::move(shards)) {
  check_vocab(vocab);
  std::vector<std::string> names;
  for (std::size_t s = 0; s < shards_.size(); ++s) {
    names.push_back("shard " + std::to_string(s));
    if (shards_[s].empty()) throw Error(Errc::invalid_argument, names.back() + " holds no tokens (expected at least one)");
    auto const bad = std::find_if(shards_[s].begin(), shards_[s].end(), [vocab](std::uint16_t t) { return t >= vocab; });
    if (bad != shards_[s].end())
      throw Error(Errc::invalid_argument, names.back() + ": token " + std::to_string(*bad) + " at index " + std::to_string(bad - shards_[s].begin()) +
                                              " (expected below the vocab, " + std::to_string(vocab) + ")");
  }
  check_shards(names);
}

void TokenLoader::check_shards(std::vector<std::string> const& names) {
  std::int64_t const b = options_.batch;
  std::int64_t const t = options_.block;
  if (b < 1 || t < 1 || t > std::numeric_limits<std::int32_t>::max())
    throw Error(Errc::invalid_argument, "a token loader with batch " + std::to_string(b) + " and block " + std::to_string(t) +
                                            " (expected batch >= 1 and 1 <= block < 2^31)");
  if (shards_.empty()) throw Error(Errc::invalid_argument, "a token loader over no shards (expected at least one)");
  for (std::size_t s = 0; s < shards_.size(); ++s) {
    auto const n = static_cast<std::int64_t>(shards_[s].size());
    if (n < t + 1)
      throw Error(Errc::invalid_argument, names[s] + " holds " + std::to_string(n) + " tokens, too few for one window of block + 1 = " +
                                              std::to_string(t + 1) + " (expected at least " + std::to_string(t + 1) + ")");
    first_window_.push_back(total_);
    // Sampled windows may start anywhere they fit; sequential ones every T tokens, each reading T + 1.
    total_ += options_.sequential ? (n - 1) / t : n - t;
  }
}

std::int64_t TokenLoader::max_step() const noexcept { return (std::numeric_limits<std::int64_t>::max() - options_.batch) / options_.batch; }

TokenWindow TokenLoader::window(std::int64_t step, std::int64_t row) const {
  if (step < 0 || step > max_step() || row < 0 || row >= options_.batch)
    throw Error(Errc::invalid_argument, "window of step " + std::to_string(step) + ", row " + std::to_string(row) + " (expected a step in [0, " +
                                            std::to_string(max_step()) + "] and a row in [0, " + std::to_string(options_.batch) + "))");
  auto const total = static_cast<std::uint64_t>(total_);
  std::uint64_t index = 0;
  if (options_.sequential) {
    index = static_cast<std::uint64_t>(step * options_.batch + row) % total;
  } else {
    // Uniform over [0, total) by rejection: words at or above the largest multiple of total are redrawn.
    std::uint64_t word = mix(mix(options_.seed ^ mix(static_cast<std::uint64_t>(step))) ^ static_cast<std::uint64_t>(row));
    std::uint64_t const limit = std::numeric_limits<std::uint64_t>::max() - std::numeric_limits<std::uint64_t>::max() % total;
    while (word >= limit) word = mix(word);
    index = word % total;
  }
  auto const at = std::upper_bound(first_window_.begin(), first_window_.end(), static_cast<std::int64_t>(index)) - 1;
  std::int64_t const shard = at - first_window_.begin();
  std::int64_t const local = static_cast<std::int64_t>(index) - *at;
  return {shard, options_.sequential ? local * options_.block : local};
}

TokenBatch TokenLoader::rows(std::int64_t step, std::int64_t first_row, std::int64_t rows, Allocator& allocator) const {
  if (first_row < 0 || rows < 0 || first_row > options_.batch - rows)
    throw Error(Errc::invalid_argument, "rows [" + std::to_string(first_row) + ", " + std::to_string(first_row) + " + " + std::to_string(rows) +
                                            ") of a global batch of " + std::to_string(options_.batch) + " (expected a range inside [0, " +
                                            std::to_string(options_.batch) + "))");
  std::int64_t const t = options_.block;
  TokenBatch out{Tensor::empty({rows, t}, DType::int32, allocator), Tensor::empty({rows, t}, DType::int32, allocator), step, first_row};
  auto x = out.x.host_span<std::int32_t>();
  auto y = out.y.host_span<std::int32_t>();
  for (std::int64_t r = 0; r < rows; ++r) {
    TokenWindow const w = window(step, first_row + r);
    auto const source = shards_[static_cast<std::size_t>(w.shard)].begin() + w.offset;
    auto const row = static_cast<std::size_t>(r * t);
    std::copy(source, source + t, x.begin() + static_cast<std::ptrdiff_t>(row));
    std::copy(source + 1, source + t + 1, y.begin() + static_cast<std::ptrdiff_t>(row));
  }
  return out;
}

TokenBatch TokenLoader::next(Allocator& allocator) {
  std::int64_t const all[] = {options_.batch};
  return std::move(next(all, allocator).front());
}

std::vector<TokenBatch> TokenLoader::next(std::span<std::int64_t const> rows, Allocator& allocator) {
  bool const valid = std::all_of(rows.begin(), rows.end(), [this](std::int64_t n) { return n >= 0 && n <= options_.batch; });
  if (!valid || std::accumulate(rows.begin(), rows.end(), std::int64_t{0}) != options_.batch) {
    std::string list;
    for (std::int64_t n : rows) list += (list.empty() ? "" : ", ") + std::to_string(n);
    throw Error(Errc::invalid_argument,
                "rows per rank {" + list + "} (expected counts >= 0 adding up to the batch, " + std::to_string(options_.batch) + ")");
  }
  if (position_ > max_step())
    throw Error(Errc::invalid_argument, "next() past step " + std::to_string(max_step()) + " (expected fewer steps)");
  std::vector<TokenBatch> parts;
  std::int64_t first = 0;
  for (std::int64_t n : rows) {
    parts.push_back(this->rows(position_, first, n, allocator));
    first += n;
  }
  ++position_;
  return parts;
}

void TokenLoader::seek(std::int64_t step) {
  if (step < 0 || step > max_step())
    throw Error(Errc::invalid_argument, "seek(" + std::to_string(step) + ") (expected a step in [0, " + std::to_string(max_step()) + "])");
  position_ = step;
}

}  // namespace mgpu::data
