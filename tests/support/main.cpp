// Test runner entry point (Catch2 v2 or v3).
#define CATCH_CONFIG_RUNNER
#include "support/catch.hpp"

int main(int argc, char* argv[]) { return Catch::Session().run(argc, argv); }
