# Every binary: --help (exit 0, usage on stdout), --version, and an unknown option refused. Included from the
# top-level CMakeLists.txt after bench/, so that every binary target is defined by then.
set(DUET_HELP_TARGETS duet duet-router duetctl duet-ctx duet-gen duet-generate duet-http-echo
    duet-test-worker duet-bench duet-bench-kernels duet-bench-xfer bench_tokenizer duet-xfer-peer
    duet-bench-gemm-cuda duet-bench-model-cuda duet-bench-launch-floor duet-bench-suspend
    duet-bench-move duet-bench-splitkv duet-bench-splitkv-cuda duet-bench-tune duet-bench-grammar duet-jschema-walk
    tokenizer_oracle_driver duet-chat-template duet-splitkv-plan)
set(DUET_HELP_FILES "")
set(DUET_HELP_DEPS "")
foreach(t ${DUET_HELP_TARGETS})
  if(TARGET ${t})
    list(APPEND DUET_HELP_FILES "$<TARGET_FILE:${t}>")
    list(APPEND DUET_HELP_DEPS ${t})
  endif()
endforeach()
list(JOIN DUET_HELP_FILES ":" DUET_HELP_JOINED)
duet_add_test(test_binaries_help SOURCES ${PROJECT_SOURCE_DIR}/tests/integration/test_binaries_help.c
              TIMEOUT 120)
if(DUET_HAVE_CUDA)
  set(_cuda 1)
else()
  set(_cuda 0)
endif()
target_compile_definitions(test_binaries_help PRIVATE "DUET_HELP_BINARIES=\"${DUET_HELP_JOINED}\""
                           "DUET_EXPECT_VERSION=\"${PROJECT_VERSION}\"" DUET_EXPECT_CUDA=${_cuda})
add_dependencies(test_binaries_help ${DUET_HELP_DEPS})
