# The `install` test (tests/CMakeLists.txt): spillway consumed as an installed library.
#   1. cmake --install of this build into a fresh prefix under it (WORK_DIR/prefix);
#   2. every public header of the source tree is installed, and its quoted includes are
#      public headers ("spillway/<part>/x.hpp"), never src/ ones;
#   3. headers/: each installed header compiled alone with only the prefix's include/,
#      fmt's and nlohmann's on the include path; spillway::spillway linked into a program;
#   4. examples/cpp/offload_and_adamw configured with find_package(spillway) from that
#      prefix alone, built, and run (it exits non-zero on any mismatch).
# Nothing of spillway is rebuilt; the projects use the build's compiler and generator.
# Inputs (-D): BUILD_DIR SOURCE_DIR WORK_DIR CXX_COMPILER BUILD_TYPE GENERATOR, CXX_FLAGS and
# LINKER_FLAGS (the build's, sanitizers included), WARNINGS (joined with '|'), CUDA_ROOT.
cmake_minimum_required(VERSION 3.22)

foreach(var BUILD_DIR SOURCE_DIR WORK_DIR CXX_COMPILER GENERATOR)
  if(NOT ${var})
    message(FATAL_ERROR "install test: ${var} is not set")
  endif()
endforeach()
string(REPLACE "|" ";" WARNINGS "${WARNINGS}")
set(prefix ${WORK_DIR}/prefix)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install test: ${what} failed (${rc}):\n${out}")
  endif()
  message(STATUS "${what}: ok")
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

# The projects' configure arguments: this build's toolchain, only the fresh prefix.
set(configure_args -G "${GENERATOR}" -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DCMAKE_BUILD_TYPE=${BUILD_TYPE} -DCMAKE_PREFIX_PATH=${prefix}
    "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${LINKER_FLAGS}")
if(CUDA_ROOT)
  list(APPEND configure_args -DCUDAToolkit_ROOT=${CUDA_ROOT})
endif()

# Found in the fresh prefix, not in another install of spillway.
function(check_found_in_prefix binary_dir)
  file(STRINGS ${binary_dir}/CMakeCache.txt found REGEX "^spillway_DIR:")
  string(REGEX REPLACE "^[^=]*=" "" found "${found}")
  cmake_path(IS_PREFIX prefix "${found}" NORMALIZE inside)
  if(NOT inside)
    message(FATAL_ERROR "install test: found spillway in '${found}', not under ${prefix}")
  endif()
endfunction()

# 1. Install.
file(REMOVE_RECURSE ${WORK_DIR})
run("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})

# 2. The public headers, all of them, including only what a consumer has.
file(GLOB_RECURSE source_headers RELATIVE ${SOURCE_DIR}/include/spillway
     ${SOURCE_DIR}/include/spillway/*.hpp)
set(problems "")
foreach(h IN LISTS source_headers)
  set(installed ${prefix}/include/spillway/${h})
  if(NOT EXISTS ${installed})
    list(APPEND problems "include/spillway/${h} is not installed")
    continue()
  endif()
  file(STRINGS ${installed} includes REGEX "^[ \t]*#[ \t]*include")
  foreach(line IN LISTS includes)
    if(line MATCHES "\"" AND NOT line MATCHES "#[ \t]*include[ \t]+\"spillway/[a-z0-9_]+/[a-z0-9_]+\\.hpp\"")
      list(APPEND problems "include/spillway/${h} includes a non-public header: ${line}")
    endif()
  endforeach()
endforeach()
if(NOT source_headers)
  list(APPEND problems "no header found in ${SOURCE_DIR}/include/spillway")
endif()
foreach(p IN LISTS problems)
  message(SEND_ERROR "install test: ${p}")
endforeach()
if(problems)
  message(FATAL_ERROR "install test: the installed headers are wrong")
endif()
list(LENGTH source_headers n_headers)
message(STATUS "${n_headers} public headers installed, none includes a src/ header: ok")

# 3. Each header alone, and the umbrella target linked.
run("headers alone: configure" ${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR}/headers
    -B ${WORK_DIR}/headers ${configure_args} -DSPILLWAY_INCLUDE_DIR=${prefix}/include
    "-DSPILLWAY_WARNINGS=${WARNINGS}")
check_found_in_prefix(${WORK_DIR}/headers)
run("headers alone: build" ${CMAKE_COMMAND} --build ${WORK_DIR}/headers -j 2)
run("spillway::spillway linked" ${WORK_DIR}/headers/link_all)

# 4. The example.
run("example: configure" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/cpp/offload_and_adamw
    -B ${WORK_DIR}/example ${configure_args})
check_found_in_prefix(${WORK_DIR}/example)
run("example: build" ${CMAKE_COMMAND} --build ${WORK_DIR}/example)
run("example: run" ${WORK_DIR}/example/offload_and_adamw)
message("${run_output}")
