// Logging sink. The level is process-wide configuration set before any work starts (not mutable state
// that changes behaviour mid-run), hence the one atomic here.
#include "core/log.h"

#include <atomic>
#include <cstdio>

namespace lmx {
namespace {
std::atomic<LogLevel> g_level{LogLevel::kInfo};
}
void set_log_level(LogLevel level) { g_level = level; }
void log_message(LogLevel level, const std::string& message) {
  if (level < g_level.load()) return;
  static const char* kNames[] = {"debug", "info", "warn", "error"};
  std::fprintf(stderr, "[loramux %s] %s\n", kNames[int(level)], message.c_str());
}
}  // namespace lmx
