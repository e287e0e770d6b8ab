# Admission control, the admin API and duetctl (router/cluster/admission.c, router/cluster/admin.c,
# router/duetctl_main.c).
duet_add_test(test_router_admission SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_admission.c
              LIBS duet_router_admin TIMEOUT 120)
# The admin API over real HTTP on loopback with a fake ops table (tests/unit/router_admin_fake.h).
duet_add_test(test_router_admin SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_admin.c
              LIBS duet_router_admin PkgConfig::JANSSON Threads::Threads TIMEOUT 180)
# duetctl as a real process against an admin API started inside the test.
duet_add_test(test_duetctl SOURCES ${PROJECT_SOURCE_DIR}/tests/integration/test_duetctl.c
              LIBS duet_router_admin PkgConfig::JANSSON Threads::Threads TIMEOUT 180)
add_dependencies(test_duetctl duetctl)
