#!/usr/bin/env bash
# The launcher tests/conformance.py gives the ChainerMN conformance kit (as
# its MPIEXEC): the real one ($MNOPT_CONFORMANCE_MPIEXEC) with each rank's
# output in a file of its own, printed when the job ends, one rank after
# the other (kept in $MNOPT_CONFORMANCE_LOG too, where set), then the
# summary line of the rank that passed fewest tests.
#
# Why: the kit takes a module's result from the last line of the job's
# output, and the ranks' outputs reach it interleaved in whatever pieces
# the pipes carried, mid-line too.  Under load the last line was once in
# a few dozen runs an empty piece of one rank's summary, and a module that
# had passed counted as hung.
#
# Only MPICH's launcher (hydra) can write a file per rank this way; any
# other launcher runs as it is.
set -u
real=${MNOPT_CONFORMANCE_MPIEXEC:?the real mpiexec}
case $("$real" --version 2>&1) in
    *HYDRA*) ;;
    *) exec "$real" "$@" ;;
esac
# The job's ranks: from -n, as the kit launches (else those that wrote).
ranks=
[ "${1:-}" = -n ] && ranks=${2:-}
dir=$(mktemp -d) || exit 1

report() {
    local rank file last passed fewest='' summary='' count=$ranks
    if [ -z "$count" ]; then
        count=$(ls "$dir" | sed -n 's/^[a-z]*\.\([0-9][0-9]*\)$/\1/p' \
            | sort -n | tail -n 1)
        count=$(( ${count:--1} + 1 ))
    fi
    for (( rank = 0; rank < count; rank++ )); do
        for file in "$dir/out.$rank" "$dir/err.$rank"; do
            # A line a rank left unfinished ends here, not in the next.
            [ -s "$file" ] && sed '$a\' "$file"
        done | tee -a "${MNOPT_CONFORMANCE_LOG:-/dev/null}"
        last=$(tail -n 1 "$dir/out.$rank" 2>/dev/null)
        passed=$(grep -o '[0-9]* passed' <<<"$last" | cut -d' ' -f1)
        passed=${passed:-0}
        [ -n "$last" ] || last="(rank $rank wrote no summary)"
        if [ -z "$fewest" ] || [ "$passed" -lt "$fewest" ]; then
            fewest=$passed
            summary=$last
        fi
    done
    printf '%s\n' "$summary"
    rm -rf "$dir"
}
# A job the kit's timeout ends still shows what its ranks wrote: they
# write unbuffered (each to its own file, nothing interleaves).
export PYTHONUNBUFFERED=1
trap report EXIT
trap 'exit 143' TERM
"$real" -outfile-pattern "$dir/out.%r" -errfile-pattern "$dir/err.%r" "$@"
