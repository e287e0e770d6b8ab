# deploy/launcher: the cluster-file parser of `duet up` (pure: no processes, no sockets).
duet_add_test(test_launcher_cluster SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_launcher_cluster.c
              LIBS duet_launcher TIMEOUT 120)
# deploy/launcher: the command lines and stops of Helix generation groups, with real mpirun groups
# of a stand-in script (Open MPI is a dependency: deploy/install-deps.sh).
duet_add_test(test_launcher_procs SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_launcher_procs.c
              LIBS duet_launcher TIMEOUT 120)
# deploy/launcher: `duet sbatch`'s batch script (pure text; the job runs on a real Slurm in
# tests/integration/test_slurm.sh).
duet_add_test(test_launcher_sbatch SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_launcher_sbatch.c
              LIBS duet_launcher TIMEOUT 60)
