"""pytest plugin (``-p flax_dropin``): Flax's own attention tests with
`fusedattn.flax.attention_fn` as Flax's attention function.

It replaces ``flax.linen.dot_product_attention`` and ``flax.nnx.dot_product_attention``
(the names the tests call) and the ``attention_fn`` default of every linen / nnx
attention layer (bound when Flax defined the class, so replacing the name alone
would not reach them). fusedattn.flax captured Flax's originals when it was
imported, so its fallbacks still run Flax's own code.
"""
from __future__ import annotations

import inspect
import logging

import flax.linen as nn
import flax.linen.attention as linen_attention
import flax.nnx as nnx
import flax.nnx.nn.attention as nnx_attention

import fusedattn.flax as fa

ORIGINALS = (linen_attention.dot_product_attention, nnx_attention.dot_product_attention)


def _replace_defaults(func, new) -> int:
    """Swap Flax's originals for `new` among func's (unwrapped) defaults."""
    func = inspect.unwrap(func)
    n = 0
    if func.__defaults__:
        func.__defaults__ = tuple(new if d in ORIGINALS else d for d in func.__defaults__)
        n += sum(d is new for d in func.__defaults__)
    if func.__kwdefaults__:
        for k, d in func.__kwdefaults__.items():
            if d in ORIGINALS:
                func.__kwdefaults__[k] = new
                n += 1
    return n


def _subclasses(cls):
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


def install(new=fa.attention_fn) -> int:
    """Make `new` Flax's attention function; returns how many defaults it replaced."""
    for mod in (nn, linen_attention):
        mod.dot_product_attention = new
    for mod in (nnx, nnx_attention):
        mod.dot_product_attention = new
    replaced = 0
    for cls in _subclasses(linen_attention.MultiHeadDotProductAttention):
        field = cls.__dataclass_fields__.get("attention_fn")
        if field is not None and field.default in ORIGINALS:
            field.default = new
        if cls.__dict__.get("attention_fn") in ORIGINALS:
            setattr(cls, "attention_fn", new)
        if "__init__" in cls.__dict__:
            replaced += _replace_defaults(cls.__init__, new)
    replaced += _replace_defaults(nnx_attention.MultiHeadAttention.__init__, new)
    return replaced


_REPLACED = install()
assert _REPLACED >= 2, "found no attention_fn default to replace: Flax changed its layout"


class _Reasons(logging.Handler):
    """Collects the fallbacks fusedattn logged, to list them at the end."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        self.seen.append(record.getMessage())


_REASONS = _Reasons()
logging.getLogger("fusedattn").addHandler(_REASONS)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"flax_dropin: {len(_REASONS.seen)} kinds of call ran Flax's own "
                                f"function:")
    for message in _REASONS.seen:
        terminalreporter.write_line(f"  {message}")


def pytest_report_header(config):
    return (f"flax_dropin: Flax's attention function is fusedattn.flax.attention_fn "
            f"({_REPLACED} layer defaults replaced)")
