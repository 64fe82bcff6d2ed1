#!/usr/bin/env bash
# Install steplens on one host as systemd services (agent, collector, or both). Idempotent: running
# it again upgrades the package and the unit files and never overwrites an existing config.
#
#   install.sh [--agent] [--collector] [--prefix /opt/steplens] [--from PATH_OR_SDIST]
#              [--no-ebpf] [--dry-run]
#
# Steps: venv at PREFIX, pip install steplens, unit files to /etc/systemd/system, example configs to
# /etc/steplens (only if absent), system users named by User= in the units, then daemon-reload and
# enable --now when systemd is PID 1 (otherwise it prints what it would run).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(dirname "$SCRIPT_DIR")"
readonly SCRIPT_DIR REPO_ROOT
readonly UNIT_DIR="${STEPLENS_UNIT_DIR:-/etc/systemd/system}"
readonly CONF_DIR="${STEPLENS_CONF_DIR:-/etc/steplens}"

PREFIX=/opt/steplens
FROM="$REPO_ROOT"
AGENT=0
COLLECTOR=0
NO_EBPF=0
DRY_RUN=0

usage() {
    sed -n '2,10s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
}

die() {
    echo "install.sh: error: $*" >&2
    exit 1
}

step() {
    echo "==> [$1] ${*:2}"
}

# Print a command, then run it unless --dry-run.
run() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    if [[ $DRY_RUN -eq 0 ]]; then
        "$@"
    fi
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --agent) AGENT=1 ;;
        --collector) COLLECTOR=1 ;;
        --no-ebpf) NO_EBPF=1 ;;
        --dry-run) DRY_RUN=1 ;;
        --prefix)
            [[ $# -ge 2 ]] || die "--prefix needs a value"
            PREFIX="$2"
            shift
            ;;
        --from)
            [[ $# -ge 2 ]] || die "--from needs a value"
            FROM="$2"
            shift
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
    shift
done

[[ $AGENT -eq 1 || $COLLECTOR -eq 1 ]] || die "choose --agent, --collector or both"
[[ $NO_EBPF -eq 0 || $AGENT -eq 1 ]] || die "--no-ebpf only applies with --agent"
[[ "$PREFIX" == /* ]] || die "--prefix must be an absolute path: $PREFIX"
[[ -e "$FROM" ]] || die "--from: no such file or directory: $FROM"
FROM="$(cd "$(dirname "$FROM")" && pwd)/$(basename "$FROM")"
if [[ $DRY_RUN -eq 0 && $EUID -ne 0 ]]; then
    die "must run as root (or use --dry-run)"
fi
command -v python3 >/dev/null || die "python3 not found"

units=()
[[ $AGENT -eq 1 ]] && units+=(steplens-agent)
[[ $COLLECTOR -eq 1 ]] && units+=(steplens-collector)

[[ $DRY_RUN -eq 1 ]] && echo "install.sh: dry run, nothing is changed"

# 1. venv. The agent's eBPF sources import bcc, which comes from the distribution (python3-bpfcc),
# not from PyPI, so the agent's venv sees the system site-packages. Re-running venv on an existing
# directory keeps the installed packages.
step venv "python environment at $PREFIX"
venv_args=()
[[ $AGENT -eq 1 ]] && venv_args+=(--system-site-packages)
run python3 -m venv "${venv_args[@]}" "$PREFIX"

# 2. package (a checkout directory, an sdist or a wheel).
step pip "install steplens from $FROM"
run "$PREFIX/bin/pip" install --disable-pip-version-check --upgrade "$FROM"

# Documentation= in the units points here.
run install -d -m 0755 "$PREFIX/share/doc/steplens/systemd"
run install -m 0644 "$SCRIPT_DIR/README.md" "$PREFIX/share/doc/steplens/systemd/README.md"

# 3. unit files (always overwritten: they belong to the package, local changes go in drop-ins).
step units "unit files into $UNIT_DIR"
for unit in "${units[@]}"; do
    run install -m 0644 "$SCRIPT_DIR/$unit.service" "$UNIT_DIR/$unit.service"
done
if [[ $AGENT -eq 1 ]]; then
    dropin_dir="$UNIT_DIR/steplens-agent.service.d"
    if [[ $NO_EBPF -eq 1 ]]; then
        run install -d -m 0755 "$dropin_dir"
        run install -m 0644 "$SCRIPT_DIR/steplens-agent.service.d/no-ebpf.conf" "$dropin_dir/no-ebpf.conf"
    elif [[ -e "$dropin_dir/no-ebpf.conf" ]]; then
        echo "note: $dropin_dir/no-ebpf.conf exists and is kept (eBPF stays off); remove it to enable eBPF"
    fi
fi

# 4. configs: copied from the examples only when absent, never overwritten. The agent's is 0600
# (it runs as root); the collector's 0644 because its DynamicUser must read it, so keep secrets
# out of it (TLS keys go in through LoadCredential=, see README.md).
step config "configs in $CONF_DIR (only if absent)"
run install -d -m 0755 "$CONF_DIR"
for unit in "${units[@]}"; do
    name="${unit#steplens-}"
    src="$SCRIPT_DIR/$name.toml.example"
    dst="$CONF_DIR/$name.toml"
    mode=0600
    [[ $name == collector ]] && mode=0644
    if [[ -e "$dst" ]]; then
        echo "keep $dst (exists)"
    elif [[ ! -e "$src" ]]; then
        [[ $DRY_RUN -eq 1 ]] || die "example config missing: $src"
        echo "warning: example config missing: $src"
        run install -m "$mode" "$src" "$dst"
    else
        run install -m "$mode" "$src" "$dst"
    fi
done

# 5. users: whatever User= the units name (today none: the agent is root with a bounding set,
# the collector a DynamicUser).
step users "system users the units need"
need_user=0
for unit in "${units[@]}"; do
    user="$(sed -n 's/^User=//p' "$SCRIPT_DIR/$unit.service" | tail -n 1)"
    if [[ -z "$user" || "$user" == root ]]; then
        continue
    fi
    need_user=1
    if id -u "$user" >/dev/null 2>&1; then
        echo "user $user exists"
    else
        run useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$user"
    fi
done
[[ $need_user -eq 1 ]] || echo "no users to create (agent: root with a capability bounding set; collector: DynamicUser)"

# 6. systemd. /run/systemd/system exists only when systemd is PID 1 (what sd_booted() checks).
step systemd "daemon-reload and enable --now"
if [[ -d /run/systemd/system ]]; then
    if [[ $DRY_RUN -eq 0 ]] && command -v systemd-analyze >/dev/null; then
        for unit in "${units[@]}"; do
            run systemd-analyze verify "$UNIT_DIR/$unit.service"
        done
    fi
    run systemctl daemon-reload
    for unit in "${units[@]}"; do
        run systemctl enable --now "$unit.service"
    done
else
    echo "systemd is not PID 1 here; on a systemd host this step runs:"
    echo "  systemctl daemon-reload"
    for unit in "${units[@]}"; do
        echo "  systemctl enable --now $unit.service"
    done
fi
echo "done"
