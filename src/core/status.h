// Status and Result<T>: how request-level failures (bad file, bad adapter, bad request) travel to the
// caller with a precise message. Programmer errors use LMX_CHECK (abort), never Status.
// Used by every library above core.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace lmx {

enum class StatusCode { kOk, kInvalidArgument, kNotFound, kIo, kUnsupported, kOutOfRange, kInternal };

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // Prefix the message with context ("adapter 'x': " + message), keeping the code.
  Status with_context(const std::string& context) const {
    return ok() ? *this : Status(code_, context + ": " + message_);
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status io_error(std::string m) { return {StatusCode::kIo, std::move(m)}; }
inline Status unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
inline Status out_of_range(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }

// A value or the Status explaining why there is none.
template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}                     // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {              // NOLINT: implicit by design
    if (status_.ok()) status_ = Status(StatusCode::kInternal, "Result built from an ok Status");
  }
  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { check(); return *value_; }
  const T& value() const& { check(); return *value_; }
  T&& value() && { check(); return std::move(*value_); }
  T* operator->() { check(); return &*value_; }
  const T* operator->() const { check(); return &*value_; }
  T& operator*() & { check(); return *value_; }

 private:
  void check() const {
    if (!value_) {
      std::fprintf(stderr, "loramux: value() of a failed Result: %s\n", status_.message().c_str());
      std::abort();
    }
  }
  std::optional<T> value_;
  Status status_;
};

}  // namespace lmx

// Return early from a function returning Status or Result<T>.
#define LMX_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::lmx::Status lmx_status_ = (expr);        \
    if (!lmx_status_.ok()) return lmx_status_; \
  } while (0)

#define LMX_CONCAT_INNER(a, b) a##b
#define LMX_CONCAT(a, b) LMX_CONCAT_INNER(a, b)
// LMX_ASSIGN_OR_RETURN(auto x, f()) — x gets f()'s value or the function returns f()'s Status.
#define LMX_ASSIGN_OR_RETURN(decl, expr) LMX_ASSIGN_OR_RETURN_IMPL(LMX_CONCAT(lmx_result_, __LINE__), decl, expr)
#define LMX_ASSIGN_OR_RETURN_IMPL(tmp, decl, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  decl = std::move(tmp).value()

// Programmer errors only (broken invariants inside the library), never bad input.
#define LMX_CHECK(cond, ...)                                                            \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "loramux: check failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)
