#include "kvcached/mem_info_tracker.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <pthread.h>
#include <vector>

#include "kvcached/errors.hpp"
#include "kvcached/mapping_guard.hpp"

namespace kvcached {

namespace {

constexpr const char* kShmDir = "/dev/shm/";

// A name kvcached makes (kvcached.naming rule 2): 1-127 printable ASCII
// characters, no '/' or whitespace, not "." or "..".
bool valid_name(const char* s, size_t n) {
  if (n == 0 || n >= sizeof(MemInfoRecord::name)) return false;
  if ((n == 1 && s[0] == '.') || (n == 2 && s[0] == '.' && s[1] == '.')) return false;
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c <= 0x20 || c >= 0x7f || c == '/') return false;
  }
  return true;
}

std::string shm_path(const std::string& name) {
  if (!valid_name(name.data(), name.size())) {
    invalid("record name '" + name + "' is invalid; use 1-127 printable ASCII characters without '/' or spaces");
  }
  return kShmDir + name;
}

// Text of a record field for messages and snapshots: printable ASCII kept,
// everything else as \xNN, so no byte of it can reach a terminal raw.
std::string escaped(const char* s, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

int64_t clock_ns(clockid_t clk) {
  timespec ts;
  clock_gettime(clk, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

int64_t now_ns() { return clock_ns(CLOCK_REALTIME); }

// Opens a file of /dev/shm without following a link or blocking on a FIFO.
int open_shm(const std::string& name, int flags, mode_t mode = 0) {
  return ::open(shm_path(name).c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode);
}

MemInfoRecord* map_record(int fd, const std::string& name, size_t size, int* guard) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd);
    fail(ErrorKind::Backend, "cannot map record '" + name + "': " + std::strerror(e));
  }
  *guard = mapping_guard::add(p);
  return static_cast<MemInfoRecord*>(p);
}

void copy_name(char* dst, size_t cap, const std::string& s) {
  std::memset(dst, 0, cap);
  std::memcpy(dst, s.data(), std::min(cap - 1, s.size()));
}

// flock() without an unbounded wait: polls LOCK_NB until `wait_ns` passed.
bool lock_within(int fd, int64_t wait_ns) {
  int64_t start = clock_ns(CLOCK_MONOTONIC);
  long sleep_ns = 20000;
  for (;;) {
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) return true;
    if (errno != EWOULDBLOCK && errno != EINTR) return false;
    if (clock_ns(CLOCK_MONOTONIC) - start >= wait_ns) return false;
    timespec ts{0, sleep_ns};
    nanosleep(&ts, nullptr);
    sleep_ns = std::min(sleep_ns * 2, 2000000L);
  }
}

struct FileLock {
  FileLock(int fd, int64_t wait_ns) : fd_(fd), held_(lock_within(fd, wait_ns)) {}
  ~FileLock() {
    if (held_) flock(fd_, LOCK_UN);
  }
  int fd_;
  bool held_;
};

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// A writer that died between its two seq updates left seq odd. Under the
// record's lock no writer is running, so the write is completed here: the
// revision moves on (the owner re-reads the limit; a compare-and-set against
// the old revision fails) and seq becomes even. Caller holds the lock.
void finish_dead_write_locked(MemInfoRecord* r) {
  uint32_t seq = r->seq.load(std::memory_order_acquire);
  if (!(seq & 1u)) return;
  r->revision.fetch_add(1, std::memory_order_acq_rel);
  r->seq.store(seq + 1, std::memory_order_release);
  futex_wake_all(&r->revision);
}

bool in_range(int64_t v) { return v >= 0 && v <= kMaxRecordBytes; }

// Upper bounds of the histogram buckets, ns. Map/unmap: a host page maps in
// ~10 us, a 2 MiB GPU page in ~30-45 us, a TP fan-out of a batch in ms.
// Wants: served within a scheduling step (ms) to minutes.
constexpr int64_t kUs = 1000, kMs = 1000 * kUs, kS = 1000 * kMs;
constexpr int64_t kLatencyBounds[kStatBuckets] = {
    5 * kUs,  10 * kUs,  25 * kUs,  50 * kUs,  100 * kUs, 250 * kUs, 500 * kUs, 1 * kMs,
    2 * kMs + 500 * kUs, 5 * kMs, 10 * kMs, 25 * kMs, 50 * kMs, 100 * kMs, 250 * kMs, 1 * kS,
};
constexpr int64_t kWantBounds[kStatBuckets] = {
    10 * kMs, 25 * kMs, 50 * kMs, 100 * kMs, 250 * kMs, 500 * kMs, 1 * kS,   2 * kS,
    5 * kS,   10 * kS,  20 * kS,  30 * kS,   60 * kS,   120 * kS,  300 * kS, 600 * kS,
};

// The statistics block of a version-2 record whose header checks pass; null otherwise.
MemInfoStats* stats_block(MemInfoRecord* r, size_t size) {
  if (size != kMemInfoV2Size) return nullptr;
  auto* st = reinterpret_cast<MemInfoStats*>(reinterpret_cast<char*>(r) + sizeof(MemInfoRecord));
  if (st->magic != kMemStatsMagic || st->version != kMemStatsVersion || st->size != sizeof(MemInfoStats) ||
      st->counter_slots != kStatCounterSlots || st->hist_slots != kStatHistSlots || st->buckets != kStatBuckets) {
    return nullptr;
  }
  return st;
}

// Why a version-2 statistics block is not trusted ("" when it is).
std::string stats_header_problem(const MemInfoStats* st) {
  if (st->magic != kMemStatsMagic) return "its statistics block has a wrong magic";
  if (st->version != kMemStatsVersion) {
    return "its statistics block is of version " + std::to_string(st->version) + ", this kvcached reads version " +
           std::to_string(kMemStatsVersion);
  }
  if (st->size != sizeof(MemInfoStats) || st->counter_slots != kStatCounterSlots || st->hist_slots != kStatHistSlots ||
      st->buckets != kStatBuckets) {
    return "its statistics block has a wrong layout (size/slot fields)";
  }
  return "";
}

// The record size a header claims, if its version is one this build reads; 0 otherwise.
size_t size_of_version(uint32_t version) {
  if (version == kMemInfoVersionV1) return sizeof(MemInfoRecord);
  if (version == kMemInfoVersion) return kMemInfoV2Size;
  return 0;
}

}  // namespace

namespace {

// Reads /proc/<pid>/<file> into buf (NUL-terminated); false if unreadable.
bool read_proc(int pid, const char* file, char* buf, size_t size) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/%s", pid, file);
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = read(fd, buf, size - 1);
  close(fd);
  if (n <= 0) return false;
  buf[n] = 0;
  return true;
}

// The state letter (field #3 of /proc/<pid>/stat) and start time (#22); 0 if gone.
uint64_t stat_of(int pid, char* state) {
  char buf[1024];
  if (!read_proc(pid, "stat", buf, sizeof(buf))) return 0;
  char* p = std::strrchr(buf, ')');  // comm may contain spaces and ')'
  if (!p || !p[1] || !p[2]) return 0;
  p += 2;
  if (state) *state = *p;
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (!p) return 0;
    ++p;
  }
  return std::strtoull(p, nullptr, 10);
}

// An exited process not yet reaped: its memory (and GPU context) is gone.
// A zombie thread-group leader whose other threads still run is alive.
bool exited_unreaped(int pid, char state) {
  if (state != 'Z' && state != 'X') return false;
  char buf[4096];
  if (!read_proc(pid, "status", buf, sizeof(buf))) return true;
  const char* t = std::strstr(buf, "\nThreads:");
  return !t || std::strtol(t + 9, nullptr, 10) <= 1;
}

// The owner's liveness lock: an OFD lock on one byte past any record's end,
// taken by create() and held while the owner's lock descriptor is open. Unlike
// owner_pid/start time it survives a truncated or scribbled record, and it
// dies with the owner (issue 34, item 9: a damaged live record fails closed).
constexpr off_t kOwnerLockStart = off_t(1) << 30;

struct flock owner_lock_range(short type) {
  struct flock fl;
  std::memset(&fl, 0, sizeof(fl));
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = kOwnerLockStart;
  fl.l_len = 1;
  return fl;
}

void register_owner_fd(int fd);

// A second description of fd's file holding the owner lock (-1: none could be
// had, e.g. a kernel without OFD locks: liveness then rests on the pid alone).
int take_owner_lock(int fd) {
  char self[64];
  std::snprintf(self, sizeof(self), "/proc/self/fd/%d", fd);
  int lfd = ::open(self, O_RDONLY | O_CLOEXEC);
  if (lfd < 0) return -1;
  struct flock fl = owner_lock_range(F_WRLCK);
  // F_WRLCK on a read-only description is refused; F_RDLCK conflicts with the
  // readers' F_WRLCK probe all the same.
  fl.l_type = F_RDLCK;
  if (fcntl(lfd, F_OFD_SETLK, &fl) != 0) {
    close(lfd);
    return -1;
  }
  register_owner_fd(lfd);
  return lfd;
}

// Whether another open file description holds the owner lock of fd's file.
bool owner_lock_held(int fd) {
  struct flock fl = owner_lock_range(F_WRLCK);
  return fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
}

// A forked child shares the owner's open file description, and with it the
// lock: it would outlive a killed owner in the child. So the child swaps each
// owner descriptor for a fresh one of the same file (same fd number, no lock).
std::mutex g_owner_mu;
std::vector<int> g_owner_fds;

void owner_fork_prepare() { g_owner_mu.lock(); }
void owner_fork_parent() { g_owner_mu.unlock(); }
void owner_fork_child() {
  for (int fd : g_owner_fds) {
    char self[64];
    std::snprintf(self, sizeof(self), "/proc/self/fd/%d", fd);
    int fresh = ::open(self, O_RDONLY | O_CLOEXEC);
    if (fresh >= 0) {
      dup3(fresh, fd, O_CLOEXEC);
      close(fresh);
    }
  }
  g_owner_mu.unlock();
}

void register_owner_fd(int fd) {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(owner_fork_prepare, owner_fork_parent, owner_fork_child); });
  std::lock_guard<std::mutex> g(g_owner_mu);
  g_owner_fds.push_back(fd);
}

void unregister_owner_fd(int fd) {
  std::lock_guard<std::mutex> g(g_owner_mu);
  for (auto it = g_owner_fds.begin(); it != g_owner_fds.end(); ++it) {
    if (*it == fd) {
      g_owner_fds.erase(it);
      return;
    }
  }
}

}  // namespace

uint64_t process_start_time(int pid) { return stat_of(pid, nullptr); }

bool process_alive(int pid, uint64_t start_time) {
  if (pid <= 0 || pid > kMaxPid) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char state = 0;
  uint64_t st = stat_of(pid, &state);
  if (st == 0 || (start_time != 0 && st != start_time)) return false;
  return !exited_unreaped(pid, state);
}

MemInfoTracker::MemInfoTracker(std::string name, int fd, MemInfoRecord* rec, size_t size, int guard, bool owner)
    : name_(std::move(name)), fd_(fd), rec_(rec), size_(size), stats_(stats_block(rec, size)), guard_(guard),
      owner_(owner) {}

MemInfoTracker::MemInfoTracker(MemInfoTracker&& o) noexcept
    : name_(std::move(o.name_)),
      fd_(o.fd_),
      rec_(o.rec_),
      size_(o.size_),
      stats_(o.stats_),
      guard_(o.guard_),
      owner_(o.owner_),
      lock_fd_(o.lock_fd_) {
  o.lock_fd_ = -1;
  o.fd_ = -1;
  o.rec_ = nullptr;
  o.stats_ = nullptr;
  o.guard_ = -1;
}

MemInfoTracker::~MemInfoTracker() {
  mapping_guard::remove(guard_);
  if (rec_) munmap(rec_, size_);
  if (fd_ >= 0) close(fd_);
  if (lock_fd_ >= 0) {
    unregister_owner_fd(lock_fd_);
    close(lock_fd_);  // the owner lock goes with it
  }
}

bool MemInfoTracker::detached() const { return mapping_guard::lost(guard_); }

namespace {

// What to do with an existing file where create() wants a record: refuse a
// live owner's record or another user's file; remove anything else of ours
// (a dead owner's record, or the remains of a create() killed half way).
void reclaim_or_refuse(const std::string& name) {
  std::string path = shm_path(name);
  struct stat lst;
  if (lstat(path.c_str(), &lst) != 0) return;  // gone meanwhile: create again
  uid_t euid = geteuid();
  bool foreign = lst.st_uid != euid;
  if (foreign && euid != 0) {
    invalid("record name '" + name + "' is taken by uid " + std::to_string(lst.st_uid) + " (another user's /dev/shm/" +
            name + "); choose another KVCACHED_IPC_NAME, or ask that user or root to remove it");
  }
  if (S_ISDIR(lst.st_mode)) invalid("/dev/shm/" + name + " is a directory; remove it or choose another KVCACHED_IPC_NAME");
  bool record = false;
  if (S_ISREG(lst.st_mode)) {
    int fd = open_shm(name, O_RDONLY);
    if (fd >= 0) {
      alignas(8) char buf[sizeof(MemInfoRecord)] = {};
      struct stat st;
      bool same = fstat(fd, &st) == 0 && st.st_ino == lst.st_ino && st.st_dev == lst.st_dev;
      ssize_t n = same ? pread(fd, buf, sizeof(buf), 0) : -1;
      bool locked = same && owner_lock_held(fd);
      close(fd);
      if (!same) return;  // replaced meanwhile: create again
      uint64_t magic = 0;
      int32_t pid = 0;
      uint64_t start = 0;
      if (n == static_cast<ssize_t>(sizeof(buf))) {
        std::memcpy(&magic, buf + offsetof(MemInfoRecord, magic), sizeof(magic));
        std::memcpy(&pid, buf + offsetof(MemInfoRecord, owner_pid), sizeof(pid));
        std::memcpy(&start, buf + offsetof(MemInfoRecord, owner_start_time), sizeof(start));
      }
      record = magic == kMemInfoMagic;
      if (record && process_alive(pid, start)) {
        invalid("record '" + name + "' belongs to live process " + std::to_string(pid) +
                "; choose another KVCACHED_IPC_NAME or stop that instance");
      }
      if (locked) {
        invalid("record '" + name + "' is held by a live process (its owner lock is taken, though the record is "
                "damaged); choose another KVCACHED_IPC_NAME or stop that instance");
      }
    } else if (errno != ENOENT) {
      record = false;
    }
  }
  if (foreign && !record) {
    invalid("record name '" + name + "' is taken by uid " + std::to_string(lst.st_uid) + " and is not a record; remove /dev/shm/" +
            name + " or choose another KVCACHED_IPC_NAME");
  }
  struct stat now;
  if (lstat(path.c_str(), &now) == 0 && now.st_ino == lst.st_ino && now.st_dev == lst.st_dev) ::unlink(path.c_str());
}

}  // namespace

MemInfoTracker MemInfoTracker::create(const std::string& name, const std::string& engine, int device_type,
                                      int device_index, int64_t total, int64_t limit) {
  std::string path = shm_path(name);
  if (engine.size() >= sizeof(MemInfoRecord::engine) || !(engine.empty() || valid_name(engine.data(), engine.size()))) {
    invalid("engine tag '" + escaped(engine.data(), engine.size()) + "' must be 0-31 printable ASCII characters");
  }
  if (device_type < 0 || device_type > 2 || device_index < 0 || device_index > 0xffff) {
    invalid("device type/index " + std::to_string(device_type) + "/" + std::to_string(device_index) + " is out of range");
  }
  if (!in_range(total) || !in_range(limit)) {
    invalid("total and limit must be >= 0 and at most 2^60 bytes, got " + std::to_string(total) + " and " + std::to_string(limit));
  }
  int fd = -1;
  for (int attempt = 0; attempt < 3 && fd < 0; ++attempt) {
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0 || errno != EEXIST) break;
    reclaim_or_refuse(name);
  }
  if (fd < 0) fail(ErrorKind::Backend, "cannot create record '" + name + "': " + std::strerror(errno));
  fchmod(fd, 0600);  // whatever the umask
  if (ftruncate(fd, kMemInfoV2Size) != 0) {
    int e = errno;
    close(fd);
    ::unlink(path.c_str());
    fail(ErrorKind::Backend, "cannot size record '" + name + "': " + std::strerror(e));
  }
  int guard = -1;
  MemInfoRecord* r = map_record(fd, name, kMemInfoV2Size, &guard);
  r->version = kMemInfoVersion;
  r->record_size = kMemInfoV2Size;
  // The statistics block: zeros from ftruncate, then its header.
  auto* st = reinterpret_cast<MemInfoStats*>(reinterpret_cast<char*>(r) + sizeof(MemInfoRecord));
  st->magic = kMemStatsMagic;
  st->version = kMemStatsVersion;
  st->size = sizeof(MemInfoStats);
  st->counter_slots = kStatCounterSlots;
  st->hist_slots = kStatHistSlots;
  st->buckets = kStatBuckets;
  r->device_type = device_type;
  r->device_index = device_index;
  r->owner_pid = getpid();
  r->owner_start_time = process_start_time(getpid());
  r->seq.store(0);
  r->revision.store(1);
  r->limit.store(limit);
  r->used.store(0);
  r->prealloc.store(0);
  r->total.store(total);
  r->updated_ns.store(now_ns());
  r->granted.store(0);
  r->device_bytes.store(0);
  r->applied_revision.store(0);
  r->wakes.store(0);
  r->wanted.store(0);
  r->wanted_ns.store(0);
  r->quarantined.store(0);
  copy_name(r->name, sizeof(r->name), name);
  copy_name(r->engine, sizeof(r->engine), engine);
  std::atomic_thread_fence(std::memory_order_release);
  // The magic last: a reader never takes a record half made for one.
  reinterpret_cast<std::atomic<uint64_t>*>(&r->magic)->store(kMemInfoMagic, std::memory_order_release);
  MemInfoTracker t(name, fd, r, kMemInfoV2Size, guard, true);
  t.lock_fd_ = take_owner_lock(fd);
  return t;
}

MemInfoTracker MemInfoTracker::open(const std::string& name) {
  int fd = open_shm(name, O_RDWR);
  if (fd < 0) {
    int e = errno;
    if (e == ENOENT) invalid("no kvcached instance named '" + name + "'; see `kvctl list`");
    if (e == EACCES || e == EPERM) invalid("record '" + name + "' belongs to another user; run kvctl as its owner");
    if (e == ELOOP) invalid("'" + name + "' in /dev/shm is a symbolic link, not a kvcached record");
    fail(ErrorKind::Backend, "cannot open record '" + name + "': " + std::strerror(e));
  }
  // The header first (a copy: the file may change size under us), then a
  // mapping of exactly the size its version has.
  alignas(8) char head[sizeof(MemInfoRecord)] = {};
  struct stat st;
  bool reg = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  ssize_t got = reg ? pread(fd, head, sizeof(head), 0) : -1;
  uint64_t magic = 0;
  uint32_t version = 0, record_size = 0;
  std::memcpy(&magic, head + offsetof(MemInfoRecord, magic), sizeof(magic));
  std::memcpy(&version, head + offsetof(MemInfoRecord, version), sizeof(version));
  std::memcpy(&record_size, head + offsetof(MemInfoRecord, record_size), sizeof(record_size));
  size_t want = size_of_version(version);
  if (!reg || got != static_cast<ssize_t>(sizeof(head)) || magic != kMemInfoMagic) {
    close(fd);
    invalid("'" + name + "' in /dev/shm is not a kvcached record (" +
            (reg ? std::to_string(st.st_size) + " bytes, no record header" : std::string("not a regular file")) + ")");
  }
  if (want == 0) {
    close(fd);
    invalid("'" + name + "' in /dev/shm is a kvcached record of version " + std::to_string(version) +
            ", not a kvcached record of version 1 or 2 that this kvcached reads; use the kvctl of the kvcached that "
            "instance runs");
  }
  if (record_size != want || static_cast<size_t>(st.st_size) != want) {
    close(fd);
    invalid("'" + name + "' in /dev/shm is not a kvcached record (" + std::to_string(st.st_size) +
            " bytes, size field " + std::to_string(record_size) + "; a record of version " + std::to_string(version) +
            " has " + std::to_string(want) + ")");
  }
  int guard = -1;
  MemInfoRecord* r = map_record(fd, name, want, &guard);
  return MemInfoTracker(name, fd, r, want, guard, false);
}

uint32_t MemInfoTracker::settled_seq(bool may_repair) const {
  int64_t start = 0;
  for (int i = 0;; ++i) {
    uint32_t a = rec_->seq.load(std::memory_order_acquire);
    if (!(a & 1u)) return a;
    if (i < 1000) continue;  // a live writer is two stores away from done
    int64_t now = clock_ns(CLOCK_MONOTONIC);
    if (start == 0) start = now;
    if (now - start >= kSeqWaitNs) break;
    timespec ts{0, 100000};
    nanosleep(&ts, nullptr);
  }
  if (may_repair) {
    // A fresh open file description: flock() on our own fd_ would not
    // exclude a writer using this same tracker from another thread.
    char self[64];
    std::snprintf(self, sizeof(self), "/proc/self/fd/%d", fd_);
    int lfd = ::open(self, O_RDONLY | O_CLOEXEC);
    if (lfd >= 0) {
      if (flock(lfd, LOCK_EX | LOCK_NB) == 0) {
        finish_dead_write_locked(rec_);
        flock(lfd, LOCK_UN);
      }
      close(lfd);
    }
  }
  return rec_->seq.load(std::memory_order_acquire);
}

MemInfoSnapshot MemInfoTracker::snapshot() const {
  MemInfoSnapshot s;
  s.name = name_;  // the file name (validated); the name field must match it
  auto bad = [&s](const std::string& why) {
    if (s.problem.empty()) s.problem = why;
  };
  struct stat st;
  bool stat_ok = fstat(fd_, &st) == 0;
  if (stat_ok) s.owner_uid = st.st_uid;
  uid_t euid = geteuid();
  s.owner_locked = owner_ || owner_lock_held(fd_);  // read first: a damaged record's owner still counts
  s.owner_alive = s.owner_locked;
  if (detached()) {
    bad("the record file was truncated while mapped; this handle is detached from it");
    return s;
  }
  if (!stat_ok || static_cast<size_t>(st.st_size) < size_) {
    bad("the record file is " + (stat_ok ? std::to_string(st.st_size) : std::string("?")) + " bytes, not " +
        std::to_string(size_) + " (truncated)");
    return s;  // reading the mapping past the end of the file would fault
  }
  if (static_cast<size_t>(st.st_size) != size_) {
    bad("the record file is " + std::to_string(st.st_size) + " bytes, not " + std::to_string(size_));
  }
  if (owner_ && st.st_uid != euid) {
    bad("the record now belongs to uid " + std::to_string(st.st_uid) + ", not to its owner (uid " +
        std::to_string(euid) + "); its limit is not trusted");
  } else if (!owner_ && euid != 0 && st.st_uid != euid) {
    bad("owned by uid " + std::to_string(st.st_uid) + ", not by this user");
  }
  if (st.st_mode & 022) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    bad(std::string("writable by other users (mode ") + mode + ")");
  }
  bool trusted_file = s.problem.empty();
  s.record_version = rec_->version;
  if (reinterpret_cast<std::atomic<uint64_t>*>(&rec_->magic)->load(std::memory_order_acquire) != kMemInfoMagic ||
      size_of_version(s.record_version) != size_ || rec_->record_size != size_) {
    bad("not a kvcached record of version 1 or 2 (magic/version/size fields say version " +
        std::to_string(s.record_version) + ", " + std::to_string(rec_->record_size) + " bytes; mapped " +
        std::to_string(size_) + ")");
  }
  size_t n = strnlen(rec_->name, sizeof(rec_->name));
  if (n == sizeof(rec_->name) || n != name_.size() || std::memcmp(rec_->name, name_.data(), n) != 0) {
    bad("its name field '" + escaped(rec_->name, n) + "' does not match the file name");
  }
  size_t en = strnlen(rec_->engine, sizeof(rec_->engine));
  s.engine = escaped(rec_->engine, en);
  if (en == sizeof(rec_->engine) || s.engine != std::string(rec_->engine, en) ||
      (en && !valid_name(rec_->engine, en))) {
    bad("its engine field '" + s.engine + "' is not printable ASCII");
  }
  s.device_type = rec_->device_type;
  s.device_index = rec_->device_index;
  if (s.device_type < 0 || s.device_type > 2 || s.device_index < 0 || s.device_index > 0xffff) {
    bad("device type/index " + std::to_string(s.device_type) + "/" + std::to_string(s.device_index) + " out of range");
  }
  s.owner_pid = rec_->owner_pid;
  s.owner_start_time = rec_->owner_start_time;
  if (s.owner_pid <= 0 || s.owner_pid > kMaxPid) bad("owner pid " + std::to_string(s.owner_pid) + " out of range");
  bool paired = false;
  for (int attempt = 0; attempt < 4 && !paired; ++attempt) {
    uint32_t a = settled_seq(trusted_file);
    s.revision = rec_->revision.load(std::memory_order_acquire);
    s.limit = rec_->limit.load(std::memory_order_acquire);
    if (a & 1u) break;  // a writer holds it (or a stopped one): busy
    paired = rec_->seq.load(std::memory_order_acquire) == a;
  }
  s.busy = !paired;
  s.used = rec_->used.load(std::memory_order_acquire);
  s.prealloc = rec_->prealloc.load(std::memory_order_acquire);
  s.total = rec_->total.load(std::memory_order_acquire);
  s.updated_ns = rec_->updated_ns.load(std::memory_order_acquire);
  s.granted = rec_->granted.load(std::memory_order_acquire);
  s.device_bytes = rec_->device_bytes.load(std::memory_order_acquire);
  s.applied_revision = rec_->applied_revision.load(std::memory_order_acquire);
  s.wanted = rec_->wanted.load(std::memory_order_acquire);
  s.wanted_ns = rec_->wanted_ns.load(std::memory_order_acquire);
  s.quarantined = rec_->quarantined.load(std::memory_order_acquire);
  const std::pair<const char*, int64_t> sizes[] = {
      {"limit", s.limit},     {"used", s.used},         {"prealloc", s.prealloc},         {"total", s.total},
      {"granted", s.granted}, {"wanted", s.wanted},     {"device_bytes", s.device_bytes}, {"quarantined", s.quarantined},
  };
  for (const auto& f : sizes) {
    if (!in_range(f.second)) bad(std::string(f.first) + " = " + std::to_string(f.second) + " is out of range");
  }
  if (s.updated_ns < 0 || s.wanted_ns < 0) bad("a timestamp field is negative");
  s.owner_alive = s.owner_locked || process_alive(s.owner_pid, s.owner_start_time);
  if (size_ == kMemInfoV2Size) read_stats(s);
  return s;
}

void MemInfoTracker::read_stats(MemInfoSnapshot& s) const {
  // Checked on its own: a bad block hides the statistics, not the record.
  const auto* st = reinterpret_cast<const MemInfoStats*>(reinterpret_cast<const char*>(rec_) + sizeof(MemInfoRecord));
  std::string why = stats_header_problem(st);
  auto out_of_range = [&why](const std::string& what, uint64_t v) {
    if (why.empty() && v > kMaxStatCount) {
      why = "its statistics block is corrupt (" + what + " = " + std::to_string(v) + " is out of range)";
    }
  };
  const int nc = static_cast<int>(StatCounter::Count), nh = static_cast<int>(StatHist::Count);
  if (why.empty()) {
    s.want_since_ns = st->want_since_ns.load(std::memory_order_acquire);
    if (s.want_since_ns < 0) why = "its statistics block is corrupt (want_since_ns is negative)";
    s.counters.resize(nc);
    for (int i = 0; i < nc; ++i) {
      uint64_t v = st->counters[i].load(std::memory_order_relaxed);
      out_of_range(stat_counter_name(static_cast<StatCounter>(i)), v);
      s.counters[i] = static_cast<int64_t>(v);
    }
    s.hist_buckets.assign(nh, std::vector<int64_t>(kStatBuckets + 1));
    s.hist_sum_ns.resize(nh);
    for (int h = 0; h < nh; ++h) {
      std::string hn = stat_hist_name(static_cast<StatHist>(h));
      for (int b = 0; b <= kStatBuckets; ++b) {
        uint64_t v = st->hist[h].bucket[b].load(std::memory_order_relaxed);
        out_of_range(hn + " bucket " + std::to_string(b), v);
        s.hist_buckets[h][b] = static_cast<int64_t>(v);
      }
      uint64_t sum = st->hist[h].sum_ns.load(std::memory_order_relaxed);
      out_of_range(hn + " sum", sum);
      s.hist_sum_ns[h] = static_cast<int64_t>(sum);
    }
  }
  if (!why.empty()) {
    s.stats_problem = why + "; its statistics are not shown (they restart with the instance)";
    s.counters.clear();
    s.hist_buckets.clear();
    s.hist_sum_ns.clear();
    s.want_since_ns = 0;
    return;
  }
  s.has_stats = true;
}

void MemInfoTracker::add_counter(StatCounter c, uint64_t n) {
  // The magic again: a block overwritten since open gets nothing more.
  if (stats_ == nullptr || n == 0 || stats_->magic != kMemStatsMagic) return;
  stats_->counters[static_cast<int>(c)].fetch_add(n, std::memory_order_relaxed);
}

void MemInfoTracker::observe(StatHist h, int64_t ns) {
  if (stats_ == nullptr || stats_->magic != kMemStatsMagic) return;
  if (ns < 0) ns = 0;  // a CLOCK_REALTIME step backwards
  const int64_t* bounds = stat_hist_bounds_ns(h);
  int b = 0;
  while (b < kStatBuckets && ns > bounds[b]) ++b;
  auto& hist = stats_->hist[static_cast<int>(h)];
  hist.bucket[b].fetch_add(1, std::memory_order_relaxed);
  hist.sum_ns.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
}

const char* stat_counter_name(StatCounter c) {
  switch (c) {
    case StatCounter::PagesMapped: return "pages_mapped";
    case StatCounter::PagesUnmapped: return "pages_unmapped";
    case StatCounter::MapFailures: return "map_failures";
    case StatCounter::UnmapFailures: return "unmap_failures";
    case StatCounter::RefusedLimit: return "refused_limit";
    case StatCounter::RefusedBudget: return "refused_budget";
    case StatCounter::GiveBacks: return "give_backs";
    case StatCounter::GivenBackBytes: return "given_back_bytes";
    case StatCounter::PagesQuarantined: return "pages_quarantined";
    case StatCounter::Count: break;
  }
  return "?";
}

const char* stat_hist_name(StatHist h) {
  switch (h) {
    case StatHist::MapLatency: return "map_seconds";
    case StatHist::UnmapLatency: return "unmap_seconds";
    case StatHist::WantServed: return "want_served_seconds";
    case StatHist::Count: break;
  }
  return "?";
}

const int64_t* stat_hist_bounds_ns(StatHist h) { return h == StatHist::WantServed ? kWantBounds : kLatencyBounds; }

void MemInfoTracker::publish_usage(int64_t used, int64_t prealloc) {
  rec_->used.store(used, std::memory_order_release);
  rec_->prealloc.store(prealloc, std::memory_order_release);
  rec_->updated_ns.store(now_ns(), std::memory_order_release);
}

void MemInfoTracker::set_total(int64_t total) { rec_->total.store(total, std::memory_order_release); }

int64_t MemInfoTracker::set_limit(int64_t limit, int64_t expected_revision) {
  if (!in_range(limit)) invalid("limit must be >= 0 and at most 2^60 bytes, got " + std::to_string(limit));
  if (expected_revision < -1 || expected_revision > static_cast<int64_t>(UINT32_MAX)) {
    invalid("revision " + std::to_string(expected_revision) + " is outside [0, 4294967295] (revisions are 32-bit)");
  }
  MemInfoSnapshot now = snapshot();
  if (!now.problem.empty()) {
    invalid("record '" + name_ + "' is invalid (" + now.problem + "); nothing was written. Remove it with `kvctl delete " +
            name_ + "` or restart that instance");
  }
  char self[64];
  std::snprintf(self, sizeof(self), "/proc/self/fd/%d", fd_);
  int lfd = ::open(self, O_RDONLY | O_CLOEXEC);  // own open file description: excludes this process's threads too
  if (lfd < 0) fail(ErrorKind::Backend, "cannot lock record '" + name_ + "': " + std::strerror(errno));
  int64_t out = -1;
  {
    FileLock lock(lfd, kWriteLockWaitNs);
    if (!lock.held_) {
      close(lfd);
      fail(ErrorKind::Backend, "record '" + name_ + "' stayed locked by another writer for " +
                                   std::to_string(kWriteLockWaitNs / 1000000000) +
                                   " s (a stopped kvctl?); nothing was written, retry");
    }
    finish_dead_write_locked(rec_);
    uint32_t rev = rec_->revision.load(std::memory_order_acquire);
    if (expected_revision < 0 || static_cast<uint32_t>(expected_revision) == rev) {
      rec_->seq.fetch_add(1, std::memory_order_acq_rel);
      rec_->limit.store(limit, std::memory_order_release);
      rec_->revision.store(rev + 1, std::memory_order_release);
      rec_->seq.fetch_add(1, std::memory_order_acq_rel);
      futex_wake_all(&rec_->revision);
      out = static_cast<int64_t>(static_cast<uint32_t>(rev + 1));
    }
  }
  close(lfd);
  return out;
}

uint32_t MemInfoTracker::wait_for_change(uint32_t seen, int timeout_ms) const {
  uint32_t cur = rec_->revision.load(std::memory_order_acquire);
  if (cur != seen) return cur;
  if (timeout_ms < 0) timeout_ms = 0;
  timespec ts{timeout_ms / 1000, static_cast<long>(timeout_ms % 1000) * 1000000L};
  // Shared (not private) futex: the word lives in a mapping other processes share.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&rec_->revision), FUTEX_WAIT, seen, &ts, nullptr, 0);
  return rec_->revision.load(std::memory_order_acquire);
}

void MemInfoTracker::wake() const {
  rec_->wakes.fetch_add(1, std::memory_order_acq_rel);
  futex_wake_all(&rec_->revision);
}

uint32_t MemInfoTracker::wake_count() const { return rec_->wakes.load(std::memory_order_acquire); }

void MemInfoTracker::set_granted(int64_t bytes) {
  if (!in_range(bytes)) invalid("granted bytes must be >= 0 and at most 2^60, got " + std::to_string(bytes));
  rec_->granted.store(bytes, std::memory_order_release);
}

void MemInfoTracker::set_device_bytes(int64_t bytes) {
  if (!in_range(bytes)) invalid("device bytes must be >= 0 and at most 2^60, got " + std::to_string(bytes));
  rec_->device_bytes.store(bytes, std::memory_order_release);
}

void MemInfoTracker::set_wanted(int64_t bytes) {
  if (!in_range(bytes)) invalid("wanted bytes must be >= 0 and at most 2^60, got " + std::to_string(bytes));
  // Time first: a reader that sees the new bytes also sees a fresh time.
  int64_t now = now_ns();
  rec_->wanted_ns.store(now, std::memory_order_release);
  rec_->wanted.store(bytes, std::memory_order_release);
  if (stats_ != nullptr) {
    // Only the owner writes a want: the start and end of one are seen here.
    int64_t since = stats_->want_since_ns.load(std::memory_order_acquire);
    if (bytes > 0 && since == 0) {
      stats_->want_since_ns.store(now, std::memory_order_release);
    } else if (bytes == 0 && since > 0) {
      stats_->want_since_ns.store(0, std::memory_order_release);
      observe(StatHist::WantServed, now - since);
    }
  }
}

void MemInfoTracker::set_quarantined(int64_t bytes) {
  if (!in_range(bytes)) invalid("quarantined bytes must be >= 0 and at most 2^60, got " + std::to_string(bytes));
  rec_->quarantined.store(bytes, std::memory_order_release);
}

void MemInfoTracker::ack_revision(uint32_t revision) {
  rec_->applied_revision.store(revision, std::memory_order_release);
}

void MemInfoTracker::unlink() {
  // Only the file this handle maps: a successor may have taken the name.
  std::string path = shm_path(name_);
  struct stat mine, now;
  if (fstat(fd_, &mine) == 0 && lstat(path.c_str(), &now) == 0 && mine.st_ino == now.st_ino &&
      mine.st_dev == now.st_dev) {
    ::unlink(path.c_str());
  }
}

std::vector<std::string> list_mem_info_records() {
  std::vector<std::string> out;
  DIR* d = opendir(kShmDir);
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    size_t n = strlen(e->d_name);
    if (!valid_name(e->d_name, n)) continue;  // kvcached never makes such a name
    if (e->d_type != DT_REG && e->d_type != DT_UNKNOWN) continue;
    std::string name(e->d_name, n);
    int fd = open_shm(name, O_RDONLY);
    if (fd < 0) continue;
    uint64_t magic = 0;
    struct stat st;
    bool reg = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    bool ok = reg && pread(fd, &magic, sizeof(magic), 0) == static_cast<ssize_t>(sizeof(magic)) && magic == kMemInfoMagic;
    // A record truncated or overwritten under its live owner is still listed
    // (as invalid): its owner's memory must not drop out of the budget.
    ok = ok || (reg && owner_lock_held(fd));
    close(fd);
    if (ok) out.push_back(std::move(name));
  }
  closedir(d);
  return out;
}

void delete_mem_info_record(const std::string& name, bool force) {
  std::string path = shm_path(name);
  struct stat lst;
  if (lstat(path.c_str(), &lst) != 0) {
    if (errno == ENOENT) invalid("no kvcached instance named '" + name + "'; see `kvctl list`");
    fail(ErrorKind::Backend, "cannot inspect /dev/shm/" + name + ": " + std::strerror(errno));
  }
  uid_t euid = geteuid();
  if (lst.st_uid != euid && euid != 0) {
    invalid("record '" + name + "' belongs to uid " + std::to_string(lst.st_uid) +
            "; only that user (or root) can delete it");
  }
  if (!S_ISREG(lst.st_mode)) {
    invalid("'" + name + "' in /dev/shm is not a kvcached record (not a regular file); nothing was deleted");
  }
  int fd = open_shm(name, O_RDONLY);
  if (fd < 0) fail(ErrorKind::Backend, "cannot open /dev/shm/" + name + ": " + std::strerror(errno));
  // Read a copy (no mapping: the file may be truncated under us).
  alignas(8) char buf[sizeof(MemInfoRecord)] = {};
  struct stat st;
  bool same = fstat(fd, &st) == 0 && st.st_ino == lst.st_ino && st.st_dev == lst.st_dev;
  ssize_t n = pread(fd, buf, sizeof(buf), 0);
  bool locked = same && owner_lock_held(fd);
  close(fd);
  if (!same) invalid("'" + name + "' was replaced while being deleted (a new instance?); nothing was deleted, retry");
  if (locked && !force) {
    invalid("instance '" + name + "' is alive (its owner lock is held; the record may be damaged); stop it first, or "
            "pass --force");
  }
  uint64_t magic = 0;
  if (n >= static_cast<ssize_t>(sizeof(magic))) std::memcpy(&magic, buf, sizeof(magic));
  if (magic != kMemInfoMagic) {
    invalid("'" + name + "' in /dev/shm is not a kvcached record; nothing was deleted (remove it by hand if it is yours)");
  }
  if (n == static_cast<ssize_t>(sizeof(buf)) && !force) {
    int32_t pid = 0;
    uint64_t start = 0;
    std::memcpy(&pid, buf + offsetof(MemInfoRecord, owner_pid), sizeof(pid));
    std::memcpy(&start, buf + offsetof(MemInfoRecord, owner_start_time), sizeof(start));
    if (process_alive(pid, start)) {
      invalid("instance '" + name + "' is alive (pid " + std::to_string(pid) + "); stop it first, or pass --force");
    }
  }
  struct stat now;
  if (lstat(path.c_str(), &now) != 0 || now.st_ino != lst.st_ino || now.st_dev != lst.st_dev) {
    invalid("'" + name + "' was replaced while being deleted (a new instance?); nothing was deleted, retry");
  }
  if (::unlink(path.c_str()) != 0) {
    fail(ErrorKind::Backend, "could not delete /dev/shm/" + name + ": " + std::strerror(errno) + "; it is still there");
  }
}

bool record_owner_locked(const std::string& name) {
  if (!valid_name(name.data(), name.size())) return false;
  int fd = open_shm(name, O_RDONLY);
  if (fd < 0) return false;
  struct stat st;
  bool held = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && owner_lock_held(fd);
  close(fd);
  return held;
}

}  // namespace kvcached
