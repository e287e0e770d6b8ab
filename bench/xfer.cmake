# duet-bench-xfer: bandwidth (1-256 MiB, vs memcpy) and one-page latency of the UCX transfer
# runtime between two processes, over shared memory and tcp, on loopback or across network
# namespaces (--netns, --net-devices; bench/bench_xfer.c).
add_executable(duet-bench-xfer ${CMAKE_CURRENT_LIST_DIR}/bench_xfer.c)
duet_target_defaults(duet-bench-xfer)
target_compile_options(duet-bench-xfer PRIVATE -O2)
target_link_libraries(duet-bench-xfer PRIVATE duet_transfer)
if(DUET_HAVE_CUDA) # --transport cuda: device pools
  target_compile_definitions(duet-bench-xfer PRIVATE DUET_HAVE_CUDA=1)
  target_link_libraries(duet-bench-xfer PRIVATE CUDA::cudart_static)
endif()
