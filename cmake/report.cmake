# pdserve bench's report (src/report): results JSON in, one self-contained
# report.html out (inline CSS and SVG). Library, tests, and the screenshot.
add_library(pd_report STATIC src/report/report.c src/report/extract.c src/report/svg.c)
target_link_libraries(pd_report PUBLIC pd_base PkgConfig::JANSSON m)

if(PD_BUILD_TESTS)
  # The unit test keeps every report it writes under report_cases/, and
  # report_cases checks each with the XML parser (tests/report/report_check.py).
  pd_add_test(test_report tests/report/test_report.c pd_report)
  target_include_directories(test_report PRIVATE ${CMAKE_SOURCE_DIR}/src/report)
  set_tests_properties(test_report PROPERTIES
                       ENVIRONMENT PD_REPORT_KEEP=${CMAKE_BINARY_DIR}/report_cases
                       FIXTURES_SETUP report_cases)
  add_executable(report_render tests/report/report_render.c)
  target_link_libraries(report_render PRIVATE pd_report)
  set_target_properties(report_render PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  find_program(PD_REPORT_PYTHON3 python3 PATHS /usr/bin NO_DEFAULT_PATH)
  if(NOT PD_REPORT_PYTHON3)
    set(PD_REPORT_PYTHON3 python3)
  endif()
  add_test(NAME report_cases
           COMMAND ${PD_REPORT_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/report/report_check.py
                   --cases ${CMAKE_BINARY_DIR}/report_cases)
  set_tests_properties(report_cases PROPERTIES FIXTURES_REQUIRED report_cases)
  # A realistic run (tests/report/fixture.json) rendered and checked.
  add_test(NAME report_fixture
           COMMAND ${PD_REPORT_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/report/report_check.py
                   --render $<TARGET_FILE:report_render>
                   ${CMAKE_SOURCE_DIR}/tests/report/fixture.json ${CMAKE_BINARY_DIR}/report_fixture)
  # The same page in headless Chromium: a PNG that is not blank (SKIPPED
  # without chromium: scripts/deps.sh installs it).
  add_test(NAME report_screenshot
           COMMAND bash ${CMAKE_SOURCE_DIR}/tests/report/screenshot.sh $<TARGET_FILE:report_render>
                   ${CMAKE_SOURCE_DIR}/tests/report/fixture.json ${CMAKE_BINARY_DIR}/report_screenshot)
  set_tests_properties(report_screenshot PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 120)
endif()

# The progress lines of pdserve sim --seeds (src/base/progress.c; the same
# issue): stderr only, summary and exit codes unchanged.
if(PD_BUILD_TESTS)
  add_test(NAME sim_progress_lines
           COMMAND ${CMAKE_COMMAND} -DPDSERVE=$<TARGET_FILE:pdserve>
                   -P ${CMAKE_SOURCE_DIR}/tests/report/progress_cli.cmake)
endif()
