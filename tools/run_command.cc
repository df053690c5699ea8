#include "tools/run_command.h"

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace poseidon::tools {

int RunRunCommand(const std::vector<std::string>& args) {
  // This binary sits in <build>/tools/; the package in <source>/libclient/python.
  char self[PATH_MAX] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string build_dir;
  if (n > 0) {
    std::string exe(self, static_cast<size_t>(n));
    build_dir = exe.substr(0, exe.rfind('/'));         // <build>/tools
    build_dir = build_dir.substr(0, build_dir.rfind('/'));  // <build>
  }
  const std::string python_dir = POSEIDON_PYTHON_DIR;
  const char* old = std::getenv("PYTHONPATH");
  const std::string pythonpath = old && *old ? python_dir + ":" + old : python_dir;
  setenv("PYTHONPATH", pythonpath.c_str(), 1);
  if (!build_dir.empty() && std::getenv("POSEIDON_BUILD_DIR") == nullptr) {
    setenv("POSEIDON_BUILD_DIR", build_dir.c_str(), 1);
  }
  std::vector<char*> argv = {const_cast<char*>("/usr/bin/python3"), const_cast<char*>("-m"),
                             const_cast<char*>("poseidon.run")};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  execv(argv[0], argv.data());
  std::fprintf(stderr, "poseidon run: cannot start /usr/bin/python3: %s\n", std::strerror(errno));
  return 2;
}

}  // namespace poseidon::tools
