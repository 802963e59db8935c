// The doctest main of every test executable, and the summary of the one test file a run is for.
//
// tests/meson.build compiles several test files into one executable where they share most of what they include (one
// compilation of libtorch's and Asio's headers instead of one per file), and each meson test runs one file's cases
// (`--source-file=*/test_NAME.cpp`, with CORPC_TEST_FILE=test_NAME.cpp). doctest's own summary then counts the other
// files' cases as skipped; this listener prints the run's file alone, in the same form, on a line of its own:
//   [corpc] test_rpc.cpp: test cases: 22 | 21 passed | 0 failed | 1 skipped
// where "skipped" are that file's cases that a skip decorator left out (no GPU, no IPv6, ...). scripts/suite.sh
// counts that line when it is there.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace {

class FileSummary : public doctest::IReporter {
 public:
  explicit FileSummary(const doctest::ContextOptions&) {
    if (const char* f = std::getenv("CORPC_TEST_FILE")) file_ = f;
  }

  void test_case_start(const doctest::TestCaseData& tc) override { counting_ = ours(tc); }
  void test_case_end(const doctest::CurrentTestCaseStats& stats) override {
    if (!counting_) return;
    ++(stats.testCaseSuccess ? passed_ : failed_);
  }
  void test_case_skipped(const doctest::TestCaseData& tc) override {
    if (tc.m_skip && ours(tc)) ++skipped_;
  }
  void test_run_end(const doctest::TestRunStats&) override {
    if (file_.empty()) return;
    std::printf("[corpc] %.*s: test cases: %d | %d passed | %d failed | %d skipped\n", static_cast<int>(file_.size()),
                file_.data(), passed_ + failed_ + skipped_, passed_, failed_, skipped_);
    std::fflush(stdout);
  }

  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}

 private:
  bool ours(const doctest::TestCaseData& tc) const {
    std::string_view path(tc.m_file.c_str());
    auto slash = path.rfind('/');
    return !file_.empty() && path.substr(slash == std::string_view::npos ? 0 : slash + 1) == file_;
  }

  std::string_view file_;
  bool counting_ = false;
  int passed_ = 0, failed_ = 0, skipped_ = 0;
};

}  // namespace

REGISTER_LISTENER("corpc_file_summary", 1, FileSummary);
