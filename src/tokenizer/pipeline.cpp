// Normalizer and pre-tokenizer (see pipeline.h). Split follows `tokenizers`' NormalizedString::split:
// matches and the gaps between them, `invert` swapping the two, then the behaviour folding them; empty
// pieces are dropped as PreTokenizedString::split drops them.
#include "tokenizer/pipeline.h"

#include <utf8proc.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

namespace lmx::tokenizer {
namespace {

using json = nlohmann::json;

// GPT-2's pattern, used by a ByteLevel pre-tokenizer with use_regex.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string type_of(const json& spec, const std::string& where, Status& status) {
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string()) {
    status = invalid_argument(where + ": expected an object with a string \"type\", found " + spec.dump().substr(0, 200));
    return {};
  }
  return spec["type"].get<std::string>();
}

bool is_ascii(std::string_view text) {
  for (char c : text)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

std::string escape_literal(const std::string& literal) {
  std::string out;
  for (char c : literal) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

}  // namespace

Status Normalizer::parse(const json& spec, const std::string& where, std::vector<Step>& steps) {
  Status status;
  const std::string type = type_of(spec, where, status);
  LMX_RETURN_IF_ERROR(status);
  if (type == "Sequence") {
    if (!spec.contains("normalizers") || !spec["normalizers"].is_array())
      return invalid_argument(where + ".normalizers: expected an array");
    for (size_t i = 0; i < spec["normalizers"].size(); ++i)
      LMX_RETURN_IF_ERROR(parse(spec["normalizers"][i], where + ".normalizers[" + std::to_string(i) + "]", steps));
  } else if (type == "NFC") {
    steps.push_back({Kind::kNfc, {}, {}});
  } else if (type == "NFD") {
    steps.push_back({Kind::kNfd, {}, {}});
  } else if (type == "NFKC") {
    steps.push_back({Kind::kNfkc, {}, {}});
  } else if (type == "NFKD") {
    steps.push_back({Kind::kNfkd, {}, {}});
  } else if (type == "Prepend") {
    if (!spec.contains("prepend") || !spec["prepend"].is_string())
      return invalid_argument(where + ".prepend: expected a string");
    steps.push_back({Kind::kPrepend, {}, spec["prepend"].get<std::string>()});
  } else if (type == "Replace") {
    const json& pattern = spec.value("pattern", json());
    if (!pattern.is_object() || !pattern.contains("String") || !pattern["String"].is_string())
      return unsupported(where + ".pattern: only {\"String\": ...} patterns are supported in Replace, found " +
                         pattern.dump());
    if (!spec.contains("content") || !spec["content"].is_string())
      return invalid_argument(where + ".content: expected a string");
    steps.push_back({Kind::kReplace, pattern["String"].get<std::string>(), spec["content"].get<std::string>()});
  } else {
    return unsupported(where + ".type: unsupported normalizer '" + type +
                       "' (supported: NFC, NFD, NFKC, NFKD, Prepend, Replace, Sequence)");
  }
  return Status::Ok();
}

Result<Normalizer> Normalizer::from_json(const json& spec, const std::string& where) {
  Normalizer normalizer;
  if (!spec.is_null()) LMX_RETURN_IF_ERROR(parse(spec, where, normalizer.steps_));
  return normalizer;
}

void Normalizer::apply(std::string_view text, std::string& out) const {
  std::string current(text), next;
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Kind::kNfc: case Kind::kNfd: case Kind::kNfkc: case Kind::kNfkd: {
        if (is_ascii(current)) break;  // ASCII is invariant under every normalization form
        int options = UTF8PROC_STABLE;
        if (step.kind == Kind::kNfc || step.kind == Kind::kNfkc) options |= UTF8PROC_COMPOSE;
        else options |= UTF8PROC_DECOMPOSE;
        if (step.kind == Kind::kNfkc || step.kind == Kind::kNfkd) options |= UTF8PROC_COMPAT;
        utf8proc_uint8_t* mapped = nullptr;
        const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(current.data()),
                                                utf8proc_ssize_t(current.size()), &mapped,
                                                static_cast<utf8proc_option_t>(options));
        // Input is valid UTF-8 (Tokenizer::encode replaces invalid bytes first), so failure means no memory.
        if (n >= 0) current.assign(reinterpret_cast<const char*>(mapped), size_t(n));
        std::free(mapped);
        break;
      }
      case Kind::kPrepend:
        if (!current.empty()) current.insert(0, step.content);
        break;
      case Kind::kReplace: {
        if (step.pattern.empty()) break;
        next.clear();
        size_t from = 0;
        for (size_t at; (at = current.find(step.pattern, from)) != std::string::npos; from = at + step.pattern.size())
          next.append(current, from, at - from).append(step.content);
        next.append(current, from);
        current.swap(next);
        break;
      }
    }
  }
  out.append(current);
}

Status PreTokenizer::parse(const json& spec, const std::string& where, std::vector<Step>& steps) {
  Status status;
  const std::string type = type_of(spec, where, status);
  LMX_RETURN_IF_ERROR(status);
  if (type == "Sequence") {
    if (!spec.contains("pretokenizers") || !spec["pretokenizers"].is_array())
      return invalid_argument(where + ".pretokenizers: expected an array");
    for (size_t i = 0; i < spec["pretokenizers"].size(); ++i)
      LMX_RETURN_IF_ERROR(parse(spec["pretokenizers"][i], where + ".pretokenizers[" + std::to_string(i) + "]", steps));
    return Status::Ok();
  }
  if (!steps.empty() && steps.back().kind == Kind::kByteLevel)
    return unsupported(where + ": a pre-tokenizer after ByteLevel is not supported (ByteLevel must come last)");
  if (type == "ByteLevel") {
    Step step{Kind::kByteLevel, {}};
    step.add_prefix_space = spec.value("add_prefix_space", true);
    if (spec.value("use_regex", true)) {
      LMX_ASSIGN_OR_RETURN(step.regex, Regex::compile(kGpt2Pattern, where + " (ByteLevel use_regex)"));
      step.has_regex = true;
    }
    steps.push_back(std::move(step));
  } else if (type == "Split") {
    Step step{Kind::kSplit, {}};
    const json& pattern = spec.value("pattern", json());
    std::string regex;
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string())
      regex = pattern["Regex"].get<std::string>();
    else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string())
      regex = escape_literal(pattern["String"].get<std::string>());
    else
      return invalid_argument(where + ".pattern: expected {\"Regex\": ...} or {\"String\": ...}, found " + pattern.dump());
    LMX_ASSIGN_OR_RETURN(step.regex, Regex::compile(regex, where + ".pattern"));
    step.has_regex = true;
    const std::string behavior = spec.value("behavior", std::string());
    if (behavior == "Removed") step.behavior = Behavior::kRemoved;
    else if (behavior == "Isolated") step.behavior = Behavior::kIsolated;
    else if (behavior == "MergedWithPrevious") step.behavior = Behavior::kMergedWithPrevious;
    else if (behavior == "MergedWithNext") step.behavior = Behavior::kMergedWithNext;
    else if (behavior == "Contiguous") step.behavior = Behavior::kContiguous;
    else
      return invalid_argument(where + ".behavior: expected Removed, Isolated, MergedWithPrevious, MergedWithNext "
                              "or Contiguous, found '" + behavior + "'");
    step.invert = spec.value("invert", false);
    steps.push_back(std::move(step));
  } else {
    return unsupported(where + ".type: unsupported pre-tokenizer '" + type + "' (supported: Split, ByteLevel, Sequence)");
  }
  return Status::Ok();
}

Result<PreTokenizer> PreTokenizer::from_json(const json& spec, const std::string& where) {
  PreTokenizer pre;
  if (!spec.is_null()) LMX_RETURN_IF_ERROR(parse(spec, where, pre.steps_));
  return pre;
}

Status PreTokenizer::apply(std::string_view text, PreTokenScratch& scratch) const {
  scratch.pieces.clear();
  scratch.owned.clear();
  if (!text.empty()) scratch.pieces.push_back(text);
  for (const Step& step : steps_) {
    scratch.next.clear();
    for (std::string_view piece : scratch.pieces) {
      if (step.kind == Kind::kByteLevel && step.add_prefix_space && piece.front() != ' ') {
        piece = scratch.owned.emplace_back(" " + std::string(piece));
      }
      if (!step.has_regex) {
        scratch.next.push_back(piece);
        continue;
      }
      scratch.matches.clear();
      LMX_RETURN_IF_ERROR(step.regex.find_all(piece, scratch.regex, scratch.matches));
      // (range, is_match) over the whole piece: matches and the non-empty gaps between them.
      struct Range {
        size_t begin, end;
        bool is_match;
      };
      std::vector<Range> ranges;
      ranges.reserve(scratch.matches.size() * 2 + 1);
      size_t previous = 0;
      for (auto [b, e] : scratch.matches) {
        if (previous != b) ranges.push_back({previous, b, false});
        ranges.push_back({b, e, true});
        previous = e;
      }
      if (previous != piece.size()) ranges.push_back({previous, piece.size(), false});
      if (step.invert)
        for (Range& r : ranges) r.is_match = !r.is_match;
      auto emit = [&](size_t b, size_t e) {
        if (e > b) scratch.next.push_back(piece.substr(b, e - b));
      };
      switch (step.behavior) {
        case Behavior::kIsolated:
          for (const Range& r : ranges) emit(r.begin, r.end);
          break;
        case Behavior::kRemoved:
          for (const Range& r : ranges)
            if (!r.is_match) emit(r.begin, r.end);
          break;
        case Behavior::kMergedWithPrevious:
        case Behavior::kContiguous: {
          // Fold left: a match joins the piece before it (Contiguous: any run of equal kind joins).
          std::vector<std::pair<size_t, size_t>> folded;
          bool previous_match = false;
          for (const Range& r : ranges) {
            const bool join = step.behavior == Behavior::kContiguous ? r.is_match == previous_match
                                                                      : r.is_match && !previous_match;
            if (join && !folded.empty()) folded.back().second = r.end;
            else folded.emplace_back(r.begin, r.end);
            previous_match = r.is_match;
          }
          for (auto [b, e] : folded) emit(b, e);
          break;
        }
        case Behavior::kMergedWithNext: {
          // Fold right to left: a match joins the piece after it.
          std::vector<std::pair<size_t, size_t>> folded;
          bool previous_match = false;
          for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) {
            if (it->is_match && !previous_match && !folded.empty()) folded.back().first = it->begin;
            else folded.emplace_back(it->begin, it->end);
            previous_match = it->is_match;
          }
          for (auto it = folded.rbegin(); it != folded.rend(); ++it) emit(it->first, it->second);
          break;
        }
      }
    }
    scratch.pieces.swap(scratch.next);
  }
  return Status::Ok();
}

}  // namespace lmx::tokenizer
