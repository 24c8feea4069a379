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
dir=$(mktemp -d)

report() {
    local out rank last passed fewest='' summary=''
    for out in $(ls "$dir"/out.* 2>/dev/null | sort -t. -k2 -n); do
        rank=${out##*.}
        cat "$out" "$dir/err.$rank" 2>/dev/null \
            | tee -a "${MNOPT_CONFORMANCE_LOG:-/dev/null}"
        last=$(tail -n 1 "$out")
        passed=$(grep -o '[0-9]* passed' <<<"$last" | cut -d' ' -f1)
        passed=${passed:-0}
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
