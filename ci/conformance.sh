#!/usr/bin/env bash
# Conformance job: the drop-ins against the originals' own tests.
#  * Flax: the attention tests of the flax sdist on PyPI (fetched now, never
#    committed), linen and nnx, with fusedattn.flax.attention_fn as Flax's
#    attention function (tests/conformance/flax_dropin.py).
#  * JAX: its sdist ships no tests, so our port of tests/nn_test.py's attention
#    cases (tests/test_jax_nn_dropin.py) runs with jax.nn.dot_product_attention
#    replaced by fusedattn's (tests/conformance/jax_dropin.py); the plain suite runs
#    the same file calling fusedattn directly.
# Every failure is a bug or an entry in the README's list of intended differences.
#   ci/conformance.sh          install fusedattn[test] first (as ci/cpu.sh does)
#   FUSEDATTN_NO_INSTALL=1 ci/conformance.sh   use the current environment (src/ if
#                              fusedattn is not installed there)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
if [[ -z ${FUSEDATTN_NO_INSTALL:-} ]]; then
  FUSEDATTN_GPU=none python3 -m pip install -q ".[test]"
elif ! python3 -c "import fusedattn" 2>/dev/null; then
  export PYTHONPATH=$root/src${PYTHONPATH:+:$PYTHONPATH}
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The tests of the Flax release installed here, from its sdist.
version=$(python3 -c 'import flax; print(flax.__version__)')
python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "flax==$version"
tar xzf "$work/flax-$version.tar.gz" -C "$work" \
  "flax-$version/tests/linen/linen_attention_test.py" "flax-$version/tests/nnx/nn/attention_test.py"
mkdir "$work/flax_tests"
cp "$work/flax-$version"/tests/linen/linen_attention_test.py \
   "$work/flax-$version"/tests/nnx/nn/attention_test.py "$work/flax_tests/"

echo "== Flax $version attention tests, fusedattn as Flax's attention function"
(cd "$work/flax_tests" &&
  PYTHONPATH=$root/tests/conformance${PYTHONPATH:+:$PYTHONPATH} \
  python3 -m pytest -q -p no:cacheprovider -p flax_dropin "$@" \
    linen_attention_test.py attention_test.py)

echo "== JAX's attention cases, jax.nn.dot_product_attention replaced by fusedattn's"
PYTHONPATH=$root/tests/conformance${PYTHONPATH:+:$PYTHONPATH} \
  python3 -m pytest -q -p no:cacheprovider -p jax_dropin "$@" tests/test_jax_nn_dropin.py
