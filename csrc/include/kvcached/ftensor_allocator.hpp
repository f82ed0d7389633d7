// FTensorAllocator: the KV tensors of one instance and KV group, and the
// all-or-nothing map/unmap of page offsets across every layer and K/V buffer.
//
// Offsets are byte offsets into one per-layer K (or V) buffer, multiples of
// the page size. Layouts:
//   per-layer   : one FTensor per layer, [K buffer | V buffer]; a page offset
//                 maps num_layers * num_kv_buffers units of page_size.
//   contiguous  : one FTensor, [page][layer][kv][page_size bytes]; a page
//                 offset maps one compound unit of page_size*layers*kv bytes.
// Invariants kept here: for one offset every target is mapped or none is; a
// logical page is Unmapped, Mapped or Prepared (held by an unmap transaction);
// after a failed rollback the allocator refuses all work (fail closed).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvcached/backend.hpp"
#include "kvcached/ftensor.hpp"

namespace kvcached {

enum class TxOutcome { Unknown = 0, Prepared, Committed, Aborted };

struct MapResult {
  std::vector<int64_t> newly_mapped;
  std::vector<int64_t> already_mapped;
};

struct AllocatorStats {
  int64_t mapped_pages = 0;
  int64_t prepared_pages = 0;
  int64_t physical_bytes = 0;  // bytes of live handles of this allocator (zero page excluded)
  int64_t quarantined = 0;        // units (handles or holes) out of circulation
  int64_t quarantined_bytes = 0;  // bytes of quarantined or unreleased handles: still allocated
  int64_t pending_transactions = 0;
};

class FTensorAllocator {
 public:
  static constexpr size_t kTxHistory = 4096;

  FTensorAllocator(std::shared_ptr<Backend> backend, int group_id, size_t page_size, bool contiguous);
  ~FTensorAllocator();

  // Creates the KV tensors: `size` bytes per K/V buffer per layer (rounded up
  // to the page size). Throws if they exist already.
  void create_kv_tensors(size_t size, size_t num_layers, size_t num_kv_buffers);
  bool created() const;
  std::vector<std::shared_ptr<FTensor>> tensors() const;

  int group_id() const { return group_id_; }
  size_t page_size() const { return page_size_; }
  bool contiguous() const { return contiguous_; }
  size_t buffer_size() const { return buffer_size_; }
  size_t num_layers() const { return num_layers_; }
  size_t num_kv_buffers() const { return num_kv_buffers_; }
  size_t num_pages() const { return page_state_.size(); }
  // Physical bytes one page offset maps across all layers and buffers.
  size_t bytes_per_page() const { return page_size_ * num_layers_ * num_kv_buffers_; }
  const std::shared_ptr<Backend>& backend() const { return backend_; }

  // Strict map: every offset must be unmapped. All-or-nothing.
  void map(const std::vector<int64_t>& offsets);
  // Idempotent map for retries: already-mapped offsets are reported, not refused.
  MapResult map_with_result(const std::vector<int64_t>& offsets);
  // Direct unmap (prepare + commit in one step).
  void unmap(const std::vector<int64_t>& offsets);

  // Two-phase unmap. prepare: unmap, zero page back, keep handles. commit:
  // release them. abort: map them back (data intact). Repeats are idempotent;
  // a prepare of an aborted transaction is refused.
  void prepare_unmap(int64_t tx, const std::vector<int64_t>& offsets);
  void commit_unmap(int64_t tx);
  void abort_unmap(int64_t tx);
  TxOutcome tx_outcome(int64_t tx) const;

  bool is_mapped(int64_t offset) const;
  std::vector<int64_t> mapped_offsets() const;
  AllocatorStats stats() const;
  bool failed() const;
  std::string failure() const;

  // Bytes of quarantined or unreleased handles (see FTensor).
  int64_t quarantined_bytes() const;

  // Releases every physical page, quarantined ones too where the driver
  // allows; returns the bytes it could not release. The tensors' address
  // ranges stay valid (zero page) until their last user drops them. Later
  // calls raise Shutdown.
  int64_t shutdown();

 private:
  enum class Page : uint8_t { Unmapped, Mapped, Prepared };
  struct Target {
    FTensor* tensor;
    size_t unit;
  };
  struct Retained {
    Target target;
    PhysHandle handle;
  };
  struct PendingTx {
    std::vector<size_t> pages;
    std::vector<Retained> retained;
  };

  void check_usable_locked() const;
  void check_created_locked() const;
  std::vector<size_t> pages_of_locked(const std::vector<int64_t>& offsets) const;
  void targets_locked(size_t page, std::vector<Target>* out) const;
  void map_pages_locked(const std::vector<size_t>& pages);
  // Unmaps every target of `pages`, retaining handles; all-or-nothing.
  std::vector<Retained> retain_pages_locked(const std::vector<size_t>& pages);
  void release_retained_locked(std::vector<Retained>& retained);
  void remember_locked(int64_t tx, TxOutcome outcome);
  [[noreturn]] void fail_closed_locked(const std::string& why);

  std::shared_ptr<Backend> backend_;
  const int group_id_;
  const size_t page_size_;
  const bool contiguous_;
  size_t buffer_size_ = 0;
  size_t num_layers_ = 0;
  size_t num_kv_buffers_ = 0;

  mutable std::mutex mu_;
  std::shared_ptr<ZeroPage> zero_;
  std::vector<std::shared_ptr<FTensor>> tensors_;
  std::vector<Page> page_state_;
  int64_t mapped_pages_ = 0;
  int64_t prepared_pages_ = 0;
  std::unordered_map<int64_t, PendingTx> pending_;
  std::unordered_map<int64_t, TxOutcome> history_;
  std::deque<int64_t> history_order_;
  int64_t next_internal_tx_ = -1;  // direct unmaps use negative ids
  bool shut_down_ = false;
  std::string failure_;
};

// Process-wide registry, the upstream kvcached globals: one configuration set
// by init_kvcached() and one allocator per KV group.
namespace registry {

struct Config {
  std::string device;
  size_t page_size = 0;
  bool contiguous = false;
};

void init(const std::string& device, size_t page_size, bool contiguous);
bool initialized();
Config config();
// Shuts every group down; returns the bytes that could not be released.
int64_t shutdown();
// The allocator of a group, created on demand with the init() configuration.
std::shared_ptr<FTensorAllocator> group(int group_id, bool create);
std::vector<std::shared_ptr<FTensorAllocator>> all_groups();

}  // namespace registry
}  // namespace kvcached
