# The context worker's prefix cache through a real cluster (duet-router + duet-ctx with
# cache.prefix + duet-gen, demo model): answers equal duet-generate's, hit or miss.
add_test(NAME prefix_cache_cluster
         COMMAND ${PROJECT_BINARY_DIR}/pyvenv/bin/python
                 ${PROJECT_SOURCE_DIR}/tests/integration/prefix_cache_cluster_test.py
                 ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR}/models/duet-demo)
set_tests_properties(prefix_cache_cluster PROPERTIES TIMEOUT 300 LABELS "integration;network"
                                                     RESOURCE_LOCK duet_cluster)

# The router's placement by cached prefix (placement.prefix_aware): two duet-ctx with cache.prefix
# and one duet-gen; multi-turn conversations stay on the context worker holding them.
add_test(NAME prefix_placement_cluster
         COMMAND ${PROJECT_BINARY_DIR}/pyvenv/bin/python
                 ${PROJECT_SOURCE_DIR}/tests/integration/prefix_placement_cluster_test.py
                 ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR}/models/duet-demo)
set_tests_properties(prefix_placement_cluster PROPERTIES TIMEOUT 300
                                                         LABELS "integration;network"
                                                         RESOURCE_LOCK duet_cluster)

# The generation worker's prefix cache (cache.prefix on duet-gen, every prompt prefilled there):
# hits at chunk ends, a next turn from what decoding kept, page pressure, a cancel mid-prefill;
# answers equal duet-generate's.
add_test(NAME prefix_cache_gen_cluster
         COMMAND ${PROJECT_BINARY_DIR}/pyvenv/bin/python
                 ${PROJECT_SOURCE_DIR}/tests/integration/prefix_cache_gen_cluster_test.py
                 ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR}/models/duet-demo)
set_tests_properties(prefix_cache_gen_cluster PROPERTIES TIMEOUT 300
                     LABELS "integration;network" RESOURCE_LOCK duet_cluster)
