// BPE model (see bpe.h). The merge loop mirrors `tokenizers`' Word::merge_all, including its heap order
// and its stale-entry test, so ties and chains of merges resolve exactly as in Hugging Face.
#include "tokenizer/bpe.h"

#include <algorithm>
#include <bit>
#include <nlohmann/json.hpp>

#include "tokenizer/utf8.h"

namespace lmx::tokenizer {
namespace {

using json = nlohmann::json;

constexpr uint64_t kEmptyKey = ~uint64_t{0};

uint64_t pair_key(int32_t left, int32_t right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}

size_t slot_of(uint64_t key, size_t mask) {
  // Fibonacci hashing spreads the id pairs, which are dense small integers.
  return size_t((key * 0x9E3779B97F4A7C15ull) >> 20) & mask;
}

// The text of a vocabulary entry as bytes: ByteLevel alphabet back to bytes when every character is in
// the alphabet, else the entry's own UTF-8 (added tokens such as "<｜begin▁of▁sentence｜>").
bool byte_level_to_bytes(std::string_view token, const ByteLevelAlphabet& alphabet, std::string& bytes) {
  bytes.clear();
  size_t i = 0;
  while (i < token.size()) {
    Utf8Step step = utf8_step(token.substr(i));
    if (!step.valid) return false;
    size_t length = 0;
    const int b = alphabet.char_to_byte(decode_code_point(token.substr(i), &length));
    if (b < 0) return false;
    bytes.push_back(static_cast<char>(b));
    i += length;
  }
  return true;
}

}  // namespace

Result<BpeModel> BpeModel::from_json(const json& model, const std::string& file) {
  const std::string where = file + ": model";
  if (!model.is_object()) return invalid_argument(where + ": expected an object, found " + model.type_name());
  const std::string type = model.value("type", std::string("BPE"));
  if (type != "BPE")
    return unsupported(where + ".type: unsupported model '" + type + "' (supported: BPE)");
  if (model.contains("dropout") && !model["dropout"].is_null())
    return unsupported(where + ".dropout: BPE dropout is not supported (expected null, found " +
                       model["dropout"].dump() + ")");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty())
      return unsupported(where + "." + key + ": '" + model[key].get<std::string>() +
                         "' is not supported with byte-level BPE (expected null or \"\")");
  }
  if (!model.contains("vocab") || !model["vocab"].is_object())
    return invalid_argument(where + ".vocab: expected an object of token -> id");
  if (!model.contains("merges") || !model["merges"].is_array())
    return invalid_argument(where + ".merges: expected an array");

  BpeModel bpe;
  const ByteLevelAlphabet alphabet;
  const json& vocab = model["vocab"];
  int32_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() > INT32_MAX)
      return invalid_argument(where + ".vocab[\"" + it.key() + "\"]: expected a non-negative id, found " +
                              it.value().dump());
    max_id = std::max(max_id, it.value().get<int32_t>());
  }
  bpe.id_to_bytes_.assign(size_t(max_id + 1), std::string());
  std::fill(std::begin(bpe.byte_id_), std::end(bpe.byte_id_), -1);
  std::string bytes;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const int32_t id = it.value().get<int32_t>();
    if (byte_level_to_bytes(it.key(), alphabet, bytes)) {
      bpe.bytes_to_id_.emplace(bytes, id);
      if (bytes.size() == 1) bpe.byte_id_[static_cast<unsigned char>(bytes[0])] = id;
      bpe.id_to_bytes_[size_t(id)] = bytes;
    } else {
      bpe.id_to_bytes_[size_t(id)] = it.key();  // never produced by merges; decodes as its UTF-8
    }
  }
  // Lookups of merge parts use the vocabulary's own spelling, which byte-level keys no longer hold.
  auto id_of = [&](const std::string& token) -> std::optional<int32_t> {
    auto it = vocab.find(token);
    if (it == vocab.end()) return std::nullopt;
    return it.value().get<int32_t>();
  };

  const json& merges = model["merges"];
  size_t capacity = 16;
  while (capacity < merges.size() * 2) capacity *= 2;
  bpe.merge_keys_.assign(capacity, kEmptyKey);
  bpe.merge_values_.assign(capacity, Merge{0, 0});
  const size_t mask = capacity - 1;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    std::string left, right;
    const std::string at = where + ".merges[" + std::to_string(rank) + "]";
    if (m.is_string()) {  // legacy encoding "a b": exactly one space, as `tokenizers` requires
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        return invalid_argument(at + ": expected \"left right\" (one space), found \"" + s + "\"");
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      return invalid_argument(at + ": expected \"left right\" or [\"left\", \"right\"], found " + m.dump());
    }
    auto l = id_of(left), r = id_of(right), merged = id_of(left + right);
    if (!l || !r || !merged)
      return invalid_argument(at + ": token '" + (!l ? left : !r ? right : left + right) +
                              "' is not in model.vocab");
    const uint64_t key = pair_key(*l, *r);
    size_t slot = slot_of(key, mask);
    while (bpe.merge_keys_[slot] != kEmptyKey && bpe.merge_keys_[slot] != key) slot = (slot + 1) & mask;
    if (bpe.merge_keys_[slot] == key) continue;  // a repeated pair keeps its first (lowest) rank, as in HF
    bpe.merge_keys_[slot] = key;
    bpe.merge_values_[slot] = Merge{uint32_t(rank), *merged};
  }

  bpe.ignore_merges_ = model.value("ignore_merges", false);
  bpe.byte_fallback_ = model.value("byte_fallback", false);
  bpe.fuse_unk_ = model.value("fuse_unk", false);
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    auto unk = id_of(model["unk_token"].get<std::string>());
    if (!unk)
      return invalid_argument(where + ".unk_token: '" + model["unk_token"].get<std::string>() +
                              "' is not in model.vocab");
    bpe.unk_id_ = *unk;
  }
  return bpe;
}

std::optional<int32_t> BpeModel::find(std::string_view bytes) const {
  auto it = bytes_to_id_.find(bytes);
  if (it == bytes_to_id_.end()) return std::nullopt;
  return it->second;
}

const BpeModel::Merge* BpeModel::find_merge(int32_t left, int32_t right) const {
  const uint64_t key = pair_key(left, right);
  const size_t mask = merge_keys_.size() - 1;
  for (size_t slot = slot_of(key, mask);; slot = (slot + 1) & mask) {
    if (merge_keys_[slot] == key) return &merge_values_[slot];
    if (merge_keys_[slot] == kEmptyKey) return nullptr;
  }
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto id = find(word)) {
      ids.push_back(*id);
      return;
    }
  }
  // One symbol per byte; a byte missing from the vocabulary becomes <0xXX> (byte_fallback), else the
  // unknown token (fused with a preceding unknown when fuse_unk), else it is dropped — all as in HF.
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (unsigned char b : word) {
    int32_t id = byte_id_[b];
    if (id < 0 && byte_fallback_) {
      static constexpr char kHex[] = "0123456789ABCDEF";
      const char name[] = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
      if (auto fb = find(std::string_view(name, 6))) id = *fb;
    }
    if (id < 0) {
      if (unk_id_ < 0) continue;
      if (fuse_unk_ && !symbols.empty() && symbols.back().id == unk_id_) continue;
      id = unk_id_;
    }
    const int32_t index = int32_t(symbols.size());
    symbols.push_back(Symbol{id, index - 1, index + 1, true});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  // Heap entries order by (rank, position) ascending; an entry is stale when the pair at its position
  // no longer merges into the same id (checked on pop, like `tokenizers`).
  struct Entry {
    uint32_t rank;
    int32_t pos;
    int32_t merged;
  };
  auto later = [](const Entry& a, const Entry& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  std::vector<Entry> heap;
  heap.reserve(symbols.size() * 2);
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const Merge* m = find_merge(symbols[i].id, symbols[i + 1].id))
      heap.push_back(Entry{m->rank, int32_t(i), m->merged});
  }
  std::make_heap(heap.begin(), heap.end(), later);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Entry top = heap.back();
    heap.pop_back();
    Symbol& cur = symbols[size_t(top.pos)];
    if (!cur.alive || cur.next < 0) continue;
    Symbol& right = symbols[size_t(cur.next)];
    const Merge* m = find_merge(cur.id, right.id);
    if (m == nullptr || m->merged != top.merged) continue;
    cur.id = top.merged;
    right.alive = false;
    cur.next = right.next;
    if (cur.next >= 0) symbols[size_t(cur.next)].prev = top.pos;
    if (cur.prev >= 0) {
      if (const Merge* pm = find_merge(symbols[size_t(cur.prev)].id, cur.id)) {
        heap.push_back(Entry{pm->rank, cur.prev, pm->merged});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    }
    if (cur.next >= 0) {
      if (const Merge* nm = find_merge(cur.id, symbols[size_t(cur.next)].id)) {
        heap.push_back(Entry{nm->rank, top.pos, nm->merged});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    }
  }
  for (const Symbol& s : symbols)
    if (s.alive) ids.push_back(s.id);
}

}  // namespace lmx::tokenizer
