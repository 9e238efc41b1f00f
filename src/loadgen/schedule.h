// Who asks for what, and when: the adapter (or base model) of each request, and Poisson arrival times.
// Deterministic from the seed, platform-independent (core/rng.h, own transforms). Called by `bench serve`
// before any request is sent, so a run's plan is known up front and can be printed and checked.
#pragma once
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/status.h"

namespace lmx::loadgen {

enum class AssignmentPolicy { kRoundRobin, kRandom, kZipf };

struct Assignment {
  AssignmentPolicy policy = AssignmentPolicy::kRoundRobin;
  double zipf_exponent = 1.0;  // zipf:S — adapter k (0-based) drawn with weight 1 / (k + 1)^S
  double base_fraction = 0.0;  // share of requests sent to the base model, in [0, 1]
};

// "round-robin", "random" or "zipf:S" (S > 0); the error names the flag and the accepted forms.
Result<Assignment> parse_assignment(const std::string& text, double base_fraction);

// Target of each request: -1 = the base model, k = adapters[k]. With no adapters every request is base.
// round-robin: request i goes to base when floor((i + 1) F) > floor(i F) (base requests spread evenly,
// exactly floor(N F) of them), the others cycle over the adapters in order. random / zipf: each request
// independently base with probability F, else an adapter drawn uniformly / by Zipf weights.
std::vector<int> assign_targets(int num_requests, int num_adapters, const Assignment& assignment, uint64_t seed);

constexpr double kInfiniteRate = std::numeric_limits<double>::infinity();

// Send times in seconds from the start: a Poisson process of `rate` requests/s (the first at 0, then
// exponential gaps of mean 1/rate, as vLLM's generator), all 0 for an infinite rate (everything at once).
std::vector<double> poisson_arrivals(int num_requests, double rate, uint64_t seed);

// Uniform double in [0, 1) with 53 bits from a 64-bit draw.
double unit_interval(uint64_t bits);

}  // namespace lmx::loadgen
