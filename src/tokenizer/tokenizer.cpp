// Tokenizer loading and encode/decode (see tokenizer.h). The encode pipeline is HF `tokenizers`' order:
// added tokens in the raw text -> normalize the rest -> added tokens marked "normalized" -> pre-tokenize
// -> BPE per piece (cached) -> post-processor. Files: tokenizer.json, tokenizer_config.json.
#include "tokenizer/tokenizer.h"

#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <shared_mutex>
#include <unordered_map>

#include "io/safetensors.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pipeline.h"
#include "tokenizer/utf8.h"

namespace lmx::tokenizer {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// Bounded pre-token cache. Pieces longer than kMaxCachedBytes are rare (long whitespace or symbol
// runs) and would crowd out words; when full the cache is cleared rather than frozen, so a long-running
// server keeps adapting to its traffic.
constexpr size_t kCacheCapacity = 1 << 16;
constexpr size_t kMaxCachedBytes = 64;

struct WordCache {
  std::shared_mutex mutex;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
};

// Everything one encode call needs besides the read-only tables; pooled so calls do not allocate.
struct EncodeScratch {
  std::string sanitized, normalized;
  std::vector<TextSegment> raw_segments, normalized_segments;
  PreTokenScratch pre;
};

Result<json> parse_json_file(const std::string& path) {
  LMX_ASSIGN_OR_RETURN(std::string text, io::read_text_file(path));
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    return invalid_argument(path + ": malformed JSON: " + e.what());
  }
}

// bos_token / eos_token in tokenizer_config.json: a string or {"content": ...}; null or absent -> none.
std::optional<std::string> config_token(const json& config, const char* key) {
  if (!config.contains(key)) return std::nullopt;
  const json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

}  // namespace

struct Tokenizer::Impl {
  BpeModel bpe;
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  AddedTokenMatcher raw_matcher, normalized_matcher;
  std::vector<int32_t> prefix_ids, suffix_ids;  // TemplateProcessing's single-sequence template

  std::vector<std::string> id_to_bytes;  // model bytes, overridden by added contents
  std::vector<uint8_t> added_kind;       // 0 model token, 1 added, 2 added special
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> added_by_content;
  int32_t bos = -1, eos = -1;

  WordCache cache;
  std::mutex scratch_mutex;
  std::vector<std::unique_ptr<EncodeScratch>> scratch_pool;

  Status parse_post_processor(const json& spec, const std::string& where);
  void encode_text(std::string_view text, EncodeScratch& scratch, std::vector<int32_t>& ids);
  void encode_piece(std::string_view piece, std::vector<int32_t>& ids);
};

Status Tokenizer::Impl::parse_post_processor(const json& spec, const std::string& where) {
  if (spec.is_null()) return Status::Ok();
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string())
    return invalid_argument(where + ": expected an object with a string \"type\"");
  const std::string type = spec["type"].get<std::string>();
  if (type == "ByteLevel") return Status::Ok();  // only trims offsets; ids are unchanged
  if (type == "Sequence") {
    if (!spec.contains("processors") || !spec["processors"].is_array())
      return invalid_argument(where + ".processors: expected an array");
    for (size_t i = 0; i < spec["processors"].size(); ++i)
      LMX_RETURN_IF_ERROR(parse_post_processor(spec["processors"][i], where + ".processors[" + std::to_string(i) + "]"));
    return Status::Ok();
  }
  if (type != "TemplateProcessing")
    return unsupported(where + ".type: unsupported post-processor '" + type +
                       "' (supported: TemplateProcessing, ByteLevel, Sequence)");
  if (!spec.contains("single") || !spec["single"].is_array())
    return invalid_argument(where + ".single: expected an array");
  const json& specials = spec.value("special_tokens", json::object());
  bool seen_sequence = false;
  for (size_t i = 0; i < spec["single"].size(); ++i) {
    const json& item = spec["single"][i];
    const std::string at = where + ".single[" + std::to_string(i) + "]";
    if (item.contains("Sequence")) {
      seen_sequence = true;
    } else if (item.contains("SpecialToken") && item["SpecialToken"].contains("id")) {
      const std::string name = item["SpecialToken"]["id"].get<std::string>();
      if (!specials.contains(name) || !specials[name].contains("ids") || !specials[name]["ids"].is_array())
        return invalid_argument(at + ": special token '" + name + "' has no ids in " + where + ".special_tokens");
      for (const json& id : specials[name]["ids"])
        (seen_sequence ? suffix_ids : prefix_ids).push_back(id.get<int32_t>());
    } else {
      return invalid_argument(at + ": expected {\"Sequence\": ...} or {\"SpecialToken\": ...}, found " + item.dump());
    }
  }
  return Status::Ok();
}

Result<Tokenizer> Tokenizer::load(const std::string& path) {
  fs::path json_path = path, config_path;
  std::error_code ec;
  if (!fs::exists(json_path, ec))
    return not_found(path + ": no such file or directory (expected a model directory with tokenizer.json, or the file)");
  if (fs::is_directory(json_path, ec)) {
    config_path = json_path / "tokenizer_config.json";
    json_path /= "tokenizer.json";
  } else {
    config_path = json_path.parent_path() / "tokenizer_config.json";
  }
  const std::string file = json_path.string();
  if (!fs::exists(json_path, ec)) return not_found(file + ": no tokenizer.json (expected a model directory or the file)");
  LMX_ASSIGN_OR_RETURN(json spec, parse_json_file(file));
  if (!spec.is_object()) return invalid_argument(file + ": expected a JSON object, found " + spec.type_name());
  json config = json::object();
  const std::string config_file = config_path.string();
  if (fs::exists(config_path, ec)) {
    LMX_ASSIGN_OR_RETURN(config, parse_json_file(config_file));
    if (!config.is_object()) return invalid_argument(config_file + ": expected a JSON object");
  }

  auto impl = std::make_shared<Impl>();
  if (!spec.contains("model")) return invalid_argument(file + ": missing \"model\"");
  LMX_ASSIGN_OR_RETURN(impl->bpe, BpeModel::from_json(spec["model"], file));
  LMX_ASSIGN_OR_RETURN(impl->normalizer, Normalizer::from_json(spec.value("normalizer", json()), file + ": normalizer"));
  LMX_ASSIGN_OR_RETURN(impl->pre_tokenizer,
                       PreTokenizer::from_json(spec.value("pre_tokenizer", json()), file + ": pre_tokenizer"));
  if (!impl->pre_tokenizer.ends_with_byte_level())
    return unsupported(file + ": pre_tokenizer: BPE without a final ByteLevel pre-tokenizer (SentencePiece-style "
                       "character BPE) is not supported");
  const json& decoder = spec.value("decoder", json());
  const std::string decoder_type = decoder.is_object() ? decoder.value("type", std::string()) : std::string("null");
  if (decoder_type != "ByteLevel")
    return unsupported(file + ": decoder.type: unsupported decoder '" + decoder_type + "' (supported: ByteLevel)");
  LMX_RETURN_IF_ERROR(impl->parse_post_processor(spec.value("post_processor", json()), file + ": post_processor"));
  if (spec.contains("truncation") && !spec["truncation"].is_null())
    return unsupported(file + ": truncation: must be null (loramux never truncates prompts silently)");

  // Added tokens: tokenizer.json's list, plus any entry of tokenizer_config's added_tokens_decoder that
  // the list lacks (transformers registers those too; for the shipped models the two agree).
  std::vector<AddedToken> added;
  auto read_added = [&](const json& t, std::optional<int32_t> id, const std::string& at) -> Status {
    if (!t.is_object() || !t.contains("content") || !t["content"].is_string())
      return invalid_argument(at + ": expected an object with a string \"content\"");
    AddedToken token;
    if (id) token.id = *id;
    else if (t.contains("id") && t["id"].is_number_integer()) token.id = t["id"].get<int32_t>();
    else return invalid_argument(at + ".id: expected an integer");
    if (token.id < 0) return invalid_argument(at + ".id: expected a non-negative id, found " + std::to_string(token.id));
    token.content = t["content"].get<std::string>();
    token.special = t.value("special", false);
    token.lstrip = t.value("lstrip", false);
    token.rstrip = t.value("rstrip", false);
    token.normalized = t.value("normalized", !token.special);
    token.single_word = t.value("single_word", false);
    added.push_back(std::move(token));
    return Status::Ok();
  };
  const json& added_json = spec.value("added_tokens", json::array());
  for (size_t i = 0; i < added_json.size(); ++i)
    LMX_RETURN_IF_ERROR(read_added(added_json[i], std::nullopt, file + ": added_tokens[" + std::to_string(i) + "]"));
  if (config.contains("added_tokens_decoder") && config["added_tokens_decoder"].is_object()) {
    for (auto it = config["added_tokens_decoder"].begin(); it != config["added_tokens_decoder"].end(); ++it) {
      int32_t id = -1;
      try {
        id = std::stoi(it.key());
      } catch (...) {
        return invalid_argument(config_file + ": added_tokens_decoder: key '" + it.key() + "' is not an id");
      }
      bool known = false;
      for (const AddedToken& t : added) known = known || t.id == id;
      if (!known) LMX_RETURN_IF_ERROR(read_added(it.value(), id, config_file + ": added_tokens_decoder[\"" + it.key() + "\"]"));
    }
  }

  int32_t vocab_size = int32_t(impl->bpe.id_to_bytes().size());
  for (const AddedToken& t : added) vocab_size = std::max(vocab_size, t.id + 1);
  impl->id_to_bytes = impl->bpe.id_to_bytes();
  impl->id_to_bytes.resize(size_t(vocab_size));
  impl->added_kind.assign(size_t(vocab_size), 0);
  std::vector<AddedToken> raw_tokens, normalized_tokens;
  std::vector<std::string> raw_patterns, normalized_patterns;
  for (const AddedToken& t : added) {
    impl->id_to_bytes[size_t(t.id)] = t.content;
    impl->added_kind[size_t(t.id)] = t.special ? 2 : 1;
    impl->added_by_content.emplace(t.content, t.id);
    // HF matches "normalized": false tokens in the raw text and the others in the normalized text,
    // against their normalized content (special or not: DeepSeek-V3 has a normalized special token).
    if (t.normalized) {
      std::string pattern;
      impl->normalizer.apply(t.content, pattern);
      normalized_patterns.push_back(std::move(pattern));
      normalized_tokens.push_back(t);
    } else {
      raw_patterns.push_back(t.content);
      raw_tokens.push_back(t);
    }
  }
  impl->raw_matcher = AddedTokenMatcher(std::move(raw_tokens), std::move(raw_patterns));
  impl->normalized_matcher = AddedTokenMatcher(std::move(normalized_tokens), std::move(normalized_patterns));

  Tokenizer tokenizer;
  tokenizer.impl_ = std::move(impl);
  for (auto [key, target] : {std::pair{"bos_token", &tokenizer.impl_->bos}, std::pair{"eos_token", &tokenizer.impl_->eos}}) {
    if (auto content = config_token(config, key)) {
      auto id = tokenizer.token_to_id(*content);
      if (!id) return invalid_argument(config_file + ": " + key + ": '" + *content + "' is not a token of " + file);
      *target = *id;
    }
  }
  return tokenizer;
}

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& ids) {
  if (piece.size() > kMaxCachedBytes) {
    bpe.encode_word(piece, ids);
    return;
  }
  {
    std::shared_lock lock(cache.mutex);
    auto it = cache.map.find(piece);
    if (it != cache.map.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = ids.size();
  bpe.encode_word(piece, ids);
  std::unique_lock lock(cache.mutex);
  if (cache.map.size() >= kCacheCapacity) cache.map.clear();
  cache.map.emplace(std::string(piece), std::vector<int32_t>(ids.begin() + std::ptrdiff_t(first), ids.end()));
}

void Tokenizer::Impl::encode_text(std::string_view text, EncodeScratch& s, std::vector<int32_t>& ids) {
  s.raw_segments.clear();
  raw_matcher.split(text, s.raw_segments);
  for (const TextSegment& raw : s.raw_segments) {
    if (raw.token_id >= 0) {
      ids.push_back(raw.token_id);
      continue;
    }
    std::string_view part = text.substr(raw.begin, raw.end - raw.begin);
    if (!normalizer.identity()) {
      s.normalized.clear();
      normalizer.apply(part, s.normalized);
      part = s.normalized;
    }
    s.normalized_segments.clear();
    normalized_matcher.split(part, s.normalized_segments);
    for (const TextSegment& seg : s.normalized_segments) {
      if (seg.token_id >= 0) {
        ids.push_back(seg.token_id);
        continue;
      }
      const Status status = pre_tokenizer.apply(part.substr(seg.begin, seg.end - seg.begin), s.pre);
      // PCRE2 only fails on resource limits (JIT stack up to 8 MiB); this is not reachable with the
      // shipped patterns, and an encode that silently dropped text would be worse than stopping.
      LMX_CHECK(status.ok());
      for (std::string_view piece : s.pre.pieces) encode_piece(piece, ids);
    }
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::unique_ptr<EncodeScratch> scratch;
  {
    std::lock_guard lock(impl_->scratch_mutex);
    if (!impl_->scratch_pool.empty()) {
      scratch = std::move(impl_->scratch_pool.back());
      impl_->scratch_pool.pop_back();
    }
  }
  if (!scratch) scratch = std::make_unique<EncodeScratch>();
  if (!is_valid_utf8(text)) {
    scratch->sanitized.clear();
    append_utf8_lossy(text, scratch->sanitized);
    text = scratch->sanitized;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  if (add_special_tokens) ids.insert(ids.end(), impl_->prefix_ids.begin(), impl_->prefix_ids.end());
  impl_->encode_text(text, *scratch, ids);
  if (add_special_tokens) ids.insert(ids.end(), impl_->suffix_ids.begin(), impl_->suffix_ids.end());
  std::lock_guard lock(impl_->scratch_mutex);
  impl_->scratch_pool.push_back(std::move(scratch));
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string text, run;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    const uint8_t kind = impl_->added_kind[size_t(id)];
    if (kind == 0) {
      run += impl_->id_to_bytes[size_t(id)];
      continue;
    }
    if (kind == 2 && skip_special_tokens) continue;
    append_utf8_lossy(run, text);
    run.clear();
    text += impl_->id_to_bytes[size_t(id)];
  }
  append_utf8_lossy(run, text);
  return text;
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  static const std::string kEmpty;  // immutable: the answer for unknown ids
  return id >= 0 && id < vocab_size() ? impl_->id_to_bytes[size_t(id)] : kEmpty;
}

bool Tokenizer::is_added(int32_t id) const {
  return id >= 0 && id < vocab_size() && impl_->added_kind[size_t(id)] != 0;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && impl_->added_kind[size_t(id)] == 2;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view text) const {
  auto it = impl_->added_by_content.find(text);
  if (it != impl_->added_by_content.end()) return it->second;
  return impl_->bpe.find(text);
}

int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int32_t Tokenizer::vocab_size() const { return int32_t(impl_->id_to_bytes.size()); }

}  // namespace lmx::tokenizer
