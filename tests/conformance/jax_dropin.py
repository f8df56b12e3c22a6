"""pytest plugin (``-p jax_dropin``): ``jax.nn.dot_product_attention`` is fusedattn's.

`ORIGINAL` keeps jax.nn's own function for the tests' references. fusedattn
captured it when imported (above the replacement), so its float64 fallback still
runs jax.nn's code instead of calling itself.
"""
from __future__ import annotations

import jax

import fusedattn

ORIGINAL = jax.nn.dot_product_attention
jax.nn.dot_product_attention = fusedattn.dot_product_attention


def pytest_report_header(config):
    return "jax_dropin: jax.nn.dot_product_attention is fusedattn.dot_product_attention"
