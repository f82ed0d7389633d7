#include "kvcached/ftensor_allocator.hpp"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <unordered_set>

#include "kvcached/errors.hpp"

namespace kvcached {

namespace {
std::string bytes_text(size_t b) { return std::to_string(b) + " bytes"; }

// KVCACHED_ZERO_PAGE: "rw" (the default) or "ro": the zero page read-only, so that a kernel
// writing into unmapped KV memory faults instead of changing what all unmapped memory reads.
bool zero_page_read_only() {
  const char* v = std::getenv("KVCACHED_ZERO_PAGE");
  std::string s = v ? v : "";
  if (s.empty() || s == "rw") return false;
  if (s == "ro") return true;
  invalid("KVCACHED_ZERO_PAGE=" + s + " is neither rw nor ro; unset it, or set ro to make a write into unmapped KV memory fault");
}
}  // namespace

FTensorAllocator::FTensorAllocator(std::shared_ptr<Backend> backend, int group_id, size_t page_size,
                                   bool contiguous)
    : backend_(std::move(backend)), group_id_(group_id), page_size_(page_size), contiguous_(contiguous) {}

FTensorAllocator::~FTensorAllocator() {
  try {
    shutdown();
  } catch (...) {
  }
}

void FTensorAllocator::check_usable_locked() const {
  if (shut_down_) {
    fail(ErrorKind::Shutdown, "kvcached was shut down (group " + std::to_string(group_id_) +
                                  "); call init_kvcached() and create_kv_tensors() again");
  }
  if (!failure_.empty()) {
    fail(ErrorKind::StateConsistency, "the KV pool of group " + std::to_string(group_id_) +
                                          " refuses work after a failed rollback (" + failure_ +
                                          "); restart this instance");
  }
}

void FTensorAllocator::check_created_locked() const {
  if (tensors_.empty()) {
    invalid("the KV tensors of group " + std::to_string(group_id_) +
            " are not created yet; call create_kv_tensors() first");
  }
}

void FTensorAllocator::fail_closed_locked(const std::string& why) {
  if (failure_.empty()) failure_ = why;
  fail(ErrorKind::StateConsistency, why + "; the KV pool of group " + std::to_string(group_id_) +
                                        " now refuses work: restart this instance");
}

void FTensorAllocator::create_kv_tensors(size_t size, size_t num_layers, size_t num_kv_buffers) {
  std::lock_guard<std::mutex> g(mu_);
  check_usable_locked();
  if (!tensors_.empty()) {
    invalid("the KV tensors of group " + std::to_string(group_id_) +
            " were already created; call shutdown_kvcached() before creating them again, or use another group_id");
  }
  if (size == 0) invalid("create_kv_tensors: size must be > 0 bytes per K/V buffer");
  if (num_layers == 0) invalid("create_kv_tensors: num_layers must be >= 1");
  if (num_kv_buffers == 0 || num_kv_buffers > 2) invalid("create_kv_tensors: num_kv_buffers must be 1 (MLA) or 2 (K and V)");
  size_t buffer = (size + page_size_ - 1) / page_size_ * page_size_;
  size_t pages = buffer / page_size_;
  size_t unit = contiguous_ ? page_size_ * num_layers * num_kv_buffers : page_size_;
  auto zero = std::make_shared<ZeroPage>(backend_, unit, zero_page_read_only());
  std::vector<std::shared_ptr<FTensor>> tensors;
  if (contiguous_) {
    tensors.push_back(std::make_shared<FTensor>(backend_, pages * unit, unit, zero));
  } else {
    for (size_t l = 0; l < num_layers; ++l) {
      tensors.push_back(std::make_shared<FTensor>(backend_, buffer * num_kv_buffers, unit, zero));
    }
  }
  zero_ = std::move(zero);
  tensors_ = std::move(tensors);
  buffer_size_ = buffer;
  num_layers_ = num_layers;
  num_kv_buffers_ = num_kv_buffers;
  page_state_.assign(pages, Page::Unmapped);
}

bool FTensorAllocator::created() const {
  std::lock_guard<std::mutex> g(mu_);
  return !tensors_.empty();
}

std::vector<std::shared_ptr<FTensor>> FTensorAllocator::tensors() const {
  std::lock_guard<std::mutex> g(mu_);
  return tensors_;
}

std::vector<size_t> FTensorAllocator::pages_of_locked(const std::vector<int64_t>& offsets) const {
  std::vector<size_t> pages;
  pages.reserve(offsets.size());
  std::unordered_set<int64_t> seen;
  seen.reserve(offsets.size() * 2);
  for (int64_t off : offsets) {
    if (off < 0 || off % static_cast<int64_t>(page_size_) != 0) {
      invalid("offset " + std::to_string(off) + " is not a multiple of the page size " + bytes_text(page_size_) +
              "; offsets are page-aligned byte offsets into one K/V buffer");
    }
    if (static_cast<size_t>(off) >= buffer_size_) {
      invalid("offset " + std::to_string(off) + " is out of range: each K/V buffer holds " +
              bytes_text(buffer_size_) + " (" + std::to_string(page_state_.size()) + " pages of " +
              bytes_text(page_size_) + ")");
    }
    if (!seen.insert(off).second) invalid("offset " + std::to_string(off) + " appears twice in one call");
    pages.push_back(static_cast<size_t>(off) / page_size_);
  }
  return pages;
}

void FTensorAllocator::targets_locked(size_t page, std::vector<Target>* out) const {
  out->clear();
  if (contiguous_) {
    out->push_back({tensors_[0].get(), page});
    return;
  }
  size_t pages = page_state_.size();
  for (auto& t : tensors_) {
    for (size_t k = 0; k < num_kv_buffers_; ++k) out->push_back({t.get(), k * pages + page});
  }
}

void FTensorAllocator::map_pages_locked(const std::vector<size_t>& pages) {
  std::vector<Target> done, targets;
  done.reserve(pages.size() * num_layers_ * num_kv_buffers_);
  try {
    for (size_t p : pages) {
      targets_locked(p, &targets);
      for (const Target& t : targets) {
        t.tensor->map_new(t.unit);
        done.push_back(t);
      }
    }
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::StateConsistency) fail_closed_locked(std::string("map failed: ") + e.what());
    // Roll back every unit this call mapped, newest first.
    for (auto it = done.rbegin(); it != done.rend(); ++it) {
      try {
        PhysHandle h = it->tensor->unmap_retain(it->unit);
        it->tensor->release(h);
      } catch (const Error& re) {
        fail_closed_locked(std::string("map failed (") + e.what() + ") and its rollback failed: " + re.what());
      }
    }
    fail(e.kind(), "mapping " + std::to_string(pages.size()) + " page(s) failed and was rolled back, nothing is mapped: " +
                       e.what());
  }
  for (size_t p : pages) page_state_[p] = Page::Mapped;
  mapped_pages_ += static_cast<int64_t>(pages.size());
}

std::vector<FTensorAllocator::Retained> FTensorAllocator::retain_pages_locked(const std::vector<size_t>& pages) {
  std::vector<Retained> retained;
  std::vector<Target> targets;
  retained.reserve(pages.size() * num_layers_ * num_kv_buffers_);
  try {
    for (size_t p : pages) {
      targets_locked(p, &targets);
      for (const Target& t : targets) retained.push_back({t, t.tensor->unmap_retain(t.unit)});
    }
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::StateConsistency) fail_closed_locked(std::string("unmap failed: ") + e.what());
    for (auto it = retained.rbegin(); it != retained.rend(); ++it) {
      try {
        it->target.tensor->remap(it->target.unit, it->handle);
      } catch (const Error& re) {
        it->target.tensor->quarantine(it->handle);
        fail_closed_locked(std::string("unmap failed (") + e.what() + ") and restoring the pages failed: " + re.what());
      }
    }
    fail(e.kind(), "unmapping " + std::to_string(pages.size()) +
                       " page(s) failed and was rolled back, every page is still mapped with its data: " + e.what());
  }
  return retained;
}

void FTensorAllocator::release_retained_locked(std::vector<Retained>& retained) {
  // A failed release leaves the handle quarantined in its FTensor; the
  // address range is already on the zero page, so consistency holds.
  for (Retained& r : retained) r.target.tensor->release(r.handle);
  retained.clear();
}

void FTensorAllocator::remember_locked(int64_t tx, TxOutcome outcome) {
  auto it = history_.find(tx);
  if (it != history_.end()) {
    it->second = outcome;
    return;
  }
  history_.emplace(tx, outcome);
  history_order_.push_back(tx);
  while (history_order_.size() > kTxHistory) {
    history_.erase(history_order_.front());
    history_order_.pop_front();
  }
}

void FTensorAllocator::map(const std::vector<int64_t>& offsets) {
  std::lock_guard<std::mutex> g(mu_);
  check_usable_locked();
  check_created_locked();
  std::vector<size_t> pages = pages_of_locked(offsets);
  for (size_t i = 0; i < pages.size(); ++i) {
    if (page_state_[pages[i]] == Page::Mapped) {
      invalid("offset " + std::to_string(offsets[i]) +
              " is already mapped (double map); unmap it first, or use map_to_kv_tensors_with_result for retries");
    }
    if (page_state_[pages[i]] == Page::Prepared) {
      invalid("offset " + std::to_string(offsets[i]) + " is held by a pending unmap transaction; commit or abort it first");
    }
  }
  if (!pages.empty()) map_pages_locked(pages);
}

MapResult FTensorAllocator::map_with_result(const std::vector<int64_t>& offsets) {
  std::lock_guard<std::mutex> g(mu_);
  check_usable_locked();
  check_created_locked();
  std::vector<size_t> pages = pages_of_locked(offsets);
  MapResult result;
  std::vector<size_t> fresh;
  for (size_t i = 0; i < pages.size(); ++i) {
    switch (page_state_[pages[i]]) {
      case Page::Mapped: result.already_mapped.push_back(offsets[i]); break;
      case Page::Unmapped:
        fresh.push_back(pages[i]);
        result.newly_mapped.push_back(offsets[i]);
        break;
      case Page::Prepared:
        invalid("offset " + std::to_string(offsets[i]) +
                " is held by a pending unmap transaction; commit or abort it first");
    }
  }
  if (!fresh.empty()) map_pages_locked(fresh);
  return result;
}

void FTensorAllocator::unmap(const std::vector<int64_t>& offsets) {
  std::lock_guard<std::mutex> g(mu_);
  check_usable_locked();
  check_created_locked();
  std::vector<size_t> pages = pages_of_locked(offsets);
  for (size_t i = 0; i < pages.size(); ++i) {
    if (page_state_[pages[i]] == Page::Unmapped) {
      invalid("offset " + std::to_string(offsets[i]) + " is not mapped; nothing to unmap");
    }
    if (page_state_[pages[i]] == Page::Prepared) {
      invalid("offset " + std::to_string(offsets[i]) + " is held by a pending unmap transaction; commit or abort it");
    }
  }
  if (pages.empty()) return;
  std::vector<Retained> retained = retain_pages_locked(pages);
  release_retained_locked(retained);
  for (size_t p : pages) page_state_[p] = Page::Unmapped;
  mapped_pages_ -= static_cast<int64_t>(pages.size());
}

void FTensorAllocator::prepare_unmap(int64_t tx, const std::vector<int64_t>& offsets) {
  std::lock_guard<std::mutex> g(mu_);
  check_usable_locked();
  check_created_locked();
  std::vector<size_t> pages = pages_of_locked(offsets);
  if (auto it = pending_.find(tx); it != pending_.end()) {
    std::vector<size_t> a = it->second.pages, b = pages;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (a == b) return;  // repeated prepare: idempotent
    invalid("transaction " + std::to_string(tx) + " is already prepared with other offsets");
  }
  if (auto it = history_.find(tx); it != history_.end()) {
    if (it->second == TxOutcome::Aborted) {
      invalid("transaction " + std::to_string(tx) + " was aborted; a prepare after abort is refused");
    }
    invalid("transaction " + std::to_string(tx) + " was already committed; use a new transaction id");
  }
  for (size_t i = 0; i < pages.size(); ++i) {
    if (page_state_[pages[i]] == Page::Unmapped) {
      invalid("offset " + std::to_string(offsets[i]) + " is not mapped; nothing to unmap");
    }
    if (page_state_[pages[i]] == Page::Prepared) {
      invalid("offset " + std::to_string(offsets[i]) + " is already held by another pending unmap transaction");
    }
  }
  std::vector<Retained> retained;
  try {
    retained = retain_pages_locked(pages);
  } catch (const Error&) {
    remember_locked(tx, TxOutcome::Aborted);  // rolled back: the coordinator will abort
    throw;
  }
  for (size_t p : pages) page_state_[p] = Page::Prepared;
  prepared_pages_ += static_cast<int64_t>(pages.size());
  pending_.emplace(tx, PendingTx{std::move(pages), std::move(retained)});
  remember_locked(tx, TxOutcome::Prepared);
}

void FTensorAllocator::commit_unmap(int64_t tx) {
  std::lock_guard<std::mutex> g(mu_);
  check_usable_locked();
  auto it = pending_.find(tx);
  if (it == pending_.end()) {
    auto h = history_.find(tx);
    if (h != history_.end() && h->second == TxOutcome::Committed) return;  // repeated commit
    if (h != history_.end() && h->second == TxOutcome::Aborted) {
      invalid("transaction " + std::to_string(tx) + " was aborted; it cannot be committed");
    }
    invalid("unknown transaction " + std::to_string(tx) + ": nothing was prepared under this id");
  }
  PendingTx p = std::move(it->second);
  pending_.erase(it);
  release_retained_locked(p.retained);
  for (size_t page : p.pages) page_state_[page] = Page::Unmapped;
  prepared_pages_ -= static_cast<int64_t>(p.pages.size());
  mapped_pages_ -= static_cast<int64_t>(p.pages.size());
  remember_locked(tx, TxOutcome::Committed);
}

void FTensorAllocator::abort_unmap(int64_t tx) {
  std::lock_guard<std::mutex> g(mu_);
  check_usable_locked();
  auto it = pending_.find(tx);
  if (it == pending_.end()) {
    auto h = history_.find(tx);
    if (h != history_.end() && h->second == TxOutcome::Committed) {
      invalid("transaction " + std::to_string(tx) + " was already committed; its pages are released and cannot be restored");
    }
    remember_locked(tx, TxOutcome::Aborted);  // unknown or aborted: a late prepare will be refused
    return;
  }
  PendingTx p = std::move(it->second);
  pending_.erase(it);
  for (size_t i = 0; i < p.retained.size(); ++i) {
    Retained& r = p.retained[i];
    try {
      r.target.tensor->remap(r.target.unit, r.handle);
    } catch (const Error& e) {
      for (size_t j = i; j < p.retained.size(); ++j) p.retained[j].target.tensor->quarantine(p.retained[j].handle);
      remember_locked(tx, TxOutcome::Aborted);
      fail_closed_locked(std::string("abort of unmap transaction ") + std::to_string(tx) +
                         " could not restore a page: " + e.what());
    }
  }
  for (size_t page : p.pages) page_state_[page] = Page::Mapped;
  prepared_pages_ -= static_cast<int64_t>(p.pages.size());
  remember_locked(tx, TxOutcome::Aborted);
}

TxOutcome FTensorAllocator::tx_outcome(int64_t tx) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = history_.find(tx);
  return it == history_.end() ? TxOutcome::Unknown : it->second;
}

bool FTensorAllocator::is_mapped(int64_t offset) const {
  std::lock_guard<std::mutex> g(mu_);
  if (offset < 0 || offset % static_cast<int64_t>(page_size_) != 0 || static_cast<size_t>(offset) >= buffer_size_) {
    return false;
  }
  return page_state_[static_cast<size_t>(offset) / page_size_] == Page::Mapped;
}

std::vector<int64_t> FTensorAllocator::mapped_offsets() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int64_t> out;
  for (size_t p = 0; p < page_state_.size(); ++p) {
    if (page_state_[p] != Page::Unmapped) out.push_back(static_cast<int64_t>(p * page_size_));
  }
  return out;
}

AllocatorStats FTensorAllocator::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  AllocatorStats s;
  s.mapped_pages = mapped_pages_;
  s.prepared_pages = prepared_pages_;
  s.physical_bytes = mapped_pages_ * static_cast<int64_t>(bytes_per_page());
  for (auto& t : tensors_) {
    s.quarantined += static_cast<int64_t>(t->num_quarantined());
    s.quarantined_bytes += t->quarantined_bytes();
  }
  s.pending_transactions = static_cast<int64_t>(pending_.size());
  return s;
}

bool FTensorAllocator::failed() const {
  std::lock_guard<std::mutex> g(mu_);
  return !failure_.empty();
}

std::string FTensorAllocator::failure() const {
  std::lock_guard<std::mutex> g(mu_);
  return failure_;
}

int64_t FTensorAllocator::quarantined_bytes() const {
  std::lock_guard<std::mutex> g(mu_);
  int64_t b = 0;
  for (auto& t : tensors_) b += t->quarantined_bytes();
  return b;
}

int64_t FTensorAllocator::shutdown() {
  std::lock_guard<std::mutex> g(mu_);
  if (shut_down_) return 0;
  shut_down_ = true;
  for (auto& kv : pending_) release_retained_locked(kv.second.retained);
  pending_.clear();
  std::vector<Target> targets;
  for (size_t p = 0; p < page_state_.size(); ++p) {
    if (page_state_[p] != Page::Mapped) continue;
    targets_locked(p, &targets);
    for (const Target& t : targets) {
      try {
        t.tensor->release(t.tensor->unmap_retain(t.unit));
      } catch (const Error&) {
      }
    }
  }
  page_state_.assign(page_state_.size(), Page::Unmapped);
  mapped_pages_ = prepared_pages_ = 0;
  int64_t left = 0;
  for (auto& t : tensors_) left += t->release_quarantine();
  // Tensors live on (zero page only) while Python still holds views of them.
  tensors_.clear();
  zero_.reset();
  return left;
}

// ---------------------------------------------------------------------------
namespace registry {
namespace {
struct State {
  std::mutex mu;
  bool initialized = false;
  Config config;
  std::map<int, std::shared_ptr<FTensorAllocator>> groups;
};
State& state() {
  static State* s = new State();
  return *s;
}
}  // namespace

void init(const std::string& device, size_t page_size, bool contiguous) {
  auto backend = get_backend(device);  // throws a clear error without a driver
  size_t g = backend->granularity();
  if (page_size == 0 || page_size % g != 0) {
    invalid("page size " + std::to_string(page_size) + " is not a multiple of the " + backend->name() +
            " backend granularity " + std::to_string(g) + "; use a multiple of " + std::to_string(g) +
            " such as " + std::to_string(std::max<size_t>(g, (page_size / g + 1) * g)));
  }
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  std::string dev = backend->device().str();
  if (s.initialized) {
    if (s.config.device == dev && s.config.page_size == page_size && s.config.contiguous == contiguous) return;
    if (!s.groups.empty()) {
      invalid("kvcached is already initialized for " + s.config.device + " with page size " +
              std::to_string(s.config.page_size) + (s.config.contiguous ? " (contiguous layout)" : " (per-layer layout)") +
              "; call shutdown_kvcached() first");
    }
  }
  s.config = Config{dev, page_size, contiguous};
  s.initialized = true;
}

bool initialized() {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.initialized;
}

Config config() {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  if (!s.initialized) fail(ErrorKind::Shutdown, "kvcached is not initialized; call init_kvcached() first");
  return s.config;
}

int64_t shutdown() {
  State& s = state();
  std::map<int, std::shared_ptr<FTensorAllocator>> groups;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    groups.swap(s.groups);
    s.initialized = false;
  }
  int64_t left = 0;
  for (auto& kv : groups) left += kv.second->shutdown();
  return left;
}

std::shared_ptr<FTensorAllocator> group(int group_id, bool create) {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  if (!s.initialized) fail(ErrorKind::Shutdown, "kvcached is not initialized; call init_kvcached() first");
  if (group_id < 0) invalid("group_id must be >= 0, got " + std::to_string(group_id));
  auto it = s.groups.find(group_id);
  if (it != s.groups.end()) return it->second;
  if (!create) {
    invalid("the KV tensors of group " + std::to_string(group_id) + " are not created yet; call create_kv_tensors() first");
  }
  auto a = std::make_shared<FTensorAllocator>(get_backend(s.config.device), group_id, s.config.page_size,
                                              s.config.contiguous);
  s.groups.emplace(group_id, a);
  return a;
}

std::vector<std::shared_ptr<FTensorAllocator>> all_groups() {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  std::vector<std::shared_ptr<FTensorAllocator>> out;
  for (auto& kv : s.groups) out.push_back(kv.second);
  return out;
}

}  // namespace registry
}  // namespace kvcached
