// FTensor: one stable virtual address range, cut into equal map units. Every
// unit is backed either by its own physical handle or by the shared zero page,
// so the range is always readable and its address never moves.
//
// Invariant kept here: a unit is Zero (zero page mapped), Mapped (own handle
// mapped) or Hole (neither: a rollback failed; the unit is quarantined and
// the owner must fail closed). Handles whose state is unknown are kept in a
// quarantine list and never reused; handles whose release failed (mapped
// nowhere) in an unreleased list. Both count as quarantined bytes, and
// release_quarantine() (at shutdown) gives back what the driver lets go.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kvcached/backend.hpp"

namespace kvcached {

// One zeroed physical allocation of `size` bytes, mapped behind every unmapped unit of
// every tensor of a group. Invariant: it reads zeros. Mapped read-write (the default), a
// kernel's stray write into unmapped memory would change what every unmapped unit reads;
// read-only (`read_only`, KVCACHED_ZERO_PAGE=ro), that write faults instead.
class ZeroPage {
 public:
  ZeroPage(std::shared_ptr<Backend> backend, size_t size, bool read_only = false);
  ~ZeroPage();
  ZeroPage(const ZeroPage&) = delete;
  ZeroPage& operator=(const ZeroPage&) = delete;
  PhysHandle handle() const { return handle_; }
  size_t size() const { return size_; }
  bool read_only() const { return read_only_; }

 private:
  std::shared_ptr<Backend> backend_;
  PhysHandle handle_ = 0;
  size_t size_ = 0;
  bool read_only_ = false;
};

class FTensor {
 public:
  // `size` must be a multiple of `unit`; `zero->size()` must equal `unit`.
  FTensor(std::shared_ptr<Backend> backend, size_t size, size_t unit, std::shared_ptr<ZeroPage> zero);
  ~FTensor();
  FTensor(const FTensor&) = delete;
  FTensor& operator=(const FTensor&) = delete;

  uintptr_t data() const { return base_; }
  size_t size() const { return size_; }
  size_t unit() const { return unit_; }
  size_t num_units() const { return state_.size(); }
  const std::shared_ptr<Backend>& backend() const { return backend_; }

  bool is_mapped(size_t i) const { return state_[i] == Unit::Mapped; }
  // Creates a physical unit and maps it at unit i (which must be Zero).
  // On error the unit is Zero again and nothing leaked, or, if restoring the
  // zero page failed, the unit is a Hole and StateConsistency is thrown.
  void map_new(size_t i);
  // Takes unit i's handle out and maps the zero page back; the caller owns
  // the handle. On error the unit stays mapped with its data, or it becomes a
  // Hole with StateConsistency thrown.
  PhysHandle unmap_retain(size_t i);
  // Maps a retained handle back at unit i (which must be Zero). On error the
  // caller still owns `h`; a Hole throws StateConsistency.
  void remap(size_t i, PhysHandle h);
  // Releases a handle that is mapped nowhere; a failing release keeps it in
  // the unreleased list (retried by release_quarantine()).
  void release(PhysHandle h);
  // Keeps a handle whose state is unknown out of circulation for good.
  void quarantine(PhysHandle h);
  // Shutdown: retries the unreleased handles, unmaps holes (zero page back),
  // then releases the quarantined handles (each was never released; a handle
  // still mapped somewhere is freed by the driver when it is unmapped).
  // Returns the bytes still held after that.
  int64_t release_quarantine();

  size_t num_mapped() const { return num_mapped_; }
  size_t num_quarantined() const { return quarantined_.size() + unreleased_.size() + holes_; }
  int64_t quarantined_bytes() const {
    return static_cast<int64_t>((quarantined_.size() + unreleased_.size()) * unit_);
  }

 private:
  enum class Unit : uint8_t { Zero, Mapped, Hole };
  uintptr_t va(size_t i) const { return base_ + i * unit_; }
  // Maps `h` at unit i and grants access; on error nothing stays mapped there
  // (or, if even the undo fails, a StateConsistency error is thrown).
  void map_accessible(size_t i, PhysHandle h);
  // Replaces the zero page at unit i by `h`; restores the zero page on error.
  void place(size_t i, PhysHandle h);
  // Maps the zero page at an empty unit; marks a Hole and throws if it cannot.
  void restore_zero(size_t i, const char* during);

  std::shared_ptr<Backend> backend_;
  std::shared_ptr<ZeroPage> zero_;
  uintptr_t base_ = 0;
  size_t size_ = 0;
  size_t unit_ = 0;
  std::vector<Unit> state_;
  std::vector<PhysHandle> handles_;
  std::vector<PhysHandle> quarantined_;
  std::vector<PhysHandle> unreleased_;
  size_t num_mapped_ = 0;
  size_t holes_ = 0;
};

// Bytes quarantined or unreleased in every FTensor of this process now.
int64_t quarantined_bytes_total();

}  // namespace kvcached
