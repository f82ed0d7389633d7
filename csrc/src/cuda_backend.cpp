// CUDA driver VMM backend. libcuda is loaded at run time (dlopen), never
// linked, so one build imports on machines with no GPU and uses the GPU where
// there is one. cuda.h supplies types only.
#include <cuda.h>
#include <dlfcn.h>

#include <mutex>
#include <string>

#include "kvcached/backend.hpp"
#include "kvcached/errors.hpp"

namespace kvcached {
namespace {

// Driver entry points, by their versioned exported names.
struct CudaDriver {
  CUresult (*Init)(unsigned int);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DeviceGetCount)(int*);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*CtxGetCurrent)(CUcontext*);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*CtxSynchronize)(void);
  CUresult (*MemGetInfo)(size_t*, size_t*);
  CUresult (*MemsetD8)(CUdeviceptr, unsigned char, size_t);
  CUresult (*MemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*MemAddressFree)(CUdeviceptr, size_t);
  CUresult (*MemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
  CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*MemUnmap)(CUdeviceptr, size_t);
  CUresult (*MemRelease)(CUmemGenericAllocationHandle);
  CUresult (*MemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
  CUresult (*GetErrorName)(CUresult, const char**);
};

const CudaDriver& driver() {
  static CudaDriver drv;
  static std::string load_error;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      load_error = "the CUDA driver (libcuda.so.1) is not available on this machine; "
                   "use device='cpu' for the host backend";
      return;
    }
    auto sym = [&](void* fp_slot, const char* name) {
      void* s = dlsym(lib, name);
      if (!s && load_error.empty()) {
        load_error = std::string("the CUDA driver lacks ") + name + "; a driver with CUDA VMM support (>= 11.2) is needed";
      }
      *static_cast<void**>(fp_slot) = s;
    };
    sym(&drv.Init, "cuInit");
    sym(&drv.DeviceGet, "cuDeviceGet");
    sym(&drv.DeviceGetCount, "cuDeviceGetCount");
    sym(&drv.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    sym(&drv.CtxGetCurrent, "cuCtxGetCurrent");
    sym(&drv.CtxSetCurrent, "cuCtxSetCurrent");
    sym(&drv.CtxSynchronize, "cuCtxSynchronize");
    sym(&drv.MemGetInfo, "cuMemGetInfo_v2");
    sym(&drv.MemsetD8, "cuMemsetD8_v2");
    sym(&drv.MemAddressReserve, "cuMemAddressReserve");
    sym(&drv.MemAddressFree, "cuMemAddressFree");
    sym(&drv.MemCreate, "cuMemCreate");
    sym(&drv.MemMap, "cuMemMap");
    sym(&drv.MemSetAccess, "cuMemSetAccess");
    sym(&drv.MemUnmap, "cuMemUnmap");
    sym(&drv.MemRelease, "cuMemRelease");
    sym(&drv.MemGetAllocationGranularity, "cuMemGetAllocationGranularity");
    sym(&drv.GetErrorName, "cuGetErrorName");
  });
  if (!load_error.empty()) fail(ErrorKind::Backend, load_error);
  return drv;
}

std::string cu_text(CUresult r) {
  const char* name = nullptr;
  if (driver().GetErrorName(r, &name) != CUDA_SUCCESS || !name) name = "CUDA_ERROR_UNKNOWN";
  return std::string(name) + " (" + std::to_string(static_cast<int>(r)) + ")";
}

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  ErrorKind kind = (r == CUDA_ERROR_OUT_OF_MEMORY) ? ErrorKind::OutOfMemory : ErrorKind::Backend;
  fail(kind, std::string("CUDA backend: ") + what + " failed: " + cu_text(r));
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int index) : Backend(DeviceSpec{DeviceSpec::Kind::Cuda, index}) {
    const CudaDriver& d = driver();
    check(d.Init(0), "cuInit");
    int count = 0;
    check(d.DeviceGetCount(&count), "cuDeviceGetCount");
    if (index >= count) {
      invalid("device cuda:" + std::to_string(index) + " does not exist; this machine has " +
              std::to_string(count) + " CUDA device(s)");
    }
    check(d.DeviceGet(&dev_, index), "cuDeviceGet");
    check(d.DevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    prop_ = {};
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = dev_;
    access_ = {};
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    bind_thread();
    check(d.MemGetAllocationGranularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity");
  }

  const char* name() const override { return "cuda"; }
  size_t granularity() const override { return granularity_; }
  int dlpack_device_type() const override { return 2; /* kDLCUDA */ }

  void bind_thread() override {
    // The primary context is the one torch uses; bind it where none is current.
    CUcontext cur = nullptr;
    driver().CtxGetCurrent(&cur);
    if (cur != ctx_) check(driver().CtxSetCurrent(ctx_), "cuCtxSetCurrent");
  }

  uintptr_t reserve(size_t size, size_t alignment) override {
    bind_thread();
    CUdeviceptr p = 0;
    check(driver().MemAddressReserve(&p, size, alignment, 0, 0), "cuMemAddressReserve");
    return static_cast<uintptr_t>(p);
  }

  void free_reservation(uintptr_t va, size_t size) override {
    bind_thread();
    driver().MemAddressFree(static_cast<CUdeviceptr>(va), size);
  }

  void zero_fill(uintptr_t va, size_t size) override {
    bind_thread();
    check(driver().MemsetD8(static_cast<CUdeviceptr>(va), 0, size), "cuMemsetD8");
    check(driver().CtxSynchronize(), "cuCtxSynchronize");
  }

  void mem_info(size_t* free_bytes, size_t* total_bytes) override {
    bind_thread();
    check(driver().MemGetInfo(free_bytes, total_bytes), "cuMemGetInfo");
  }

 protected:
  PhysHandle do_create(size_t size) override {
    bind_thread();
    CUmemGenericAllocationHandle h = 0;
    check(driver().MemCreate(&h, size, &prop_, 0), "cuMemCreate");
    return static_cast<PhysHandle>(h);
  }
  void do_map(uintptr_t va, size_t size, PhysHandle h) override {
    bind_thread();
    check(driver().MemMap(static_cast<CUdeviceptr>(va), size, 0, static_cast<CUmemGenericAllocationHandle>(h), 0),
          "cuMemMap");
  }
  void do_set_access(uintptr_t va, size_t size, bool writable) override {
    bind_thread();
    CUmemAccessDesc a = access_;
    if (!writable) a.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
    check(driver().MemSetAccess(static_cast<CUdeviceptr>(va), size, &a, 1),
          writable ? "cuMemSetAccess" : "cuMemSetAccess (read-only zero page: unset KVCACHED_ZERO_PAGE if the driver refuses it)");
  }
  void do_unmap(uintptr_t va, size_t size) override {
    bind_thread();
    check(driver().MemUnmap(static_cast<CUdeviceptr>(va), size), "cuMemUnmap");
  }
  void do_release(PhysHandle h) override {
    bind_thread();
    check(driver().MemRelease(static_cast<CUmemGenericAllocationHandle>(h)), "cuMemRelease");
  }

 private:
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  CUmemAllocationProp prop_;
  CUmemAccessDesc access_;
  size_t granularity_ = 0;
};

}  // namespace

std::shared_ptr<Backend> make_cuda_backend(int index) { return std::make_shared<CudaBackend>(index); }

}  // namespace kvcached
