// Jinja lexer and parser: template source -> Program (jinja_ast.h). Whitespace control replicates jinja2's
// lexer with trim_blocks and lstrip_blocks on (transformers' settings); the grammar and operator precedence
// replicate jinja2's Parser. Anything outside the subset fails here, naming the line and the construct.
// Called by jinja::parse() users (chat_template.cpp); evaluation lives in jinja_eval.cpp.
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <set>
#include <stdexcept>

#include "tokenizer/jinja_ast.h"

namespace lmx::jinja {
namespace {

// Parse errors travel as an exception inside this file only; parse() turns it into a Status.
struct SyntaxError {
  int line;
  std::string message;
};

struct Token {
  enum class Type { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };
  Type type = Type::kEof;
  std::string text;
  int line = 0;
  std::int64_t integer = 0;
  double number = 0.0;
};

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string rstrip_ws(const std::string& s) {
  std::size_t end = s.size();
  while (end > 0 && is_space(s[end - 1])) --end;
  return s.substr(0, end);
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(normalize(std::move(source))) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) lex_root();
    Token eof;
    eof.type = Token::Type::kEof;
    eof.line = line_;
    tokens_.push_back(eof);
    return std::move(tokens_);
  }

 private:
  // jinja2 turns \r\n and \r into \n and, without keep_trailing_newline, drops one final newline.
  static std::string normalize(std::string s) {
    std::string out;
    out.reserve(s.size());
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (s[i] == '\r') {
        out += '\n';
        if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
      } else {
        out += s[i];
      }
    }
    if (!out.empty() && out.back() == '\n') out.pop_back();
    return out;
  }

  void advance_to(std::size_t new_pos) {
    for (std::size_t i = pos_; i < new_pos; ++i)
      if (src_[i] == '\n') ++line_;
    pos_ = new_pos;
  }

  void emit(Token::Type type, std::string text, int line) {
    Token t;
    t.type = type;
    t.text = std::move(text);
    t.line = line;
    tokens_.push_back(std::move(t));
  }

  // Text before a tag, with the tag's `-` (strip all whitespace) or lstrip_blocks (strip the indentation of a
  // line that holds only the block/comment tag) applied, exactly as jinja2's OptionalLStrip rule does.
  std::string strip_before_tag(std::string text, char sign, bool is_variable) {
    if (sign == '-') return rstrip_ws(text);
    if (sign == '+' || is_variable) return text;
    std::size_t line_begin = text.rfind('\n');
    line_begin = line_begin == std::string::npos ? 0 : line_begin + 1;
    if (line_begin > 0 || line_starting_) {
      bool only_ws = line_begin < text.size();
      for (std::size_t i = line_begin; i < text.size(); ++i) only_ws = only_ws && is_space(text[i]);
      if (only_ws) text.resize(line_begin);
    }
    return text;
  }

  // Match `-X}` followed by whitespace, `+X}`, or `X}` (plus one newline when `trim` — trim_blocks) at pos.
  // Returns the end position, or npos.
  std::size_t match_tag_end(std::size_t p, char closer, bool trim) const {
    auto at = [&](std::size_t i, char c) { return i < src_.size() && src_[i] == c; };
    if (at(p, '-') && at(p + 1, closer) && at(p + 2, '}')) {
      p += 3;
      while (p < src_.size() && is_space(src_[p])) ++p;
      return p;
    }
    if (at(p, '+') && at(p + 1, closer) && at(p + 2, '}') && closer != '}') return p + 3;  // no `+}}` in jinja2
    if (at(p, closer) && at(p + 1, '}')) {
      p += 2;
      if (trim && at(p, '\n')) ++p;
      return p;
    }
    return std::string::npos;
  }

  void lex_root() {
    std::size_t tag = src_.find('{', pos_);
    while (tag != std::string::npos &&
           !(tag + 1 < src_.size() && (src_[tag + 1] == '{' || src_[tag + 1] == '%' || src_[tag + 1] == '#')))
      tag = src_.find('{', tag + 1);
    if (tag == std::string::npos) {
      emit(Token::Type::kText, src_.substr(pos_), line_);
      advance_to(src_.size());
      return;
    }
    char kind = src_[tag + 1];
    char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? src_[tag + 2] : 0;
    std::string text = strip_before_tag(src_.substr(pos_, tag - pos_), sign, kind == '{');
    if (!text.empty()) emit(Token::Type::kText, std::move(text), line_);
    advance_to(tag);
    std::size_t inner = tag + 2 + (sign ? 1 : 0);
    if (kind == '#') {
      lex_comment(inner);
    } else if (kind == '%' && lex_raw(inner)) {
      // handled
    } else {
      lex_tag(inner, kind == '{');
    }
  }

  void lex_comment(std::size_t inner) {
    int start_line = line_;
    for (std::size_t p = inner; p < src_.size(); ++p) {
      std::size_t end = match_tag_end(p, '#', true);
      if (end == std::string::npos) continue;
      line_starting_ = src_[end - 1] == '\n';
      advance_to(end);
      return;
    }
    throw SyntaxError{start_line, "missing end of comment tag"};
  }

  // `{% raw %}...{% endraw %}`: the body is text, taken verbatim.
  bool lex_raw(std::size_t inner) {
    std::size_t p = inner;
    while (p < src_.size() && is_space(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    std::size_t q = p;
    while (q < src_.size() && is_space(src_[q])) ++q;
    if (q == p && q < src_.size() && src_[q] != '-' && src_[q] != '%') return false;  // e.g. `raws`
    std::size_t body = match_tag_end(q, '%', false);
    if (body == std::string::npos) return false;
    int start_line = line_;
    for (std::size_t t = src_.find("{%", body); t != std::string::npos; t = src_.find("{%", t + 1)) {
      std::size_t e = t + 2;
      char sign = e < src_.size() && (src_[e] == '-' || src_[e] == '+') ? src_[e] : 0;
      if (sign) ++e;
      while (e < src_.size() && is_space(src_[e])) ++e;
      if (src_.compare(e, 6, "endraw") != 0) continue;
      e += 6;
      while (e < src_.size() && is_space(src_[e])) ++e;
      std::size_t end = match_tag_end(e, '%', true);
      if (end == std::string::npos) continue;
      advance_to(body);
      std::string text = strip_before_tag(src_.substr(body, t - body), sign, false);
      if (!text.empty()) emit(Token::Type::kText, std::move(text), line_);
      line_starting_ = src_[end - 1] == '\n';
      advance_to(end);
      return true;
    }
    throw SyntaxError{start_line, "missing end of raw directive"};
  }

  void lex_tag(std::size_t inner, bool is_variable) {
    emit(is_variable ? Token::Type::kVarBegin : Token::Type::kBlockBegin, "", line_);
    advance_to(inner);
    const char closer = is_variable ? '}' : '%';
    std::vector<char> brackets;
    while (true) {
      if (pos_ >= src_.size())
        throw SyntaxError{line_, std::string("unexpected end of template, expected '") + closer + "}'"};
      if (brackets.empty()) {
        std::size_t end = match_tag_end(pos_, closer, !is_variable);
        if (end != std::string::npos) {
          emit(is_variable ? Token::Type::kVarEnd : Token::Type::kBlockEnd, "", line_);
          line_starting_ = src_[end - 1] == '\n';
          advance_to(end);
          return;
        }
      }
      char c = src_[pos_];
      if (is_space(c)) {
        advance_to(pos_ + 1);
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        lex_number();
      } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        std::size_t e = pos_;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        emit(Token::Type::kName, src_.substr(pos_, e - pos_), line_);
        advance_to(e);
      } else if (c == '\'' || c == '"') {
        lex_string(c);
      } else {
        lex_operator(brackets);
      }
    }
  }

  void lex_number() {
    std::size_t e = pos_;
    auto digits = [&] {
      while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) ||
                                 (src_[e] == '_' && e + 1 < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e + 1])))))
        ++e;
    };
    digits();
    bool is_float = false;
    if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
      is_float = true;
      ++e;
      digits();
    }
    if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      std::size_t save = e;
      ++e;
      if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
      if (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) {
        is_float = true;
        digits();
      } else {
        e = save;
      }
    }
    std::string text;
    for (std::size_t i = pos_; i < e; ++i)
      if (src_[i] != '_') text += src_[i];
    Token t;
    t.line = line_;
    t.text = text;
    if (is_float) {
      t.type = Token::Type::kFloat;
      t.number = std::strtod(text.c_str(), nullptr);
    } else {
      t.type = Token::Type::kInt;
      errno = 0;
      t.integer = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) throw SyntaxError{line_, "integer literal " + text + " does not fit in 64 bits"};
    }
    tokens_.push_back(std::move(t));
    advance_to(e);
  }

  // Python string-literal escapes (jinja2 decodes literals with "unicode-escape").
  void lex_string(char quote) {
    int start_line = line_;
    std::string value;
    std::size_t p = pos_ + 1;
    while (true) {
      if (p >= src_.size()) throw SyntaxError{start_line, "unterminated string literal"};
      char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        value += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) throw SyntaxError{start_line, "unterminated string literal"};
      char e = src_[p + 1];
      p += 2;
      auto hex = [&](int n) {
        if (p + n > src_.size()) throw SyntaxError{line_, "truncated \\x/\\u escape in string literal"};
        std::uint32_t cp = 0;
        for (int i = 0; i < n; ++i) {
          char h = src_[p + i];
          if (!std::isxdigit(static_cast<unsigned char>(h))) throw SyntaxError{line_, "bad hex escape in string literal"};
          cp = cp * 16 + static_cast<std::uint32_t>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
        }
        p += n;
        append_utf8(value, cp);
      };
      switch (e) {
        case 'n': value += '\n'; break;
        case 't': value += '\t'; break;
        case 'r': value += '\r'; break;
        case 'b': value += '\b'; break;
        case 'f': value += '\f'; break;
        case 'v': value += '\v'; break;
        case 'a': value += '\a'; break;
        case '\\': value += '\\'; break;
        case '\'': value += '\''; break;
        case '"': value += '"'; break;
        case '\n': break;  // line continuation
        case 'x': hex(2); break;
        case 'u': hex(4); break;
        case 'U': hex(8); break;
        case '0': case '1': case '2': case '3': case '4': case '5': case '6': case '7': {
          std::uint32_t cp = static_cast<std::uint32_t>(e - '0');
          for (int i = 0; i < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++i, ++p) cp = cp * 8 + static_cast<std::uint32_t>(src_[p] - '0');
          append_utf8(value, cp);
          break;
        }
        default:  // Python keeps unknown escapes as written
          value += '\\';
          value += e;
      }
    }
    emit(Token::Type::kString, std::move(value), start_line);
    advance_to(p + 1);
  }

  void lex_operator(std::vector<char>& brackets) {
    static constexpr const char* kOps[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[", "]",
                                           "(",  ")",  "{",  "}",  ">",  "<",  "=", ".", ":", "|", ",", ";"};
    for (const char* op : kOps) {
      std::string_view sv(op);
      if (src_.compare(pos_, sv.size(), sv) != 0) continue;
      char c = op[0];
      if (sv.size() == 1 && (c == '(' || c == '[' || c == '{')) brackets.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
      if (sv.size() == 1 && (c == ')' || c == ']' || c == '}')) {
        if (brackets.empty() || brackets.back() != c) throw SyntaxError{line_, std::string("unexpected '") + c + "'"};
        brackets.pop_back();
      }
      emit(Token::Type::kOp, std::string(sv), line_);
      advance_to(pos_ + sv.size());
      return;
    }
    throw SyntaxError{line_, std::string("unexpected character '") + src_[pos_] + "'"};
  }

  std::string src_;
  std::size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;  // the previous lexer match ended with a newline (jinja2's line_starting)
  std::vector<Token> tokens_;
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  Body parse_template() {
    Body body = parse_body({});
    if (cur().type != Token::Type::kEof) fail("unexpected tag");
    return body;
  }

 private:
  const Token& cur() const { return toks_[pos_]; }
  const Token& peek(std::size_t n = 1) const { return toks_[std::min(pos_ + n, toks_.size() - 1)]; }
  Token next() { return toks_[pos_ < toks_.size() - 1 ? pos_++ : pos_]; }
  [[noreturn]] void fail(const std::string& message) const { throw SyntaxError{cur().line, message}; }
  bool is_op(const char* op) const { return cur().type == Token::Type::kOp && cur().text == op; }
  bool is_name(const char* name) const { return cur().type == Token::Type::kName && cur().text == name; }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(std::string("expected '") + op + "', got " + describe(cur()));
    next();
  }
  std::string expect_name() {
    if (cur().type != Token::Type::kName) fail("expected a name, got " + describe(cur()));
    return next().text;
  }
  void expect_block_end() {
    if (cur().type != Token::Type::kBlockEnd) fail("expected end of statement '%}', got " + describe(cur()));
    next();
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Token::Type::kEof: return "end of template";
      case Token::Type::kBlockEnd: return "'%}'";
      case Token::Type::kVarEnd: return "'}}'";
      case Token::Type::kString: return "string literal";
      default: return "'" + t.text + "'";
    }
  }

  // Statements until a `{% name %}` tag whose name is in `end_names` (left unconsumed: the caller reads it).
  Body parse_body(const std::set<std::string>& end_names) {
    open_blocks_.push_back(join(end_names));
    struct Pop {
      std::vector<std::string>& v;
      ~Pop() { v.pop_back(); }
    } pop{open_blocks_};
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Token::Type::kEof) {
        if (!end_names.empty()) fail("unexpected end of template, expected one of: " + join(end_names));
        return body;
      }
      if (t.type == Token::Type::kText) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kText;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.type == Token::Type::kVarBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kOutput;
        s->line = t.line;
        s->expr = parse_tuple(true, false);
        if (cur().type != Token::Type::kVarEnd) fail("expected end of print statement '}}', got " + describe(cur()));
        next();
        body.push_back(std::move(s));
      } else if (t.type == Token::Type::kBlockBegin) {
        const Token& name = peek();
        if (name.type != Token::Type::kName) { next(); fail("expected a statement name after '{%'"); }
        if (end_names.count(name.text)) {
          next();  // leave the caller at the name
          return body;
        }
        next();
        body.push_back(parse_statement());
      } else {
        fail("unexpected " + describe(t));
      }
    }
  }

  static std::string join(const std::set<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
  }

  std::unique_ptr<Stmt> parse_statement() {
    const Token keyword = next();
    const std::string& k = keyword.text;
    auto s = std::make_unique<Stmt>();
    s->line = keyword.line;
    if (k == "if") return parse_if(std::move(s));
    if (k == "for") return parse_for(std::move(s));
    if (k == "set") return parse_set(std::move(s));
    if (k == "macro") return parse_macro(std::move(s));
    if (k == "call") return parse_call_block(std::move(s));
    if (k == "filter") {
      s->kind = Stmt::Kind::kFilterBlock;
      s->expr = parse_filter_chain(nullptr);
      expect_block_end();
      s->body = parse_body({"endfilter"});
      next();
      expect_block_end();
      return s;
    }
    if (k == "break" || k == "continue") {
      if (loop_depth_ == 0) fail("'" + k + "' outside of a for loop");
      s->kind = k == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
      expect_block_end();
      return s;
    }
    if (k == "with") {
      s->kind = Stmt::Kind::kWith;
      while (cur().type != Token::Type::kBlockEnd) {
        if (!s->assignments.empty()) expect_op(",");
        Target t = parse_assign_target(false);
        expect_op("=");
        s->assignments.emplace_back(std::move(t), parse_expression(true));
      }
      expect_block_end();
      s->body = parse_body({"endwith"});
      next();
      expect_block_end();
      return s;
    }
    if (k == "generation") {  // transformers' AssistantTracker tag: renders its body unchanged
      s->kind = Stmt::Kind::kScope;
      expect_block_end();
      s->body = parse_body({"endgeneration"});
      next();
      expect_block_end();
      return s;
    }
    if (k == "print") {
      s->kind = Stmt::Kind::kOutput;
      s->expr = parse_tuple(true, false);
      expect_block_end();
      return s;
    }
    static const std::set<std::string> kKnownUnsupported = {"block", "extends", "include", "import", "from",
                                                            "autoescape", "do", "trans", "pluralize"};
    if (kKnownUnsupported.count(k)) throw SyntaxError{keyword.line, "unsupported statement '{% " + k + " %}'"};
    if (k.rfind("end", 0) == 0 || k == "elif" || k == "else")
      throw SyntaxError{keyword.line, "unexpected '{% " + k + " %}'" +
                                          (open_blocks_.empty() || open_blocks_.back().empty() ? std::string(" outside any block") : ", expected one of: " + open_blocks_.back())};
    throw SyntaxError{keyword.line, "unknown statement '{% " + k + " %}'"};
  }

  std::unique_ptr<Stmt> parse_if(std::unique_ptr<Stmt> s) {
    s->kind = Stmt::Kind::kIf;
    while (true) {
      s->conditions.push_back(parse_tuple(false, false));
      expect_block_end();
      s->branches.push_back(parse_body({"elif", "else", "endif"}));
      std::string tag = next().text;
      if (tag == "elif") continue;
      if (tag == "else") {
        expect_block_end();
        s->else_body = parse_body({"endif"});
        next();
      }
      expect_block_end();
      return s;
    }
  }

  std::unique_ptr<Stmt> parse_for(std::unique_ptr<Stmt> s) {
    s->kind = Stmt::Kind::kFor;
    s->target = parse_assign_target(false);
    if (!is_name("in")) fail("expected 'in' in for loop, got " + describe(cur()));
    next();
    s->expr = parse_tuple(false, false, {"recursive"});
    if (is_name("if")) {
      next();
      s->condition = parse_expression(true);
    }
    if (is_name("recursive")) fail("unsupported construct: recursive for loop");
    expect_block_end();
    ++loop_depth_;
    s->body = parse_body({"endfor", "else"});
    --loop_depth_;
    if (toks_[pos_].text == "else") {
      next();
      expect_block_end();
      s->else_body = parse_body({"endfor"});
    }
    next();
    expect_block_end();
    return s;
  }

  std::unique_ptr<Stmt> parse_set(std::unique_ptr<Stmt> s) {
    s->target = parse_assign_target(true);
    if (is_op("=")) {
      next();
      s->kind = Stmt::Kind::kSet;
      s->expr = parse_tuple(true, false);
      expect_block_end();
      return s;
    }
    if (s->target.is_tuple || !s->target.ns_attr.empty()) fail("block set needs a plain name as target");
    s->kind = Stmt::Kind::kSetBlock;
    if (is_op("|")) s->expr = parse_filter_chain(nullptr);
    expect_block_end();
    s->body = parse_body({"endset"});
    next();
    expect_block_end();
    return s;
  }

  std::vector<std::pair<std::string, ExprPtr>> parse_signature() {
    std::vector<std::pair<std::string, ExprPtr>> params;
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      std::string name = expect_name();
      ExprPtr def;
      if (is_op("=")) {
        next();
        def = parse_expression(true);
      } else if (!params.empty() && params.back().second) {
        fail("non-default parameter '" + name + "' follows a default parameter");
      }
      params.emplace_back(std::move(name), std::move(def));
    }
    next();
    return params;
  }

  std::unique_ptr<Stmt> parse_macro(std::unique_ptr<Stmt> s) {
    s->kind = Stmt::Kind::kMacro;
    s->text = expect_name();
    s->params = parse_signature();
    expect_block_end();
    int saved = loop_depth_;
    loop_depth_ = 0;  // break/continue cannot cross a macro boundary
    s->body = parse_body({"endmacro"});
    loop_depth_ = saved;
    next();
    if (cur().type == Token::Type::kName) next();  // `{% endmacro name %}`
    expect_block_end();
    return s;
  }

  std::unique_ptr<Stmt> parse_call_block(std::unique_ptr<Stmt> s) {
    s->kind = Stmt::Kind::kCallBlock;
    if (is_op("(")) s->params = parse_signature();
    s->expr = parse_expression(true);
    if (s->expr->kind != Expr::Kind::kCall) fail("expected a call in '{% call %}'");
    expect_block_end();
    s->body = parse_body({"endcall"});
    next();
    expect_block_end();
    return s;
  }

  // `name`, `a, b`, or (with_namespace) `ns.attr`.
  Target parse_assign_target(bool with_namespace) {
    Target t;
    bool parens = is_op("(");
    if (parens) next();
    t.names.push_back(expect_name());
    if (with_namespace && is_op(".")) {
      next();
      t.ns_attr = expect_name();
      return t;
    }
    while (is_op(",")) {
      next();
      t.is_tuple = true;
      if (cur().type != Token::Type::kName) break;  // trailing comma
      t.names.push_back(expect_name());
    }
    if (parens) expect_op(")");
    return t;
  }

  // Comma-separated expressions become a tuple (jinja2's parse_tuple); `extra_end` names stop it.
  ExprPtr parse_tuple(bool with_condexpr, bool explicit_parens, const std::set<std::string>& extra_end = {}) {
    int line = cur().line;
    std::vector<ExprPtr> items;
    bool saw_comma = false;
    while (true) {
      if (!items.empty()) {
        if (!is_op(",")) break;
        next();
        saw_comma = true;
      }
      if (cur().type == Token::Type::kVarEnd || cur().type == Token::Type::kBlockEnd || is_op(")") ||
          (cur().type == Token::Type::kName && extra_end.count(cur().text)))
        break;
      items.push_back(with_condexpr ? parse_expression(true) : parse_or());
    }
    if (!saw_comma) {
      if (items.size() == 1) return std::move(items[0]);
      if (!explicit_parens) fail("expected an expression, got " + describe(cur()));
    }
    auto e = std::make_unique<Expr>();
    e->kind = Expr::Kind::kTuple;
    e->line = line;
    e->args = std::move(items);
    return e;
  }

  ExprPtr make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    int line = cur().line;
    ExprPtr expr = parse_or();
    if (!with_condexpr) return expr;
    while (is_name("if")) {
      next();
      auto e = make(Expr::Kind::kCondition, line);
      e->a = parse_or();
      e->b = std::move(expr);
      if (is_name("else")) {
        next();
        e->c = parse_expression(true);
      }
      expr = std::move(e);
    }
    return expr;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      auto e = make(Expr::Kind::kOr, next().line);
      e->a = std::move(left);
      e->b = parse_and();
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      auto e = make(Expr::Kind::kAnd, next().line);
      e->a = std::move(left);
      e->b = parse_not();
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      auto e = make(Expr::Kind::kNot, next().line);
      e->a = parse_not();
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    int line = cur().line;
    ExprPtr first = parse_math1();
    ExprPtr e;
    while (true) {
      std::string op;
      if (cur().type == Token::Type::kOp &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == "<=" || cur().text == ">" ||
           cur().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && peek().type == Token::Type::kName && peek().text == "in") {
        next();
        next();
        op = "notin";
      } else {
        break;
      }
      if (!e) {
        e = make(Expr::Kind::kCompare, line);
        e->a = std::move(first);
      }
      e->compare_ops.push_back(op);
      e->args.push_back(parse_math1());
    }
    return e ? std::move(e) : std::move(first);
  }

  ExprPtr binary(const std::string& op, ExprPtr left, ExprPtr right, int line) {
    auto e = make(Expr::Kind::kBinary, line);
    e->name = op;
    e->a = std::move(left);
    e->b = std::move(right);
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      Token op = next();
      left = binary(op.text, std::move(left), parse_concat(), op.line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op("~")) {
      Token op = next();
      left = binary("~", std::move(left), parse_math2(), op.line);
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      Token op = next();
      left = binary(op.text, std::move(left), parse_pow(), op.line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      Token op = next();
      left = binary("**", std::move(left), parse_unary(true), op.line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      Token op = next();
      node = make(op.text == "-" ? Expr::Kind::kNeg : Expr::Kind::kPos, op.line);
      node->a = parse_unary(false);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    int line = t.line;
    if (t.type == Token::Type::kName) {
      std::string n = next().text;
      auto e = make(Expr::Kind::kLiteral, line);
      if (n == "true" || n == "True") e->literal = Value::from_bool(true);
      else if (n == "false" || n == "False") e->literal = Value::from_bool(false);
      else if (n == "none" || n == "None") e->literal = Value::none();
      else {
        e->kind = Expr::Kind::kName;
        e->name = n;
      }
      return e;
    }
    if (t.type == Token::Type::kString) {
      std::string s;
      while (cur().type == Token::Type::kString) s += next().text;  // adjacent literals concatenate
      auto e = make(Expr::Kind::kLiteral, line);
      e->literal = Value::from_string(std::move(s));
      return e;
    }
    if (t.type == Token::Type::kInt || t.type == Token::Type::kFloat) {
      Token n = next();
      auto e = make(Expr::Kind::kLiteral, line);
      e->literal = n.type == Token::Type::kInt ? Value::from_int(n.integer) : Value::from_float(n.number);
      return e;
    }
    if (is_op("(")) {
      next();
      ExprPtr e = parse_tuple(true, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto e = make(Expr::Kind::kList, line);
      while (!is_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("]")) break;
        e->args.push_back(parse_expression(true));
      }
      next();
      return e;
    }
    if (is_op("{")) {
      next();
      auto e = make(Expr::Kind::kDict, line);
      while (!is_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("}")) break;
        e->args.push_back(parse_expression(true));
        expect_op(":");
        e->args.push_back(parse_expression(true));
      }
      next();
      return e;
    }
    fail("unexpected " + describe(t) + " in expression");
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".")) {
        int line = next().line;
        if (cur().type == Token::Type::kName) {
          auto e = make(Expr::Kind::kGetAttr, line);
          e->a = std::move(node);
          e->name = next().text;
          node = std::move(e);
        } else if (cur().type == Token::Type::kInt) {
          auto e = make(Expr::Kind::kGetItem, line);
          e->a = std::move(node);
          e->b = make(Expr::Kind::kLiteral, line);
          e->b->literal = Value::from_int(next().integer);
          node = std::move(e);
        } else {
          fail("expected an attribute name after '.'");
        }
      } else if (is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    int line = next().line;  // '['
    ExprPtr parts[3];
    int colons = 0;
    while (!is_op("]")) {
      if (is_op(":")) {
        next();
        if (++colons > 2) fail("too many ':' in slice");
        continue;
      }
      if (is_op(",")) fail("unsupported construct: tuple subscript");
      if (parts[colons]) fail("expected ']' or ':' in subscript");
      parts[colons] = parse_expression(true);
    }
    next();
    if (colons == 0) {
      if (!parts[0]) fail("empty subscript");
      auto e = make(Expr::Kind::kGetItem, line);
      e->a = std::move(node);
      e->b = std::move(parts[0]);
      return e;
    }
    auto e = make(Expr::Kind::kSlice, line);
    e->a = std::move(node);
    e->b = std::move(parts[0]);
    e->c = std::move(parts[1]);
    e->d = std::move(parts[2]);
    return e;
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (!e.args.empty() || !e.kwargs.empty()) expect_op(",");
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail("unsupported construct: *args/**kwargs in a call");
      if (cur().type == Token::Type::kName && peek().type == Token::Type::kOp && peek().text == "=") {
        std::string key = next().text;
        next();
        e.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!e.kwargs.empty()) fail("positional argument follows keyword argument");
        e.args.push_back(parse_expression(true));
      }
    }
    next();
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = make(Expr::Kind::kCall, cur().line);
    e->a = std::move(node);
    parse_call_args(*e);
    return e;
  }

  // Filters, tests and calls after a unary expression, left to right (jinja2's parse_filter_expr).
  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filter_chain(std::move(node));
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  // `| f(args) | g ...`; with input == nullptr the chain applies to a block body ({% filter %}, {% set x | f %}).
  ExprPtr parse_filter_chain(ExprPtr input) {
    bool first = true;
    while (first || is_op("|")) {
      if (is_op("|")) next();
      first = false;
      int line = cur().line;
      std::string name = expect_name();
      while (is_op(".")) {
        next();
        name += "." + expect_name();
      }
      if (!known_filter(name)) throw SyntaxError{line, "unsupported filter '" + name + "'"};
      auto e = make(Expr::Kind::kFilter, line);
      e->name = name;
      e->a = std::move(input);
      if (is_op("(")) parse_call_args(*e);
      input = std::move(e);
    }
    return input;
  }

  ExprPtr parse_test(ExprPtr node) {
    int line = next().line;  // 'is'
    auto e = make(Expr::Kind::kTest, line);
    if (is_name("not")) {
      next();
      e->negated = true;
    }
    e->name = expect_name();
    while (is_op(".")) {
      next();
      e->name += "." + expect_name();
    }
    if (!known_test(e->name)) throw SyntaxError{line, "unsupported test '" + e->name + "'"};
    e->a = std::move(node);
    const Token& t = cur();
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((t.type == Token::Type::kName || t.type == Token::Type::kString || t.type == Token::Type::kInt ||
                t.type == Token::Type::kFloat || is_op("[") || is_op("{")) &&
               !(is_name("else") || is_name("or") || is_name("and"))) {
      if (is_name("is")) fail("you cannot chain multiple tests with 'is'");
      e->args.push_back(parse_postfix(parse_primary()));
    }
    return e;
  }

  std::vector<Token> toks_;
  std::size_t pos_ = 0;
  int loop_depth_ = 0;
  std::vector<std::string> open_blocks_;  // end tags awaited by each open block, for error messages
};

}  // namespace

Result<std::shared_ptr<const Program>> parse(const std::string& source, const std::string& origin) {
  try {
    auto program = std::make_shared<Program>();
    program->origin = origin;
    program->body = Parser(Lexer(source).run()).parse_template();
    return std::shared_ptr<const Program>(std::move(program));
  } catch (const SyntaxError& e) {
    return invalid_argument(origin + ":" + std::to_string(e.line) + ": " + e.message);
  }
}

}  // namespace lmx::jinja
