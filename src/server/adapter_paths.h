// Where runtime adapter loads may read from: a client-supplied lora_path must resolve, after following
// every symlink, to a directory inside the --lora-dir root, and so must the adapter files in it.
// Who calls: http_server.cpp (POST /v1/load_lora_adapter); tests/server.
#pragma once
#include <string>

#include "core/status.h"

namespace lmx::server {

// `path` relative to `root` or absolute. Returns the canonical directory; errors say why it is refused
// (missing, not a directory, outside the root) without revealing anything outside the root.
// A path swapped for a link between this check and the load is not defended against (documented).
Result<std::string> resolve_adapter_dir(const std::string& root, const std::string& path);

}  // namespace lmx::server
