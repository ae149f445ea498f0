// The table of environment variables (core/env.h): docs/cli.md lists exactly its rows, every
// TESSERA_* name the sources use is in it, a name missing from it is refused when read, and
// bools mean their value (TESSERA_NO_DIRECT_IO=0 leaves direct I/O on).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "support/build_paths.h"
#include "support/test_util.h"
#include "tessera/core/env.h"

namespace fs = std::filesystem;
using tessera::env::SetBy;

namespace {

std::string set_by_word(SetBy s) {
  switch (s) {
    case SetBy::User: return "user";
    case SetBy::Tessera: return "tessera";
    case SetBy::Test: return "test";
  }
  return "?";
}

std::string trim(const std::string& s) {
  const auto a = s.find_first_not_of(' ');
  return a == std::string::npos ? "" : s.substr(a, s.find_last_not_of(' ') - a + 1);
}

// The rows of docs/cli.md's "Environment variables" table: name -> its cells.
std::map<std::string, std::vector<std::string>> documented_rows() {
  std::ifstream in(std::string(TESSERA_SOURCE_DIR) + "/docs/cli.md");
  std::string line;
  bool in_section = false;
  std::map<std::string, std::vector<std::string>> rows;
  while (std::getline(in, line)) {
    if (line.rfind("## ", 0) == 0) in_section = line == "## Environment variables";
    if (!in_section || line.rfind("| `", 0) != 0) continue;
    std::vector<std::string> cells;
    std::string cell;
    for (size_t i = 1; i < line.size(); ++i) {
      if (line[i] == '\\' && i + 1 < line.size() && line[i + 1] == '|') {
        cell += '|';
        ++i;
      } else if (line[i] == '|') {
        cells.push_back(trim(cell));
        cell.clear();
      } else {
        cell += line[i];
      }
    }
    if (!cells.empty()) rows[cells[0].substr(1, cells[0].size() - 2)] = cells;  // `NAME`
  }
  return rows;
}

}  // namespace

TEST(Env, DocsListTheTableOfVariables) {
  const auto rows = documented_rows();
  ASSERT_FALSE(rows.empty()) << "docs/cli.md has no \"## Environment variables\" table";
  std::set<std::string> in_table;
  for (const auto& v : tessera::env::variables()) {
    in_table.insert(v.name);
    auto it = rows.find(v.name);
    if (it == rows.end()) {
      ADD_FAILURE() << v.name << " is in core/env.cpp's table but not in docs/cli.md";
      continue;
    }
    const std::vector<std::string>& c = it->second;
    ASSERT_EQ(c.size(), 5u) << v.name;
    EXPECT_EQ(c[1], v.type) << v.name;
    EXPECT_EQ(c[2], v.default_value) << v.name;
    EXPECT_EQ(c[3], set_by_word(v.set_by)) << v.name;
    EXPECT_EQ(c[4], v.meaning) << v.name;
  }
  for (const auto& [name, cells] : rows) EXPECT_TRUE(in_table.count(name)) << name << " is documented but not in the table";
}

// Every "TESSERA_..." string in the library, the CLI, the examples and the tests (a read, a
// variable set for a child, a message naming one) is a variable of the table.
TEST(Env, EveryTesseraNameInTheSourcesIsInTheTable) {
  const std::regex name("\"(TESSERA_[A-Z0-9_]+)");
  std::set<std::string> in_table;
  for (const auto& v : tessera::env::variables()) in_table.insert(v.name);
  int files = 0;
  for (const char* dir : {"src", "tools", "examples", "tests", "bench"}) {
    for (const auto& e : fs::recursive_directory_iterator(std::string(TESSERA_SOURCE_DIR) + "/" + dir)) {
      const std::string ext = e.path().extension().string();
      if (!e.is_regular_file() || (ext != ".cpp" && ext != ".h")) continue;
      ++files;
      const std::string text = tessera::testing::read_bytes(e.path().string());
      for (std::sregex_iterator m(text.begin(), text.end(), name), end; m != end; ++m)
        EXPECT_TRUE(in_table.count((*m)[1].str())) << (*m)[1].str() << " in " << e.path().string()
                                                   << " is not in core/env.cpp's table";
    }
  }
  EXPECT_GT(files, 100);
}

TEST(Env, ANameMissingFromTheTableIsRefusedWhenRead) {
  const std::string missing = std::string("TESSERA_") + "NOT_A_VARIABLE";  // kept out of the scan above
  const std::string e = tessera::testing::error_of([&] { tessera::env::get(missing); });
  EXPECT_CONTAINS(e, missing + " is read but is not in the table of environment variables");
  EXPECT_CONTAINS(e, "src/tessera/core/env.cpp");
  EXPECT_NO_THROW(tessera::env::get("PATH"));  // not Tessera's: the launchers' and the system's pass
}

TEST(Env, BoolsMeanTheirValue) {
  for (const auto& [value, want] : std::map<std::string, bool>{{"0", false}, {"off", false}, {"1", true}, {"Yes", true}}) {
    ::setenv("TESSERA_NO_DIRECT_IO", value.c_str(), 1);
    EXPECT_EQ(tessera::env::get_bool("TESSERA_NO_DIRECT_IO"), want) << value;
  }
  ::setenv("TESSERA_NO_DIRECT_IO", "maybe", 1);
  EXPECT_CONTAINS(tessera::testing::error_of([] { tessera::env::get_bool("TESSERA_NO_DIRECT_IO"); }),
                  "TESSERA_NO_DIRECT_IO='maybe' is not a boolean");
  ::unsetenv("TESSERA_NO_DIRECT_IO");
}
