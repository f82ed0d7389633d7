#include "kvcached/ftensor.hpp"

#include <atomic>
#include <string>

#include "kvcached/errors.hpp"

namespace kvcached {

namespace {
std::atomic<int64_t> g_quarantined_bytes{0};
}  // namespace

int64_t quarantined_bytes_total() { return g_quarantined_bytes.load(std::memory_order_relaxed); }

namespace {
// VA alignment for a range of `unit`-sized mappings: the largest power of two
// dividing the unit. A compound unit (page * layers * kv, e.g. 2 MiB * 28 * 2)
// is not a power of two, and cuMemAddressReserve refuses such alignments.
size_t va_alignment(size_t unit) { return unit & (~unit + 1); }
}  // namespace

ZeroPage::ZeroPage(std::shared_ptr<Backend> backend, size_t size, bool read_only)
    : backend_(std::move(backend)), size_(size), read_only_(read_only) {
  handle_ = backend_->create(size);
  // Zero it through a scratch mapping (GPU memory is not zeroed by create).
  uintptr_t va = 0;
  bool mapped = false;
  try {
    va = backend_->reserve(size, va_alignment(size));
    backend_->map(va, size, handle_);
    mapped = true;
    backend_->set_access(va, size);
    backend_->zero_fill(va, size);
    backend_->unmap(va, size);
    mapped = false;
    backend_->free_reservation(va, size);
  } catch (...) {
    if (mapped) {
      try { backend_->unmap(va, size); } catch (...) {}
    }
    if (va) backend_->free_reservation(va, size);
    try { backend_->release(handle_, size_); } catch (...) {}
    throw;
  }
}

ZeroPage::~ZeroPage() {
  try {
    backend_->release(handle_, size_);
  } catch (...) {
    // Destructors must not throw; a handle we cannot release is leaked.
  }
}

FTensor::FTensor(std::shared_ptr<Backend> backend, size_t size, size_t unit, std::shared_ptr<ZeroPage> zero)
    : backend_(std::move(backend)), zero_(std::move(zero)), size_(size), unit_(unit) {
  if (unit == 0 || size == 0 || size % unit != 0) invalid("FTensor: size must be a positive multiple of the map unit");
  if (zero_->size() != unit) invalid("FTensor: the zero page must be exactly one map unit");
  size_t n = size / unit;
  base_ = backend_->reserve(size, va_alignment(unit));
  state_.assign(n, Unit::Hole);
  handles_.assign(n, 0);
  size_t done = 0;
  try {
    for (; done < n; ++done) backend_->map(va(done), unit_, zero_->handle());
    backend_->set_access(base_, size_, !zero_->read_only());  // one call over the whole range
  } catch (...) {
    for (size_t i = 0; i < done; ++i) {
      try { backend_->unmap(va(i), unit_); } catch (...) {}
    }
    backend_->free_reservation(base_, size_);
    throw;
  }
  state_.assign(n, Unit::Zero);
}

FTensor::~FTensor() {
  // Best effort: nothing here may throw.
  for (size_t i = 0; i < state_.size(); ++i) {
    try {
      backend_->unmap(va(i), unit_);  // a hole may still hold a stuck mapping
      if (state_[i] == Unit::Mapped) backend_->release(handles_[i], unit_);
    } catch (...) {
    }
  }
  release_quarantine();
  backend_->free_reservation(base_, size_);
}

namespace {
// A mapping whose access grant failed could not be undone: the unit holds the
// handle without access. The caller decides what that handle becomes.
struct StuckMapping : Error {
  explicit StuckMapping(const std::string& m) : Error(ErrorKind::StateConsistency, m) {}
};
}  // namespace

void FTensor::map_accessible(size_t i, PhysHandle h) {
  backend_->map(va(i), unit_, h);
  try {
    backend_->set_access(va(i), unit_, h != zero_->handle() || !zero_->read_only());
  } catch (const Error& e) {
    try {
      backend_->unmap(va(i), unit_);
    } catch (const std::exception& u) {
      throw StuckMapping(std::string(e.what()) + "; undoing the mapping failed too: " + u.what());
    }
    throw;
  }
}

void FTensor::restore_zero(size_t i, const char* during) {
  try {
    map_accessible(i, zero_->handle());
  } catch (const std::exception& e) {
    state_[i] = Unit::Hole;
    ++holes_;
    fail(ErrorKind::StateConsistency, std::string("could not restore the zero page after a failed ") + during +
                                          " (" + e.what() + "); the unit at offset " +
                                          std::to_string(i * unit_) + " is quarantined");
  }
}

void FTensor::place(size_t i, PhysHandle h) {
  backend_->unmap(va(i), unit_);  // zero page out; on error nothing changed
  try {
    map_accessible(i, h);
  } catch (const StuckMapping& e) {
    state_[i] = Unit::Hole;
    ++holes_;
    quarantine(h);
    fail(ErrorKind::StateConsistency, std::string("could not undo a failed mapping (") + e.what() +
                                          "); the unit is quarantined");
  } catch (const Error&) {
    restore_zero(i, "map");
    throw;
  }
}

void FTensor::map_new(size_t i) {
  if (state_[i] != Unit::Zero) invalid("FTensor: unit " + std::to_string(i) + " is not unmapped");
  PhysHandle h = backend_->create(unit_);
  try {
    place(i, h);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::StateConsistency && state_[i] == Unit::Hole && !quarantined_.empty() &&
        quarantined_.back() == h) {
      throw;  // h may still be mapped: it stays quarantined
    }
    release(h);
    throw;
  }
  state_[i] = Unit::Mapped;
  handles_[i] = h;
  ++num_mapped_;
}

PhysHandle FTensor::unmap_retain(size_t i) {
  if (state_[i] != Unit::Mapped) invalid("FTensor: unit " + std::to_string(i) + " is not mapped");
  PhysHandle h = handles_[i];
  backend_->unmap(va(i), unit_);  // on error nothing changed
  try {
    map_accessible(i, zero_->handle());
  } catch (const Error& first) {
    // Put the data page back where it was.
    try {
      map_accessible(i, h);
    } catch (const std::exception& e) {
      state_[i] = Unit::Hole;
      ++holes_;
      --num_mapped_;
      quarantine(h);
      fail(ErrorKind::StateConsistency, std::string("unmap could neither map the zero page (") + first.what() +
                                            ") nor restore the data page (" + e.what() + "); unit quarantined");
    }
    throw;
  }
  state_[i] = Unit::Zero;
  handles_[i] = 0;
  --num_mapped_;
  return h;
}

void FTensor::remap(size_t i, PhysHandle h) {
  if (state_[i] != Unit::Zero) invalid("FTensor: unit " + std::to_string(i) + " is not unmapped");
  place(i, h);
  state_[i] = Unit::Mapped;
  handles_[i] = h;
  ++num_mapped_;
}

void FTensor::release(PhysHandle h) {
  try {
    backend_->release(h, unit_);
  } catch (const Error&) {
    unreleased_.push_back(h);
    g_quarantined_bytes.fetch_add(static_cast<int64_t>(unit_), std::memory_order_relaxed);
  }
}

void FTensor::quarantine(PhysHandle h) {
  quarantined_.push_back(h);
  g_quarantined_bytes.fetch_add(static_cast<int64_t>(unit_), std::memory_order_relaxed);
}

int64_t FTensor::release_quarantine() {
  // Holes first: once unmapped, no quarantined handle is mapped there.
  for (size_t i = 0; i < state_.size() && holes_ > 0; ++i) {
    if (state_[i] != Unit::Hole) continue;
    try {
      try {
        backend_->unmap(va(i), unit_);
      } catch (const Error&) {
        // Nothing may be mapped there: the zero page below decides.
      }
      map_accessible(i, zero_->handle());
      state_[i] = Unit::Zero;
      --holes_;
    } catch (const std::exception&) {
    }
  }
  auto drain = [this](std::vector<PhysHandle>& list) {
    std::vector<PhysHandle> kept;
    for (PhysHandle h : list) {
      try {
        backend_->release(h, unit_);
        g_quarantined_bytes.fetch_sub(static_cast<int64_t>(unit_), std::memory_order_relaxed);
      } catch (const Error&) {
        kept.push_back(h);
      }
    }
    list.swap(kept);
  };
  drain(unreleased_);
  drain(quarantined_);
  return quarantined_bytes();
}

}  // namespace kvcached
