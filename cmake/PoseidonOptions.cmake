# Build options. POSEIDON_WITH_RDMA / POSEIDON_WITH_CUDA are AUTO by default: on when libibverbs
# headers / nvcc are found, off otherwise; the build and the tests pass with both off.

set(POSEIDON_WITH_RDMA "AUTO" CACHE STRING "Build the RDMA (libibverbs) transport: AUTO, ON or OFF")
set(POSEIDON_WITH_CUDA "AUTO" CACHE STRING "Build the CUDA GPU path: AUTO, ON or OFF")
option(POSEIDON_SANITIZE "Build with AddressSanitizer and UndefinedBehaviorSanitizer" OFF)
option(POSEIDON_TSAN "Build with ThreadSanitizer (not with POSEIDON_SANITIZE)" OFF)
option(POSEIDON_WERROR "Treat compiler warnings as errors" OFF)
option(POSEIDON_FUZZ "Build libFuzzer targets (needs clang)" OFF)

# --- RDMA -------------------------------------------------------------------------------------
find_path(POSEIDON_IBVERBS_INCLUDE infiniband/verbs.h)
find_library(POSEIDON_IBVERBS_LIBRARY ibverbs)
if(POSEIDON_WITH_RDMA STREQUAL "AUTO")
  if(POSEIDON_IBVERBS_INCLUDE AND POSEIDON_IBVERBS_LIBRARY)
    set(POSEIDON_RDMA_ENABLED ON)
  else()
    set(POSEIDON_RDMA_ENABLED OFF)
  endif()
elseif(POSEIDON_WITH_RDMA)
  if(NOT (POSEIDON_IBVERBS_INCLUDE AND POSEIDON_IBVERBS_LIBRARY))
    message(FATAL_ERROR "POSEIDON_WITH_RDMA=ON but libibverbs was not found (apt install libibverbs-dev)")
  endif()
  set(POSEIDON_RDMA_ENABLED ON)
else()
  set(POSEIDON_RDMA_ENABLED OFF)
endif()

# --- CUDA -------------------------------------------------------------------------------------
if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
if(POSEIDON_WITH_CUDA STREQUAL "AUTO")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(POSEIDON_CUDA_ENABLED ON)
  else()
    set(POSEIDON_CUDA_ENABLED OFF)
  endif()
elseif(POSEIDON_WITH_CUDA)
  set(POSEIDON_CUDA_ENABLED ON)
else()
  set(POSEIDON_CUDA_ENABLED OFF)
endif()
if(POSEIDON_CUDA_ENABLED AND NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 90)
endif()
if(POSEIDON_CUDA_ENABLED)
  # The runtime and cuBLAS as shared libraries (CUDA::cudart, CUDA::cublas); no device code of
  # our own needs nvcc so far, the toolkit's libraries do the work.
  find_package(CUDAToolkit REQUIRED)
endif()

message(STATUS "Poseidon: RDMA=${POSEIDON_RDMA_ENABLED} CUDA=${POSEIDON_CUDA_ENABLED} "
               "sanitize=${POSEIDON_SANITIZE} tsan=${POSEIDON_TSAN} werror=${POSEIDON_WERROR} "
               "fuzz=${POSEIDON_FUZZ}")
if(POSEIDON_SANITIZE AND POSEIDON_TSAN)
  message(FATAL_ERROR "POSEIDON_SANITIZE (ASan) and POSEIDON_TSAN cannot be combined: use two build "
                      "directories (scripts/test.sh does)")
endif()

# --- Warnings and sanitizers, applied to our own targets through poseidon_compile_options ---------
add_library(poseidon_compile_options INTERFACE)
target_compile_options(poseidon_compile_options INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wcast-align -Wunused
  -Woverloaded-virtual -Wnull-dereference -Wimplicit-fallthrough
  $<$<BOOL:${POSEIDON_WERROR}>:-Werror>)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  # GCC 12 reports false positives from inlined libstdc++ / Boost code.
  target_compile_options(poseidon_compile_options INTERFACE -Wno-maybe-uninitialized
    -Wno-array-bounds -Wno-stringop-overflow -Wno-null-dereference)
endif()
if(POSEIDON_SANITIZE)
  # Every UBSan check but vptr: sanitizer_common tests memory through a pipe(2) for it, so a
  # process out of file descriptors (a state the daemons must survive, ops_emfile_backoff) gets
  # false "invalid vptr" reports for valid objects, which -fno-sanitize-recover makes aborts.
  set(_san -fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined
      -fno-omit-frame-pointer)
  target_compile_options(poseidon_compile_options INTERFACE ${_san})
  target_link_options(poseidon_compile_options INTERFACE ${_san})
endif()
if(POSEIDON_TSAN)
  # The thread model (docs/thread_model.md) checked: data races in our code, the tests' threads
  # and the daemons they start. Third-party libraries (gRPC, protobuf, OpenBLAS) are not
  # instrumented; tests/tsan.supp names what is theirs.
  set(_tsan -fsanitize=thread -fno-omit-frame-pointer)
  target_compile_options(poseidon_compile_options INTERFACE ${_tsan})
  target_link_options(poseidon_compile_options INTERFACE ${_tsan})
endif()
if(POSEIDON_RDMA_ENABLED)
  target_compile_definitions(poseidon_compile_options INTERFACE POSEIDON_HAVE_RDMA=1)
endif()
if(POSEIDON_CUDA_ENABLED)
  target_compile_definitions(poseidon_compile_options INTERFACE POSEIDON_HAVE_CUDA=1)
endif()
target_include_directories(poseidon_compile_options INTERFACE ${PROJECT_SOURCE_DIR})

# poseidon_test(name SOURCES ... LIBS ...): a GoogleTest binary registered with CTest.
function(poseidon_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gmock GTest::gtest_main poseidon_compile_options)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60
    PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS}")
endfunction()
