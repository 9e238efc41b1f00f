// Adapter assignment and arrival schedule (see schedule.h).
#include "loadgen/schedule.h"

#include <cmath>

#include "core/rng.h"

namespace lmx::loadgen {

double unit_interval(uint64_t bits) { return double(bits >> 11) * (1.0 / 9007199254740992.0); }

Result<Assignment> parse_assignment(const std::string& text, double base_fraction) {
  if (!(base_fraction >= 0.0 && base_fraction <= 1.0))
    return invalid_argument("--base-fraction must be in [0, 1], found " + std::to_string(base_fraction));
  Assignment a{.base_fraction = base_fraction};
  if (text == "round-robin") {
    a.policy = AssignmentPolicy::kRoundRobin;
  } else if (text == "random") {
    a.policy = AssignmentPolicy::kRandom;
  } else if (text.rfind("zipf:", 0) == 0) {
    a.policy = AssignmentPolicy::kZipf;
    const std::string exponent = text.substr(5);
    size_t used = 0;
    try {
      a.zipf_exponent = std::stod(exponent, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != exponent.size() || !(a.zipf_exponent > 0) || !std::isfinite(a.zipf_exponent))
      return invalid_argument("--lora-assignment zipf:S needs a positive number S, found '" + text + "'");
  } else {
    return invalid_argument("--lora-assignment must be round-robin, random or zipf:S, found '" + text + "'");
  }
  return a;
}

std::vector<int> assign_targets(int num_requests, int num_adapters, const Assignment& a, uint64_t seed) {
  std::vector<int> targets(size_t(std::max(num_requests, 0)), -1);
  if (num_adapters <= 0) return targets;
  if (a.policy == AssignmentPolicy::kRoundRobin) {
    int next_adapter = 0;
    for (int i = 0; i < num_requests; ++i) {
      const bool base = std::floor(double(i + 1) * a.base_fraction) > std::floor(double(i) * a.base_fraction);
      if (base) continue;
      targets[size_t(i)] = next_adapter;
      next_adapter = (next_adapter + 1) % num_adapters;
    }
    return targets;
  }
  // Cumulative weights of the adapters: uniform for random, 1/(k+1)^S for Zipf.
  std::vector<double> cumulative(static_cast<size_t>(num_adapters));
  double total = 0;
  for (int k = 0; k < num_adapters; ++k) {
    total += a.policy == AssignmentPolicy::kZipf ? 1.0 / std::pow(double(k + 1), a.zipf_exponent) : 1.0;
    cumulative[size_t(k)] = total;
  }
  Rng rng(mix64(seed ^ 0x61646170746572ull));  // "adapter": a stream apart from the dataset's and arrivals'
  for (int i = 0; i < num_requests; ++i) {
    if (unit_interval(rng.next_u64()) < a.base_fraction) continue;
    const double u = unit_interval(rng.next_u64()) * total;
    int k = 0;
    while (k + 1 < num_adapters && u >= cumulative[size_t(k)]) ++k;
    targets[size_t(i)] = k;
  }
  return targets;
}

std::vector<double> poisson_arrivals(int num_requests, double rate, uint64_t seed) {
  std::vector<double> times(size_t(std::max(num_requests, 0)), 0.0);
  if (!std::isfinite(rate)) return times;
  // The first request goes at time 0 and each later one after an exponential gap of mean 1/rate, as
  // vLLM's generator sleeps after yielding a request.
  Rng rng(mix64(seed ^ 0x61727269766cull));  // "arrivl"
  double now = 0;
  for (size_t i = 0; i < times.size(); ++i) {
    times[i] = now;
    now += -std::log1p(-unit_interval(rng.next_u64())) / rate;
  }
  return times;
}

}  // namespace lmx::loadgen
