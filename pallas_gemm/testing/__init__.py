"""What the tests and benchmarks of every family share: the float64 reference and the one
tolerance table (`reference`), and the grouped problems' shapes (`grouped_shapes`)."""
