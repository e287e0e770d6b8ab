# Transfer plans: random shapes against a byte-by-byte reference copy, and refusals.
duet_add_test(transfer_plan SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transfer_plan.c
              LIBS duet_transfer TIMEOUT 300)
# Reservations: protobuf round trips, refusals of malformed / oversized / stale input, fuzz.
duet_add_test(transfer_reservation_proto
              SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transfer_reservation.c
              LIBS duet_transfer TIMEOUT 120)
