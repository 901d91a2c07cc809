// MLX's own cost per op, with no host language: bench/chain.exs's reference. A chain of
// `n` alternating sin/cos on a 1x8 float32 tensor, built through MLX's C++ API and
// evaluated with mx::eval, as bench/chain.py does from Python and bench/chain.exs through
// Emily.Program.eval/3. Prints `n mean_us`: the best of five windows of `reps` runs.
#include <mlx/mlx.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace mx = mlx::core;

static double window(int n, int reps, const mx::array& x) {
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; r++) {
    mx::array y = x;
    for (int i = 1; i <= n; i++) y = (i % 2 == 0) ? mx::cos(y) : mx::sin(y);
    mx::eval(y);
    volatile float read = y.data<float>()[0];
    (void)read;
  }
  std::chrono::duration<double, std::micro> took = std::chrono::steady_clock::now() - t0;
  return took.count() / reps;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: chain REPS N...\n");
    return 2;
  }
  mx::set_default_device(mx::Device::cpu);
  std::vector<float> v(8);
  for (int i = 0; i < 8; i++) v[i] = 0.1f * i;
  mx::array x(v.data(), {1, 8}, mx::float32);
  mx::eval(x);
  int reps = std::atoi(argv[1]);
  for (int a = 2; a < argc; a++) {
    int n = std::atoi(argv[a]);
    window(n, reps / 10 + 1, x);
    double best = 1e30;
    for (int w = 0; w < 5; w++) best = std::min(best, window(n, reps, x));
    std::printf("%d %.3f\n", n, best);
  }
  return 0;
}
