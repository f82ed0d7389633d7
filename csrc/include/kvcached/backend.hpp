// Physical-memory backend: reserve virtual address ranges and create, map,
// grant access to, unmap and release physical pages. Three implementations
// (CUDA driver VMM, HIP VMM, host mmap+memfd) behave the same in every
// observable way, so every layer above is testable on a machine with no GPU.
//
// The five page operations go through fault injection here, once, for all
// backends; implementations override the do_* hooks.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kvcached/fault_injection.hpp"

namespace kvcached {

using PhysHandle = uint64_t;

struct DeviceSpec {
  enum class Kind { Host, Cuda, Hip } kind = Kind::Host;
  int index = 0;
  std::string str() const;
};

// "cpu" -> Host; "cuda", "cuda:N" -> Cuda (or Hip in a HIP build); "hip:N" -> Hip.
DeviceSpec parse_device(const std::string& dev);

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const = 0;
  const DeviceSpec& device() const { return device_; }
  // Smallest page size the backend can map; page sizes must be multiples.
  virtual size_t granularity() const = 0;
  // DLPack device type of memory in this backend (kDLCPU=1, kDLCUDA=2, kDLROCM=10).
  virtual int dlpack_device_type() const = 0;

  // Virtual address space. reserve() returns `alignment`-aligned, unbacked VA.
  virtual uintptr_t reserve(size_t size, size_t alignment) = 0;
  virtual void free_reservation(uintptr_t va, size_t size) = 0;

  // Page operations (fault-injectable). Errors throw kvcached::Error; a failed
  // call leaves nothing half-done at this level.
  PhysHandle create(size_t size);
  void map(uintptr_t va, size_t size, PhysHandle h);
  // Read-write by default; read-only for the zero page where KVCACHED_ZERO_PAGE=ro asks
  // that a stray write into unmapped memory fault instead of changing what every unmapped unit reads.
  void set_access(uintptr_t va, size_t size, bool writable = true);
  void unmap(uintptr_t va, size_t size);
  void release(PhysHandle h, size_t size);

  // Writes zeros to mapped, accessible memory and waits for completion.
  virtual void zero_fill(uintptr_t va, size_t size) = 0;
  // Device memory free/total, as the device (or OS, for host) reports it now.
  virtual void mem_info(size_t* free_bytes, size_t* total_bytes) = 0;
  // Makes this backend usable from the calling thread (CUDA: current context).
  virtual void bind_thread() {}

  int64_t live_handles() const { return live_handles_.load(std::memory_order_relaxed); }
  int64_t live_bytes() const { return live_bytes_.load(std::memory_order_relaxed); }

 protected:
  explicit Backend(DeviceSpec d) : device_(d) {}
  virtual PhysHandle do_create(size_t size) = 0;
  virtual void do_map(uintptr_t va, size_t size, PhysHandle h) = 0;
  virtual void do_set_access(uintptr_t va, size_t size, bool writable) = 0;
  virtual void do_unmap(uintptr_t va, size_t size) = 0;
  virtual void do_release(PhysHandle h) = 0;

 private:
  DeviceSpec device_;
  std::atomic<int64_t> live_handles_{0};
  std::atomic<int64_t> live_bytes_{0};
};

// One backend per device per process, created on first use.
std::shared_ptr<Backend> get_backend(const std::string& dev);

// Factories; each throws a clear error where the runtime is missing.
std::shared_ptr<Backend> make_host_backend();
std::shared_ptr<Backend> make_cuda_backend(int index);
std::shared_ptr<Backend> make_hip_backend(int index);

}  // namespace kvcached
