// Error kinds of the data plane. Each maps to one Python exception type in the
// bindings, so callers can tell recoverable pressure from lost consistency.
#pragma once

#include <stdexcept>
#include <string>

namespace kvcached {

enum class ErrorKind {
  InvalidArgument,   // caller bug: bad offset, double map, ...; nothing changed
  OutOfMemory,       // physical memory pressure: recoverable, nothing changed
  StateConsistency,  // rollback failed: the pool refuses further work
  Backend,           // a driver/OS call failed and was rolled back
  Shutdown,          // use after shutdown_kvcached()
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg)
      : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

[[noreturn]] inline void fail(ErrorKind kind, const std::string& msg) {
  throw Error(kind, msg);
}

[[noreturn]] inline void invalid(const std::string& msg) {
  throw Error(ErrorKind::InvalidArgument, msg);
}

}  // namespace kvcached
