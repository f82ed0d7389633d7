#include "kvcached/page_allocator.hpp"

#include <algorithm>
#include <chrono>
#include <unordered_set>

#include "kvcached/errors.hpp"
#include "kvcached/ftensor_allocator.hpp"
#include "kvcached/mem_info_tracker.hpp"

namespace kvcached {

namespace {
int64_t mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class LocalMapper final : public Mapper {
 public:
  explicit LocalMapper(int group_id) : group_id_(group_id) {}
  void map(const std::vector<int64_t>& offsets) override { registry::group(group_id_, false)->map(offsets); }
  void unmap(const std::vector<int64_t>& offsets) override { registry::group(group_id_, false)->unmap(offsets); }
  int64_t quarantined_bytes() const override {
    try {
      return registry::group(group_id_, false)->quarantined_bytes();
    } catch (const Error&) {
      return 0;  // not initialized or shut down
    }
  }

 private:
  int group_id_;
};
}  // namespace

std::shared_ptr<Mapper> make_local_mapper(int group_id) { return std::make_shared<LocalMapper>(group_id); }

PageAllocator::PageAllocator(const PageAllocatorOptions& opts, std::shared_ptr<Mapper> mapper)
    : opts_(opts), mapper_(std::move(mapper)) {
  if (opts_.page_size == 0) invalid("PageAllocator: page_size must be > 0");
  if (opts_.num_layers == 0) invalid("PageAllocator: num_layers must be >= 1");
  if (opts_.num_kv_buffers == 0) invalid("PageAllocator: num_kv_buffers must be >= 1");
  if (opts_.mem_size_per_layer < opts_.page_size) {
    invalid("PageAllocator: mem_size_per_layer (" + std::to_string(opts_.mem_size_per_layer) +
            ") must hold at least one page of " + std::to_string(opts_.page_size) + " bytes");
  }
  if (opts_.min_reserved > opts_.max_reserved) invalid("PageAllocator: min_reserved must be <= max_reserved");
  num_virtual_pages_ = opts_.mem_size_per_layer / opts_.page_size;
  state_.assign(num_virtual_pages_, State::Free);
  for (size_t i = 0; i < num_virtual_pages_; ++i) free_.insert(free_.end(), static_cast<int64_t>(i));
  target_pages_ = num_virtual_pages_;
  free_in_target_ = num_virtual_pages_;
  if (opts_.enable_prealloc && opts_.allow_prealloc && opts_.min_reserved > 0) start_prealloc_thread();
}

PageAllocator::~PageAllocator() { stop_prealloc_thread(); }

size_t PageAllocator::limit_pages_locked() const {
  if (limit_bytes_ < 0) return num_virtual_pages_;
  return std::min(num_virtual_pages_, static_cast<size_t>(limit_bytes_) / bytes_per_page());
}

size_t PageAllocator::free_capacity_locked() const {
  size_t limit = limit_pages_locked();
  size_t headroom = mapped_ >= limit ? 0 : limit - mapped_;
  return std::min(free_in_target_, headroom);
}

int64_t PageAllocator::take_free_locked() {
  auto it = free_.begin();  // lowest id; ids past the target sort last
  int64_t id = *it;
  free_.erase(it);
  --free_in_target_;
  state_[id] = State::Busy;
  return id;
}

void PageAllocator::put_free_locked(int64_t id) {
  state_[id] = State::Free;
  free_.insert(id);
  if (static_cast<size_t>(id) < target_pages_) ++free_in_target_;
}

std::vector<int64_t> PageAllocator::offsets_of(const std::vector<int64_t>& ids) const {
  std::vector<int64_t> out;
  out.reserve(ids.size());
  for (int64_t id : ids) out.push_back(id * static_cast<int64_t>(opts_.page_size));
  return out;
}

std::vector<int64_t> PageAllocator::alloc_pages(size_t n) {
  if (n == 0) invalid("alloc_pages: n must be >= 1");
  std::unique_lock<std::mutex> lk(mu_);
  // A page the pre-map thread is mapping is counted as free (num_free_pages):
  // wait for it rather than report a shortage that is not there.
  while (n > reserved_.size() + free_capacity_locked() && premapping_ > 0) cv_.wait(lk);
  size_t from_reserve = std::min(n, reserved_.size());
  size_t fresh = n - from_reserve;
  if (fresh > free_capacity_locked()) {
    fail(ErrorKind::OutOfMemory, "no free KV page: asked for " + std::to_string(n) + ", " +
                                     std::to_string(reserved_.size() + free_capacity_locked()) +
                                     " can be mapped now (" + std::to_string(inuse_) + " in use, target " +
                                     std::to_string(target_pages_) + " pages, limit " +
                                     std::to_string(limit_pages_locked()) + ")");
  }
  std::vector<int64_t> ids;
  ids.reserve(n);
  for (size_t i = 0; i < from_reserve; ++i) {
    ids.push_back(reserved_.back());
    reserved_.pop_back();
    state_[ids.back()] = State::InUse;
  }
  inuse_ += from_reserve;
  publish_locked();
  if (fresh == 0) {
    if (prealloc_running_ && reserved_.size() < opts_.min_reserved) cv_.notify_all();
    return ids;
  }
  std::vector<int64_t> new_ids;
  new_ids.reserve(fresh);
  for (size_t i = 0; i < fresh; ++i) new_ids.push_back(take_free_locked());
  mapped_ += fresh;
  lk.unlock();
  int64_t t0 = mono_ns();
  try {
    mapper_->map(offsets_of(new_ids));
  } catch (const Error& e) {
    lk.lock();
    if (e.kind() != ErrorKind::Shutdown) count_map_locked(fresh, t0, false);
    for (int64_t id : new_ids) put_free_locked(id);
    mapped_ -= fresh;
    // Give the reserved pages back in their order.
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
      state_[*it] = State::Reserved;
      reserved_.push_back(*it);
    }
    inuse_ -= from_reserve;
    last_error_ = e.what();
    publish_quarantine_locked();
    throw;
  }
  lk.lock();
  count_map_locked(fresh, t0, true);
  for (int64_t id : new_ids) {
    state_[id] = State::InUse;
    ids.push_back(id);
  }
  inuse_ += fresh;
  publish_locked();
  if (prealloc_running_ && reserved_.size() < opts_.min_reserved) cv_.notify_all();
  return ids;
}

int64_t PageAllocator::alloc_page() { return alloc_pages(1)[0]; }

void PageAllocator::free_pages(const std::vector<int64_t>& ids) {
  std::unique_lock<std::mutex> lk(mu_);
  std::unordered_set<int64_t> seen;
  for (int64_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= num_virtual_pages_) {
      invalid("page id " + std::to_string(id) + " is out of range [0, " + std::to_string(num_virtual_pages_) + ")");
    }
    if (state_[id] != State::InUse) invalid("page " + std::to_string(id) + " is not in use (double free?)");
    if (!seen.insert(id).second) invalid("page " + std::to_string(id) + " appears twice in one free");
  }
  std::vector<int64_t> to_unmap;
  // A page the pre-map thread is mapping joins the reserve when done: count
  // it, or the reserve ends one past its maximum.
  size_t keep = opts_.max_reserved - std::min(opts_.max_reserved, premapping_);
  size_t limit = limit_pages_locked();
  for (int64_t id : ids) {
    --inuse_;
    bool in_target = static_cast<size_t>(id) < target_pages_;
    if (in_target && reserved_.size() < keep && mapped_ <= limit) {
      state_[id] = State::Reserved;
      reserved_.push_back(id);
    } else {
      state_[id] = State::Busy;
      to_unmap.push_back(id);
    }
  }
  publish_locked();
  if (!to_unmap.empty()) unmap_busy(std::move(to_unmap), lk);
}

void PageAllocator::free_page(int64_t id) { free_pages({id}); }

void PageAllocator::unmap_busy(std::vector<int64_t> ids, std::unique_lock<std::mutex>& lk) {
  lk.unlock();
  int64_t t0 = mono_ns();
  try {
    mapper_->unmap(offsets_of(ids));
  } catch (const Error& e) {
    lk.lock();
    last_error_ = e.what();
    bool lost = e.kind() == ErrorKind::StateConsistency;
    count_unmap_locked(ids.size(), t0, false, lost ? ids.size() : 0);
    if (lost) {
      for (int64_t id : ids) state_[id] = State::Quarantined;
      mapped_ -= ids.size();
      quarantined_ += ids.size();
      publish_quarantine_locked();
      throw;
    }
    // Rolled back: the pages are still mapped and unused. Within the target
    // they join the reserve (past its max); past it they must never be handed
    // out again, so they wait in stranded_ for the next trim or resize.
    for (int64_t id : ids) {
      state_[id] = State::Reserved;
      (static_cast<size_t>(id) < target_pages_ ? reserved_ : stranded_).push_back(id);
    }
    return;
  }
  lk.lock();
  count_unmap_locked(ids.size(), t0, true, 0);
  for (int64_t id : ids) put_free_locked(id);
  mapped_ -= ids.size();
  publish_locked();
  publish_quarantine_locked();
  cv_.notify_all();
}

size_t PageAllocator::trim() {
  std::unique_lock<std::mutex> lk(mu_);
  std::vector<int64_t> ids;
  ids.swap(reserved_);
  ids.insert(ids.end(), stranded_.begin(), stranded_.end());
  stranded_.clear();
  for (int64_t id : ids) state_[id] = State::Busy;
  size_t n = ids.size();
  if (n) unmap_busy(std::move(ids), lk);
  return n - std::min(n, reserved_.size() + stranded_.size());
}

bool PageAllocator::resize(size_t mem_size_per_layer) {
  size_t target = mem_size_per_layer / opts_.page_size;
  if (target > num_virtual_pages_) {
    invalid("resize to " + std::to_string(mem_size_per_layer) + " bytes per buffer exceeds the virtual capacity of " +
            std::to_string(num_virtual_pages_ * opts_.page_size) + " bytes");
  }
  std::unique_lock<std::mutex> lk(mu_);
  target_pages_ = target;
  free_in_target_ = static_cast<size_t>(std::distance(free_.begin(), free_.lower_bound(static_cast<int64_t>(target))));
  std::vector<int64_t> drop;
  std::vector<int64_t> keep;
  for (int64_t id : reserved_) (static_cast<size_t>(id) >= target ? drop : keep).push_back(id);
  for (int64_t id : stranded_) (static_cast<size_t>(id) >= target ? drop : keep).push_back(id);
  stranded_.clear();
  reserved_.swap(keep);
  for (int64_t id : drop) state_[id] = State::Busy;
  if (!drop.empty()) unmap_busy(std::move(drop), lk);
  cv_.notify_all();
  for (size_t id = target; id < num_virtual_pages_; ++id) {
    if (state_[id] == State::InUse || state_[id] == State::Busy) return false;
  }
  return true;
}

void PageAllocator::set_mem_limit(int64_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  limit_bytes_ = bytes;
  cv_.notify_all();
}

int64_t PageAllocator::mem_limit() const {
  std::lock_guard<std::mutex> g(mu_);
  return limit_bytes_;
}

void PageAllocator::set_reserve_bounds(size_t min_reserved, size_t max_reserved) {
  if (min_reserved > max_reserved) invalid("min_reserved must be <= max_reserved");
  std::lock_guard<std::mutex> g(mu_);
  opts_.min_reserved = min_reserved;
  opts_.max_reserved = max_reserved;
  cv_.notify_all();
}

void PageAllocator::attach_tracker(std::shared_ptr<MemInfoTracker> tracker) {
  std::lock_guard<std::mutex> g(mu_);
  tracker_ = std::move(tracker);
  if (tracker_) tracker_->set_total(static_cast<int64_t>(num_virtual_pages_ * bytes_per_page()));
  publish_locked();
  publish_quarantine_locked();
}

void PageAllocator::publish_locked() {
  if (!tracker_) return;
  int64_t bpp = static_cast<int64_t>(bytes_per_page());
  // "prealloc" counts every mapped page not handed out: reserve and in-flight maps.
  tracker_->publish_usage(static_cast<int64_t>(inuse_) * bpp, static_cast<int64_t>(mapped_ - inuse_) * bpp);
}

void PageAllocator::publish_quarantine_locked() {
  if (!tracker_) return;
  // Pages lost to a failed unmap, or the handles the mapper could not release
  // (the same memory may be counted by both: take the larger).
  int64_t pages = static_cast<int64_t>(quarantined_ * bytes_per_page());
  tracker_->set_quarantined(std::max(pages, mapper_->quarantined_bytes()));
}

void PageAllocator::count_map_locked(size_t pages, int64_t start_ns, bool ok) {
  if (!tracker_ || !tracker_->has_stats()) return;
  if (ok) {
    tracker_->add_counter(StatCounter::PagesMapped, pages);
    tracker_->observe(StatHist::MapLatency, mono_ns() - start_ns);
  } else {
    tracker_->add_counter(StatCounter::MapFailures, 1);
  }
}

void PageAllocator::count_unmap_locked(size_t pages, int64_t start_ns, bool ok, size_t quarantined) {
  if (!tracker_ || !tracker_->has_stats()) return;
  if (ok) {
    tracker_->add_counter(StatCounter::PagesUnmapped, pages);
    tracker_->observe(StatHist::UnmapLatency, mono_ns() - start_ns);
  } else {
    tracker_->add_counter(StatCounter::UnmapFailures, 1);
    tracker_->add_counter(StatCounter::PagesQuarantined, quarantined);
  }
}

void PageAllocator::start_prealloc_thread() {
  if (!opts_.allow_prealloc) invalid("this PageAllocator maps through Python callbacks and cannot pre-map in the background");
  std::lock_guard<std::mutex> g(mu_);
  if (prealloc_running_) return;
  stop_ = false;
  prealloc_running_ = true;
  prealloc_ = std::thread([this] { prealloc_loop(); });
}

void PageAllocator::stop_prealloc_thread() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!prealloc_running_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (prealloc_.joinable()) prealloc_.join();
  std::lock_guard<std::mutex> g(mu_);
  prealloc_running_ = false;
}

void PageAllocator::prealloc_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    bool wanted = reserved_.size() < opts_.min_reserved && free_capacity_locked() > 0;
    if (!wanted) {
      cv_.wait(lk);
      continue;
    }
    int64_t id = take_free_locked();
    ++mapped_;
    ++premapping_;
    lk.unlock();
    bool ok = true;
    int64_t t0 = mono_ns();
    try {
      mapper_->map(offsets_of({id}));
    } catch (const Error& e) {
      ok = false;
      lk.lock();
      // Tensors not created yet (Shutdown kind) is a wait, not a failure.
      if (e.kind() != ErrorKind::Shutdown) count_map_locked(1, t0, false);
      --premapping_;
      last_error_ = e.what();
      put_free_locked(id);
      --mapped_;
      publish_quarantine_locked();
      cv_.notify_all();  // an alloc waiting for this page decides again
      // Pressure or tensors not created yet: back off instead of spinning.
      cv_.wait_for(lk, std::chrono::milliseconds(100));
    }
    if (ok) {
      lk.lock();
      count_map_locked(1, t0, true);
      --premapping_;
      state_[id] = State::Reserved;
      reserved_.push_back(id);
      publish_locked();
      cv_.notify_all();
    }
  }
}

size_t PageAllocator::num_total_pages() const {
  std::lock_guard<std::mutex> g(mu_);
  return target_pages_;
}
size_t PageAllocator::num_free_pages() const {
  std::lock_guard<std::mutex> g(mu_);
  return reserved_.size() + premapping_ + free_capacity_locked();
}
size_t PageAllocator::num_inuse_pages() const {
  std::lock_guard<std::mutex> g(mu_);
  return inuse_;
}
size_t PageAllocator::num_reserved_pages() const {
  std::lock_guard<std::mutex> g(mu_);
  return reserved_.size() + stranded_.size();
}
bool PageAllocator::is_reserved(int64_t id) const {
  std::lock_guard<std::mutex> g(mu_);
  return id >= 0 && static_cast<size_t>(id) < num_virtual_pages_ && state_[id] == State::Reserved;
}
size_t PageAllocator::num_mapped_pages() const {
  std::lock_guard<std::mutex> g(mu_);
  return mapped_;
}
size_t PageAllocator::num_quarantined_pages() const {
  std::lock_guard<std::mutex> g(mu_);
  return quarantined_;
}
std::string PageAllocator::last_error() const {
  std::lock_guard<std::mutex> g(mu_);
  return last_error_;
}

int64_t PageAllocator::get_page_id(int64_t block_id, int64_t block_mem_size) const {
  if (block_id < 0 || block_mem_size <= 0) invalid("get_page_id: block_id must be >= 0 and block_mem_size > 0");
  return block_id * block_mem_size / static_cast<int64_t>(opts_.page_size);
}

}  // namespace kvcached
