// CPU reference of ops/rope.h and ops/attention.h: rotary embedding, KV-cache writes and paged causal
// attention (GQA, sliding window, GPT-OSS sinks). Softmax in fp32 with max subtraction, as transformers'
// eager attention does.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"

namespace lmx::cpu {

// Rotate-half (NeoX) layout: pair (i, i + D/2) turns by angle position·inv_freq[i]. The angle is an fp32
// product of the fp32 position and inverse frequency, as in transformers' rotary embedding.
void CpuBackend::rope(const ops::RopeParams& p) {
  ops::require(ops::check(p), "rope");
  if (p.has_qk_norm()) {  // the QK-norm as rms_norm on each head, then the rotation
    qk_norm(p);
    rope(ops::without_qk_norm(p));
    return;
  }
  require_host_f32(p.q, "RopeParams.q", "rope");
  const int64_t tokens = p.q.dim(0), q_heads = p.q.dim(1), kv_heads = p.k.dim(1), head_dim = p.q.dim(2);
  const int64_t half = head_dim / 2;
  const int32_t* positions = p.positions.ptr<int32_t>();  // [T] i32
  const float* inv_freq = p.inv_freq.ptr<float>();        // [D/2] f32
  float* q = p.q.ptr<float>();                            // [T, Hq, D] f32
  float* k = p.k.ptr<float>();                            // [T, Hkv, D] f32
  pool_.parallel_for(tokens, 6 * (q_heads + kv_heads) * head_dim, [&](int64_t begin, int64_t end) {
    std::vector<float> cos_table(half), sin_table(half);  // [D/2] f32
    auto rotate = [&](float* head) {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = head[i], x2 = head[i + half];
        head[i] = x1 * cos_table[i] - x2 * sin_table[i];
        head[i + half] = x2 * cos_table[i] + x1 * sin_table[i];
      }
    };
    for (int64_t t = begin; t < end; ++t) {
      const float position = float(positions[t]);
      for (int64_t i = 0; i < half; ++i) {
        const float angle = position * inv_freq[i];
        cos_table[i] = std::cos(angle) * p.attention_scaling;
        sin_table[i] = std::sin(angle) * p.attention_scaling;
      }
      for (int64_t h = 0; h < q_heads; ++h) rotate(q + (t * q_heads + h) * head_dim);
      for (int64_t h = 0; h < kv_heads; ++h) rotate(k + (t * kv_heads + h) * head_dim);
    }
  });
}

void CpuBackend::kv_write(const ops::KvWriteParams& p) {
  ops::require(ops::check(p), "kv_write");
  require_host_f32(p.k, "KvWriteParams.k", "kv_write");
  const int64_t tokens = p.k.dim(0);
  const int64_t cache_rows = p.k_cache.dim(0) * p.k_cache.dim(1);
  const int64_t row_elems = p.k.dim(1) * p.k.dim(2);             // Hkv * D
  const int32_t* write_index = p.kv_write_index.ptr<int32_t>();  // [T] i32
  for (int64_t t = 0; t < tokens; ++t) {
    if (write_index[t] < -1 || write_index[t] >= cache_rows) {
      contract_violation("kv_write", "kv_write_index[" + std::to_string(t) + "] = " + std::to_string(write_index[t]) +
                                         " outside [0, pages * P = " + std::to_string(cache_rows) + ") and not -1 (skip)");
    }
  }
  // Two tokens writing one cache row is a bookkeeping bug upstream (and a race on the GPU): refuse it.
  std::vector<int32_t> sorted_rows(write_index, write_index + tokens);
  std::sort(sorted_rows.begin(), sorted_rows.end());
  const auto repeated = std::adjacent_find(std::upper_bound(sorted_rows.begin(), sorted_rows.end(), -1), sorted_rows.end());
  if (repeated != sorted_rows.end()) {
    contract_violation("kv_write", "kv_write_index: cache row " + std::to_string(*repeated) + " written twice");
  }
  const size_t row_bytes = size_t(row_elems) * sizeof(float);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t row = write_index[t];
    if (row < 0) continue;  // a padding row
    std::memcpy(p.k_cache.ptr<float>() + row * row_elems, p.k.ptr<float>() + t * row_elems, row_bytes);
    std::memcpy(p.v_cache.ptr<float>() + row * row_elems, p.v.ptr<float>() + t * row_elems, row_bytes);
  }
}

namespace {

// Check the batch metadata the kernels trust, and return the sequence of every token.
std::vector<int32_t> validate_attention_metadata(const ops::AttentionParams& p) {
  const int64_t tokens = p.q.dim(0), seqs = p.block_table.dim(0), max_pages = p.block_table.dim(1);
  const int64_t pages = p.k_cache.dim(0), page_size = p.k_cache.dim(1);
  const int32_t* seq_start = p.seq_start.ptr<int32_t>();      // [B+1] i32
  const int32_t* positions = p.positions.ptr<int32_t>();      // [T] i32
  const int32_t* block_table = p.block_table.ptr<int32_t>();  // [B, max_pages] i32
  if (seq_start[0] != 0 || seq_start[seqs] != tokens) {
    contract_violation("attention", "seq_start must run from 0 to T = " + std::to_string(tokens) + ", found " +
                                        std::to_string(seq_start[0]) + " .. " + std::to_string(seq_start[seqs]));
  }
  std::vector<int32_t> token_seq(tokens);
  for (int64_t b = 0; b < seqs; ++b) {
    if (seq_start[b + 1] < seq_start[b]) {
      contract_violation("attention", "seq_start decreases at sequence " + std::to_string(b));
    }
    for (int64_t t = seq_start[b]; t < seq_start[b + 1]; ++t) {
      token_seq[t] = int32_t(b);
      const int64_t position = positions[t];
      if (position < 0 || position / page_size >= max_pages) {
        contract_violation("attention", "positions[" + std::to_string(t) + "] = " + std::to_string(position) +
                                            " outside the block table's " + std::to_string(max_pages * page_size) +
                                            " positions");
      }
      // Every page the token reads (a window only trims the front) must be a real page.
      const int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, position - p.sliding_window + 1) : 0;
      for (int64_t page = lo / page_size; page <= position / page_size; ++page) {
        const int32_t physical = block_table[b * max_pages + page];
        if (physical < 0 || physical >= pages) {
          contract_violation("attention", "block_table[" + std::to_string(b) + "][" + std::to_string(page) + "] = " +
                                              std::to_string(physical) + " outside [0, " + std::to_string(pages) + ")");
        }
      }
    }
  }
  return token_seq;
}

}  // namespace

// For token t of sequence b at position p and head h: keys j in [lo, p] (lo = p - W + 1 with a window),
// read from cache row block_table[b][j / P] * P + j % P of kv head h / (Hq / Hkv).
//   s_j = scale · q·k_j;  m = max(s_j, sink);  w_j = exp(s_j - m) / (Σ_j exp(s_j - m) + exp(sink - m))
//   out = Σ_j w_j · v_j         (the sink joins the denominator only: it has no value)
void CpuBackend::attention(const ops::AttentionParams& p) {
  ops::require(ops::check(p), "attention");
  require_host_f32(p.q, "AttentionParams.q", "attention");
  const std::vector<int32_t> token_seq = validate_attention_metadata(p);
  const int64_t tokens = p.q.dim(0), q_heads = p.q.dim(1), head_dim = p.q.dim(2);
  const int64_t page_size = p.k_cache.dim(1), kv_heads = p.k_cache.dim(2), max_pages = p.block_table.dim(1);
  const int64_t group = q_heads / kv_heads;
  const float* q = p.q.ptr<float>();                          // [T, Hq, D] f32
  const float* k_cache = p.k_cache.ptr<float>();              // [pages, P, Hkv, D] f32
  const float* v_cache = p.v_cache.ptr<float>();              // [pages, P, Hkv, D] f32
  const int32_t* block_table = p.block_table.ptr<int32_t>();  // [B, max_pages] i32
  const int32_t* positions = p.positions.ptr<int32_t>();      // [T] i32
  const bf16* sinks = optional_ptr<bf16>(p.sinks);            // [Hq] bf16
  float* out = p.out.ptr<float>();                            // [T, Hq, D] f32

  // Rows are (token, head) pairs; work per row grows with the position, 256 keys is a rough average.
  pool_.parallel_for(tokens * q_heads, 4 * 256 * head_dim, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;         // [keys] f32
    std::vector<float> acc(head_dim);  // [D] f32
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / q_heads, h = row % q_heads, kv_head = h / group;
      const int64_t b = token_seq[t], position = positions[t];
      const int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, position - p.sliding_window + 1) : 0;
      auto cache_offset = [&](int64_t j) {
        const int64_t cache_row = int64_t(block_table[b * max_pages + j / page_size]) * page_size + j % page_size;
        return (cache_row * kv_heads + kv_head) * head_dim;
      };
      const float* q_head = q + (t * q_heads + h) * head_dim;

      scores.assign(size_t(position - lo + 1), 0.0f);
      float max_logit = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j <= position; ++j) {
        scores[j - lo] = dot(q_head, k_cache + cache_offset(j), head_dim) * p.softmax_scale;
        max_logit = std::max(max_logit, scores[j - lo]);
      }
      const float sink = sinks ? bf16_to_f32(sinks[h]) : 0.0f;
      if (sinks) max_logit = std::max(max_logit, sink);
      float denominator = 0.0f;
      for (float& s : scores) {
        s = std::exp(s - max_logit);
        denominator += s;
      }
      if (sinks) denominator += std::exp(sink - max_logit);

      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = lo; j <= position; ++j) {
        const float weight = scores[j - lo] / denominator;
        const float* v_row = v_cache + cache_offset(j);
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += weight * v_row[d];
      }
      std::copy(acc.begin(), acc.end(), out + (t * q_heads + h) * head_dim);
    }
  });
}

}  // namespace lmx::cpu
