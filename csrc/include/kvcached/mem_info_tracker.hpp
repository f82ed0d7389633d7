// MemInfoTracker: the per-instance shared-memory record in /dev/shm that
// kvctl/kvtop read and write. Layout is versioned; fields are updated with
// atomics so a reader never sees a torn value.
//
//  - Created 0600 by the owner (O_EXCL); other users cannot open it.
//  - Limit writers serialize through flock() on the record (the kernel drops
//    the lock if a writer dies), bump `seq` around the write (seqlock for
//    readers) and wake waiters with a futex on `revision`.
//  - The owner publishes used/prealloc bytes; a watcher waits on the futex,
//    so a limit change is seen at once without polling.
//  - The owner also publishes `granted` (bytes of the device budget it holds,
//    0 when it takes part in no budget), `device_bytes` (usable bytes of its
//    device, 0 if unknown) and `applied_revision` (the last limit revision its
//    PageAllocator enforces). wake() wakes the owner's watcher without a
//    limit change (a peer asking it to give back unused budget).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace kvcached {

constexpr uint64_t kMemInfoMagic = 0x3144484341435f4bULL;  // "K_CACHD1"
constexpr uint32_t kMemInfoVersion = 1;

struct MemInfoRecord {
  uint64_t magic;
  uint32_t version;
  uint32_t record_size;
  int32_t device_type;  // 0 host, 1 cuda, 2 hip
  int32_t device_index;
  int32_t owner_pid;
  int32_t reserved0;
  uint64_t owner_start_time;  // /proc/<pid>/stat starttime: tells pid reuse apart
  std::atomic<uint32_t> seq;       // seqlock over limit/revision (odd: write in progress)
  std::atomic<uint32_t> revision;  // futex word, bumped on every limit change
  std::atomic<int64_t> limit;      // bytes the instance may map (all layers)
  std::atomic<int64_t> used;       // bytes of in-use pages
  std::atomic<int64_t> prealloc;   // bytes mapped but unused (reserve pool)
  std::atomic<int64_t> total;      // virtual capacity in bytes
  std::atomic<int64_t> updated_ns; // CLOCK_REALTIME of the last owner update
  char name[128];
  char engine[32];
  // Carved from the former 64 reserved bytes: the record size is unchanged.
  std::atomic<int64_t> granted;            // device-budget bytes held by the owner
  std::atomic<int64_t> device_bytes;       // usable bytes of the device (0: unknown)
  std::atomic<uint32_t> applied_revision;  // last revision the owner enforces
  uint32_t reserved2;
  // A live owner that the device budget (not its own limit) keeps from
  // mapping what its load needs publishes the bytes it lacks and when; idle
  // peers read it and give their cached pages back. 0 bytes: nothing wanted.
  std::atomic<int64_t> wanted;
  std::atomic<int64_t> wanted_ns;  // CLOCK_REALTIME of the last set_wanted
  char reserved1[24];
};
static_assert(sizeof(MemInfoRecord) == 312, "the shared record layout must not change size");

struct MemInfoSnapshot {
  std::string name;
  std::string engine;
  int device_type = 0;
  int device_index = 0;
  int owner_pid = 0;
  uint64_t owner_start_time = 0;
  bool owner_alive = false;
  uint32_t revision = 0;
  int64_t limit = 0;
  int64_t used = 0;
  int64_t prealloc = 0;
  int64_t total = 0;
  int64_t updated_ns = 0;
  int64_t granted = 0;
  int64_t device_bytes = 0;
  uint32_t applied_revision = 0;
  int64_t wanted = 0;
  int64_t wanted_ns = 0;
};

class MemInfoTracker {
 public:
  // Creates the record (owner). A record of the same name whose owner is dead
  // is reclaimed; one with a live owner is refused.
  static MemInfoTracker create(const std::string& name, const std::string& engine, int device_type,
                               int device_index, int64_t total, int64_t limit);
  // Opens an existing record for reading/updating (kvctl).
  static MemInfoTracker open(const std::string& name);

  MemInfoTracker(MemInfoTracker&& o) noexcept;
  MemInfoTracker& operator=(MemInfoTracker&&) = delete;
  ~MemInfoTracker();

  const std::string& name() const { return name_; }
  MemInfoSnapshot snapshot() const;
  void publish_usage(int64_t used, int64_t prealloc);
  void set_total(int64_t total);
  // Sets the limit; returns the new revision. If expected_revision >= 0 and
  // differs from the current one, nothing changes and -1 is returned.
  int64_t set_limit(int64_t limit, int64_t expected_revision);
  // Blocks until revision != seen, timeout_ms passes or wake() is called;
  // returns the revision.
  uint32_t wait_for_change(uint32_t seen, int timeout_ms) const;
  // Wakes every wait_for_change on this record without changing it.
  void wake() const;
  // Owner-side fields (see the record comment).
  void set_granted(int64_t bytes);
  void set_device_bytes(int64_t bytes);
  void ack_revision(uint32_t revision);
  // Publishes the bytes the owner lacks now (0: none) with the time.
  void set_wanted(int64_t bytes);
  // Removes the name from /dev/shm (open mappings stay valid).
  void unlink();

 private:
  MemInfoTracker(std::string name, int fd, MemInfoRecord* rec);
  std::string name_;
  int fd_ = -1;
  MemInfoRecord* rec_ = nullptr;
};

// Names of kvcached records in /dev/shm readable by this user.
std::vector<std::string> list_mem_info_records();
// Alive: the pid exists with this start time (0: any) and has not exited
// (an exited, unreaped zombie holds no memory and counts as dead).
bool process_alive(int pid, uint64_t start_time);
uint64_t process_start_time(int pid);
// Removes a record; refuses (InvalidArgument) while its owner lives unless force.
void delete_mem_info_record(const std::string& name, bool force);

}  // namespace kvcached
