// The parts of the extension module spillway._spillway (python/src): each binds one face of
// the library. Tensors cross as integers (data pointers) and byte counts, streams as native
// handles: the module never sees a torch type (docs/python.md).
#pragma once

#include <nanobind/nanobind.h>

namespace spillway::python {

void bind_plan(nanobind::module_& m);     // plan_binding.cpp
void bind_offload(nanobind::module_& m);  // offload_binding.cpp
void bind_optim(nanobind::module_& m);    // optim_binding.cpp
void bind_stream(nanobind::module_& m);   // stream_binding.cpp

}  // namespace spillway::python
