# The worker glue for moving a running request between generation workers (issue 37): pools from
# duet_worker_pool_alloc (the replay pool too), duet_worker_layout's replay_rows, a real transfer
# of a speculating sequence into a second model instance, duet_model_seq_set_received.
duet_add_test(worker_move SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_worker_move.c LIBS duet_worker
              TIMEOUT 120)
