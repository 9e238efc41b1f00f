// Tree-walking evaluator for parsed Jinja programs: scopes, statements, expressions, filters, tests,
// Python string/dict methods and the globals transformers installs (raise_exception, strftime_now, namespace,
// dict, range). Semantics are jinja2's, including its Undefined rules. Called through jinja::render().
// Runtime errors are thrown as TemplateError inside this file and returned as a Status by render(): threading a
// Result through every node of a recursive evaluator would bury the semantics under plumbing.
#include <algorithm>
#include <cmath>
#include <ctime>
#include <set>

#include <utf8proc.h>

#include "tokenizer/jinja_ast.h"

namespace lmx::jinja {
namespace {

struct TemplateError {
  int line;
  std::string message;
};

// The names the parser accepts. Kept here beside their implementations so the two cannot drift apart.
const std::set<std::string>& filter_names() {
  static const std::set<std::string> names = {
      "abs",  "capitalize", "count",   "d",          "default", "first",     "float", "indent",  "int",
      "items", "join",      "last",    "length",     "list",    "lower",     "map",   "reject",  "rejectattr",
      "replace", "reverse", "safe",    "select",     "selectattr", "sort",   "string", "sum",    "title",
      "tojson", "trim",     "unique",  "upper",      "dictsort", "min",      "max",   "round",   "wordcount"};
  return names;
}

const std::set<std::string>& test_names() {
  static const std::set<std::string> names = {
      "boolean", "callable", "defined", "divisibleby", "eq", "equalto", "escaped", "even", "false", "float",
      "ge", "greaterthan", "gt", "in", "integer", "iterable", "le", "lower", "lessthan", "lt", "mapping", "ne",
      "none", "number", "odd", "sameas", "sequence", "string", "true", "undefined", "upper", "==", "!=", "<",
      "<=", ">", ">="};
  return names;
}

struct Scope {
  std::shared_ptr<Scope> parent;
  Object vars;
};

enum class Flow { kNormal, kBreak, kContinue };

std::string object_type_repr(const Value& v) {
  if (v.kind == Value::Kind::kNone) return "None";
  return type_name(v) + " object";
}

std::int64_t as_int(const Value& v) { return v.kind == Value::Kind::kBool ? v.boolean : v.integer; }
double as_double(const Value& v) { return v.kind == Value::Kind::kFloat ? v.number : static_cast<double>(as_int(v)); }

std::int64_t floor_div(std::int64_t a, std::int64_t b) {
  std::int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

// Simple (one-to-one) Unicode case mapping from utf8proc. Python's str.upper() uses full case mapping, so
// the few one-to-many letters (German sharp s, ligatures) stay unchanged here where Python would expand them.
std::uint32_t cp_upper(std::uint32_t cp) { return static_cast<std::uint32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(cp))); }
std::uint32_t cp_lower(std::uint32_t cp) { return static_cast<std::uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))); }
std::string map_case(const std::string& s, std::uint32_t (*f)(std::uint32_t)) {
  std::string out;
  out.reserve(s.size());
  for (std::uint32_t cp : decode_utf8(s)) append_utf8(out, f(cp));
  return out;
}
std::string py_lower(const std::string& s) { return map_case(s, cp_lower); }
std::string py_upper(const std::string& s) { return map_case(s, cp_upper); }
bool is_alpha(std::uint32_t cp) {
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
}
bool is_cased(std::uint32_t cp) { return cp_upper(cp) != cp || cp_lower(cp) != cp; }

}  // namespace

bool known_filter(const std::string& name) { return filter_names().count(name) != 0; }
bool known_test(const std::string& name) { return test_names().count(name) != 0; }

class Interpreter {
 public:
  explicit Interpreter(const Program& program) : program_(program) {}

  std::string run(const Object& variables) {
    auto root = std::make_shared<Scope>();
    install_globals(root->vars);
    for (const auto& [k, v] : variables.items) root->vars.set(k, v);
    scope_ = root;
    std::string out;
    out_ = &out;
    exec(program_.body);
    return out;
  }

  [[noreturn]] void fail(const std::string& message) const { throw TemplateError{line_, message}; }

 private:
  // ---- scopes -------------------------------------------------------------------------------------------------
  Value lookup(const std::string& name) const {
    for (const Scope* s = scope_.get(); s; s = s->parent.get())
      if (const Value* v = s->vars.find(name)) return *v;
    return Value::undefined("'" + name + "' is undefined");
  }

  // Run `f` with a fresh child scope of `parent` (loops, macros, with), restoring the current one afterwards.
  template <typename F>
  auto in_scope(std::shared_ptr<Scope> parent, F&& f) {
    auto child = std::make_shared<Scope>();
    child->parent = std::move(parent);
    std::shared_ptr<Scope> saved = scope_;
    scope_ = child;
    struct Restore {
      Interpreter* self;
      std::shared_ptr<Scope> saved;
      ~Restore() { self->scope_ = std::move(saved); }
    } restore{this, std::move(saved)};
    return f();
  }

  // Render `body` into a string instead of the current output (macros, block set, filter blocks).
  std::string capture(const Body& body) {
    std::string buffer;
    std::string* saved = out_;
    out_ = &buffer;
    struct Restore {
      Interpreter* self;
      std::string* saved;
      ~Restore() { self->out_ = saved; }
    } restore{this, saved};
    exec(body);
    return buffer;
  }

  void assign(const Target& target, const Value& value) {
    if (!target.is_tuple) {
      scope_->vars.set(target.names[0], value);
      return;
    }
    std::vector<Value> items = iterate(value);
    if (items.size() != target.names.size())
      fail(items.size() > target.names.size() ? "too many values to unpack (expected " + std::to_string(target.names.size()) + ")"
                                              : "not enough values to unpack (expected " + std::to_string(target.names.size()) +
                                                    ", got " + std::to_string(items.size()) + ")");
    for (std::size_t i = 0; i < items.size(); ++i) scope_->vars.set(target.names[i], items[i]);
  }

  // ---- statements ---------------------------------------------------------------------------------------------
  Flow exec(const Body& body) {
    for (const auto& stmt : body) {
      Flow flow = exec(*stmt);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& s) {
    line_ = s.line;
    switch (s.kind) {
      case Stmt::Kind::kText: *out_ += s.text; return Flow::kNormal;
      case Stmt::Kind::kOutput: *out_ += to_str(eval(*s.expr)); return Flow::kNormal;
      case Stmt::Kind::kIf:
        for (std::size_t i = 0; i < s.conditions.size(); ++i)
          if (truthy(eval(*s.conditions[i]))) return exec(s.branches[i]);
        return exec(s.else_body);
      case Stmt::Kind::kFor: exec_for(s); return Flow::kNormal;
      case Stmt::Kind::kSet: {
        Value value = eval(*s.expr);
        if (!s.target.ns_attr.empty()) {
          Value ns = lookup(s.target.names[0]);
          if (ns.kind != Value::Kind::kNamespace) fail("cannot assign attribute on non-namespace object");
          if (!s.target.ns_attr.empty() && s.target.ns_attr[0] == '_')
            fail("cannot store underscore-prefixed attribute '" + s.target.ns_attr + "' on a namespace");
          ns.object->set(s.target.ns_attr, std::move(value));
        } else {
          assign(s.target, value);
        }
        return Flow::kNormal;
      }
      case Stmt::Kind::kSetBlock: {
        Value value = Value::from_string(capture(s.body));
        if (s.expr) value = eval_filter(*s.expr, &value);
        assign(s.target, value);
        return Flow::kNormal;
      }
      case Stmt::Kind::kMacro: scope_->vars.set(s.text, make_macro(s, s.text)); return Flow::kNormal;
      case Stmt::Kind::kCallBlock: {
        Value caller = make_macro(s, "caller");
        *out_ += to_str(eval_call(*s.expr, &caller));
        return Flow::kNormal;
      }
      case Stmt::Kind::kFilterBlock: {
        Value body = Value::from_string(capture(s.body));
        *out_ += to_str(eval_filter(*s.expr, &body));
        return Flow::kNormal;
      }
      case Stmt::Kind::kBreak: return Flow::kBreak;
      case Stmt::Kind::kContinue: return Flow::kContinue;
      case Stmt::Kind::kWith:
        return in_scope(scope_, [&] {
          for (const auto& [target, expr] : s.assignments) assign(target, eval(*expr));
          return exec(s.body);
        });
      case Stmt::Kind::kScope: return exec(s.body);
    }
    return Flow::kNormal;
  }

  void exec_for(const Stmt& s) {
    std::vector<Value> items = iterate(eval(*s.expr));
    if (s.condition) {  // `for x in xs if cond`: filtered before loop.* counts anything
      std::vector<Value> kept;
      for (const Value& item : items) {
        bool keep = in_scope(scope_, [&] {
          assign(s.target, item);
          return truthy(eval(*s.condition));
        });
        if (keep) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      in_scope(scope_, [&] { return exec(s.else_body); });
      return;
    }
    const auto length = static_cast<std::int64_t>(items.size());
    std::shared_ptr<Scope> outer = scope_;
    for (std::int64_t i = 0; i < length; ++i) {
      // Each iteration gets a fresh scope: jinja2 does not carry `set` values from one iteration to the next.
      Flow flow = in_scope(outer, [&] {
        assign(s.target, items[static_cast<std::size_t>(i)]);
        Object loop;
        loop.set("index", Value::from_int(i + 1));
        loop.set("index0", Value::from_int(i));
        loop.set("revindex", Value::from_int(length - i));
        loop.set("revindex0", Value::from_int(length - i - 1));
        loop.set("first", Value::from_bool(i == 0));
        loop.set("last", Value::from_bool(i == length - 1));
        loop.set("length", Value::from_int(length));
        loop.set("depth", Value::from_int(1));
        loop.set("depth0", Value::from_int(0));
        loop.set("previtem", i > 0 ? items[static_cast<std::size_t>(i - 1)] : Value::undefined("there is no previous item"));
        loop.set("nextitem", i + 1 < length ? items[static_cast<std::size_t>(i + 1)] : Value::undefined("there is no next item"));
        Callable cycle{"loop.cycle", [i](Interpreter& in, CallArgs& args) {
                         if (args.positional.empty()) in.fail("no items for cycling given");
                         return args.positional[static_cast<std::size_t>(i) % args.positional.size()];
                       }};
        Value cycle_value;
        cycle_value.kind = Value::Kind::kCallable;
        cycle_value.callable = std::make_shared<const Callable>(std::move(cycle));
        loop.set("cycle", cycle_value);
        scope_->vars.set("loop", Value::from_object(std::move(loop)));
        return exec(s.body);
      });
      if (flow == Flow::kBreak) break;
    }
  }

  // Macros and `{% call %}` callers: a callable closing over the scope it was defined in.
  Value make_macro(const Stmt& s, const std::string& name) {
    std::shared_ptr<Scope> closure = scope_;
    const Stmt* stmt = &s;
    Callable c{name, [stmt, closure, name](Interpreter& in, CallArgs& args) {
                 return in.call_macro(*stmt, closure, name, args);
               }};
    Value v;
    v.kind = Value::Kind::kCallable;
    v.callable = std::make_shared<const Callable>(std::move(c));
    return v;
  }

 public:
  Value call_macro(const Stmt& s, const std::shared_ptr<Scope>& closure, const std::string& name, CallArgs& args) {
    if (++call_depth_ > 200) fail("macro recursion too deep in '" + name + "'");
    int saved_line = line_;
    Value result = in_scope(closure, [&] {
      std::vector<bool> bound(s.params.size(), false);
      Array varargs;
      for (std::size_t i = 0; i < args.positional.size(); ++i) {
        if (i < s.params.size()) {
          scope_->vars.set(s.params[i].first, args.positional[i]);
          bound[i] = true;
        } else {
          varargs.push_back(args.positional[i]);
        }
      }
      Object kwargs;
      for (auto& [key, value] : args.keyword) {
        if (key == "caller") {
          scope_->vars.set("caller", value);
          continue;
        }
        const std::string& name = key;  // structured bindings cannot be captured before C++20 compilers caught up (clang 14)
        auto it = std::find_if(s.params.begin(), s.params.end(), [&](const auto& p) { return p.first == name; });
        if (it == s.params.end()) {
          kwargs.set(key, value);
          continue;
        }
        std::size_t idx = static_cast<std::size_t>(it - s.params.begin());
        if (bound[idx]) fail("macro '" + name + "' got multiple values for argument '" + key + "'");
        scope_->vars.set(key, value);
        bound[idx] = true;
      }
      for (std::size_t i = 0; i < s.params.size(); ++i) {
        if (bound[i]) continue;
        scope_->vars.set(s.params[i].first, s.params[i].second ? eval(*s.params[i].second)
                                                               : Value::undefined("parameter '" + s.params[i].first + "' was not provided"));
      }
      scope_->vars.set("varargs", Value::from_array(std::move(varargs), true));
      scope_->vars.set("kwargs", Value::from_object(std::move(kwargs)));
      return Value::from_string(capture(s.body));
    });
    line_ = saved_line;
    --call_depth_;
    return result;
  }

 private:
  // ---- expressions --------------------------------------------------------------------------------------------
  Value eval(const Expr& e) {
    line_ = e.line;
    switch (e.kind) {
      case Expr::Kind::kLiteral: return e.literal;
      case Expr::Kind::kName: return lookup(e.name);
      case Expr::Kind::kGetAttr: return get_attr(eval(*e.a), e.name);
      case Expr::Kind::kGetItem: {
        Value obj = eval(*e.a);
        return get_item(obj, eval(*e.b));
      }
      case Expr::Kind::kSlice: return eval_slice(e);
      case Expr::Kind::kCall: return eval_call(e, nullptr);
      case Expr::Kind::kFilter: return eval_filter(e, nullptr);
      case Expr::Kind::kTest: {
        Value input = eval(*e.a);
        CallArgs args = eval_args(e);
        bool result = apply_test(e.name, input, args);
        return Value::from_bool(e.negated ? !result : result);
      }
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        Value v = eval(*e.a);
        if (v.is_undefined()) fail(v.text);
        if (!v.is_number()) fail("bad operand type for unary " + std::string(e.kind == Expr::Kind::kNeg ? "-" : "+") + ": '" + type_name(v) + "'");
        if (e.kind == Expr::Kind::kPos) return v.kind == Value::Kind::kBool ? Value::from_int(v.boolean) : v;
        return v.kind == Value::Kind::kFloat ? Value::from_float(-v.number) : Value::from_int(-as_int(v));
      }
      case Expr::Kind::kNot: return Value::from_bool(!truthy(eval(*e.a)));
      case Expr::Kind::kAnd: {
        Value left = eval(*e.a);
        return truthy(left) ? eval(*e.b) : left;
      }
      case Expr::Kind::kOr: {
        Value left = eval(*e.a);
        return truthy(left) ? left : eval(*e.b);
      }
      case Expr::Kind::kBinary: {
        Value left = eval(*e.a);
        Value right = eval(*e.b);
        line_ = e.line;
        return binary(e.name, left, right);
      }
      case Expr::Kind::kCompare: {
        Value left = eval(*e.a);
        for (std::size_t i = 0; i < e.compare_ops.size(); ++i) {
          Value right = eval(*e.args[i]);
          line_ = e.line;
          if (!compare(e.compare_ops[i], left, right)) return Value::from_bool(false);
          left = std::move(right);
        }
        return Value::from_bool(true);
      }
      case Expr::Kind::kCondition:
        if (truthy(eval(*e.a))) return eval(*e.b);
        if (e.c) return eval(*e.c);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        Array items;
        for (const auto& item : e.args) items.push_back(eval(*item));
        return Value::from_array(std::move(items), e.kind == Expr::Kind::kTuple);
      }
      case Expr::Kind::kDict: {
        Object o;
        for (std::size_t i = 0; i + 1 < e.args.size(); i += 2) {
          Value key = eval(*e.args[i]);
          if (!key.is_string()) fail("dict literal keys must be strings here, got " + type_name(key));
          o.set(key.text, eval(*e.args[i + 1]));
        }
        return Value::from_object(std::move(o));
      }
    }
    fail("internal: unknown expression kind");
  }

  CallArgs eval_args(const Expr& e) {
    CallArgs args;
    for (const auto& a : e.args) args.positional.push_back(eval(*a));
    for (const auto& [k, v] : e.kwargs) args.keyword.emplace_back(k, eval(*v));
    line_ = e.line;
    return args;
  }

  Value eval_call(const Expr& e, const Value* caller) {
    Value callee = eval(*e.a);
    CallArgs args = eval_args(e);
    if (caller) args.keyword.emplace_back("caller", *caller);
    if (callee.is_undefined()) fail(callee.text);
    if (callee.kind != Value::Kind::kCallable) fail("'" + type_name(callee) + "' object is not callable");
    return callee.callable->fn(*this, args);
  }

  // A filter node; `block_input` replaces the innermost input for {% filter %} and {% set x | f %} bodies.
  Value eval_filter(const Expr& e, const Value* block_input) {
    Value input = e.a ? (e.a->kind == Expr::Kind::kFilter ? eval_filter(*e.a, block_input) : eval(*e.a))
                      : (block_input ? *block_input : Value::undefined("no filter input"));
    CallArgs args = eval_args(e);
    return apply_filter(e.name, input, args);
  }

  Value eval_slice(const Expr& e) {
    Value obj = eval(*e.a);
    auto bound = [&](const ExprPtr& p) -> std::optional<std::int64_t> {
      if (!p) return std::nullopt;
      Value v = eval(*p);
      if (v.kind == Value::Kind::kNone) return std::nullopt;
      if (v.kind != Value::Kind::kInt && v.kind != Value::Kind::kBool) fail("slice indices must be integers or None");
      return as_int(v);
    };
    auto start = bound(e.b), stop = bound(e.c), step_opt = bound(e.d);
    line_ = e.line;
    std::int64_t step = step_opt.value_or(1);
    if (step == 0) fail("slice step cannot be zero");
    if (obj.is_undefined()) fail(obj.text);
    auto pick = [&](std::int64_t n) {
      // Python's slice.indices()
      std::vector<std::int64_t> idx;
      auto clamp = [&](std::optional<std::int64_t> v, std::int64_t def) {
        if (!v) return def;
        std::int64_t x = *v < 0 ? *v + n : *v;
        if (step > 0) return std::clamp<std::int64_t>(x, 0, n);
        return std::clamp<std::int64_t>(x, -1, n - 1);
      };
      std::int64_t lo = clamp(start, step > 0 ? 0 : n - 1);
      std::int64_t hi = clamp(stop, step > 0 ? n : -1);
      for (std::int64_t i = lo; step > 0 ? i < hi : i > hi; i += step) idx.push_back(i);
      return idx;
    };
    if (obj.is_string()) {
      auto cps = decode_utf8(obj.text);
      std::string out;
      for (std::int64_t i : pick(static_cast<std::int64_t>(cps.size()))) append_utf8(out, cps[static_cast<std::size_t>(i)]);
      return Value::from_string(std::move(out));
    }
    if (obj.kind == Value::Kind::kArray) {
      Array out;
      for (std::int64_t i : pick(static_cast<std::int64_t>(obj.array->size()))) out.push_back((*obj.array)[static_cast<std::size_t>(i)]);
      return Value::from_array(std::move(out), obj.is_tuple);
    }
    return Value::undefined("'" + object_type_repr(obj) + "' is not subscriptable");
  }

  Value get_attr(const Value& obj, const std::string& name) {
    if (obj.is_undefined()) fail(obj.text);
    if (!name.empty() && name[0] == '_') return Value::undefined("access to attribute '" + name + "' is unsafe");
    switch (obj.kind) {
      case Value::Kind::kObject: {
        static const std::set<std::string> kDictMethods = {"get", "items", "keys", "values", "copy", "pop", "popitem",
                                                           "update", "setdefault", "clear"};
        if (kDictMethods.count(name)) return bound_method(obj, name);  // Python getattr wins over the key
        if (const Value* v = obj.object->find(name)) return *v;
        break;
      }
      case Value::Kind::kNamespace:
        if (const Value* v = obj.object->find(name)) return *v;
        break;
      case Value::Kind::kString: {
        static const std::set<std::string> kStrMethods = {
            "startswith", "endswith", "split", "rsplit", "strip", "lstrip", "rstrip", "replace", "upper", "lower",
            "title", "capitalize", "find", "rfind", "count", "join", "splitlines", "isdigit", "isalpha", "isspace",
            "isalnum", "islower", "isupper", "removeprefix", "removesuffix", "index"};
        if (kStrMethods.count(name)) return bound_method(obj, name);
        break;
      }
      case Value::Kind::kArray: {
        static const std::set<std::string> kListMethods = {"index", "count", "append", "pop", "extend", "insert", "remove", "sort", "reverse", "clear"};
        if (kListMethods.count(name)) return bound_method(obj, name);
        break;
      }
      default: break;
    }
    return Value::undefined("'" + object_type_repr(obj) + "' has no attribute '" + name + "'");
  }

  Value get_item(const Value& obj, const Value& key) {
    if (obj.is_undefined()) fail(obj.text);
    switch (obj.kind) {
      case Value::Kind::kObject:
      case Value::Kind::kNamespace:
        if (key.is_string()) {
          if (const Value* v = obj.object->find(key.text)) return *v;
          return get_attr(obj, key.text);
        }
        break;
      case Value::Kind::kArray:
      case Value::Kind::kString:
        if (key.kind == Value::Kind::kInt || key.kind == Value::Kind::kBool) {
          std::int64_t i = as_int(key);
          if (obj.is_string()) {
            auto cps = decode_utf8(obj.text);
            auto n = static_cast<std::int64_t>(cps.size());
            if (i < 0) i += n;
            if (i >= 0 && i < n) return Value::from_string(encode_utf8(cps, static_cast<std::size_t>(i), static_cast<std::size_t>(i + 1)));
          } else {
            auto n = static_cast<std::int64_t>(obj.array->size());
            if (i < 0) i += n;
            if (i >= 0 && i < n) return (*obj.array)[static_cast<std::size_t>(i)];
          }
          return Value::undefined("'" + object_type_repr(obj) + "' has no attribute '" + to_str(key) + "'");
        }
        if (key.is_string()) return get_attr(obj, key.text);
        break;
      default: break;
    }
    return Value::undefined("'" + object_type_repr(obj) + "' has no attribute '" + to_str(key) + "'");
  }

  Value bound_method(const Value& receiver, const std::string& name) {
    Callable c{name, [receiver, name](Interpreter& in, CallArgs& args) { return in.call_method(receiver, name, args); }};
    Value v;
    v.kind = Value::Kind::kCallable;
    v.callable = std::make_shared<const Callable>(std::move(c));
    return v;
  }

  // ---- operators ----------------------------------------------------------------------------------------------
  [[noreturn]] void operand_error(const std::string& op, const Value& a, const Value& b) {
    if (a.is_undefined()) fail(a.text);
    if (b.is_undefined()) fail(b.text);
    fail("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  }

  Value binary(const std::string& op, const Value& a, const Value& b) {
    using K = Value::Kind;
    if (op == "~") return Value::from_string(to_str(a) + to_str(b));
    bool numeric = a.is_number() && b.is_number();
    bool floating = numeric && (a.kind == K::kFloat || b.kind == K::kFloat);
    if (op == "+") {
      if (numeric) return floating ? Value::from_float(as_double(a) + as_double(b)) : Value::from_int(as_int(a) + as_int(b));
      if (a.is_string() && b.is_string()) return Value::from_string(a.text + b.text);
      if (a.kind == K::kArray && b.kind == K::kArray && a.is_tuple == b.is_tuple) {
        Array out = *a.array;
        out.insert(out.end(), b.array->begin(), b.array->end());
        return Value::from_array(std::move(out), a.is_tuple);
      }
      operand_error(op, a, b);
    }
    if (op == "*") {
      if (numeric) return floating ? Value::from_float(as_double(a) * as_double(b)) : Value::from_int(as_int(a) * as_int(b));
      const Value* seq = a.is_number() ? &b : &a;
      const Value* count = a.is_number() ? &a : &b;
      if (count->is_number() && count->kind != K::kFloat) {
        std::int64_t n = std::max<std::int64_t>(0, as_int(*count));
        if (seq->is_string()) {
          std::string out;
          for (std::int64_t i = 0; i < n; ++i) out += seq->text;
          return Value::from_string(std::move(out));
        }
        if (seq->kind == K::kArray) {
          Array out;
          for (std::int64_t i = 0; i < n; ++i) out.insert(out.end(), seq->array->begin(), seq->array->end());
          return Value::from_array(std::move(out), seq->is_tuple);
        }
      }
      operand_error(op, a, b);
    }
    if (!numeric) {
      if (op == "%" && a.is_string()) fail("unsupported construct: printf-style string formatting with '%'");
      operand_error(op, a, b);
    }
    if (op == "-") return floating ? Value::from_float(as_double(a) - as_double(b)) : Value::from_int(as_int(a) - as_int(b));
    if (op == "/") {
      if (as_double(b) == 0.0) fail("division by zero");
      return Value::from_float(as_double(a) / as_double(b));
    }
    if (op == "//" || op == "%") {
      if (as_double(b) == 0.0) fail(op == "%" ? "modulo by zero" : "integer division or modulo by zero");
      if (floating) {
        double x = as_double(a), y = as_double(b);
        double q = std::floor(x / y);
        return op == "//" ? Value::from_float(q) : Value::from_float(x - q * y);
      }
      std::int64_t q = floor_div(as_int(a), as_int(b));
      return op == "//" ? Value::from_int(q) : Value::from_int(as_int(a) - q * as_int(b));
    }
    if (op == "**") {
      if (!floating && as_int(b) >= 0) {
        std::int64_t result = 1;
        for (std::int64_t i = 0; i < as_int(b); ++i) result *= as_int(a);
        return Value::from_int(result);
      }
      return Value::from_float(std::pow(as_double(a), as_double(b)));
    }
    fail("internal: unknown operator " + op);
  }

  bool contains(const Value& container, const Value& item) {
    switch (container.kind) {
      case Value::Kind::kUndefined: return false;
      case Value::Kind::kString:
        if (!item.is_string()) fail("'in <string>' requires string as left operand, not " + type_name(item));
        return container.text.find(item.text) != std::string::npos;
      case Value::Kind::kArray:
        return std::any_of(container.array->begin(), container.array->end(), [&](const Value& v) { return values_equal(v, item); });
      case Value::Kind::kObject: return item.is_string() && container.object->find(item.text) != nullptr;
      default: fail("argument of type '" + type_name(container) + "' is not iterable");
    }
  }

  bool compare(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return values_equal(a, b);
    if (op == "!=") return !values_equal(a, b);
    if (op == "in") return contains(b, a);
    if (op == "notin") return !contains(b, a);
    int order = three_way(op, a, b);
    if (op == "<") return order < 0;
    if (op == "<=") return order <= 0;
    if (op == ">") return order > 0;
    return order >= 0;
  }

  int three_way(const std::string& op, const Value& a, const Value& b) {
    if (a.is_number() && b.is_number()) {
      double x = as_double(a), y = as_double(b);
      if (a.kind != Value::Kind::kFloat && b.kind != Value::Kind::kFloat) return as_int(a) < as_int(b) ? -1 : as_int(a) > as_int(b);
      return x < y ? -1 : x > y;
    }
    if (a.is_string() && b.is_string()) return a.text < b.text ? -1 : a.text > b.text;  // UTF-8 order == code point order
    if (a.kind == Value::Kind::kArray && b.kind == Value::Kind::kArray) {
      for (std::size_t i = 0; i < std::min(a.array->size(), b.array->size()); ++i) {
        if (values_equal((*a.array)[i], (*b.array)[i])) continue;
        return three_way(op, (*a.array)[i], (*b.array)[i]);
      }
      return a.array->size() < b.array->size() ? -1 : a.array->size() > b.array->size();
    }
    if (a.is_undefined()) fail(a.text);
    if (b.is_undefined()) fail(b.text);
    fail("'" + (op == "notin" ? std::string("not in") : op) + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
  }

 public:
  // Python iteration: lists, dict keys, string characters; Undefined iterates as empty.
  std::vector<Value> iterate(const Value& v) {
    switch (v.kind) {
      case Value::Kind::kUndefined: return {};
      case Value::Kind::kArray: return *v.array;
      case Value::Kind::kObject: {
        std::vector<Value> keys;
        for (const auto& kv : v.object->items) keys.push_back(Value::from_string(kv.first));
        return keys;
      }
      case Value::Kind::kString: {
        std::vector<Value> chars;
        for (std::uint32_t cp : decode_utf8(v.text)) {
          std::string s;
          append_utf8(s, cp);
          chars.push_back(Value::from_string(std::move(s)));
        }
        return chars;
      }
      default: fail("'" + type_name(v) + "' object is not iterable");
    }
  }

  std::int64_t length(const Value& v) {
    switch (v.kind) {
      case Value::Kind::kUndefined: return 0;
      case Value::Kind::kString: return static_cast<std::int64_t>(decode_utf8(v.text).size());
      case Value::Kind::kArray: return static_cast<std::int64_t>(v.array->size());
      case Value::Kind::kObject: return static_cast<std::int64_t>(v.object->items.size());
      default: fail("object of type '" + type_name(v) + "' has no len()");
    }
  }

  // ---- arguments ----------------------------------------------------------------------------------------------
  // Positional `index` or keyword `name`, else `fallback`.
  static const Value* arg(const CallArgs& args, std::size_t index, const char* name) {
    if (index < args.positional.size()) return &args.positional[index];
    for (const auto& [k, v] : args.keyword)
      if (k == name) return &v;
    return nullptr;
  }
  Value arg_or(const CallArgs& args, std::size_t index, const char* name, Value fallback) {
    const Value* v = arg(args, index, name);
    return v ? *v : fallback;
  }
  std::string string_arg(const CallArgs& args, std::size_t index, const char* name, const char* what) {
    const Value* v = arg(args, index, name);
    if (!v || !v->is_string()) fail(std::string(what) + " expects a string argument '" + name + "'");
    return v->text;
  }

  // ---- Python methods -----------------------------------------------------------------------------------------
  static std::string strip_chars(const std::string& s, const Value* chars, bool left, bool right) {
    auto cps = decode_utf8(s);
    std::vector<std::uint32_t> set;
    bool whitespace = !chars || chars->kind == Value::Kind::kNone;
    if (!whitespace) set = decode_utf8(chars->text);
    auto strip_it = [&](std::uint32_t cp) { return whitespace ? is_py_space(cp) : std::find(set.begin(), set.end(), cp) != set.end(); };
    std::size_t b = 0, e = cps.size();
    if (left)
      while (b < e && strip_it(cps[b])) ++b;
    if (right)
      while (e > b && strip_it(cps[e - 1])) --e;
    return encode_utf8(cps, b, e);
  }

  static std::vector<std::string> split_whitespace(const std::string& s, std::int64_t maxsplit) {
    auto cps = decode_utf8(s);
    std::vector<std::string> parts;
    std::size_t i = 0;
    while (true) {
      while (i < cps.size() && is_py_space(cps[i])) ++i;
      if (i >= cps.size()) break;
      if (maxsplit >= 0 && static_cast<std::int64_t>(parts.size()) == maxsplit) {
        std::size_t e = cps.size();
        while (e > i && is_py_space(cps[e - 1])) --e;
        parts.push_back(encode_utf8(cps, i, e));
        break;
      }
      std::size_t j = i;
      while (j < cps.size() && !is_py_space(cps[j])) ++j;
      parts.push_back(encode_utf8(cps, i, j));
      i = j;
    }
    return parts;
  }

  std::vector<std::string> split_sep(const std::string& s, const std::string& sep, std::int64_t maxsplit, bool from_right) {
    if (sep.empty()) fail("empty separator");
    std::vector<std::string> parts;
    if (!from_right) {
      std::size_t start = 0;
      while (maxsplit < 0 || static_cast<std::int64_t>(parts.size()) < maxsplit) {
        std::size_t hit = s.find(sep, start);
        if (hit == std::string::npos) break;
        parts.push_back(s.substr(start, hit - start));
        start = hit + sep.size();
      }
      parts.push_back(s.substr(start));
      return parts;
    }
    std::size_t end = s.size();
    while (maxsplit < 0 || static_cast<std::int64_t>(parts.size()) < maxsplit) {
      if (end < sep.size()) break;
      std::size_t hit = s.rfind(sep, end - sep.size());
      if (hit == std::string::npos) break;
      parts.push_back(s.substr(hit + sep.size(), end - hit - sep.size()));
      end = hit;
    }
    parts.push_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
    return parts;
  }

  static std::string replace_all(const std::string& s, const std::string& from, const std::string& to, std::int64_t count) {
    std::string out;
    if (from.empty()) {  // Python inserts `to` around every character
      auto cps = decode_utf8(s);
      std::int64_t done = 0;
      for (std::size_t i = 0; i <= cps.size(); ++i) {
        if (count < 0 || done < count) {
          out += to;
          ++done;
        }
        if (i < cps.size()) append_utf8(out, cps[i]);
      }
      return out;
    }
    std::size_t start = 0;
    std::int64_t done = 0;
    while (count < 0 || done < count) {
      std::size_t hit = s.find(from, start);
      if (hit == std::string::npos) break;
      out.append(s, start, hit - start);
      out += to;
      start = hit + from.size();
      ++done;
    }
    out.append(s, start, std::string::npos);
    return out;
  }

  static std::string py_title(const std::string& s) {  // str.title(): upper after a non-letter, lower after a letter
    std::string out;
    bool prev_cased = false;
    for (std::uint32_t cp : decode_utf8(s)) {
      append_utf8(out, prev_cased ? cp_lower(cp) : cp_upper(cp));
      prev_cased = is_cased(cp);
    }
    return out;
  }

  static std::string py_capitalize(const std::string& s) {
    auto cps = decode_utf8(s);
    std::string out;
    for (std::size_t i = 0; i < cps.size(); ++i) append_utf8(out, i == 0 ? cp_upper(cps[i]) : cp_lower(cps[i]));
    return out;
  }

  static std::vector<std::string> splitlines(const std::string& s) {
    std::vector<std::string> lines;
    auto cps = decode_utf8(s);
    std::size_t start = 0;
    for (std::size_t i = 0; i < cps.size(); ++i) {
      std::uint32_t c = cps[i];
      bool brk = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x85 || c == 0x2028 || c == 0x2029;
      if (!brk) continue;
      lines.push_back(encode_utf8(cps, start, i));
      if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
      start = i + 1;
    }
    if (start < cps.size()) lines.push_back(encode_utf8(cps, start, cps.size()));
    return lines;
  }

  static Value string_list(std::vector<std::string> parts) {
    Array out;
    for (auto& p : parts) out.push_back(Value::from_string(std::move(p)));
    return Value::from_array(std::move(out));
  }

  std::int64_t int_arg(const CallArgs& args, std::size_t index, const char* name, std::int64_t fallback) {
    const Value* v = arg(args, index, name);
    if (!v || v->kind == Value::Kind::kNone) return fallback;
    if (v->kind != Value::Kind::kInt && v->kind != Value::Kind::kBool) fail(std::string("argument '") + name + "' must be an integer");
    return as_int(*v);
  }

  Value call_method(const Value& self, const std::string& name, CallArgs& args) {
    if (self.kind == Value::Kind::kArray) {
      if (name == "index" || name == "count") {
        const Value* x = arg(args, 0, "x");
        if (!x) fail("list." + name + "() takes exactly one argument");
        std::int64_t count = 0;
        for (std::size_t i = 0; i < self.array->size(); ++i) {
          if (!values_equal((*self.array)[i], *x)) continue;
          if (name == "index") return Value::from_int(static_cast<std::int64_t>(i));
          ++count;
        }
        if (name == "index") fail(to_repr(*x) + " is not in list");
        return Value::from_int(count);
      }
      fail("access to attribute '" + name + "' of 'list' object is unsafe (the template sandbox is immutable)");
    }
    if (self.kind == Value::Kind::kObject) {
      if (name == "get") {
        const Value* key = arg(args, 0, "key");
        if (!key) fail("get expected at least 1 argument, got 0");
        if (key->is_string())
          if (const Value* v = self.object->find(key->text)) return *v;
        return arg_or(args, 1, "default", Value::none());
      }
      if (name == "items" || name == "keys" || name == "values") {
        Array out;
        for (const auto& [k, v] : self.object->items) {
          if (name == "items") out.push_back(Value::from_array({Value::from_string(k), v}, true));
          else if (name == "keys") out.push_back(Value::from_string(k));
          else out.push_back(v);
        }
        return Value::from_array(std::move(out));
      }
      if (name == "copy") return Value::from_object(*self.object);
      fail("access to attribute '" + name + "' of 'dict' object is unsafe (the template sandbox is immutable)");
    }
    const std::string& s = self.text;
    if (name == "startswith" || name == "endswith") {
      const Value* p = arg(args, 0, "prefix");
      if (!p) fail(name + "() takes at least 1 argument");
      std::vector<std::string> options;
      if (p->is_string()) options.push_back(p->text);
      else if (p->kind == Value::Kind::kArray)
        for (const Value& o : *p->array) options.push_back(o.is_string() ? o.text : (fail(name + "() tuple items must be str"), ""));
      else fail(name + " first arg must be str or a tuple of str, not " + type_name(*p));
      for (const auto& o : options) {
        if (o.size() > s.size()) continue;
        if (name == "startswith" ? s.compare(0, o.size(), o) == 0 : s.compare(s.size() - o.size(), o.size(), o) == 0)
          return Value::from_bool(true);
      }
      return Value::from_bool(false);
    }
    if (name == "split" || name == "rsplit") {
      const Value* sep = arg(args, 0, "sep");
      std::int64_t maxsplit = int_arg(args, 1, "maxsplit", -1);
      if (!sep || sep->kind == Value::Kind::kNone) {
        if (name == "rsplit" && maxsplit >= 0) fail("rsplit() without separator and with maxsplit is not supported");
        return string_list(split_whitespace(s, maxsplit));
      }
      if (!sep->is_string()) fail("must be str or None, not " + type_name(*sep));
      return string_list(split_sep(s, sep->text, maxsplit, name == "rsplit"));
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return Value::from_string(strip_chars(s, arg(args, 0, "chars"), name != "rstrip", name != "lstrip"));
    if (name == "replace") {
      std::string from = string_arg(args, 0, "old", "replace()");
      std::string to = string_arg(args, 1, "new", "replace()");
      return Value::from_string(replace_all(s, from, to, int_arg(args, 2, "count", -1)));
    }
    if (name == "upper") return Value::from_string(py_upper(s));
    if (name == "lower") return Value::from_string(py_lower(s));
    if (name == "title") return Value::from_string(py_title(s));
    if (name == "capitalize") return Value::from_string(py_capitalize(s));
    if (name == "find" || name == "rfind" || name == "index") {
      std::string sub = string_arg(args, 0, "sub", name.c_str());
      std::size_t hit = name == "rfind" ? s.rfind(sub) : s.find(sub);
      if (hit == std::string::npos) {
        if (name == "index") fail("substring not found");
        return Value::from_int(-1);
      }
      return Value::from_int(static_cast<std::int64_t>(decode_utf8(s.substr(0, hit)).size()));
    }
    if (name == "count") {
      std::string sub = string_arg(args, 0, "sub", "count()");
      if (sub.empty()) return Value::from_int(static_cast<std::int64_t>(decode_utf8(s).size()) + 1);
      std::int64_t n = 0;
      for (std::size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
      return Value::from_int(n);
    }
    if (name == "join") {
      const Value* items = arg(args, 0, "iterable");
      if (!items) fail("join() takes exactly one argument");
      std::string out;
      bool first = true;
      for (const Value& v : iterate(*items)) {
        if (!v.is_string()) fail("sequence item: expected str instance, " + type_name(v) + " found");
        out += (first ? "" : s) + v.text;
        first = false;
      }
      return Value::from_string(std::move(out));
    }
    if (name == "splitlines") return string_list(splitlines(s));
    if (name == "removeprefix" || name == "removesuffix") {
      std::string x = string_arg(args, 0, "prefix", name.c_str());
      if (name == "removeprefix" && s.compare(0, x.size(), x) == 0) return Value::from_string(s.substr(x.size()));
      if (name == "removesuffix" && !x.empty() && x.size() <= s.size() && s.compare(s.size() - x.size(), x.size(), x) == 0)
        return Value::from_string(s.substr(0, s.size() - x.size()));
      return self;
    }
    auto all_of = [&](auto pred) {
      auto cps = decode_utf8(s);
      return Value::from_bool(!cps.empty() && std::all_of(cps.begin(), cps.end(), pred));
    };
    if (name == "isdigit") return all_of([](std::uint32_t c) { return c >= '0' && c <= '9'; });
    if (name == "isalpha") return all_of([](std::uint32_t c) { return is_alpha(c); });
    if (name == "isalnum") return all_of([](std::uint32_t c) { return is_alpha(c) || (c >= '0' && c <= '9'); });
    if (name == "isspace") return all_of([](std::uint32_t c) { return is_py_space(c); });
    if (name == "islower" || name == "isupper") {
      bool cased = false, ok = true;
      for (std::uint32_t cp : decode_utf8(s)) {
        bool lower = cp_upper(cp) != cp, upper = cp_lower(cp) != cp;
        if (lower) { cased = true; ok = ok && name == "islower"; }
        if (upper) { cased = true; ok = ok && name == "isupper"; }
      }
      return Value::from_bool(cased && ok);
    }
    fail("'str' object has no attribute '" + name + "'");
  }

  // ---- filters ------------------------------------------------------------------------------------------------
  // jinja2's attribute getter for map/selectattr/sort/join: dotted path, integer parts index.
  Value attribute_of(const Value& item, const std::string& path) {
    Value v = item;
    std::size_t start = 0;
    while (true) {
      std::size_t dot = path.find('.', start);
      std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
      v = get_item(v, numeric ? Value::from_int(std::stoll(part)) : Value::from_string(part));
      if (dot == std::string::npos) return v;
      start = dot + 1;
    }
  }

  std::string attribute_arg(const CallArgs& args, std::size_t index, const char* what) {
    const Value* a = arg(args, index, "attribute");
    if (!a) return "";
    if (a->is_string()) return a->text;
    if (a->kind == Value::Kind::kInt) return std::to_string(a->integer);
    fail(std::string(what) + ": attribute must be a string");
  }

  Value apply_filter(const std::string& name, const Value& input, CallArgs& args) {
    if (name == "safe") return input;
    if (name == "string") return input.is_string() ? input : Value::from_string(to_str(input));
    if (name == "length" || name == "count") return Value::from_int(length(input));
    if (name == "default" || name == "d") {
      bool boolean = truthy(arg_or(args, 1, "boolean", Value::from_bool(false)));
      if (input.is_undefined() || (boolean && !truthy(input))) return arg_or(args, 0, "default_value", Value::from_string(""));
      return input;
    }
    if (name == "trim") return Value::from_string(strip_chars(to_str(input), arg(args, 0, "chars"), true, true));
    if (name == "upper") return Value::from_string(py_upper(to_str(input)));
    if (name == "lower") return Value::from_string(py_lower(to_str(input)));
    if (name == "capitalize") return Value::from_string(py_capitalize(to_str(input)));
    if (name == "title") {
      // jinja2's do_title: words start after runs of [-\s({[<], not after every non-letter like str.title()
      std::string out;
      bool at_word_start = true;
      for (std::uint32_t cp : decode_utf8(to_str(input))) {
        bool delim = cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || is_py_space(cp);
        if (delim) {
          append_utf8(out, cp);
          at_word_start = true;
        } else {
          append_utf8(out, at_word_start ? cp_upper(cp) : cp_lower(cp));
          at_word_start = false;
        }
      }
      return Value::from_string(std::move(out));
    }
    if (name == "replace") {
      std::string s = to_str(input);
      const Value* from = arg(args, 0, "old");
      const Value* to = arg(args, 1, "new");
      if (!from || !to) fail("replace filter needs 'old' and 'new'");
      return Value::from_string(replace_all(s, to_str(*from), to_str(*to), int_arg(args, 2, "count", -1)));
    }
    if (name == "indent") {
      const Value* width = arg(args, 0, "width");
      std::string indention = width && width->is_string() ? width->text : std::string(static_cast<std::size_t>(width ? as_int(*width) : 4), ' ');
      bool first = truthy(arg_or(args, 1, "first", Value::from_bool(false)));
      bool blank = truthy(arg_or(args, 2, "blank", Value::from_bool(false)));
      std::vector<std::string> lines = splitlines(to_str(input) + "\n");
      std::string rv;
      if (blank) {
        for (std::size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + indention : "") + lines[i];
      } else {
        rv = lines.empty() ? "" : lines[0];
        for (std::size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : indention + lines[i]);
      }
      return Value::from_string(first ? indention + rv : rv);
    }
    if (name == "tojson") {
      const Value* indent = arg(args, 0, "indent");
      const Value* separators = arg(args, 3, "separators");
      bool sort_keys = truthy(arg_or(args, 4, "sort_keys", Value::from_bool(false)));
      if (truthy(arg_or(args, 1, "ensure_ascii", Value::from_bool(false)))) fail("tojson(ensure_ascii=True) is not supported");
      int indent_n = -1;
      std::string indent_text;
      if (indent && indent->is_string()) indent_text = indent->text;
      else if (indent && indent->kind != Value::Kind::kNone) indent_n = static_cast<int>(as_int(*indent));
      std::string item_sep, key_sep;
      if (separators && separators->kind == Value::Kind::kArray && separators->array->size() == 2) {
        item_sep = to_str((*separators->array)[0]);
        key_sep = to_str((*separators->array)[1]);
      }
      bool custom = separators && separators->kind == Value::Kind::kArray;
      auto text = to_json_text(input, indent_n, indent_text, sort_keys, custom ? &item_sep : nullptr, custom ? &key_sep : nullptr);
      if (!text.ok()) fail(text.status().message());
      return Value::from_string(text.value());
    }
    if (name == "join") {
      std::string sep = to_str(arg_or(args, 0, "d", Value::from_string("")));
      std::string attribute = attribute_arg(args, 1, "join");
      std::string out;
      bool first = true;
      for (const Value& v : iterate(input)) {
        out += (first ? "" : sep) + to_str(attribute.empty() ? v : attribute_of(v, attribute));
        first = false;
      }
      return Value::from_string(std::move(out));
    }
    if (name == "first" || name == "last") {
      std::vector<Value> items = iterate(input);
      if (items.empty()) return Value::undefined("No " + name + " item, sequence was empty.");
      return name == "first" ? items.front() : items.back();
    }
    if (name == "list") return Value::from_array(iterate(input));
    if (name == "items") {
      if (input.is_undefined()) return Value::from_array({});
      if (input.kind != Value::Kind::kObject) fail("Can only get item pairs from a mapping.");
      CallArgs none;
      return call_method(input, "items", none);
    }
    if (name == "dictsort") {
      if (input.kind != Value::Kind::kObject) fail("dictsort: value must be a dict");
      bool case_sensitive = truthy(arg_or(args, 0, "case_sensitive", Value::from_bool(false)));
      std::string by = to_str(arg_or(args, 1, "by", Value::from_string("key")));
      bool reverse = truthy(arg_or(args, 2, "reverse", Value::from_bool(false)));
      std::vector<Value> pairs;
      for (const auto& [k, v] : input.object->items) pairs.push_back(Value::from_array({Value::from_string(k), v}, true));
      std::size_t pos = by == "value" ? 1 : 0;
      sort_values(pairs, [&](const Value& p) { return (*p.array)[pos]; }, case_sensitive, reverse);
      return Value::from_array(std::move(pairs));
    }
    if (name == "reverse") {
      if (input.is_string()) {
        auto cps = decode_utf8(input.text);
        std::reverse(cps.begin(), cps.end());
        return Value::from_string(encode_utf8(cps));
      }
      std::vector<Value> items = iterate(input);
      std::reverse(items.begin(), items.end());
      return Value::from_array(std::move(items));
    }
    if (name == "int") {
      Value fallback = arg_or(args, 0, "default", Value::from_int(0));
      switch (input.kind) {
        case Value::Kind::kInt: return input;
        case Value::Kind::kBool: return Value::from_int(input.boolean);
        case Value::Kind::kFloat: return std::isfinite(input.number) ? Value::from_int(static_cast<std::int64_t>(input.number)) : fallback;
        case Value::Kind::kString: {
          std::string t = strip_chars(input.text, nullptr, true, true);
          char* end = nullptr;
          long long i = std::strtoll(t.c_str(), &end, 10);
          if (!t.empty() && end && *end == 0) return Value::from_int(i);
          double d = std::strtod(t.c_str(), &end);
          if (!t.empty() && end && *end == 0 && std::isfinite(d)) return Value::from_int(static_cast<std::int64_t>(d));
          return fallback;
        }
        default: return fallback;
      }
    }
    if (name == "float") {
      Value fallback = arg_or(args, 0, "default", Value::from_float(0.0));
      if (input.is_number()) return Value::from_float(as_double(input));
      if (input.is_string()) {
        std::string t = strip_chars(input.text, nullptr, true, true);
        char* end = nullptr;
        double d = std::strtod(t.c_str(), &end);
        if (!t.empty() && end && *end == 0) return Value::from_float(d);
      }
      return fallback;
    }
    if (name == "abs") {
      if (!input.is_number()) fail("bad operand type for abs(): '" + type_name(input) + "'");
      return input.kind == Value::Kind::kFloat ? Value::from_float(std::fabs(input.number)) : Value::from_int(std::llabs(as_int(input)));
    }
    if (name == "round") {
      if (!input.is_number()) fail("round filter needs a number");
      std::int64_t precision = int_arg(args, 0, "precision", 0);
      std::string method = to_str(arg_or(args, 1, "method", Value::from_string("common")));
      double scale = std::pow(10.0, static_cast<double>(precision));
      double x = as_double(input) * scale;
      double r = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::round(x);
      return Value::from_float(r / scale);
    }
    if (name == "wordcount") return Value::from_int(static_cast<std::int64_t>(split_whitespace(to_str(input), -1).size()));
    if (name == "sum") {
      std::string attribute = attribute_arg(args, 0, "sum");
      Value total = arg_or(args, 1, "start", Value::from_int(0));
      for (const Value& v : iterate(input)) total = binary("+", total, attribute.empty() ? v : attribute_of(v, attribute));
      return total;
    }
    if (name == "min" || name == "max") {
      std::vector<Value> items = iterate(input);
      if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
      bool case_sensitive = truthy(arg_or(args, 0, "case_sensitive", Value::from_bool(false)));
      std::string attribute = attribute_arg(args, 1, name.c_str());
      auto key = [&](const Value& v) { return attribute.empty() ? v : attribute_of(v, attribute); };
      sort_values(items, key, case_sensitive, false);
      return name == "min" ? items.front() : items.back();
    }
    if (name == "sort") {
      std::vector<Value> items = iterate(input);
      bool reverse = truthy(arg_or(args, 0, "reverse", Value::from_bool(false)));
      bool case_sensitive = truthy(arg_or(args, 1, "case_sensitive", Value::from_bool(false)));
      std::string attribute = attribute_arg(args, 2, "sort");
      sort_values(items, [&](const Value& v) { return attribute.empty() ? v : attribute_of(v, attribute); }, case_sensitive, reverse);
      return Value::from_array(std::move(items));
    }
    if (name == "unique") {
      bool case_sensitive = truthy(arg_or(args, 0, "case_sensitive", Value::from_bool(false)));
      std::string attribute = attribute_arg(args, 1, "unique");
      Array out;
      std::vector<Value> seen;
      for (const Value& v : iterate(input)) {
        Value key = attribute.empty() ? v : attribute_of(v, attribute);
        if (!case_sensitive && key.is_string()) key = Value::from_string(py_lower(key.text));
        if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return values_equal(s, key); })) continue;
        seen.push_back(key);
        out.push_back(v);
      }
      return Value::from_array(std::move(out));
    }
    if (name == "map") {
      Array out;
      const Value* attribute = nullptr;
      for (const auto& [k, v] : args.keyword)
        if (k == "attribute") attribute = &v;
      if (attribute) {
        Value fallback = Value::undefined("");
        bool has_default = false;
        for (const auto& [k, v] : args.keyword)
          if (k == "default") { fallback = v; has_default = true; }
        for (const Value& v : iterate(input)) {
          Value got = attribute_of(v, to_str(*attribute));
          out.push_back(has_default && got.is_undefined() ? fallback : got);
        }
        return Value::from_array(std::move(out));
      }
      if (args.positional.empty() || !args.positional[0].is_string()) fail("map filter needs a filter name or attribute=");
      std::string filter = args.positional[0].text;
      if (!known_filter(filter)) fail("map: unsupported filter '" + filter + "'");
      CallArgs rest;
      rest.positional.assign(args.positional.begin() + 1, args.positional.end());
      rest.keyword = args.keyword;
      for (const Value& v : iterate(input)) out.push_back(apply_filter(filter, v, rest));
      return Value::from_array(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      bool by_attr = name == "selectattr" || name == "rejectattr";
      bool want = name == "select" || name == "selectattr";
      std::size_t first_test_arg = by_attr ? 1 : 0;
      std::string attribute;
      if (by_attr) {
        if (args.positional.empty() || !args.positional[0].is_string()) fail(name + " needs an attribute name");
        attribute = args.positional[0].text;
      }
      std::string test;
      CallArgs test_args;
      if (args.positional.size() > first_test_arg) {
        if (!args.positional[first_test_arg].is_string()) fail(name + ": test name must be a string");
        test = args.positional[first_test_arg].text;
        if (!known_test(test)) fail(name + ": unsupported test '" + test + "'");
        test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(first_test_arg) + 1, args.positional.end());
      }
      Array out;
      for (const Value& v : iterate(input)) {
        Value subject = by_attr ? attribute_of(v, attribute) : v;
        bool ok = test.empty() ? truthy(subject) : apply_test(test, subject, test_args);
        if (ok == want) out.push_back(v);
      }
      return Value::from_array(std::move(out));
    }
    fail("internal: filter '" + name + "' has no implementation");
  }

  template <typename KeyFn>
  void sort_values(std::vector<Value>& items, KeyFn key, bool case_sensitive, bool reverse) {
    auto normalized = [&](const Value& v) {
      Value k = key(v);
      if (!case_sensitive && k.is_string()) k.text = py_lower(k.text);
      return k;
    };
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      int order = three_way("<", normalized(x), normalized(y));
      return reverse ? order > 0 : order < 0;
    });
  }

  // ---- tests --------------------------------------------------------------------------------------------------
  bool apply_test(const std::string& name, const Value& v, CallArgs& args) {
    using K = Value::Kind;
    auto other = [&]() -> const Value& {
      if (args.positional.empty()) fail("test '" + name + "' needs an argument");
      return args.positional[0];
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.kind == K::kNone;
    if (name == "boolean") return v.kind == K::kBool;
    if (name == "true") return v.kind == K::kBool && v.boolean;
    if (name == "false") return v.kind == K::kBool && !v.boolean;
    if (name == "integer") return v.kind == K::kInt;
    if (name == "float") return v.kind == K::kFloat;
    if (name == "number") return v.is_number();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.kind == K::kObject;
    if (name == "iterable") return v.kind == K::kUndefined || v.kind == K::kString || v.kind == K::kArray || v.kind == K::kObject;
    if (name == "sequence") return v.kind == K::kUndefined || v.kind == K::kString || v.kind == K::kArray || v.kind == K::kObject;
    if (name == "callable") return v.kind == K::kCallable || v.kind == K::kUndefined;  // Undefined has __call__
    if (name == "escaped") return false;
    if (name == "sameas") {
      const Value& o = other();
      if (v.kind != o.kind) return false;
      if (v.kind == K::kArray) return v.array == o.array;
      if (v.kind == K::kObject || v.kind == K::kNamespace) return v.object == o.object;
      return values_equal(v, o);
    }
    if (name == "eq" || name == "equalto" || name == "==") return values_equal(v, other());
    if (name == "ne" || name == "!=") return !values_equal(v, other());
    if (name == "lt" || name == "lessthan" || name == "<") return three_way("<", v, other()) < 0;
    if (name == "le" || name == "<=") return three_way("<=", v, other()) <= 0;
    if (name == "gt" || name == "greaterthan" || name == ">") return three_way(">", v, other()) > 0;
    if (name == "ge" || name == ">=") return three_way(">=", v, other()) >= 0;
    if (name == "in") return contains(other(), v);
    if (name == "odd" || name == "even" || name == "divisibleby") {
      if (v.kind != K::kInt && v.kind != K::kBool) fail("test '" + name + "' needs an integer");
      std::int64_t n = as_int(v);
      if (name == "odd") return n % 2 != 0;
      if (name == "even") return n % 2 == 0;
      const Value& d = other();
      if (!d.is_number() || as_int(d) == 0) fail("divisibleby needs a non-zero integer");
      return n % as_int(d) == 0;
    }
    if (name == "lower" || name == "upper") {
      CallArgs none;
      return truthy(call_method(Value::from_string(to_str(v)), name == "lower" ? "islower" : "isupper", none));
    }
    fail("internal: test '" + name + "' has no implementation");
  }

  // ---- globals ------------------------------------------------------------------------------------------------
  static Value builtin(std::string name, std::function<Value(Interpreter&, CallArgs&)> fn) {
    Value v;
    v.kind = Value::Kind::kCallable;
    v.callable = std::make_shared<const Callable>(Callable{std::move(name), std::move(fn)});
    return v;
  }

  static void install_globals(Object& globals) {
    globals.set("raise_exception", builtin("raise_exception", [](Interpreter& in, CallArgs& args) -> Value {
                  in.fail("raise_exception: " + (args.positional.empty() ? std::string() : to_str(args.positional[0])));
                }));
    globals.set("strftime_now", builtin("strftime_now", [](Interpreter& in, CallArgs& args) -> Value {
                  if (args.positional.empty() || !args.positional[0].is_string()) in.fail("strftime_now expects a format string");
                  std::time_t now = std::time(nullptr);
                  std::tm local{};
                  localtime_r(&now, &local);
                  char buf[256];
                  std::size_t n = std::strftime(buf, sizeof buf, args.positional[0].text.c_str(), &local);
                  return Value::from_string(std::string(buf, n));
                }));
    auto make_dict = [](Interpreter& in, CallArgs& args, bool is_namespace) {
      Object o;
      for (const Value& p : args.positional) {
        if (p.kind != Value::Kind::kObject) in.fail("namespace()/dict() positional argument must be a dict");
        for (const auto& [k, v] : p.object->items) o.set(k, v);
      }
      for (const auto& [k, v] : args.keyword) {
        if (is_namespace && !k.empty() && k[0] == '_') in.fail("cannot store underscore-prefixed attribute '" + k + "' on a namespace");
        o.set(k, v);
      }
      return is_namespace ? Value::new_namespace(std::move(o)) : Value::from_object(std::move(o));
    };
    globals.set("namespace", builtin("namespace", [make_dict](Interpreter& in, CallArgs& a) { return make_dict(in, a, true); }));
    globals.set("dict", builtin("dict", [make_dict](Interpreter& in, CallArgs& a) { return make_dict(in, a, false); }));
    globals.set("range", builtin("range", [](Interpreter& in, CallArgs& args) {
                  std::vector<std::int64_t> n;
                  for (const Value& v : args.positional) {
                    if (v.kind != Value::Kind::kInt && v.kind != Value::Kind::kBool) in.fail("range() arguments must be integers");
                    n.push_back(as_int(v));
                  }
                  if (n.empty() || n.size() > 3) in.fail("range expects 1 to 3 arguments");
                  std::int64_t start = n.size() == 1 ? 0 : n[0], stop = n.size() == 1 ? n[0] : n[1], step = n.size() == 3 ? n[2] : 1;
                  if (step == 0) in.fail("range() arg 3 must not be zero");
                  Array out;
                  for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
                    if (out.size() >= 100000) in.fail("range too big (the sandbox limit is 100000 items)");
                    out.push_back(Value::from_int(i));
                  }
                  return Value::from_array(std::move(out));
                }));
  }

  const Program& program_;
  std::shared_ptr<Scope> scope_;
  std::string* out_ = nullptr;
  int line_ = 0;
  int call_depth_ = 0;
};

Result<std::string> render(const Program& program, const Object& variables) {
  Interpreter interpreter(program);
  try {
    return interpreter.run(variables);
  } catch (const TemplateError& e) {
    return invalid_argument(program.origin + ":" + std::to_string(e.line) + ": " + e.message);
  }
}

}  // namespace lmx::jinja
