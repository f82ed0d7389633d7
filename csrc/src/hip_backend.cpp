// HIP VMM backend for ROCm GPUs; compiled only where ROCm headers exist
// (setup.py defines KVCACHED_WITH_HIP). libamdhip64 is loaded at run time.
#include <memory>

#include "kvcached/backend.hpp"
#include "kvcached/errors.hpp"

#ifdef KVCACHED_WITH_HIP
#include <dlfcn.h>
#include <hip/hip_runtime_api.h>

#include <mutex>
#include <string>

namespace kvcached {
namespace {

struct HipRuntime {
  hipError_t (*Init)(unsigned int);
  hipError_t (*GetDeviceCount)(int*);
  hipError_t (*SetDevice)(int);
  hipError_t (*DeviceSynchronize)(void);
  hipError_t (*MemGetInfo)(size_t*, size_t*);
  hipError_t (*MemsetD8)(hipDeviceptr_t, unsigned char, size_t);
  hipError_t (*MemAddressReserve)(void**, size_t, size_t, void*, unsigned long long);
  hipError_t (*MemAddressFree)(void*, size_t);
  hipError_t (*MemCreate)(hipMemGenericAllocationHandle_t*, size_t, const hipMemAllocationProp*, unsigned long long);
  hipError_t (*MemMap)(void*, size_t, size_t, hipMemGenericAllocationHandle_t, unsigned long long);
  hipError_t (*MemSetAccess)(void*, size_t, const hipMemAccessDesc*, size_t);
  hipError_t (*MemUnmap)(void*, size_t);
  hipError_t (*MemRelease)(hipMemGenericAllocationHandle_t);
  hipError_t (*MemGetAllocationGranularity)(size_t*, const hipMemAllocationProp*, hipMemAllocationGranularity_flags);
  const char* (*GetErrorName)(hipError_t);
};

const HipRuntime& hip() {
  static HipRuntime rt;
  static std::string load_error;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libamdhip64.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      load_error = "the HIP runtime (libamdhip64.so) is not available; use device='cpu' for the host backend";
      return;
    }
    auto sym = [&](void* slot, const char* name) {
      void* s = dlsym(lib, name);
      if (!s && load_error.empty()) load_error = std::string("the HIP runtime lacks ") + name;
      *static_cast<void**>(slot) = s;
    };
    sym(&rt.Init, "hipInit");
    sym(&rt.GetDeviceCount, "hipGetDeviceCount");
    sym(&rt.SetDevice, "hipSetDevice");
    sym(&rt.DeviceSynchronize, "hipDeviceSynchronize");
    sym(&rt.MemGetInfo, "hipMemGetInfo");
    sym(&rt.MemsetD8, "hipMemsetD8");
    sym(&rt.MemAddressReserve, "hipMemAddressReserve");
    sym(&rt.MemAddressFree, "hipMemAddressFree");
    sym(&rt.MemCreate, "hipMemCreate");
    sym(&rt.MemMap, "hipMemMap");
    sym(&rt.MemSetAccess, "hipMemSetAccess");
    sym(&rt.MemUnmap, "hipMemUnmap");
    sym(&rt.MemRelease, "hipMemRelease");
    sym(&rt.MemGetAllocationGranularity, "hipMemGetAllocationGranularity");
    sym(&rt.GetErrorName, "hipGetErrorName");
  });
  if (!load_error.empty()) fail(ErrorKind::Backend, load_error);
  return rt;
}

void check(hipError_t r, const char* what) {
  if (r == hipSuccess) return;
  ErrorKind kind = (r == hipErrorOutOfMemory) ? ErrorKind::OutOfMemory : ErrorKind::Backend;
  fail(kind, std::string("HIP backend: ") + what + " failed: " + hip().GetErrorName(r));
}

class HipBackend final : public Backend {
 public:
  explicit HipBackend(int index) : Backend(DeviceSpec{DeviceSpec::Kind::Hip, index}) {
    check(hip().Init(0), "hipInit");
    int count = 0;
    check(hip().GetDeviceCount(&count), "hipGetDeviceCount");
    if (index >= count) invalid("device hip:" + std::to_string(index) + " does not exist");
    prop_ = {};
    prop_.type = hipMemAllocationTypePinned;
    prop_.location.type = hipMemLocationTypeDevice;
    prop_.location.id = index;
    access_ = {};
    access_.location = prop_.location;
    access_.flags = hipMemAccessFlagsProtReadWrite;
    bind_thread();
    check(hip().MemGetAllocationGranularity(&granularity_, &prop_, hipMemAllocationGranularityMinimum),
          "hipMemGetAllocationGranularity");
  }
  const char* name() const override { return "hip"; }
  size_t granularity() const override { return granularity_; }
  int dlpack_device_type() const override { return 10; /* kDLROCM */ }
  void bind_thread() override { check(hip().SetDevice(device().index), "hipSetDevice"); }
  uintptr_t reserve(size_t size, size_t alignment) override {
    bind_thread();
    void* p = nullptr;
    check(hip().MemAddressReserve(&p, size, alignment, nullptr, 0), "hipMemAddressReserve");
    return reinterpret_cast<uintptr_t>(p);
  }
  void free_reservation(uintptr_t va, size_t size) override {
    (void)hip().MemAddressFree(reinterpret_cast<void*>(va), size);
  }
  void zero_fill(uintptr_t va, size_t size) override {
    bind_thread();
    check(hip().MemsetD8(reinterpret_cast<hipDeviceptr_t>(va), 0, size), "hipMemsetD8");
    check(hip().DeviceSynchronize(), "hipDeviceSynchronize");
  }
  void mem_info(size_t* free_bytes, size_t* total_bytes) override {
    bind_thread();
    check(hip().MemGetInfo(free_bytes, total_bytes), "hipMemGetInfo");
  }

 protected:
  PhysHandle do_create(size_t size) override {
    bind_thread();
    hipMemGenericAllocationHandle_t h{};
    check(hip().MemCreate(&h, size, &prop_, 0), "hipMemCreate");
    return reinterpret_cast<PhysHandle>(h);
  }
  void do_map(uintptr_t va, size_t size, PhysHandle h) override {
    check(hip().MemMap(reinterpret_cast<void*>(va), size, 0, reinterpret_cast<hipMemGenericAllocationHandle_t>(h), 0),
          "hipMemMap");
  }
  void do_set_access(uintptr_t va, size_t size, bool writable) override {
    hipMemAccessDesc a = access_;
    if (!writable) a.flags = hipMemAccessFlagsProtRead;
    check(hip().MemSetAccess(reinterpret_cast<void*>(va), size, &a, 1), "hipMemSetAccess");
  }
  void do_unmap(uintptr_t va, size_t size) override {
    check(hip().MemUnmap(reinterpret_cast<void*>(va), size), "hipMemUnmap");
  }
  void do_release(PhysHandle h) override {
    check(hip().MemRelease(reinterpret_cast<hipMemGenericAllocationHandle_t>(h)), "hipMemRelease");
  }

 private:
  hipMemAllocationProp prop_;
  hipMemAccessDesc access_;
  size_t granularity_ = 0;
};

}  // namespace

std::shared_ptr<Backend> make_hip_backend(int index) { return std::make_shared<HipBackend>(index); }

}  // namespace kvcached

#else  // !KVCACHED_WITH_HIP

namespace kvcached {
std::shared_ptr<Backend> make_hip_backend(int) {
  fail(ErrorKind::Backend,
       "this kvcached build has no HIP backend (ROCm headers were not found at build time); "
       "reinstall on a ROCm machine or use device='cpu'");
}
}  // namespace kvcached

#endif
