# Admission control, the admin API and duetctl (router/admission.c, router/admin.c,
# router/duetctl_main.c).
duet_add_test(test_router_admission SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_admission.c
              LIBS duet_router_admin TIMEOUT 120)
