#!/usr/bin/env bash
# Create a virtual environment with upstream Levanter for scripts/bench/train.py --upstream-venv.
#
#   scripts/bench/setup_upstream_venv.sh [VENV_DIR]      # default: ~/.cache/levanter-bench/upstream-venv
#
# Pins: levanter 1.2.dev1644 is broken with jax >= 0.8, so jax and
# jaxlib are held at 0.7.2 and flax below 0.12 (0.12 needs jax >= 0.10); GitPython and chex are undeclared
# dependencies of that wheel. Downloads ~1.7 GB; takes 2-3 minutes with a fast registry.
# Pass the directory to the benchmark:  .venv/bin/python scripts/bench/train.py --upstream-venv VENV_DIR
set -euo pipefail

# The default lies outside the checkout: a 1.7 GB venv must not show up as untracked files here.
VENV=${1:-$HOME/.cache/levanter-bench/upstream-venv}
PYTHON=${PYTHON:-python3}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import levanter" 2>/dev/null; then
    echo "upstream levanter already installed in $VENV"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q \
    "levanter==1.2.dev1644" "jax==0.7.2" "jaxlib==0.7.2" "flax<0.12" gitpython chex
"$VENV/bin/pip" check || echo "warning: pip check reported problems (see above)" >&2
"$VENV/bin/python" -c "import levanter, jax; print('upstream levanter', levanter.__file__, 'jax', jax.__version__)"
