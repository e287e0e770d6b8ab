# libduet-cupti-trace.so: a CUPTI injection library recording every kernel's start and end in a
# CUDA process (bench/cupti_trace.c; tools/trace_step.py makes a per-kernel table of a decode
# step from it). Built when the CUDA toolkit has CUPTI.
if(DUET_HAVE_CUDA AND TARGET CUDA::cupti)
  add_library(duet-cupti-trace SHARED ${CMAKE_CURRENT_LIST_DIR}/cupti_trace.c)
  duet_target_defaults(duet-cupti-trace)
  target_link_libraries(duet-cupti-trace PRIVATE CUDA::cupti)
endif()
