#!/bin/bash
# Checks deploy/systemd/*.service with `systemd-analyze verify`: syntax, known options, and that
# ExecStart names an executable. ExecStart is rewritten to stub executables in a temp dir (the
# units point at /usr/bin, where the packages install them). Exit 77 (skip) without systemd-analyze.
set -euo pipefail

units_dir=${1:?usage: systemd_verify_test.sh DEPLOY_SYSTEMD_DIR}
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "SKIP: systemd-analyze not installed (Debian package systemd)"
  exit 77
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin" "$tmp/units"
for bin in poseidon-coordinator poseidon-server poseidon-agent; do
  printf '#!/bin/sh\nexit 0\n' > "$tmp/bin/$bin"
  chmod +x "$tmp/bin/$bin"
done

fail=0
count=0
for unit in "$units_dir"/*.service; do
  name=$(basename "$unit")
  count=$((count + 1))
  if ! grep -q '^ExecStart=/usr/bin/poseidon-' "$unit"; then
    echo "FAIL: $name: ExecStart does not run /usr/bin/poseidon-*"
    fail=1
  fi
  for key in ProtectSystem=strict ProtectHome=yes PrivateTmp=yes NoNewPrivileges=yes \
             Restart=on-failure "EnvironmentFile=/etc/poseidon/"; do
    if ! grep -q "^$key" "$unit"; then
      echo "FAIL: $name: missing $key"
      fail=1
    fi
  done
  sed "s|/usr/bin/|$tmp/bin/|" "$unit" > "$tmp/units/$name"
done
if ! grep -q '^ReadWritePaths=/dev/shm' "$units_dir/poseidon-agent@.service"; then
  echo "FAIL: poseidon-agent@.service: the agent needs ReadWritePaths=/dev/shm"
  fail=1
fi
if [ "$count" -ne 3 ]; then
  echo "FAIL: expected 3 units in $units_dir, found $count"
  fail=1
fi

# verify needs instances of a template; check rank 0 of the agent.
cp "$tmp/units/poseidon-agent@.service" "$tmp/units/poseidon-agent@0.service"
for name in poseidon-coordinator.service poseidon-server.service poseidon-agent@0.service; do
  # Without a running systemd, verify still parses; only lines naming the unit file (unknown
  # keys, bad values, a missing executable) count as failures.
  out=$(cd "$tmp/units" && SYSTEMD_LOG_LEVEL=warning systemd-analyze verify --man=no \
        "$tmp/units/$name" 2>&1) || rc=$? && rc=${rc:-0}
  echo "== systemd-analyze verify $name (rc $rc)"
  [ -n "$out" ] && echo "$out"
  if [ "$rc" -ne 0 ] || echo "$out" | grep -qF "$name"; then
    echo "FAIL: $name"
    fail=1
  fi
  unset rc
done
if [ "$fail" -ne 0 ]; then exit 1; fi
echo "PASS: $count units verified"
