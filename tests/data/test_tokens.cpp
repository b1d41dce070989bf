// Token shards (byte-exact format, every corruption), the byte tokenizer, and the token loader:
// determinism, resuming, per-rank parts, targets and the sequential walk, each against a reference
// computed here from the tokens themselves.
#include <mgpu/core/error.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/data/tokens.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/ops/ops.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <thread>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

namespace fs = std::filesystem;
using mgpu::Errc;
using mgpu::data::TokenLoader;
using mgpu::data::TokenLoaderOptions;

namespace {

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("mgpu-tokens-" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

std::vector<unsigned char> file_bytes(fs::path const& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

fs::path write_bytes(fs::path const& path, std::vector<unsigned char> const& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<char const*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return path;
}

// A shard built byte by byte, as llm.c's writer lays it out: 256 little-endian int32 (magic
// 20240520 = 0x0134D888, version 1, count), then the tokens as little-endian uint16.
std::vector<unsigned char> reference_shard(std::vector<std::uint16_t> const& tokens, std::uint32_t count) {
  std::vector<unsigned char> out(1024, 0);
  unsigned char const magic[4] = {0x88, 0xD8, 0x34, 0x01};
  std::copy(magic, magic + 4, out.begin());
  out[4] = 1;
  for (int i = 0; i < 4; ++i) out[static_cast<std::size_t>(8 + i)] = static_cast<unsigned char>(count >> (8 * i));
  for (std::uint16_t t : tokens) {
    out.push_back(static_cast<unsigned char>(t % 256));
    out.push_back(static_cast<unsigned char>(t / 256));
  }
  return out;
}

std::vector<std::uint16_t> iota_tokens(std::size_t n, std::uint16_t first = 0) {
  std::vector<std::uint16_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<std::int32_t> values(mgpu::Tensor const& t) {
  auto const s = t.host_span<std::int32_t>();
  return {s.begin(), s.end()};
}

std::shared_ptr<mgpu::Allocator> host() { return mgpu::Allocator::create({mgpu::DeviceKind::host, 0}); }

}  // namespace

TEST_CASE("token shards round-trip and match llm.c's layout byte for byte", "[data][tokens]") {
  TempDir dir;
  std::vector<std::uint16_t> const tokens = {0, 1, 255, 256, 1000, 50256, 65535};
  fs::path const path = dir.path / "a.bin";
  mgpu::data::write_token_shard(path, tokens);
  CHECK(file_bytes(path) == reference_shard(tokens, 7));
  CHECK(mgpu::data::read_token_shard(path, 65536) == tokens);
  // Overwriting replaces the file through a temporary that does not stay behind.
  mgpu::data::write_token_shard(path, std::vector<std::uint16_t>{7});
  CHECK(mgpu::data::read_token_shard(path, 8) == std::vector<std::uint16_t>{7});
  CHECK(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator()) == 1);
  // A shard written by another tool, from the reference bytes.
  CHECK(mgpu::data::read_token_shard(write_bytes(dir.path / "b.bin", reference_shard({3, 2, 1}, 3)), 4) ==
        std::vector<std::uint16_t>{3, 2, 1});
}

TEST_CASE("corrupt token shards name the file and the byte offset", "[data][tokens]") {
  TempDir dir;
  auto const good = reference_shard({10, 20, 30, 40}, 4);
  auto const write = [&](char const* name, std::vector<unsigned char> const& bytes) { return write_bytes(dir.path / name, bytes); };
  auto const read = [](fs::path const& p) { return mgpu::data::read_token_shard(p, 256); };

  auto bad_magic = good;
  bad_magic[0] ^= 1;
  fs::path p = write("magic.bin", bad_magic);
  REQUIRE_MGPU_ERROR(read(p), Errc::corrupt_data, p.string() + ":byte 0: magic 20240521 (expected 20240520");

  auto bad_version = good;
  bad_version[4] = 2;
  p = write("version.bin", bad_version);
  REQUIRE_MGPU_ERROR(read(p), Errc::corrupt_data, p.string() + ":byte 4: version 2 (expected 1");

  p = write("header.bin", std::vector<unsigned char>(good.begin(), good.begin() + 100));
  REQUIRE_MGPU_ERROR(read(p), Errc::corrupt_data, p.string() + ":byte 100: truncated header");
  p = write("empty.bin", {});
  REQUIRE_MGPU_ERROR(read(p), Errc::corrupt_data, p.string() + ":byte 0: truncated header");

  p = write("body.bin", std::vector<unsigned char>(good.begin(), good.end() - 3));
  REQUIRE_MGPU_ERROR(read(p), Errc::corrupt_data, p.string() + ":byte 1029: truncated: the header promises 4 tokens");

  p = write("count.bin", reference_shard({10, 20, 30, 40}, 3));
  REQUIRE_MGPU_ERROR(read(p), Errc::corrupt_data, p.string() + ":byte 1030: 2 bytes after the 3 tokens");
  p = write("negative.bin", reference_shard({10}, 0xFFFFFFFFu));
  REQUIRE_MGPU_ERROR(read(p), Errc::corrupt_data, p.string() + ":byte 8: a token count of -1");

  p = write("zero.bin", reference_shard({}, 0));
  REQUIRE_MGPU_ERROR(read(p), Errc::corrupt_data, p.string() + ":byte 8: a token count of 0 (expected at least one token)");

  p = write("vocab.bin", reference_shard({10, 256, 300}, 3));
  REQUIRE_MGPU_ERROR(read(p), Errc::corrupt_data, p.string() + ":byte 1026: token 256 at index 1 (expected below the vocab, 256)");
  CHECK(mgpu::data::read_token_shard(p, 301) == std::vector<std::uint16_t>{10, 256, 300});

  REQUIRE_MGPU_ERROR(read(dir.path / "missing.bin"), Errc::io, "cannot open " + (dir.path / "missing.bin").string());
  REQUIRE_MGPU_ERROR(mgpu::data::read_token_shard(write("ok.bin", good), 0), Errc::invalid_argument, "vocab 0 (expected 1 to 65536");
  REQUIRE_MGPU_ERROR(mgpu::data::read_token_shard(dir.path / "ok.bin", 65537), Errc::invalid_argument, "vocab 65537");

  REQUIRE_MGPU_ERROR(mgpu::data::write_token_shard(dir.path / "none.bin", {}), Errc::invalid_argument, "0 tokens");
  CHECK_FALSE(fs::exists(dir.path / "none.bin"));
  REQUIRE_MGPU_ERROR(mgpu::data::write_token_shard(dir.path / "no-such-dir" / "x.bin", std::vector<std::uint16_t>{1}), Errc::io, "no-such-dir");
}

TEST_CASE("the byte tokenizer is lossless for any bytes", "[data][tokens]") {
  mgpu::data::ByteTokenizer const bytes;
  std::string text = "Wherefore art thou, caf\xc3\xa9?";
  text.push_back('\0');
  text.push_back('\xff');
  auto const tokens = bytes.encode(text);
  REQUIRE(tokens.size() == text.size());
  CHECK(tokens[0] == 'W');
  CHECK(tokens[23] == 0xc3);
  CHECK(tokens.back() == 255);
  CHECK(bytes.decode(tokens) == text);
  CHECK(bytes.vocab() == 256);
  REQUIRE_MGPU_ERROR(bytes.decode(std::vector<std::uint16_t>{65, 256}), Errc::invalid_argument, "token 256 at index 1 (expected below 256");
}

TEST_CASE("sampled windows: every row is its shard's tokens, targets shifted by one", "[data][tokens]") {
  auto alloc = host();
  // Two shards with distinct tokens, so a row's values say where it came from.
  std::vector<std::vector<std::uint16_t>> const shards = {iota_tokens(12), iota_tokens(9, 100)};
  TokenLoader loader(shards, 256, {.batch = 4, .block = 3, .seed = 7});
  CHECK(loader.windows() == (12 - 3) + (9 - 3));
  std::map<std::pair<std::int64_t, std::int64_t>, int> seen;
  for (int step = 0; step < 150; ++step) {
    auto const batch = loader.next(*alloc);
    REQUIRE(batch.x.dtype() == mgpu::DType::int32);
    REQUIRE(batch.x.shape() == mgpu::Shape{4, 3});
    REQUIRE(batch.y.shape() == mgpu::Shape{4, 3});
    auto const x = values(batch.x);
    auto const y = values(batch.y);
    for (std::int64_t r = 0; r < 4; ++r) {
      auto const w = loader.window(step, r);
      auto const& tokens = shards.at(static_cast<std::size_t>(w.shard));
      REQUIRE(w.offset >= 0);
      REQUIRE(w.offset + 4 <= static_cast<std::int64_t>(tokens.size()));
      for (std::int64_t t = 0; t < 3; ++t) {
        CHECK(x[static_cast<std::size_t>(r * 3 + t)] == tokens[static_cast<std::size_t>(w.offset + t)]);
        CHECK(y[static_cast<std::size_t>(r * 3 + t)] == tokens[static_cast<std::size_t>(w.offset + t + 1)]);
      }
      ++seen[{w.shard, w.offset}];
    }
  }
  // 600 draws over 15 starts (40 each on average): every start drawn, none far from its share.
  CHECK(seen.size() == 15);
  for (auto const& [where, count] : seen) {
    INFO("shard " << where.first << " offset " << where.second);
    CHECK(count >= 15);
    CHECK(count <= 70);
  }
}

TEST_CASE("the window sequence depends on the seed and the step only", "[data][tokens]") {
  auto alloc = host();
  std::vector<std::vector<std::uint16_t>> const shards = {iota_tokens(500)};
  TokenLoaderOptions const options{.batch = 6, .block = 8, .seed = 42};
  TokenLoader a(shards, 512, options);
  std::vector<std::vector<std::int32_t>> run;
  for (int step = 0; step < 5; ++step) run.push_back(values(a.next(*alloc).x));
  CHECK(a.position() == 5);

  // A second loader alike, resumed at step 3 as a checkpoint would have it.
  TokenLoader b(shards, 512, options);
  b.seek(3);
  CHECK(b.position() == 3);
  CHECK(values(b.next(*alloc).x) == run[3]);
  CHECK(values(b.next(*alloc).x) == run[4]);
  b.seek(0);
  CHECK(values(b.next(*alloc).x) == run[0]);
  CHECK(run[0] != run[1]);

  TokenLoader other_seed(shards, 512, {.batch = 6, .block = 8, .seed = 43});
  CHECK(values(other_seed.next(*alloc).x) != run[0]);

  REQUIRE_MGPU_ERROR(b.seek(-1), Errc::invalid_argument, "seek(-1) (expected a step in [0, ");
  REQUIRE_MGPU_ERROR(b.window(0, 6), Errc::invalid_argument, "row 6");
}

TEST_CASE("ranks get disjoint parts that together are the global batch", "[data][tokens]") {
  auto alloc = host();
  std::vector<std::vector<std::uint16_t>> const shards = {iota_tokens(300), iota_tokens(200, 1000)};
  TokenLoaderOptions const options{.batch = 8, .block = 5, .seed = 3};
  TokenLoader whole(shards, 2048, options);
  TokenLoader split(shards, 2048, options);
  std::vector<std::int64_t> const rows = {3, 0, 5};
  for (int step = 0; step < 4; ++step) {
    auto const global = whole.next(*alloc);
    auto const parts = split.next(rows, *alloc);
    REQUIRE(parts.size() == 3);
    std::vector<std::int32_t> x;
    std::vector<std::int32_t> y;
    std::int64_t first = 0;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      CHECK(parts[i].step == step);
      CHECK(parts[i].first_row == first);  // consecutive, non-overlapping row ranges
      CHECK(parts[i].x.shape() == mgpu::Shape{rows[i], 5});
      first += rows[i];
      auto const px = values(parts[i].x);
      auto const py = values(parts[i].y);
      x.insert(x.end(), px.begin(), px.end());
      y.insert(y.end(), py.begin(), py.end());
    }
    CHECK(x == values(global.x));
    CHECK(y == values(global.y));
    // One rank building only its own rows, from its own loader, gets the same part.
    CHECK(values(split.rows(step, 3, 5, *alloc).x) == values(parts[2].x));
  }
  REQUIRE_MGPU_ERROR(split.next(std::vector<std::int64_t>{4, 3}, *alloc), Errc::invalid_argument,
                     "rows per rank {4, 3} (expected counts >= 0 adding up to the batch, 8)");
  REQUIRE_MGPU_ERROR(split.next(std::vector<std::int64_t>{9, -1}, *alloc), Errc::invalid_argument, "{9, -1}");
  REQUIRE_MGPU_ERROR(split.rows(0, 6, 3, *alloc), Errc::invalid_argument, "rows [6, 6 + 3) of a global batch of 8");
  CHECK(split.position() == 4);  // failed calls do not advance
}

TEST_CASE("ranks build their rows of one step at once from one loader", "[data][tokens]") {
  auto alloc = host();
  TokenLoader const loader(std::vector<std::vector<std::uint16_t>>{iota_tokens(400)}, 512, {.batch = 12, .block = 6, .seed = 5});
  std::vector<std::vector<std::int32_t>> parts(4);
  std::vector<std::thread> ranks;
  for (std::int64_t rank = 0; rank < 4; ++rank)  // rows() is const: one shared loader, one allocator
    ranks.emplace_back([&, rank] { parts[static_cast<std::size_t>(rank)] = values(loader.rows(9, rank * 3, 3, *alloc).x); });
  for (auto& t : ranks) t.join();
  std::vector<std::int32_t> joined;
  for (auto const& p : parts) joined.insert(joined.end(), p.begin(), p.end());
  CHECK(joined == values(loader.rows(9, 0, 12, *alloc).x));
}

TEST_CASE("the sequential walk equals a hand loop over consecutive windows", "[data][tokens]") {
  auto alloc = host();
  std::int64_t const block = 3;
  std::vector<std::vector<std::uint16_t>> const shards = {iota_tokens(10), iota_tokens(8, 50)};
  // The windows in walk order: every `block` tokens while block + 1 tokens remain, shard by shard.
  std::vector<std::vector<std::int32_t>> windows;
  for (auto const& tokens : shards)
    for (std::size_t at = 0; at + block + 1 <= tokens.size(); at += block)
      windows.emplace_back(tokens.begin() + static_cast<std::ptrdiff_t>(at), tokens.begin() + static_cast<std::ptrdiff_t>(at + block + 1));
  REQUIRE(windows.size() == 5);
  TokenLoader loader(shards, 256, {.batch = 2, .block = block, .seed = 99, .sequential = true});
  CHECK(loader.windows() == 5);
  for (std::int64_t step = 0; step < 6; ++step) {  // past the end: the walk starts over
    auto const batch = loader.next(*alloc);
    auto const x = values(batch.x);
    auto const y = values(batch.y);
    for (std::int64_t r = 0; r < 2; ++r) {
      auto const& w = windows[static_cast<std::size_t>((step * 2 + r) % 5)];
      CHECK(std::vector<std::int32_t>(x.begin() + r * block, x.begin() + (r + 1) * block) == std::vector<std::int32_t>(w.begin(), w.end() - 1));
      CHECK(std::vector<std::int32_t>(y.begin() + r * block, y.begin() + (r + 1) * block) == std::vector<std::int32_t>(w.begin() + 1, w.end()));
    }
  }
}

TEST_CASE("token loaders reject what they cannot draw from", "[data][tokens]") {
  TempDir dir;
  std::vector<std::vector<std::uint16_t>> const shards = {iota_tokens(10)};
  REQUIRE_MGPU_ERROR(TokenLoader(shards, 256, {.batch = 0, .block = 4}), Errc::invalid_argument, "batch 0 and block 4 (expected batch >= 1");
  REQUIRE_MGPU_ERROR(TokenLoader(shards, 256, {.batch = 2, .block = 0}), Errc::invalid_argument, "block 0");
  REQUIRE_MGPU_ERROR(TokenLoader(shards, 256, {.batch = 2, .block = 10}), Errc::invalid_argument,
                     "shard 0 holds 10 tokens, too few for one window of block + 1 = 11");
  REQUIRE_MGPU_ERROR(TokenLoader(shards, 5, {.batch = 2, .block = 4}), Errc::invalid_argument,
                     "shard 0: token 5 at index 5 (expected below the vocab, 5)");
  REQUIRE_MGPU_ERROR(TokenLoader(std::vector<std::vector<std::uint16_t>>{{}}, 256, {}), Errc::invalid_argument, "shard 0 holds no tokens");
  REQUIRE_MGPU_ERROR(TokenLoader(std::vector<std::vector<std::uint16_t>>{}, 256, {}), Errc::invalid_argument, "no shards");
  REQUIRE_MGPU_ERROR(TokenLoader(shards, 0, {}), Errc::invalid_argument, "vocab 0");

  // From files: the short shard is named; the reader's errors pass through.
  fs::path const long_shard = dir.path / "long.bin";
  fs::path const short_shard = dir.path / "short.bin";
  mgpu::data::write_token_shard(long_shard, iota_tokens(40));
  mgpu::data::write_token_shard(short_shard, iota_tokens(4));
  REQUIRE_MGPU_ERROR(TokenLoader({long_shard, short_shard}, 256, {.batch = 2, .block = 4}), Errc::invalid_argument,
                     short_shard.string() + " holds 4 tokens, too few for one window of block + 1 = 5");
  REQUIRE_MGPU_ERROR(TokenLoader({long_shard}, 39, {.batch = 2, .block = 4}), Errc::corrupt_data, long_shard.string() + ":byte 1102: token 39");
  TokenLoader const loader({long_shard, short_shard}, 256, {.batch = 2, .block = 3});
  CHECK(loader.shards().size() == 2);
  CHECK(loader.shards()[1] == iota_tokens(4));
}

TEST_CASE("int32 batches are checkpointed as int32 and refused by arithmetic", "[data][tokens]") {
  TempDir dir;
  auto alloc = host();
  mgpu::Stream stream(mgpu::Device{mgpu::DeviceKind::host, 0});
  TokenLoader loader(std::vector<std::vector<std::uint16_t>>{iota_tokens(64)}, 64, {.batch = 2, .block = 4, .seed = 1});
  auto const batch = loader.next(*alloc);
  mgpu::io::Checkpoint saved;
  saved.put("x", batch.x, stream);
  saved.save(dir.path / "c.mgpu");
  auto const loaded = mgpu::io::Checkpoint::load(dir.path / "c.mgpu");
  CHECK(loaded.get("x").type == mgpu::io::RecordType::int32);
  auto const back = mgpu::Tensor::empty({2, 4}, mgpu::DType::int32, *alloc);
  loaded.copy_to("x", back, stream);
  CHECK(values(back) == values(batch.x));
  REQUIRE_MGPU_ERROR(loaded.copy_to("x", mgpu::Tensor::empty({2, 4}, mgpu::DType::float32, *alloc), stream), Errc::invalid_argument,
                     "is int32 [2, 4] (expected float32 [2, 4])");
  REQUIRE_MGPU_ERROR(mgpu::fill_async(back, 1.0f, stream), Errc::invalid_argument, "arithmetic on an int32 tensor");
  REQUIRE_MGPU_ERROR(mgpu::ops::scale(back, 2.0f, stream), Errc::invalid_argument, "scale: t is int32 (expected float32, bfloat16 or float16)");
  stream.synchronize();
  CHECK(values(back) == values(batch.x));
  REQUIRE_MGPU_ERROR(batch.x.host_span<float>(), Errc::invalid_argument, "host_span<float32> of a int32 tensor");
}
