// CSV reading shared by the cluster module's file formats (job traces, nodes, pods).
#include "csv.hpp"

#include <cmath>
#include <cstdlib>

#include <mgpu/core/error.hpp>

namespace mgpu::cluster::detail {

std::vector<std::string> split_csv(std::string const& line) {
  std::vector<std::string> fields;
  std::string field;
  bool quoted = false;
  for (char c : line) {
    if (c == '"') {
      quoted = !quoted;
    } else if (c == ',' && !quoted) {
      fields.push_back(field);
      field.clear();
    } else if (c != '\r') {
      field += c;
    }
  }
  fields.push_back(field);
  return fields;
}

void corrupt(std::filesystem::path const& path, std::size_t line, std::string const& what) {
  throw Error(Errc::corrupt_data, path.string() + ":" + std::to_string(line) + ": " + what);
}

double number(std::filesystem::path const& path, std::size_t line, std::string const& column, std::string const& text) {
  char* end = nullptr;
  double const value = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(value))
    corrupt(path, line, "column '" + column + "' is '" + text + "' (expected a number)");
  return value;
}

CsvHeader::CsvHeader(std::filesystem::path path, std::string const& line)
    : path_(std::move(path)), names_(split_csv(line)) {}

int CsvHeader::column(std::string const& name, bool required) const {
  if (name.empty()) return -1;
  for (std::size_t i = 0; i < names_.size(); ++i) {
    if (names_[i] == name) return static_cast<int>(i);
  }
  if (required)
    corrupt(path_, 1, "no column named '" + name + "' in the header (expected it, or a mapping to another name)");
  return -1;
}

}  // namespace mgpu::cluster::detail
