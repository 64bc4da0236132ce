#!/bin/sh
# mpirun -n N tests/tools/fake_hosts.sh CMD...: run CMD with MINIPAR_HOST naming this rank's
# "host": ranks 0..K-1 on host h0, K..2K-1 on h1, ... (K = MINIPAR_RANKS_PER_HOST, default 2).
# Ranks on one machine then count bytes to other "hosts" as inter-host (docs/design.md §5).
k=${MINIPAR_RANKS_PER_HOST:-2}
MINIPAR_HOST="h$(( ${PMI_RANK:-0} / k ))"
export MINIPAR_HOST
exec "$@"
