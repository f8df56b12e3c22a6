// Lets each translation unit of a vendor extension add its own FFI handlers and
// Python functions to the module, so the cuDNN, CK and small-seq sources never
// include each other. module.cc (per vendor) builds the pybind11 module from it.
#pragma once

#include <functional>
#include <vector>

#include <pybind11/pybind11.h>

namespace fusedattn {

using ModuleInitializer = std::function<void(pybind11::module_&)>;

inline std::vector<ModuleInitializer>& module_initializers() {
  static std::vector<ModuleInitializer> initializers;
  return initializers;
}

struct RegisterWithModule {
  explicit RegisterWithModule(ModuleInitializer init) {
    module_initializers().push_back(std::move(init));
  }
};

// A PyCapsule holding an XLA FFI handler, as jax.ffi.register_ffi_target expects.
template <typename Handler>
pybind11::capsule ffi_capsule(Handler* handler) {
  return pybind11::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace fusedattn

// In any source file of the extension:
//   FUSEDATTN_MODULE_INIT(my_part) { m.def(...); targets["fusedattn_x"] = ...; }
// `m` is the module; handlers go into the dict `m.attr("ffi_targets")`.
#define FUSEDATTN_MODULE_INIT(tag)                                         \
  static void fusedattn_init_##tag(pybind11::module_& m);                 \
  static ::fusedattn::RegisterWithModule fusedattn_register_##tag(        \
      fusedattn_init_##tag);                                               \
  static void fusedattn_init_##tag(pybind11::module_& m)
