// The CPU AdamW with speculation then validation, driven from Python (spillway.torch's
// CPUAdamW): bound in a later commit.
#include "bindings.hpp"

namespace spillway::python {

void bind_optim(nanobind::module_& m) { (void)m; }

}  // namespace spillway::python
