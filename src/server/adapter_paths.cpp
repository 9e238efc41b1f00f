// Adapter path confinement (see adapter_paths.h).
#include "server/adapter_paths.h"

#include <filesystem>

namespace lmx::server {

namespace fs = std::filesystem;

namespace {
// True when canonical `p` is `root` or below it, compared component by component (so /a/bc is not
// inside /a/b).
bool is_within(const fs::path& root, const fs::path& p) {
  auto r = root.begin(), q = p.begin();
  for (; r != root.end(); ++r, ++q)
    if (q == p.end() || *r != *q) return false;
  return true;
}
}  // namespace

Result<std::string> resolve_adapter_dir(const std::string& root, const std::string& path) {
  std::error_code ec;
  fs::path canonical_root = fs::canonical(root, ec);
  if (ec) return io_error("--lora-dir '" + root + "' is not accessible: " + ec.message());
  fs::path requested(path);
  fs::path joined = requested.is_absolute() ? requested : canonical_root / requested;
  fs::path dir = fs::canonical(joined, ec);
  if (ec) return not_found("lora_path '" + path + "' does not exist under the adapter root");
  if (!is_within(canonical_root, dir))
    return invalid_argument("lora_path '" + path + "' resolves outside the adapter root (--lora-dir)");
  if (!fs::is_directory(dir, ec)) return invalid_argument("lora_path '" + path + "' is not a directory");
  // The files the loader opens must not be links out of the root either.
  for (const char* file : {"adapter_config.json", "adapter_model.safetensors"}) {
    fs::path f = dir / file;
    if (!fs::exists(f, ec)) continue;  // the loader reports missing files with its own message
    fs::path target = fs::canonical(f, ec);
    if (ec || !is_within(canonical_root, target))
      return invalid_argument("lora_path '" + path + "': " + file + " resolves outside the adapter root (--lora-dir)");
  }
  return dir.string();
}

}  // namespace lmx::server
