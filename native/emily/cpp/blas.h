// An f32 matrix as sgemm reads it, for Emily's CPU kernels that call BLAS (Linux, where
// Emily links OpenBLAS).
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace emily::blas {

// The rows x cols matrix at `a` with row and column strides (sr, sc): in place where one
// axis is packed and the other's stride spans it (row-major, or column-major as
// `trans`), with that stride as its leading dimension; else copied dense into `copy` (a
// broadcast axis, or neither packed). sgemm reads the same values either way.
struct Matrix {
  const float* p;
  CBLAS_TRANSPOSE trans = CblasNoTrans;
  int64_t ld;
  std::vector<float> copy;

  Matrix(const float* a, int64_t rows, int64_t cols, int64_t sr, int64_t sc) : p(a) {
    if (sc == 1 && (sr >= cols || rows == 1)) {
      ld = rows == 1 ? std::max<int64_t>(cols, 1) : sr;
    } else if (sr == 1 && (sc >= rows || cols == 1)) {
      trans = CblasTrans, ld = cols == 1 ? std::max<int64_t>(rows, 1) : sc;
    } else {
      copy.resize(rows * cols);
      for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) copy[i * cols + j] = a[i * sr + j * sc];
      p = copy.data(), ld = std::max<int64_t>(cols, 1);
    }
  }
};

}  // namespace emily::blas
