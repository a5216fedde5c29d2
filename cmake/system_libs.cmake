# The libraries the parts link privately that come without a CMake package of their own:
# libnuma (memory, optim), OpenBLAS (nn), and Highway (optim) when its package is missing,
# as imported targets. The build includes this file, and so does the installed
# spillwayConfig.cmake: the exported link interface names these targets, never a path of
# the build machine, and a consumer's link finds each library on its own machine (the
# parts are static, so their private libraries come along to the final link).
# Sets SPILLWAY_SYSTEM_LIBS_MISSING to the libraries not found (empty: all were).
set(SPILLWAY_SYSTEM_LIBS_MISSING "")

if(NOT TARGET spillway_deps::numa)
  find_library(NUMA_LIBRARY numa)
  if(NUMA_LIBRARY)
    add_library(spillway_deps::numa UNKNOWN IMPORTED)
    set_target_properties(spillway_deps::numa PROPERTIES IMPORTED_LOCATION "${NUMA_LIBRARY}")
  else()
    list(APPEND SPILLWAY_SYSTEM_LIBS_MISSING "libnuma (NUMA_LIBRARY)")
  endif()
endif()

if(NOT TARGET spillway_deps::openblas)
  find_library(OPENBLAS_LIBRARY openblas)
  if(OPENBLAS_LIBRARY)
    add_library(spillway_deps::openblas UNKNOWN IMPORTED)
    set_target_properties(spillway_deps::openblas PROPERTIES IMPORTED_LOCATION "${OPENBLAS_LIBRARY}")
  else()
    list(APPEND SPILLWAY_SYSTEM_LIBS_MISSING "OpenBLAS (OPENBLAS_LIBRARY)")
  endif()
endif()

# Highway: portable SIMD with run-time dispatch (the CPU AdamW of src/optim/arch/). Its own
# package when installed, else the library and its headers.
if(NOT TARGET hwy::hwy)
  find_package(hwy CONFIG QUIET)
endif()
if(NOT TARGET hwy::hwy)
  find_library(HWY_LIBRARY hwy)
  find_path(HWY_INCLUDE_DIR hwy/highway.h)
  if(HWY_LIBRARY AND HWY_INCLUDE_DIR)
    add_library(hwy::hwy UNKNOWN IMPORTED)
    set_target_properties(hwy::hwy PROPERTIES IMPORTED_LOCATION "${HWY_LIBRARY}"
                                              INTERFACE_INCLUDE_DIRECTORIES "${HWY_INCLUDE_DIR}")
  else()
    list(APPEND SPILLWAY_SYSTEM_LIBS_MISSING "Highway (HWY_LIBRARY, HWY_INCLUDE_DIR)")
  endif()
endif()

# PCRE2 (8-bit) and utf8proc: the tokenizer's regular expressions with Unicode classes and
# its Unicode normalization (src/text).
foreach(lib pcre2-8 utf8proc)
  if(NOT TARGET spillway_deps::${lib})
    string(TOUPPER "${lib}" var)
    string(REPLACE "-" "_" var "${var}")
    find_library(${var}_LIBRARY ${lib})
    if(${var}_LIBRARY)
      add_library(spillway_deps::${lib} UNKNOWN IMPORTED)
      set_target_properties(spillway_deps::${lib} PROPERTIES IMPORTED_LOCATION "${${var}_LIBRARY}")
    else()
      list(APPEND SPILLWAY_SYSTEM_LIBS_MISSING "${lib} (${var}_LIBRARY)")
    endif()
  endif()
endforeach()

# cpp-httplib (the live server): Debian builds it as a library, with the defines its header
# needs to match the library's build (its pkg-config file's).
if(NOT TARGET spillway_deps::httplib)
  find_library(HTTPLIB_LIBRARY cpp-httplib)
  find_path(HTTPLIB_INCLUDE_DIR httplib.h)
  if(HTTPLIB_LIBRARY AND HTTPLIB_INCLUDE_DIR)
    add_library(spillway_deps::httplib UNKNOWN IMPORTED)
    set_target_properties(spillway_deps::httplib PROPERTIES
      IMPORTED_LOCATION "${HTTPLIB_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${HTTPLIB_INCLUDE_DIR}"
      INTERFACE_COMPILE_DEFINITIONS
        "CPPHTTPLIB_OPENSSL_SUPPORT;CPPHTTPLIB_ZLIB_SUPPORT;CPPHTTPLIB_BROTLI_SUPPORT")
  else()
    list(APPEND SPILLWAY_SYSTEM_LIBS_MISSING "cpp-httplib (HTTPLIB_LIBRARY, HTTPLIB_INCLUDE_DIR)")
  endif()
endif()
