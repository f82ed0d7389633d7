#include "kvcached/backend.hpp"

#include <map>
#include <mutex>

#include "kvcached/errors.hpp"

namespace kvcached {

std::string DeviceSpec::str() const {
  switch (kind) {
    case Kind::Host: return "cpu";
    case Kind::Cuda: return "cuda:" + std::to_string(index);
    case Kind::Hip: return "hip:" + std::to_string(index);
  }
  return "?";
}

DeviceSpec parse_device(const std::string& dev) {
  DeviceSpec d;
  std::string kind = dev, idx;
  auto colon = dev.find(':');
  if (colon != std::string::npos) {
    kind = dev.substr(0, colon);
    idx = dev.substr(colon + 1);
  }
  if (kind == "cpu") {
    if (!idx.empty() && idx != "0") invalid("device '" + dev + "': the host backend has only 'cpu'");
    d.kind = DeviceSpec::Kind::Host;
    return d;
  }
  if (kind == "cuda") {
#ifdef KVCACHED_WITH_HIP
    d.kind = DeviceSpec::Kind::Hip;  // ROCm builds of torch name devices "cuda"
#else
    d.kind = DeviceSpec::Kind::Cuda;
#endif
  } else if (kind == "hip") {
    d.kind = DeviceSpec::Kind::Hip;
  } else {
    invalid("unknown device '" + dev + "'; use 'cpu', 'cuda', 'cuda:N' or 'hip:N'");
  }
  if (!idx.empty()) {
    size_t pos = 0;
    int v = -1;
    try {
      v = std::stoi(idx, &pos);
    } catch (const std::logic_error&) {
      pos = 0;
    }
    if (pos != idx.size() || v < 0) invalid("device '" + dev + "': index must be a non-negative integer");
    d.index = v;
  }
  return d;
}

namespace {
[[noreturn]] void injected(BackendOp op) {
  fail(ErrorKind::Backend, std::string("injected fault in backend ") + op_name(op) +
                               " (KVCACHED_FAULT_INJECT or kvcached fault API)");
}
}  // namespace

PhysHandle Backend::create(size_t size) {
  if (faults::should_fail(BackendOp::Create)) injected(BackendOp::Create);
  PhysHandle h = do_create(size);
  live_handles_.fetch_add(1, std::memory_order_relaxed);
  live_bytes_.fetch_add(static_cast<int64_t>(size), std::memory_order_relaxed);
  return h;
}

void Backend::map(uintptr_t va, size_t size, PhysHandle h) {
  if (faults::should_fail(BackendOp::Map)) injected(BackendOp::Map);
  do_map(va, size, h);
}

void Backend::set_access(uintptr_t va, size_t size, bool writable) {
  if (faults::should_fail(BackendOp::SetAccess)) injected(BackendOp::SetAccess);
  do_set_access(va, size, writable);
}

void Backend::unmap(uintptr_t va, size_t size) {
  if (faults::should_fail(BackendOp::Unmap)) injected(BackendOp::Unmap);
  do_unmap(va, size);
}

void Backend::release(PhysHandle h, size_t size) {
  if (faults::should_fail(BackendOp::Release)) injected(BackendOp::Release);
  do_release(h);
  live_handles_.fetch_sub(1, std::memory_order_relaxed);
  live_bytes_.fetch_sub(static_cast<int64_t>(size), std::memory_order_relaxed);
}

std::shared_ptr<Backend> get_backend(const std::string& dev) {
  static std::mutex mu;
  static auto* backends = new std::map<std::string, std::shared_ptr<Backend>>();
  DeviceSpec d = parse_device(dev);
  std::lock_guard<std::mutex> g(mu);
  auto& slot = (*backends)[d.str()];
  if (!slot) {
    switch (d.kind) {
      case DeviceSpec::Kind::Host: slot = make_host_backend(); break;
      case DeviceSpec::Kind::Cuda: slot = make_cuda_backend(d.index); break;
      case DeviceSpec::Kind::Hip: slot = make_hip_backend(d.index); break;
    }
  }
  return slot;
}

}  // namespace kvcached
