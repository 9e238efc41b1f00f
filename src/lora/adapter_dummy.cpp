// make_dummy_adapter (seeded random adapters for benchmarks and tests) and describe_adapter (the text of
// `loramux inspect`). Neither touches files. Who calls: bench/CLI, tests.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>
#include <thread>
#include <vector>

#include "core/rng.h"
#include "lora/adapter.h"
#include "lora/adapter_internal.h"

namespace lmx::lora {

using ops::LoraTarget;

// A: kaiming-uniform-like, U(-1/sqrt(in), 1/sqrt(in)) as nn.Linear initialises lora_A. B: nonzero (PEFT
// starts B at zero, which would make the adapter a no-op) and large enough that each adapter visibly
// changes greedy continuations — a trained adapter's update is ~10-30% of the base projection, and so is
// this one's (|B·A·x| ≈ 0.27·|x| at r = 16). Scaling alpha = 2r, i.e. 2, folded into b.
Adapter make_dummy_adapter(const std::string& name, const BaseModelShapes& base, int rank, uint64_t seed,
                           DummyTargets which) {
  LMX_CHECK(rank >= 1);  // the CLI validates --rank; a bad value here is a programmer error
  constexpr float kBRange = 0.1f;
  const float scaling = 2.0f;  // alpha / r with alpha = 2r
  Adapter adapter;
  adapter.name = name;
  adapter.dir = "";
  adapter.base_model_name = "dummy:" + base.family;
  adapter.max_rank = rank;
  adapter.layers.assign(size_t(base.num_layers), {});
  const bool moe = base.num_experts > 0;
  adapter.format = moe ? AdapterFormat::kFusedParameters : AdapterFormat::kModules;  // the shape a PEFT one would have
  std::vector<LoraTarget> targets;
  if (which != DummyTargets::kMlp) targets = {LoraTarget::kQ, LoraTarget::kK, LoraTarget::kV, LoraTarget::kO};
  if (which != DummyTargets::kAttention && moe) {
    targets.push_back(LoraTarget::kMoeGateUp);
    targets.push_back(LoraTarget::kMoeDown);
  } else if (which != DummyTargets::kAttention) {
    targets.push_back(LoraTarget::kGate);
    targets.push_back(LoraTarget::kUp);
    targets.push_back(LoraTarget::kDown);
  }
  // Layers are generated in parallel: every (layer, target) has its own stream and its own slot in
  // adapter.layers, so the result does not depend on the thread count (a 48-layer × 128-expert adapter is
  // ~1.3 G numbers: tens of seconds on one core).
  auto make_layer = [&](int layer) {
    for (LoraTarget target : targets) {
      const int in = base.in_features[size_t(target)];
      const int out = base.out_features[size_t(target)];
      if (in <= 0 || out <= 0) continue;
      const bool expert = detail::is_moe_target(target);
      const int64_t E = expert ? base.num_experts : 1;
      // One stream per (seed, layer, target): adapters of different seeds, and layers of one adapter,
      // never share numbers.
      Rng rng(mix64(seed ^ mix64(uint64_t(layer) * 131 + uint64_t(target))));
      LoraPair pair;
      pair.rank = rank;
      pair.scaling = scaling;
      if (expert) {
        pair.a = OwnedTensor::host(DType::F32, {E, rank, in});
        pair.b = OwnedTensor::host(DType::F32, {E, out, rank});
      } else {
        pair.a = OwnedTensor::host(DType::F32, {rank, in});
        pair.b = OwnedTensor::host(DType::F32, {out, rank});
      }
      const float a_bound = 1.0f / std::sqrt(float(in));
      float* a = pair.a.view.ptr<float>();
      for (int64_t i = 0; i < pair.a.view.numel(); ++i) a[i] = rng.uniform(-a_bound, a_bound);
      float* b = pair.b.view.ptr<float>();
      for (int64_t i = 0; i < pair.b.view.numel(); ++i) b[i] = rng.uniform(-kBRange, kBRange) * scaling;
      adapter.layers[size_t(layer)][size_t(target)] = std::move(pair);
    }
  };
  const int threads = int(std::max(1u, std::min(std::thread::hardware_concurrency(), 16u)));
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&, w] {
      for (int layer = w; layer < base.num_layers; layer += threads) make_layer(layer);
    });
  }
  for (std::thread& t : pool) t.join();
  // Identity: everything the content depends on (not the name), so equal dummies share cache entries.
  detail::ContentHasher hasher;
  // (the targets join the recipe only when not all, so the default's hashes are those of before)
  const std::string recipe = "dummy-v1 family=" + base.family + " rank=" + std::to_string(rank) +
                             " seed=" + std::to_string(seed) + " layers=" + std::to_string(base.num_layers) +
                             " experts=" + std::to_string(base.num_experts) +
                             (which == DummyTargets::kAll         ? ""
                              : which == DummyTargets::kAttention ? " targets=attention"
                                                                  : " targets=mlp");
  hasher.add(recipe.data(), recipe.size());
  hasher.add(base.in_features.data(), sizeof(base.in_features));
  hasher.add(base.out_features.data(), sizeof(base.out_features));
  const uint8_t interleaved = base.gate_up_interleaved;
  hasher.add(&interleaved, 1);
  adapter.content_hash = hasher.hex();
  return adapter;
}

namespace {

// One layer's targets as text, e.g. "q_proj r=8 x2, experts.gate_up r=16 x2".
std::string layer_signature(const std::array<std::optional<LoraPair>, ops::kNumLoraTargets>& layer) {
  std::ostringstream os;
  bool first = true;
  for (int t = 0; t < ops::kNumLoraTargets; ++t) {
    if (!layer[size_t(t)]) continue;
    const LoraPair& p = *layer[size_t(t)];
    os << (first ? "" : ", ") << detail::target_label(LoraTarget(t)) << " r=" << p.rank;
    if (p.scaling != 0.0f) {
      os << " scale=" << p.scaling;
    } else {
      os << " scale=mixed";  // merged gate/up or experts with different alpha/r, folded per part
    }
    first = false;
  }
  return first ? "(none)" : os.str();
}

}  // namespace

std::string describe_adapter(const Adapter& adapter) {
  std::ostringstream os;
  os << "adapter:      " << adapter.name << "\n";
  if (!adapter.dir.empty()) os << "directory:    " << adapter.dir << "\n";
  os << "format:       "
     << (adapter.format == AdapterFormat::kFusedParameters ? "PEFT LoRA, fused expert parameters (target_parameters)"
                                                             : "PEFT LoRA, modules (target_modules)")
     << "\n";
  os << "base model:   " << (adapter.base_model_name.empty() ? "(not recorded)" : adapter.base_model_name) << "\n";
  os << "content hash: " << adapter.content_hash << "\n";
  os << "file bytes:   " << adapter.file_bytes << "\n";
  os << "max rank:     " << adapter.max_rank << "\n";
  size_t params = 0, pairs = 0;
  for (const auto& layer : adapter.layers)
    for (const auto& p : layer)
      if (p) {
        params += size_t(p->a.view.numel() + p->b.view.numel());
        ++pairs;
      }
  os << "parameters:   " << params << " in " << pairs << " A/B pairs (as loaded: f32, merged gate/up)\n";
  os << "targets per layer:\n";
  // Runs of layers with the same targets print once.
  size_t begin = 0;
  for (size_t l = 0; l <= adapter.layers.size(); ++l) {
    if (l < adapter.layers.size() && layer_signature(adapter.layers[l]) == layer_signature(adapter.layers[begin])) continue;
    if (l > begin) {
      os << "  layer" << (l - begin > 1 ? "s " : " ") << begin;
      if (l - begin > 1) os << "-" << (l - 1);
      os << ": " << layer_signature(adapter.layers[begin]) << "\n";
    }
    begin = l;
  }
  return os.str();
}

}  // namespace lmx::lora
