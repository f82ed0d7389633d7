#include "kvcached/mapping_guard.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>

namespace kvcached {
namespace mapping_guard {

namespace {
constexpr int kSlots = 4096;  // records mapped at once by one process (kvctl list maps one at a time)

struct Slot {
  std::atomic<uintptr_t> base{0};
  std::atomic<int> lost{0};
};

Slot g_slots[kSlots];
size_t g_page = 0;
struct sigaction g_prev;
std::once_flag g_installed;

void on_sigbus(int sig, siginfo_t* si, void* ctx) {
  // Only a fault raised by the kernel carries a meaningful address.
  if (si && si->si_code > 0) {
    uintptr_t a = reinterpret_cast<uintptr_t>(si->si_addr);
    for (Slot& s : g_slots) {
      uintptr_t b = s.base.load(std::memory_order_acquire);
      if (b != 0 && a >= b && a < b + g_page) {
        int saved = errno;
        void* p = mmap(reinterpret_cast<void*>(b), g_page, PROT_READ | PROT_WRITE,
                       MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        errno = saved;
        if (p != MAP_FAILED) {
          s.lost.store(1, std::memory_order_release);
          return;  // the access is retried on the anonymous page
        }
        break;  // cannot repair: die as without us
      }
    }
  }
  if (g_prev.sa_flags & SA_SIGINFO) {
    if (g_prev.sa_sigaction) {
      g_prev.sa_sigaction(sig, si, ctx);
      return;
    }
  } else if (g_prev.sa_handler != SIG_DFL && g_prev.sa_handler != SIG_IGN) {
    g_prev.sa_handler(sig);
    return;
  }
  // Default action: restore it; the faulting access repeats and ends the process.
  signal(SIGBUS, SIG_DFL);
  if (!si || si->si_code <= 0) raise(SIGBUS);
}

void install() {
  g_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_prev);
}
}  // namespace

int add(void* base) {
  std::call_once(g_installed, install);
  uintptr_t b = reinterpret_cast<uintptr_t>(base);
  for (int i = 0; i < kSlots; ++i) {
    uintptr_t expected = 0;
    if (g_slots[i].base.compare_exchange_strong(expected, b, std::memory_order_acq_rel)) {
      g_slots[i].lost.store(0, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

void remove(int slot) {
  if (slot < 0 || slot >= kSlots) return;
  g_slots[slot].base.store(0, std::memory_order_release);
}

bool lost(int slot) {
  return slot >= 0 && slot < kSlots && g_slots[slot].lost.load(std::memory_order_acquire) != 0;
}

}  // namespace mapping_guard
}  // namespace kvcached
