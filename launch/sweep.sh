#!/bin/bash
# A grid of crm-train runs as plain sbatch jobs: one launch/train.sbatch job per grid point, so each
# point has its own job id, run dir (outputs/<job id>), wandb run and requeue, exactly like a single
# run. (The other way, Hydra's multirun over submitit, is `crm-train -m hydra/launcher=slurm ...`.)
#
#   launch/sweep.sh loss=cls,ranking noise=none,add,remove name=ablation [more overrides] [--sbatch-option ...]
#   DRY_RUN=1 launch/sweep.sh ...       # print the sbatch commands, submit nothing
#
# key=a,b,c is a sweep dimension (explicit values only); key=value is the same for every point;
# arguments starting with `--` go to sbatch (e.g. --nodes=1 --time=12:00:00). Values holding
# brackets or quotes (lists such as data.test_files=[a,b]) are never split. With name=X, each point
# is named X-<its values>. Prints one line per point: the job id, then the point's overrides.
set -euo pipefail

SCRIPT=$(dirname "$0")/train.sbatch
SBATCH_OPTS=()
FIXED=()
DIMS=()
BASE_NAME=""
for arg in "$@"; do
  if [[ $arg == --* ]]; then
    SBATCH_OPTS+=("$arg")
  elif [[ $arg =~ ^name=(.*)$ ]]; then
    BASE_NAME=${BASH_REMATCH[1]}
  elif [[ $arg == *=*,* && ${arg#*=} != *[\[\]\(\)\{\}\"\']* ]]; then
    DIMS+=("$arg")
  else
    FIXED+=("$arg")
  fi
done
if [[ ${#DIMS[@]} -eq 0 ]]; then
  echo "sweep.sh: no sweep dimension (key=a,b,...); for one run use sbatch $SCRIPT" >&2
  exit 2
fi

# The cartesian product; a point is its overrides, one per line.
points=("")
for dim in "${DIMS[@]}"; do
  key=${dim%%=*}
  IFS=, read -r -a values <<< "${dim#*=}"
  next=()
  for point in "${points[@]}"; do
    for value in "${values[@]}"; do
      next+=("${point:+$point$'\n'}$key=$value")
    done
  done
  points=("${next[@]}")
done

for point in "${points[@]}"; do
  mapfile -t overrides <<< "$point"
  if [[ -n $BASE_NAME ]]; then
    label=$BASE_NAME
    for o in "${overrides[@]}"; do label+="-${o#*=}"; done
    overrides+=("name=$label")
  fi
  command=(sbatch --parsable "${SBATCH_OPTS[@]}" "$SCRIPT" "${FIXED[@]}" "${overrides[@]}")
  if [[ -n ${DRY_RUN:-} ]]; then
    printf '%q ' "${command[@]}"
    echo
  else
    job=$("${command[@]}")
    printf '%s\t%s\n' "${job%%;*}" "${FIXED[*]} ${overrides[*]}"
  fi
done
