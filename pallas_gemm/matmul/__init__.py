"""The dense GEMM family: `gemm`, `dot_general`, the layers `dense` and `mlp`, and its
backends, one module each (`xla`, `triton`, `mosaic`, `cuda`; the contract they share is
`_contract.md`). `api` checks a call and binds it, `auto` picks the backend, `op` is the
primitive, `tuning` the autotuner and its cache."""
