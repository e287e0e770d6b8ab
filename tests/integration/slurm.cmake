# `duet sbatch` on a real Slurm started on this machine (slurmctld + slurmd + munged in a temp
# folder): the job's answers against duet-generate, then an ordered scancel that leaves nothing
# running. Fails (never skips) without slurm-wlm / munge (deploy/install-deps.sh --tests).
add_test(NAME test_slurm
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/integration/test_slurm.sh ${PROJECT_SOURCE_DIR}
                 ${PROJECT_BINARY_DIR})
set_tests_properties(test_slurm PROPERTIES TIMEOUT 360 LABELS "integration;network")
