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
  // In a build tree this binary sits in <build>/tools/ and the package in
  // <source>/libclient/python; installed, it sits in <prefix>/bin/ next to the daemons, and the
  // package is python3-poseidon's (on python3's path already).
  char self[PATH_MAX] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string exe_dir;
  if (n > 0) {
    const std::string exe(self, static_cast<size_t>(n));
    exe_dir = exe.substr(0, exe.rfind('/'));
  }
  const bool installed =
      !exe_dir.empty() && access((exe_dir + "/poseidon-agent").c_str(), X_OK) == 0;
  if (installed) {
    if (std::getenv("POSEIDON_BIN_DIR") == nullptr) setenv("POSEIDON_BIN_DIR", exe_dir.c_str(), 1);
  } else {
    const std::string python_dir = POSEIDON_PYTHON_DIR;
    const char* old = std::getenv("PYTHONPATH");
    const std::string pythonpath = old && *old ? python_dir + ":" + old : python_dir;
    setenv("PYTHONPATH", pythonpath.c_str(), 1);
    const std::string build_dir = exe_dir.substr(0, exe_dir.rfind('/'));  // <build>
    if (!exe_dir.empty() && std::getenv("POSEIDON_BUILD_DIR") == nullptr) {
      setenv("POSEIDON_BUILD_DIR", build_dir.c_str(), 1);
    }
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
