// The AVX-512 build of rounding.cpp (setup.py compiles it with -march=x86-64-v4 -mavx512bf16). A file of its
// own so that the two builds' object files differ and setup.py can compile them at the same time.
#include "rounding.cpp"
