// ScopedEnv: sets an environment variable for one scope, then restores it (the tests of one
// process run one at a time).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace mgpu::test {

class ScopedEnv {
 public:
  ScopedEnv(char const* name, char const* value) : name_(name) {
    if (char const* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ScopedEnv(ScopedEnv const&) = delete;
  ScopedEnv& operator=(ScopedEnv const&) = delete;
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  char const* name_;
  std::optional<std::string> old_;
};

}  // namespace mgpu::test
