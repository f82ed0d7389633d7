// Deterministic fault injection for the backend calls, so rollback paths run for
// real in tests on every backend. Armed by API or by KVCACHED_FAULT_INJECT, e.g.
// "map:3" (3rd map fails), "create:2x4" (2nd..5th fail), "release:1x*" (all).
#pragma once

#include <cstdint>
#include <string>

namespace kvcached {

enum class BackendOp : int { Create = 0, Map, SetAccess, Unmap, Release, Count };

const char* op_name(BackendOp op);
BackendOp parse_op(const std::string& name);  // throws InvalidArgument

namespace faults {

// Make the nth call of `op` from now fail, and `count` calls after it
// (count < 0: every later call). Re-arming an op replaces its rule.
void arm(BackendOp op, int64_t nth, int64_t count);
void clear();
// Parses a KVCACHED_FAULT_INJECT-style spec ("map:3,unmap:1x2"); throws on a bad spec.
void arm_from_spec(const std::string& spec);
// Counts the call; returns true when this call must fail.
bool should_fail(BackendOp op);
// Total calls of `op` made through the backend layer in this process.
int64_t calls(BackendOp op);
// Calls that failed by injection.
int64_t injected(BackendOp op);

}  // namespace faults
}  // namespace kvcached
