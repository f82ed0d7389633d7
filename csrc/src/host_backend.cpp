// Host backend: the GPU VMM model on the OS's virtual memory.
//   reserve     -> mmap(PROT_NONE, MAP_NORESERVE)        (cuMemAddressReserve)
//   create      -> memfd + fallocate (memory is committed) (cuMemCreate)
//   map         -> mmap(MAP_FIXED|MAP_SHARED, PROT_NONE)  (cuMemMap)
//   set_access  -> mprotect(READ|WRITE, or READ)          (cuMemSetAccess)
//   unmap       -> mmap(MAP_FIXED, PROT_NONE) over it     (cuMemUnmap)
//   release     -> close(fd)                              (cuMemRelease)
// Like a CUDA handle, a memfd stays alive while it is mapped anywhere, and its
// pages are counted once however many times it is mapped.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <cstdio>
#include <string>

#include "kvcached/backend.hpp"
#include "kvcached/errors.hpp"

namespace kvcached {
namespace {

std::string errno_text(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

class HostBackend final : public Backend {
 public:
  HostBackend() : Backend(DeviceSpec{}) { granularity_ = static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

  const char* name() const override { return "host"; }
  size_t granularity() const override { return granularity_; }
  int dlpack_device_type() const override { return 1; /* kDLCPU */ }

  uintptr_t reserve(size_t size, size_t alignment) override {
    if (alignment < granularity_) alignment = granularity_;
    size_t span = size + alignment;
    void* p = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      fail(ErrorKind::OutOfMemory, "host backend: cannot reserve " + std::to_string(size) +
                                       " bytes of address space: " + errno_text(errno));
    }
    uintptr_t base = reinterpret_cast<uintptr_t>(p);
    uintptr_t aligned = (base + alignment - 1) / alignment * alignment;
    if (aligned > base) munmap(p, aligned - base);
    uintptr_t end = base + span, aligned_end = aligned + size;
    if (end > aligned_end) munmap(reinterpret_cast<void*>(aligned_end), end - aligned_end);
    return aligned;
  }

  void free_reservation(uintptr_t va, size_t size) override { munmap(reinterpret_cast<void*>(va), size); }

  void zero_fill(uintptr_t va, size_t size) override { std::memset(reinterpret_cast<void*>(va), 0, size); }

  void mem_info(size_t* free_bytes, size_t* total_bytes) override {
    // What the OS can still give: MemAvailable of MemTotal. (stdio: the
    // extension keeps iostreams out, see docs/DESIGN.md.)
    size_t total = 0, avail = 0;
    if (FILE* f = std::fopen("/proc/meminfo", "r")) {
      char key[64];
      unsigned long long kb = 0;
      while (std::fscanf(f, "%63s %llu kB\n", key, &kb) == 2) {
        if (std::strcmp(key, "MemTotal:") == 0) total = kb * 1024;
        if (std::strcmp(key, "MemAvailable:") == 0) avail = kb * 1024;
      }
      std::fclose(f);
    }
    *free_bytes = avail;
    *total_bytes = total;
  }

 protected:
  PhysHandle do_create(size_t size) override {
    int fd = memfd_create("kvcached-page", MFD_CLOEXEC);
    if (fd < 0) {
      fail(errno == EMFILE || errno == ENFILE ? ErrorKind::OutOfMemory : ErrorKind::Backend,
           "host backend: memfd_create failed: " + errno_text(errno) +
               (errno == EMFILE ? "; raise the open-file limit (ulimit -n) or use a larger page size" : ""));
    }
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      int e = errno;
      close(fd);
      fail(ErrorKind::Backend, "host backend: ftruncate failed: " + errno_text(e));
    }
    // Commit the memory now, as cuMemCreate does, so pressure shows up here
    // and not as a SIGBUS inside a later write.
    int rc = posix_fallocate(fd, 0, static_cast<off_t>(size));
    if (rc != 0) {
      close(fd);
      fail(rc == ENOSPC || rc == ENOMEM ? ErrorKind::OutOfMemory : ErrorKind::Backend,
           "host backend: cannot commit a page of " + std::to_string(size) + " bytes: " + errno_text(rc));
    }
    return static_cast<PhysHandle>(fd);
  }

  void do_map(uintptr_t va, size_t size, PhysHandle h) override {
    void* p = mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_SHARED | MAP_FIXED, static_cast<int>(h), 0);
    if (p == MAP_FAILED) {
      int e = errno;
      fail(e == ENOMEM ? ErrorKind::OutOfMemory : ErrorKind::Backend,
           "host backend: mmap of a page failed: " + errno_text(e) +
               (e == ENOMEM ? "; too many mappings? raise vm.max_map_count or use a larger page size" : ""));
    }
  }

  void do_set_access(uintptr_t va, size_t size, bool writable) override {
    if (mprotect(reinterpret_cast<void*>(va), size, writable ? PROT_READ | PROT_WRITE : PROT_READ) != 0) {
      fail(ErrorKind::Backend, "host backend: mprotect failed: " + errno_text(errno));
    }
  }

  void do_unmap(uintptr_t va, size_t size) override {
    // Replacing the mapping keeps the range reserved, as cuMemUnmap does.
    void* p = mmap(reinterpret_cast<void*>(va), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail(ErrorKind::Backend, "host backend: unmap failed: " + errno_text(errno));
  }

  void do_release(PhysHandle h) override {
    // On Linux close() frees the descriptor even when it reports EINTR/EIO:
    // only EBADF means nothing was released. Saying "failed" otherwise would
    // get the handle retried, and a retry could close a reused descriptor.
    if (close(static_cast<int>(h)) != 0 && errno == EBADF) {
      fail(ErrorKind::Backend, "host backend: release (close) failed: " + errno_text(errno));
    }
  }

 private:
  size_t granularity_;
};

}  // namespace

std::shared_ptr<Backend> make_host_backend() { return std::make_shared<HostBackend>(); }

}  // namespace kvcached
