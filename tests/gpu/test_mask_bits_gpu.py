"""The CUDA extension's mask packer (csrc/cuda/mask_bits.cu) against numpy's packing
and XLA's (`kernel_mask.pack_bits`): the same int32 words, bit for bit, padding zero;
masks whose key count is not a multiple of 16 stay with XLA."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedattn.backends import extension
from fusedattn.block_sparse.kernel_mask import NATIVE_BITS, pack_bits
from fusedattn.block_sparse.kernel_parts import WORD, whole

pytestmark = pytest.mark.gpu


def numpy_words(mask, sq, skv):
    """Bit k of word w of row q: key 32 w + k (little-endian bytes of a uint32)."""
    B, H, s_q, s_kv = mask.shape
    padded = np.zeros((B, H, sq, skv), bool)
    padded[..., :s_q, :s_kv] = mask
    words = np.packbits(padded, axis=-1, bitorder="little").view("<u4").view(np.int32)
    return np.swapaxes(words, -1, -2)


def calls() -> int:
    return extension.handler_counts("cuda").get(NATIVE_BITS, (0, 0))[0]


@pytest.mark.parametrize("shape", [(2, 1, 256, 256), (1, 3, 300, 208), (2, 2, 1000, 2048),
                                   (1, 1, 64, 16)])
def test_native_words_equal_numpy_and_xla(shape):
    if extension.gpu_platform() != "cuda":
        pytest.skip("the packer is in the CUDA extension only")
    rng = np.random.default_rng(sum(shape))
    mask = rng.random(shape) < 0.5
    mask[..., 0, :] = True                        # every sign bit of row 0 set
    mask[..., -1, :] = False
    sq, skv = whole(shape[2]), whole(shape[3])
    before = calls()
    native = np.asarray(jax.jit(lambda m: pack_bits(m, sq, skv, native=True))(jnp.asarray(mask)))
    assert calls() == before + 1, "the native packer did not run"
    assert native.dtype == np.int32 and native.shape == shape[:2] + (skv // WORD, sq)
    np.testing.assert_array_equal(native, numpy_words(mask, sq, skv))
    np.testing.assert_array_equal(native, np.asarray(jax.jit(
        lambda m: pack_bits(m, sq, skv))(jnp.asarray(mask))))


def test_keys_not_a_multiple_of_16_stay_with_xla():
    if extension.gpu_platform() != "cuda":
        pytest.skip("the packer is in the CUDA extension only")
    mask = np.random.default_rng(0).random((1, 2, 130, 100)) < 0.5
    before = calls()
    words = np.asarray(jax.jit(lambda m: pack_bits(m, 256, 128, native=True))(jnp.asarray(mask)))
    assert calls() == before
    np.testing.assert_array_equal(words, numpy_words(mask, 256, 128))
