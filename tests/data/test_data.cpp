// Loaders on small generated files (good and malformed), generators, splitting, normalization and
// the prefetching batch loader.
#include <mgpu/core/error.hpp>
#include <mgpu/data/dataset.hpp>
#include <mgpu/data/loader.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

namespace fs = std::filesystem;
using mgpu::Errc;
using mgpu::data::InMemoryDataset;

namespace {

struct Files {
  fs::path dir = fs::temp_directory_path() / ("mgpu-data-" + std::to_string(::getpid()));
  Files() { fs::create_directories(dir); }
  ~Files() { fs::remove_all(dir); }
  fs::path write(std::string const& name, std::string const& text) {
    std::ofstream(dir / name, std::ios::binary) << text;
    return dir / name;
  }
};

std::string idx(std::vector<unsigned> const& dims, std::vector<unsigned char> const& data, unsigned char type = 0x08) {
  std::string out{'\0', '\0', static_cast<char>(type), static_cast<char>(dims.size())};
  for (unsigned d : dims)
    for (int shift : {24, 16, 8, 0}) out.push_back(static_cast<char>((d >> shift) & 0xff));
  out.append(data.begin(), data.end());
  return out;
}

// Labels equal to the example's index, so batches show which examples they hold.
InMemoryDataset indexed(std::int64_t n) {
  std::vector<float> x(static_cast<std::size_t>(n));
  std::iota(x.begin(), x.end(), 0.0f);
  return {x, x, 1, 0};
}

std::vector<float> labels_of(mgpu::data::Batch const& b) {
  auto s = b.y.host_span<float>();
  return {s.begin(), s.end()};
}

}  // namespace

TEST_CASE("CSV: header detection, label column, text labels", "[data]") {
  Files f;
  auto const a = mgpu::data::load_csv(f.write("a.csv", "x1, x2 ,label\r\n1,2,0\r\n\r\n3.5,-4e1,2\r\n"));
  CHECK(a.size() == 2);
  CHECK(a.features() == 2);
  CHECK(a.classes() == 3);
  CHECK(std::vector<float>(a.feature_data().begin(), a.feature_data().end()) == std::vector<float>{1, 2, 3.5f, -40});
  auto const b = mgpu::data::load_csv(f.write("b.csv", "1;5;6\n0;7;8\n"), {.label_column = 0, .delimiter = ';'});
  CHECK(std::vector<float>(b.labels().begin(), b.labels().end()) == std::vector<float>{1, 0});
  CHECK(std::vector<float>(b.feature_data().begin(), b.feature_data().end()) == std::vector<float>{5, 6, 7, 8});
  auto const c = mgpu::data::load_csv(f.write("c.csv", "5.1,3.5,\"setosa\"\n6.2,2.9,versicolor\n5.0,3.6,setosa\n"));
  CHECK(c.classes() == 2);
  CHECK(c.class_names() == std::vector<std::string>{"setosa", "versicolor"});
  CHECK(std::vector<float>(c.labels().begin(), c.labels().end()) == std::vector<float>{0, 1, 0});
  auto const r = mgpu::data::load_csv(f.write("r.csv", "1,0.25\n2,0.5\n"), {.classification = false});
  CHECK(r.classes() == 0);
  CHECK(r.labels()[1] == 0.5f);
}

TEST_CASE("Malformed CSV files name the file and line", "[data]") {
  Files f;
  REQUIRE_MGPU_ERROR(mgpu::data::load_csv(f.write("n.csv", "a,b,c\n1,2,0\n1,2\n")), Errc::corrupt_data, "n.csv:3: 2 fields (expected 3 as on line 2)");
  REQUIRE_MGPU_ERROR(mgpu::data::load_csv(f.write("t.csv", "1,2,0\n1,abc,1\n")), Errc::corrupt_data, "t.csv:2: column 2 holds 'abc' (expected a finite number)");
  REQUIRE_MGPU_ERROR(mgpu::data::load_csv(f.write("e.csv", "a,b\n")), Errc::corrupt_data, "no data rows");
  REQUIRE_MGPU_ERROR(mgpu::data::load_csv(f.write("l.csv", "1,2,0.5\n")), Errc::corrupt_data, "label '0.5' is not a class id");
  REQUIRE_MGPU_ERROR(mgpu::data::load_csv(f.write("k.csv", "1,2,0\n"), {.label_column = 3}), Errc::invalid_argument, "expected -3 to 2");
  REQUIRE_MGPU_ERROR(mgpu::data::load_csv(f.dir / "missing.csv"), Errc::io, "cannot open");
}

TEST_CASE("IDX images and labels, and malformed IDX files", "[data]") {
  Files f;
  auto const images = f.write("img", idx({3, 2, 2}, {0, 255, 51, 102, 1, 2, 3, 4, 5, 6, 7, 8}));
  auto const labels = f.write("lab", idx({3}, {7, 0, 2}));
  auto const d = mgpu::data::load_idx(images, labels);
  CHECK(d.size() == 3);
  CHECK(d.features() == 4);
  CHECK(d.classes() == 8);
  CHECK(d.feature_data()[1] == 1.0f);
  CHECK(d.feature_data()[2] == Approx(0.2f));
  CHECK(d.labels()[0] == 7.0f);
  REQUIRE_MGPU_ERROR(mgpu::data::load_idx(f.write("bad", idx({3, 2, 2}, {1, 2}, 0x0d)), labels), Errc::corrupt_data, "bad:byte 0: not an IDX images file");
  REQUIRE_MGPU_ERROR(mgpu::data::load_idx(f.write("short", idx({3, 2, 2}, {1, 2, 3, 4, 5})), labels), Errc::corrupt_data,
                     "short:byte 16: the header promises 12 bytes of data, the file has 5 (truncated)");
  REQUIRE_MGPU_ERROR(mgpu::data::load_idx(images, f.write("two", idx({2}, {1, 2}))), Errc::corrupt_data, "holds 3 images but");
  REQUIRE_MGPU_ERROR(mgpu::data::load_idx(images, f.write("hdr", std::string("\0\0\x08\x01\0", 5))), Errc::corrupt_data, "truncated header");
  // Headers claiming more than the file holds are checked against its length before anything is
  // allocated; extents whose product overflows, and empty files, are errors (not undefined behaviour).
  REQUIRE_MGPU_ERROR(mgpu::data::load_idx(f.write("huge", idx({0xffffffffu, 28, 28}, {1, 2, 3})), labels), Errc::corrupt_data,
                     "huge:byte 16: the header promises 3367254359280 bytes of data, the file has 3 (truncated)");
  REQUIRE_MGPU_ERROR(mgpu::data::load_idx(f.write("wrap", idx({0xffffffffu, 0xffffffffu, 0xffffffffu}, {1, 2, 3})), labels),
                     Errc::corrupt_data, "wrap:byte 4: the header's extents multiply to more than 2^64 bytes");
  REQUIRE_MGPU_ERROR(mgpu::data::load_idx(f.write("none", idx({0, 0x80000000u, 0x80000000u}, {})), f.write("nolab", idx({0}, {}))),
                     Errc::corrupt_data, "none:byte 4: no images (expected at least one)");
}

TEST_CASE("Generators are deterministic per seed; split is a seeded partition", "[data]") {
  auto const a = mgpu::data::make_clusters(100, 5, 4, 9);
  auto const b = mgpu::data::make_clusters(100, 5, 4, 9);
  auto const c = mgpu::data::make_clusters(100, 5, 4, 10);
  CHECK(std::equal(a.feature_data().begin(), a.feature_data().end(), b.feature_data().begin()));
  CHECK_FALSE(std::equal(a.feature_data().begin(), a.feature_data().end(), c.feature_data().begin()));
  auto const s = mgpu::data::make_spirals(90, 3, 1);
  CHECK(s.classes() == 3);
  for (float v : s.feature_data()) CHECK(std::abs(v) < 1.6f);

  auto const data = indexed(50);
  auto const [train, test] = mgpu::data::split(data, 0.2, 3);
  CHECK(train.size() == 40);
  CHECK(test.size() == 10);
  std::set<float> seen(train.labels().begin(), train.labels().end());
  seen.insert(test.labels().begin(), test.labels().end());
  CHECK(seen.size() == 50);
  auto const again = mgpu::data::split(data, 0.2, 3).second;
  CHECK(std::equal(test.labels().begin(), test.labels().end(), again.labels().begin()));
  REQUIRE_MGPU_ERROR(mgpu::data::split(data, 1.0, 3), Errc::invalid_argument, "expected 0 <= fraction < 1");
}

TEST_CASE("The normalizer standardizes with training statistics", "[data]") {
  InMemoryDataset const d({1, 10, 3, 10, 5, 10}, {0, 1, 0}, 2, 2);
  auto const n = mgpu::data::Normalizer::fit(d);
  std::vector<float> x(d.feature_data().begin(), d.feature_data().end());
  n.apply(x);
  CHECK(x[0] == Approx(-std::sqrt(1.5)));  // mean 3, std sqrt(8/3)
  CHECK(x[4] == Approx(std::sqrt(1.5)));
  CHECK(x[1] == 0.0f);  // constant feature: std taken as 1
}

TEST_CASE("The batch loader covers each example once per epoch, reshuffles, resumes and reports failures", "[data]") {
  auto const data = indexed(103);
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::data::BatchLoader loader(data, {.batch = 10, .seed = 5, .prefetch = 3}, host);
  CHECK(loader.batches_per_epoch() == 11);
  std::vector<std::vector<float>> epoch0;
  while (auto b = loader.next()) epoch0.push_back(labels_of(*b));
  REQUIRE(epoch0.size() == 11);
  CHECK(epoch0.back().size() == 3);
  std::multiset<float> all;
  for (auto const& b : epoch0) all.insert(b.begin(), b.end());
  CHECK(all.size() == 103);
  CHECK(std::set<float>(all.begin(), all.end()).size() == 103);

  loader.start_epoch(1);
  auto const first1 = labels_of(*loader.next());
  CHECK(first1 != epoch0[0]);
  loader.start_epoch(0, 4);  // resume epoch 0 at batch 4: the same batches as before
  for (std::size_t i = 4; i < 11; ++i) CHECK(labels_of(*loader.next()) == epoch0[i]);
  CHECK_FALSE(loader.next().has_value());

  mgpu::data::BatchLoader dropping(data, {.batch = 10, .shuffle = false, .drop_last = true}, host);
  CHECK(dropping.batches_per_epoch() == 10);
  CHECK(labels_of(*dropping.next()) == std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});

  struct Failing final : mgpu::data::Dataset {
    std::int64_t size() const override { return 30; }
    std::int64_t features() const override { return 1; }
    std::int64_t classes() const override { return 0; }
    float example(std::int64_t i, std::span<float> x) const override {
      if (i == 25) throw mgpu::Error(Errc::io, "example 25 is unreadable");
      x[0] = 0;
      return 0;
    }
  } failing;
  mgpu::data::BatchLoader broken(failing, {.batch = 10, .shuffle = false}, host);
  CHECK(broken.next().has_value());
  CHECK(broken.next().has_value());
  REQUIRE_MGPU_ERROR(broken.next(), Errc::io, "example 25 is unreadable");
  REQUIRE_MGPU_ERROR(mgpu::data::BatchLoader(data, {.batch = 0}, host), Errc::invalid_argument, "expected both >= 1");
}
