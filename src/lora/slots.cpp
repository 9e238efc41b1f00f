// SlotTable: allocates every slot stack once, through the Backend, and copies adapters in and out.
// A slot's rank-r A occupies rows [0, r) of its [Rcap, in] block and its B columns [0, r) of [out, Rcap];
// everything else in the slot is zero (load writes the padding, clear zeroes the slot), so a kernel that
// ran over the full capacity would still compute the exact delta.
#include "lora/slots.h"

#include <algorithm>
#include <cstring>

#include "core/host_parallel.h"

#include "lora/adapter_internal.h"

namespace lmx::lora {

using ops::LoraTarget;

namespace {

bool target_present(const BaseModelShapes& base, LoraTarget target) {
  const int in = base.in_features[size_t(target)], out = base.out_features[size_t(target)];
  if (in <= 0 || out <= 0) return false;
  return !detail::is_moe_target(target) || base.num_experts > 0;
}

int target_capacity(LoraTarget target, int max_rank) { return target == LoraTarget::kMoeGateUp ? 2 * max_rank : max_rank; }

std::string slot_where(const Adapter& adapter, int layer, LoraTarget target) {
  return "adapter '" + adapter.name + "' layer " + std::to_string(layer) + " " +
         std::string(detail::target_label(target));
}

}  // namespace

SlotTable::SlotTable(ops::Backend& backend, const BaseModelShapes& base, int num_slots, int max_rank)
    : backend_(backend), base_(base), num_slots_(num_slots) {
  LMX_CHECK(num_slots >= 1 && max_rank >= 1);  // engine limits are validated before this is built
  const DType dtype = backend.lora_dtype();
  const int64_t S = num_slots, E = base.num_experts;
  layers_.resize(size_t(base.num_layers));
  for (auto& layer : layers_) {
    for (int t = 0; t < ops::kNumLoraTargets; ++t) {
      const LoraTarget target = LoraTarget(t);
      if (!target_present(base, target)) continue;
      Target& slot = layer[size_t(t)];
      const int64_t in = base.in_features[size_t(t)], out = base.out_features[size_t(t)];
      slot.capacity = target_capacity(target, max_rank);
      const int64_t R = slot.capacity;
      if (detail::is_moe_target(target)) {
        slot.a = backend.empty(dtype, {S, E, R, in});   // [S, E, R, in]
        slot.b = backend.empty(dtype, {S, E, out, R});  // [S, E, out, R]
      } else {
        slot.a = backend.empty(dtype, {S, R, in});   // [S, R, in]
        slot.b = backend.empty(dtype, {S, out, R});  // [S, out, R]
      }
      slot.rank = backend.empty(DType::I32, {S});  // [S] i32
      backend.fill_zero(slot.a);
      backend.fill_zero(slot.b);
      backend.fill_zero(slot.rank);
      slot.host_rank.assign(size_t(S), 0);
    }
  }
}

uint64_t SlotTable::device_bytes(const BaseModelShapes& base, int num_slots, int max_rank, DType dtype) {
  uint64_t per_layer = 0;  // one slot's A and B over every target, plus each target's rank entry
  for (int t = 0; t < ops::kNumLoraTargets; ++t) {
    const LoraTarget target = LoraTarget(t);
    if (!target_present(base, target)) continue;
    const uint64_t in = uint64_t(base.in_features[size_t(t)]), out = uint64_t(base.out_features[size_t(t)]);
    const uint64_t experts = detail::is_moe_target(target) ? uint64_t(base.num_experts) : 1;
    per_layer += experts * uint64_t(target_capacity(target, max_rank)) * (in + out) * dtype_size(dtype) + 4;
  }
  return per_layer * uint64_t(num_slots) * uint64_t(base.num_layers);
}

size_t SlotImage::bytes() const {
  size_t n = 0;
  for (const auto& layer : layers)
    for (const Block& block : layer) n += block.a.view.nbytes() + block.b.view.nbytes();
  return n;
}

Result<SlotImage> SlotTable::prepare(const Adapter& adapter) const {
  if (adapter.layers.size() != layers_.size())
    return invalid_argument("adapter '" + adapter.name + "' has " + std::to_string(adapter.layers.size()) +
                            " layers, the base model " + std::to_string(layers_.size()));
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (int t = 0; t < ops::kNumLoraTargets; ++t) {
      const auto& pair = adapter.layers[l][size_t(t)];
      if (!pair) continue;
      const LoraTarget target = LoraTarget(t);
      const Target& dst = layers_[l][size_t(t)];
      const std::string where = slot_where(adapter, int(l), target);
      if (dst.capacity == 0) return invalid_argument(where + ": the base model has no such target");
      if (pair->rank < 1 || pair->rank > dst.capacity)
        return out_of_range(where + ": rank " + std::to_string(pair->rank) + " does not fit the slot capacity " +
                            std::to_string(dst.capacity) + " (--max-lora-rank" +
                            (target == LoraTarget::kMoeGateUp ? ", doubled for merged gate/up)" : ")"));
      const int64_t in = base_.in_features[size_t(t)], out = base_.out_features[size_t(t)];
      const int64_t r = pair->rank, E = base_.num_experts;
      const Tensor& a = pair->a.view;
      const Tensor& b = pair->b.view;
      const bool expert = detail::is_moe_target(target);
      const bool a_ok = a.dtype == DType::F32 && (expert ? a.ndim == 3 && a.shape[0] == E && a.shape[1] == r && a.shape[2] == in
                                                         : a.ndim == 2 && a.shape[0] == r && a.shape[1] == in);
      const bool b_ok = b.dtype == DType::F32 && (expert ? b.ndim == 3 && b.shape[0] == E && b.shape[1] == out && b.shape[2] == r
                                                         : b.ndim == 2 && b.shape[0] == out && b.shape[1] == r);
      if (!a_ok || !b_ok)
        return invalid_argument(where + ": expected a " + (expert ? "[E, R, in] / [E, out, R]" : "[R, in] / [out, R]") +
                                " f32 pair with E=" + std::to_string(E) + " R=" + std::to_string(r) + " in=" +
                                std::to_string(in) + " out=" + std::to_string(out) + ", found a " + a.shape_str() +
                                ", b " + b.shape_str());
    }
  }
  // Each block in the slot's dtype, padding zeroed, experts converted in parallel: a GPT-OSS-20B rank-32
  // adapter is ~576M slot elements, which one thread converting through f32 staging took ~1.8 s for, on
  // the engine thread (perf-log run 16); prepared on the loader's worker it costs the engine nothing.
  const DType dtype = backend_.lora_dtype();
  LMX_CHECK(dtype == DType::F32 || dtype == DType::BF16);  // the two lora dtypes a backend declares
  SlotImage image;
  image.layers.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (int t = 0; t < ops::kNumLoraTargets; ++t) {
      const auto& pair = adapter.layers[l][size_t(t)];
      const Target& dst = layers_[l][size_t(t)];
      if (!pair || dst.capacity == 0) continue;
      SlotImage::Block& block = image.layers[l][size_t(t)];
      const Tensor slot_a = dst.a.view.row(0), slot_b = dst.b.view.row(0);  // shapes of one slot
      block.a = OwnedTensor::host_like(slot_a, dtype);
      block.b = OwnedTensor::host_like(slot_b, dtype);
      block.rank = pair->rank;
      const int64_t experts = detail::is_moe_target(LoraTarget(t)) ? base_.num_experts : 1;
      const int64_t R = dst.capacity, r = pair->rank;
      const int64_t in = base_.in_features[size_t(t)], out = base_.out_features[size_t(t)];
      const float* a_src = pair->a.view.ptr<float>();  // [E, r, in] f32
      const float* b_src = pair->b.view.ptr<float>();  // [E, out, r] f32
      auto stage = [&](auto* a_dst, auto* b_dst, auto convert) {  // a_dst [E, R, in], b_dst [E, out, R]
        const auto zero = convert(0.0f);
        parallel_for(experts, 1, [&](int64_t e_begin, int64_t e_end) {
          for (int64_t e = e_begin; e < e_end; ++e) {
            auto* a = a_dst + e * R * in;
            const float* a_in = a_src + e * r * in;
            for (int64_t i = 0; i < r * in; ++i) a[i] = convert(a_in[i]);
            std::fill(a + r * in, a + R * in, zero);
            for (int64_t o = 0; o < out; ++o) {
              auto* b = b_dst + (e * out + o) * R;
              const float* b_in = b_src + (e * out + o) * r;
              for (int64_t j = 0; j < r; ++j) b[j] = convert(b_in[j]);
              std::fill(b + r, b + R, zero);
            }
          }
        });
      };
      if (dtype == DType::F32) {
        stage(block.a.view.ptr<float>(), block.b.view.ptr<float>(), [](float v) { return v; });
      } else {
        stage(block.a.view.ptr<bf16>(), block.b.view.ptr<bf16>(), [](float v) { return f32_to_bf16(v); });
      }
    }
  }
  return image;
}

Status SlotTable::load(int slot, const Adapter& adapter) {
  LMX_ASSIGN_OR_RETURN(SlotImage image, prepare(adapter));
  return load(slot, image);
}

Status SlotTable::load(int slot, const SlotImage& image) {
  if (slot < 0 || slot >= num_slots_)
    return out_of_range("slot " + std::to_string(slot) + " is out of range: the table has " + std::to_string(num_slots_) +
                        " slots");
  if (image.layers.size() != layers_.size())
    return invalid_argument("slot image has " + std::to_string(image.layers.size()) + " layers, the table " +
                            std::to_string(layers_.size()));
  // Check every block against the slot before touching it, so a refused image leaves the slot as it was.
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (int t = 0; t < ops::kNumLoraTargets; ++t) {
      const SlotImage::Block& block = image.layers[l][size_t(t)];
      if (!block.a.view.defined()) continue;
      const Target& dst = layers_[l][size_t(t)];
      const bool fits = dst.capacity > 0 && block.rank >= 1 && block.rank <= dst.capacity &&
                        block.a.view.dtype == dst.a.view.dtype && block.b.view.dtype == dst.b.view.dtype &&
                        block.a.view.same_shape(dst.a.view.row(slot)) && block.b.view.same_shape(dst.b.view.row(slot));
      if (!fits)
        return invalid_argument("slot image layer " + std::to_string(l) + " " +
                                std::string(ops::lora_target_name(LoraTarget(t))) + ": a " + block.a.view.shape_str() +
                                " / b " + block.b.view.shape_str() + " rank " + std::to_string(block.rank) +
                                " was not prepared for this table (slot a " + dst.a.view.row(slot).shape_str() + ")");
    }
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (int t = 0; t < ops::kNumLoraTargets; ++t) {
      Target& dst = layers_[l][size_t(t)];
      if (dst.capacity == 0) continue;
      const SlotImage::Block& block = image.layers[l][size_t(t)];
      const Tensor slot_a = dst.a.view.row(slot);  // [E, R, in] or [R, in]
      const Tensor slot_b = dst.b.view.row(slot);  // [E, out, R] or [out, R]
      const bool present = block.a.view.defined();
      if (!present) {
        if (dst.host_rank[size_t(slot)] != 0) {
          backend_.fill_zero(slot_a);
          backend_.fill_zero(slot_b);
        }
      } else {
        backend_.copy(slot_a, block.a.view);
        backend_.copy(slot_b, block.b.view);
      }
      const int32_t rank = present ? block.rank : 0;
      if (dst.host_rank[size_t(slot)] != rank || present) {
        dst.host_rank[size_t(slot)] = rank;
        backend_.copy(dst.rank.view.rows(slot, slot + 1), Tensor(&dst.host_rank[size_t(slot)], DType::I32, {1}));
      }
    }
  }
  return Status::Ok();
}

void SlotTable::clear(int slot) {
  LMX_CHECK(slot >= 0 && slot < num_slots_);  // slots are chosen by the engine, never by a user
  for (auto& layer : layers_) {
    for (Target& dst : layer) {
      if (dst.capacity == 0 || dst.host_rank[size_t(slot)] == 0) continue;
      backend_.fill_zero(dst.a.view.row(slot));
      backend_.fill_zero(dst.b.view.row(slot));
      dst.host_rank[size_t(slot)] = 0;
      backend_.fill_zero(dst.rank.view.rows(slot, slot + 1));
    }
  }
}

ops::LoraStack SlotTable::stack(int layer, LoraTarget target) const {
  LMX_CHECK(layer >= 0 && layer < int(layers_.size()));
  const Target& t = layers_[size_t(layer)][size_t(target)];
  if (t.capacity == 0) return {};
  bool any = std::any_of(t.host_rank.begin(), t.host_rank.end(), [](int32_t r) { return r > 0; });
  if (!any) return {};
  return ops::LoraStack{.a = t.a.view, .b = t.b.view, .rank = t.rank.view, .host_rank = t.host_rank};
}

}  // namespace lmx::lora
