// Threads for the hand-written CPU kernels: ATen's OpenMP parallel_for, without ATen's headers.
//
// The kernels used to include <torch/extension.h> for at::parallel_for alone (and pybind11 for their entry
// points), and torch's headers were most of every build's compile time. This is the same split ATen's OpenMP
// backend makes (ATen/ParallelOpenMP.h: at most `threads` threads, each one contiguous chunk of
// ceil(range / threads) items, none for ranges within one grain), so partial sums per task or per thread fall
// as they did. The thread count is torch.get_num_threads(), passed by every entry point (cnns/kernels/*.py): the
// extension links libgomp.so.1, which resolves to the copy torch has loaded, but only the count torch was told
// is the count the user asked for, on whatever thread calls.

#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace cnns_kernels {

// f(first, last) over contiguous chunks of [begin, end), on up to `threads` OpenMP threads.
template <typename F>
void parallel_for(int64_t threads, int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t range = end - begin;
  grain = std::max<int64_t>(grain, 1);
  if (threads <= 1 || range <= grain || omp_in_parallel()) {
    f(begin, end);
    return;
  }
  const int64_t wanted = std::min<int64_t>(threads, (range + grain - 1) / grain);
#pragma omp parallel num_threads(static_cast<int>(wanted))
  {
    const int64_t team = omp_get_num_threads(), index = omp_get_thread_num();
    const int64_t chunk = (range + team - 1) / team;
    const int64_t first = begin + index * chunk;
    if (first < end) f(first, std::min(end, first + chunk));
  }
}

// The calling thread's index within parallel_for's team (0 outside one): a per-thread buffer's slot.
inline int64_t thread_index() { return omp_get_thread_num(); }

// How many threads parallel_for runs `tasks` one-item tasks on: `threads`, unless the build lost OpenMP
// (compiled without -fopenmp the pragma is ignored: one thread, whatever torch.set_num_threads says).
inline int64_t parallel_threads(int64_t threads, int64_t tasks) {
  int64_t seen[1024] = {0};
  parallel_for(std::min<int64_t>(threads, 1024), 0, tasks, 1, [&](int64_t, int64_t) { seen[thread_index()] = 1; });
  int64_t used = 0;
  for (int64_t s : seen) used += s;
  return used;
}

}  // namespace cnns_kernels
