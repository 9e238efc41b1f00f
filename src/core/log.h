// Minimal leveled logging to stderr. The level is set once by the CLI; libraries only call log_*.
#pragma once
#include <string>

namespace lmx {
enum class LogLevel { kDebug, kInfo, kWarn, kError };
void set_log_level(LogLevel level);
void log_message(LogLevel level, const std::string& message);
inline void log_info(const std::string& m) { log_message(LogLevel::kInfo, m); }
inline void log_warn(const std::string& m) { log_message(LogLevel::kWarn, m); }
inline void log_debug(const std::string& m) { log_message(LogLevel::kDebug, m); }
}  // namespace lmx
