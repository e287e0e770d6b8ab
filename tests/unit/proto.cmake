# proto/: framing of Envelopes on TCP streams.
duet_add_test(proto_frame SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_proto_frame.c
              LIBS duet_proto TIMEOUT 120)
