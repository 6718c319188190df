#!/usr/bin/env bash
# Installs everything podmeter's lab and tests need on a fresh Debian 12 machine, idempotently:
# system packages (clang, libbpf, bpftool, etcd, iproute2, nftables, promtool, zsh, the CNI plugins), the bpffs mount, a venv with the package,
# its lab extra and its dev tools, and the BPF object. Safe to run again: each step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v clang >/dev/null || need_apt+=(clang)
[ -f /usr/include/bpf/bpf_helpers.h ] || need_apt+=(libbpf-dev)
command -v bpftool >/dev/null || need_apt+=(bpftool)
command -v etcd >/dev/null || need_apt+=(etcd-server)
command -v openssl >/dev/null || need_apt+=(openssl)  # the etcd TLS tests make their certificates with it
command -v ip >/dev/null || need_apt+=(iproute2)
command -v nft >/dev/null || need_apt+=(nftables)  # the lab and tests induce drops with nft rules
command -v promtool >/dev/null || need_apt+=(prometheus)  # promtool: the tests check the alert rules with it
command -v zsh >/dev/null || need_apt+=(zsh)  # the tests run the zsh completion script in a real zsh
[ -x /usr/lib/cni/bridge ] || need_apt+=(containernetworking-plugins)  # the tests run the bridge CNI plugin
command -v conntrack >/dev/null || need_apt+=(conntrack)  # the Service tests compare podmeter's ctnetlink reader with it
# Real programs in the lab's pods (Services, DNS): a web server and its load generator, a key-value store,
# a DNS server. Installed for their binaries only: none is started as a system service.
command -v nginx >/dev/null || need_apt+=(nginx-light)
command -v wrk >/dev/null || need_apt+=(wrk)
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v dnsmasq >/dev/null || need_apt+=(dnsmasq-base)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "setup: installing ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
    if [[ " ${need_apt[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
      systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true  # only promtool is used
    fi
    if [ -d /run/systemd/system ]; then  # the lab runs its own instances in its pods
      systemctl disable --now nginx redis-server >/dev/null 2>&1 || true
    fi
  else
    echo "setup: not root, cannot install ${need_apt[*]}; eBPF and etcd tests will be skipped" >&2
  fi
fi

if [ "$(id -u)" -eq 0 ] && ! mount | grep -q ' /sys/fs/bpf type bpf'; then
  mount -t bpf bpf /sys/fs/bpf || echo "setup: could not mount bpffs at /sys/fs/bpf" >&2
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.stamp-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e '.[dev,lab]'   # the lab is an extra: make lab and the tests need it
  rm -f .venv/.stamp-*
  touch "$stamp"
fi

if command -v clang >/dev/null; then
  make -s bpf
fi
