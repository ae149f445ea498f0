#include <cstdio>
#include <iostream>

#include "support/scenario.h"
#include "tessera/core/env.h"

namespace tessera::testing {

std::map<std::string, ScenarioFn>& scenarios() {
  static std::map<std::string, ScenarioFn> m;
  return m;
}

std::shared_ptr<distributed::Communicator> comm() {
  static std::shared_ptr<distributed::Communicator> c;
  if (!c) {
    distributed::CommOptions o;
    o.timeout = std::chrono::milliseconds(env::get_int("TESSERA_TEST_TIMEOUT_MS", 1).value_or(30000));
    if (auto chunk = env::get_int("TESSERA_TEST_SHM_CHUNK", 4096)) o.shm_chunk_bytes = static_cast<size_t>(*chunk);
    c = distributed::Communicator::create(distributed::World::from_env(), o);
  }
  return c;
}

}  // namespace tessera::testing

int main(int argc, char** argv) {
  using namespace tessera::testing;
  if (argc < 2 || !scenarios().count(argv[1])) {
    std::cerr << "usage: tessera_test_worker SCENARIO [ARGS...]; scenarios:";
    for (auto& [k, v] : scenarios()) std::cerr << " " << k;
    std::cerr << "\n";
    return 2;
  }
  ScenarioArgs a;
  for (int i = 2; i < argc; ++i) a.args.push_back(argv[i]);
  try {
    int rc = scenarios()[argv[1]](a);
    std::fflush(stdout);
    return rc;
  } catch (const tessera::CommError& e) {
    std::cerr << "CommError: " << e.what() << "\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "FAILED: " << e.what() << "\n";
    return 1;
  }
}
