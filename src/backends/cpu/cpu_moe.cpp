// CPU reference of ops/routing.h, ops/moe.h and ops/lora.h: router top-k, the routed-expert block with
// per-(slot, expert) LoRA, and the dense multi-LoRA op. One (token, k) pair at a time, exactly the
// formula in moe.h; intermediates stay fp32.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"

namespace lmx::cpu {
namespace {

// The k entries of `values` to keep: descending value, ties to the lower index.
std::vector<int32_t> top_k_indices(const float* values, int64_t n, int k) {
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int32_t a, int32_t b) { return values[a] > values[b] || (values[a] == values[b] && a < b); });
  order.resize(k);
  return order;
}

// One matrix of a slot-stacked LoRA: A [R, in] and B [out, R] at `matrix` (slot, or slot * E + expert).
// y[o] += Σ_{r < rank} B[o][r] · z[r] with z[r] = A[r]·x; `z` is scratch of at least `rank` floats.
template <typename W>
void lora_apply_typed(const ops::LoraStack& w, int64_t matrix, int rank, const float* x, float* y, float* z) {
  const int64_t in = w.a.dim(-1), capacity = w.b.dim(-1), out = w.b.dim(-2);
  const W* a = w.a.ptr<W>() + matrix * capacity * in;   // [R, in] f32 or bf16
  const W* b = w.b.ptr<W>() + matrix * out * capacity;  // [out, R] f32 or bf16
  for (int r = 0; r < rank; ++r) z[r] = dot(x, a + r * in, in);
  for (int64_t o = 0; o < out; ++o) y[o] += dot(z, b + o * capacity, rank);
}

void lora_apply(const ops::LoraStack& w, int64_t matrix, int rank, const float* x, float* y, float* z) {
  if (w.a.dtype == DType::BF16) {
    lora_apply_typed<bf16>(w, matrix, rank, x, y, z);
  } else {
    lora_apply_typed<float>(w, matrix, rank, x, y, z);
  }
}

// token_slot in [-1, S) and every rank in [0, R]; `name` is the stack's Params field.
void validate_lora_slots(const ops::LoraStack& w, const Tensor& token_slot, const char* name, const char* op) {
  if (!w.defined()) return;
  const int64_t slots = w.rank.dim(0), capacity = w.b.dim(-1);
  const int32_t* rank = w.rank.ptr<int32_t>();
  for (int64_t s = 0; s < slots; ++s) {
    if (rank[s] < 0 || rank[s] > capacity) {
      contract_violation(op, std::string(name) + ".rank[" + std::to_string(s) + "] = " + std::to_string(rank[s]) +
                                 " outside [0, R = " + std::to_string(capacity) + "]");
    }
  }
  const int32_t* slot_of = token_slot.ptr<int32_t>();
  for (int64_t t = 0; t < token_slot.dim(0); ++t) {
    if (slot_of[t] < -1 || slot_of[t] >= slots) {
      contract_violation(op, "token_slot[" + std::to_string(t) + "] = " + std::to_string(slot_of[t]) +
                                 " outside [-1, S = " + std::to_string(slots) + ") of " + name);
    }
  }
}

}  // namespace

void CpuBackend::router_topk(const ops::RouterTopKParams& p) {
  ops::require(ops::check(p), "router_topk");
  require_host_f32(p.logits, "RouterTopKParams.logits", "router_topk");
  const int64_t tokens = p.logits.dim(0), experts = p.logits.dim(1);
  const int k = p.top_k;
  std::vector<float> probs(experts);  // [E] f32
  for (int64_t t = 0; t < tokens; ++t) {
    const float* logits = p.logits.ptr<float>() + t * experts;  // [E] f32
    int32_t* ids = p.topk_ids.ptr<int32_t>() + t * k;           // [K] i32
    float* weights = p.topk_weights.ptr<float>() + t * k;       // [K] f32
    require_no_nan(logits, experts, "RouterTopKParams.logits", t, "router_topk");
    if (p.rule == ops::RoutingRule::kSoftmaxThenTopK) {
      const float max_logit = *std::max_element(logits, logits + experts);
      float sum = 0.0f;
      for (int64_t e = 0; e < experts; ++e) {
        probs[e] = std::exp(logits[e] - max_logit);
        sum += probs[e];
      }
      for (int64_t e = 0; e < experts; ++e) probs[e] /= sum;
      const std::vector<int32_t> chosen = top_k_indices(probs.data(), experts, k);
      float chosen_sum = 0.0f;
      for (int i = 0; i < k; ++i) chosen_sum += probs[chosen[i]];
      for (int i = 0; i < k; ++i) {
        ids[i] = chosen[i];
        weights[i] = p.renormalize ? probs[chosen[i]] / chosen_sum : probs[chosen[i]];
      }
    } else {  // kTopKThenSoftmax: the chosen logits are already in descending order
      const std::vector<int32_t> chosen = top_k_indices(logits, experts, k);
      const float max_logit = logits[chosen[0]];
      float sum = 0.0f;
      for (int i = 0; i < k; ++i) {
        weights[i] = std::exp(logits[chosen[i]] - max_logit);
        sum += weights[i];
      }
      for (int i = 0; i < k; ++i) {
        ids[i] = chosen[i];
        weights[i] /= sum;
      }
    }
  }
}

// Exactly moe.h's formula, one (token, k) pair at a time; out[t] accumulates the pairs in k order.
void CpuBackend::moe(const ops::MoeParams& p) {
  ops::require(ops::check(p), "moe");
  require_host_f32(p.x, "MoeParams.x", "moe");
  const int64_t tokens = p.x.dim(0), hidden = p.x.dim(1), top_k = p.topk_ids.dim(1);
  const int64_t experts = p.gate_up.dim(0), inter = p.down.dim(2);
  const int32_t* topk_ids = p.topk_ids.ptr<int32_t>();  // [T, K] i32
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    if (topk_ids[i] < 0 || topk_ids[i] >= experts) {
      contract_violation("moe", "topk_ids[" + std::to_string(i / top_k) + "][" + std::to_string(i % top_k) + "] = " +
                                    std::to_string(topk_ids[i]) + " outside [0, E = " + std::to_string(experts) + ")");
    }
  }
  validate_lora_slots(p.lora_gate_up, p.token_slot, "MoeParams.lora_gate_up", "moe");
  validate_lora_slots(p.lora_down, p.token_slot, "MoeParams.lora_down", "moe");

  const float* x = p.x.ptr<float>();                                // [T, H] f32
  const float* topk_weights = p.topk_weights.ptr<float>();          // [T, K] f32
  const int32_t* token_slot = optional_ptr<int32_t>(p.token_slot);  // [T] i32
  const bf16* gate_up = p.gate_up.ptr<bf16>();                      // [E, 2I, H] bf16
  const bf16* gate_up_bias = optional_ptr<bf16>(p.gate_up_bias);    // [E, 2I] bf16
  const bf16* down = p.down.ptr<bf16>();                            // [E, H, I] bf16
  const bf16* down_bias = optional_ptr<bf16>(p.down_bias);          // [E, H] bf16
  float* out = p.out.ptr<float>();                                  // [T, H] f32

  // The slot's true rank on a stack, 0 when the token has no adapter or the stack is absent.
  auto rank_of = [&](const ops::LoraStack& w, int32_t slot) {
    return (w.defined() && slot >= 0) ? w.rank.ptr<int32_t>()[slot] : 0;
  };
  // Activation input: which of the 2I rows of h are gate i and up i.
  auto gate_row = [&](int64_t i) { return p.layout == ops::GateUpLayout::kHalves ? i : 2 * i; };
  auto up_row = [&](int64_t i) { return p.layout == ops::GateUpLayout::kHalves ? inter + i : 2 * i + 1; };
  int64_t max_rank = 0;
  if (p.lora_gate_up.defined()) max_rank = std::max(max_rank, p.lora_gate_up.b.dim(-1));
  if (p.lora_down.defined()) max_rank = std::max(max_rank, p.lora_down.b.dim(-1));

  pool_.parallel_for(tokens, 6 * top_k * inter * hidden, [&](int64_t begin, int64_t end) {
    std::vector<float> h(2 * inter);  // [2I] f32 gate_up projection
    std::vector<float> act(inter);    // [I] f32
    std::vector<float> d(hidden);     // [H] f32 down projection
    std::vector<float> acc(hidden);   // [H] f32 Σ_k w · d
    std::vector<float> z(max_rank);   // [R] f32 LoRA shrink
    for (int64_t t = begin; t < end; ++t) {
      const float* x_row = x + t * hidden;
      const int32_t slot = token_slot ? token_slot[t] : -1;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t e = topk_ids[t * top_k + k];
        // h = W_gu[e]·x + b_gu[e] + B_gu[s,e]·(A_gu[s,e]·x)
        for (int64_t r = 0; r < 2 * inter; ++r) {
          h[r] = dot(x_row, gate_up + (e * 2 * inter + r) * hidden, hidden);
          if (gate_up_bias) h[r] += bf16_to_f32(gate_up_bias[e * 2 * inter + r]);
        }
        if (const int rank = rank_of(p.lora_gate_up, slot); rank > 0) {
          lora_apply(p.lora_gate_up, int64_t(slot) * experts + e, rank, x_row, h.data(), z.data());
        }
        // a = act(h)
        for (int64_t i = 0; i < inter; ++i) {
          float gate = h[gate_row(i)], up = h[up_row(i)];
          if (p.activation == ops::MoeActivation::kSiluGated) {
            act[i] = silu(gate) * up;
          } else {  // kGptOssClamped, as GptOssExperts._apply_gate
            gate = std::min(gate, p.swiglu_limit);
            up = std::clamp(up, -p.swiglu_limit, p.swiglu_limit);
            act[i] = (up + 1.0f) * (gate * sigmoid(gate * p.swiglu_alpha));
          }
        }
        // d = W_d[e]·a + b_d[e] + B_d[s,e]·(A_d[s,e]·a)
        for (int64_t o = 0; o < hidden; ++o) {
          d[o] = dot(act.data(), down + (e * hidden + o) * inter, inter);
          if (down_bias) d[o] += bf16_to_f32(down_bias[e * hidden + o]);
        }
        if (const int rank = rank_of(p.lora_down, slot); rank > 0) {
          lora_apply(p.lora_down, int64_t(slot) * experts + e, rank, act.data(), d.data(), z.data());
        }
        const float weight = topk_weights[t * top_k + k];
        for (int64_t o = 0; o < hidden; ++o) acc[o] += weight * d[o];
      }
      std::copy(acc.begin(), acc.end(), out + t * hidden);
    }
  });
}

// y[t] += B[s][:, :r]·(A[s][:r]·x[t]) for s = token_slot[t] >= 0 and r = rank[s] > 0.
void CpuBackend::lora(const ops::LoraParams& p) {
  ops::require(ops::check(p), "lora");
  require_host_f32(p.x, "LoraParams.x", "lora");
  if (!p.w.defined()) return;  // no resident adapter targets this projection
  validate_lora_slots(p.w, p.token_slot, "LoraParams.w", "lora");
  const int64_t tokens = p.x.dim(0), in = p.x.dim(1), out_features = p.y.dim(1), capacity = p.w.b.dim(-1);
  const float* x = p.x.ptr<float>();                        // [T, in] f32
  const int32_t* token_slot = p.token_slot.ptr<int32_t>();  // [T] i32
  const int32_t* rank = p.w.rank.ptr<int32_t>();            // [S] i32
  float* y = p.y.ptr<float>();                              // [T, out] f32
  pool_.parallel_for(tokens, 2 * capacity * (in + out_features), [&](int64_t begin, int64_t end) {
    std::vector<float> z(capacity);  // [R] f32
    for (int64_t t = begin; t < end; ++t) {
      const int32_t slot = token_slot[t];
      if (slot < 0 || rank[slot] == 0) continue;
      lora_apply(p.w, slot, rank[slot], x + t * in, y + t * out_features, z.data());
    }
  });
}

}  // namespace lmx::cpu
