defmodule Emily.SampleProgram do
  @moduledoc false
  # The program the Program tests share: exp(-sum((x * w + x)^2, axis 1) / 100), as
  # elementwise chains (fusable) around a reduction. Slots: 0 = x, 1 = w, 2 = k (-0.01),
  # then one per instruction.

  def instructions do
    [
      {:multiply, [0, 1]},
      {:add, [3, 0]},
      {:square, [4]},
      {:sum, [5, [1], false]},
      {:multiply, [6, 2]},
      {:exp, [7]}
    ]
  end

  # [x, w, k] on the current stream.
  def inputs do
    [
      Emily.from_list([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], {:f, 32}, shape: {2, 3}),
      Emily.from_list([0.5, -1.0, 2.0, 1.0, 0.0, -0.5], {:f, 32}, shape: {2, 3}),
      Emily.from_list([-0.01], {:f, 32}, shape: {})
    ]
  end

  # By hand: x*w + x = [1.5, 0, 9 | 8, 5, 3]; squares [2.25, 0, 81 | 64, 25, 9];
  # sums [83.25, 98]; exp(-0.8325) = 0.434947, exp(-0.98) = 0.375311.
  def expected, do: [0.434947, 0.375311]
end
