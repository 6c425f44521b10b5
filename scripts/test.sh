#!/usr/bin/env bash
# Set up a virtualenv (once) and run gradsync's checks: ruff, mypy, the test suite.
#   bash scripts/test.sh [extra pytest args]      (GRADSYNC_TORCH_RANGE=0: the pinned torch only)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GRADSYNC_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
quiet_pip() {  # pip's notes about absent local index folders are noise here
  "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
quiet_pip install -q --upgrade pip
# Extras: test tools, DeepSpeed and fairscale (their tests run), the benchmark's plotting and
# Accelerate, Transformers (the language-model tests and examples), MkDocs and Playwright (the
# docs site and its browser test),
# the experiment trackers (TensorBoard, W&B, MLflow: their tests read back what they wrote).
quiet_pip install -q -c constraints.txt -e ".[test,deepspeed,fairscale,bench,hf,docs,trackers]"
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
# The real-SLURM tests start a one-node cluster from Debian's slurm-wlm and munge, installed
# here when this runs as root (CI does); otherwise they are skipped, and this says why.
echo "== SLURM"; bash scripts/slurm/install.sh
# The docs' browser test opens the built site in Debian's chromium, installed here as root.
echo "== Chromium"; bash scripts/browser/install.sh
# ruff (lint, complexity <= 15), ruff format and mypy, as the commit hooks run them
# (.pre-commit-config.yaml: the environment's own tools, nothing downloaded).
echo "== pre-commit (ruff, ruff format, mypy)"
PATH="$VENV/bin:$PATH" PRE_COMMIT_HOME="${PRE_COMMIT_HOME:-$(mktemp -d)}" \
  "$VENV/bin/pre-commit" run --all-files --show-diff-on-failure
echo "== docs"  # a broken link, anchor or snippet, or a page missing from the nav, fails it
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --quiet --site-dir "$SITE"
echo "== pytest"
# Each test process imports gradsync and the test helpers afresh: byte-compile them once (the
# environment may say PYTHONDONTWRITEBYTECODE) instead of in every one of some 300 processes.
"$VENV/bin/python" -m compileall -q src tests > /dev/null
set +e
"$VENV/bin/python" -m pytest -n 2 --dist loadgroup --no-loadscope-reorder "$@"  # tests/conftest.py: what runs where
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: the suite is broken" >&2
  exit 1
fi
# Both ends of the supported torch range (src/gradsync/_support/torch_range.py), each in its own
# virtualenv: the unit tests and the multi-process tests of torch's internals. Skipped with
# GRADSYNC_TORCH_RANGE=0 (a quicker local run); CI runs it.
range_rc=0
if [ "${GRADSYNC_TORCH_RANGE:-1}" != 0 ]; then
  echo "== torch range: $("$VENV/bin/python" scripts/torch_range.py)"
  bash scripts/torch_range.sh || range_rc=$?
fi
[ "$rc" -ne 0 ] && exit "$rc"
exit "$range_rc"
