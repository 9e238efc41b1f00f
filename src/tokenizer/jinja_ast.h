// Syntax tree of a parsed Jinja template, shared by the parser (jinja_parse.cpp, which builds it) and the
// evaluator (jinja_eval.cpp, which walks it). Nodes are "fat" structs with a kind tag: the grammar is small
// and one node type per kind would triple the code without making either side clearer.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tokenizer/jinja.h"

namespace lmx::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,    // literal
    kName,       // name
    kGetAttr,    // a.name
    kGetItem,    // a[b]
    kSlice,      // a[b:c:d] (null parts are omitted bounds)
    kCall,       // a(args, kwargs)
    kFilter,     // a | name(args, kwargs)
    kTest,       // a is [not] name(args)
    kNeg,        // -a
    kPos,        // +a
    kNot,        // not a
    kAnd,        // a and b
    kOr,         // a or b
    kBinary,     // a op b for + - * / // % ** ~
    kCompare,    // a op1 b op2 c ... (Python chained comparison); ops in `compare_ops`
    kCondition,  // b if a else c (c may be null: undefined)
    kList,       // [args]
    kTuple,      // (args)
    kDict,       // {args[2i]: args[2i+1]}
  };
  Kind kind = Kind::kLiteral;
  int line = 0;
  Value literal;
  std::string name;  // variable/attribute/filter/test name; operator text for kBinary
  bool negated = false;  // kTest with `is not`
  ExprPtr a, b, c, d;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> compare_ops;  // kCompare: "==", "!=", "<", "<=", ">", ">=", "in", "notin"
};

// Assignment target: a name, a namespace attribute (ns.attr), or a tuple of names.
struct Target {
  std::vector<std::string> names;  // one name, or several for tuple unpacking
  std::string ns_attr;             // non-empty: `{% set names[0].ns_attr = ... %}`
  bool is_tuple = false;
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Stmt {
  enum class Kind { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kCallBlock, kFilterBlock, kBreak, kContinue, kWith, kScope };
  Kind kind = Kind::kText;
  int line = 0;
  std::string text;  // kText; macro name for kMacro
  ExprPtr expr;      // kOutput value, kFor iterable, kSet value, kCallBlock call, kFilterBlock/kSetBlock filter chain
  ExprPtr condition; // kFor `if` filter
  Target target;     // kFor, kSet, kSetBlock
  // kIf: branches[i] runs when conditions[i] is true; `else_body` otherwise. kFor: else_body runs on no iterations.
  std::vector<ExprPtr> conditions;
  std::vector<Body> branches;
  Body body;
  Body else_body;
  // kMacro / kCallBlock (caller's parameters): names and default values (null = required).
  std::vector<std::pair<std::string, ExprPtr>> params;
  // kWith: assignments evaluated in order inside the new scope.
  std::vector<std::pair<Target, ExprPtr>> assignments;
};

struct Program {
  std::string origin;
  Body body;
};

// Python-string helpers shared by the value and evaluation code (Python strings index code points).
std::vector<std::uint32_t> decode_utf8(std::string_view s);  // invalid bytes decode as U+FFFD
std::string encode_utf8(const std::vector<std::uint32_t>& cps, std::size_t begin = 0, std::size_t end = SIZE_MAX);
void append_utf8(std::string& out, std::uint32_t cp);
bool is_py_space(std::uint32_t cp);  // str.isspace()
std::string python_float_repr(double d);
std::string type_name(const Value& v);  // Python type name for error messages: 'str', 'dict', 'NoneType', ...
bool values_equal(const Value& a, const Value& b);

// Whether a filter/test name exists; the parser rejects unknown ones at load time, like jinja2's compiler.
bool known_filter(const std::string& name);
bool known_test(const std::string& name);

}  // namespace lmx::jinja
