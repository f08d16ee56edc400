#!/usr/bin/env bash
# The suite's budget (CONTRIBUTING.md, "The suite's budget"): the README's test command from a
# fresh clone, with a fresh HOME, XDG_CACHE_HOME and TMPDIR (no compilation cache, no JAX or
# pytest cache from earlier runs), timed as wall seconds and CPU seconds (user + sys of pytest,
# its workers and their subprocesses). pip's own cache is kept: installing is not timed.
#
#   bench/suite_budget.sh [COMMIT]      # default: HEAD of this checkout
#
# Prints one line, `suite: W s wall, U+S = C s cpu (budget 600 s wall, 1,200 s cpu)`, beside the
# machine's speed before and after (bench/cpu_speed.py: this shared machine's speed drifts by tens
# of percent within an hour, so a figure is read beside it), and keeps the clone's pytest output
# and per-test CPU report (tests/compile_report.py) in the folder it names. Measure on a quiet
# machine (`uptime`: load under 3 on 2 cores), or the wall time is the other processes' as well.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
commit="$(git -C "$repo" rev-parse "${1:-HEAD}")"
work="$(mktemp -d /tmp/suite-budget.XXXXXX)"
git clone -q "$repo" "$work/clone"
git -C "$work/clone" checkout -q "$commit"
mkdir -p "$work/home" "$work/cache" "$work/tmp"
cd "$work/clone"
# The README's install, with pip's own cache (outside the fresh HOME).
python3 -m venv .venv
PIP_CACHE_DIR="${PIP_CACHE_DIR:-$HOME/.cache/pip}" \
  .venv/bin/pip install -q -c constraints.txt -e '.[test]'
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg); commit $commit; $(nproc) cores"
speed_before="$(.venv/bin/python bench/cpu_speed.py)"
# The README's test command, timed; the fresh folders hold every cache it makes.
env HOME="$work/home" XDG_CACHE_HOME="$work/cache" TMPDIR="$work/tmp" \
  THESEUS_COMPILE_REPORT="$work/compile.jsonl" \
  /usr/bin/time -f '%e %U %S' -o "$work/time.txt" \
  .venv/bin/python -m pytest -q >"$work/pytest.txt" 2>&1 || status=$?
tail -n 3 "$work/pytest.txt"
read -r wall user sys < <(tail -n 1 "$work/time.txt")  # after "Command exited ..." if it failed
cpu="$(python3 -c "print(f'{$user + $sys:.0f}')")"
echo "suite: ${wall} s wall, ${user}+${sys} = ${cpu} s cpu (budget 600 s wall, 1,200 s cpu)"
echo "machine: ${speed_before} before, $(.venv/bin/python bench/cpu_speed.py) after (bench/cpu_speed.py)"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg); output and per-test report in $work"
exit "${status:-0}"
