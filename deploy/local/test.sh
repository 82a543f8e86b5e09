#!/usr/bin/env bash
# The project's single test command:   ./deploy/local/test.sh [pytest args...]
#
# Installs the package with its dev extras into the project's virtual environment
# (.venv/, made on the first run; PYTHON=... or an active virtual environment is
# used instead, see use_python in lib.sh; skipped when pyproject.toml is unchanged
# since the last install), starts the local services (deploy/local/up.sh), then
# runs ruff, the typecheck and pytest, all with that environment's python. All three run
# even if an earlier one fails; the exit status is non-zero if any failed.
# pytest collecting no tests (exit 5) counts as a failure.
# Quiet set-up: one line per step; the package managers' output goes to log files
# under deploy/local/.state/ (shown when a step fails), or to stderr with VERBOSE=1.
# While pytest collects, it prints a "collecting: ..." line every 5 s
# (OUTBOXKIT_TEST_PROGRESS_INTERVAL). Ctrl-C stops the step that runs, and with
# it every relay, consumer or other process the tests started (tests/support/
# lifeline.py); the remaining steps are skipped and the exit status is 130.
# Compiled modules (and pytest's rewritten test modules) are kept under
# deploy/local/.state/pycache, also when PYTHONDONTWRITEBYTECODE is set: without
# them every run recompiled the suite, a third of its collection time.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
SERVICE=test
# shellcheck source=lib.sh
source "$REPO_ROOT/deploy/local/lib.sh"

declare -a summary=()
failed=0
interrupted=0
t_all=$(date +%s)
# Ctrl-C reaches the whole process group (the step's command too); the script
# only notes it, and stops once that command has ended.
trap 'interrupted=1' INT

step() {
    local name="$1" t0 rc=0
    shift
    echo "==> $name" >&2
    t0=$(date +%s)
    "$@" || rc=$?
    summary+=("$(printf '%-10s %4ss  %s' "$name" "$(($(date +%s) - t0))" \
        "$([[ $rc -eq 0 ]] && echo ok || echo "FAILED (exit $rc)")")")
    [[ $rc -eq 0 ]] || failed=1
    if [[ $interrupted -eq 1 ]]; then
        echo "==> interrupted: the remaining steps are skipped" >&2
        exit 130
    fi
    return "$rc"
}

report() {
    {
        echo "==> step timings"
        printf '    %s\n' "${summary[@]}"
        echo "    total      $(($(date +%s) - t_all))s"
    } >&2
}
trap report EXIT

install_deps() {
    use_python
    install_package '.[dev]'
}

services_up() {
    local env given
    env="$(deploy/local/up.sh)" || return 1
    # An address the caller set wins over the local default (README: the tests
    # on a MariaDB with the binary log on).
    # (as "export ...": a "declare" evaluated in a function would be local to it)
    given="$(export -p | sed -n 's/^declare -x \(OUTBOXKIT_TEST_[A-Z_]*=\)/export \1/p')"
    eval "$env"
    eval "$given"
    export OUTBOXKIT_TEST_DB_URL OUTBOXKIT_TEST_PG_URL OUTBOXKIT_TEST_KAFKA_BOOTSTRAP \
        OUTBOXKIT_TEST_REDIS_URL OUTBOXKIT_TEST_PUSHGATEWAY_URL
}

run_pytest() {
    local rc=0
    # Two workers (pytest-xdist): the suite spends much of its time waiting on
    # services and on the processes it starts, so two tests at once fill a
    # 2-core machine. Each test has its own database, topics, Redis prefix and
    # instances, so they do not meet. OUTBOXKIT_TEST_WORKERS=0 runs them one by
    # one in this process; a `-n` among the arguments wins.
    # The slowest tests are listed at the end, to keep the suite's time in view.
    env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX="$REPO_ROOT/deploy/local/.state/pycache" \
        "$PY" -m pytest --durations=20 -n "${OUTBOXKIT_TEST_WORKERS:-2}" --dist worksteal "$@" \
        </dev/null || rc=$?
    if [[ $rc -eq 5 ]]; then
        echo "pytest collected no tests: treating as a failure" >&2
    fi
    return "$rc"
}

# Setup failures make the checks meaningless: stop there.
# (install_deps runs in this shell: PY and the activated environment stay set.)
step pip install_deps || exit 1
step services services_up || exit 1

step ruff "$PY" -m ruff check . || true
step mypy env PYTHON="$PY" deploy/local/typecheck.sh || true
step pytest run_pytest "$@" || true

exit "$failed"
