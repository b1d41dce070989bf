// Atomic whole-file writes: temporary file, fsync, rename, fsync of the folder.
#include "core/atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include <mgpu/core/error.hpp>

namespace mgpu::detail {
namespace {

[[noreturn]] void fail_io(std::string const& what, std::filesystem::path const& path) {
  throw Error(Errc::io, what + " " + path.string() + ": " + std::strerror(errno));
}

void write_all(int fd, std::span<std::byte const> bytes, std::filesystem::path const& path) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    ssize_t const n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_io("writing", path);
    }
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace

void write_file_atomically(std::filesystem::path const& path, std::span<std::byte const> bytes, Durability durability) {
  std::filesystem::path const dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  std::filesystem::path const temp = dir / ("." + path.filename().string() + ".tmp." + std::to_string(::getpid()));
  int const fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail_io("creating", temp);
  try {
    write_all(fd, bytes, temp);
    if (durability == Durability::synced && ::fsync(fd) != 0) fail_io("syncing", temp);
  } catch (...) {
    ::close(fd);
    ::unlink(temp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(temp.c_str());
    fail_io("closing", temp);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    int const saved = errno;
    ::unlink(temp.c_str());
    errno = saved;
    fail_io("renaming into", path);
  }
  if (durability != Durability::synced) return;
  int const dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {  // makes the rename durable
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace mgpu::detail
