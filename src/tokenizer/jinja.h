// The Jinja2 subset interpreter behind chat templates: values, the parsed program, parse and render.
// It is internal to src/tokenizer (chat_template.cpp is its only caller); it knows nothing about chat,
// messages or tokens. Semantics follow Python jinja2 3.1 as configured by transformers (trim_blocks,
// lstrip_blocks, loopcontrols, default Undefined, immutable sandbox), because renders must match byte for byte.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace lmx::jinja {

struct Value;
struct Object;
struct Callable;
using Array = std::vector<Value>;

// One template value. A fat struct rather than a std::variant: the interpreter switches on `kind` everywhere
// and the unused members cost a few bytes per temporary, which chat templates never notice.
// Arrays and objects are shared and immutable once built (the sandbox forbids mutation), so copies are cheap;
// only a namespace() object is mutable, and it is shared by reference like in Python.
struct Value {
  enum class Kind : std::uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kArray, kObject, kNamespace, kCallable };
  Kind kind = Kind::kUndefined;
  bool boolean = false;
  bool is_tuple = false;  // kArray built as a Python tuple (only its repr differs)
  std::int64_t integer = 0;
  double number = 0.0;
  std::string text;  // kString; for kUndefined the message jinja2 raises when the value is used strictly
  std::shared_ptr<const Array> array;
  std::shared_ptr<Object> object;  // kObject (treated as immutable) and kNamespace (mutable, shared)
  std::shared_ptr<const Callable> callable;

  static Value undefined(std::string why) { Value v; v.text = std::move(why); return v; }
  static Value none() { Value v; v.kind = Kind::kNone; return v; }
  static Value from_bool(bool b) { Value v; v.kind = Kind::kBool; v.boolean = b; return v; }
  static Value from_int(std::int64_t i) { Value v; v.kind = Kind::kInt; v.integer = i; return v; }
  static Value from_float(double d) { Value v; v.kind = Kind::kFloat; v.number = d; return v; }
  static Value from_string(std::string s) { Value v; v.kind = Kind::kString; v.text = std::move(s); return v; }
  static Value from_array(Array a, bool tuple = false);
  static Value from_object(Object o);
  static Value new_namespace(Object o);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  bool is_mapping() const { return kind == Kind::kObject; }
};

// Insertion-ordered string-keyed map: Python dicts keep insertion order and tojson/items must reproduce it.
// Linear lookup, because chat objects have a handful of keys.
struct Object {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view key) const;
  void set(std::string key, Value value);  // replaces in place or appends
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

class Interpreter;
// Macros, builtins (range, namespace, raise_exception, ...) and bound methods ('x'.split).
struct Callable {
  std::string name;
  std::function<Value(Interpreter&, CallArgs&)> fn;  // may throw TemplateError (see jinja_eval.cpp)
};

// Python semantics used by both evaluation and the chat layer.
bool truthy(const Value& v);
std::string to_str(const Value& v);   // Python str(): what {{ v }} prints
std::string to_repr(const Value& v);  // Python repr(): how values print inside lists and dicts
// json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=...) — transformers' tojson.
// indent < 0 means None. Fails (Status) on undefined, callables and namespaces like Python's TypeError.
Result<std::string> to_json_text(const Value& v, int indent, const std::string& indent_text, bool sort_keys,
                                 const std::string* item_sep, const std::string* key_sep);
Value from_json(const nlohmann::ordered_json& j);
Value from_json(const nlohmann::json& j);  // keys come sorted: nlohmann::json does not keep their order

struct Program;  // the parsed template, defined in jinja_ast.h

// Parse a template; unsupported syntax fails here with "<origin>:<line>: <construct> ..." in the Status.
Result<std::shared_ptr<const Program>> parse(const std::string& source, const std::string& origin);
// Render with the given top-level variables (render() keyword arguments in jinja2).
Result<std::string> render(const Program& program, const Object& variables);

}  // namespace lmx::jinja
