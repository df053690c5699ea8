// Loads the CUDA stager plugin (libposeidon_cuda_stager.so) on first use. The agent binary does
// not link CUDA: the plugin, with the CUDA runtime and cuBLAS, is loaded only when a training
// process attaches a CUDA arena. (Loading cuBLAS at start-up also broke the metrics endpoint:
// civetweb refused to start with libcublasLt loaded.)
#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "agent/device_stager.h"

namespace poseidon::agent {
namespace {

struct Plugin {
  void (*available)(absl::Status*) = nullptr;
  DeviceStager* (*open)(const DeviceAttach*, void*, uint64_t, absl::Status*) = nullptr;
  absl::Status status;
};

const Plugin& LoadPlugin() {
  static Plugin plugin;
  static std::once_flag once;
  std::call_once(once, [] {
#ifndef POSEIDON_HAVE_CUDA
    plugin.status = absl::UnimplementedError(
        "this poseidon-agent was built without CUDA (POSEIDON_WITH_CUDA)");
#else
    constexpr char kName[] = "libposeidon_cuda_stager.so";
    std::string errors;
    void* lib = nullptr;
    // Next to the executable (the build tree, or an installed bin/), then the library path.
    char exe[PATH_MAX];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    std::string dir = n > 0 ? std::string(exe, static_cast<size_t>(n)) : std::string();
    dir = dir.substr(0, dir.rfind('/') + 1);
    for (const std::string& path :
         {dir + kName, dir + "../lib/poseidon/" + kName, std::string(kName)}) {
      if ((lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
      errors += absl::StrCat("\n  ", dlerror());
    }
    if (lib == nullptr) {
      plugin.status = absl::UnavailableError(
          absl::StrCat("cannot load the CUDA stager plugin ", kName, ":", errors));
      return;
    }
    plugin.available =
        reinterpret_cast<void (*)(absl::Status*)>(dlsym(lib, "psd_cuda_stager_available"));
    plugin.open = reinterpret_cast<DeviceStager* (*)(const DeviceAttach*, void*, uint64_t,
                                                     absl::Status*)>(
        dlsym(lib, "psd_cuda_stager_open"));
    if (plugin.available == nullptr || plugin.open == nullptr) {
      plugin.status = absl::InternalError(absl::StrCat(kName, " lacks its entry points"));
    }
#endif
  });
  return plugin;
}

}  // namespace

absl::Status CudaDeviceAvailable() {
  const Plugin& p = LoadPlugin();
  if (!p.status.ok()) return p.status;
  absl::Status s;
  p.available(&s);
  return s;
}

absl::StatusOr<std::unique_ptr<DeviceStager>> OpenDeviceStager(const DeviceAttach& attach,
                                                               void* host, uint64_t host_bytes) {
  const Plugin& p = LoadPlugin();
  if (!p.status.ok()) return p.status;
  absl::Status s;
  std::unique_ptr<DeviceStager> stager(p.open(&attach, host, host_bytes, &s));
  if (!s.ok()) return s;
  if (!stager) return absl::InternalError("the CUDA stager plugin returned nothing");
  return stager;
}

}  // namespace poseidon::agent
