#!/bin/bash
# One torchrun worker of scratchlm, pinned to a NUMA node (docs/cluster.md, "Thread pinning").
#
#   torchrun ... --nproc-per-node R --no-python recipes/slurm/rank.sh serve MODEL --tensor-parallel-size T ...
#
# Local rank i runs on NUMA node i (mod the node count) with its memory there too, and uses
# OMP_NUM_THREADS torch threads (set it to the cores of one NUMA node). Without numactl it runs unpinned.
set -euo pipefail
: "${LOCAL_RANK:?rank.sh runs under torchrun (LOCAL_RANK is not set)}"
PYTHON=${PYTHON:-python}
if command -v numactl >/dev/null 2>&1; then
    NODES=$(numactl --hardware | awk '/^available:/ {print $2}')
    NODE=$(( LOCAL_RANK % NODES ))
    exec numactl --cpunodebind="$NODE" --membind="$NODE" "$PYTHON" -m scratchlm "$@"
fi
echo "rank.sh: numactl not found; local rank $LOCAL_RANK runs unpinned" >&2
exec "$PYTHON" -m scratchlm "$@"
