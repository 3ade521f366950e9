#!/usr/bin/env bash
# Installs what LUMEN needs from the OS, or says exactly what is missing.
#   etcd-server      the etcd binary (tests and `make demo` start their own members)
#   etcd-client      etcdctl, which tests use to write malformed records into etcd
#   libsystemd-dev   headers for the `systemd` extra (systemd-python), with pkg-config
#   systemd          systemd-analyze, which the unit-file tests run (systemd need not be PID 1)
#   openssl          the etcd and lumend roles make their CAs and certificates with it
#   prometheus       promtool and prometheus: the shipped alert rules are checked with
#                    promtool and evaluated by a real Prometheus (tests/deploy)
#   logrotate        checks the engine-log rotation the lumend role installs (tests/deploy)
#   iproute2         `ip`: the chaos suite's network namespaces, links and black holes
#   nftables         `nft`: the chaos suite's packet loss
set -euo pipefail

missing=()
command -v etcd >/dev/null 2>&1 || [ -n "${LUMEN_ETCD_BIN:-}" ] || missing+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)  # the etcd role's PKI (Ansible tests)
{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || missing+=(prometheus)
command -v logrotate >/dev/null 2>&1 || missing+=(logrotate)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
if ! command -v pkg-config >/dev/null 2>&1; then
    missing+=(pkg-config libsystemd-dev)
elif ! pkg-config --exists libsystemd; then
    missing+=(libsystemd-dev)
fi
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; then
        apt-get update >/dev/null
        apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null
    fi
    # Debian's packages start an etcd on 2379 and a Prometheus on 9090 where systemd runs;
    # the tests start their own on free ports.
    exit 0
fi

cat >&2 <<MSG
LUMEN needs these system packages, which are missing: ${missing[*]}
Install them as root, for example on Debian or Ubuntu:
    apt-get install -y ${missing[*]}
(or point LUMEN_ETCD_BIN at an etcd binary), then run make again.
MSG
exit 1
