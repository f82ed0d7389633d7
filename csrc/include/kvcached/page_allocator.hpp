// PageAllocator: the ledger of kvcached pages (page id = offset / page_size)
// of one KV group. A page is Free (unmapped), Reserved (mapped, unused: the
// fast path), InUse, Busy (a map/unmap is in flight) or Quarantined.
//
//   alloc: Reserved -> InUse (no driver call), else Free -> Busy -> map -> InUse
//   free : InUse -> Reserved while the reserve is below its max, else unmap -> Free
//   prealloc thread: keeps the reserve at its min by mapping Free pages; it
//   runs in C++ only (never takes the Python GIL with a local mapper).
//   resize: pages at or past the target are never handed out; reserved ones are
//   unmapped at once, in-use ones when they are freed (gradual shrink).
// The mapping itself goes through a Mapper: the local FTensorAllocator, or a
// fan-out to worker processes.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace kvcached {

class MemInfoTracker;

class Mapper {
 public:
  virtual ~Mapper() = default;
  // Both are all-or-nothing and throw kvcached::Error.
  virtual void map(const std::vector<int64_t>& offsets) = 0;
  virtual void unmap(const std::vector<int64_t>& offsets) = 0;
  // Bytes the mapper could not release (quarantined), where it knows; 0 else.
  virtual int64_t quarantined_bytes() const { return 0; }
};

// Maps through this process's FTensorAllocator of `group_id` (looked up per call,
// so the allocator may be built before the tensors exist).
std::shared_ptr<Mapper> make_local_mapper(int group_id);

struct PageAllocatorOptions {
  size_t num_layers = 1;
  size_t mem_size_per_layer = 0;  // virtual bytes of one K/V buffer
  size_t page_size = 0;
  size_t num_kv_buffers = 2;
  size_t min_reserved = 0;
  size_t max_reserved = 0;
  bool enable_prealloc = true;
  // False for mappers that call into Python: a C++ thread must not wait on
  // the GIL while Python joins it.
  bool allow_prealloc = true;
};

class PageAllocator {
 public:
  PageAllocator(const PageAllocatorOptions& opts, std::shared_ptr<Mapper> mapper);
  ~PageAllocator();
  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  // n page ids, all mapped, or an OutOfMemory error with nothing changed.
  std::vector<int64_t> alloc_pages(size_t n);
  int64_t alloc_page();
  // Pages must all be in use; otherwise InvalidArgument and nothing changes.
  void free_pages(const std::vector<int64_t>& ids);
  void free_page(int64_t id);
  // Unmaps every reserved page; returns how many.
  size_t trim();
  // New target in bytes per K/V buffer; returns true when fully applied (no
  // in-use page at or past the target).
  bool resize(size_t mem_size_per_layer);
  // Cap on physical bytes over all layers and buffers (< 0: none).
  void set_mem_limit(int64_t bytes);
  int64_t mem_limit() const;
  void set_reserve_bounds(size_t min_reserved, size_t max_reserved);
  // Publishes used/prealloc bytes to a shared record after every change
  // (three atomic stores; nullptr detaches).
  void attach_tracker(std::shared_ptr<MemInfoTracker> tracker);

  void start_prealloc_thread();
  void stop_prealloc_thread();

  size_t page_size() const { return opts_.page_size; }
  size_t bytes_per_page() const { return opts_.page_size * opts_.num_layers * opts_.num_kv_buffers; }
  size_t num_virtual_pages() const { return num_virtual_pages_; }
  size_t num_total_pages() const;     // current target
  size_t num_free_pages() const;      // allocatable now: reserve (and pages being pre-mapped) + free within target and limit
  size_t num_inuse_pages() const;
  size_t num_reserved_pages() const;  // mapped and unused (reserve and stranded)
  // Whether page `id` is in the reserve: alloc_pages hands the reserve out before any free
  // page, and free pages lowest id first (what available_size's count relies on).
  bool is_reserved(int64_t id) const;
  size_t num_mapped_pages() const;    // reserved + in use + in flight
  size_t num_quarantined_pages() const;
  int64_t get_page_id(int64_t block_id, int64_t block_mem_size) const;
  std::string last_error() const;

 private:
  enum class State : uint8_t { Free, Reserved, InUse, Busy, Quarantined };

  size_t limit_pages_locked() const;
  size_t free_capacity_locked() const;
  int64_t take_free_locked();
  void put_free_locked(int64_t id);
  std::vector<int64_t> offsets_of(const std::vector<int64_t>& ids) const;
  // Unmaps `ids` (already Busy) outside the lock and settles their state.
  void unmap_busy(std::vector<int64_t> ids, std::unique_lock<std::mutex>& lk);
  void prealloc_loop();
  void publish_locked();
  // After a failed map or any unmap: the record's quarantined bytes.
  void publish_quarantine_locked();
  // The record's statistics after a map/unmap call (one batch of pages):
  // a few atomic adds to the shared block, only on the paths that called the
  // mapper, never on the reserve fast path.
  void count_map_locked(size_t pages, int64_t start_ns, bool ok);
  void count_unmap_locked(size_t pages, int64_t start_ns, bool ok, size_t quarantined);

  PageAllocatorOptions opts_;
  std::shared_ptr<Mapper> mapper_;
  size_t num_virtual_pages_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<State> state_;
  std::set<int64_t> free_;          // ordered: low ids first, so the tail drains on shrink
  std::vector<int64_t> reserved_;   // LIFO; only ids within the target
  std::vector<int64_t> stranded_;   // mapped, unused, past the target: an unmap failed; retried by trim/resize
  size_t target_pages_ = 0;
  size_t free_in_target_ = 0;
  size_t inuse_ = 0;
  size_t mapped_ = 0;               // reserved + in use + mapping in flight
  size_t premapping_ = 0;           // pages the pre-map thread is mapping now
  size_t quarantined_ = 0;
  int64_t limit_bytes_ = -1;
  std::string last_error_;
  std::shared_ptr<MemInfoTracker> tracker_;

  std::thread prealloc_;
  bool stop_ = false;
  bool prealloc_running_ = false;
};

}  // namespace kvcached
