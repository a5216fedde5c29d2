// spillway._spillway: the extension module (docs/python.md). The Python package
// (python/spillway) wraps it; nothing here knows torch.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "spillway/core/error.hpp"

namespace nb = nanobind;

NB_MODULE(_spillway, m) {
  m.doc() = "spillway's engines and planner (the extension module behind `import spillway`)";
  m.def(
      "version", [] { return std::string("0.1.0"); }, "spillway's version");
  // An engine session is referenced from the hooks torch keeps on the user's modules, so it
  // may still be alive when the interpreter exits: freed by the OS then, not a refcount bug.
  nb::set_leak_warnings(false);
  // spillway::Error is spillway.Error (a RuntimeError); an InputError, a bad value a caller
  // gave, is a ValueError that names the field and the value.
  static nb::exception<spillway::Error> error(m, "Error", PyExc_RuntimeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const spillway::InputError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const spillway::Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });
  spillway::python::bind_plan(m);
  spillway::python::bind_offload(m);
  spillway::python::bind_optim(m);
  spillway::python::bind_stream(m);
}
