#!/bin/sh
# Joins the run whose owner wrote /shared/owner.json (docker/compose.yaml) with its join string;
# extra arguments go to `peer start`.
set -eu
info=/shared/owner.json
i=0
until [ -s "$info" ]; do
    i=$((i + 1))
    if [ "$i" -gt 300 ]; then echo "error: the owner wrote no $info within 300 s" >&2; exit 1; fi
    sleep 1
done
join=$(python -c 'import json,sys; print(json.load(open(sys.argv[1]))["join"])' "$info")
exec peer start --join "$join" "$@"
