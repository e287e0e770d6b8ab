# The generation group's collectives (group/, issue 39) across real ranks. Not Criterion suites:
# each program runs as N ranks under mpirun (label `mpi`). The MPI settings: ob1 over shared
# memory, no network probing, more ranks than cores allowed; every test has a TIMEOUT so a hang
# cannot stall ctest.
set(DUET_MPI_TEST_ENV
    "OMPI_MCA_pml=ob1;OMPI_MCA_btl=self,vader;OMPI_MCA_btl_vader_single_copy_mechanism=none;OMPI_MCA_oob_tcp_if_include=lo;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
set(DUET_MPIRUN ${MPIEXEC_EXECUTABLE} --oversubscribe --allow-run-as-root)

add_executable(test_comm_mpi ${CMAKE_CURRENT_LIST_DIR}/test_comm_mpi.c)
duet_target_defaults(test_comm_mpi)
target_link_libraries(test_comm_mpi PRIVATE duet_group m)

foreach(n 2 4)
  add_test(NAME group_comm_mpi_n${n}
           COMMAND ${DUET_MPIRUN} ${MPIEXEC_NUMPROC_FLAG} ${n} $<TARGET_FILE:test_comm_mpi>)
  set_tests_properties(group_comm_mpi_n${n} PROPERTIES TIMEOUT 60 LABELS mpi
                       ENVIRONMENT "${DUET_MPI_TEST_ENV}")
endforeach()
add_test(NAME group_comm_mpi_launched COMMAND test_comm_mpi --launched-env)
set_tests_properties(group_comm_mpi_launched PROPERTIES TIMEOUT 30 LABELS mpi)
# One rank SIGKILLs itself mid-loop: mpirun must end the job nonzero, in bounded time, with no
# rank left behind (kill_rank.sh checks all three).
add_test(NAME group_comm_mpi_kill
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/kill_rank.sh ${MPIEXEC_EXECUTABLE}
                 $<TARGET_FILE:test_comm_mpi> 3)
set_tests_properties(group_comm_mpi_kill PROPERTIES TIMEOUT 60 LABELS mpi
                     ENVIRONMENT "${DUET_MPI_TEST_ENV}")

# The nccl transport on device buffers, 2 ranks with a GPU each; skips (exit 77) where fewer
# than 2 CUDA devices are visible, as on CI.
if(DUET_HAVE_NCCL)
  add_executable(test_comm_nccl ${CMAKE_CURRENT_LIST_DIR}/test_comm_nccl.c)
  duet_target_defaults(test_comm_nccl)
  target_link_libraries(test_comm_nccl PRIVATE duet_group_nccl m)
  add_test(NAME group_comm_nccl_n2
           COMMAND ${DUET_MPIRUN} ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:test_comm_nccl>)
  set_tests_properties(group_comm_nccl_n2 PROPERTIES TIMEOUT 120 LABELS mpi SKIP_RETURN_CODE 77
                       ENVIRONMENT "${DUET_MPI_TEST_ENV}")
endif()

# A group's forward (engine/shard.h) against the single-process model: the demo model at cp x tp
# 2x1, 4x1, 1x2, 2x2 and a q_lora fixture at 2x1 (tests/group/test_engine_group.c).
add_executable(test_engine_group ${CMAKE_CURRENT_LIST_DIR}/test_engine_group.c)
duet_target_defaults(test_engine_group)
target_link_libraries(test_engine_group PRIVATE duet_engine duet_group m)
foreach(case "demo;models/duet-demo;2;1" "demo;models/duet-demo;4;1" "demo;models/duet-demo;1;2"
        "demo;models/duet-demo;2;2" "mla;tests/fixtures/mla-first-bf16-mixed-norenorm;2;1")
  list(GET case 0 tag)
  list(GET case 1 dir)
  list(GET case 2 cp)
  list(GET case 3 tp)
  math(EXPR n "${cp} * ${tp}")
  add_test(NAME group_engine_${tag}_cp${cp}_tp${tp}
           COMMAND ${DUET_MPIRUN} ${MPIEXEC_NUMPROC_FLAG} ${n} $<TARGET_FILE:test_engine_group>
                   ${PROJECT_SOURCE_DIR}/${dir} ${cp} ${tp})
  set_tests_properties(group_engine_${tag}_cp${cp}_tp${tp} PROPERTIES TIMEOUT 120 LABELS mpi
                       ENVIRONMENT "${DUET_MPI_TEST_ENV}")
endforeach()

# The autotuner's profiling split over real ranks with an injected cost model
# (tests/group/test_tune_group.c): each pair profiled once, equal tables, equal to one rank alone.
add_executable(test_tune_group ${CMAKE_CURRENT_LIST_DIR}/test_tune_group.c)
duet_target_defaults(test_tune_group)
target_link_libraries(test_tune_group PRIVATE duet_kernels duet_group m)
foreach(n 2 3 4)
  add_test(NAME group_tune_n${n}
           COMMAND ${DUET_MPIRUN} ${MPIEXEC_NUMPROC_FLAG} ${n} $<TARGET_FILE:test_tune_group>)
  set_tests_properties(group_tune_n${n} PROPERTIES TIMEOUT 60 LABELS mpi
                       ENVIRONMENT "${DUET_MPI_TEST_ENV}")
endforeach()
