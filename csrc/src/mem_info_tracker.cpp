#include "kvcached/mem_info_tracker.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <cstdio>
#include <cstdlib>

#include "kvcached/errors.hpp"

namespace kvcached {

namespace {

std::string shm_name(const std::string& name) {
  if (name.empty() || name.size() >= sizeof(MemInfoRecord::name) || name.find('/') != std::string::npos ||
      name == "." || name == "..") {
    invalid("record name '" + name + "' is invalid; use 1-127 characters without '/'");
  }
  return "/" + name;
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

MemInfoRecord* map_record(int fd, const std::string& name) {
  void* p = mmap(nullptr, sizeof(MemInfoRecord), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd);
    fail(ErrorKind::Backend, "cannot map record '" + name + "': " + std::strerror(e));
  }
  return static_cast<MemInfoRecord*>(p);
}

void copy_name(char* dst, size_t cap, const std::string& s) {
  std::memset(dst, 0, cap);
  std::memcpy(dst, s.data(), std::min(cap - 1, s.size()));
}

struct FileLock {
  explicit FileLock(int fd) : fd_(fd) { while (flock(fd_, LOCK_EX) != 0 && errno == EINTR) {} }
  ~FileLock() { flock(fd_, LOCK_UN); }
  int fd_;
};

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

}  // namespace

uint64_t process_start_time(int pid) { return stat_of(pid, nullptr); }

bool process_alive(int pid, uint64_t start_time) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char state = 0;
  uint64_t st = stat_of(pid, &state);
  if (st == 0 || (start_time != 0 && st != start_time)) return false;
  return !exited_unreaped(pid, state);
}

MemInfoTracker::MemInfoTracker(std::string name, int fd, MemInfoRecord* rec)
    : name_(std::move(name)), fd_(fd), rec_(rec) {}

MemInfoTracker::MemInfoTracker(MemInfoTracker&& o) noexcept : name_(std::move(o.name_)), fd_(o.fd_), rec_(o.rec_) {
  o.fd_ = -1;
  o.rec_ = nullptr;
}

MemInfoTracker::~MemInfoTracker() {
  if (rec_) munmap(rec_, sizeof(MemInfoRecord));
  if (fd_ >= 0) close(fd_);
}

MemInfoTracker MemInfoTracker::create(const std::string& name, const std::string& engine, int device_type,
                                      int device_index, int64_t total, int64_t limit) {
  std::string path = shm_name(name);
  int fd = -1;
  for (int attempt = 0; attempt < 2 && fd < 0; ++attempt) {
    fd = shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0 || errno != EEXIST) break;
    // Exists: reclaim it only if its owner is gone.
    MemInfoSnapshot old;
    bool readable = true;
    try {
      old = open(name).snapshot();
    } catch (const Error&) {
      readable = false;
    }
    if (readable && old.owner_alive) {
      invalid("record '" + name + "' belongs to live process " + std::to_string(old.owner_pid) +
              "; choose another KVCACHED_IPC_NAME or stop that instance");
    }
    if (!readable) {
      invalid("record '" + name + "' exists and cannot be opened by this user; remove /dev/shm/" + name +
              " or choose another KVCACHED_IPC_NAME");
    }
    shm_unlink(path.c_str());
  }
  if (fd < 0) fail(ErrorKind::Backend, "cannot create record '" + name + "': " + std::strerror(errno));
  fchmod(fd, 0600);  // whatever the umask
  if (ftruncate(fd, sizeof(MemInfoRecord)) != 0) {
    int e = errno;
    close(fd);
    shm_unlink(path.c_str());
    fail(ErrorKind::Backend, "cannot size record '" + name + "': " + std::strerror(e));
  }
  MemInfoRecord* r = map_record(fd, name);
  r->version = kMemInfoVersion;
  r->record_size = sizeof(MemInfoRecord);
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
  r->wanted.store(0);
  r->wanted_ns.store(0);
  copy_name(r->name, sizeof(r->name), name);
  copy_name(r->engine, sizeof(r->engine), engine);
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint64_t>*>(&r->magic)->store(kMemInfoMagic, std::memory_order_release);
  return MemInfoTracker(name, fd, r);
}

MemInfoTracker MemInfoTracker::open(const std::string& name) {
  std::string path = shm_name(name);
  int fd = shm_open(path.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    int e = errno;
    if (e == ENOENT) invalid("no kvcached instance named '" + name + "'; see `kvctl list`");
    if (e == EACCES) invalid("record '" + name + "' belongs to another user; run kvctl as its owner");
    fail(ErrorKind::Backend, "cannot open record '" + name + "': " + std::strerror(e));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(MemInfoRecord)) {
    close(fd);
    invalid("'" + name + "' in /dev/shm is not a kvcached record");
  }
  MemInfoRecord* r = map_record(fd, name);
  if (reinterpret_cast<std::atomic<uint64_t>*>(&r->magic)->load(std::memory_order_acquire) != kMemInfoMagic ||
      r->version != kMemInfoVersion) {
    munmap(r, sizeof(MemInfoRecord));
    close(fd);
    invalid("'" + name + "' in /dev/shm is not a kvcached record of version " + std::to_string(kMemInfoVersion));
  }
  return MemInfoTracker(name, fd, r);
}

MemInfoSnapshot MemInfoTracker::snapshot() const {
  MemInfoSnapshot s;
  s.name = std::string(rec_->name, strnlen(rec_->name, sizeof(rec_->name)));
  s.engine = std::string(rec_->engine, strnlen(rec_->engine, sizeof(rec_->engine)));
  s.device_type = rec_->device_type;
  s.device_index = rec_->device_index;
  s.owner_pid = rec_->owner_pid;
  s.owner_start_time = rec_->owner_start_time;
  for (;;) {
    uint32_t a = rec_->seq.load(std::memory_order_acquire);
    if (a & 1u) continue;
    s.revision = rec_->revision.load(std::memory_order_acquire);
    s.limit = rec_->limit.load(std::memory_order_acquire);
    if (rec_->seq.load(std::memory_order_acquire) == a) break;
  }
  s.used = rec_->used.load(std::memory_order_acquire);
  s.prealloc = rec_->prealloc.load(std::memory_order_acquire);
  s.total = rec_->total.load(std::memory_order_acquire);
  s.updated_ns = rec_->updated_ns.load(std::memory_order_acquire);
  s.granted = rec_->granted.load(std::memory_order_acquire);
  s.device_bytes = rec_->device_bytes.load(std::memory_order_acquire);
  s.applied_revision = rec_->applied_revision.load(std::memory_order_acquire);
  s.wanted = rec_->wanted.load(std::memory_order_acquire);
  s.wanted_ns = rec_->wanted_ns.load(std::memory_order_acquire);
  s.owner_alive = process_alive(s.owner_pid, s.owner_start_time);
  return s;
}

void MemInfoTracker::publish_usage(int64_t used, int64_t prealloc) {
  rec_->used.store(used, std::memory_order_release);
  rec_->prealloc.store(prealloc, std::memory_order_release);
  rec_->updated_ns.store(now_ns(), std::memory_order_release);
}

void MemInfoTracker::set_total(int64_t total) { rec_->total.store(total, std::memory_order_release); }

int64_t MemInfoTracker::set_limit(int64_t limit, int64_t expected_revision) {
  if (limit < 0) invalid("limit must be >= 0 bytes, got " + std::to_string(limit));
  FileLock lock(fd_);
  uint32_t rev = rec_->revision.load(std::memory_order_acquire);
  if (expected_revision >= 0 && static_cast<uint32_t>(expected_revision) != rev) return -1;
  rec_->seq.fetch_add(1, std::memory_order_acq_rel);
  rec_->limit.store(limit, std::memory_order_release);
  rec_->revision.store(rev + 1, std::memory_order_release);
  rec_->seq.fetch_add(1, std::memory_order_acq_rel);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&rec_->revision), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  return static_cast<int64_t>(rev) + 1;
}

uint32_t MemInfoTracker::wait_for_change(uint32_t seen, int timeout_ms) const {
  uint32_t cur = rec_->revision.load(std::memory_order_acquire);
  if (cur != seen) return cur;
  timespec ts{timeout_ms / 1000, static_cast<long>(timeout_ms % 1000) * 1000000L};
  // Shared (not private) futex: the word lives in a mapping other processes share.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&rec_->revision), FUTEX_WAIT, seen, &ts, nullptr, 0);
  return rec_->revision.load(std::memory_order_acquire);
}

void MemInfoTracker::wake() const {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&rec_->revision), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

void MemInfoTracker::set_granted(int64_t bytes) {
  if (bytes < 0) invalid("granted bytes must be >= 0, got " + std::to_string(bytes));
  rec_->granted.store(bytes, std::memory_order_release);
}

void MemInfoTracker::set_device_bytes(int64_t bytes) {
  if (bytes < 0) invalid("device bytes must be >= 0, got " + std::to_string(bytes));
  rec_->device_bytes.store(bytes, std::memory_order_release);
}

void MemInfoTracker::set_wanted(int64_t bytes) {
  if (bytes < 0) invalid("wanted bytes must be >= 0, got " + std::to_string(bytes));
  // Time first: a reader that sees the new bytes also sees a fresh time.
  rec_->wanted_ns.store(now_ns(), std::memory_order_release);
  rec_->wanted.store(bytes, std::memory_order_release);
}

void MemInfoTracker::ack_revision(uint32_t revision) {
  rec_->applied_revision.store(revision, std::memory_order_release);
}

void MemInfoTracker::unlink() { shm_unlink(shm_name(name_).c_str()); }

std::vector<std::string> list_mem_info_records() {
  std::vector<std::string> out;
  DIR* d = opendir("/dev/shm");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n == "." || n == "..") continue;
    int fd = shm_open(("/" + n).c_str(), O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) continue;
    uint64_t magic = 0;
    struct stat st;
    bool ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && static_cast<size_t>(st.st_size) == sizeof(MemInfoRecord) &&
              pread(fd, &magic, sizeof(magic), 0) == static_cast<ssize_t>(sizeof(magic)) && magic == kMemInfoMagic;
    close(fd);
    if (ok) out.push_back(n);
  }
  closedir(d);
  return out;
}

void delete_mem_info_record(const std::string& name, bool force) {
  MemInfoSnapshot s = MemInfoTracker::open(name).snapshot();
  if (s.owner_alive && !force) {
    invalid("instance '" + name + "' is alive (pid " + std::to_string(s.owner_pid) +
            "); stop it first, or pass --force");
  }
  shm_unlink(shm_name(name).c_str());
}

}  // namespace kvcached
