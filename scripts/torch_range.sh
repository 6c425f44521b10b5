#!/usr/bin/env bash
# The unit tests and the multi-process tests that exercise torch's internals (marked
# torch_internals) on each end of the supported torch range, each in a virtualenv of its own
# (.venv-torch-X.Y.Z): the releases src/gradsync/_support/torch_range.py pins (OLDEST_PIN, NEWEST_PIN).
#   bash scripts/torch_range.sh [pytest args]        # both ends
#   TORCH_RANGE_PINS=2.15.0 bash scripts/torch_range.sh
# Other packages keep constraints.txt's versions. The torch requested here is installed from
# the package index whatever a machine's global pip configuration caps (PIP_CONSTRAINT below
# replaces any configured constraint file with this project's own).
set -euo pipefail
cd "$(dirname "$0")/.."
PINS=${TORCH_RANGE_PINS:-$(python3 scripts/torch_range.py --pins)}
OLDEST=$(python3 scripts/torch_range.py --pins | cut -d' ' -f1)
# With the oldest torch, the extras' lowest versions (pyproject.toml's floors) and the tests
# that use them: DeepSpeed, Transformers' tensor-parallel plans, Accelerate as the reference.
FLOOR_TESTS=(tests/multiprocess/test_deepspeed.py tests/multiprocess/test_deepspeed_hpz.py
  tests/multiprocess/test_accelerate_scripts.py tests/multiprocess/test_accelerate_own_scripts.py
  tests/multiprocess/test_save_pretrained.py)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
failed=()
for pin in $PINS; do
  venv=.venv-torch-$pin
  echo "== torch $pin ($venv)"
  start=$SECONDS
  extra=()
  if [ "$pin" = "$OLDEST" ]; then
    floors=$(python3 scripts/torch_range.py --floors)
    names=$(echo "$floors" | cut -d= -f1 | paste -sd'|')
    grep -Ev "^(torch|$names)==" constraints.txt > "$WORK/constraints.txt"
    echo "$floors" >> "$WORK/constraints.txt"
    echo "   with the extras' floors: $(echo "$floors" | paste -sd' ')"
    extra=("${FLOOR_TESTS[@]}")
  else
    grep -v '^torch==' constraints.txt > "$WORK/constraints.txt"
  fi
  echo "torch==$pin" >> "$WORK/constraints.txt"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip 2> >(grep -v "is ignored: it is neither" >&2)
  PIP_CONSTRAINT="$WORK/constraints.txt" "$venv/bin/python" -m pip install -q \
    -e ".[test,deepspeed,fairscale,bench,hf,trackers]" 2> >(grep -v "is ignored: it is neither" >&2)
  "$venv/bin/python" -c "import torch; print('torch', torch.__version__, '(installed in', $SECONDS - $start, 's)')"
  set +e
  "$venv/bin/python" -m pytest -n 2 --dist loadgroup --no-loadscope-reorder -q \
    -m "not multiprocess or torch_internals" "$@"
  rc=$?
  if [ "$rc" -eq 0 ] && [ "${#extra[@]}" -gt 0 ]; then
    "$venv/bin/python" -m pytest -n 2 --dist loadgroup --no-loadscope-reorder -q "${extra[@]}" "$@"
    rc=$?
  fi
  set -e
  echo "== torch $pin: pytest exit $rc, $((SECONDS - start)) s with the install"
  [ "$rc" -eq 0 ] || failed+=("$pin")
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "failed on torch ${failed[*]}" >&2
  exit 1
fi
