// TempDir: a fresh directory per test (named after the running test and the process), removed afterwards.
// Shared by every test that writes files (checkpoints, adapters, request files).
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace lmx::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& tag = "test") {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string test = info ? std::string(info->test_suite_name()) + "_" + info->name() : "no_test";
    for (char& c : test)
      if (c == '/') c = '_';  // parameterized test names
    path_ = std::filesystem::temp_directory_path() /
            ("loramux_" + tag + "_" + test + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string str() const { return path_.string(); }
  // A path for a file inside the directory.
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  // A subdirectory, created.
  std::string sub(const std::string& name) const {
    std::filesystem::create_directories(path_ / name);
    return (path_ / name).string();
  }

 private:
  static int& counter() {
    static int n = 0;  // several TempDirs in one test get distinct names
    return n;
  }
  std::filesystem::path path_;
};

}  // namespace lmx::testing
