"""pallas_gemm.mgpu.unpad: the copy that drops a padded kernel output's padding."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.mgpu import unpad


def test_copy_kernel_copies_the_leading_block():
  # Ragged blocks on both axes, a batch, and values that would show a shifted row.
  x = jax.random.normal(jax.random.key(0), (2, 19, 1030), jnp.bfloat16)
  out = unpad.copy_kernel(x, 13, 1027, interpret=True)
  assert out.shape == (2, 13, 1027)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(x[:, :13, :1027], np.float32))


def test_unpad_in_interpret_mode_is_the_slice():
  x = jax.random.normal(jax.random.key(1), (1, 9, 70), jnp.float32)
  text = jax.jit(lambda x: unpad.unpad(x, 7, 65, interpret=True)).lower(x).as_text()
  assert "pallas_gemm_unpad" not in text and "slice" in text
  np.testing.assert_array_equal(unpad.unpad(x, 7, 65, interpret=True), x[:, :7, :65])
