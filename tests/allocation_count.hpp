// Counting heap allocations in a test binary: allocation_count.cpp replaces the global
// operator new (every thread's calls count; the sanitizers' allocators still see them).
// Link it only into test binaries that check "no allocation in steady state".
#pragma once

#include <cstdint>

namespace spillway::testing {

// Calls of operator new so far in this process.
int64_t heap_allocations();

}  // namespace spillway::testing
