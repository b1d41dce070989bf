// Timeline: spans from stream work and host scopes, and the Chrome trace JSON read back by a
// JSON parser.
#include <mgpu/trace/timeline.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/temp_path.hpp"

using mgpu::trace::Lane;
using mgpu::trace::Timeline;
using namespace std::chrono_literals;

TEST_CASE("Timeline: disabled records nothing, enabled records stream work in order") {
  mgpu::Stream stream(mgpu::Device{});
  Timeline timeline;
  int ran = 0;
  timeline.stream_span(stream, "off", "test", 0, Lane::compute, [&] { stream.enqueue([&] { ++ran; }); });
  stream.synchronize();
  CHECK(ran == 1);
  CHECK(timeline.spans().empty());

  timeline.enable();
  timeline.stream_span(stream, "first", "test", 3, Lane::compute, [&] { stream.enqueue([] { std::this_thread::sleep_for(5ms); }); });
  timeline.stream_span(stream, "second", "test", 3, Lane::communication, [&] { stream.enqueue([] { std::this_thread::sleep_for(2ms); }); });
  stream.synchronize();
  auto const spans = timeline.spans();
  REQUIRE(spans.size() == 2);
  CHECK(spans[0].name == "first");
  CHECK(spans[0].rank == 3);
  CHECK(spans[1].lane == Lane::communication);
  CHECK(spans[0].end_ns - spans[0].begin_ns >= 5'000'000);
  CHECK(spans[1].begin_ns >= spans[0].end_ns);  // one stream runs its work in order
}

TEST_CASE("Timeline: a stream span whose work throws records nothing and frees its slot") {
  mgpu::Stream stream(mgpu::Device{});
  Timeline timeline;
  timeline.enable();
  for (int i = 0; i < 3; ++i) {
    CHECK_THROWS_AS(timeline.stream_span(stream, "broken", "test", 0, Lane::compute, [] { throw std::runtime_error("bad op"); }),
                    std::runtime_error);
  }
  for (int i = 0; i < 5; ++i) {
    timeline.stream_span(stream, "ok " + std::to_string(i), "test", 0, Lane::compute, [&] { stream.enqueue([] {}); });
  }
  stream.synchronize();
  auto const spans = timeline.spans();
  REQUIRE(spans.size() == 5);  // none of the broken ones; slots reused in any order keep names apart
  for (int i = 0; i < 5; ++i) CHECK(spans[static_cast<std::size_t>(i)].name == "ok " + std::to_string(i));
}

TEST_CASE("Timeline: Chrome trace JSON parses and carries every span") {
  Timeline timeline;
  timeline.enable();
  {
    Timeline::Scope scope(&timeline, "step \"1\"", "host", 1, Lane::host);
    std::this_thread::sleep_for(1ms);
  }
  timeline.record({"reduce", "comm", 0, Lane::communication, 1500, 4250});
  auto const json = nlohmann::json::parse(timeline.chrome_trace_json());
  int complete = 0;
  bool named_rank = false;
  for (auto const& e : json.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "process_name" && e.at("args").at("name") == "rank 1") named_rank = true;
    if (e.at("ph") != "X") continue;
    ++complete;
    if (e.at("name") == "reduce") {
      CHECK(e.at("pid") == 0);
      CHECK(e.at("tid") == Lane::communication);
      CHECK(e.at("ts").get<double>() == Approx(1.5));
      CHECK(e.at("dur").get<double>() == Approx(2.75));
    } else {
      CHECK(e.at("name") == "step \"1\"");
      CHECK(e.at("dur").get<double>() >= 1000.0);
    }
  }
  CHECK(complete == 2);
  CHECK(named_rank);

  auto const path = mgpu::test::temp_path("mgpu_timeline_test.json");
  timeline.write_chrome_trace(path.string());
  std::ifstream in(path);
  CHECK(nlohmann::json::parse(in).at("traceEvents").size() == json.at("traceEvents").size());
  std::filesystem::remove(path);
  REQUIRE_MGPU_ERROR(timeline.write_chrome_trace("/nonexistent-dir/x.json"), mgpu::Errc::io, "/nonexistent-dir/x.json");
}
