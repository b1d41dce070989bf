// Preloaded into the mpirun tests of an ASan build (tests/CMakeLists.txt): dlclose does nothing, so
// that OpenMPI's components stay loaded to the end and LeakSanitizer names the library of each of
// their leaks (tests/dist/lsan.supp) from the allocating frame alone.
extern "C" int dlclose(void*) { return 0; }
