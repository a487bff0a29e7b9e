#!/usr/bin/env bash
# compute-sanitizer's memcheck (with the leak check), racecheck, initcheck and synccheck over
# tests/sanitize_subset.py, a small run of every kernel path checked against the oracle.
#
# Usage: tools/sanitize.sh [LOG_DIR]        (default: sanitize-logs/)
#   TOOLS="memcheck racecheck"  run only these tools (default: all four)
#   SUBSET_FILTER=append        run only the subset's cases whose name contains this
#   COMPUTE_SANITIZER=/path     the binary (default: PATH, then /usr/local/cuda*/bin)
#   PYTHON=python3              the interpreter
# Prints one summary line per tool and exits 1 if any tool reports an error, exits non-zero
# or sees a wrong result. Logs: LOG_DIR/<tool>.sanitizer.log (the report), <tool>.out (the
# subset's own output), plain.log (the run without a sanitizer).
set -uo pipefail
cd "$(dirname "$0")/.."

logs="${1:-sanitize-logs}"
mkdir -p "$logs"
python="${PYTHON:-python3}"
sanitizer="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}"
if [[ -z "$sanitizer" ]]; then
  for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
    if [[ -x "$candidate" ]]; then sanitizer="$candidate"; break; fi
  done
fi
if [[ ! -x "$sanitizer" ]]; then
  echo "compute-sanitizer not found: put it on PATH or set COMPUTE_SANITIZER" >&2
  exit 2
fi
# tools/ too: the subset imports test modules whose cases use tools/benchlib (as conftest.py does).
export PYTHONPATH="$PWD:$PWD/tools${PYTHONPATH:+:$PYTHONPATH}"
subset=(tests/sanitize_subset.py)
[[ -n "${SUBSET_FILTER:-}" ]] && subset+=(-k "$SUBSET_FILTER")

# A plain run first: it compiles every kernel into the disk cache, so the sanitized runs only
# load CUBINs, and it proves the subset passes before any tool is blamed.
echo "$("$sanitizer" --version | tail -n 1)"
start=$SECONDS
if ! "$python" "${subset[@]}" > "$logs/plain.log" 2>&1; then
  tail -n 30 "$logs/plain.log"
  echo "plain      : the subset fails without a sanitizer; fix that first" >&2
  exit 1
fi
echo "plain      : $(tail -n 1 "$logs/plain.log") ($((SECONDS - start)) s)"

# The error count a tool reports: "ERROR SUMMARY: N errors", or racecheck's
# "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)"; "?" when there is none.
error_count() {
  local count
  count=$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$1" | tail -n 1 | grep -Eo '[0-9]+')
  if [[ -z "$count" ]]; then
    count=$(grep -Eo 'RACECHECK SUMMARY: .*\(([0-9]+) error' "$1" | tail -n 1 \
            | grep -Eo '\([0-9]+' | tr -d '(')
  fi
  echo "${count:-?}"
}

failed=0
for tool in ${TOOLS:-memcheck racecheck initcheck synccheck}; do
  options=(--tool "$tool" --error-exitcode 1 --print-limit 100
           --log-file "$logs/$tool.sanitizer.log")
  [[ "$tool" == memcheck ]] && options+=(--leak-check full)
  start=$SECONDS
  "$sanitizer" "${options[@]}" "$python" "${subset[@]}" > "$logs/$tool.out" 2>&1
  code=$?
  errors=$(error_count "$logs/$tool.sanitizer.log")
  results=$(grep -E '^sanitize_subset: ' "$logs/$tool.out" | tail -n 1)
  printf '%-11s: %s errors, exit %d, %s (%d s)\n' "$tool" "$errors" "$code" \
         "${results:-sanitize_subset: no result line}" $((SECONDS - start))
  if [[ "$errors" != 0 || "$code" != 0 || "$results" != *" 0 failed" ]]; then
    failed=1
    grep -m 20 -E '^========= (Invalid|Uninitialized|Error|Race|Barrier|Leaked|Program hit)' \
      "$logs/$tool.sanitizer.log" | sed 's/^/    /'
  fi
done
echo "logs in $logs/"
exit "$failed"
