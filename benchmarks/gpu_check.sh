#!/usr/bin/env bash
# Every GPU check in one call (benchmarks/gpu_check.py), for a lent GPU machine; docs/benchmarks.md, "On a GPU".
#
#   bash benchmarks/gpu_check.sh --prepare    # here, with package registries: fill .gpu_check/, which travels
#   bash benchmarks/gpu_check.sh              # there: every check, under 12.5 min (8.5 without big_model); in $OUT
#   bash benchmarks/gpu_check.sh --dry-run    # anywhere: CUDA hidden, every part starts and skips (CI runs this)
#
# The Python used is $PYTHON, else the Makefile's .venv, else python3 (on the lent machine: the image's, with its
# CUDA torch). That machine reaches no registry, so the packages its image lacks come as wheels in
# .gpu_check/wheels and are installed without an index. When the chosen Python still lacks what the checks need
# and TORCH names a torch requirement (e.g. TORCH=torch==2.13.0, a CUDA build on Linux from PyPI), the project's
# Makefile installs everything into .venv (`make install TORCH=...`, which needs registries); an install is never
# tried without TORCH, so a machine with no registry does not wait on the network.
set -u
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

if [ "${1:-}" = "--prepare" ]; then
    shift
    exec "$PYTHON" benchmarks/gpu_check.py --prepare "$@"
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

needed="torch transformers peft accelerate datasets evaluate pytest"
has_needed() {
    "$PYTHON" -c "import importlib.util, sys; sys.exit(any(not importlib.util.find_spec(n) for n in sys.argv[1:]))" \
        $needed
}

if ! has_needed && compgen -G ".gpu_check/wheels/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/hf_zo_gpu_check_site"
    echo "gpu_check.sh: installing the carried wheels into $site"
    timeout 30 "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .gpu_check/wheels/*.whl && export PYTHONPATH="$PYTHONPATH:$site"
fi

if ! has_needed; then
    if [ -n "${TORCH:-}" ]; then
        echo "gpu_check.sh: $PYTHON lacks one of: $needed; make install TORCH=$TORCH"
        make install PYTHON=python3 "TORCH=$TORCH" && PYTHON=.venv/bin/python
    else
        echo "gpu_check.sh: $PYTHON lacks one of: $needed. With package registries, set TORCH to a CUDA torch" \
            "requirement to install with the Makefile; without, carry .gpu_check/ (--prepare). Running anyway." >&2
    fi
fi

exec "$PYTHON" benchmarks/gpu_check.py "$@"
