# DUET_SANITIZE: build every C target with the compiler's sanitizers (docs/sanitizers.md).
# A list as -fsanitize= takes it: "address,undefined" (CI's Debug build), "thread" (CI's run of
# the thread pool and the workers), "undefined", "leak"; empty is off. Works with gcc and clang.
# Included from the top-level CMakeLists.txt before any target, so that every library, binary and
# test is instrumented alike (a leak or race is found in whatever duet code a test reaches, and
# ASan needs every object of a binary built with it to see every overflow).
set(DUET_SANITIZE "" CACHE STRING
    "Sanitizers for every C target, as -fsanitize= takes them (address,undefined | thread | ...); empty: off")

if(DUET_SANITIZE)
  string(REPLACE "," ";" _duet_san_list "${DUET_SANITIZE}")
  foreach(s ${_duet_san_list})
    if(NOT s MATCHES "^(address|undefined|thread|leak)$")
      message(FATAL_ERROR "DUET_SANITIZE=${DUET_SANITIZE}: '${s}' is not one of address, undefined, thread, leak")
    endif()
  endforeach()
  if("thread" IN_LIST _duet_san_list AND ("address" IN_LIST _duet_san_list OR "leak" IN_LIST _duet_san_list))
    message(FATAL_ERROR "DUET_SANITIZE=${DUET_SANITIZE}: thread cannot be combined with address or leak "
                        "(each needs the whole address space its own way): make two builds")
  endif()
  # The CUDA sources are compiled by nvcc with its own host compiler, uninstrumented, and the CUDA
  # driver maps device memory where ASan and TSan keep their shadow: a sanitized build is a
  # CPU-only build.
  if(DUET_WITH_CUDA)
    message(FATAL_ERROR "DUET_SANITIZE=${DUET_SANITIZE} needs -DDUET_WITH_CUDA=OFF: the CUDA code cannot be "
                        "sanitized (nvcc compiles it uninstrumented, the driver's mappings clash with the shadow memory)")
  endif()
  set(DUET_SANITIZE_FLAGS -fsanitize=${DUET_SANITIZE} -fno-omit-frame-pointer)
  if("undefined" IN_LIST _duet_san_list)
    # UBSan only prints and carries on by default: abort instead, so that a report fails the test
    list(APPEND DUET_SANITIZE_FLAGS -fno-sanitize-recover=undefined)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C>:${DUET_SANITIZE_FLAGS}>")
  add_link_options(${DUET_SANITIZE_FLAGS})
  message(STATUS "duet: sanitizers ${DUET_SANITIZE}")
endif()

# duet_sanitize_test_env(): give every test of the calling directory (ctest's ENVIRONMENT, which
# the processes a test starts inherit) the sanitizers' options: stop at the first report with a
# failing exit status, look for leaks at exit, and the suppressions of tools/sanitizers/ (only
# reports from outside duet, each with its reason there). Called at the end of each directory that
# adds tests, since a test's properties can only be set from its own directory.
function(duet_sanitize_test_env)
  if(NOT DUET_SANITIZE)
    return()
  endif()
  get_property(tests DIRECTORY PROPERTY TESTS)
  if(NOT tests)
    return()
  endif()
  set(supp ${PROJECT_SOURCE_DIR}/tools/sanitizers)
  # Reports go to files, one per process: Criterion's --tap=- silences the tests' stderr, and the
  # duet processes a test starts write theirs to logs few tests show. .ci/run prints the files and
  # fails on any; locally, look in BUILD/sanitizer-logs after a run (report.<program>.<pid>).
  set(logs ${PROJECT_BINARY_DIR}/sanitizer-logs)
  file(MAKE_DIRECTORY ${logs})
  set_property(TEST ${tests} APPEND PROPERTY ENVIRONMENT
               "ASAN_OPTIONS=log_path=${logs}/report:log_exe_name=1:detect_leaks=1:halt_on_error=1:abort_on_error=1:fast_unwind_on_malloc=0:strict_string_checks=1:detect_stack_use_after_return=1"
               "LSAN_OPTIONS=log_path=${logs}/report:log_exe_name=1:suppressions=${supp}/lsan.supp:print_suppressions=0"
               "UBSAN_OPTIONS=log_path=${logs}/report:log_exe_name=1:halt_on_error=1:abort_on_error=1:print_stacktrace=1"
               "TSAN_OPTIONS=log_path=${logs}/report:log_exe_name=1:halt_on_error=1:abort_on_error=1:second_deadlock_stack=1:suppressions=${supp}/tsan.supp:print_suppressions=0")
endfunction()
