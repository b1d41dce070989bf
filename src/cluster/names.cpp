// The placement policies' and tie rules' names, for command lines and reports.
#include <mgpu/cluster/policy.hpp>

#include <iterator>
#include <string>

#include <mgpu/core/error.hpp>

namespace mgpu::cluster {
namespace {

constexpr FitPolicy policies[] = {FitPolicy::random,    FitPolicy::first_fit,   FitPolicy::best_fit,
                                  FitPolicy::worst_fit, FitPolicy::dot_product, FitPolicy::gpu_packing,
                                  FitPolicy::fgd};
constexpr TieRule rules[] = {TieRule::first, TieRule::random, TieRule::packed};

}  // namespace

std::string_view name_of(FitPolicy policy) noexcept {
  switch (policy) {
    case FitPolicy::random:
      return "random";
    case FitPolicy::first_fit:
      return "first-fit";
    case FitPolicy::best_fit:
      return "best-fit";
    case FitPolicy::worst_fit:
      return "worst-fit";
    case FitPolicy::dot_product:
      return "dot-product";
    case FitPolicy::gpu_packing:
      return "gpu-packing";
    case FitPolicy::fgd:
      return "fgd";
  }
  return "?";
}

std::string_view name_of(TieRule rule) noexcept {
  switch (rule) {
    case TieRule::first:
      return "first";
    case TieRule::random:
      return "random";
    case TieRule::packed:
      return "packed";
  }
  return "?";
}

FitPolicy fit_policy_named(std::string_view name) {
  std::string list;
  for (FitPolicy p : policies) {
    if (name_of(p) == name) return p;
    list += (list.empty() ? "" : ", ") + std::string(name_of(p));
  }
  throw Error(Errc::invalid_argument,
              "no placement policy named '" + std::string(name) + "' (expected one of: " + list + ")");
}

TieRule tie_rule_named(std::string_view name) {
  std::string list;
  for (TieRule r : rules) {
    if (name_of(r) == name) return r;
    list += (list.empty() ? "" : ", ") + std::string(name_of(r));
  }
  throw Error(Errc::invalid_argument, "no tie rule named '" + std::string(name) + "' (expected one of: " + list + ")");
}

std::vector<FitPolicy> all_fit_policies() { return {std::begin(policies), std::end(policies)}; }

}  // namespace mgpu::cluster
