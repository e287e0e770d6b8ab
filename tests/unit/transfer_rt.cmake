# The UCX transfer runtime (transfer/xfer*.c): in-process state machines and refusals, and real
# multi-process transfers through the test-only helper duet-xfer-peer.
add_executable(duet-xfer-peer ${PROJECT_SOURCE_DIR}/tests/integration/transfer_peer.c)
duet_target_defaults(duet-xfer-peer)
target_link_libraries(duet-xfer-peer PRIVATE duet_transfer)

duet_add_test(transfer_procs SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transfer_procs.c
              LIBS duet_transfer TIMEOUT 150)
target_compile_definitions(transfer_procs PRIVATE DUET_XFER_PEER="$<TARGET_FILE:duet-xfer-peer>")
add_dependencies(transfer_procs duet-xfer-peer)
duet_add_test(transfer_local SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transfer_local.c
              LIBS duet_transfer TIMEOUT 60)
# Device pools (DUET_XFER_MEM_CUDA): refused without UCX CUDA transports (everywhere); real
# transfers between device and host pools where a device and a CUDA-built UCX are present.
if(DUET_HAVE_CUDA)
  duet_add_test(transfer_cuda SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transfer_cuda.c
                LIBS duet_transfer CUDA::cudart_static TIMEOUT 120)
endif()
