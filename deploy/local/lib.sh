# shellcheck shell=bash
# Shared helpers for the deploy/local service scripts. Source it, don't run it.
#
# Conventions:
#   - all diagnostics go to stderr; stdout is reserved for what a caller evals
#   - quiet by default: one line per service (or step) and errors; `detail`
#     lines and package-manager output only with VERBOSE=1 (or --verbose),
#     else the package-manager output goes to a log file under .state/
#   - each instance lives in $STATE_DIR/<service>-<name>/ (data, pid, log, config)
#   - daemons are started directly (no systemd / init scripts) and bound to 127.0.0.1

LOCAL_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE_DIR="${OUTBOXKIT_LOCAL_STATE:-$LOCAL_DIR/.state}"

log() { printf '[%s] %s\n' "${SERVICE:-local}" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
verbose() { [[ "${VERBOSE:-0}" == 1 || "${VERBOSE:-}" == true ]]; }
# detail MSG: a line only worth reading when asked for (VERBOSE=1 / --verbose).
detail() { if verbose; then log "$@"; fi; }

# run_logged LOGFILE CMD...: run CMD with its output appended to LOGFILE (and on
# stderr with VERBOSE=1); on failure show the log's last lines and return its status.
run_logged() {
    local logfile="$1" rc=0
    shift
    mkdir -p "$(dirname "$logfile")"
    if verbose; then
        local -
        set -o pipefail # the command's status, not tee's
        "$@" 2>&1 </dev/null | tee -a "$logfile" >&2 || rc=$?
    else
        "$@" </dev/null >>"$logfile" 2>&1 || rc=$?
    fi
    if [[ $rc -ne 0 ]]; then
        show_log_tail "$logfile" 30
        log "failed (exit $rc): $* (full log: $logfile)"
    fi
    return "$rc"
}

# Parse "<cmd> [--name N] [--port P] [...]". Sets CMD, NAME, PORT plus any extra
# --flag given in the EXTRA_FLAGS array (e.g. controller-port -> CONTROLLER_PORT).
parse_args() {
    CMD="${1:-}"
    [[ -n "$CMD" ]] || die "usage: $(basename "$0") start|stop|status|kill [--name N] [--port P]"
    shift
    # ignore same-named variables from the environment (PORT is a common one)
    NAME=default PORT=""
    local f0
    for f0 in "${EXTRA_FLAGS[@]:-}"; do
        if [[ -n "$f0" ]]; then
            printf -v "$(tr 'a-z-' 'A-Z_' <<<"$f0")" '%s' ""
        fi
    done
    GIVEN=" "
    while [[ $# -gt 0 ]]; do
        if [[ "$1" == --verbose ]]; then
            export VERBOSE=1
            shift
            continue
        fi
        local flag="${1#--}" val
        [[ "$1" == --* && $# -ge 2 ]] || die "bad argument: $1"
        val="$2"
        shift 2
        case "$flag" in
            name) NAME="$val" ;;
            port) PORT="$val" GIVEN+="PORT " ;;
            *)
                local known=0 f
                for f in "${EXTRA_FLAGS[@]:-}"; do
                    [[ "$f" == "$flag" ]] && known=1
                done
                [[ $known -eq 1 ]] || die "unknown option --$flag"
                local var
                var="$(tr 'a-z-' 'A-Z_' <<<"$flag")"
                printf -v "$var" '%s' "$val"
                GIVEN+="$var "
                ;;
        esac
    done
    [[ "$NAME" =~ ^[A-Za-z0-9_.-]+$ ]] || die "bad --name '$NAME'"
    INSTANCE_DIR="$STATE_DIR/$SERVICE-$NAME"
    PID_FILE="$INSTANCE_DIR/pid"
}

# A named instance remembers its ports, so "stop --name X" needs no --port.
remember_settings() {
    mkdir -p "$INSTANCE_DIR"
    local v out=""
    for v in "$@"; do
        out+="$v=${!v:-}"$'\n'
    done
    printf '%s' "$out" >"$INSTANCE_DIR/settings"
}

load_settings() {
    local f="$INSTANCE_DIR/settings" line k
    [[ -f "$f" ]] || return 0
    while IFS= read -r line; do
        [[ -n "$line" ]] || continue
        k="${line%%=*}"
        # flags given on this command line (even empty ones) win
        if [[ "$GIVEN" != *" $k "* ]]; then
            printf -v "$k" '%s' "${line#*=}"
        fi
    done <"$f"
}

# read_pid: the instance's pid, only if that process is alive and still ours.
# Pid files outlive reboots and killed sessions; a recycled pid must never be
# mistaken for the instance (or signalled). Scripts set PROC_MATCH to a string
# that the instance's command line contains.
read_pid() {
    [[ -s "$PID_FILE" ]] || return 1
    local pid cmdline
    pid="$(tr -dc '0-9' <"$PID_FILE")"
    [[ -n "$pid" ]] || return 1
    cmdline="$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline")" || return 1
    [[ "$cmdline" == *"${PROC_MATCH:?}"* ]] || return 1
    echo "$pid"
}

pid_alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }

instance_pid_alive() {
    local pid
    pid="$(read_pid)" || return 1
    pid_alive "$pid"
}

port_open() {
    # bash's /dev/tcp: no extra tools needed
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# wait_for TIMEOUT_S DESCRIPTION COMMAND...: poll every 0.2s.
wait_for() {
    local timeout="$1" what="$2" deadline
    shift 2
    deadline=$(($(date +%s) + timeout))
    while ! "$@" >/dev/null 2>&1; do
        if [[ $(date +%s) -ge $deadline ]]; then
            log "timed out after ${timeout}s waiting for $what"
            return 1
        fi
        sleep 0.2
    done
}

# stop_pid PID TIMEOUT_S: SIGTERM, wait, then SIGKILL.
# stop_pid PID GRACE_S [SIGNAL]: send SIGNAL (TERM), SIGKILL after GRACE_S.
stop_pid() {
    local pid="$1" timeout="$2" signal="${3:-TERM}" i
    pid_alive "$pid" || return 0
    kill "-$signal" "$pid" 2>/dev/null || true
    for ((i = 0; i < timeout * 5; i++)); do
        pid_alive "$pid" || return 0
        sleep 0.2
    done
    log "pid $pid did not stop in ${timeout}s, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        pid_alive "$pid" || return 0
        sleep 0.1
    done
    die "pid $pid survived SIGKILL"
}

kill_instance() {
    local pid
    if pid="$(read_pid)" && pid_alive "$pid"; then
        log "$NAME: SIGKILL pid $pid"
        kill -KILL "$pid" 2>/dev/null || true
        while pid_alive "$pid"; do sleep 0.1; done
    fi
    rm -f "$PID_FILE"
}

# stop_instance GRACE_S [SIGNAL]: SIGNAL (TERM) to this checkout's instance,
# SIGKILL after GRACE_S.
stop_instance() {
    local pid
    if pid="$(read_pid)" && pid_alive "$pid"; then
        detail "$NAME: stopping pid $pid"
        stop_pid "$pid" "$1" "${2:-TERM}"
        log "$NAME stopped"
    fi
    rm -f "$PID_FILE"
}

# instance_status CHECK_CMD...: say whether the instance runs and answers
# CHECK_CMD (this checkout's, or the default one started elsewhere); 3 if not.
instance_status() {
    if instance_pid_alive && "$@" >/dev/null 2>&1; then
        echo "$SERVICE $NAME running: pid $(read_pid), 127.0.0.1:$PORT"
        return 0
    fi
    if [[ "$NAME" == default ]] && port_open "$PORT" && "$@" >/dev/null 2>&1; then
        echo "$SERVICE $NAME running (started outside this checkout), 127.0.0.1:$PORT"
        return 0
    fi
    echo "$SERVICE $NAME not running"
    return 3
}

# run_command STOP_GRACE_S CHECK_CMD...: do $CMD with the script's own start().
run_command() {
    local grace="$1"
    shift
    case "$CMD" in
        start) start ;;
        stop) stop_instance "$grace" ;;
        kill) kill_instance ;;
        status) instance_status "$@" ;;
        *) die "unknown command $CMD (start|stop|status|kill)" ;;
    esac
}

show_log_tail() {
    local f="$1"
    if [[ -f "$f" ]]; then
        log "last lines of $f:"
        tail -n "${2:-40}" "$f" >&2 || true
    fi
}

# Another checkout of the project (another worktree, a CI clone) may already
# run the default instance from its own .state/. If the port answers as the
# right service, use it instead of failing on a busy port.
# already_served CHECK_CMD...: 0 if this checkout's or such a foreign instance answers.
already_served() {
    if instance_pid_alive; then
        "$@" >/dev/null 2>&1 || return 1
        log "$NAME ready on 127.0.0.1:$PORT (already running)"
        return 0
    fi
    [[ "$NAME" == default ]] || return 1
    port_open "$PORT" || return 1
    "$@" >/dev/null 2>&1 || return 1
    log "$NAME ready on 127.0.0.1:$PORT (started outside this checkout)"
    return 0
}

# Refuse to start on a port some other process already listens on.
require_free_port() {
    local port="$1"
    if port_open "$port"; then
        die "port $port on 127.0.0.1 is already in use by another process (not instance '$NAME')"
    fi
}

pkg_installed() {
    [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]
}

# ensure_packages PKG...: apt-get install whatever is missing, without letting
# the packages' maintainer scripts start their daemons (no init system here,
# and a system daemon would grab our ports).
ensure_packages() {
    local missing=() p
    for p in "$@"; do
        pkg_installed "$p" || missing+=("$p")
    done
    [[ ${#missing[@]} -gt 0 ]] || return 0
    local apt_log="$STATE_DIR/apt.log"
    log "installing ${missing[*]} (log: $apt_log)"
    local policy=/usr/sbin/policy-rc.d created_policy=0
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        created_policy=1
    fi
    local rc=0
    if [[ -z "${OUTBOXKIT_APT_UPDATED:-}" ]]; then
        run_logged "$apt_log" apt-get update -qq || rc=$?
        [[ $rc -ne 0 ]] || export OUTBOXKIT_APT_UPDATED=1
    fi
    if [[ $rc -eq 0 ]]; then
        run_logged "$apt_log" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "${missing[@]}" || rc=$?
    fi
    [[ $created_policy -eq 1 ]] && rm -f "$policy"
    [[ $rc -eq 0 ]] || die "apt-get install ${missing[*]} failed"
}

# Start a command detached from the caller's session, recording its pid.
# spawn_daemon LOGFILE CMD...
spawn_daemon() {
    local logfile="$1"
    shift
    rm -f "$PID_FILE"
    # bash writes its own pid then execs the daemon, so the pid file is exact
    # whether or not setsid had to fork.
    # shellcheck disable=SC2016 # expanded by the inner bash
    # Without a test run's mark (tests/support/lifeline.py): a service outlives
    # the run that started it, and is stopped by name.
    env -u OUTBOXKIT_TEST_HARNESS nohup setsid bash -c 'echo $$ >"$0"; exec "$@"' "$PID_FILE" "$@" \
        </dev/null >>"$logfile" 2>&1 &
    local i
    for ((i = 0; i < 50; i++)); do
        [[ -s "$PID_FILE" ]] && return 0
        sleep 0.1
    done
    die "daemon did not write its pid file $PID_FILE"
}

# -- the project's Python ----------------------------------------------------------
# demo.sh and test.sh install the package into a virtual environment, never into
# the system's Python: Debian's python3 is "externally managed" (PEP 668) and pip
# refuses to install into it. Which interpreter, in this order:
#   1. PYTHON=/path/to/python: that one, as given (the caller's choice);
#   2. an active virtual environment (VIRTUAL_ENV): its python;
#   3. the project's own: $OUTBOXKIT_VENV, by default .venv/ at the top of the
#      checkout, made with `python3 -m venv` when missing (installing Debian's
#      python3-venv first if that python3 lacks it).

REPO_ROOT_DIR="$(cd "$LOCAL_DIR/../.." && pwd)"
PROJECT_VENV="${OUTBOXKIT_VENV:-$REPO_ROOT_DIR/.venv}"

# externally_managed PY: PY is a system interpreter pip refuses (PEP 668).
externally_managed() {
    "$1" - <<'PY' 2>/dev/null
import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists(marker) else 1)
PY
}

# venv_usable DIR: DIR holds a whole virtual environment: its python and its pip
# (a `python3 -m venv` without ensurepip stops after the python). File checks
# only: this runs at every start.
venv_usable() {
    [[ -f "$1/pyvenv.cfg" && -x "$1/bin/python" && -x "$1/bin/pip" ]]
}

# make_venv DIR: create the virtual environment (python3 -m venv), installing
# Debian's python3-venv first if python3 cannot make one (Debian leaves out
# ensurepip, so `python3 -m venv` fails half-way without it).
make_venv() {
    local dir="$1" base="${OUTBOXKIT_BASE_PYTHON:-python3}"
    command -v "$base" >/dev/null 2>&1 || die "$base not found: install Python 3.11 or newer"
    "$base" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        die "$($base -V 2>&1) is too old: outboxkit needs Python 3.11 or newer"
    if ! "$base" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        command -v apt-get >/dev/null 2>&1 ||
            die "$base cannot make a virtual environment (no ensurepip): install its venv module"
        ensure_packages python3-venv
    fi
    # A half-made environment (an earlier run without python3-venv) is replaced;
    # never anything that is not a virtual environment.
    if [[ -e "$dir" ]]; then
        [[ -f "$dir/pyvenv.cfg" ]] ||
            die "$dir exists and is not a virtual environment: move it away or set OUTBOXKIT_VENV"
        rm -rf "$dir"
    fi
    mkdir -p "$STATE_DIR"
    run_logged "$STATE_DIR/venv.log" "$base" -m venv "$dir" ||
        die "could not create the virtual environment $dir"
}

# use_python: set PY to the interpreter to install into and run with (see above),
# creating and activating the project's virtual environment when that is the one.
# Says which on stderr, in one line.
use_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        PY="$PYTHON"
        if externally_managed "$PY"; then
            die "PYTHON=$PY is the system's Python, which pip may not install into (PEP 668): unset PYTHON to use the project's virtual environment $PROJECT_VENV, or point PYTHON at a virtual environment's python"
        fi
        log "python: $PY (from PYTHON)"
        return 0
    fi
    if [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
        PY="$VIRTUAL_ENV/bin/python"
        log "python: $PY (the active virtual environment)"
        return 0
    fi
    local made=""
    if ! venv_usable "$PROJECT_VENV"; then
        make_venv "$PROJECT_VENV"
        made="created; "
    fi
    # Activated for what this script runs (typecheck.sh, pytest, the demo's
    # processes, the `outboxkit` command); `. $PROJECT_VENV/bin/activate` does
    # the same in a shell.
    export VIRTUAL_ENV="$PROJECT_VENV"
    export PATH="$PROJECT_VENV/bin:$PATH"
    PY="$PROJECT_VENV/bin/python"
    log "python: $PY (${made}the project's virtual environment; in a shell: . ${PROJECT_VENV/#$PWD\//}/bin/activate)"
}

# install_package SPEC: `pip install -e SPEC` (`.` or `.[dev]`) into $PY, skipped
# when this checkout's package is already installed there from the same
# pyproject.toml: a stamp in the environment (outboxkit-install.stamp under its
# sys.prefix) records the pyproject.toml hash, checkout and extras of the last
# install; the package must also still import from this checkout.
# pip's output goes to $STATE_DIR/pip.log (its tail shown when it fails).
install_package() {
    local spec="$1" prefix stamp key
    prefix="$("$PY" -c 'import sys; print(sys.prefix)')" || die "$PY does not run"
    stamp="$prefix/outboxkit-install.stamp"
    key="$(sha256sum "$REPO_ROOT_DIR/pyproject.toml" | cut -d' ' -f1) $REPO_ROOT_DIR"
    if installed_from_here "$stamp" "$key" "$spec"; then
        log "outboxkit $spec already installed in $prefix (pyproject.toml unchanged)"
        return 0
    fi
    log "installing outboxkit $spec into $prefix (pip log: $STATE_DIR/pip.log)"
    mkdir -p "$STATE_DIR"
    # The mysqlclient extra (also in dev) builds the C driver from source: it
    # needs the MariaDB client headers and pkg-config (and a compiler, which
    # the Python build already needs).
    if [[ "$spec" == *mysqlclient* || "$spec" == *dev* ]]; then
        ensure_packages libmariadb-dev pkg-config gcc
    fi
    : >"$STATE_DIR/pip.log"
    (cd "$REPO_ROOT_DIR" && run_logged "$STATE_DIR/pip.log" "$PY" -m pip install -q \
        --disable-pip-version-check -e "$spec") || return 1
    # One line per checkout and extras: an install of other extras keeps this one.
    local line
    {
        if [[ -f "$stamp" ]]; then
            while IFS= read -r line; do
                [[ "$line" == *" $REPO_ROOT_DIR $spec" ]] || printf '%s\n' "$line"
            done <"$stamp"
        fi
        echo "$key $spec"
    } >"$stamp.tmp" && mv "$stamp.tmp" "$stamp" ||
        log "could not write $stamp (the next run installs again)"
}

# installed_from_here STAMP KEY SPEC: the stamp holds KEY for SPEC (for `.`, any
# extras of this checkout do), and outboxkit imports from this checkout.
installed_from_here() {
    local stamp="$1" key="$2" spec="$3"
    [[ -f "$stamp" ]] || return 1
    if [[ "$spec" == . ]]; then
        grep -qF "$key ." "$stamp" || return 1
    else
        grep -qF -x "$key $spec" "$stamp" || return 1
    fi
    # -P: not the current directory (the checkout's own outboxkit/ would be found).
    "$PY" -P -c 'import importlib.util as u, os, sys
spec = u.find_spec("outboxkit")
origin = os.path.realpath(spec.origin) if spec and spec.origin else ""
sys.exit(0 if origin.startswith(os.path.realpath(sys.argv[1]) + os.sep) else 1)' \
        "$REPO_ROOT_DIR" 2>/dev/null
}
