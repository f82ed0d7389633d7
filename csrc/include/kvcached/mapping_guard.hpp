// MappingGuard: survive the truncation of a shared file that is mapped here.
//
// Accessing a MAP_SHARED page past the end of its file raises SIGBUS, which
// kills the process. The instance records in /dev/shm are such mappings and
// anyone with write access (the same user, root) can truncate them. A guarded
// mapping is registered here; a SIGBUS inside it replaces the vanished page by
// a private anonymous one (the faulting access then completes on zeros) and
// marks the slot lost. A SIGBUS anywhere else goes to the handler that was
// installed before ours, or to the default action.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvcached {
namespace mapping_guard {

// Registers [base, base + one page); returns a slot (-1 when all are taken:
// the mapping is then unguarded). Installs the handler on first use.
int add(void* base);
// Unregisters a slot before its mapping is unmapped.
void remove(int slot);
// True once a SIGBUS hit the slot's mapping (it is detached from its file).
bool lost(int slot);

}  // namespace mapping_guard
}  // namespace kvcached
