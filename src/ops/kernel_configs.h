// Tuned launch configurations as data (design.md §6, docs/kernels.md): per op, per problem shape and per
// token bucket, a small set of named integer knobs (tile sizes, split_k, path, PDL on/off). Read from a
// folder of JSON files (`--kernel-configs DIR`, one file per op) and written by `loramux tune`. Nothing
// here knows a kernel: the CUDA launchers look their knobs up by name and keep built-in defaults for any
// shape or knob a file does not cover. Host code; tested on the CPU.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "core/status.h"

namespace lmx::ops {

// The knobs of one (op, shape, bucket): name -> value, e.g. {"split_k": 8, "pdl": 1}.
using KernelKnobs = std::map<std::string, int64_t, std::less<>>;

// A shape key names the dimensions an op's tuning depends on, in a fixed order the op chooses:
// shape_key({{"H", 2880}, {"I", 2880}, {"E", 32}}) == "H=2880,I=2880,E=32".
std::string shape_key(std::initializer_list<std::pair<std::string_view, int64_t>> dims);

class KernelConfigs {
 public:
  // Every *.json in `dir` (files in a fixed order); an error names the file, the JSON path and what was
  // expected vs found. A missing directory is an error; an empty one is fine (all built-in defaults).
  static Result<KernelConfigs> load_dir(const std::string& dir);
  // Parse one file's text (`source` names it in errors); merges into this set, later entries win.
  Status add_json(std::string_view text, const std::string& source);

  // Writes `<dir>/<op>.json` for every op held (creating dir), in the format load_dir reads.
  Status save_dir(const std::string& dir) const;

  // The knobs of the smallest bucket >= tokens for (op, shape); past the largest bucket, the largest;
  // nullptr when the op or shape has no entry (the caller uses its built-in default).
  const KernelKnobs* find(std::string_view op, std::string_view shape, int64_t tokens) const;

  // Record (or replace) one entry; `bucket` is the largest token count it is meant for (>= 1).
  void set(const std::string& op, const std::string& shape, int64_t bucket, KernelKnobs knobs);
  // Every entry and note of `other` into this set (other's win).
  void merge(const KernelConfigs& other);
  // Free-form provenance written into each file ("device": "NVIDIA H200", "command": "...").
  void set_note(const std::string& key, const std::string& value) { notes_[key] = value; }

  // Every (shape, bucket, knobs) of `op`, in key order; the first error `visit` returns ends the walk and is returned.
  Status for_each(std::string_view op,
                  const std::function<Status(const std::string& shape, int64_t bucket, const KernelKnobs& knobs)>& visit) const;

  bool empty() const { return ops_.empty(); }
  size_t entries() const;

 private:
  // op -> shape -> bucket (max tokens) -> knobs
  std::map<std::string, std::map<std::string, std::map<int64_t, KernelKnobs>, std::less<>>, std::less<>> ops_;
  std::map<std::string, std::string> notes_;
};

}  // namespace lmx::ops
