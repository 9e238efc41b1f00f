// Jinja values with Python's semantics: truthiness, str()/repr() (what templates print), equality, json.dumps
// (transformers' tojson) and conversion from nlohmann JSON. Used by jinja_eval.cpp and chat_template.cpp;
// evaluation of expressions is not here.
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "tokenizer/jinja_ast.h"

namespace lmx::jinja {

Value Value::from_array(Array a, bool tuple) {
  Value v;
  v.kind = Kind::kArray;
  v.is_tuple = tuple;
  v.array = std::make_shared<const Array>(std::move(a));
  return v;
}

Value Value::from_object(Object o) {
  Value v;
  v.kind = Kind::kObject;
  v.object = std::make_shared<Object>(std::move(o));
  return v;
}

Value Value::new_namespace(Object o) {
  Value v = from_object(std::move(o));
  v.kind = Kind::kNamespace;
  return v;
}

const Value* Object::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Object::set(std::string key, Value value) {
  for (auto& [k, v] : items) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(std::move(key), std::move(value));
}

std::vector<std::uint32_t> decode_utf8(std::string_view s) {
  std::vector<std::uint32_t> out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    auto b = static_cast<unsigned char>(s[i]);
    int len = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > s.size()) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    std::uint32_t cp = len == 1 ? b : b & (0xFF >> (len + 1));
    bool ok = true;
    for (int k = 1; k < len; ++k) {
      auto c = static_cast<unsigned char>(s[i + k]);
      ok = ok && (c & 0xC0) == 0x80;
      cp = (cp << 6) | (c & 0x3F);
    }
    out.push_back(ok ? cp : 0xFFFD);
    i += ok ? len : 1;
  }
  return out;
}

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string encode_utf8(const std::vector<std::uint32_t>& cps, std::size_t begin, std::size_t end) {
  std::string out;
  end = std::min(end, cps.size());
  for (std::size_t i = begin; i < end; ++i) append_utf8(out, cps[i]);
  return out;
}

bool is_py_space(std::uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// float.__repr__: the shortest digits that round-trip, in fixed notation when the decimal point falls in
// (-4, 16], otherwise d.ddde±XX — the rule in CPython's format_float_short.
std::string python_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string s(buf, res.ptr);
  bool negative = s[0] == '-';
  if (negative) s.erase(0, 1);
  std::size_t epos = s.find('e');
  int exponent = std::atoi(s.c_str() + epos + 1);
  std::string digits;
  for (std::size_t i = 0; i < epos; ++i)
    if (s[i] != '.') digits += s[i];
  int decpt = exponent + 1;
  std::string out;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out = "0." + std::string(static_cast<std::size_t>(-decpt), '0') + digits;
    } else if (decpt >= static_cast<int>(digits.size())) {
      out = digits + std::string(static_cast<std::size_t>(decpt) - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<std::size_t>(decpt)) + "." + digits.substr(static_cast<std::size_t>(decpt));
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char e[16];
    std::snprintf(e, sizeof e, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += e;
  }
  return negative ? "-" + out : out;
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return "str";
    case Value::Kind::kArray: return v.is_tuple ? "tuple" : "list";
    case Value::Kind::kObject: return "dict";
    case Value::Kind::kNamespace: return "Namespace";
    case Value::Kind::kCallable: return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return false;
    case Value::Kind::kBool: return v.boolean;
    case Value::Kind::kInt: return v.integer != 0;
    case Value::Kind::kFloat: return v.number != 0.0;
    case Value::Kind::kString: return !v.text.empty();
    case Value::Kind::kArray: return !v.array->empty();
    case Value::Kind::kObject: return !v.object->items.empty();
    case Value::Kind::kNamespace:
    case Value::Kind::kCallable: return true;
  }
  return false;
}

namespace {

bool repr_printable(std::uint32_t cp) {
  // str.isprintable() is false for controls, Latin-1 controls/NBSP/soft hyphen and the line/paragraph separators;
  // the rest of Unicode's non-printables are rare enough in chat data to treat as printable.
  return !(cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD || cp == 0x2028 || cp == 0x2029);
}

std::string repr_string(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (std::uint32_t cp : decode_utf8(s)) {
    if (cp == static_cast<std::uint32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (!repr_printable(cp)) {
      char buf[16];
      std::snprintf(buf, sizeof buf, cp <= 0xFF ? "\\x%02x" : "\\u%04x", cp);
      out += buf;
    } else {
      append_utf8(out, cp);
    }
  }
  out += quote;
  return out;
}

}  // namespace

std::string to_repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kString: return repr_string(v.text);
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kArray: {
      std::string out = v.is_tuple ? "(" : "[";
      for (std::size_t i = 0; i < v.array->size(); ++i) out += (i ? ", " : "") + to_repr((*v.array)[i]);
      if (v.is_tuple && v.array->size() == 1) out += ",";
      return out + (v.is_tuple ? ")" : "]");
    }
    case Value::Kind::kObject:
    case Value::Kind::kNamespace: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, item] : v.object->items) {
        out += (first ? "" : ", ") + repr_string(k) + ": " + to_repr(item);
        first = false;
      }
      out += "}";
      return v.kind == Value::Kind::kNamespace ? "<Namespace " + out + ">" : out;
    }
    default: return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.boolean ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.integer);
    case Value::Kind::kFloat: return python_float_repr(v.number);
    case Value::Kind::kString: return v.text;
    case Value::Kind::kCallable: return "<function " + v.callable->name + ">";
    default: return to_repr(v);
  }
}

bool values_equal(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind == K::kFloat || b.kind == K::kFloat) {
      double x = a.kind == K::kFloat ? a.number : static_cast<double>(a.kind == K::kBool ? a.boolean : a.integer);
      double y = b.kind == K::kFloat ? b.number : static_cast<double>(b.kind == K::kBool ? b.boolean : b.integer);
      return x == y;
    }
    std::int64_t x = a.kind == K::kBool ? a.boolean : a.integer;
    std::int64_t y = b.kind == K::kBool ? b.boolean : b.integer;
    return x == y;
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case K::kUndefined:
    case K::kNone: return true;
    case K::kString: return a.text == b.text;
    case K::kArray: {
      if (a.is_tuple != b.is_tuple || a.array->size() != b.array->size()) return false;
      for (std::size_t i = 0; i < a.array->size(); ++i)
        if (!values_equal((*a.array)[i], (*b.array)[i])) return false;
      return true;
    }
    case K::kObject: {
      if (a.object->items.size() != b.object->items.size()) return false;
      for (const auto& [k, v] : a.object->items) {
        const Value* other = b.object->find(k);
        if (!other || !values_equal(v, *other)) return false;
      }
      return true;
    }
    case K::kNamespace: return a.object == b.object;
    case K::kCallable: return a.callable == b.callable;
    default: return false;
  }
}

namespace {

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
          out += buf;
        } else {
          out += c;  // ensure_ascii=False: UTF-8 passes through
        }
    }
  }
  out += '"';
}

struct JsonWriter {
  bool indented;
  std::string indent_text;
  bool sort_keys;
  std::string item_sep;
  std::string key_sep;
  std::string out;
  std::string error;

  void newline(int level) {
    out += '\n';
    for (int i = 0; i < level; ++i) out += indent_text;
  }

  bool write(const Value& v, int level) {
    switch (v.kind) {
      case Value::Kind::kNone: out += "null"; return true;
      case Value::Kind::kBool: out += v.boolean ? "true" : "false"; return true;
      case Value::Kind::kInt: out += std::to_string(v.integer); return true;
      case Value::Kind::kFloat:
        out += std::isnan(v.number) ? "NaN" : std::isinf(v.number) ? (v.number > 0 ? "Infinity" : "-Infinity")
                                                                    : python_float_repr(v.number);
        return true;
      case Value::Kind::kString: json_string(out, v.text); return true;
      case Value::Kind::kArray: {
        if (v.array->empty()) {
          out += "[]";
          return true;
        }
        out += '[';
        for (std::size_t i = 0; i < v.array->size(); ++i) {
          if (i) out += item_sep;
          if (indented) newline(level + 1);
          if (!write((*v.array)[i], level + 1)) return false;
        }
        if (indented) newline(level);
        out += ']';
        return true;
      }
      case Value::Kind::kObject: {
        if (v.object->items.empty()) {
          out += "{}";
          return true;
        }
        std::vector<const std::pair<std::string, Value>*> items;
        for (const auto& kv : v.object->items) items.push_back(&kv);
        if (sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* x, auto* y) { return x->first < y->first; });
        out += '{';
        for (std::size_t i = 0; i < items.size(); ++i) {
          if (i) out += item_sep;
          if (indented) newline(level + 1);
          json_string(out, items[i]->first);
          out += key_sep;
          if (!write(items[i]->second, level + 1)) return false;
        }
        if (indented) newline(level);
        out += '}';
        return true;
      }
      default:
        error = "Object of type " + type_name(v) + " is not JSON serializable";
        return false;
    }
  }
};

template <typename J>
Value convert_json(const J& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return Value::none();
    case nlohmann::json::value_t::boolean: return Value::from_bool(j.template get<bool>());
    case nlohmann::json::value_t::number_integer: return Value::from_int(j.template get<std::int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      auto u = j.template get<std::uint64_t>();
      return u <= static_cast<std::uint64_t>(INT64_MAX) ? Value::from_int(static_cast<std::int64_t>(u))
                                                         : Value::from_float(static_cast<double>(u));
    }
    case nlohmann::json::value_t::number_float: return Value::from_float(j.template get<double>());
    case nlohmann::json::value_t::string: return Value::from_string(j.template get<std::string>());
    case nlohmann::json::value_t::array: {
      Array a;
      a.reserve(j.size());
      for (const auto& item : j) a.push_back(convert_json(item));
      return Value::from_array(std::move(a));
    }
    case nlohmann::json::value_t::object: {
      Object o;
      for (auto it = j.begin(); it != j.end(); ++it) o.items.emplace_back(it.key(), convert_json(it.value()));
      return Value::from_object(std::move(o));
    }
    default: return Value::undefined("unsupported JSON value");
  }
}

}  // namespace

Result<std::string> to_json_text(const Value& v, int indent, const std::string& indent_text, bool sort_keys,
                                 const std::string* item_sep, const std::string* key_sep) {
  JsonWriter w;
  w.indented = indent >= 0 || !indent_text.empty();
  w.indent_text = indent >= 0 ? std::string(static_cast<std::size_t>(indent), ' ') : indent_text;
  w.sort_keys = sort_keys;
  // json.dumps defaults: (', ', ': ') without indent, (',', ': ') with it.
  w.item_sep = item_sep ? *item_sep : (w.indented ? "," : ", ");
  w.key_sep = key_sep ? *key_sep : ": ";
  if (!w.write(v, 0)) return invalid_argument(w.error);
  return std::move(w.out);
}

Value from_json(const nlohmann::ordered_json& j) { return convert_json(j); }
Value from_json(const nlohmann::json& j) { return convert_json(j); }

}  // namespace lmx::jinja
