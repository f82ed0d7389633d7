#include "kvcached/fault_injection.hpp"

#include <array>
#include <cstdlib>
#include <mutex>

#include "kvcached/errors.hpp"

namespace kvcached {

namespace {
constexpr int kOps = static_cast<int>(BackendOp::Count);
const char* const kNames[kOps] = {"create", "map", "set_access", "unmap", "release"};

struct Rule {
  int64_t first = -1;  // call index (1-based) of the first failure; -1: disarmed
  int64_t count = 0;   // failures from `first`; < 0 means forever
};

struct State {
  std::mutex mu;
  std::array<int64_t, kOps> calls{};
  std::array<int64_t, kOps> injected{};
  std::array<Rule, kOps> rules{};
};

State& state() {
  static State* s = new State();  // leaked on purpose: used from exit paths
  return *s;
}

void arm_locked(State& s, BackendOp op, int64_t nth, int64_t count) {
  int i = static_cast<int>(op);
  s.rules[i].first = s.calls[i] + nth;
  s.rules[i].count = count;
}

struct EnvArm {
  EnvArm() {
    if (const char* spec = std::getenv("KVCACHED_FAULT_INJECT"); spec && *spec) {
      faults::arm_from_spec(spec);
    }
  }
};
}  // namespace

const char* op_name(BackendOp op) { return kNames[static_cast<int>(op)]; }

BackendOp parse_op(const std::string& name) {
  for (int i = 0; i < kOps; ++i) {
    if (name == kNames[i]) return static_cast<BackendOp>(i);
  }
  invalid("unknown backend operation '" + name +
          "'; use one of create, map, set_access, unmap, release");
}

namespace faults {

void arm(BackendOp op, int64_t nth, int64_t count) {
  if (nth < 1) invalid("fault injection: nth must be >= 1, got " + std::to_string(nth));
  if (count == 0) invalid("fault injection: count must be non-zero (negative means forever)");
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  arm_locked(s, op, nth, count);
}

void clear() {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  for (auto& r : s.rules) r = Rule{};
}

void arm_from_spec(const std::string& spec) {
  size_t start = 0;
  while (start <= spec.size()) {
    size_t comma = spec.find(',', start);
    if (comma == std::string::npos) comma = spec.size();
    std::string item = spec.substr(start, comma - start);
    start = comma + 1;
    if (item.empty()) continue;
    auto colon = item.find(':');
    if (colon == std::string::npos) {
      invalid("KVCACHED_FAULT_INJECT item '" + item + "' must look like op:N or op:NxM");
    }
    BackendOp op = parse_op(item.substr(0, colon));
    std::string rest = item.substr(colon + 1);
    int64_t nth = 0, count = 1;
    try {
      auto x = rest.find('x');
      nth = std::stoll(rest.substr(0, x));
      if (x != std::string::npos) {
        std::string c = rest.substr(x + 1);
        count = (c == "*") ? -1 : std::stoll(c);
      }
    } catch (const std::logic_error&) {
      invalid("KVCACHED_FAULT_INJECT item '" + item + "' must look like op:N or op:NxM");
    }
    arm(op, nth, count);
  }
}

bool should_fail(BackendOp op) {
  static EnvArm env_arm;  // parse the environment before the first call counts
  (void)env_arm;
  State& s = state();
  int i = static_cast<int>(op);
  std::lock_guard<std::mutex> g(s.mu);
  int64_t n = ++s.calls[i];
  const Rule& r = s.rules[i];
  if (r.first < 0 || n < r.first) return false;
  if (r.count >= 0 && n >= r.first + r.count) return false;
  ++s.injected[i];
  return true;
}

int64_t calls(BackendOp op) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  return s.calls[static_cast<int>(op)];
}

int64_t injected(BackendOp op) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  return s.injected[static_cast<int>(op)];
}

}  // namespace faults
}  // namespace kvcached
