// Timeline recording and Chrome trace-event export.
#include <mgpu/trace/timeline.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>
#include <tuple>
#include <utility>

#include <mgpu/core/error.hpp>

namespace mgpu::trace {
namespace {

std::int64_t steady_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void append_escaped(std::string& out, std::string_view text) {
  out += '"';
  for (char const c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

// Microseconds with nanosecond precision, as the trace format's "ts" and "dur" expect.
void append_us(std::string& out, std::int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld.%03lld", static_cast<long long>(ns / 1000), static_cast<long long>(ns % 1000));
  out += buf;
}

}  // namespace

std::string lane_name(int lane) {
  switch (lane) {
    case Lane::compute: return "compute";
    case Lane::communication: return "communication";
    case Lane::host: return "host";
    default: return "lane " + std::to_string(lane);
  }
}

Timeline::Timeline() : origin_ns_(steady_ns()) {}

std::int64_t Timeline::now_ns() const noexcept { return steady_ns() - origin_ns_; }

void Timeline::record(Span span) {
  if (!enabled()) return;
  std::lock_guard lock(mutex_);
  spans_.push_back(std::move(span));
}

Span* Timeline::open(Span span) {
  std::lock_guard lock(mutex_);
  if (free_slots_.empty()) return &slots_.emplace_back(std::move(span));
  Span* const slot = free_slots_.back();
  free_slots_.pop_back();
  *slot = std::move(span);
  return slot;
}

void Timeline::close(Span* span, bool keep) {
  span->end_ns = now_ns();
  std::lock_guard lock(mutex_);
  if (keep && enabled()) spans_.push_back(std::move(*span));
  free_slots_.push_back(span);
}

Timeline::Scope::Scope(Timeline* timeline, std::string name, std::string_view category, int rank, int lane)
    : timeline_(timeline != nullptr && timeline->enabled() ? timeline : nullptr) {
  if (timeline_ == nullptr) return;
  span_ = Span{std::move(name), std::string(category), rank, lane, timeline_->now_ns(), 0};
}

Timeline::Scope::~Scope() {
  if (timeline_ == nullptr) return;
  span_.end_ns = timeline_->now_ns();
  try {
    timeline_->record(std::move(span_));
  } catch (...) {  // out of memory while tracing: the span is lost, the work is not
  }
}

std::vector<Span> Timeline::spans() const {
  std::vector<Span> copy;
  {
    std::lock_guard lock(mutex_);
    copy = spans_;
  }
  std::stable_sort(copy.begin(), copy.end(), [](Span const& a, Span const& b) {
    return std::tie(a.begin_ns, a.rank, a.lane) < std::tie(b.begin_ns, b.rank, b.lane);
  });
  return copy;
}

void Timeline::clear() {
  std::lock_guard lock(mutex_);
  spans_.clear();
}

std::string Timeline::chrome_trace_json() const {
  std::vector<Span> const all = spans();
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  auto const separator = [&] {
    if (!first) out += ",\n";
    first = false;
  };
  std::set<std::pair<int, int>> lanes;
  for (Span const& s : all) lanes.insert({s.rank, s.lane});
  std::set<int> ranks;
  for (auto const& [rank, lane] : lanes) {
    if (ranks.insert(rank).second) {
      separator();
      out += "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" + std::to_string(rank) + ",\"tid\":0,\"args\":{\"name\":";
      append_escaped(out, "rank " + std::to_string(rank));
      out += "}}";
    }
    separator();
    out += "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" + std::to_string(rank) + ",\"tid\":" + std::to_string(lane) +
           ",\"args\":{\"name\":";
    append_escaped(out, lane_name(lane));
    out += "}}";
  }
  for (Span const& s : all) {
    separator();
    out += "{\"ph\":\"X\",\"name\":";
    append_escaped(out, s.name);
    out += ",\"cat\":";
    append_escaped(out, s.category);
    out += ",\"pid\":" + std::to_string(s.rank) + ",\"tid\":" + std::to_string(s.lane) + ",\"ts\":";
    append_us(out, s.begin_ns);
    out += ",\"dur\":";
    append_us(out, std::max<std::int64_t>(0, s.end_ns - s.begin_ns));
    out += '}';
  }
  out += "]}\n";
  return out;
}

void Timeline::write_chrome_trace(std::string const& path) const {
  std::string const json = chrome_trace_json();
  std::string const temp = path + ".tmp";
  {
    std::ofstream file(temp, std::ios::binary | std::ios::trunc);
    if (!file) throw Error(Errc::io, "cannot open '" + temp + "' to write the trace (expected a writable path)");
    file.write(json.data(), static_cast<std::streamsize>(json.size()));
    file.close();
    if (!file) {
      std::remove(temp.c_str());
      throw Error(Errc::io, "cannot write the trace to '" + temp + "' (expected free space)");
    }
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    std::remove(temp.c_str());
    throw Error(Errc::io, "cannot rename '" + temp + "' to '" + path + "' (expected a writable directory)");
  }
}

}  // namespace mgpu::trace
