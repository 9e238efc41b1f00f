// KernelConfigs (kernel_configs.h): the JSON files of `--kernel-configs DIR`. One file per op:
//   {"op": "moe_lora", "notes": {"device": "NVIDIA H200", ...},
//    "shapes": {"H=2880,I=2880,E=32,K=4,R=32": [{"max_tokens": 16, "knobs": {"split_k": 8, "pdl": 1}}, ...]}}
// Validation is strict (unknown top-level fields, non-integer knobs, duplicate buckets are errors): a typo in
// a tuning file must not silently fall back to defaults.
#include "ops/kernel_configs.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

namespace lmx::ops {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

Status field_error(const std::string& source, const std::string& path, const std::string& expected,
                   const json& found) {
  std::string shown = found.dump();
  if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
  return invalid_argument("kernel configs " + source + ": " + path + ": expected " + expected + ", found " + shown);
}

bool is_op_name(const std::string& op) {
  return !op.empty() && std::all_of(op.begin(), op.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

}  // namespace

std::string shape_key(std::initializer_list<std::pair<std::string_view, int64_t>> dims) {
  std::string key;
  for (const auto& [name, value] : dims) {
    if (!key.empty()) key += ',';
    key += std::string(name) + "=" + std::to_string(value);
  }
  return key;
}

Status KernelConfigs::add_json(std::string_view text, const std::string& source) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    return invalid_argument("kernel configs " + source + ": not valid JSON: " + e.what());
  }
  if (!doc.is_object()) return field_error(source, "(top level)", "an object", doc);
  for (const auto& [key, value] : doc.items()) {
    if (key != "op" && key != "notes" && key != "shapes") {
      return field_error(source, key, "one of the fields op, notes, shapes", value);
    }
  }
  if (!doc.contains("op") || !doc["op"].is_string() || !is_op_name(doc["op"].get<std::string>())) {
    return field_error(source, "op", "a name of [a-z0-9_-]", doc.value("op", json()));
  }
  const std::string op = doc["op"].get<std::string>();
  if (doc.contains("notes")) {
    if (!doc["notes"].is_object()) return field_error(source, "notes", "an object of strings", doc["notes"]);
    for (const auto& [key, value] : doc["notes"].items()) {
      if (!value.is_string()) return field_error(source, "notes." + key, "a string", value);
      notes_[key] = value.get<std::string>();
    }
  }
  if (!doc.contains("shapes") || !doc["shapes"].is_object()) {
    return field_error(source, "shapes", "an object {shape key: [buckets]}", doc.value("shapes", json()));
  }
  // Parse everything before merging, so a bad file changes nothing.
  std::map<std::string, std::map<int64_t, KernelKnobs>, std::less<>> parsed;
  for (const auto& [shape, buckets] : doc["shapes"].items()) {
    const std::string where = "shapes[\"" + shape + "\"]";
    if (!buckets.is_array()) return field_error(source, where, "an array of {max_tokens, knobs}", buckets);
    auto& per_bucket = parsed[shape];
    for (size_t i = 0; i < buckets.size(); ++i) {
      const json& entry = buckets[i];
      const std::string at = where + "[" + std::to_string(i) + "]";
      if (!entry.is_object() || !entry.contains("max_tokens") || !entry.contains("knobs") || entry.size() != 2) {
        return field_error(source, at, "{\"max_tokens\": N, \"knobs\": {...}}", entry);
      }
      if (!entry["max_tokens"].is_number_integer() || entry["max_tokens"].get<int64_t>() < 1) {
        return field_error(source, at + ".max_tokens", "an integer >= 1", entry["max_tokens"]);
      }
      const int64_t bucket = entry["max_tokens"].get<int64_t>();
      if (per_bucket.count(bucket)) return field_error(source, at + ".max_tokens", "a bucket not listed before", entry["max_tokens"]);
      if (!entry["knobs"].is_object()) return field_error(source, at + ".knobs", "an object of integers", entry["knobs"]);
      KernelKnobs knobs;
      for (const auto& [name, value] : entry["knobs"].items()) {
        if (!value.is_number_integer()) return field_error(source, at + ".knobs." + name, "an integer", value);
        knobs[name] = value.get<int64_t>();
      }
      per_bucket[bucket] = std::move(knobs);
    }
  }
  for (auto& [shape, buckets] : parsed) {
    for (auto& [bucket, knobs] : buckets) ops_[op][shape][bucket] = std::move(knobs);
  }
  return Status::Ok();
}

Result<KernelConfigs> KernelConfigs::load_dir(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return not_found("kernel configs: " + dir + " is not a directory");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.is_regular_file() && entry.path().extension() == ".json") files.push_back(entry.path());
  }
  if (ec) return io_error("kernel configs: cannot list " + dir + ": " + ec.message());
  std::sort(files.begin(), files.end());
  KernelConfigs configs;
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) return io_error("kernel configs: cannot read " + file.string());
    std::stringstream text;
    text << in.rdbuf();
    if (Status s = configs.add_json(text.str(), file.string()); !s.ok()) return s;
  }
  return configs;
}

Status KernelConfigs::save_dir(const std::string& dir) const {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("kernel configs: cannot create " + dir + ": " + ec.message());
  for (const auto& [op, shapes] : ops_) {
    json doc = {{"op", op}, {"notes", notes_}, {"shapes", json::object()}};
    for (const auto& [shape, buckets] : shapes) {
      json list = json::array();
      for (const auto& [bucket, knobs] : buckets) {
        json knob_object = json::object();
        for (const auto& [name, value] : knobs) knob_object[name] = value;
        list.push_back({{"max_tokens", bucket}, {"knobs", knob_object}});
      }
      doc["shapes"][shape] = list;
    }
    const fs::path file = fs::path(dir) / (op + ".json");
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out << doc.dump(2) << "\n";
    if (!out) return io_error("kernel configs: cannot write " + file.string());
  }
  return Status::Ok();
}

const KernelKnobs* KernelConfigs::find(std::string_view op, std::string_view shape, int64_t tokens) const {
  const auto op_it = ops_.find(op);
  if (op_it == ops_.end()) return nullptr;
  const auto shape_it = op_it->second.find(shape);
  if (shape_it == op_it->second.end() || shape_it->second.empty()) return nullptr;
  const auto& buckets = shape_it->second;
  const auto it = buckets.lower_bound(tokens);
  return it != buckets.end() ? &it->second : &buckets.rbegin()->second;
}

Status KernelConfigs::for_each(
    std::string_view op,
    const std::function<Status(const std::string& shape, int64_t bucket, const KernelKnobs& knobs)>& visit) const {
  const auto op_it = ops_.find(op);
  if (op_it == ops_.end()) return Status();
  for (const auto& [shape, buckets] : op_it->second) {
    for (const auto& [bucket, knobs] : buckets) {
      if (Status s = visit(shape, bucket, knobs); !s.ok()) return s;
    }
  }
  return Status();
}

void KernelConfigs::set(const std::string& op, const std::string& shape, int64_t bucket, KernelKnobs knobs) {
  LMX_CHECK(is_op_name(op) && bucket >= 1);
  ops_[op][shape][bucket] = std::move(knobs);
}

void KernelConfigs::merge(const KernelConfigs& other) {
  for (const auto& [op, shapes] : other.ops_) {
    for (const auto& [shape, buckets] : shapes) {
      for (const auto& [bucket, knobs] : buckets) ops_[op][shape][bucket] = knobs;
    }
  }
  for (const auto& [key, value] : other.notes_) notes_[key] = value;
}

size_t KernelConfigs::entries() const {
  size_t n = 0;
  for (const auto& [op, shapes] : ops_) {
    for (const auto& [shape, buckets] : shapes) n += buckets.size();
  }
  return n;
}

}  // namespace lmx::ops
