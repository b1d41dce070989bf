// Internal: the CSV reading the cluster module's trace, nodes and pods files share.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace mgpu::cluster::detail {

/// Splits one CSV line into fields (double quotes group commas; carriage returns are dropped).
std::vector<std::string> split_csv(std::string const& line);
/// Throws Error(corrupt_data) "path:line: what".
[[noreturn]] void corrupt(std::filesystem::path const& path, std::size_t line, std::string const& what);
/// A finite number, else corrupt() naming the column and the text.
double number(std::filesystem::path const& path, std::size_t line, std::string const& column, std::string const& text);

/// A CSV file's header: column(name) is the index of a column, or corrupt() on line 1 when a
/// required one is missing (-1 for a missing optional one or an empty name).
class CsvHeader {
 public:
  CsvHeader(std::filesystem::path path, std::string const& line);
  [[nodiscard]] int column(std::string const& name, bool required) const;
  [[nodiscard]] std::size_t size() const noexcept { return names_.size(); }

 private:
  std::filesystem::path path_;
  std::vector<std::string> names_;
};

}  // namespace mgpu::cluster::detail
