#!/bin/bash
# duet-bench-xfer across two network namespaces (--netns, --net-devices): two throwaway namespaces
# joined by one veth pair, nothing else in them, so the veth is the only way between the sender
# and the receiver. `duet-bench-xfer --quick --transport tcp` must exit 0; the KV bytes it says
# it put must equal what --quick's schedule moves (computed here from the layout: 2 runs of each
# of 1, 4, 16, 64 and 256 MiB of 8064-byte tokens, 100 one-page transfers of 128 tokens x 8064 B,
# 200 of 16 tokens x 576 B); and the veth's own counters, read here through `ip netns exec` (not
# the benchmark's), must have moved by at least that many bytes: sent by the sender's end,
# received by the receiver's. Then the errors: a missing namespace, a missing device, lo across
# namespaces, a veth whose peer is down, and setns as an unprivileged user each exit 2 naming the
# cause.
# Needs root and iproute2: skips (exit 77, a stated reason) without them; CI runs as root.
# Namespaces and links are named dxt<pid>; the trap and the next run's sweep remove them.
# Usage: test_bench_xfer_netns.sh BUILD_DIR
set -u
BIN=$1/bench/duet-bench-xfer
ID=$$
NA=dxt$ID-a NB=dxt$ID-b DA=dxt${ID}a DB=dxt${ID}b
NET=10.216.$((ID % 250))
OUT=$(mktemp /tmp/duet-xfer-netns-XXXXXX)

fail() {
  echo "test_bench_xfer_netns: FAIL: $*" >&2
  [ -s "$OUT" ] && { echo "---- duet-bench-xfer's output" >&2; cat "$OUT" >&2; }
  exit 1
}

# Remove what a run left whose pid is gone (or this run's: $1); deleting a namespace deletes the
# veth end in it, and with it the other end.
sweep() {
  local n p
  for n in $(ip netns list | awk '{print $1}' | grep -E '^dxt[0-9]+-[ab]$'); do
    p=${n#dxt} p=${p%-*}
    if [ "$p" = "${1:-}" ] || ! kill -0 "$p" 2> /dev/null; then ip netns del "$n"; fi
  done
}
cleanup() {
  sweep "$ID"
  rm -f "$OUT"
}

[ "$(id -u)" = 0 ] || {
  echo "test_bench_xfer_netns: SKIP: needs root to create network namespaces (CI runs as root)"
  exit 77
}
ip netns list > /dev/null 2>&1 || {
  echo "test_bench_xfer_netns: SKIP: needs iproute2's ip with netns support"
  exit 77
}
[ -x "$BIN" ] || fail "$BIN missing"
sweep ""
trap cleanup EXIT
ip netns add "$NA" && ip netns add "$NB" &&
  ip -n "$NA" link add "$DA" type veth peer name "$DB" netns "$NB" &&
  ip -n "$NA" addr add "$NET.1/24" dev "$DA" && ip -n "$NB" addr add "$NET.2/24" dev "$DB" &&
  ip -n "$NA" link set "$DA" up && ip -n "$NB" link set "$DB" up ||
  fail "could not create the namespaces"
for _ in $(seq 50); do # a veth's carrier comes a moment after both ends are up
  [ "$(ip netns exec "$NA" cat "/sys/class/net/$DA/operstate")" = up ] &&
    [ "$(ip netns exec "$NB" cat "/sys/class/net/$DB/operstate")" = up ] && break
  sleep 0.1
done

# counter NS DEV rx|tx: the veth end's byte counter, from inside its namespace
counter() { ip netns exec "$1" cat "/sys/class/net/$2/statistics/$3_bytes"; }

tx0=$(counter "$NA" "$DA" tx) rx0=$(counter "$NB" "$DB" rx)
timeout 60 "$BIN" --quick --transport tcp --netns "$NA,$NB" --net-devices "$DA,$DB" > "$OUT" 2>&1
rc=$?
[ $rc = 0 ] || fail "duet-bench-xfer exited $rc"
tx1=$(counter "$NA" "$DA" tx) rx1=$(counter "$NB" "$DB" rx)

# what --quick moves: the bandwidth sizes twice (whole tokens of 7 x 1152 B), then the two
# one-page latency runs
want=0
for mib in 1 4 16 64 256; do want=$((want + 2 * (mib * 1048576 / 8064) * 8064)); done
want=$((want + 100 * 128 * 8064 + 200 * 16 * 576))
put=$(sed -n 's/^kv bytes put: \([0-9]*\)$/\1/p' "$OUT")
[ "$put" = "$want" ] || fail "kv bytes put '$put', --quick's schedule moves $want"
grep -q "^tcp (UCX_TLS=tcp,self; sender: $DA in netns $NA, receiver: $DB in netns $NB)$" "$OUT" ||
  fail "the heading does not name both namespaces and devices"
[ $((tx1 - tx0)) -ge "$put" ] || fail "$DA sent $((tx1 - tx0)) bytes, fewer than the $put put"
[ $((rx1 - rx0)) -ge "$put" ] || fail "$DB received $((rx1 - rx0)) bytes, fewer than the $put put"
# the benchmark's own counters agree in kind (read inside each side's namespace)
stx=$(sed -n "s/^sender dev $DA: tx_bytes +\([0-9]*\) .*/\1/p" "$OUT")
rrx=$(sed -n "s/^receiver dev $DB: rx_bytes +\([0-9]*\) .*/\1/p" "$OUT")
[ -n "$stx" ] && [ "$stx" -ge "$put" ] || fail "the sender's printed tx_bytes '$stx' < $put"
[ -n "$rrx" ] && [ "$rrx" -ge "$put" ] || fail "the receiver's printed rx_bytes '$rrx' < $put"
echo "test_bench_xfer_netns: $put KV bytes put; $DA sent $((tx1 - tx0)), $DB received $((rx1 - rx0))"

# expect_error WHAT ARGS...: exit 2 and a stderr line containing WHAT, within 20 s
expect_error() {
  local what=$1
  shift
  timeout 20 "$@" > "$OUT" 2>&1
  local rc=$?
  [ $rc = 2 ] || fail "$* exited $rc, not 2"
  grep -qF -- "$what" "$OUT" || fail "$* did not say \"$what\""
  echo "test_bench_xfer_netns: exit 2, \"$what\""
}
expect_error "sender: no network namespace 'nosuch$ID'" \
  "$BIN" --transport tcp --netns "nosuch$ID,$NB" --net-devices "$DA,$DB"
expect_error "receiver: no network device 'nodev' in network namespace '$NB'" \
  "$BIN" --transport tcp --netns "$NA,$NB" --net-devices "$DA,nodev"
expect_error "lo cannot reach the other" "$BIN" --transport tcp --netns "$NA,$NB"
ip -n "$NB" link set "$DB" down || fail "could not set $DB down"
expect_error "sender: network device '$DA' in network namespace '$NA' is without a carrier" \
  "$BIN" --transport tcp --netns "$NA,$NB" --net-devices "$DA,$DB"
if command -v setpriv > /dev/null; then
  expect_error "needs root" setpriv --reuid 65534 --regid 65534 --clear-groups \
    "$BIN" --transport tcp --netns "$NA,$NB" --net-devices "$DA,$DB"
else
  fail "setpriv (util-linux) is missing: cannot check the unprivileged case"
fi
echo "test_bench_xfer_netns: PASS"
