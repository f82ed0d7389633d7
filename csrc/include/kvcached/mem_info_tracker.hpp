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
//  - Version 2 appends a statistics block (MemInfoStats) to the 312-byte
//    version-1 record: counters and fixed-bucket histograms that every
//    process holding the record adds to with atomic adds (pages mapped and
//    unmapped, failures, refusals, give-backs, latencies), so one read sees
//    one number per instance whichever processes did the work. A version-1
//    record (an older kvcached) is still read and written; it has no
//    statistics. A block that fails its checks is reported in
//    `stats_problem` (the record itself stays valid: its limit and usage are
//    checked on their own) and nothing is added to it.
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
constexpr uint32_t kMemInfoVersion = 2;    // what create() writes
constexpr uint32_t kMemInfoVersionV1 = 1;  // an older kvcached's record: read and written, no statistics

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
static_assert(sizeof(MemInfoRecord) == 312, "the version-1 record layout must not change size");

// The statistics of a version-2 record, right after the version-1 fields.
// Slots beyond the named ones are reserved (zero): a later block version may
// name them without moving anything.
constexpr uint64_t kMemStatsMagic = 0x3153544154535f4bULL;  // "K_STATS1"
constexpr uint32_t kMemStatsVersion = 1;
constexpr int kStatCounterSlots = 16;
constexpr int kStatHistSlots = 4;
constexpr int kStatBuckets = 16;  // finite upper bounds; one more bucket counts the rest (+Inf)

enum class StatCounter : int {
  PagesMapped = 0,   // pages mapped (all layers and K/V of a page count once)
  PagesUnmapped,     // pages unmapped
  MapFailures,       // map calls that failed (rolled back)
  UnmapFailures,     // unmap calls that failed (rolled back, or quarantined)
  RefusedLimit,      // requests not placed: the instance's own limit stopped them
  RefusedBudget,     // requests not placed: the device budget stopped them
  GiveBacks,         // idle give-backs (a peer wanted memory, or a lowered limit)
  GivenBackBytes,    // bytes those give-backs unmapped
  PagesQuarantined,  // pages lost to an unmap whose rollback failed
  Count
};
enum class StatHist : int {
  MapLatency = 0,  // one map call (a batch of pages), success only
  UnmapLatency,    // one unmap call, success only
  WantServed,      // a want published until it was withdrawn (the load got its memory)
  Count
};
static_assert(static_cast<int>(StatCounter::Count) <= kStatCounterSlots, "counter slots");
static_assert(static_cast<int>(StatHist::Count) <= kStatHistSlots, "histogram slots");

struct MemInfoStats {
  uint64_t magic;
  uint32_t version;
  uint32_t size;  // sizeof(MemInfoStats)
  uint32_t counter_slots;
  uint32_t hist_slots;
  uint32_t buckets;
  uint32_t reserved0;
  // CLOCK_REALTIME when the current want began (0: none); the owner's set_wanted keeps it.
  std::atomic<int64_t> want_since_ns;
  std::atomic<uint64_t> counters[kStatCounterSlots];
  struct Hist {
    std::atomic<uint64_t> bucket[kStatBuckets + 1];  // per bucket, not cumulative
    std::atomic<uint64_t> sum_ns;
  } hist[kStatHistSlots];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters need lock-free 64-bit atomics");
constexpr size_t kMemInfoV2Size = sizeof(MemInfoRecord) + sizeof(MemInfoStats);
// One page: the SIGBUS guard covers the first page of a mapping.
static_assert(kMemInfoV2Size <= 4096, "a version-2 record must fit one page");

// Names (the collector's metric stems) and upper bounds (ns) of the buckets.
const char* stat_counter_name(StatCounter c);
const char* stat_hist_name(StatHist h);
const int64_t* stat_hist_bounds_ns(StatHist h);  // kStatBuckets ascending bounds
// A counter, bucket or sum above this is corruption (2^62: centuries of events).
constexpr uint64_t kMaxStatCount = uint64_t(1) << 62;

struct MemInfoSnapshot {
  std::string name;
  std::string engine;
  int device_type = 0;
  int device_index = 0;
  int owner_pid = 0;
  uint64_t owner_start_time = 0;
  bool owner_alive = false;   // the owner lock is held, or owner_pid/start time name a live process
  bool owner_locked = false;  // the owner's liveness lock is held (true in the owner itself)
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
  uint32_t record_version = 0;
  // Statistics (version 2): valid only when has_stats; stats_problem says
  // why a version-2 block is not trusted (empty for version 1: no block).
  bool has_stats = false;
  std::string stats_problem;
  int64_t want_since_ns = 0;
  std::vector<int64_t> counters;                  // StatCounter::Count entries
  std::vector<std::vector<int64_t>> hist_buckets;  // per histogram: kStatBuckets + 1, not cumulative
  std::vector<int64_t> hist_sum_ns;
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
  // Statistics (version 2; no-ops on a version-1 record). Atomic adds to the
  // shared block: any process holding the record may call them, and callers
  // add in batches (one call per map/unmap call, not per page).
  bool has_stats() const { return stats_ != nullptr; }
  void add_counter(StatCounter c, uint64_t n);
  void observe(StatHist h, int64_t ns);
  // Removes the name from /dev/shm (open mappings stay valid).
  void unlink();

 private:
  MemInfoTracker(std::string name, int fd, MemInfoRecord* rec, size_t size, int guard, bool owner);
  // Waits (bounded) for an even seq, repairing a write a dead writer left
  // half done; returns the even seq, or an odd one if still busy.
  uint32_t settled_seq(bool may_repair) const;
  bool detached() const;
  void read_stats(MemInfoSnapshot& s) const;
  std::string name_;
  int fd_ = -1;
  MemInfoRecord* rec_ = nullptr;
  size_t size_ = 0;                // bytes mapped: the record's size for its version
  MemInfoStats* stats_ = nullptr;  // the block of a version-2 record whose header checks passed
  int guard_ = -1;      // SIGBUS guard slot of the mapping (-1: none)
  bool owner_ = false;  // made by create(): the file must stay ours
  // The owner's liveness lock lives on its own open file description, never
  // mapped: a mapping (inherited by fork, too) would keep the description,
  // and the lock, alive after the owner's death.
  int lock_fd_ = -1;
};

// Names of files in /dev/shm that start with the record magic and are
// readable by this user (a name kvcached could not have made is skipped).
std::vector<std::string> list_mem_info_records();
// Whether a live process holds the owner lock of /dev/shm/<name>, whatever the
// file now contains (a truncated record's owner still holds it).
bool record_owner_locked(const std::string& name);
// Alive: the pid exists with this start time (0: any) and has not exited
// (an exited, unreaped zombie holds no memory and counts as dead).
bool process_alive(int pid, uint64_t start_time);
uint64_t process_start_time(int pid);
// Removes a record; refuses (InvalidArgument) while its owner lives unless
// force, another user's record, and a file that is not a record. Throws
// unless the name is really gone (or now names another file: a new owner).
void delete_mem_info_record(const std::string& name, bool force);

}  // namespace kvcached
