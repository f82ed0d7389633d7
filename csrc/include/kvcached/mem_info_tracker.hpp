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
//
// Nothing read from a record is trusted before it is checked (docs/SECURITY.md):
//  - snapshot() validates the file (regular, the record's size, owner uid,
//    not writable by others) and every field (magic, version, ranges, a name
//    of printable ASCII equal to the file name) and reports the first failed
//    check in `problem` instead of throwing; names come back escaped.
//  - A reader waits a bounded time for an odd `seq` (a write in progress).
//    After that it takes the record's lock without waiting: if it gets it,
//    the writer died between its two `seq` updates and the reader completes
//    the write (bumps the revision, so the owner re-reads the limit); if not,
//    the snapshot is marked `busy`.
//  - A record truncated while mapped would raise SIGBUS at the next access; a
//    SIGBUS handler replaces the vanished page by an anonymous one and marks
//    the handle detached (its snapshot says so) instead of killing the process.
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
  // Bumped by every wake(): a watcher tells a peer's request from a spurious
  // or signal-interrupted futex return. Was reserved (zero).
  std::atomic<uint32_t> wakes;
  // A live owner that the device budget (not its own limit) keeps from
  // mapping what its load needs publishes the bytes it lacks and when; idle
  // peers read it and give their cached pages back. 0 bytes: nothing wanted.
  std::atomic<int64_t> wanted;
  std::atomic<int64_t> wanted_ns;  // CLOCK_REALTIME of the last set_wanted
  // Bytes of the instance's memory that could not be released (a failed
  // driver call): allocated until the owner exits. Carved from reserved1.
  std::atomic<int64_t> quarantined;
  char reserved1[16];
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
  int64_t quarantined = 0;
  int64_t owner_uid = -1;  // uid owning the file
  std::string problem;     // why the record cannot be trusted; empty: valid
  bool busy = false;       // a limit write did not finish within the readers' bound
};

// Field bounds a valid record keeps (anything beyond is corruption).
constexpr int64_t kMaxRecordBytes = int64_t(1) << 60;
constexpr int kMaxPid = 1 << 22;  // PID_MAX_LIMIT on 64-bit Linux
// How long a reader waits for an odd seqlock word before it tries the repair.
constexpr int64_t kSeqWaitNs = 50 * 1000 * 1000;
// How long a limit writer waits for the record's lock.
constexpr int64_t kWriteLockWaitNs = int64_t(2) * 1000 * 1000 * 1000;

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
  // Never throws for bad contents: see `problem` and `busy`.
  MemInfoSnapshot snapshot() const;
  void publish_usage(int64_t used, int64_t prealloc);
  void set_total(int64_t total);
  // Sets the limit; returns the new revision. If expected_revision >= 0 and
  // differs from the current one, nothing changes and -1 is returned.
  // Refuses (InvalidArgument) an invalid record, a limit outside
  // [0, kMaxRecordBytes] and an expected revision outside [-1, 2^32); a lock
  // held by another writer for kWriteLockWaitNs is a Backend error.
  int64_t set_limit(int64_t limit, int64_t expected_revision);
  // Blocks until revision != seen, timeout_ms passes or wake() is called;
  // returns the revision.
  uint32_t wait_for_change(uint32_t seen, int timeout_ms) const;
  // Wakes every wait_for_change on this record without changing the limit
  // (it bumps wake_count()).
  void wake() const;
  uint32_t wake_count() const;
  // Owner-side fields (see the record comment).
  void set_granted(int64_t bytes);
  void set_device_bytes(int64_t bytes);
  void ack_revision(uint32_t revision);
  // Publishes the bytes the owner lacks now (0: none) with the time.
  void set_wanted(int64_t bytes);
  void set_quarantined(int64_t bytes);
  // Removes the name from /dev/shm (open mappings stay valid).
  void unlink();

 private:
  MemInfoTracker(std::string name, int fd, MemInfoRecord* rec, int guard, bool owner);
  // Waits (bounded) for an even seq, repairing a write a dead writer left
  // half done; returns the even seq, or an odd one if still busy.
  uint32_t settled_seq(bool may_repair) const;
  bool detached() const;
  std::string name_;
  int fd_ = -1;
  MemInfoRecord* rec_ = nullptr;
  int guard_ = -1;      // SIGBUS guard slot of the mapping (-1: none)
  bool owner_ = false;  // made by create(): the file must stay ours
};

// Names of files in /dev/shm that start with the record magic and are
// readable by this user (a name kvcached could not have made is skipped).
std::vector<std::string> list_mem_info_records();
// Alive: the pid exists with this start time (0: any) and has not exited
// (an exited, unreaped zombie holds no memory and counts as dead).
bool process_alive(int pid, uint64_t start_time);
uint64_t process_start_time(int pid);
// Removes a record; refuses (InvalidArgument) while its owner lives unless
// force, another user's record, and a file that is not a record. Throws
// unless the name is really gone (or now names another file: a new owner).
void delete_mem_info_record(const std::string& name, bool force);

}  // namespace kvcached
