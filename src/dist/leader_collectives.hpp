// The hierarchical leader (internal: not installed): each process's first rank does a
// collective's exchange between processes, after the ranks inside the process have done their
// step (reduced to it, gathered, ...) and before the result is handed back to them.
#pragma once

#include <memory>

#include "comm/base.hpp"
#include "dist/link.hpp"

namespace mgpu::dist::detail {

// The leader's part of each collective: the exchange between processes, on the leader's stream
// after the in-process step. `local` holds the process's partial or data, as each kind needs.
struct Leader {
  std::shared_ptr<Link> link;
  Call call;
  int rank;
  // The exchange of `call`: all-reduce (call.recv holds the process's partial), reduce-scatter
  // (call.send: the partial over the world; call.recv: this process's blocks), all-gather
  // (call.recv: the whole result, this process's blocks filled), broadcast and reduce (call.root:
  // the root's process), barrier. Throws on a mismatch between the processes' headers, a timeout
  // or a transport failure, having aborted the communicator.
  void operator()() const;
};

}  // namespace mgpu::dist::detail
