# duet-chat-template against jinja2 configured as transformers configures it, on every published
# template x conversation x add_generation_prompt in tests/data/chat_templates, and the feature
# snippets (about 2900 cases, about 15 s on 2 cores). Fails (never skips) without the tests' venv.
add_test(NAME chat_template_oracle
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/integration/run_chat_template_oracle.sh
                 ${PROJECT_BINARY_DIR})
set_tests_properties(chat_template_oracle PROPERTIES TIMEOUT 120 LABELS "integration")
