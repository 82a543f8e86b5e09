#!/usr/bin/env bash
# Run one cluster test with a deliberate break of the guarantee it checks, to
# see it fail (docs/reliability.md, "How the cluster tests were seen failing").
#
#   tests/cluster/mutations/run.sh NAME      # NAME.patch beside this script
#
# The patch is applied to the checkout, the test named on the patch's first
# line ("# test: <pytest -k expression>") runs, and the patch is reverted on
# exit whatever happened. A clean checkout is required for the patched files.
# Exit status: 0 when the test FAILED under the break (what is expected),
# 1 when it passed (the test does not see the break).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
patch="$here/$1.patch"
[[ -f "$patch" ]] || { echo "no $patch" >&2; exit 2; }
test_k="$(sed -n 's/^# test: //p' "$patch" | head -1)"
file="$(sed -n 's/^# file: //p' "$patch" | head -1)"
cd "$root"
git apply --check "$patch"
git apply "$patch"
trap 'git apply -R "$patch"' EXIT
eval "$(deploy/local/up.sh)"
if .venv/bin/python -m pytest -n 0 -p no:cacheprovider -x "${file:-tests/cluster/test_cluster.py}" \
    -k "$test_k"; then
  echo "MUTATION SURVIVED: the test passed with $1.patch applied" >&2
  exit 1
fi
echo "mutation $1 seen: the test failed with the break applied"
