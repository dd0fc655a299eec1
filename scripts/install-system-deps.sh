#!/usr/bin/env bash
# Installs the system packages that the test suite needs and pip cannot provide.
# Idempotent: packages already present are left alone, so CI can call it on every run.
#
#   openssh-server  real sshd on loopback for the SSH transport tests (tests/agent/test_agent_ssh.py)
#   docker-compose  validates docker-compose.yml offline (no engine needed)
#   chromium        headless browser for the dashboard tests (driven by Playwright, never downloaded)
#   prometheus      promtool, which checks the /metrics exposition
#   slurm-wlm munge a real single-node Slurm cluster for the Slurm transport tests
#   tmux            a real terminal for the demo's test (what a newcomer sees in theirs)
set -euo pipefail

packages=(openssh-server docker-compose chromium prometheus slurm-wlm munge tmux)

missing=()
for pkg in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done

if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # --no-install-recommends: sshd alone, without xauth and friends.
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# sshd refuses to start without its privilege-separation directory; /run is a tmpfs on most
# machines, so this has to be recreated after every boot, not only after installation.
mkdir -p /run/sshd
chmod 0755 /run/sshd
